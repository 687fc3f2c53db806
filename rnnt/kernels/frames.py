"""Triton framing, power and mel product of a trimmed waveform batch: the middle of
`rnnt.data.features.FeatureExtractor` on a GPU, with the same numbers.

The reference adds the dither, applies the pre-emphasis and the length mask, builds a
reflect-padded copy of the batch, multiplies every frame by the window into a (B, T, win)
tensor, which the FFT pads again to (B, T, n_fft), and squares the spectrum's real and imaginary
parts in passes of their own: some fifteen kernels and several copies of the batch. Here one
kernel writes each frame, windowed and zero-padded to n_fft, straight from the trimmed samples
(and the dither's noise), the FFT runs on it as before, and one kernel squares the spectrum,
or squares it and multiplies it by the mel basis. The samples can stay where the trim found
them (`begin`): the feature stage then skips the trim's copy of the batch.

Every sample is computed as the reference computes it: the same operations in the same order,
in float32, with the compiler's fusion of a multiply and an add into one rounding turned off.
So the power of every real frame equals the reference's bit for bit (the FFT gets the same
input); the mel product's sums run in another order than the reference's matrix product.

The frames are packed: each utterance gets only the rows of its bound on its frames, one
after the other, instead of the batch's longest (random batches are about a third padding).
The feature stage bounds them on the host, from each utterance's length and speed before
resampling (`rnnt.data.features.frames_bound`); rows past an utterance's own frames are zero.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from rnnt.host_lengths import to_device

FRAMES_PER_PROGRAM = 8
FRAME_CHUNK = 64  # samples of a frame computed at a time (a power of two, at most n_fft)
FRAMES_NUM_WARPS = 8
POWER_BLOCK = 1024
# The FFT runs over a frame count rounded up to this many, so that the batches of a run, whose
# longest utterance varies, share a few cuFFT plans: making a plan for a new batch shape holds
# the training loop's thread for tens of milliseconds, and the GPU idles after it
# (docs/PERFORMANCE.md).
FFT_FRAME_BUCKET = 64


@triton.jit(do_not_specialize=["width"])
def _frames_kernel(
    wave_ptr,  # (B, width) float32: each row's samples from its begin on (see below)
    noise_ptr,  # (B, width) float32: the dither's N(0, 1) draws (unused without dither)
    begin_ptr,  # (B,) int64: where each row's samples start (unused without HAS_BEGIN: at 0)
    lengths_ptr,  # (B,) int64
    layout_ptr,  # (2, B) int64: each row's first output row, then its number of output rows
    window_ptr,  # (WIN,) float32
    out_ptr,  # (rows, N_FFT) float32
    width,
    dither,
    coeff,
    HOP: tl.constexpr,
    WIN: tl.constexpr,
    N_FFT: tl.constexpr,
    FRAMES: tl.constexpr,
    CHUNK: tl.constexpr,
    HAS_DITHER: tl.constexpr,
    HAS_BEGIN: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    batch = tl.num_programs(0).to(tl.int64)
    # positions within a row and frames within an utterance are int32 (a row is far below 2^31
    # samples); the per-element arithmetic in int64 took two instructions an operation
    t = tl.program_id(1) * FRAMES + tl.arange(0, FRAMES)[:, None]
    length = tl.load(lengths_ptr + row).to(tl.int32)
    out_start = tl.load(layout_ptr + row)
    out_rows = tl.load(layout_ptr + batch + row).to(tl.int32)
    last = tl.maximum(length - 1, 0)
    # frames past the utterance's own (1 + length // HOP) are left zero: nothing reads them
    real_frame = t <= length // HOP
    base = row * width
    row_samples = wave_ptr + base
    if HAS_BEGIN:
        row_samples += tl.load(begin_ptr + row)
    out = out_ptr + out_start * N_FFT + t * N_FFT
    # a frame's samples CHUNK at a time: the chunks past the window (n_fft - win of the
    # n_fft, 37.5% at 320 of 512) are the FFT's zero padding, stored without the samples'
    # arithmetic
    for c in tl.static_range(N_FFT // CHUNK):
        k = c * CHUNK + tl.arange(0, CHUNK)[None, :]
        if c * CHUNK < WIN:
            # the sample frame t reads at k, mirrored at the start and past the utterance's
            # last sample (numpy "reflect"), as power_spectrum's padded copy holds it
            q = tl.abs(t * HOP - WIN // 2 + k)
            q = tl.where(q > last, 2 * last - q, q)
            q = tl.minimum(tl.maximum(q, 0), last)
            inside = (k < WIN) & real_frame & (q < length)
            has_prev = inside & (q >= 1)
            samples = row_samples + q
            x = tl.load(samples, mask=inside, other=0.0)
            x_prev = tl.load(samples - 1, mask=has_prev, other=0.0)
            if HAS_DITHER:
                noise = noise_ptr + base + q
                x = x + dither * tl.load(noise, mask=inside, other=0.0)
                x_prev = x_prev + dither * tl.load(noise - 1, mask=has_prev, other=0.0)
            y = tl.where(q >= 1, x - coeff * x_prev, x)
            window = tl.load(window_ptr + k, mask=k < WIN, other=0.0)
            frame = tl.where(inside, y * window, 0.0)
        else:
            frame = tl.zeros((FRAMES, CHUNK), dtype=tl.float32)
        tl.store(out + k, frame, mask=t < out_rows)


@triton.jit(do_not_specialize=["n"])
def _power_kernel(spec_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """|X|^2 of the first n complex64 values (interleaved real, imaginary) into n float32; the
    blocks along the grid's first axis, which has room for a whole packed batch's."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = i < n
    re = tl.load(spec_ptr + 2 * i, mask=inside, other=0.0)
    im = tl.load(spec_ptr + 2 * i + 1, mask=inside, other=0.0)
    tl.store(out_ptr + i, re * re + im * im, mask=inside)


@triton.jit(do_not_specialize=["rows", "bins"])
def _power_mel_kernel(
    spec_ptr,  # (>= rows, bins) complex64 as float32 pairs
    weights_ptr,  # (K_BLOCKS * BLOCK_K, M_BLOCKS * BLOCK_M) float32: the basis, transposed
    k_blocks_ptr,  # (2, M_BLOCKS) int32: each block of mels' first and last + 1 block of bins
    out_ptr,  # (rows, n_mels) float32
    rows,
    bins,
    n_mels,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    M_BLOCKS: tl.constexpr,
    PRECISION: tl.constexpr,  # "tf32x3" (tensor cores from Ampere on) or "ieee" (FMAs)
):
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)[:, None]
    kk = tl.arange(0, BLOCK_K)
    mm = tl.arange(0, BLOCK_M)
    m_stride = M_BLOCKS * BLOCK_M
    for j in tl.static_range(M_BLOCKS):
        acc = tl.zeros((BLOCK_R, BLOCK_M), dtype=tl.float32)
        # a mel filter covers a band of bins: only the blocks of bins that its block touches
        for kb in range(tl.load(k_blocks_ptr + j), tl.load(k_blocks_ptr + M_BLOCKS + j)):
            k = kb * BLOCK_K + kk[None, :]
            inside = (r < rows) & (k < bins)
            src = spec_ptr + 2 * (r * bins + k)
            re = tl.load(src, mask=inside, other=0.0)
            im = tl.load(src + 1, mask=inside, other=0.0)
            w = tl.load(weights_ptr + (kb * BLOCK_K + kk[:, None]) * m_stride + j * BLOCK_M + mm)
            acc = tl.dot(re * re + im * im, w, acc, input_precision=PRECISION)
        m = j * BLOCK_M + mm[None, :]
        tl.store(out_ptr + r * n_mels + m, acc, mask=(r < rows) & (m < n_mels))


MEL_BLOCK_R = 64
MEL_BLOCK_K = 32
MEL_BLOCK_M = 16


class MelTiles(NamedTuple):
    """A mel basis (F, bins) as `frame_power_packed(mel=...)` reads it (`mel_tiles`)."""

    weights: torch.Tensor  # (bins padded to MEL_BLOCK_K, F padded to MEL_BLOCK_M) float32
    k_blocks: torch.Tensor  # (2, F blocks) int32: each block of mels' first, last + 1 bin block
    n_mels: int
    bins: int


def mel_tiles(basis: torch.Tensor, device: torch.device | str = "cpu") -> MelTiles:
    """The basis transposed and zero-padded to blocks of MEL_BLOCK_K bins by MEL_BLOCK_M mels,
    and for each block of mels the range of blocks of bins where its filters are nonzero: a
    triangular filter spans a narrow band, so most blocks are zero and the kernel skips them.
    Made on the host from the basis there (reading it back from a GPU would sync), then
    moved to `device`."""
    basis = basis.detach().to(torch.float32).cpu()
    n_mels, bins = basis.shape
    m_blocks = triton.cdiv(n_mels, MEL_BLOCK_M)
    weights = torch.zeros(triton.cdiv(bins, MEL_BLOCK_K) * MEL_BLOCK_K, m_blocks * MEL_BLOCK_M)
    weights[:bins, :n_mels] = basis.T
    k_blocks = torch.zeros(2, m_blocks, dtype=torch.int32)
    for j in range(m_blocks):
        used = torch.nonzero(basis[j * MEL_BLOCK_M : (j + 1) * MEL_BLOCK_M].any(0))
        if used.numel():
            k_blocks[0, j] = int(used[0]) // MEL_BLOCK_K
            k_blocks[1, j] = int(used[-1]) // MEL_BLOCK_K + 1
    return MelTiles(weights.to(device), k_blocks.to(device), n_mels, bins)


def _mel_precision(device: torch.device) -> str:
    """Three TF32 products on tensor cores where the GPU has them (compute capability 8 on),
    which keeps float32's accuracy; float32 FMAs elsewhere (older GPUs, Triton's interpreter),
    which are slower than the power kernel then cuBLAS (docs/PERFORMANCE.md)."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 8:
        return "tf32x3"
    return "ieee"


def frame_power_packed(
    wave: torch.Tensor,
    lengths: torch.Tensor,
    noise: torch.Tensor | None,
    dither: float,
    preemph: float,
    window: torch.Tensor,
    hop: int,
    n_fft: int,
    rows: torch.Tensor,
    begin: torch.Tensor | None = None,
    mel: MelTiles | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """wave (B, S) float32 on a GPU, zero past lengths (B,) int64; noise (B, S) or None -> the
    power spectrum of `wave + dither * noise` after pre-emphasis, as FeatureExtractor computes
    it with `preemphasis` and `power_spectrum`, packed: utterance b's frames in rows
    starts[b] .. starts[b] + rows[b] - 1 of one (sum(rows), n_fft // 2 + 1) float32 tensor.
    With `begin` (B,) int64, row b's samples are wave[b, begin[b] :][: lengths[b]] (a trimmed
    region read where it lies, rather than shifted to the start first), and the noise's stay
    at noise[b, : lengths[b]].

    rows (B,) int64 on the host: the rows each utterance gets, at least its number of frames
    (1 + lengths // hop; a row past them is zero; every row at 1 + S // hop is the
    reference's padded layout). Returns the power, the frames (B,) int64 and
    the starts (B,) int64, both on the GPU; sync-free. The FFT runs over the total rounded up
    to FFT_FRAME_BUCKET frames per utterance, so that batches of nearby totals share a plan.

    With `mel` (`mel_tiles`), the power is projected on that basis in the kernel that squares
    the spectrum and never written out: the mel energies (sum(rows), F) float32 come back
    instead. Their products skip the basis's zero blocks and run on tensor cores as three TF32
    products each, which keeps float32's accuracy; the sums run in another order than a matrix
    product's."""
    wave = wave.contiguous()
    lengths = lengths.contiguous()
    batch, width = wave.shape
    win = window.numel()
    if n_fft & (n_fft - 1) or win > n_fft:
        raise ValueError(f"n_fft {n_fft} must be a power of two of at least the window's {win}")
    rows = rows.to(torch.int64).cpu()
    if rows.shape != (batch,):
        raise ValueError(f"rows has shape {tuple(rows.shape)}, the batch {batch}")
    bins = n_fft // 2 + 1
    if mel is not None and mel.bins != bins:
        raise ValueError(f"the mel basis has {mel.bins} bins, the spectrum {bins}")
    total = int(rows.sum())
    bucket = FFT_FRAME_BUCKET * batch
    fft_rows = max(triton.cdiv(total, bucket), 1) * bucket
    starts = torch.cumsum(rows, 0) - rows
    # one upload of both, which the host does not wait for
    layout = to_device(torch.cat([starts, rows]), wave.device, torch.int64).view(2, batch)
    frames = torch.empty(fft_rows, n_fft, dtype=torch.float32, device=wave.device)
    frames[total:].zero_()  # the bucket's rows past the utterances': transformed, never read
    _frames_kernel[(batch, triton.cdiv(max(int(rows.max()), 1), FRAMES_PER_PROGRAM))](
        wave,
        noise.contiguous() if noise is not None else wave,
        begin.contiguous() if begin is not None else lengths,
        lengths,
        layout,
        window.contiguous(),
        frames,
        width,
        float(dither),
        float(preemph),
        HOP=hop,
        WIN=win,
        N_FFT=n_fft,
        FRAMES=FRAMES_PER_PROGRAM,
        CHUNK=min(FRAME_CHUNK, n_fft),
        HAS_DITHER=noise is not None,
        HAS_BEGIN=begin is not None,
        num_warps=FRAMES_NUM_WARPS,
        enable_fp_fusion=False,  # one rounding per operation, as torch's kernels round
    )
    spec = torch.view_as_real(torch.fft.rfft(frames))  # (fft_rows, bins, 2)
    # a row count below an utterance's frames would drop its last frames: say so in what the
    # features' consumers read rather than let them read the next utterance's rows
    frame_counts = torch.minimum(lengths // hop + 1, layout[1])
    if mel is not None:
        out = torch.empty(total, mel.n_mels, dtype=torch.float32, device=wave.device)
        _power_mel_kernel[(max(triton.cdiv(total, MEL_BLOCK_R), 1),)](
            spec,
            mel.weights,
            mel.k_blocks,
            out,
            total,
            bins,
            mel.n_mels,
            BLOCK_R=MEL_BLOCK_R,
            BLOCK_K=MEL_BLOCK_K,
            BLOCK_M=MEL_BLOCK_M,
            M_BLOCKS=mel.k_blocks.shape[1],
            PRECISION=_mel_precision(wave.device),
            num_warps=4,
        )
        return out, frame_counts, layout[0]
    power = torch.empty(total, bins, dtype=torch.float32, device=wave.device)
    n = total * bins
    _power_kernel[(max(triton.cdiv(n, POWER_BLOCK), 1),)](
        spec, power, n, BLOCK=POWER_BLOCK, num_warps=4, enable_fp_fusion=False
    )
    return power, frame_counts, layout[0]
