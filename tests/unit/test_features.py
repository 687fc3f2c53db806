"""Torch-native front end against outside oracles: librosa (STFT, mel), scipy (pre-emphasis),
brute-force loops (silence trim, normalization), analytic sinusoids (resampling)."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import librosa
import numpy as np
import pytest
import scipy.signal
import soundfile as sf
import torch

from rnnt.config import FeaturesConfig
from rnnt.data.features import (
    RESAMPLE_LOBES,
    TRIM_WINDOW,
    AudioFileError,
    FeatureExtractor,
    draw_speeds,
    hann_window,
    mel_basis,
    normalize,
    power_spectrum,
    preemphasis,
    read_audio,
    resample,
    trim_silence,
)


def _speechlike(rng: np.random.Generator, n: int, lead: int = 0, trail: int = 0) -> np.ndarray:
    """Harmonics with a syllable envelope between silent margins (float32)."""
    t = np.arange(n) / 16000
    f0 = 120 + 30 * np.sin(2 * np.pi * 3 * t)
    phase = 2 * np.pi * np.cumsum(f0) / 16000
    voiced = sum(np.sin(k * phase) / k for k in range(1, 12))
    envelope = 0.5 + 0.5 * np.sin(2 * np.pi * 4 * t) ** 2
    x = 0.3 * voiced * envelope + 0.01 * rng.standard_normal(n)
    return np.concatenate([np.zeros(lead), x, np.zeros(trail)]).astype(np.float32)


def _pad(rows: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    lens = torch.tensor([len(r) for r in rows])
    out = torch.zeros(len(rows), int(lens.max()))
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.from_numpy(r)
    return out, lens


def _trim_oracle(x: np.ndarray, cutoff_db: float) -> tuple[int, int]:
    """Loop over every window: (begin, end) of the kept region as defined in features.py."""
    n = len(x)
    if n < TRIM_WINDOW:
        return 0, n
    x64 = x.astype(np.float64)
    power = np.array([np.mean(x64[i : i + TRIM_WINDOW] ** 2) for i in range(n - TRIM_WINDOW + 1)])
    loud = np.flatnonzero(power >= power.max() * 10 ** (cutoff_db / 10))
    return int(loud[0]), min(int(loud[-1]) + TRIM_WINDOW, n)


def _librosa_features(x: np.ndarray, cfg: FeaturesConfig) -> np.ndarray:
    """The whole front end (no trim, no dither) from librosa and numpy."""
    y = scipy.signal.lfilter([1.0, -cfg.preemph], [1.0], x.astype(np.float64))
    window = scipy.signal.get_window("hann", 320, fftbins=False)
    spec = librosa.stft(
        y, n_fft=512, hop_length=160, win_length=320, window=window, center=True, pad_mode="reflect"
    )
    mel = librosa.filters.mel(sr=16000, n_fft=512, n_mels=80) @ np.abs(spec) ** 2
    logmel = np.log(np.maximum(mel, cfg.log_floor))
    mean = logmel.mean(axis=1, keepdims=True)
    return (logmel - mean) / np.sqrt(logmel.var(axis=1, keepdims=True) + 1e-5)


@pytest.mark.parametrize(
    "sr,n_fft,n_mels", [(16000, 512, 80), (16000, 512, 64), (22050, 1024, 128)]
)
def test_mel_basis_is_librosa_slaney(sr, n_fft, n_mels):
    cfg = FeaturesConfig(sample_rate=sr, n_fft=n_fft, n_mels=n_mels, pad_features_to=3 * n_mels)
    basis = mel_basis(cfg).numpy()
    assert basis.shape == (n_mels, n_fft // 2 + 1)
    reference = librosa.filters.mel(sr=sr, n_fft=n_fft, n_mels=n_mels)  # htk=False, slaney norm
    # float64 maths, one float32 rounding at the end: within an ulp of librosa's
    np.testing.assert_allclose(basis, reference, rtol=1e-6, atol=1e-8)
    # Slaney area normalization: each triangle integrates to 2 / (upper edge - lower edge) Hz
    assert np.all(basis.sum(axis=1) > 0)


def test_features_match_librosa_pipeline():
    cfg = FeaturesConfig(dither=0.0)
    rng = np.random.default_rng(0)
    # no silent margins: the trim keeps everything, so librosa needs no trim
    x = _speechlike(rng, 16000)
    feats, lens = FeatureExtractor(cfg, train=False)(*_pad([x]))
    expected = _librosa_features(x, cfg)
    assert lens.tolist() == [expected.shape[1]] == [1 + 16000 // 160]
    np.testing.assert_allclose(feats[0].numpy(), expected, atol=1e-3)


def test_trim_matches_window_loop_oracle():
    rng = np.random.default_rng(1)
    rows = [
        _speechlike(rng, 6000, lead=3000, trail=5000),
        _speechlike(rng, 9000, lead=0, trail=2500),
        _speechlike(rng, 1500),  # shorter than the window: kept whole
        _speechlike(rng, 4000, lead=7000, trail=0) * 1e-3,
    ]
    rows[3][:200] += 0.5  # a click far from the speech: stays inside the kept region
    wave, lens = _pad(rows)
    trimmed, new_lens = trim_silence(wave, lens, -60.0)
    for i, x in enumerate(rows):
        begin, end = _trim_oracle(x, -60.0)
        assert new_lens[i] == end - begin
        np.testing.assert_array_equal(trimmed[i, : end - begin].numpy(), x[begin:end])
        assert torch.all(trimmed[i, end - begin :] == 0)
    assert new_lens[0] < len(rows[0]) and new_lens[2] == 1500


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("scan,group", [(None, None), (4, 1)], ids=["default", "scan4_group1"])
def test_trim_kernel_equals_the_reference(device, scan, group, monkeypatch):
    """rnnt.kernels.trim against the float64 cumulative sums of `trim_silence` and the window
    loop: speech between silences, a quiet row with a click, a fade through the cutoff, rows
    shorter than, equal to and just over the window, a silent row, two bursts with whole blocks
    of starts of silence between them, noise in one row's padding (which no window may read),
    and fades right after loud speech. The second pass reads the row's block maxima a scan at a
    time (128, more blocks than these rows have, or 4, so that it takes several scans, as a
    16.7 s utterance sped up does), and the first pass's programs walk four blocks of a row
    (the default: some stop early at the row's end) or one. The CPU case runs Triton's
    interpreter."""
    pytest.importorskip("triton")
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from rnnt.kernels import trim
    from rnnt.kernels.trim import trim_silence_cuda

    if scan is not None:
        monkeypatch.setattr(trim, "LOUD_BLOCK_SCAN", scan)
        monkeypatch.setattr(trim, "LOUDEST_GROUP", group)

    rng = np.random.default_rng(3)
    fade = _speechlike(rng, 12000) * np.logspace(-5, 0, 12000).astype(np.float32)
    rows = [
        _speechlike(rng, 6000, lead=3000, trail=5000),
        _speechlike(rng, 4000, lead=7000, trail=2) * 1e-3,
        np.concatenate([np.zeros(5000, np.float32), fade, np.zeros(3000, np.float32)]),
        _speechlike(rng, 1500),
        _speechlike(rng, TRIM_WINDOW),
        _speechlike(rng, TRIM_WINDOW + 1, lead=0, trail=0),
        np.zeros(9000, np.float32),
        _speechlike(rng, 2 * TRIM_WINDOW + 7, lead=900, trail=1100),
        # two bursts blocks apart: the silence between them is kept, whole blocks of it
        np.concatenate(
            [_speechlike(rng, 700, lead=5000, trail=3 * TRIM_WINDOW), _speechlike(rng, 900)]
        ),
    ]
    rows[1][:200] += 0.5
    # loud speech, then noise fading through the cutoff within the same block of starts:
    # the quiet windows' sums cancel against the loud samples before them (float32 sums
    # move these rows' ends)
    tail_db = np.linspace(-40, -80, 2500)
    for k in range(4):
        tail = rng.standard_normal(2500) * 0.3 * 10 ** (tail_db / 20)
        loud = 3 * _speechlike(rng, 3000 + 173 * k)
        rows.append(np.concatenate([loud, tail]).astype(np.float32))
    wave, lens = _pad(rows)
    wave[5, len(rows[5]) :] = torch.randn(wave.shape[1] - len(rows[5])) * 10
    ref, ref_lens = trim_silence(wave, lens, -60.0, use_kernel=False)
    wave, lens = wave.to(device), lens.to(device)
    got, got_lens = trim_silence_cuda(wave, lens, -60.0, TRIM_WINDOW)
    if device == "cuda":  # the dispatch inside `trim_silence`
        dispatched, dispatched_lens = trim_silence(wave, lens, -60.0)
        assert torch.equal(dispatched, got) and torch.equal(dispatched_lens, got_lens)
    assert got_lens.tolist() == ref_lens.tolist()
    assert torch.equal(got.cpu(), ref)
    for i, x in enumerate(rows):
        begin, end = _trim_oracle(x, -60.0)
        assert got_lens[i] == end - begin
    assert 0 < got_lens[2] < len(rows[2]) - 8000 and got_lens[6] == 9000
    assert got_lens[8] > 3 * TRIM_WINDOW


def _padded_power(wave, lengths, noise, dither, coeff, window, hop, n_fft, begin=None):
    """rnnt.kernels.frames' power in the reference's padded layout: every utterance given the
    batch's 1 + S // hop rows, (B, T, bins)."""
    from rnnt.kernels.frames import frame_power_packed

    batch, t_max = wave.shape[0], wave.shape[1] // hop + 1
    rows = torch.full((batch,), t_max, dtype=torch.int64)
    power, frames, _ = frame_power_packed(
        wave, lengths, noise, dither, coeff, window, hop, n_fft, rows, begin
    )
    return power.view(batch, t_max, -1), frames


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dither,win", [(0.0, 320), (1e-5, 320), (1e-5, 400)])
@pytest.mark.parametrize("in_place", [False, True], ids=["shifted", "in_place"])
def test_framing_kernel_gives_the_references_power_bit_for_bit(device, dither, win, in_place):
    """rnnt.kernels.frames (dither, pre-emphasis, reflect padding, window, FFT, |X|^2) against
    the reference steps of FeatureExtractor: the same float32 power for every real frame, on
    ragged rows down to shorter than half a window, and finite values past them; the baseline's
    20 ms window and a 25 ms one. In place: each row's samples start at its own `begin`, with
    loud noise around them that no frame may read, as the trim leaves an utterance (the noise's
    draws stay at the row's start). The CPU case runs Triton's interpreter."""
    pytest.importorskip("triton")
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    gen = torch.Generator().manual_seed(4)
    hop, n_fft, coeff = 160, 512, 0.97
    lengths = torch.tensor([16000, 15999, 3000, 201, 161, 150, 7, 1])
    width = int(lengths.max()) + 57
    wave = torch.randn(len(lengths), width, generator=gen) * 0.1
    wave *= torch.arange(width)[None] < lengths[:, None]  # zero past each length, as trimmed
    noise = torch.randn(wave.shape, generator=gen) if dither else None
    window = hann_window(win)
    valid = torch.arange(width)[None] < lengths[:, None]
    x = wave + dither * noise * valid if dither else wave
    ref, ref_frames = power_spectrum(preemphasis(x, coeff) * valid, lengths, window, hop, n_fft)
    to = {"device": device}
    stored, begin = wave, None
    if in_place:
        begin = torch.tensor([0, 57, 3000, 10000, 9, 15000, 16000, 5])
        stored = torch.randn(wave.shape, generator=gen) * 30
        for row, (b, n) in enumerate(zip(begin.tolist(), lengths.tolist(), strict=True)):
            stored[row, b : b + n] = wave[row, :n]
        begin = begin.to(**to)
    got, frames = _padded_power(
        stored.to(**to),
        lengths.to(**to),
        noise.to(**to) if dither else None,
        dither,
        coeff,
        window.to(**to),
        hop,
        n_fft,
        begin=begin,
    )
    if device == "cuda":  # the reference's FFT on the GPU, for a like-for-like comparison
        ref, _ = power_spectrum(
            (preemphasis(x.cuda(), coeff) * valid.cuda()), lengths.cuda(), window.cuda(), hop, n_fft
        )
    got, ref = got.cpu(), ref.cpu()
    assert got.shape == ref.shape and torch.equal(frames.cpu(), ref_frames)
    assert torch.isfinite(got).all()
    for row, n in enumerate(ref_frames.tolist()):
        assert torch.equal(got[row, :n], ref[row, :n]), row


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_packed_frames_equal_the_padded_ones(device):
    """frame_power_packed gives each utterance only its `rows`: the power of every real frame
    equals the padded layout's bit for bit, the rows past an utterance's frames are zero, and a
    row count below an utterance's frames cuts its frame count instead of lending it the next
    utterance's rows. The CPU case runs Triton's interpreter."""
    pytest.importorskip("triton")
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from rnnt.kernels.frames import frame_power_packed

    gen = torch.Generator().manual_seed(6)
    hop, n_fft, coeff, dither = 160, 512, 0.97, 1e-5
    lengths = torch.tensor([16000, 3000, 161, 1, 7999])
    width = int(lengths.max()) + 300
    wave = torch.randn(len(lengths), width, generator=gen) * 0.1
    wave *= torch.arange(width)[None] < lengths[:, None]
    noise = torch.randn(wave.shape, generator=gen)
    window = hann_window(400)
    real = lengths // hop + 1
    rows = real + torch.tensor([0, 3, 0, 2, 0])
    rows[4] = real[4] - 2  # too few
    to = {"device": device}
    args = (wave.to(**to), lengths.to(**to), noise.to(**to), dither, coeff, window.to(**to))
    padded, padded_frames = _padded_power(*args, hop, n_fft)
    packed, frames, starts = frame_power_packed(*args, hop, n_fft, rows)
    packed, frames, starts, padded = packed.cpu(), frames.cpu(), starts.cpu(), padded.cpu()
    assert packed.shape == (int(rows.sum()), n_fft // 2 + 1)
    assert torch.equal(starts, torch.cumsum(rows, 0) - rows)
    assert torch.equal(frames, torch.minimum(real, rows))
    assert torch.equal(padded_frames.cpu(), real)
    for row in range(len(lengths)):
        n, start = int(frames[row]), int(starts[row])
        assert torch.equal(packed[start : start + n], padded[row, :n]), row
        assert torch.all(packed[start + n : start + int(rows[row])] == 0), row


def _banded_basis(n_mels: int, bins: int) -> torch.Tensor:
    """A made-up (n_mels, bins) basis of overlapping bands: mels 16-31 all zero (a whole block
    of mels with nothing to sum), the last one on the Nyquist bin."""
    basis = torch.zeros(n_mels, bins)
    for m in range(n_mels):
        lo = min(6 * m, bins - 13)
        basis[m, lo : lo + 13] = torch.linspace(0.1, 1.0, 13) * (m + 1)
    basis[16:32] = 0
    basis[-1, -1] = 2.0
    return basis


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("basis", ["librosa", "banded"])
def test_power_and_mel_kernel_matches_the_matrix_product(device, basis):
    """frame_power_packed with a mel basis (the power squared and projected in one kernel,
    skipping the basis's zero blocks) against its power times the basis, and against a float64
    oracle: the baseline's mel basis, and a made-up one with a block of mels that is zero
    throughout and a filter on the Nyquist bin. The CPU case runs Triton's interpreter."""
    pytest.importorskip("triton")
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from rnnt.kernels.frames import frame_power_packed, mel_tiles

    gen = torch.Generator().manual_seed(10)
    hop, n_fft = 160, 512
    lengths = torch.tensor([9000, 3000, 161, 7999])
    width = int(lengths.max())
    wave = torch.randn(len(lengths), width, generator=gen) * 0.1
    wave *= torch.arange(width)[None] < lengths[:, None]
    rows = lengths // hop + 1 + torch.tensor([0, 2, 0, 5])
    weights = mel_basis(FeaturesConfig()) if basis == "librosa" else _banded_basis(41, 257)
    to = {"device": device}
    args = (wave.to(**to), lengths.to(**to), None, 0.0, 0.97, hann_window(400).to(**to), hop)
    power, frames, starts = frame_power_packed(*args, n_fft, rows)
    got, got_frames, got_starts = frame_power_packed(
        *args, n_fft, rows, mel=mel_tiles(weights, device)
    )
    assert torch.equal(got_frames, frames) and torch.equal(got_starts, starts)
    got, power = got.cpu(), power.cpu()
    assert got.shape == (int(rows.sum()), weights.shape[0])
    oracle = power.double() @ weights.double().T
    ref = power @ weights.T
    scale = oracle.abs().amax(1, keepdim=True).clamp(min=1e-30)  # per frame: sums of products
    assert torch.all((got.double() - oracle).abs() <= 2e-6 * scale)
    assert torch.all((ref.double() - oracle).abs() <= 2e-6 * scale)
    if basis == "banded":
        assert torch.all(got[:, 16:32] == 0) and torch.all(got[:, -1] >= 2 * power[:, -1])


def test_frames_bound_holds_every_resampled_utterance():
    """frames_bound, from the host's lengths, against the frames of `resample`'s own output
    lengths at speeds down to the slowest, where the bound is met exactly, and without speed
    perturbation."""
    from rnnt.data.features import frames_bound, num_frames

    cfg = FeaturesConfig()
    hop = round(cfg.window_stride * cfg.sample_rate)
    lengths = torch.tensor([0, 1, 159, 160, 161, 1599, 4000, 12345, 20000])
    wave = torch.zeros(len(lengths), int(lengths.max()))
    ratio_range = (1.0 / cfg.speed_perturbation_max, 1.0 / cfg.speed_perturbation_min)
    bound = frames_bound(lengths, ratio_range[1], hop)
    gen = torch.Generator().manual_seed(8)
    slowest = torch.full((len(lengths),), cfg.speed_perturbation_min, dtype=torch.float64)
    for speeds in [slowest, draw_speeds(cfg, len(lengths), gen), draw_speeds(cfg, 9, gen)]:
        ratio = 1.0 / speeds
        _, out_lens = resample(wave, lengths, ratio, ratio_range, use_kernel=False)
        assert torch.all(num_frames(out_lens, hop) <= bound)
        # at each utterance's own ratio the bound is its frame count before the trim
        assert torch.equal(frames_bound(lengths, ratio, hop), num_frames(out_lens, hop))
        if speeds is slowest:
            assert torch.equal(num_frames(out_lens, hop), bound)
    assert torch.equal(frames_bound(lengths, 1.0, hop), num_frames(lengths, hop))


@pytest.mark.gpu
def test_batches_of_nearby_lengths_share_one_fft_plan():
    """The framing kernel's FFT runs over a frame count rounded up to FFT_FRAME_BUCKET, so
    batches whose longest rows differ by less than that reuse one cuFFT plan instead of making
    a new one (which holds the training loop's thread) for every batch."""
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from rnnt.kernels.frames import FFT_FRAME_BUCKET

    cache = torch.backends.cuda.cufft_plan_cache[torch.cuda.current_device()]
    cache.clear()
    hop, window = 160, hann_window(320).cuda()
    shapes = set()
    for t_max in range(FFT_FRAME_BUCKET + 1, 2 * FFT_FRAME_BUCKET + 1, 9):
        width = (t_max - 1) * hop
        wave = torch.randn(3, width, device="cuda")
        lengths = torch.tensor([width, width // 2, 5], device="cuda")
        power, _ = _padded_power(wave, lengths, None, 0.0, 0.97, window, hop, 512)
        shapes.add(tuple(power.shape))
    assert len(shapes) == 8 and cache.size == 1


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("bins", [80, 41])
def test_log_normalize_kernel_matches_the_reference(device, bins):
    """rnnt.kernels.log_normalize against `normalize` of the clamped log, and both against a
    float64 oracle: ragged lengths (the whole batch, one frame, none, a length that is not a
    multiple of the kernel's loop), a bin at the floor throughout (exactly zero, where a float32
    sum of its constant leaves a residue), bins not a multiple of the program's 16, zero past
    every length, the reference's frame-major layout. The CPU case runs Triton's interpreter."""
    pytest.importorskip("triton")
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from rnnt.data.features import NORM_EPSILON
    from rnnt.kernels.log_normalize import log_normalize_cuda

    gen = torch.Generator().manual_seed(5)
    lengths = torch.tensor([203, 150, 1, 0, 65])
    floor = FeaturesConfig().log_floor
    mel = torch.rand(len(lengths), 203, bins, generator=gen) ** 4 * 100  # (B, T, F) energies
    mel[1, :, 3] = 0.0  # digital silence in one bin
    mel[4, :, :5] = 1e-30  # below the floor
    got = log_normalize_cuda(mel.to(device), lengths.to(device), floor, NORM_EPSILON).cpu()
    # packed: each utterance's frames (at least one row) one after the other, garbage between
    rows = lengths.clamp(min=1) + torch.tensor([0, 4, 0, 1, 2])
    starts = torch.cumsum(rows, 0) - rows
    packed = torch.full((int(rows.sum()), bins), float("nan"))
    for row, n in enumerate(lengths.tolist()):
        packed[starts[row] : starts[row] + n] = mel[row, :n]
    got_packed = log_normalize_cuda(
        packed.to(device), lengths.to(device), floor, NORM_EPSILON, starts.to(device), 203
    ).cpu()
    assert torch.equal(got_packed, got) and got_packed.stride() == got.stride()
    ref = normalize(torch.log(torch.clamp(mel, min=floor)).transpose(1, 2), lengths)
    oracle = normalize(torch.log(torch.clamp(mel.double(), min=floor)).transpose(1, 2), lengths)
    assert got.shape == ref.shape == (len(lengths), bins, 203)
    assert got.stride() == ref.stride()
    assert torch.equal(got[1, 3], torch.zeros(203)) and torch.equal(got[4, :5], torch.zeros(5, 203))
    torch.testing.assert_close(got.double(), oracle, rtol=0, atol=5e-6)
    torch.testing.assert_close(got, ref, rtol=0, atol=5e-6)
    for row, n in enumerate(lengths.tolist()):
        assert torch.all(got[row, :, n:] == 0), row
        if n > 1:  # zero mean, unit variance (less eps) over the utterance's own frames
            torch.testing.assert_close(
                got[row, 5:, :n].double().mean(1),
                torch.zeros(bins - 5, dtype=torch.float64),
                rtol=0,
                atol=1e-6,
            )


@pytest.mark.gpu
def test_feature_extractor_kernels_give_the_references_features():
    """The whole stage on a GPU with its Triton kernels (trim, framing, log and normalization)
    and with the reference functions, dither on (from one seed each): the same lengths, and the
    same features up to the normalization's float32 sums, which the kernel takes in another
    order (its own test bounds the difference; everything before it equals the reference bit
    for bit). Speed perturbation is off: the resampler's kernel rounds otherwise than its
    float64 reference (its own test bounds the difference)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    rng = np.random.default_rng(7)
    rows = [_speechlike(rng, n, lead=900, trail=700) for n in (48000, 30001, 1500, 160)]
    wave, lens = _pad(rows)
    pcm = (wave * 32768).round().clamp(-32768, 32767).to(torch.int16).cuda()
    cfg = FeaturesConfig(dither=1e-5)
    extractor = FeatureExtractor(cfg, train=True, speed_perturb=False).cuda()
    got = extractor(pcm, lens.cuda(), torch.Generator(device="cuda").manual_seed(0))
    # lengths on the host, as the loader passes them: the frames packed to their bound
    packed = extractor(pcm, lens, torch.Generator(device="cuda").manual_seed(0))
    extractor.use_kernels = False
    ref = extractor(pcm, lens.cuda(), torch.Generator(device="cuda").manual_seed(0))
    for features, frames in (got, packed):
        assert torch.equal(frames, ref[1])
        assert features.shape == ref[0].shape and features.stride() == ref[0].stride()
        torch.testing.assert_close(features, ref[0], rtol=0, atol=5e-6)


@pytest.mark.gpu
def test_packed_and_padded_stages_agree_with_speed_perturbation():
    """With speed perturbation, the kernels' stage given the host's lengths (packed frames)
    and the device's (padded) from one seed: the same lengths and features, up to the mel
    product's float32 sums (cuBLAS picks its kernel by the rows); and with speeds drawn on the
    host (frames bounded at each utterance's own speed) against the same speeds on the GPU."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    rng = np.random.default_rng(9)
    rows = [_speechlike(rng, n, lead=900, trail=700) for n in (64000, 30001, 8000, 1500, 160)]
    wave, lens = _pad(rows)
    pcm = (wave * 32768).round().clamp(-32768, 32767).to(torch.int16).cuda()
    cfg = FeaturesConfig(dither=1e-5)
    extractor = FeatureExtractor(cfg, train=True).cuda()
    padded = extractor(pcm, lens.cuda(), torch.Generator(device="cuda").manual_seed(3))
    packed = extractor(pcm, lens, torch.Generator(device="cuda").manual_seed(3))
    assert torch.equal(packed[1], padded[1])
    assert packed[0].shape == padded[0].shape
    torch.testing.assert_close(packed[0], padded[0], rtol=0, atol=5e-6)
    # speeds drawn on the host, as the loader draws them: each utterance's frames bounded at
    # its own speed; the same speeds on the GPU frame every utterance to the longest
    speeds = draw_speeds(cfg, len(lens), torch.Generator().manual_seed(4))
    own = extractor(pcm, lens, torch.Generator(device="cuda").manual_seed(3), speeds)
    on_gpu = extractor(
        pcm, lens.cuda(), torch.Generator(device="cuda").manual_seed(3), speeds.cuda()
    )
    assert torch.equal(own[1], on_gpu[1]) and not torch.equal(own[1], padded[1])
    torch.testing.assert_close(own[0], on_gpu[0], rtol=0, atol=5e-6)


_HOPPER_COMPILE = r"""
import os, subprocess, sys, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from rnnt.kernels import frames, log_normalize, resample, trim

P = "constexpr"
KERNELS = {
    "resample": (resample._resample_kernel, {"wave_ptr": "*fp32", "lengths_ptr": "*i64",
        "out_lengths_ptr": "*i64", "ratio_ptr": "*fp64", "table_ptr": "*i64",
        "out_ptr": "*fp32", "width": "i32", "out_width": "i32", "HALF": P, "LOBES": P,
        "BLOCK": P, "PCM16": P}, {"HALF": 19, "LOBES": 16, "BLOCK": resample.BLOCK,
        "PCM16": False}, {"num_warps": resample.NUM_WARPS}),
    "resample_pcm16": (resample._resample_kernel, {"wave_ptr": "*i16", "lengths_ptr": "*i64",
        "out_lengths_ptr": "*i64", "ratio_ptr": "*fp64", "table_ptr": "*i64",
        "out_ptr": "*fp32", "width": "i32", "out_width": "i32", "HALF": P, "LOBES": P,
        "BLOCK": P, "PCM16": P}, {"HALF": 19, "LOBES": 16, "BLOCK": resample.BLOCK,
        "PCM16": True}, {"num_warps": resample.NUM_WARPS}),
    "loudest": (trim._loudest_kernel, {"wave_ptr": "*fp32", "lengths_ptr": "*i64",
        "block_max_ptr": "*fp64", "width": "i32", "n_blocks": "i32", "WINDOW": P, "GROUP": P},
        {"WINDOW": 2048, "GROUP": trim.LOUDEST_GROUP}, {"num_warps": trim.NUM_WARPS}),
    "loud_span": (trim._loud_span_kernel, {"wave_ptr": "*fp32", "lengths_ptr": "*i64",
        "block_max_ptr": "*fp64", "cutoff_ptr": "*fp64", "begin_ptr": "*i64",
        "kept_ptr": "*i64", "width": "i32", "n_blocks": "i32", "WINDOW": P, "SCAN": P},
        {"WINDOW": 2048, "SCAN": trim.LOUD_BLOCK_SCAN}, {"num_warps": trim.NUM_WARPS}),
    "shift": (trim._shift_kernel, {"wave_ptr": "*fp32", "begin_ptr": "*i64",
        "new_lengths_ptr": "*i64", "out_ptr": "*fp32", "width": "i32", "BLOCK": P},
        {"BLOCK": 1024}, {"num_warps": 4}),
    "frames": (frames._frames_kernel, {"wave_ptr": "*fp32", "noise_ptr": "*fp32",
        "begin_ptr": "*i64", "lengths_ptr": "*i64", "layout_ptr": "*i64", "window_ptr": "*fp32",
        "out_ptr": "*fp32", "width": "i32", "dither": "fp32", "coeff": "fp32", "HOP": P, "WIN": P,
        "N_FFT": P, "FRAMES": P, "CHUNK": P, "HAS_DITHER": P, "HAS_BEGIN": P}, {"HOP": 160,
        "WIN": 320, "N_FFT": 512, "FRAMES": frames.FRAMES_PER_PROGRAM,
        "CHUNK": frames.FRAME_CHUNK, "HAS_DITHER": True, "HAS_BEGIN": True},
        {"num_warps": frames.FRAMES_NUM_WARPS, "enable_fp_fusion": False}),
    "power": (frames._power_kernel, {"spec_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32",
        "BLOCK": P}, {"BLOCK": frames.POWER_BLOCK},
        {"num_warps": 4, "enable_fp_fusion": False}),
    "power_mel": (frames._power_mel_kernel, {"spec_ptr": "*fp32", "weights_ptr": "*fp32",
        "k_blocks_ptr": "*i32", "out_ptr": "*fp32", "rows": "i32", "bins": "i32",
        "n_mels": "i32", "BLOCK_R": P, "BLOCK_K": P, "BLOCK_M": P, "M_BLOCKS": P,
        "PRECISION": P},
        {"BLOCK_R": frames.MEL_BLOCK_R, "BLOCK_K": frames.MEL_BLOCK_K,
        "BLOCK_M": frames.MEL_BLOCK_M, "M_BLOCKS": 5, "PRECISION": "tf32x3"},
        {"num_warps": 4}),
    "log_normalize": (log_normalize._log_normalize_kernel, {"mel_ptr": "*fp32",
        "starts_ptr": "*i64", "lengths_ptr": "*i64", "out_ptr": "*fp32", "frames": "i32",
        "bins": "i32", "floor": "fp32", "eps": "fp32", "BINS": P, "FRAMES": P},
        {"BINS": log_normalize.BINS_PER_PROGRAM, "FRAMES": log_normalize.FRAMES_PER_LOOP},
        {"num_warps": log_normalize.NUM_WARPS}),
}
tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
for name, (fn, signature, constexprs, options) in KERNELS.items():
    compiled = triton.compile(ASTSource(fn, signature, constexprs),
                              target=GPUTarget("cuda", 90, 32), options=options)
    path = os.path.join(sys.argv[1], name + ".cubin")
    with open(path, "wb") as f:
        f.write(compiled.asm["cubin"])
    usage = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True).stdout
    print(name, " ".join(w for w in usage.split() if w.startswith(("REG:", "STACK:"))))
"""


def test_the_feature_stage_kernels_compile_for_hopper(tmp_path):
    """The Triton kernels of the GPU feature stage, compiled for sm_90 by Triton's own ptxas
    (no GPU needed): a construct the interpreter runs but the compiler rejects (a float64
    scan, say) fails here rather than at a GPU run's warm-up. Each also keeps its registers:
    a kernel that spills them to its stack runs many times slower (the resampler's launch of
    512 samples on 2 warps spills 1,736 bytes and took 19 times as long); the 32 bytes the
    resampler has are the float32 sine's slow path for large angles, which it never takes."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # the kernels' own default; frames.py turns it off
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    done = subprocess.run(
        [sys.executable, "-c", _HOPPER_COMPILE, str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in done.stdout.strip().splitlines())
    assert set(lines) == {
        "resample",
        "resample_pcm16",
        "loudest",
        "loud_span",
        "shift",
        "frames",
        "power",
        "power_mel",
        "log_normalize",
    }
    for name, usage in lines.items():
        stack = int(usage.split("STACK:")[1].split()[0])
        assert stack <= 64, (name, usage)


def test_power_spectrum_frames_are_numpy_reflect_padded_stfts():
    """Each real frame is the power of rfft(window * frame) of the utterance alone, centred with
    numpy's reflect padding, whatever the batch's other rows and its padding hold; utterances
    shorter than half a window included."""
    gen = torch.Generator().manual_seed(0)
    win, hop, n_fft = 400, 160, 512
    window = torch.hann_window(win, periodic=False, dtype=torch.float64)
    lengths = [16000, 15999, 3000, 201, 161, 150, 7]
    width = max(lengths) + 57
    wave = torch.randn(len(lengths), width, generator=gen, dtype=torch.float64)
    power, frames = power_spectrum(wave, torch.tensor(lengths), window, hop, n_fft)
    assert power.shape == (len(lengths), width // hop + 1, n_fft // 2 + 1)
    assert torch.isfinite(power).all()
    for row, n in enumerate(lengths):
        assert int(frames[row]) == n // hop + 1
        x = wave[row, :n].numpy()
        if n > win // 2:
            padded = np.pad(x, win // 2, mode="reflect")
            for t in range(n // hop + 1):
                frame = padded[t * hop : t * hop + win] * window.numpy()
                want = np.abs(np.fft.rfft(frame, n=n_fft)) ** 2
                np.testing.assert_allclose(power[row, t].numpy(), want, rtol=1e-9, atol=1e-9)
        else:  # numpy cannot reflect more than the signal holds: mirror, mirror, then clamp
            last = n - 1
            for t in range(n // hop + 1):
                pos = np.abs(t * hop - win // 2 + np.arange(win))
                pos = np.minimum(np.clip(np.where(pos > last, 2 * last - pos, pos), 0, None), last)
                want = np.abs(np.fft.rfft(x[pos] * window.numpy(), n=n_fft)) ** 2
                np.testing.assert_allclose(power[row, t].numpy(), want, rtol=1e-9, atol=1e-9)


def test_preemphasis_matches_lfilter():
    x = np.random.default_rng(2).standard_normal(500).astype(np.float32)
    y = preemphasis(torch.from_numpy(x)[None], 0.97)[0].numpy()
    np.testing.assert_allclose(y, scipy.signal.lfilter([1, -0.97], [1], x), atol=1e-6)


def test_normalize_uses_valid_frames_only():
    rng = np.random.default_rng(3)
    x = torch.from_numpy(rng.standard_normal((2, 4, 9)) * 3 + 5)
    lens = torch.tensor([9, 5])
    out = normalize(x, lens)
    for b, n in enumerate(lens.tolist()):
        v = x[b, :, :n].numpy()
        ref = (v - v.mean(1, keepdims=True)) / np.sqrt(v.var(1, keepdims=True) + 1e-5)
        np.testing.assert_allclose(out[b, :, :n].numpy(), ref, atol=1e-10)
        assert torch.all(out[b, :, n:] == 0)


@pytest.mark.parametrize("ratio", [0.85, 1.0 / 0.85, 16000 / 22050])
def test_resample_sinusoid(ratio):
    n = 8000
    freq = 440.0 / 16000  # cycles per input sample, well below either Nyquist
    x = np.sin(2 * np.pi * freq * np.arange(n)).astype(np.float32)
    out, lens = resample(
        torch.from_numpy(x)[None],
        torch.tensor([n]),
        torch.tensor([ratio], dtype=torch.float64),
        (ratio, ratio),
    )
    m = int(lens[0])
    assert m == int(np.ceil(n * ratio))
    # output sample k sits at input position (k + 0.5) / ratio - 0.5
    pos = (np.arange(m) + 0.5) / ratio - 0.5
    expected = np.sin(2 * np.pi * freq * pos)
    inner = slice(100, m - 100)  # away from the zero-extended edges
    np.testing.assert_allclose(out[0, inner].numpy(), expected[inner], atol=2e-3)


def test_resample_downsampling_removes_what_cannot_be_represented():
    n = 16000
    x = np.sin(2 * np.pi * 7000 / 16000 * np.arange(n)).astype(np.float32)  # above 5.4 kHz
    out, lens = resample(
        torch.from_numpy(x)[None],
        torch.tensor([n]),
        torch.tensor([0.68], dtype=torch.float64),
        (0.68, 0.68),
    )
    assert out[0, 500 : int(lens[0]) - 500].abs().max() < 0.02


def test_batched_equals_one_by_one_and_pads_with_zeros():
    cfg = FeaturesConfig(dither=0.0)
    rng = np.random.default_rng(4)
    rows = [_speechlike(rng, 5000, 2500, 1000), _speechlike(rng, 12000), _speechlike(rng, 3000)]
    extractor = FeatureExtractor(cfg, train=False)
    feats, lens = extractor(*_pad(rows))
    for i, x in enumerate(rows):
        alone, alone_len = extractor(*_pad([x]))
        n = int(alone_len[0])
        assert int(lens[i]) == n
        np.testing.assert_allclose(feats[i, :, :n].numpy(), alone[0, :, :n].numpy(), atol=1e-5)
        assert torch.all(feats[i, :, n:] == 0)


def test_speed_perturbation_and_dither_follow_the_generator():
    cfg = FeaturesConfig()
    rng = np.random.default_rng(5)
    wave, lens = _pad([_speechlike(rng, 8000), _speechlike(rng, 6000)])
    extractor = FeatureExtractor(cfg, train=True)
    a, a_lens = extractor(wave, lens, torch.Generator().manual_seed(7))
    b, b_lens = extractor(wave, lens, torch.Generator().manual_seed(7))
    c, c_lens = extractor(wave, lens, torch.Generator().manual_seed(8))
    assert torch.equal(a, b) and torch.equal(a_lens, b_lens)
    assert not torch.equal(a_lens, c_lens) or not torch.equal(a, c)
    # speeds in [0.85, 1.15]: frames of a shorter/longer resampled utterance (no trim here)
    for n, frames in zip(lens.tolist(), a_lens.tolist()):
        assert 1 + int(n / 1.15) // 160 <= frames <= 1 + int(np.ceil(n / 0.85)) // 160


@pytest.mark.parametrize(
    "device,width",
    [("cpu", 3_000), pytest.param("cuda", 300_000, marks=pytest.mark.gpu)],
)
def test_resample_kernel_reads_int16_pcm_as_the_scaled_floats(device, width):
    """int16 PCM into the resampler gives, bit for bit, what the float32 of sample / 32768
    gives: the kernel converts each tap as the feature stage's conversion did. The CPU case
    runs Triton's interpreter."""
    pytest.importorskip("triton")
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    gen = torch.Generator().manual_seed(3)
    lengths = torch.tensor([width, 7, width * 3 // 5, 2048])
    pcm = torch.randint(-32768, 32768, (len(lengths), width), generator=gen, dtype=torch.int32)
    pcm = (pcm * (torch.arange(width)[None] < lengths[:, None])).to(torch.int16)
    ratio = 1.0 / torch.tensor([0.85, 1.15, 1.0, 1.0712], dtype=torch.float64)
    ratio_range = (1 / 1.15, 1 / 0.85)
    pcm, lengths, ratio = pcm.to(device), lengths.to(device), ratio.to(device)
    from rnnt.kernels.resample import resample_cuda

    # the reference converts first
    ref, ref_lens = resample(pcm, lengths, ratio, ratio_range, use_kernel=False)
    half = math.ceil(RESAMPLE_LOBES / ratio_range[0])
    args = (lengths, ref_lens, ratio, ref.shape[1], half, RESAMPLE_LOBES)
    from_pcm = resample_cuda(pcm, *args)
    from_floats = resample_cuda(pcm * (1.0 / 32768), *args)
    assert from_pcm.dtype == torch.float32
    assert torch.equal(from_pcm, from_floats)
    assert (from_pcm - ref).abs().max().item() < 2e-5
    if device == "cuda":  # the dispatch inside `resample`
        dispatched, lens = resample(pcm, lengths, ratio, ratio_range)
        assert torch.equal(dispatched, from_pcm) and torch.equal(lens, ref_lens)


def test_read_audio_names_missing_and_corrupt_files(tmp_path):
    stereo = np.stack([np.linspace(-0.5, 0.5, 800), np.zeros(800)], axis=1)
    sf.write(tmp_path / "ok.wav", stereo, 16000, subtype="FLOAT")
    samples, rate = read_audio(str(tmp_path / "ok.wav"))
    assert rate == 16000
    np.testing.assert_allclose(samples, stereo.mean(axis=1), atol=1e-7)
    with pytest.raises(AudioFileError, match="missing.flac: audio file not found"):
        read_audio(str(tmp_path / "missing.flac"))
    (tmp_path / "bad.flac").write_bytes(b"fLaC" + bytes(range(200)))
    with pytest.raises(AudioFileError, match="bad.flac: cannot decode audio"):
        read_audio(str(tmp_path / "bad.flac"))


@pytest.mark.parametrize(
    "device,width",
    [("cpu", 3_000), pytest.param("cuda", 300_000, marks=pytest.mark.gpu)],
)
def test_resample_kernel_equals_the_reference(device, width):
    """rnnt.kernels.resample against the float64 gather of `resample`, at the training speed
    range, with ragged lengths, downsampling and upsampling rows, and (on the GPU) a long row
    whose input positions float32 could not place. The CPU case runs Triton's interpreter."""
    pytest.importorskip("triton")
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from rnnt.kernels.resample import resample_cuda

    gen = torch.Generator().manual_seed(0)
    lengths = torch.tensor([width, 1, 2048, width * 4 // 7, width - 1, 64])
    wave = torch.randn(len(lengths), width, generator=gen) * 0.3
    wave *= torch.arange(width)[None] < lengths[:, None]  # padding is zero, as in a batch
    ratio = 1.0 / torch.tensor([0.85, 1.15, 1.0, 0.9137, 1.0712, 1.149], dtype=torch.float64)
    ratio_range = (1 / 1.15, 1 / 0.85)
    wave, lengths, ratio = wave.to(device), lengths.to(device), ratio.to(device)
    ref, ref_lens = resample(wave, lengths, ratio, ratio_range, use_kernel=False)
    half = math.ceil(RESAMPLE_LOBES / ratio_range[0])
    got = resample_cuda(wave, lengths, ref_lens, ratio, ref.shape[1], half, RESAMPLE_LOBES)
    if device == "cuda":  # the dispatch inside `resample`
        dispatched, lens = resample(wave, lengths, ratio, ratio_range)
        assert torch.equal(dispatched, got) and torch.equal(lens, ref_lens)
    assert got.shape == ref.shape and got.dtype == ref.dtype
    err = (got - ref).abs().max().item()
    assert err < 2e-5 * wave.abs().max().item(), err
    for b, n in enumerate(ref_lens.tolist()):
        assert torch.all(got[b, n:] == 0)
