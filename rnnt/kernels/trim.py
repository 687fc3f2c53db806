"""Triton silence trim of a padded waveform batch: `rnnt.data.features.trim_silence` on a GPU.

The reference takes a float64 cumulative sum of the squared samples over each whole row and
subtracts it at every window start: about ten float64 passes over the (B, S) batch and an int64
index of the same size for the final shift, the largest part of the feature stage's GPU time
after the resampler. Here each program sums the windows of `WINDOW` consecutive starts from
two blocks of samples held in registers: with lo = x[i0, i0 + W) and hi = x[i0 + W, i0 + 2W),
the window at i0 + j sums to sum(lo^2) - prefix(lo^2)[j] + prefix(hi^2)[j], where prefix is
exclusive. The sums are float64 over at most 2W terms, so a quiet window next to a loud one
keeps its precision, as in the reference (float32 would lose it).

Two passes read the batch: the first finds each row's loudest window (and each block's), the
second the first and last window within the cutoff of it, summing only the first and last block
that holds such a window. A third writes the kept samples shifted to the row's start; the
feature stage skips it (`loud_regions_cuda`), and its framing reads them where they are.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

NUM_WARPS = 8
LOUD_BLOCK_SCAN = 128  # block maxima read at a time by the second pass's programs


@triton.jit
def _block_window_sums(wave_ptr, lengths_ptr, width, WINDOW: tl.constexpr):
    """This program's row and block, the (WINDOW,) starts of its windows, their float64 sums
    of squares, and the mask of the windows that lie inside the row's length."""
    row = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1).to(tl.int64)
    length = tl.load(lengths_ptr + row)
    lo_pos = block * WINDOW + tl.arange(0, WINDOW)
    hi_pos = lo_pos + WINDOW
    lo = tl.load(wave_ptr + row * width + lo_pos, mask=lo_pos < length, other=0.0).to(tl.float64)
    hi = tl.load(wave_ptr + row * width + hi_pos, mask=hi_pos < length, other=0.0).to(tl.float64)
    lo_sq = lo * lo
    hi_sq = hi * hi
    lo_prefix = tl.cumsum(lo_sq, 0) - lo_sq
    hi_prefix = tl.cumsum(hi_sq, 0) - hi_sq
    sums = tl.sum(lo_sq, 0) - lo_prefix + hi_prefix
    return row, block, lo_pos, sums, lo_pos <= length - WINDOW


# The widths change with every batch: not specialized on, so no batch compiles a variant.
@triton.jit(do_not_specialize=["width", "n_blocks"])
def _loudest_kernel(
    wave_ptr,  # (B, width) float32
    lengths_ptr,  # (B,) int64
    block_max_ptr,  # (B, n_blocks) float64: the largest window sum of each block of starts
    width,
    n_blocks,
    WINDOW: tl.constexpr,
):
    row, block, _, sums, valid = _block_window_sums(wave_ptr, lengths_ptr, width, WINDOW)
    # -1 where no window starts inside the row: no such block counts as loud in the second pass
    tl.store(block_max_ptr + row * n_blocks + block, tl.max(tl.where(valid, sums, -1.0), 0))


@triton.jit(do_not_specialize=["width", "n_blocks"])
def _loud_span_kernel(
    wave_ptr,  # (B, width) float32
    lengths_ptr,  # (B,) int64
    block_max_ptr,  # (B, n_blocks) float64: from _loudest_kernel
    threshold_ptr,  # (B,) float64: the window sum at which a window is loud
    first_ptr,  # (B, n_blocks) int64: the block's first loud start, or `width`
    last_ptr,  # (B, n_blocks) int64: the block's last loud start, or -1
    width,
    n_blocks,
    WINDOW: tl.constexpr,
    SCAN: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    threshold = tl.load(threshold_ptr + row)
    # Only the row's first and last loud block can hold its first and last loud window, and a
    # block is loud where its largest window sum reaches the threshold: the other programs
    # skip the sums (most of a row's blocks), and the result is the same.
    first_block = n_blocks
    last_block = -1
    for start in range(0, n_blocks, SCAN):
        index = start + tl.arange(0, SCAN)
        maxima = tl.load(block_max_ptr + row * n_blocks + index, mask=index < n_blocks, other=-1.0)
        loud_block = maxima >= threshold
        first_block = tl.minimum(first_block, tl.min(tl.where(loud_block, index, n_blocks), 0))
        last_block = tl.maximum(last_block, tl.max(tl.where(loud_block, index, -1), 0))
    first = tl.full((), 0, tl.int64) + width
    last = tl.full((), -1, tl.int64)
    if (block == first_block) | (block == last_block):
        _, _, pos, sums, valid = _block_window_sums(wave_ptr, lengths_ptr, width, WINDOW)
        loud = valid & (sums >= threshold)
        first = tl.min(tl.where(loud, pos, width), 0)
        last = tl.max(tl.where(loud, pos, -1), 0)
    tl.store(first_ptr + row * n_blocks + block, first)
    tl.store(last_ptr + row * n_blocks + block, last)


@triton.jit(do_not_specialize=["width"])
def _shift_kernel(
    wave_ptr,  # (B, width) float32
    begin_ptr,  # (B,) int64
    new_lengths_ptr,  # (B,) int64
    out_ptr,  # (B, width) float32
    width,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    pos = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    begin = tl.load(begin_ptr + row)
    keep = pos < tl.load(new_lengths_ptr + row)
    x = tl.load(wave_ptr + row * width + begin + pos, mask=keep, other=0.0)
    tl.store(out_ptr + row * width + pos, x, mask=pos < width)


def trim_silence_cuda(
    wave: torch.Tensor, lengths: torch.Tensor, cutoff_db: float, window: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """wave (B, S) float32 on a GPU, lengths (B,) int64 -> the kept samples shifted to the
    start, (B, S) float32 zero past them, and their lengths; `window` a power of two. Same
    contract, and the same regions, as `rnnt.data.features.trim_silence`; sync-free."""
    wave = wave.contiguous()
    batch, width = wave.shape
    begin, new_lengths = loud_regions_cuda(wave, lengths, cutoff_db, window)
    out = torch.empty_like(wave)
    shift_block = 1024
    _shift_kernel[(batch, triton.cdiv(width, shift_block))](
        wave, begin, new_lengths, out, width, BLOCK=shift_block, num_warps=4
    )
    return out, new_lengths


def loud_regions_cuda(
    wave: torch.Tensor, lengths: torch.Tensor, cutoff_db: float, window: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The regions `trim_silence_cuda` keeps, without the copy: (begin, lengths), (B,) int64
    each, for a consumer that reads `wave[b, begin[b] :][: lengths[b]]` where it is (the
    framing kernel); sync-free."""
    wave = wave.contiguous()
    lengths = lengths.contiguous()
    batch, width = wave.shape
    n_blocks = max(1, triton.cdiv(width - window + 1, window))
    grid = (batch, n_blocks)
    block_max = torch.empty(batch, n_blocks, dtype=torch.float64, device=wave.device)
    _loudest_kernel[grid](
        wave, lengths, block_max, width, n_blocks, WINDOW=window, num_warps=NUM_WARPS
    )
    # a window is loud at or above the loudest's power times the cutoff; the powers are the
    # sums over the same `window`, so the sums compare alike
    threshold = block_max.amax(dim=1) * 10.0 ** (cutoff_db / 10.0)
    first = torch.empty(batch, n_blocks, dtype=torch.int64, device=wave.device)
    last = torch.empty_like(first)
    _loud_span_kernel[grid](
        wave,
        lengths,
        block_max,
        threshold,
        first,
        last,
        width,
        n_blocks,
        WINDOW=window,
        SCAN=LOUD_BLOCK_SCAN,
        num_warps=NUM_WARPS,
    )
    short = lengths < window
    begin = torch.where(short, 0, first.amin(dim=1))
    end = torch.where(short, lengths, torch.minimum(last.amax(dim=1) + window, lengths))
    return begin, end - begin
