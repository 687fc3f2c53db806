"""Training CUDA graphs (rnnt/graphs.py).

CPU tests cover everything but the replay: bucket lengths, the O(1) table against brute force,
the frame bound against librosa, padding against F.pad, and the padded-bucket path (pad, run,
slice) against the eager model, values and gradients. GPU tests compare captured graphs with
eager training and check dropout freshness and the absence of host syncs.
"""

import math

import librosa
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from rnnt.config import ConfigError, FeaturesConfig
from rnnt.data.manifest import Utterance
from rnnt.graphs import (
    BucketTable,
    EncoderBucket,
    PredictionBucket,
    SequenceTooLongError,
    TrainingGraphs,
    _EncodeSegment,
    _PredictSegment,
    bucket_lengths,
    longest_transcript,
    max_spliced_frames,
    pad_into,
)
from rnnt.model import RNNT
from tests.helpers import tiny_cfg

NO_DROPOUT = dict(enc_dropout=0.0, pred_dropout=0.0, joint_dropout=0.0)


# ------------------------------------------------------------------------------ buckets


def test_bucket_lengths_follow_l_minus_l_over_n():
    assert bucket_lengths(1000, 4) == [1000, 750, 500, 250]
    assert bucket_lengths(655, 4) == [655, 492, 329, 166]
    assert bucket_lengths(10, 1) == [10]
    assert bucket_lengths(3, 8) == [3]  # L // N == 0: one bucket, not eight copies


@pytest.mark.parametrize("max_len,num_cg", [(0, 4), (10, 0)])
def test_bucket_lengths_reject_bad_arguments(max_len, num_cg):
    with pytest.raises(ValueError):
        bucket_lengths(max_len, num_cg)


@pytest.mark.parametrize("max_len,num_cg", [(655, 4), (125, 8), (7, 3), (1, 1)])
def test_bucket_table_matches_brute_force(max_len, num_cg):
    lengths = bucket_lengths(max_len, num_cg)
    table = BucketTable(lengths, "encoder")
    for n in range(1, max_len + 1):
        smallest = min(length for length in lengths if length >= n)
        assert table.lengths[table(n)] == smallest


def test_bucket_table_rejects_too_long_and_empty_batches():
    table = BucketTable([100, 50], "encoder")
    with pytest.raises(SequenceTooLongError, match="length 101 .* largest CUDA graph \\(100\\)"):
        table(101)
    with pytest.raises(ValueError, match="empty"):
        table(0)


@pytest.mark.parametrize("duration", [16.7, 3.21, 0.5])
def test_max_spliced_frames_bounds_librosa_frames_after_slowest_speed(duration):
    feats = FeaturesConfig()
    sr = feats.sample_rate
    hop = round(feats.window_stride * sr)
    audio = np.zeros(round(duration * sr), dtype=np.float32)
    # speed 0.85 by resampling, as the pipeline does: the audio gets 1/0.85 times longer
    slow = librosa.resample(audio, orig_sr=sr, target_sr=sr / feats.speed_perturbation_min)
    frames = librosa.stft(slow, n_fft=feats.n_fft, hop_length=hop, center=True).shape[1]
    spliced = math.ceil(frames / feats.frame_subsample)
    bound = max_spliced_frames(duration, feats)
    assert spliced <= bound <= spliced + 1


def test_max_spliced_frames_baseline_value():
    # 16.7 s / 0.85 = 19.647 s -> 314,353 samples + 160 -> 1,966 frames -> 656 spliced
    assert max_spliced_frames(16.7, FeaturesConfig()) == 656


def test_longest_transcript_uses_manifest_tokens_and_names_untokenized_utterances():
    utts = [
        Utterance("a", "a.flac", 1.0, "x y", [3, 4]),
        Utterance("b", "b.flac", 2.0, "x y z", [3, 4, 5, 6, 7]),
    ]
    assert longest_transcript(utts) == 5
    utts.append(Utterance("c-1", "c.flac", 1.0, "x"))
    with pytest.raises(ConfigError, match="c-1"):
        longest_transcript(utts)


# ------------------------------------------------------------------------------ padding


def test_pad_into_matches_f_pad():
    torch.manual_seed(0)
    x = torch.randn(3, 2, 5)
    static = torch.randn(6, 4, 5)
    pad_into(static, x, 7.0)
    assert torch.equal(static, F.pad(x, (0, 0, 0, 2, 0, 3), value=7.0))
    y = torch.randint(0, 9, (2, 3))
    static_y = torch.full((4, 6), -5)
    pad_into(static_y, y, 11)
    assert torch.equal(static_y, F.pad(y, (0, 3, 0, 2), value=11))
    with pytest.raises(ValueError, match="cannot pad"):
        pad_into(torch.zeros(2, 2), torch.zeros(3, 2), 0)


@pytest.mark.parametrize("lstm", ["cudnn", "wave"])
def test_encoder_buckets_give_eager_values_and_gradients(lstm):
    """Pad into a longer, wider bucket, run, slice: the eager model's f, f_lens and weight
    gradients, for odd and even lengths (the stack-time tail) and a partial batch."""
    torch.manual_seed(0)
    cfg = tiny_cfg(encoder_lstm=lstm, enc_n_hid=32, **NO_DROPOUT)
    model = RNNT(cfg).double()
    cap_b, feats = 4, model.cfg.in_feats
    buckets = []
    for n in (9, 14):
        bucket = EncoderBucket(n, cap_b, feats, 2, torch.float64, "cpu")
        bucket.fn = _EncodeSegment(model.encoder)
        buckets.append(bucket)
    table = BucketTable([9, 14], "encoder")
    for t, b in [(9, 4), (7, 3), (10, 4), (14, 2), (1, 1)]:
        x = torch.randn(t, b, feats, dtype=torch.float64)
        lens = torch.randint(1, t + 1, (b,))
        lens[0] = t
        weight = torch.randn(b, -(-t // 2), model.cfg.joint_n_hid, dtype=torch.float64)

        model.zero_grad(set_to_none=True)
        f_ref, f_lens_ref = model.encode(x, lens)
        (f_ref * weight).sum().backward()
        grads_ref = [p.grad.clone() for p in model.encoder.parameters()]

        model.zero_grad(set_to_none=True)
        f, f_lens = buckets[table(t)](x, lens)
        (f * weight).sum().backward()
        assert f.shape == f_ref.shape
        torch.testing.assert_close(f, f_ref, rtol=1e-10, atol=1e-12)
        assert torch.equal(f_lens, f_lens_ref)
        for p, g_ref in zip(model.encoder.parameters(), grads_ref):
            torch.testing.assert_close(p.grad, g_ref, rtol=1e-9, atol=1e-12)


def test_prediction_buckets_give_eager_values_and_gradients():
    torch.manual_seed(1)
    model = RNNT(tiny_cfg(**NO_DROPOUT)).double()
    blank, cap_b = model.blank_idx, 3
    buckets = []
    for n in (4, 8):
        bucket = PredictionBucket(n, cap_b, blank, "cpu")
        bucket.fn = _PredictSegment(model.prediction)
        buckets.append(bucket)
    table = BucketTable([4, 8], "prediction")
    for u, b in [(4, 3), (3, 2), (5, 3), (8, 1)]:
        y = torch.randint(0, model.cfg.n_classes - 1, (b, u))
        weight = torch.randn(b, u + 1, model.cfg.joint_n_hid, dtype=torch.float64)

        model.zero_grad(set_to_none=True)
        (model.predict(y) * weight).sum().backward()
        grads_ref = [p.grad.clone() for p in model.prediction.parameters()]
        g_ref = model.predict(y)

        model.zero_grad(set_to_none=True)
        g = buckets[table(u)](y)
        (g * weight).sum().backward()
        torch.testing.assert_close(g, g_ref, rtol=1e-10, atol=1e-12)
        for p, gr in zip(model.prediction.parameters(), grads_ref):
            torch.testing.assert_close(p.grad, gr, rtol=1e-9, atol=1e-12)


def test_training_graphs_need_cuda():
    model = RNNT(tiny_cfg())
    with pytest.raises(ConfigError, match="CUDA"):
        TrainingGraphs(model, 2, 10, 5, 2, torch.float32, "cpu")


def test_the_capture_stream_is_set_inside_the_block_and_restored(monkeypatch):
    from rnnt import graphs

    sentinel, before = object(), torch.cuda.graph.default_capture_stream
    with graphs._capture_stream(sentinel):
        assert torch.cuda.graph.default_capture_stream is sentinel
    assert torch.cuda.graph.default_capture_stream is before
    with pytest.raises(KeyError), graphs._capture_stream(sentinel):
        raise KeyError("a failed capture")
    assert torch.cuda.graph.default_capture_stream is before
    monkeypatch.delattr(torch.cuda.graph, "default_capture_stream")
    with (
        pytest.raises(RuntimeError, match="default_capture_stream"),
        graphs._capture_stream(sentinel),
    ):
        pass


def test_the_accumulate_grad_stream_warning_is_turned_off_where_torch_has_it(monkeypatch):
    from rnnt import graphs

    calls = []
    monkeypatch.setattr(
        torch.autograd.graph,
        "set_warn_on_accumulate_grad_stream_mismatch",
        calls.append,
        raising=False,
    )
    graphs._quiet_accumulate_grad_stream_warning()
    assert calls == [False]
    monkeypatch.delattr(torch.autograd.graph, "set_warn_on_accumulate_grad_stream_mismatch")
    graphs._quiet_accumulate_grad_stream_warning()  # an older torch: nothing to turn off


# ------------------------------------------------------------------------------ GPU


def _gpu_model(seed: int = 0, **kw) -> RNNT:
    torch.manual_seed(seed)
    sizes = dict(n_classes=64, in_feats=64, enc_n_hid=128, pred_n_hid=64, joint_n_hid=96)
    return RNNT(tiny_cfg(**{**sizes, **NO_DROPOUT, **kw})).cuda().half().train()


def _batch(model: RNNT, b: int, t: int, u: int, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(t, b, model.cfg.in_feats, device="cuda", generator=gen).half()
    x_lens = torch.randint(1, t + 1, (b,), device="cuda", generator=gen)
    x_lens[0] = t
    y = torch.randint(0, model.cfg.n_classes - 1, (b, u), device="cuda", generator=gen)
    y_lens = torch.randint(1, u + 1, (b,), device="cuda", generator=gen)
    y_lens[0] = u
    x = x.masked_fill((torch.arange(t, device="cuda")[:, None] >= x_lens)[:, :, None], 0.0)
    return x, x_lens, y, y_lens


def _loss_and_grads(model, encode, predict, batch):
    from rnnt.loss import TransducerLoss

    x, x_lens, y, y_lens = batch
    model.zero_grad(set_to_none=True)
    f, f_lens = encode(x, x_lens)
    g = predict(y)
    loss = TransducerLoss("reference", model.blank_idx)(model.joint, f, g, f_lens, y, y_lens)
    (loss * 64.0).backward()
    return loss.detach().float(), f_lens, [p.grad.float().clone() for p in model.parameters()]


def _assert_graphs_match_eager(model, graphs, shapes):
    """For batches of (B, T, U): the graphed loss, lengths and gradients are the eager ones."""
    for i, (b, t, u) in enumerate(shapes):
        batch = _batch(model, b, t, u, seed=i)
        loss_e, lens_e, grads_e = _loss_and_grads(model, model.encode, model.predict, batch)
        loss_g, lens_g, grads_g = _loss_and_grads(model, graphs.encode, graphs.predict, batch)
        torch.testing.assert_close(loss_g, loss_e, rtol=2e-3, atol=1e-3)
        assert torch.equal(lens_g, lens_e)
        for ge, gg in zip(grads_e, grads_g):
            torch.testing.assert_close(gg, ge, rtol=2e-2, atol=2e-2 * ge.abs().max().item())


@pytest.mark.gpu
def test_graphed_training_matches_eager_in_every_bucket():
    model = _gpu_model()
    graphs = TrainingGraphs(model, 6, 80, 20, 4, torch.float16, "cuda")
    assert graphs.feat_buckets == [20, 40, 60, 80] and graphs.token_buckets == [5, 10, 15, 20]
    # one batch per encoder bucket (incl. the longest) and per prediction bucket, a partial one
    shapes = [(6, 80, 20), (6, 57, 11), (6, 33, 6), (6, 20, 1), (4, 41, 15)]
    _assert_graphs_match_eager(model, graphs, shapes)
    x, x_lens, y, _ = _batch(model, 6, 81, 5, seed=9)
    with pytest.raises(SequenceTooLongError):
        graphs.encode(x, x_lens)
    with pytest.raises(SequenceTooLongError):
        graphs.predict(torch.zeros(6, 21, dtype=torch.int64, device="cuda"))
    with pytest.raises(ValueError, match="larger than the 6"):
        graphs.predict(torch.zeros(7, 3, dtype=torch.int64, device="cuda"))


@pytest.mark.gpu
def test_graphs_follow_in_place_weight_updates_and_accumulate_gradients():
    model = _gpu_model(seed=3)
    graphs = TrainingGraphs(model, 4, 40, 10, 2, torch.float16, "cuda")
    batch = _batch(model, 4, 37, 9, seed=3)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.05)  # what the optimizer's in-place copy does
    loss_e, _, grads_e = _loss_and_grads(model, model.encode, model.predict, batch)
    loss_g, _, grads_g = _loss_and_grads(model, graphs.encode, graphs.predict, batch)
    torch.testing.assert_close(loss_g, loss_e, rtol=2e-3, atol=1e-3)
    # two micro-batches through the same buckets: .grad must be the sum, not twice the last
    from rnnt.loss import TransducerLoss

    loss_fn = TransducerLoss("reference", model.blank_idx)
    x, x_lens, y, y_lens = batch
    model.zero_grad(set_to_none=True)
    for scale in (64.0, 32.0):
        f, f_lens = graphs.encode(x, x_lens)
        (loss_fn(model.joint, f, graphs.predict(y), f_lens, y, y_lens) * scale).backward()
    for p, ge, gg in zip(model.parameters(), grads_e, grads_g):
        scale = ge.abs().max().item()
        torch.testing.assert_close(p.grad.float(), gg * 1.5, rtol=1e-2, atol=1e-2 * scale)


@pytest.mark.gpu
def test_dropout_draws_fresh_masks_at_every_replay():
    # nn.Dropout (philox offsets advanced per replay) and cuDNN's internal LSTM dropout (its
    # state buffer advances in place) must both change between replays of one graph
    model = _gpu_model(enc_dropout=0.5, pred_dropout=0.5)
    graphs = TrainingGraphs(model, 4, 16, 8, 1, torch.float16, "cuda")
    x, x_lens, y, _ = _batch(model, 4, 16, 8, seed=0)
    f1 = graphs.encode(x, x_lens)[0].clone()
    f2 = graphs.encode(x, x_lens)[0].clone()
    g1, g2 = graphs.predict(y).clone(), graphs.predict(y).clone()
    assert not torch.equal(f1, f2) and not torch.equal(g1, g2)
    lstm = torch.nn.LSTM(32, 32, num_layers=2, dropout=0.5).cuda().half()
    graphed = torch.cuda.make_graphed_callables(
        lstm, (torch.randn(10, 4, 32, device="cuda").half(),)
    )
    inp = torch.randn(10, 4, 32, device="cuda").half()
    out1, out2 = graphed(inp)[0].clone(), graphed(inp)[0].clone()
    assert not torch.equal(out1, out2)  # the mask between the two cuDNN layers changed


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="the wave LSTM kernels need a Hopper GPU (sm_90)",
)
def test_graphed_wave_encoder_matches_eager_and_draws_fresh_masks():
    model = _gpu_model(enc_n_hid=1024, in_feats=256, encoder_lstm="wave")
    graphs = TrainingGraphs(model, 6, 40, 10, 2, torch.float16, "cuda")
    _assert_graphs_match_eager(model, graphs, [(6, 40, 10), (6, 17, 4), (3, 29, 7)])
    model = _gpu_model(enc_n_hid=1024, in_feats=256, encoder_lstm="wave", enc_dropout=0.5)
    graphs = TrainingGraphs(model, 4, 16, 8, 1, torch.float16, "cuda")
    x, x_lens, _, _ = _batch(model, 4, 16, 8, seed=0)
    f1 = graphs.encode(x, x_lens)[0].clone()
    f2 = graphs.encode(x, x_lens)[0].clone()
    assert not torch.equal(f1, f2)


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="the wave LSTM kernels need a Hopper GPU (sm_90)",
)
def test_side_by_side_networks_give_the_bits_of_serial_ones():
    # the prediction graph on its side stream, its backward beside the wave encoder's at the
    # training batch: a missing wait would let the loss read g, or the optimizer a gradient,
    # before it is written, and a shared cuBLAS workspace would mix the two backwards' split-K
    # sums; two micro-batches accumulate as the trainer's do. The prediction network without
    # dropout: cuDNN's dropout state advances in place, and no seed rewinds it for the rerun.
    from rnnt.loss import TransducerLoss

    model = _gpu_model(
        enc_n_hid=1024, in_feats=256, encoder_lstm="wave", enc_dropout=0.1, pred_dropout=0.0
    )
    graphs = TrainingGraphs(model, 192, 96, 32, 2, torch.float16, "cuda")
    loss_fn = TransducerLoss("reference", model.blank_idx)

    def serial(x, x_lens, y):
        return (*graphs.encode(x, x_lens), graphs.predict(y))

    batches = [_batch(model, 192, 96, 32, seed=1), _batch(model, 192, 45, 13, seed=2)]
    runs = []
    for forward in (serial, graphs):
        torch.manual_seed(7)  # the graphs' dropout draws from the default generator
        model.zero_grad(set_to_none=True)
        losses = []
        for x, x_lens, y, y_lens in batches:
            f, f_lens, g = forward(x, x_lens, y)
            loss = loss_fn(model.joint, f, g, f_lens, y, y_lens)
            (loss * 64.0).backward()
            losses.append(loss.detach().clone())
        runs.append((losses, [p.grad.clone() for p in model.parameters()]))
    (losses_s, grads_s), (losses_p, grads_p) = runs
    assert all(torch.equal(a, b) for a, b in zip(losses_s, losses_p))
    for (name, _), gs, gp in zip(model.named_parameters(), grads_s, grads_p):
        assert torch.equal(gs, gp), name
    assert any(g.abs().sum() > 0 for g in grads_p)
