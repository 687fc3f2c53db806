"""Triton windowed-sinc resampling of a padded waveform batch, one ratio per utterance.

The maths is `rnnt.data.features.resample` (the reference, which this must equal): output
sample n of row b reads input position src = (n + 0.5) / ratio_b - 0.5 and sums the input
samples near it, each weighted by a Hann-windowed sinc low-passed at c = min(ratio_b, 1):
w(x) = c sinc(c x) (1 + cos(pi c x / LOBES)) / 2 for |c x| < LOBES, x = src - index. The
reference builds a (B, N, taps) gather in float64; here each program computes a block of
output samples of one row in registers.

Only what needs it is float64: the input position (at 300,000 samples float32 would misplace
it by up to 0.02 samples) and the sine and cosine of its offset from the nearest sample. The
taps are float32: with src = m + f (m the nearest sample, |f| <= 1/2) and x = f - t for tap
m + t, sin(pi c x) = sin(pi c f) cos(pi c t) - cos(pi c f) sin(pi c t), whose terms in t are
per-row tables. Only t = 0 brings x near 0, where sinc divides by it: that tap is
sin(pi c f) / (pi c f) itself, while every other tap has |x| >= 1/2, so the difference of
products keeps float32's absolute accuracy where it matters. The envelope's cosine comes from
the same identity.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

BLOCK = 256
NUM_WARPS = 8


# The widths change with every batch; specialised (Triton's default: a variant for multiples
# of 16) each new combination would compile anew in the loader's process, stalling the input
# pipeline for a second or more in its first batches.
@triton.jit(do_not_specialize=["width", "out_width"])
def _resample_kernel(
    wave_ptr,  # (B, width) float32
    lengths_ptr,  # (B,) int64: valid input samples per row
    out_lengths_ptr,  # (B,) int64: valid output samples per row
    ratio_ptr,  # (B,) float64: output rate / input rate
    table_ptr,  # (B, 2 HALF + 1, 4) float32: cos, sin of pi c t and of pi c t / LOBES
    out_ptr,  # (B, out_width) float32
    width,
    out_width,
    HALF: tl.constexpr,
    LOBES: tl.constexpr,
    BLOCK: tl.constexpr,
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
            wave_ptr, lengths_ptr, ratio_ptr, table_ptr, row, n, out_length, width, HALF, LOBES
        )
    tl.store(out_ptr + row * out_width + n, tl.where(n < out_length, acc, 0.0), mask=n < out_width)


@triton.jit
def _resample_block(
    wave_ptr,
    lengths_ptr,
    ratio_ptr,
    table_ptr,
    row,
    n,
    out_length,
    width,
    HALF: tl.constexpr,
    LOBES: tl.constexpr,
):
    """(BLOCK,) float32 resampled samples at output positions n of `row` (see the module)."""
    ratio = tl.load(ratio_ptr + row)
    length = tl.load(lengths_ptr + row)
    cutoff = tl.minimum(ratio, 1.0)
    src = (n.to(tl.float64) + 0.5) / ratio - 0.5
    nearest = tl.floor(src + 0.5)
    f = src - nearest  # in [-1/2, 1/2]
    angle = 3.141592653589793 * cutoff * f
    sin_angle = tl.sin(angle)
    sin_f = sin_angle.to(tl.float32)
    cos_f = tl.cos(angle).to(tl.float32)
    sin_fe = tl.sin(angle / LOBES).to(tl.float32)
    cos_fe = tl.cos(angle / LOBES).to(tl.float32)
    # the centre tap's sinc, sin(a) / a, from float64 (exactly 1 where a underflows)
    tiny = tl.abs(angle) < 1e-12
    centre_sinc = tl.where(tiny, 1.0, sin_angle / tl.where(tiny, 1.0, angle)).to(tl.float32)
    f32 = f.to(tl.float32)
    c32 = cutoff.to(tl.float32)
    pi_c = 3.141592653589793 * c32
    first = nearest.to(tl.int64) - HALF
    valid = n < out_length
    row_table = table_ptr + row * (2 * HALF + 1) * 4
    acc = tl.zeros(n.shape, dtype=tl.float32)
    for k in tl.static_range(0, 2 * HALF + 1):
        t = k - HALF
        cos_t = tl.load(row_table + 4 * k)
        sin_t = tl.load(row_table + 4 * k + 1)
        cos_te = tl.load(row_table + 4 * k + 2)
        sin_te = tl.load(row_table + 4 * k + 3)
        x = f32 - t
        if t == 0:
            sinc = centre_sinc
        else:
            sinc = (sin_f * cos_t - cos_f * sin_t) / (pi_c * x)
        envelope = 0.5 * (1.0 + cos_fe * cos_te + sin_fe * sin_te)
        weight = tl.where(tl.abs(c32 * x) < LOBES, sinc * envelope, 0.0) * c32
        idx = first + k
        inside = valid & (idx >= 0) & (idx < length)
        acc += tl.load(wave_ptr + row * width + idx, mask=inside, other=0.0) * weight
    return acc


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
    """wave (B, S) float32 on a GPU -> (B, out_width) float32, zero past out_lengths.

    Every input sample within `half` of an output's nearest input sample is a tap (those
    beyond the window weigh 0); `block` output samples per program on `num_warps` warps."""
    wave = wave.contiguous()
    batch, width = wave.shape
    out = torch.empty(batch, out_width, dtype=torch.float32, device=wave.device)
    grid = (batch, triton.cdiv(out_width, block))
    _resample_kernel[grid](
        wave,
        lengths.contiguous(),
        out_lengths.contiguous(),
        ratio.contiguous(),
        tap_table(ratio, half, lobes),
        out,
        width,
        out_width,
        HALF=half,
        LOBES=lobes,
        BLOCK=block,
        num_warps=num_warps,
    )
    return out
