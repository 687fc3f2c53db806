"""Triton log and per-utterance normalization of a mel batch: the end of
`rnnt.data.features.FeatureExtractor` on a GPU, in one kernel.

The reference clamps the mel energies to the floor, takes their log, and normalizes each
utterance's mel bin over its own frames with `normalize`: about ten element-wise and reduction
kernels, each reading or writing the whole (B, F, T) batch, and the stage's SM time adds to the
training step's in full (docs/PERFORMANCE.md). Here one program per utterance and group of bins
reads its energies three times (the sum, the centred sum of squares, the output; the log is
taken again each time rather than stored) and writes the features once.

The sums run in another order than torch's reductions, so the features differ from the
reference's by float32 rounding (about 1e-6); the clamp, the log and the formula are the
reference's, the sums taken from each bin's first frame (below).

The energies can also come packed, each utterance's frames in rows of their own one after the
other (`rnnt.kernels.frames.frame_power_packed`); the features are padded all the same.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BINS_PER_PROGRAM = 16
FRAMES_PER_LOOP = 64
NUM_WARPS = 4


@triton.jit(do_not_specialize=["frames", "bins"])
def _log_normalize_kernel(
    mel_ptr,  # (rows, bins) float32: mel energies, frame-major as the product leaves them
    starts_ptr,  # (B,) int64: the row of each utterance's first frame
    lengths_ptr,  # (B,) int64: each utterance's frames
    out_ptr,  # (B, frames, bins) float32
    frames,
    bins,
    floor,
    eps,
    BINS: tl.constexpr,
    FRAMES: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    f = tl.program_id(1) * BINS + tl.arange(0, BINS)[None, :]
    t0 = tl.arange(0, FRAMES)[:, None]
    length = tl.load(lengths_ptr + row)
    count = tl.maximum(length, 1).to(tl.float32)
    base = tl.load(starts_ptr + row) * bins
    out_base = row * frames * bins
    bin_ok = f < bins

    # the sums run over the log-energies less the first frame's: a bin at the floor throughout
    # (digital silence) then sums to exactly zero, where float32 sums of its constant would
    # leave a rounding residue that the division by sqrt(eps) multiplies by 316
    first = tl.log(tl.maximum(tl.load(mel_ptr + base + f, mask=bin_ok, other=1.0), floor))

    total = tl.zeros((1, BINS), dtype=tl.float32)
    for start in range(0, length, FRAMES):
        t = start + t0
        valid = (t < length) & bin_ok
        x = tl.load(mel_ptr + base + t * bins + f, mask=valid, other=1.0)
        shifted = tl.log(tl.maximum(x, floor)) - first
        total += tl.sum(tl.where(valid, shifted, 0.0), axis=0, keep_dims=True)
    mean = total / count

    squares = tl.zeros((1, BINS), dtype=tl.float32)
    for start in range(0, length, FRAMES):
        t = start + t0
        valid = (t < length) & bin_ok
        x = tl.load(mel_ptr + base + t * bins + f, mask=valid, other=1.0)
        centered = tl.where(valid, tl.log(tl.maximum(x, floor)) - first - mean, 0.0)
        squares += tl.sum(centered * centered, axis=0, keep_dims=True)
    scale = 1.0 / tl.sqrt(squares / count + eps)

    for start in range(0, frames, FRAMES):
        t = start + t0
        valid = (t < length) & bin_ok
        x = tl.load(mel_ptr + base + t * bins + f, mask=valid, other=1.0)
        centered = tl.log(tl.maximum(x, floor)) - first - mean
        tl.store(
            out_ptr + out_base + t * bins + f,
            tl.where(valid, centered * scale, 0.0),
            mask=(t < frames) & bin_ok,
        )


def log_normalize_cuda(
    mel: torch.Tensor,
    lengths: torch.Tensor,
    floor: float,
    eps: float,
    starts: torch.Tensor | None = None,
    frames: int | None = None,
) -> torch.Tensor:
    """mel (B, T, F) float32 energies, lengths (B,) int64 frames -> features (B, F, T): per
    utterance and bin, log(max(mel, floor)) normalized to zero mean and unit variance (plus
    `eps`) over the first `lengths` frames, zero past them, as
    `normalize(torch.log(torch.clamp(mel, min=floor)).transpose(1, 2), lengths)` computes it
    (the output has the reference's frame-major layout); sync-free.

    Packed energies: mel (rows, F) with utterance b's frames from row starts[b] (B,) int64 on,
    and `frames` the T of the (B, F, T) features."""
    mel = mel.contiguous()
    if starts is None:
        batch, frames, bins = mel.shape
        starts = torch.arange(batch, device=mel.device) * frames
    else:
        if frames is None:
            raise ValueError("packed energies (starts given) need the features' frames")
        batch, bins = starts.numel(), mel.shape[-1]
    out = torch.empty(batch, frames, bins, dtype=torch.float32, device=mel.device)
    _log_normalize_kernel[(batch, triton.cdiv(bins, BINS_PER_PROGRAM))](
        mel,
        starts.contiguous(),
        lengths.contiguous(),
        out,
        frames,
        bins,
        float(floor),
        float(eps),
        BINS=BINS_PER_PROGRAM,
        FRAMES=FRAMES_PER_LOOP,
        num_warps=NUM_WARPS,
    )
    return out.transpose(1, 2)
