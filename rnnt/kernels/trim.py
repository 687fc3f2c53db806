"""Triton silence trim of a padded waveform batch: `rnnt.data.features.trim_silence` on a GPU.

The reference takes a float64 cumulative sum of the squared samples over each whole row and
subtracts it at every window start: about ten float64 passes over the (B, S) batch and an int64
index of the same size for the final shift, the largest part of the feature stage's GPU time
after the resampler. Here the windows of `WINDOW` consecutive starts (a block of starts) are
summed from two blocks of samples held in registers: with lo = x[i0, i0 + W) and
hi = x[i0 + W, i0 + 2W), the window at i0 + j sums to sum(lo^2) + prefix(hi^2 - lo^2)[j], where
prefix is exclusive: one scan a block. The sums are float64 (a float32 sample's square is exact
there), so a quiet window next to a loud one keeps its precision, as in the reference (float32
would lose it).

Two passes read the batch. The first finds each block's loudest window; a program walks
`LOUDEST_GROUP` blocks of a row, each block's hi becoming the next one's lo, and stops at the
row's last window: the blocks of padding past it (random batches are about a third padding)
cost one store. The second, one program a row, takes the loudest of the row's block maxima,
finds the first and the last block that reaches the cutoff below it, and sums only those two
again for the first and the last loud window: the region to keep, begin and length. A third
kernel writes the kept samples shifted to the row's start; the feature stage skips it
(`loud_regions_cuda`), and its framing reads them where they are.

Both passes sum a block with the same code at the same launch width, so a block that the first
pass found loud has a window at the cutoff in the second.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

NUM_WARPS = 8
LOUDEST_GROUP = 4  # blocks of starts a program of the first pass walks
LOUD_BLOCK_SCAN = 128  # block maxima read at a time by the second pass


@triton.jit
def _squares(row_ptr, pos, length):
    """float64 squares of a row's samples at `pos`, zero past its length."""
    x = tl.load(row_ptr + pos, mask=pos < length, other=0.0).to(tl.float64)
    return x * x


@triton.jit
def _window_sums(lo_sq, lo_total, hi_sq):
    """The sums of squares of the windows starting at each position of lo's block, from the
    squares of that block (lo_sq, summing to lo_total) and of the next (hi_sq)."""
    step = hi_sq - lo_sq
    return lo_total + (tl.cumsum(step, 0) - step)


@triton.jit
def _block_window_sums(row_ptr, length, block, WINDOW: tl.constexpr):
    """(starts, float64 sums, inside the row) of the windows starting in one block."""
    pos = block * WINDOW + tl.arange(0, WINDOW)
    lo_sq = _squares(row_ptr, pos, length)
    sums = _window_sums(lo_sq, tl.sum(lo_sq, 0), _squares(row_ptr, pos + WINDOW, length))
    return pos, sums, pos <= length - WINDOW


# The widths change with every batch: not specialized on, so no batch compiles a variant.
@triton.jit(do_not_specialize=["width", "n_blocks"])
def _loudest_kernel(
    wave_ptr,  # (B, width) float32
    lengths_ptr,  # (B,) int64
    block_max_ptr,  # (B, n_blocks) float64: the largest window sum of each block of starts
    width,
    n_blocks,
    WINDOW: tl.constexpr,
    GROUP: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    first_block = tl.program_id(1).to(tl.int64) * GROUP
    length = tl.load(lengths_ptr + row)
    # windows start at 0 .. length - WINDOW: the row's blocks past the last start hold none,
    # which the second pass reads as -1 (never loud)
    row_blocks = tl.where(length >= WINDOW, (length - WINDOW) // WINDOW + 1, 0)
    todo = tl.minimum(tl.maximum(row_blocks - first_block, 0), GROUP).to(tl.int32)
    out = block_max_ptr + row * n_blocks + first_block
    g = tl.arange(0, GROUP)
    none = tl.full((GROUP,), -1.0, tl.float64)
    tl.store(out + g, none, mask=(g >= todo) & (first_block + g < n_blocks))
    if todo > 0:
        row_ptr = wave_ptr + row * width
        pos = first_block * WINDOW + tl.arange(0, WINDOW)
        lo_sq = _squares(row_ptr, pos, length)
        lo_total = tl.sum(lo_sq, 0)
        for i in range(todo):
            hi_sq = _squares(row_ptr, pos + WINDOW, length)
            sums = _window_sums(lo_sq, lo_total, hi_sq)
            tl.store(out + i, tl.max(tl.where(pos <= length - WINDOW, sums, -1.0), 0))
            lo_sq = hi_sq
            lo_total = tl.sum(hi_sq, 0)
            pos += WINDOW


@triton.jit(do_not_specialize=["width", "n_blocks"])
def _loud_span_kernel(
    wave_ptr,  # (B, width) float32
    lengths_ptr,  # (B,) int64
    block_max_ptr,  # (B, n_blocks) float64: from _loudest_kernel
    cutoff_ptr,  # (1,) float64: the loud windows' least power over the loudest's
    begin_ptr,  # (B,) int64: where the kept region starts
    kept_ptr,  # (B,) int64: its length
    width,
    n_blocks,
    WINDOW: tl.constexpr,
    SCAN: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    length = tl.load(lengths_ptr + row)
    maxima_ptr = block_max_ptr + row * n_blocks
    loudest = tl.full((), -1.0, tl.float64)
    for start in range(0, n_blocks, SCAN):
        index = start + tl.arange(0, SCAN)
        maxima = tl.load(maxima_ptr + index, mask=index < n_blocks, other=-1.0)
        loudest = tl.maximum(loudest, tl.max(maxima, 0))
    # the powers are the sums over the same window, so the sums compare alike
    threshold = loudest * tl.load(cutoff_ptr)
    first_block = n_blocks
    last_block = -1
    for start in range(0, n_blocks, SCAN):
        index = start + tl.arange(0, SCAN)
        maxima = tl.load(maxima_ptr + index, mask=index < n_blocks, other=-1.0)
        loud_block = maxima >= threshold
        first_block = tl.minimum(first_block, tl.min(tl.where(loud_block, index, n_blocks), 0))
        last_block = tl.maximum(last_block, tl.max(tl.where(loud_block, index, -1), 0))
    if length < WINDOW:  # no window: the row is kept whole
        tl.store(begin_ptr + row, tl.zeros((), tl.int64))
        tl.store(kept_ptr + row, length)
    else:
        row_ptr = wave_ptr + row * width
        pos, sums, valid = _block_window_sums(row_ptr, length, first_block, WINDOW)
        first = tl.min(tl.where(valid & (sums >= threshold), pos, width), 0)
        pos, sums, valid = _block_window_sums(row_ptr, length, last_block, WINDOW)
        last = tl.max(tl.where(valid & (sums >= threshold), pos, -1), 0)
        end = tl.minimum(last + WINDOW, length)
        tl.store(begin_ptr + row, first)
        tl.store(kept_ptr + row, end - first)


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
    block_max = torch.empty(batch, n_blocks, dtype=torch.float64, device=wave.device)
    group = LOUDEST_GROUP
    _loudest_kernel[(batch, triton.cdiv(n_blocks, group))](
        wave, lengths, block_max, width, n_blocks, WINDOW=window, GROUP=group, num_warps=NUM_WARPS
    )
    # the reference's float64 factor, as a kernel argument of a fill (a Python float would
    # reach the kernel as float32)
    cutoff = torch.full((1,), 10.0 ** (cutoff_db / 10.0), dtype=torch.float64, device=wave.device)
    begin = torch.empty(batch, dtype=torch.int64, device=wave.device)
    kept = torch.empty_like(begin)
    _loud_span_kernel[(batch,)](
        wave,
        lengths,
        block_max,
        cutoff,
        begin,
        kept,
        width,
        n_blocks,
        WINDOW=window,
        SCAN=LOUD_BLOCK_SCAN,
        num_warps=NUM_WARPS,
    )
    return begin, kept
