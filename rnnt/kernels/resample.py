"""Triton windowed-sinc resampling of a padded waveform batch, one ratio per utterance.

The maths is `rnnt.data.features.resample` (the reference, which this must equal): output
sample n of row b reads input position src = (n + 0.5) / ratio_b - 0.5 and sums the taps
floor(src) + t, t in (-half, half], weighted by a Hann-windowed sinc low-passed at
min(ratio_b, 1). The reference builds a (B, N, taps) gather in float64; here each program
computes a block of output samples of one row in registers. The input position is formed in
float64 (at 300,000 samples float32 would misplace it by up to 0.02 samples); the weights
need only its fractional part, in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 512


# The widths change with every batch; specialised (Triton's default: a variant for multiples
# of 16) each new combination would compile anew in the loader's process, stalling the input
# pipeline for a second or more in its first batches.
@triton.jit(do_not_specialize=["width", "out_width"])
def _resample_kernel(
    wave_ptr,  # (B, width) float32
    lengths_ptr,  # (B,) int64: valid input samples per row
    out_lengths_ptr,  # (B,) int64: valid output samples per row
    ratio_ptr,  # (B,) float64: output rate / input rate
    out_ptr,  # (B, out_width) float32
    width,
    out_width,
    HALF: tl.constexpr,
    LOBES: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ratio = tl.load(ratio_ptr + row)
    length = tl.load(lengths_ptr + row)
    out_length = tl.load(out_lengths_ptr + row)
    cutoff = tl.minimum(ratio, 1.0)
    src = (n.to(tl.float64) + 0.5) / ratio - 0.5
    base = tl.floor(src)
    frac = src - base
    first = base.to(tl.int64) - HALF + 1
    valid = n < out_length
    # The taps' angles pi * cutoff * (frac - t) step by -pi * cutoff from tap to tap: their sines
    # and cosines (and the Hann envelope's, at 1/LOBES of the angle) come from one sin/cos per
    # output sample and a rotation per tap (a few multiply-adds instead of two transcendental
    # calls), in float64 so that 2 x HALF rotations stay exact to float32.
    step = 3.141592653589793 * cutoff
    angle = step * (frac + HALF - 1)
    sin_a, cos_a = tl.sin(angle), tl.cos(angle)
    sin_e, cos_e = tl.sin(angle / LOBES), tl.cos(angle / LOBES)
    sin_s, cos_s = tl.sin(step), tl.cos(step)
    sin_se, cos_se = tl.sin(step / LOBES), tl.cos(step / LOBES)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for k in tl.static_range(0, 2 * HALF):
        idx = first + k
        # near zero the rotated sine keeps its absolute, not its relative, accuracy
        near_zero = tl.abs(angle) < 1e-6
        safe = tl.where(near_zero, 1.0, angle).to(tl.float32)
        sinc = tl.where(near_zero, 1.0, sin_a.to(tl.float32) / safe)
        envelope = 0.5 * (1.0 + cos_e.to(tl.float32))
        inside_window = tl.abs(angle) < 3.141592653589793 * LOBES
        weight = tl.where(inside_window, sinc * envelope, 0.0) * cutoff.to(tl.float32)
        inside = valid & (idx >= 0) & (idx < length)
        x = tl.load(wave_ptr + row * width + idx, mask=inside, other=0.0)
        acc += x * weight
        angle = angle - step
        sin_a, cos_a = sin_a * cos_s - cos_a * sin_s, cos_a * cos_s + sin_a * sin_s
        sin_e, cos_e = sin_e * cos_se - cos_e * sin_se, cos_e * cos_se + sin_e * sin_se
    tl.store(out_ptr + row * out_width + n, tl.where(valid, acc, 0.0), mask=n < out_width)


def resample_cuda(
    wave: torch.Tensor,
    lengths: torch.Tensor,
    out_lengths: torch.Tensor,
    ratio: torch.Tensor,
    out_width: int,
    half: int,
    lobes: int,
) -> torch.Tensor:
    """wave (B, S) float32 on a GPU -> (B, out_width) float32, zero past out_lengths."""
    wave = wave.contiguous()
    batch, width = wave.shape
    out = torch.empty(batch, out_width, dtype=torch.float32, device=wave.device)
    grid = (batch, triton.cdiv(out_width, BLOCK))
    _resample_kernel[grid](
        wave,
        lengths.contiguous(),
        out_lengths.contiguous(),
        ratio.contiguous(),
        out,
        width,
        out_width,
        HALF=half,
        LOBES=lobes,
        BLOCK=BLOCK,
    )
    return out
