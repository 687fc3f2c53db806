import math

import pytest
import torch

from rnnt.config import FeaturesConfig, SpecAugmentConfig
from rnnt.data.augment import BatchTransform, FrameSplicing, SpecAugment
from rnnt.data.batch import FeatureBatch


def _batch(lens: list[int], n_mels: int = 80, seed: int = 0, fill: float | None = None):
    """Features with garbage (7.0) past each length, so zeroing is observable."""
    g = torch.Generator().manual_seed(seed)
    t = max(lens)
    x = (
        torch.randn(len(lens), n_mels, t, generator=g)
        if fill is None
        else torch.full((len(lens), n_mels, t), fill)
    )
    for b, n in enumerate(lens):
        x[b, :, n:] = 7.0
    tokens = torch.randint(1, 10, (len(lens), 4), generator=g)
    return FeatureBatch(
        x,
        torch.tensor(lens),
        tokens,
        torch.full((len(lens),), 4),
        [f"u{i}" for i in range(len(lens))],
        ["a"] * len(lens),
    )


def _naive_splice(x: torch.Tensor, stack: int, sub: int) -> torch.Tensor:
    b, f, t = x.shape
    t_out = -(-t // sub)
    out = torch.zeros(b, stack * f, t_out, dtype=x.dtype)
    for u in range(b):
        for i in range(t_out):
            for k in range(stack):
                if sub * i + k < t:
                    out[u, k * f : (k + 1) * f, i] = x[u, :, sub * i + k]
    return out


def _naive_transform_eval(batch: FeatureBatch, cfg: FeaturesConfig, dtype) -> torch.Tensor:
    x = batch.feats.clone()
    for u, n in enumerate(batch.feat_lens.tolist()):
        x[u, :, n:] = 0
    spliced = _naive_splice(x, cfg.frame_stack, cfg.frame_subsample)
    pad = cfg.pad_features_to - spliced.shape[1]
    return torch.nn.functional.pad(spliced, (0, 0, 0, pad)).permute(2, 0, 1).to(dtype)


def _raw_frames(out: torch.Tensor, n_mels: int = 80, stack: int = 3) -> torch.Tensor:
    """Invert splicing (stack = subsample): (T', B, 256) -> (B, n_mels, 3 T')."""
    t_out, b, _ = out.shape
    raw = out[:, :, : stack * n_mels].float().reshape(t_out, b, stack, n_mels)
    return raw.permute(1, 3, 0, 2).reshape(b, n_mels, t_out * stack)


def _runs(flags: list[bool]) -> list[tuple[int, int]]:
    """(start, length) of each run of True."""
    runs, start = [], None
    for i, v in enumerate([*flags, False]):
        if v and start is None:
            start = i
        elif not v and start is not None:
            runs.append((start, i - start))
            start = None
    return runs


@pytest.mark.parametrize("stack,sub", [(3, 3), (2, 3), (4, 2), (1, 1)])
@pytest.mark.parametrize("t", [1, 8, 9, 10])
def test_splicing_matches_naive_loop(stack, sub, t):
    x = torch.randn(2, 5, t)
    out, lens = FrameSplicing(stack, sub)(x, torch.tensor([t, max(1, t - 4)]))
    torch.testing.assert_close(out, _naive_splice(x, stack, sub), rtol=0, atol=0)
    assert lens.tolist() == [math.ceil(t / sub), math.ceil(max(1, t - 4) / sub)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_eval_transform_is_splice_zero_and_pad(dtype):
    cfg = FeaturesConfig()
    batch = _batch([10, 3, 17, 1, 16])
    before = batch.feats.clone()
    out = BatchTransform(cfg, train=False, dtype=dtype)(batch)
    assert out.feats.shape == (6, 5, 256) and out.feats.dtype == dtype
    assert out.feat_lens.tolist() == [4, 1, 6, 1, 6]
    torch.testing.assert_close(out.feats, _naive_transform_eval(batch, cfg, dtype), rtol=0, atol=0)
    assert torch.equal(batch.feats, before)  # the caller's tensor is left alone
    assert out.tokens is batch.tokens and out.utt_ids == batch.utt_ids
    assert len(out) == 5


def _train_out(lens, spec: SpecAugmentConfig, seed: int = 0):
    cfg = FeaturesConfig(spec_augment=spec)
    gen = torch.Generator().manual_seed(seed)
    batch = _batch(lens, fill=1.0)  # sentinel: every valid value is 1, so zeros are masks
    out = BatchTransform(cfg, train=True, dtype=torch.float32, generator=gen)(batch)
    return _raw_frames(out.feats)


def test_spec_augment_masks_within_spec_limits():
    spec = SpecAugmentConfig()  # 2 x [0, 20] bins, 10 x up to 3% of the length
    lens = [1600, 1, 35, 34, 700, 1234, 99, 1671] * 8
    raw = _train_out(lens, spec)
    for u, n in enumerate(lens):
        zero = raw[u] == 0
        assert zero[:, n:].all()  # nothing survives past the length
        valid = zero[:, :n]
        freq = valid.all(dim=1)  # time masks cover < 100% of frames, freq masks < 80 bins
        time = valid.all(dim=0)
        # every zero is explained by a frequency or a time mask
        assert torch.equal(valid, freq[:, None] | time[None, :])
        f_runs = _runs(freq.tolist())
        assert len(f_runs) <= 2 and sum(w for _, w in f_runs) <= 2 * spec.max_freq
        t_max = math.floor(spec.max_time * n)
        t_runs = _runs(time.tolist())
        assert len(t_runs) <= 10 and sum(w for _, w in t_runs) <= 10 * t_max
        assert all(w <= 10 * t_max for _, w in t_runs)


def _single_runs(flags: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """flags (N, L) bool -> runs of True per row, total width, first True (L when none)."""
    runs = flags[:, 0].long() + (flags[:, 1:] & ~flags[:, :-1]).sum(dim=1)
    first = torch.where(flags.any(dim=1), flags.float().argmax(dim=1), flags.shape[1])
    return runs, flags.sum(dim=1), first


def test_single_mask_width_and_position_distributions():
    # SpecAugment alone on sentinel ones: (B, 80, 1) for frequency, (B, 1, 1000) for time
    n, b = 1000, 1500
    aug = SpecAugment(SpecAugmentConfig(freq_masks=1, time_masks=0), torch.Generator())
    out = aug(torch.ones(b, 80, 1), torch.ones(b, dtype=torch.long))
    runs, widths, starts = _single_runs(out[:, :, 0] == 0)
    assert runs.max() <= 1
    counts = torch.bincount(widths, minlength=21)
    assert counts.numel() == 21  # never wider than max_freq
    # uniform over 0..20: 1500/21 = 71 expected per width
    assert counts.min() > 35 and counts.max() < 115
    # positions span the whole band
    masked = widths > 0
    assert starts[masked].min() == 0 and (starts + widths)[masked].max() == 80

    aug = SpecAugment(SpecAugmentConfig(freq_masks=0, time_masks=1), torch.Generator())
    out = aug(torch.ones(b, 1, n), torch.full((b,), n))
    runs, widths, starts = _single_runs(out[:, 0, :] == 0)
    assert runs.max() <= 1
    counts = torch.bincount(widths, minlength=31)
    assert counts.numel() == 31  # adaptive bound floor(0.03 * 1000) = 30
    assert counts.min() > 20 and counts.max() < 80  # 1500/31 = 48 expected
    ends = (starts + widths)[widths > 0]
    assert ends.max() == n and ends.min() < 60


def test_time_mask_width_adapts_to_each_length():
    lens = list(range(1, 400, 3)) * 6
    raw = _train_out(lens, SpecAugmentConfig(freq_masks=0, time_masks=1), seed=3)
    widest = {}
    for u, n in enumerate(lens):
        runs = _runs((raw[u, :, :n] == 0).all(dim=0).tolist())
        w = runs[0][1] if runs else 0
        assert w <= math.floor(0.03 * n)
        widest[n] = max(widest.get(n, 0), w)
    # the bound is reached, not just respected, for long enough utterances
    assert sum(widest[n] == math.floor(0.03 * n) for n in widest if n > 300) >= 5


def test_masks_match_a_per_utterance_loop_from_the_same_draws():
    spec = SpecAugmentConfig(min_freq=2, max_freq=9, min_time=1, max_time=0.2)
    lens = torch.tensor([1, 4, 50, 31, 12])
    aug = SpecAugment(spec, torch.Generator().manual_seed(5))
    f_start, f_width, t_start, t_width = aug.draw(lens, 24)
    aug.generator.manual_seed(5)
    freq, time = aug.masks(lens, 24, 60)
    for u, n in enumerate(lens.tolist()):
        want_f = torch.zeros(24, dtype=torch.bool)
        for s, w in zip(f_start[u].tolist(), f_width[u].tolist()):
            assert spec.min_freq <= w <= spec.max_freq and 0 <= s <= 24 - w
            want_f[s : s + w] = True
        want_t = torch.zeros(60, dtype=torch.bool)
        for s, w in zip(t_start[u].tolist(), t_width[u].tolist()):
            assert min(spec.min_time, n) <= w <= max(spec.min_time, math.floor(0.2 * n))
            assert 0 <= s and s + w <= n
            want_t[s : s + w] = True
        assert torch.equal(freq[u], want_f) and torch.equal(time[u], want_t)


def test_train_transform_is_deterministic_given_the_generator():
    cfg = FeaturesConfig()
    batch = _batch([100, 37, 64])

    def run(seed):
        gen = torch.Generator().manual_seed(seed)
        return BatchTransform(cfg, train=True, dtype=torch.float16, generator=gen)(batch).feats

    assert torch.equal(run(1), run(1))
    assert not torch.equal(run(1), run(2))
    # outside the masks, training features equal the eval transform's
    a, b = run(1), BatchTransform(cfg, train=False, dtype=torch.float16)(batch).feats
    kept = a != 0
    assert torch.equal(a[kept], b[kept]) and kept.sum() > 0.5 * (b != 0).sum()


def test_bad_shapes():
    # the config's own rules (pad_features_to, max_freq) are rnnt.config's: tests/unit/test_config
    with pytest.raises(ValueError, match="n_mels=80"):
        BatchTransform(FeaturesConfig(), train=False, dtype=torch.float32)(_batch([5], n_mels=64))
    with pytest.raises(ValueError, match="frame_stack 0"):
        FrameSplicing(0, 3)


@pytest.mark.gpu
def test_transform_on_gpu_never_syncs_and_matches_cpu():
    cfg = FeaturesConfig()
    lens = [1671, 5, 900, 1234] * 48
    batch = _batch(lens, seed=4).to("cuda")
    torch.cuda.synchronize()
    gen = torch.Generator(device="cuda").manual_seed(0)
    train = BatchTransform(cfg, train=True, dtype=torch.float16, generator=gen)
    evaluate = BatchTransform(cfg, train=False, dtype=torch.float16)
    torch.cuda.set_sync_debug_mode("error")
    try:
        out_train = train(batch)
        out_eval = evaluate(batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    cpu = BatchTransform(cfg, train=False, dtype=torch.float16)(batch.to("cpu"))
    torch.testing.assert_close(out_eval.feats.cpu(), cpu.feats, rtol=0, atol=0)
    assert out_train.feats.device.type == "cuda" and out_train.feats.dtype == torch.float16
    raw = _raw_frames(out_train.feats.cpu())
    for u, n in enumerate(lens):
        assert (raw[u, :, n:] == 0).all()
    assert (out_train.feats == 0).float().mean() > (out_eval.feats == 0).float().mean()


def test_host_lengths_follow_the_batch_to_the_model_input():
    batch = _batch([10, 7, 3])
    batch.host_lens = (batch.feat_lens.clone(), batch.token_lens.clone())  # as loaders set them
    moved = batch.to("cpu")
    assert moved.host_lens is not None and moved.host_lens[0].tolist() == [10, 7, 3]
    transform = BatchTransform(FeaturesConfig(), train=False, dtype=torch.float32)
    mb = transform(moved)
    assert mb.host_lens[0].tolist() == mb.feat_lens.tolist() == [4, 3, 1]  # ceil(T / 3)
    assert mb.host_lens[1].tolist() == mb.token_lens.tolist()
    batch.host_lens = None
    assert transform(batch).host_lens is None  # none given: none made up
