import subprocess
import sys

import torch

from rnnt.config import ModelConfig, load_config
from rnnt.model import RNNT, StackTime, count_parameters
from tests.helpers import tiny_cfg

BASELINE_PARAMS = 49_071_616


def test_baseline_has_exactly_the_mlperf_parameter_count(repo_root):
    cfg = load_config(repo_root / "configs/baseline_v3-1023sp.yaml")
    with torch.device("meta"):  # no need to allocate 49M weights to count them
        model = RNNT(cfg.model)
    assert count_parameters(model) == BASELINE_PARAMS


def test_spec_formula_for_the_parameter_count():
    lstm = lambda i, h: 4 * h * (i + h) + 8 * h  # noqa: E731
    total = (
        lstm(256, 1024)
        + lstm(1024, 1024)
        + lstm(2048, 1024)
        + 2 * lstm(1024, 1024)
        + 1023 * 512
        + 2 * lstm(512, 512)
        + 1024 * 512
        + 512
        + 512 * 512
        + 512
        + 512 * 1024
        + 1024
    )
    assert total == BASELINE_PARAMS


def test_initialization_rules():
    torch.manual_seed(0)
    cfg = tiny_cfg(weights_init_scale=0.5, forget_gate_bias=1.0, hidden_hidden_bias_scale=0.0)
    model = RNNT(cfg)
    lstm = model.encoder.pre_rnn.layers[0]
    h = cfg.enc_n_hid
    for layer in range(cfg.enc_pre_rnn_layers):
        b_ih = getattr(lstm, f"bias_ih_l{layer}")
        b_hh = getattr(lstm, f"bias_hh_l{layer}")
        assert torch.all(b_ih[h : 2 * h] == 0.5)  # 1.0 * weights_init_scale
        assert torch.all(b_hh[h : 2 * h] == 0.0)
    # PyTorch default LSTM init is U(-1/sqrt(h), 1/sqrt(h)); scaled by 0.5
    w = lstm.weight_hh_l0
    assert w.abs().max() <= 0.5 / h**0.5 + 1e-7
    assert w.abs().max() > 0.4 / h**0.5
    # non-LSTM layers keep PyTorch defaults
    fc = model.joint.fc
    assert fc.weight.abs().max() > 0.8 / cfg.joint_n_hid**0.5


def test_stack_time_shapes_and_lengths():
    x = torch.arange(5 * 2 * 3, dtype=torch.float32).reshape(5, 2, 3)
    out, lens = StackTime(2)(x, torch.tensor([5, 3]))
    assert out.shape == (3, 2, 6)
    assert lens.tolist() == [3, 2]
    torch.testing.assert_close(out[0, 1], torch.cat([x[0, 1], x[1, 1]]))
    torch.testing.assert_close(out[2, 0], torch.cat([x[4, 0], torch.zeros(3)]))


def test_forward_backward_and_shapes_of_the_tiny_config(repo_root):
    cfg = load_config(repo_root / "configs/tiny.yaml").model
    model = RNNT(cfg)
    x = torch.randn(50, 4, cfg.in_feats)
    lens = torch.tensor([50, 41, 10, 3])
    y = torch.randint(0, cfg.n_classes - 1, (4, 6))
    f, f_lens, g = model(x, lens, y)
    assert f.shape == (4, 25, cfg.joint_n_hid) and g.shape == (4, 7, cfg.joint_n_hid)
    assert f_lens.tolist() == [25, 21, 5, 2]
    logits = model.joint(f, g)
    assert logits.shape == (4, 25, 7, cfg.n_classes)
    logits.float().logsumexp(-1).mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_padding_does_not_change_valid_outputs():
    torch.manual_seed(0)
    model = RNNT(tiny_cfg()).eval()
    x = torch.randn(8, 1, 16)
    f_short, _ = model.encode(x, torch.tensor([8]))
    f_long, _ = model.encode(torch.cat([x, torch.randn(6, 1, 16)]), torch.tensor([8]))
    torch.testing.assert_close(f_short, f_long[:, : f_short.shape[1]])


def test_blank_embeds_to_zero_and_step_matches_teacher_forcing():
    torch.manual_seed(0)
    model = RNNT(tiny_cfg()).eval()
    blank = model.blank_idx
    assert torch.all(model.prediction.embed_labels(torch.tensor([blank])) == 0)
    y = torch.tensor([[3, 5, 7]])
    g_full = model.predict(y)
    state, label = None, torch.tensor([blank])
    for u in range(4):
        g_u, state = model.prediction.step(label, state)
        torch.testing.assert_close(g_u, g_full[:, u])
        if u < 3:
            label = y[:, u]


def test_model_cli_prints_parameter_count_last(repo_root):
    proc = subprocess.run(
        [sys.executable, "-m", "rnnt.model", "configs/baseline_v3-1023sp.yaml"],
        capture_output=True,
        text=True,
        cwd=repo_root,
        check=True,
    )
    assert proc.stdout.strip().splitlines()[-1] == f"parameters: {BASELINE_PARAMS}"


def test_encoded_lengths_are_those_of_encode():
    model = RNNT(ModelConfig(enc_n_hid=16, pred_n_hid=16, joint_n_hid=16, n_classes=5))
    lens = torch.tensor([9, 8, 1, 4])
    _, f_lens = model.encode(torch.zeros(9, 4, 256), lens)
    assert model.encoded_lengths(lens).tolist() == f_lens.tolist() == [5, 4, 1, 2]


def test_an_utterance_encodes_the_same_whatever_its_batch_pads():
    """Stack-time completes an odd-length utterance with a zero frame, not with the LSTM's
    output for the batch's padding: alone or beside a longer utterance, the same output."""
    torch.manual_seed(0)
    cfg = tiny_cfg()
    encoder = RNNT(cfg).encoder.eval()
    short = torch.randn(7, 1, cfg.in_feats)
    alone, alone_lens = encoder(short, torch.tensor([7]))
    padded = torch.cat([short, torch.zeros(6, 1, cfg.in_feats)])
    batch = torch.cat([padded, torch.randn(13, 1, cfg.in_feats)], dim=1)
    together, lens = encoder(batch, torch.tensor([7, 13]))
    assert alone_lens.tolist() == [4] and lens.tolist() == [4, 7]
    torch.testing.assert_close(together[0, :4], alone[0], rtol=1e-5, atol=1e-6)


def test_the_wave_encoder_stacks_frames_in_its_kernels_as_stack_time_does(monkeypatch):
    """With the wave kernels the pre-RNN stack writes StackTime's frames itself (no copies between
    the stacks, in training and in scoring): the encoder computes what pre-RNN, StackTime(2),
    post-RNN and the projection compute one after another, gradients included."""
    from rnnt.kernels import lstm_wave

    asked = []
    real = lstm_wave.lstm_stack

    def recorded(*args, stack_pairs=False, **kwargs):
        asked.append(stack_pairs)
        return real(*args, stack_pairs=stack_pairs, **kwargs)

    monkeypatch.setattr(lstm_wave, "lstm_stack", recorded)
    torch.manual_seed(0)
    model = RNNT(tiny_cfg(encoder_lstm="wave", enc_n_hid=32), eval_encoder_lstm="wave").double()
    enc = model.encoder
    t, b = 9, 5
    x = torch.randn(t, b, model.cfg.in_feats, dtype=torch.float64)
    lens = torch.tensor([9, 4, 7, 1, 8])
    for training in (True, False):
        model.train(training)
        torch.manual_seed(1)  # the same dropout seeds for both
        f, f_lens = enc(x, lens)
        weight = torch.randn(f.shape, dtype=torch.float64)
        got = torch.autograd.grad((f * weight).sum(), list(enc.parameters()), allow_unused=True)
        torch.manual_seed(1)
        h, _ = enc.pre_rnn(x, lengths=lens)
        h, want_lens = enc.stack_time(h, lens)
        h, _ = enc.post_rnn(h, lengths=want_lens)
        want = enc.joint_enc(h.transpose(0, 1))
        expected = torch.autograd.grad(
            (want * weight).sum(), list(enc.parameters()), allow_unused=True
        )
        assert torch.equal(f_lens, want_lens)
        assert (f - want).abs().max() < 1e-12
        for g, w in zip(got, expected):
            assert (g - w).abs().max() < 1e-12
    assert asked == [True, False, False, False] * 2
