import threading

import pytest
import torch

from rnnt.decoding import MODES, GreedyDecoder, decode_reference, hypotheses_to_text
from rnnt.model import RNNT
from tests.helpers import tiny_cfg

H = 16


def _model(seed: int = 0, dropout: float = 0.0, pred_layers: int = 2) -> RNNT:
    torch.manual_seed(seed)
    sizes = dict(in_feats=8, enc_n_hid=16, enc_pre_rnn_layers=1, enc_post_rnn_layers=1)
    dropouts = dict(enc_dropout=dropout, pred_dropout=dropout, joint_dropout=dropout)
    cfg = tiny_cfg(pred_n_hid=16, pred_rnn_layers=pred_layers, joint_n_hid=H, **sizes, **dropouts)
    return RNNT(cfg).eval()


def _set_blank_bias(model: RNNT, value: float) -> None:
    with torch.no_grad():
        model.joint.fc.bias[model.blank_idx] = value


def _encoder_output(seed: int, lens: list[int], frames: int | None = None):
    gen = torch.Generator().manual_seed(seed)
    frames = frames or max(lens)
    f = 2.0 * torch.randn(len(lens), frames, H, generator=gen)
    return f, torch.tensor(lens)


@torch.no_grad()
def _greedy_by_teacher_forcing(model, f, f_lens, max_step, max_utt):
    """Independent oracle: g comes from re-running the prediction network's teacher-forcing
    forward on the whole emitted prefix, instead of carrying an LSTM state step by step."""
    blank = model.blank_idx
    hyps = []
    for b in range(f.shape[0]):
        hyp: list[int] = []
        for t in range(int(f_lens[b])):
            emitted = 0
            while emitted < max_step and len(hyp) < max_utt:
                g = model.predict(torch.tensor([hyp], dtype=torch.long).view(1, -1))[:, -1]
                k = int(model.joint.step(f[b, t : t + 1], g).argmax(-1))
                if k == blank:
                    break
                hyp.append(k)
                emitted += 1
        hyps.append(hyp)
    return hyps


def _decoders(model, max_step, max_utt, batch_size):
    return {
        mode: GreedyDecoder(
            model,
            model.blank_idx,
            max_step,
            max_utt,
            mode=mode,
            batch_size=batch_size,
            unroll_factor=3,
        )
        for mode in MODES
    }


@pytest.mark.parametrize("blank_bias", [0.0, 1.0, 2.0])
def test_every_mode_matches_reference_on_ragged_batches(blank_bias):
    model = _model(seed=1)
    _set_blank_bias(model, blank_bias)
    lens = [11, 3, 0, 7, 1, 11, 5]
    f, f_lens = _encoder_output(2, lens, frames=13)  # padding frames past every length
    max_step, max_utt = 3, 20
    ref = decode_reference(model, f, f_lens, model.blank_idx, max_step, max_utt)
    assert ref == _greedy_by_teacher_forcing(model, f, f_lens, max_step, max_utt)
    assert ref[2] == []  # zero-length row
    emitted = sum(map(len, ref))
    assert 0 < emitted < max_utt * len(lens)  # a mix of blanks and symbols, limits not all hit
    for mode, decoder in _decoders(model, max_step, max_utt, batch_size=9).items():
        assert decoder.decode(f, f_lens) == ref, mode


def test_symbol_limits_are_enforced_exactly():
    model = _model(seed=3)
    _set_blank_bias(model, -1e4)  # blank never wins: both limits bind
    lens = [1, 4, 9, 30, 0]
    f, f_lens = _encoder_output(4, lens)
    max_step, max_utt = 5, 40
    expected = [min(max_step * n, max_utt) for n in lens]  # 5, 20, 40, 40, 0
    ref = decode_reference(model, f, f_lens, model.blank_idx, max_step, max_utt)
    assert [len(h) for h in ref] == expected
    assert ref == _greedy_by_teacher_forcing(model, f, f_lens, max_step, max_utt)
    for mode, decoder in _decoders(model, max_step, max_utt, batch_size=5).items():
        assert decoder.decode(f, f_lens) == ref, mode


def test_argmax_ties_resolve_to_the_lowest_index():
    model = _model(seed=5)
    with torch.no_grad():
        model.joint.fc.weight.zero_()
        model.joint.fc.bias.fill_(1.0)  # every non-blank class ties
        model.joint.fc.bias[model.blank_idx] = 0.0
    f, f_lens = _encoder_output(6, [2, 6])
    for mode, decoder in _decoders(model, 4, 10, batch_size=2).items():
        assert decoder.decode(f, f_lens) == [[0] * 8, [0] * 10], mode


def test_call_encodes_then_decodes():
    model = _model(seed=7)
    _set_blank_bias(model, 1.0)
    gen = torch.Generator().manual_seed(8)
    feat_lens = torch.tensor([17, 9, 4])
    feats = torch.randn(17, 3, 8, generator=gen)
    f, f_lens = model.encode(feats, feat_lens)
    assert f_lens.tolist() == [9, 5, 2]
    ref = decode_reference(model, f.detach(), f_lens, model.blank_idx, 30, 300)
    for mode, decoder in _decoders(model, 30, 300, batch_size=4).items():
        assert decoder(feats, feat_lens) == ref, mode


@pytest.mark.filterwarnings("ignore:dropout option adds dropout")
def test_dropout_is_off_while_decoding_and_train_mode_is_restored():
    model = _model(seed=9, dropout=0.5)
    _set_blank_bias(model, 1.0)
    f, f_lens = _encoder_output(10, [8, 5, 8])
    expected = decode_reference(model, f, f_lens, model.blank_idx, 30, 300)
    model.train()
    decoder = GreedyDecoder(model, model.blank_idx, 30, 300, mode="no_cg")
    assert decoder.decode(f, f_lens) == expected
    assert decoder.decode(f, f_lens) == expected
    assert model.training


def test_graphed_modes_reuse_and_regrow_static_buffers():
    """Batches of different sizes and lengths through one decoder: padding rows, a shorter batch
    reusing the buffers, a longer one re-sizing them, and the steps run after completion."""
    model = _model(seed=11, pred_layers=1)
    _set_blank_bias(model, 1.0)
    batches = [
        _encoder_output(12, [5, 2, 4]),
        _encoder_output(13, [3, 1]),
        _encoder_output(14, [70, 6, 33, 2]),  # longer than the first capacity (64 frames)
        _encoder_output(15, [4]),
    ]
    refs = [decode_reference(model, f, n, model.blank_idx, 2, 50) for f, n in batches]
    for mode in ("cg", "cg_unroll_pipeline"):
        decoder = GreedyDecoder(
            model, model.blank_idx, 2, 50, mode=mode, batch_size=4, unroll_factor=4
        )
        assert [decoder.decode(f, n) for f, n in batches] == refs, mode
        assert decoder._static.f.shape[:2] == (4, 128)


def test_bad_arguments_are_clear_errors():
    model = _model()
    with pytest.raises(ValueError, match="mode must be one of"):
        GreedyDecoder(model, model.blank_idx, mode="graph")
    with pytest.raises(ValueError, match="max_symbols_per_step must be >= 1"):
        GreedyDecoder(model, model.blank_idx, max_symbols_per_step=0)
    with pytest.raises(ValueError, match="needs a batch_size"):
        GreedyDecoder(model, model.blank_idx, mode="cg")
    f, f_lens = _encoder_output(0, [3, 2, 1])
    with pytest.raises(ValueError, match="exceeds eval.batch_size = 2"):
        GreedyDecoder(model, model.blank_idx, mode="cg", batch_size=2).decode(f, f_lens)
    with pytest.raises(ValueError, match=r"f_lens\[1\] = 9 exceeds T = 3"):
        GreedyDecoder(model, model.blank_idx).decode(f, torch.tensor([3, 9, 1]))
    with pytest.raises(ValueError, match="f_lens must be"):
        GreedyDecoder(model, model.blank_idx).decode(f, torch.tensor([3, 2]))


def test_hypotheses_to_text_uses_the_tokenizer(tmp_path):
    from rnnt.data.tokenizer import Tokenizer, train_tokenizer

    texts = ["the cat sat on the mat", "a dog ran to the cat", "tea and toast"] * 20
    tok = Tokenizer(train_tokenizer(texts, tmp_path / "sp", vocab_size=20))
    hyps = [tok.encode("the cat sat"), [], tok.encode("a dog")]
    assert hypotheses_to_text(hyps, tok) == ["the cat sat", "", "a dog"]


# ---------------------------------------------------------------------------------------------
# CUDA graphs


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_cuda_graph_modes_match_no_cg_and_reference(dtype):
    model = _model(seed=21).cuda().to(dtype)
    _set_blank_bias(model, 1.0)
    batches = [_encoder_output(s, lens) for s, lens in [(22, [9, 3, 0, 7]), (23, [40, 2])]]
    batches = [(f.cuda().to(dtype), n.cuda()) for f, n in batches]
    decoders = _decoders(model, 3, 30, batch_size=4)
    for f, f_lens in batches:
        expected = decoders["no_cg"].decode(f, f_lens)
        if dtype == torch.float32:
            assert expected == decode_reference(model, f, f_lens, model.blank_idx, 3, 30)
        for mode in ("cg", "cg_unroll_pipeline"):
            decoders[mode].decode(f, f_lens)  # the first call captures
            torch.cuda.set_sync_debug_mode("error")
            try:
                out = decoders[mode].decode(f, f_lens)
            finally:
                torch.cuda.set_sync_debug_mode(0)
            assert out == expected, mode


@pytest.mark.gpu
def test_graphs_are_captured_while_a_loader_thread_pins_host_memory():
    """The trainer's loaders keep pinning the next batches in their own threads while the
    first evaluation captures the decoder's graphs; a capture that any thread's host
    allocation could invalidate crashed a convergence run there."""
    model = _model(seed=41).cuda()
    _set_blank_bias(model, 1.0)
    f, f_lens = (t.cuda() for t in _encoder_output(42, [30, 7, 19]))
    expected = decode_reference(model, f, f_lens, model.blank_idx, 3, 30)
    stop, started, failures = threading.Event(), threading.Event(), []

    def pin_like_a_loader() -> None:
        held = []  # kept alive, so each pin is a fresh cudaHostAlloc
        try:
            while not stop.is_set() and len(held) < 4000:
                held.append(torch.empty(1 << 16).pin_memory())
                started.set()
        except Exception as err:  # handed to the test thread
            failures.append(err)
        started.set()

    pinner = threading.Thread(target=pin_like_a_loader)
    pinner.start()
    try:
        started.wait(timeout=30)
        outs = []
        for _ in range(4):  # each new decoder captures on its first batch
            for mode in ("cg", "cg_unroll_pipeline"):
                decoder = GreedyDecoder(model, model.blank_idx, 3, 30, mode=mode, batch_size=3)
                outs.append(decoder.decode(f, f_lens))
    finally:
        stop.set()
        pinner.join()
    assert not failures
    assert all(out == expected for out in outs)


@pytest.mark.gpu
def test_cuda_graphs_see_weights_copied_in_place():
    model = _model(seed=31).cuda()
    _set_blank_bias(model, 1.0)
    other = _model(seed=32).cuda()
    _set_blank_bias(other, 1.0)
    f, f_lens = (t.cuda() for t in _encoder_output(33, [12, 5, 9]))
    decoder = GreedyDecoder(model, model.blank_idx, 3, 30, mode="cg_unroll_pipeline", batch_size=3)
    assert decoder.decode(f, f_lens) == decode_reference(model, f, f_lens, model.blank_idx, 3, 30)
    graph = decoder._graph
    with torch.no_grad():
        for p, q in zip(model.parameters(), other.parameters()):
            p.copy_(q)
    assert decoder.decode(f, f_lens) == decode_reference(other, f, f_lens, other.blank_idx, 3, 30)
    assert decoder._graph is graph  # no re-capture


def test_decode_benchmark_cpu_smoke(repo_root, lengths_dir, tmp_path):
    import json
    import runpy

    bench = runpy.run_path(str(repo_root / "bench" / "decode.py"), run_name="bench_decode")
    out = tmp_path / "bench.json"
    argv = [str(repo_root / "configs" / "tiny.yaml"), "--device", "cpu", "--limit", "6"]
    argv += ["--batch-sizes", "4", "1", "--repeats", "1", "--reference-sample", "2"]
    argv += ["--train-steps", "5", "--json", str(out)]
    argv += ["--lengths", str(lengths_dir / "librispeech_dev-clean_lengths.tsv")]
    assert bench["main"](argv) == 0
    result = json.loads(out.read_text())
    assert result["utterances"] == 6 and result["modes_identical"] == {"4": True, "1": True}
    # batched as the evaluation batches (longest first); compared per utterance across sizes
    assert result["batch_sizes_agree"]
    # the padding of longest-first batches of 4 and 2, from the encoder frames themselves
    durations, _ = bench["read_lengths"](lengths_dir / "librispeech_dev-clean_lengths.tsv")
    cfg = bench["load_config_or_exit"](str(repo_root / "configs" / "tiny.yaml"), [])
    stack = cfg.model.enc_stack_time_factor
    frames = sorted(
        (
            -(-bench["spliced_frames"](d, cfg.features.frame_subsample) // stack)
            for d in durations[:6]
        ),
        reverse=True,
    )
    padded = 4 * frames[0] + 2 * frames[4]
    assert result["encoder_padding"]["4"] == pytest.approx(1 - sum(frames) / padded)
    assert result["encoder_padding"]["1"] == 0.0
    assert [r["mode"] for r in result["rows"]] == [*MODES, *MODES, "reference"]
    assert result["rows"][-1]["matches_batched"]
    assert all(r["utt_per_s"] > 0 for r in result["rows"])
