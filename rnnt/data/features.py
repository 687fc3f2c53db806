"""Torch-native audio front end: padded waveforms (B, S) -> normalized log-mels (B, n_mels, T).

This module is the definition of the front end of docs/SPEC.md "Features"; `rnnt.data.dali`
builds the same maths from DALI operators and is tested against it. Every detail that the
benchmark leaves open is fixed here, chosen so that DALI's operators can express it exactly:

* Decode: mono float32 at `sample_rate` (16 kHz); several channels are averaged.
* Resampling (sample-rate conversion and speed perturbation, one pass): Hann-windowed sinc,
  16 lobes (DALI's default quality), output sample n sits at input position
  (n + 0.5) * in_rate / out_rate - 0.5, output length ceil(len * out_rate / in_rate); taps
  outside the signal count as zero. Downsampling widens the kernel by in/out to low-pass.
  It is not bit-exact with DALI's resampler (which reads a lookup table), nor with soxr,
  which the torch loader's CPU workers use for speed (rnnt.data.loader), so backends agree
  to the decibel, not to 1e-3, once perturbation is on; parity is defined without it.
* Speed perturbation (train only): speed s ~ U[speed_perturbation_min, max] per utterance;
  the waveform is resampled to sample_rate / s and read back at sample_rate, so s > 1 is
  faster, shorter speech (out length ceil(len / s)).
* Silence trim (DALI `nonsilent_region`, cutoff -60 dB): the mean square of x over every
  window of W = 2048 samples starting at i, for i in [0, len - W]; the reference is the
  largest window; windows with power >= reference * 10^(-60/10) are loud. The kept region is
  [first loud i, last loud i + W). An utterance shorter than W is kept whole.
* Dither: x + dither * N(0, 1) over the kept samples (train and eval alike; 0 turns it off).
* Pre-emphasis: y[0] = x[0], y[i] = x[i] - 0.97 x[i-1] (DALI border="zero").
* STFT: frames centred on multiples of the hop (160): frame t reads samples
  [t*160 - 160, t*160 + 160), mirrored at both ends without repeating the edge sample
  (numpy "reflect"); T = 1 + len // 160 frames. Window: symmetric Hann of 320 samples
  (torch.hann_window(periodic=False)), handed to DALI explicitly; zero-padded to n_fft = 512
  for the FFT; power spectrum |X|^2, 257 bins.
* Mel: 80 Slaney-scale triangles from 0 Hz to sr/2 with Slaney's area norm (`mel_basis`, what
  librosa.filters.mel gives by default), which is also what DALI `mel_filter_bank(normalize=True,
  mel_formula="slaney")` computes.
* Log: ln(max(mel, 1e-20)).
* Normalization per mel bin over the valid frames: (x - mean) / sqrt(var + 1e-5) with the
  population variance (ddof 0, defined for one frame), DALI `normalize(axes=[1],
  epsilon=1e-5)`. Frames past each length are zero.

Shapes: B utterances, S samples (padded), T frames, F = n_mels.
"""

from __future__ import annotations

import math
import os

import numpy as np
import soundfile as sf
import torch
from torch import nn

from rnnt.config import FeaturesConfig
from rnnt.errors import UserError
from rnnt.host_lengths import to_device

TRIM_WINDOW = 2048  # samples per short-term power window of the silence trim
NORM_EPSILON = 1e-5  # added to the variance of each mel bin
RESAMPLE_LOBES = 16
# elements of the (B, S_out chunk, taps) gather per resampling chunk: bounds peak memory
_RESAMPLE_CHUNK_ELEMS = 1 << 24


class AudioFileError(UserError, RuntimeError):
    """An audio file that cannot be read; the message names the file."""


def read_audio(path: str, pcm16: bool = False) -> tuple[np.ndarray, int]:
    """(mono float32 samples, sample rate) of an audio file; channels are averaged.

    pcm16: a mono file comes back as its int16 samples (x 32768 of the float32 ones), which
    the GPU feature stage scales itself: half the bytes to pad, share and copy, and no
    conversion on the CPU. Files of several channels come back averaged in float32.
    """
    if not os.path.isfile(path):
        raise AudioFileError(f"{path}: audio file not found")
    try:
        samples, rate = sf.read(path, dtype="int16" if pcm16 else "float32", always_2d=True)
    except (sf.LibsndfileError, RuntimeError, ValueError) as err:
        raise AudioFileError(f"{path}: cannot decode audio ({err})") from None
    if samples.shape[0] == 0:
        raise AudioFileError(f"{path}: audio file has no samples")
    if samples.shape[1] == 1:
        return (samples[:, 0] if pcm16 else samples[:, 0].copy()), rate
    return samples.mean(axis=1, dtype=np.float32) / (32768 if pcm16 else 1), rate


def hann_window(length: int) -> torch.Tensor:
    """The analysis window of both backends (symmetric Hann), float32."""
    return torch.hann_window(length, periodic=False, dtype=torch.float64).float()


def hz_to_mel(hz: np.ndarray) -> np.ndarray:
    """Slaney's mel scale: linear (200/3 Hz per mel) below 1 kHz, logarithmic above (a factor
    of 6.4 per 27 mels)."""
    hz = np.asarray(hz, dtype=np.float64)
    log_step = math.log(6.4) / 27.0
    linear = hz / (200.0 / 3.0)
    return np.where(hz >= 1000.0, 15.0 + np.log(np.maximum(hz, 1e-10) / 1000.0) / log_step, linear)


def mel_to_hz(mel: np.ndarray) -> np.ndarray:
    mel = np.asarray(mel, dtype=np.float64)
    log_step = math.log(6.4) / 27.0
    return np.where(mel >= 15.0, 1000.0 * np.exp(log_step * (mel - 15.0)), mel * 200.0 / 3.0)


def mel_basis(cfg: FeaturesConfig) -> torch.Tensor:
    """(n_mels, n_fft // 2 + 1) Slaney mel filters, float32: triangles between mel-spaced
    edges from 0 Hz to the Nyquist frequency, each scaled to unit area (2 / its width in Hz).
    tests/unit/test_features.py checks them against librosa.filters.mel."""
    bins = np.linspace(0.0, cfg.sample_rate / 2, cfg.n_fft // 2 + 1)
    edges = mel_to_hz(np.linspace(0.0, hz_to_mel(cfg.sample_rate / 2), cfg.n_mels + 2))
    widths = np.diff(edges)
    rising = (bins[None, :] - edges[:-2, None]) / widths[:-1, None]
    falling = (edges[2:, None] - bins[None, :]) / widths[1:, None]
    triangles = np.maximum(0.0, np.minimum(rising, falling))
    basis = triangles * (2.0 / (edges[2:] - edges[:-2]))[:, None]
    return torch.from_numpy(basis.astype(np.float32))


def window_samples(cfg: FeaturesConfig) -> tuple[int, int]:
    """(window length, hop) in samples."""
    return round(cfg.window_size * cfg.sample_rate), round(cfg.window_stride * cfg.sample_rate)


def num_frames(lengths: torch.Tensor, hop: int) -> torch.Tensor:
    return lengths // hop + 1


def frames_bound(lengths: torch.Tensor, ratio: float | torch.Tensor, hop: int) -> torch.Tensor:
    """The most frames that utterances of `lengths` (B,) samples can have after `resample` and
    the silence trim, from the host's lengths: at each utterance's own ratio (B,) float64 on
    the host, or at a ratio of at most `ratio` (a float; 1.0: no resampling).

    `resample` makes ceil(length * ratio) samples in float64 (the same product here gives the
    same count, and no smaller ratio can round past the largest's), and the trim only
    shortens."""
    longest = torch.ceil(lengths.to(torch.float64) * ratio).to(torch.int64)
    return num_frames(longest, hop)


def _positions(lengths: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(1, width) sample positions and the (B, width) mask of positions < lengths."""
    pos = torch.arange(width, device=lengths.device)[None]
    return pos, pos < lengths[:, None]


def resample(
    wave: torch.Tensor,
    lengths: torch.Tensor,
    ratio: torch.Tensor,
    ratio_range: tuple[float, float],
    use_kernel: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Windowed-sinc resampling with a per-utterance ratio (out rate / in rate).

    wave (B, S) float, or int16 PCM (sample / 32768), lengths (B,) int64, ratio (B,) float64
    inside ratio_range = (lo, hi), which fixes the output width and tap count without reading
    `ratio` back (sync-free).
    Returns (B, ceil(S * hi)) and the output lengths ceil(lengths * ratio).

    This is the reference; float32 and int16 batches on a GPU run rnnt.kernels.resample, which
    computes the same sums in registers instead of a float64 (B, N, taps) gather (tested
    against this).
    """
    batch, width = wave.shape
    device = wave.device
    ratio = ratio.to(device=device, dtype=torch.float64)
    out_lens = torch.ceil(lengths.to(torch.float64) * ratio).to(torch.int64)
    lo, hi = ratio_range
    out_width = math.ceil(width * hi)
    half = math.ceil(RESAMPLE_LOBES / min(1.0, lo))  # the lowest ratio needs the widest kernel
    if use_kernel and wave.is_cuda and wave.dtype in (torch.float32, torch.int16):
        from rnnt.kernels.resample import resample_cuda

        return (
            resample_cuda(wave, lengths, out_lens, ratio, out_width, half, RESAMPLE_LOBES),
            out_lens,
        )
    if wave.dtype == torch.int16:
        wave = wave * (1.0 / 32768)
    cutoff = torch.clamp(ratio, max=1.0)  # (B,) low-pass at the lower Nyquist rate
    taps = torch.arange(-half + 1, half + 1, device=device, dtype=torch.float64)
    out = torch.zeros(batch, out_width, dtype=wave.dtype, device=device)
    chunk = max(1, _RESAMPLE_CHUNK_ELEMS // max(1, batch * taps.numel()))
    for start in range(0, out_width, chunk):
        n = torch.arange(start, min(start + chunk, out_width), device=device, dtype=torch.float64)
        src = (n[None] + 0.5) / ratio[:, None] - 0.5  # (B, N) input positions
        idx = torch.floor(src)[..., None] + taps  # (B, N, taps)
        dist = (src[..., None] - idx) * cutoff[:, None, None]
        envelope = 0.5 * (1 + torch.cos(math.pi * dist / RESAMPLE_LOBES))
        weight = torch.sinc(dist) * envelope * cutoff[:, None, None]
        weight = weight * (dist.abs() < RESAMPLE_LOBES)
        inside = (idx >= 0) & (idx < lengths[:, None, None])
        gathered = torch.gather(
            wave, 1, idx.clamp(0, width - 1).to(torch.int64).reshape(batch, -1)
        ).reshape(idx.shape)
        out[:, start : start + n.numel()] = (
            (gathered.to(torch.float64) * weight * inside).sum(-1).to(wave.dtype)
        )
    _, valid = _positions(out_lens, out_width)
    return out * valid, out_lens


def draw_speeds(cfg: FeaturesConfig, batch: int, generator: torch.Generator | None) -> torch.Tensor:
    """(B,) float64 speeds ~ U[speed_perturbation_min, speed_perturbation_max], drawn and left
    on the generator's device. The torch loader draws them on the host, where they bound each
    utterance's frames, and uploads them from pinned memory: a copy of speeds drawn on the GPU
    back to the host would make the host wait for the stage's stream (the audio's upload)."""
    device = generator.device if generator is not None else None
    u = torch.rand(batch, generator=generator, dtype=torch.float64, device=device)
    lo, hi = cfg.speed_perturbation_min, cfg.speed_perturbation_max
    return lo + (hi - lo) * u


def trim_silence(
    wave: torch.Tensor,
    lengths: torch.Tensor,
    cutoff_db: float,
    window: int = TRIM_WINDOW,
    use_kernel: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cut leading/trailing silence as DALI `nonsilent_region` does (see module docstring).

    wave (B, S), lengths (B,). Returns the kept samples shifted to the start, (B, S), and their
    lengths; sync-free (the width stays S).

    This is the reference; float32 batches on a GPU run rnnt.kernels.trim, which sums each
    window in registers instead of over float64 copies of the batch (tested against this).
    """
    is_power_of_two = window > 0 and window & (window - 1) == 0
    if use_kernel and wave.is_cuda and wave.dtype == torch.float32 and is_power_of_two:
        from rnnt.kernels.trim import trim_silence_cuda

        return trim_silence_cuda(wave, lengths.to(torch.int64), cutoff_db, window)
    batch, width = wave.shape
    # float64 cumulative sums: float32 loses the quiet windows next to loud ones
    energy = torch.cumsum(wave.to(torch.float64) ** 2, dim=1)
    energy = torch.cat([energy.new_zeros(batch, 1), energy], dim=1)  # (B, S + 1)
    n_windows = max(width - window + 1, 1)
    if width >= window:
        power = (energy[:, window:] - energy[:, :-window]) / window  # (B, S - W + 1)
    else:
        power = energy.new_zeros(batch, 1)
    starts, valid = _positions(lengths - window + 1, n_windows)
    power = torch.where(valid, power, torch.zeros_like(power))
    reference = power.amax(dim=1, keepdim=True)
    loud = valid & (power >= reference * 10.0 ** (cutoff_db / 10.0))
    big = torch.iinfo(torch.int64).max
    first = torch.where(loud, starts, big).amin(dim=1)
    last = torch.where(loud, starts, -1).amax(dim=1)
    short = lengths < window
    begin = torch.where(short, 0, first)
    end = torch.where(short, lengths, torch.minimum(last + window, lengths))
    new_lens = end - begin
    pos, keep = _positions(new_lens, width)
    src = (pos + begin[:, None]).clamp(max=width - 1)
    return torch.gather(wave, 1, src) * keep, new_lens


def preemphasis(wave: torch.Tensor, coeff: float) -> torch.Tensor:
    """y[i] = x[i] - coeff * x[i-1], y[0] = x[0]; zero padding stays zero except one sample
    past the end, which callers mask."""
    return torch.cat([wave[:, :1], wave[:, 1:] - coeff * wave[:, :-1]], dim=1)


def power_spectrum(
    wave: torch.Tensor, lengths: torch.Tensor, window: torch.Tensor, hop: int, n_fft: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Centred, reflect-padded STFT power: (B, S) -> (B, T, n_fft // 2 + 1), T = 1 + S // hop.

    Reflection happens at each utterance's own end, so padding never leaks into its frames.
    Frames past an utterance's `num_frames` hold finite values that mean nothing.
    """
    win = window.numel()
    batch, width = wave.shape
    frames = num_frames(lengths, hop)
    t_max = width // hop + 1
    left = win // 2  # samples before position 0 of the first frame
    right = win - left  # reflected samples that the last real frame reads past the end
    last = (lengths - 1).clamp(min=0)[:, None]

    def reflected(pos: torch.Tensor) -> torch.Tensor:
        """The source sample of (B, N) positions outside [0, last]: mirrored at the start and
        at the utterance's end (pos > last), kept inside utterances shorter than the mirror."""
        pos = pos.abs()
        pos = torch.where(pos > last, 2 * last - pos, pos).clamp(min=0)
        return torch.gather(wave, 1, torch.minimum(pos, last))

    # One padded copy that every frame reads as a strided view (no (B, T, win) index tensor):
    # `left` mirrored samples, the waveform, then each utterance's mirrored tail written just
    # past its own end.
    span = max((t_max - 1) * hop + win, left + width + right)
    padded = wave.new_zeros(batch, span)
    padded[:, left : left + width] = wave
    head = torch.arange(-left, 0, device=wave.device)[None].expand(batch, left)
    padded[:, :left] = reflected(head)
    tail = lengths.clamp(min=0)[:, None] + torch.arange(right, device=wave.device)[None]
    padded.scatter_(1, tail + left, reflected(tail))
    segments = padded.unfold(1, win, hop)[:, :t_max]  # (B, T, win), a view
    spec = torch.fft.rfft(segments * window, n=n_fft)
    return spec.real**2 + spec.imag**2, frames


class FeatureExtractor(nn.Module):
    """Normalized log-mels of padded 16 kHz waveforms, batched and sync-free.

    forward(wave (B, S) float32, lengths (B,) int64, generator) -> (feats (B, F, T), lens (B,))
    with T = 1 + S' // hop where S' = S, or ceil(S / speed_perturbation_min) when perturbing.
    Lengths on the host (the loader has them there) also bound each utterance's frames without
    a sync, so that the GPU kernels frame, transform and project only the frames that can be
    real (`rnnt.kernels.frames.frame_power_packed`) rather than the batch's longest for all.
    `speed_perturb` (default: `train`) resamples every utterance at a random speed first; the
    torch loader turns it off when perturbation already happened on another device.
    `generator` drives speed and dither (a CPU torch.Generator for determinism; None = global).
    `speeds` (B,) float64 on the host, drawn by the caller (`draw_speeds`), replace the
    generator's draw: with host lengths, the frames are then bounded at each utterance's own
    speed rather than the slowest.
    """

    def __init__(self, cfg: FeaturesConfig, train: bool, speed_perturb: bool | None = None):
        super().__init__()
        self.cfg = cfg
        self.train_mode = train
        self.speed_perturb = train if speed_perturb is None else speed_perturb
        self.win_length, self.hop = window_samples(cfg)
        if self.win_length > cfg.n_fft:
            raise ValueError(
                f"features.window_size gives {self.win_length} samples, more than "
                f"features.n_fft = {cfg.n_fft}"
            )
        self.register_buffer("window", hann_window(self.win_length), persistent=False)
        self.register_buffer("mel", mel_basis(cfg), persistent=False)
        # the basis as the GPU's kernel for the power and the mel product reads it, made at
        # the first batch there (rnnt.kernels.frames.mel_tiles: importing Triton takes seconds)
        self.mel_tiles = None
        # float32 batches on a GPU take the Triton kernels (resampling, trim, framing, log and
        # normalization), which compute what the reference functions of this module compute
        # (the normalization's sums in another order); off, the references
        self.use_kernels = True

    @torch.no_grad()
    def forward(
        self,
        wave: torch.Tensor,
        lengths: torch.Tensor,
        generator: torch.Generator | None = None,
        speeds: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        host_lengths = lengths.to(torch.int64) if lengths.device.type == "cpu" else None
        lengths = lengths.to(device=wave.device, dtype=torch.int64, non_blocking=True)
        kernels = self.use_kernels and wave.is_cuda
        # int16 rows are PCM samples (rnnt.data.features.read_audio(pcm16=True)), converted and
        # scaled in one pass (the product of int16 and a float is float32, exactly); the
        # resampler's kernel reads them as they are, and converts each tap the same way
        if wave.dtype == torch.int16 and not (self.speed_perturb and kernels):
            wave = wave * (1.0 / 32768)
        elif wave.dtype != torch.int16:
            wave = wave.float()
        ratio: float | torch.Tensor = 1.0  # of each output's length to its input's, at most
        if self.speed_perturb:
            ratio_range = (1.0 / cfg.speed_perturbation_max, 1.0 / cfg.speed_perturbation_min)
            if speeds is None:
                speeds = draw_speeds(cfg, wave.shape[0], generator)
            ratio = 1.0 / speeds.to(torch.float64)
            on_host = ratio.device.type == "cpu" and wave.is_cuda
            # an upload that the host does not wait for (behind this stream's work)
            device_ratio = to_device(ratio, wave.device, torch.float64) if on_host else ratio
            wave, lengths = resample(wave, lengths, device_ratio, ratio_range, kernels)
            if not on_host:  # the ratios are on the GPU: bound by the largest
                ratio = ratio_range[1]
        n_fft_pow2 = cfg.n_fft & (cfg.n_fft - 1) == 0  # the framing kernel's tile width
        framing_kernel = kernels and n_fft_pow2
        if framing_kernel:
            from rnnt.kernels.frames import frame_power_packed, mel_tiles
            from rnnt.kernels.log_normalize import log_normalize_cuda
            from rnnt.kernels.trim import loud_regions_cuda

            # the framing reads each row's kept samples where the trim found them: no copy
            begin, lengths = loud_regions_cuda(wave, lengths, cfg.silence_threshold_db, TRIM_WINDOW)
        else:
            wave, lengths = trim_silence(
                wave, lengths, cfg.silence_threshold_db, use_kernel=kernels
            )
        noise = None
        if cfg.dither > 0:
            device = generator.device if generator is not None else wave.device
            noise = torch.randn(wave.shape, generator=generator, device=device).to(wave.device)
        if framing_kernel:
            t_max = wave.shape[1] // self.hop + 1
            rows = torch.full((wave.shape[0],), t_max, dtype=torch.int64)
            if host_lengths is not None:
                rows = torch.minimum(frames_bound(host_lengths, ratio, self.hop), rows)
            if self.mel_tiles is None or self.mel_tiles.weights.device != wave.device:
                self.mel_tiles = mel_tiles(mel_basis(cfg), wave.device)
            mel, frames, starts = frame_power_packed(
                wave,
                lengths,
                noise,
                cfg.dither,
                cfg.preemph,
                self.window,
                self.hop,
                cfg.n_fft,
                rows,
                begin=begin,
                mel=self.mel_tiles,
            )  # (rows, F)
            features = log_normalize_cuda(
                mel, frames, cfg.log_floor, NORM_EPSILON, starts=starts, frames=t_max
            )
            return features, frames
        _, valid = _positions(lengths, wave.shape[1])
        if noise is not None:
            wave = wave + cfg.dither * noise * valid
        wave = preemphasis(wave, cfg.preemph) * valid
        power, frames = power_spectrum(wave, lengths, self.window, self.hop, cfg.n_fft)
        mel = torch.matmul(power, self.mel.T)  # (B, T, F)
        if kernels:
            from rnnt.kernels.log_normalize import log_normalize_cuda

            return log_normalize_cuda(mel, frames, cfg.log_floor, NORM_EPSILON), frames
        logmel = torch.log(torch.clamp(mel, min=cfg.log_floor)).transpose(1, 2)  # (B, F, T)
        return normalize(logmel, frames), frames


def normalize(logmel: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Per-utterance, per-bin (x - mean) / sqrt(var + eps) over the first `lengths` frames;
    (B, F, T) -> (B, F, T), zero past the lengths."""
    _, valid = _positions(lengths, logmel.shape[2])
    valid = valid[:, None, :]
    count = lengths.clamp(min=1)[:, None, None].to(logmel.dtype)
    mean = (logmel * valid).sum(2, keepdim=True) / count
    centered = (logmel - mean) * valid
    var = (centered**2).sum(2, keepdim=True) / count
    return centered / torch.sqrt(var + NORM_EPSILON)
