"""Triton windowed-sinc resampling of a padded waveform batch, one ratio per utterance.

The maths is `rnnt.data.features.resample` (the reference, which this must equal): output
sample n of row b reads input position src = (n + 0.5) / ratio_b - 0.5 and sums the input
samples near it, each weighted by a Hann-windowed sinc low-passed at c = min(ratio_b, 1):
w(x) = c sinc(c x) (1 + cos(pi c x / LOBES)) / 2 for |c x| < LOBES, x = src - index. The
reference builds a (B, N, taps) gather in float64; here each program computes a block of
output samples of one row in registers.

Only the input position is float64 (at 300,000 samples float32 would misplace it by up to
0.02 samples). Its offset from the nearest sample m, src = m + f with |f| <= 1/2, is exact
enough in float32, and so is everything after it. With x = f - t for tap m + t,
sin(pi c x) = sin(pi c f) cos(pi c t) - cos(pi c f) sin(pi c t), whose terms in t are
per-row tables; the envelope's cosine comes from the same identity. Only t = 0 brings x near
0, where sinc divides by it: that tap is sin(pi c f) / (pi c f) itself, while every other tap
has |x| >= 1/2, so the difference of products keeps float32's absolute accuracy and 1/x may
be the hardware's approximate one (a few 1e-7 relative).

The taps come in pairs, -t and +t: the table's cosines are even and its sines odd in t, so
one entry serves both, and one reciprocal of the pair's product (x at -t) (x at +t) gives
both reciprocals. A block whose taps all lie inside its row, as most do, reads them without
the per-tap bounds checks and their zero fill, about a tenth of the instructions.

The input may be int16 PCM: its taps are converted as they are read and the sum scaled by
2^-15, which gives the bits that the float32 of `wave * (1 / 32768)` gives (a power of two
scales every rounding alike), without a float32 copy of the batch (twice the int16's bytes
written, then read at every tap).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

BLOCK = 256
NUM_WARPS = 4


# The widths change with every batch; specialised (Triton's default: a variant for multiples
# of 16) each new combination would compile anew in the loader's process, stalling the input
# pipeline for a second or more in its first batches.
@triton.jit(do_not_specialize=["width", "out_width"])
def _resample_kernel(
    wave_ptr,  # (B, width) float32, or int16 PCM (PCM16)
    lengths_ptr,  # (B,) int64: valid input samples per row
    out_lengths_ptr,  # (B,) int64: valid output samples per row
    ratio_ptr,  # (B,) float64: output rate / input rate
    table_ptr,  # (B, 2 HALF + 1, 2) int64: tap_table's float32 pairs
    out_ptr,  # (B, out_width) float32
    width,
    out_width,
    HALF: tl.constexpr,
    LOBES: tl.constexpr,
    BLOCK: tl.constexpr,
    PCM16: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    first_n = tl.program_id(1).to(tl.int64) * BLOCK
    n = first_n + tl.arange(0, BLOCK)
    out_length = tl.load(out_lengths_ptr + row)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    # a block wholly past the row's end only writes zeros: random batches are about a third
    # padding, and the taps are the kernel's whole cost
    if first_n < out_length:
        acc = _resample_block(
            wave_ptr, lengths_ptr, ratio_ptr, table_ptr, row, n, width, HALF, LOBES, PCM16
        )
    tl.store(out_ptr + row * out_width + n, tl.where(n < out_length, acc, 0.0), mask=n < out_width)


@triton.jit
def _float_pair(bits):
    """The two float32 of an int64: (low word, high word), as a little-endian float32 pair."""
    low = bits.to(tl.int32).to(tl.float32, bitcast=True)
    high = (bits >> 32).to(tl.int32).to(tl.float32, bitcast=True)
    return low, high


@triton.jit
def _resample_block(
    wave_ptr,
    lengths_ptr,
    ratio_ptr,
    table_ptr,
    row,
    n,
    width,
    HALF: tl.constexpr,
    LOBES: tl.constexpr,
    PCM16: tl.constexpr,
):
    """(BLOCK,) float32 resampled samples at output positions n of `row` (see the module)."""
    ratio = tl.load(ratio_ptr + row)
    length = tl.load(lengths_ptr + row).to(tl.int32)
    cutoff = tl.minimum(ratio, 1.0)
    src = (n.to(tl.float64) + 0.5) / ratio - 0.5
    nearest = tl.floor(src + 0.5)
    f = src - nearest  # in [-1/2, 1/2]
    # from here float32: |f| <= 1/2 is exact enough, and so are the sines of small angles
    f32 = f.to(tl.float32)
    c32 = cutoff.to(tl.float32)
    first = nearest.to(tl.int32) - HALF
    # taps read first + k: one pointer, constant offsets
    taps_ptr = wave_ptr + row * width + first
    row_table = table_ptr + row * (2 * HALF + 1) * 2
    # most blocks read no tap outside their row: those skip the per-tap bounds checks
    inside = (tl.min(first, 0) >= 0) & (tl.max(first, 0) + 2 * HALF < length)
    if inside:
        acc = _sum_taps(taps_ptr, row_table, first, length, f32, c32, HALF, LOBES, PCM16, False)
    else:
        acc = _sum_taps(taps_ptr, row_table, first, length, f32, c32, HALF, LOBES, PCM16, True)
    if PCM16:
        # s / 32768 at every tap: scaling by a power of two commutes with each rounding of the
        # sum, so once at the end gives the same bits
        acc = acc * 0.000030517578125
    return acc


@triton.jit
def _sum_taps(
    taps_ptr,
    row_table,
    first,
    length,
    f32,
    c32,
    HALF: tl.constexpr,
    LOBES: tl.constexpr,
    PCM16: tl.constexpr,
    CHECKED: tl.constexpr,
):
    """The weighted sum of the taps around each output (see the module); CHECKED: some taps
    may lie outside the row and read as zero."""
    angle = 3.1415927 * c32 * f32
    sin_angle = tl.sin(angle)
    # c sinc(c x) = sin(pi c x) / (pi x): the cutoff cancels but in the sine, and the Hann
    # envelope's 1/2 and the 1/pi go into the two factors of the sine's difference of products
    half_sin_f = 0.15915494 * sin_angle
    half_cos_f = 0.15915494 * tl.cos(angle)
    sin_fe = tl.sin(angle / LOBES)
    cos_fe = tl.cos(angle / LOBES)
    # the centre tap: c sin(a) / a (c where a underflows)
    tiny = tl.abs(angle) < 1e-30
    centre_sinc = c32 * tl.where(tiny, 1.0, sin_angle / tl.where(tiny, 1.0, angle))
    # the centre tap first, then the taps at -t and +t together: their table entries are
    # one's (the cosines even, the sines odd in t) and one reciprocal serves both
    cos_te, _ = _float_pair(tl.load(row_table + 2 * HALF + 1))
    acc = _tap(taps_ptr, first, length, HALF, PCM16, CHECKED) * (
        centre_sinc * (0.5 * (1.0 + cos_fe * cos_te))
    )
    for t in tl.static_range(1, HALF + 1):
        # two float32 per 64-bit load: the loads, not the arithmetic, would bound the taps
        cos_t, sin_t = _float_pair(tl.load(row_table + 2 * (HALF + t)))
        cos_te, sin_te = _float_pair(tl.load(row_table + 2 * (HALF + t) + 1))
        even = 1.0 + cos_fe * cos_te
        envelope_ahead = even + sin_fe * sin_te
        envelope_behind = even - sin_fe * sin_te
        sine_even = half_sin_f * cos_t
        sine_odd = half_cos_f * sin_t
        # x = f -+ t, |x| >= 1/2 and x_ahead x_behind = f^2 - t^2 < 0: 1 / x_ahead =
        # -x_behind / |x_ahead x_behind| and back, through one approximate reciprocal square
        # root of the product's square (one instruction, a few 1e-7 relative)
        x_ahead = f32 - t
        x_behind = f32 + t
        product = x_ahead * x_behind
        inverse = tl.math.rsqrt(product * product)
        weight_ahead = -((sine_even - sine_odd) * envelope_ahead * x_behind) * inverse
        weight_behind = -((sine_even + sine_odd) * envelope_behind * x_ahead) * inverse
        if t >= LOBES - 1:
            # |c x| <= |t| + 1/2 < LOBES for every nearer tap: only these leave the window
            weight_ahead = tl.where(tl.abs(c32 * x_ahead) < LOBES, weight_ahead, 0.0)
            weight_behind = tl.where(tl.abs(c32 * x_behind) < LOBES, weight_behind, 0.0)
        acc += _tap(taps_ptr, first, length, HALF - t, PCM16, CHECKED) * weight_behind
        acc += _tap(taps_ptr, first, length, HALF + t, PCM16, CHECKED) * weight_ahead
    return acc


@triton.jit
def _tap(taps_ptr, first, length, k: tl.constexpr, PCM16: tl.constexpr, CHECKED: tl.constexpr):
    """The input samples at first + k as float32 (CHECKED: zero outside the row's length)."""
    if CHECKED:
        # one unsigned compare for 0 <= first + k < length; the output's own padding is
        # zeroed by the caller
        inside = (first + k).to(tl.uint32, bitcast=True) < length.to(tl.uint32, bitcast=True)
        sample = tl.load(taps_ptr + k, mask=inside, other=0)
    else:
        sample = tl.load(taps_ptr + k)
    if PCM16:
        sample = sample.to(tl.float32)  # the caller scales the sum by 2^-15
    return sample


def tap_table(ratio: torch.Tensor, half: int, lobes: int) -> torch.Tensor:
    """(B, 2 half + 1, 4) float32: cos and sin of pi c t and of pi c t / lobes for the taps
    t = -half..half, c = min(ratio, 1), computed in float64."""
    cutoff = ratio.to(torch.float64).clamp(max=1.0)
    t = torch.arange(-half, half + 1, device=ratio.device, dtype=torch.float64)
    angle = math.pi * cutoff[:, None] * t[None]
    parts = (angle.cos(), angle.sin(), (angle / lobes).cos(), (angle / lobes).sin())
    return torch.stack(parts, dim=-1).to(torch.float32).contiguous()


def resample_cuda(
    wave: torch.Tensor,
    lengths: torch.Tensor,
    out_lengths: torch.Tensor,
    ratio: torch.Tensor,
    out_width: int,
    half: int,
    lobes: int,
    block: int = BLOCK,
    num_warps: int = NUM_WARPS,
) -> torch.Tensor:
    """wave (B, S) float32 or int16 PCM on a GPU -> (B, out_width) float32, zero past
    out_lengths (int16 samples count as sample / 32768).

    Every input sample within `half` of an output's nearest input sample is a tap (those
    beyond the window weigh 0); `block` output samples per program on `num_warps` warps."""
    if wave.dtype not in (torch.float32, torch.int16):
        raise ValueError(f"wave is {wave.dtype}: the resampler reads float32 or int16 PCM")
    wave = wave.contiguous()
    batch, width = wave.shape
    out = torch.empty(batch, out_width, dtype=torch.float32, device=wave.device)
    grid = (batch, triton.cdiv(out_width, block))
    _resample_kernel[grid](
        wave,
        lengths.contiguous(),
        out_lengths.contiguous(),
        ratio.contiguous(),
        tap_table(ratio, half, lobes).view(torch.int64),
        out,
        width,
        out_width,
        HALF=half,
        LOBES=lobes,
        BLOCK=block,
        PCM16=wave.dtype == torch.int16,
        num_warps=num_warps,
    )
    return out
