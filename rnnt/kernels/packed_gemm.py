"""The wave LSTM stack's GEMMs over its real frames only (`model.encoder_gemms: packed`).

An LSTM stack's buffers are time-major: row r = t * B + b holds step t of batch row b, and it is
a real frame when t < lengths[b]. In a random batch of 192 LibriSpeech utterances padded to its
CUDA-graph bucket, about a third of the rows are padding (docs/PERFORMANCE.md, "The encoder's
GEMMs over real frames"). The stack's GEMMs outside the waves run over every row with cuBLAS,
whose sizes are fixed when a graph is captured; these Triton kernels read the lengths on the
device and skip the padding in tiles of rows, inside the same graph:

- `rows`: C = A @ B with one output row per frame (the first layer's input GEMM where it is
  hoisted out of the waves, for inputs wider than the hidden size, and the stack's input
  gradient). An output tile of rows with no real frame is
  stored as zeros without reading A or B. Zeros keep the padding finite: the waves still run
  those rows, and their gradient there is exactly zero only while every factor is finite.
- `weight_grad`: C = A^T @ B summed over the frames (each layer's weight gradients, A the gate
  gradients). The sum runs over the tiles of GRAD_TILE[2] consecutive batch rows that hold a
  real frame at their step; the gate gradients are exactly zero at the padding, so what it
  skips adds nothing.

A tile of rows is live when any of its rows is, so the rows should be ordered by length within
the batch (`rnnt.model.Encoder` sorts them): then the live tiles at step t are the first
ceil(n_t / rows) of the n_t real rows. In the batch's own order nearly every tile is live and
nothing is skipped, but the results are the same.

The plain matmuls (`DenseGemms` in rnnt/kernels/lstm_wave.py) are the reference these are
tested against; they sum in another order, so the two agree to rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Tiles (rows x columns x K), warps and pipeline stages. Triton's usual Hopper shapes for fp16;
# bench/encoder_gemms.py times them on the stack's real shapes.
ROWS_TILE = (64, 256, 64)
# Triton's interpreter runs one program at a time in Python: off the GPU, taller row tiles
# keep the CPU tests quick (the tests of the skipping pass small tiles of their own)
INTERPRETED_ROWS_TILE = (512, 256, 64)
ROWS_WARPS, ROWS_STAGES = 4, 3
GRAD_TILE = (128, 128, 64)  # (M, N, rows): the rows are the skip's granularity
GRAD_WARPS, GRAD_STAGES = 8, 3
GROUP_M = 8  # output tiles taken in groups of this many tile rows (see _tile_of)
SPLITS_PER_SM = 2  # weight_grad splits its frames until the grid has this many programs per SM


@triton.jit
def _tile_of(pid, num_m, num_n, GROUP: tl.constexpr):
    """Grouped order: programs that run together cover GROUP tile rows by a few tile columns,
    so that they read their A rows and B columns from L2 rather than from HBM."""
    width = GROUP * num_n
    first_m = (pid // width) * GROUP
    size_m = tl.minimum(num_m - first_m, GROUP)
    return first_m + (pid % width) % size_m, (pid % width) // size_m


@triton.jit
def _rows_gemm_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    len_ptr,
    n_rows,
    n_cols,
    k_dim,
    batch,
    stride_ar,
    stride_ak,
    stride_bk,
    stride_bn,
    stride_cr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP: tl.constexpr,
    STAGES: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_m, pid_n = _tile_of(tl.program_id(0), tl.cdiv(n_rows, BM), n_cols // BN, GROUP)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    in_range = rows < n_rows
    lengths = tl.load(len_ptr + rows % batch, mask=in_range, other=0)
    live = in_range & (rows // batch < lengths)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    if tl.max(live.to(tl.int32), axis=0) > 0:
        a_rows = a_ptr + rows.to(tl.int64)[:, None] * stride_ar
        b_cols = b_ptr + cols[None, :] * stride_bn
        for k0 in tl.range(0, k_dim, BK, num_stages=STAGES):
            ks = k0 + tl.arange(0, BK)
            a = tl.load(a_rows + ks[None, :] * stride_ak, mask=in_range[:, None], other=0.0)
            b = tl.load(b_cols + ks[:, None] * stride_bk)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
    c = c_ptr + rows.to(tl.int64)[:, None] * stride_cr + cols[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=in_range[:, None])


@triton.jit
def _weight_grad_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    starts_ptr,
    m_dim,
    n_cols,
    batch,
    splits,
    stride_ar,
    stride_br,
    stride_cs,
    stride_cm,
    N_TILES: tl.constexpr,
    TILES_P2: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BR: tl.constexpr,
    GROUP: tl.constexpr,
    STAGES: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_m, pid_n = _tile_of(tl.program_id(0), m_dim // BM, n_cols // BN, GROUP)
    split = tl.program_id(1)
    # The live (row tile j, step t) pairs, numbered j-major: tile j's steps 0 .. len_j - 1 are
    # numbers starts[j] .. starts[j + 1] - 1, so every iteration below reads live rows.
    tiles = tl.arange(0, TILES_P2)
    starts = tl.load(starts_ptr + tiles, mask=tiles <= N_TILES, other=2**30)
    total = tl.load(starts_ptr + N_TILES)
    first = (split * total) // splits
    last = ((split + 1) * total) // splits
    ms = pid_m * BM + tl.arange(0, BM)
    ns = pid_n * BN + tl.arange(0, BN)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for i in tl.range(first, last, num_stages=STAGES):
        tile = tl.sum((starts <= i).to(tl.int32), axis=0) - 1
        step = i - tl.sum(tl.where(tiles == tile, starts, 0), axis=0)
        rows = (step * batch + tile * BR).to(tl.int64) + tl.arange(0, BR)
        a = tl.load(a_ptr + rows[:, None] * stride_ar + ms[None, :])
        b = tl.load(b_ptr + rows[:, None] * stride_br + ns[None, :])
        acc = tl.dot(tl.trans(a), b, acc, input_precision=PRECISION)
    c = c_ptr + split * stride_cs + ms[:, None] * stride_cm + ns[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty))


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 2  # the interpreter: a small count still splits the frames
    return torch.cuda.get_device_properties(device).multi_processor_count


class PackedGemms:
    """The GEMMs of one stack's call over the frames before `lengths` (B,) (int, on the
    device, read there: no host sync). `rows_tile` and `grad_tile` override the module's
    tiles (tests use small ones). Row r of every (T * B, .) operand is step r // B of batch
    row r % B."""

    def __init__(
        self,
        lengths: torch.Tensor,
        steps: int,
        rows_tile: tuple[int, int, int] | None = None,
        grad_tile: tuple[int, int, int] | None = None,
    ) -> None:
        (self.batch,) = lengths.shape
        self.rows_tile = rows_tile or (ROWS_TILE if lengths.is_cuda else INTERPRETED_ROWS_TILE)
        self.grad_tile = grad_tile = grad_tile or GRAD_TILE
        grad_rows = grad_tile[2]
        if self.batch % grad_rows:
            raise ValueError(
                f"packed GEMMs: the batch ({self.batch} rows) must be a multiple of the weight "
                f"gradient's {grad_rows}-row tiles"
            )
        self.lengths = lengths.to(torch.int32).clamp(0, steps).contiguous()
        # each row tile's steps with a real frame, numbered as _weight_grad_kernel walks them
        tile_steps = self.lengths.view(-1, grad_rows).amax(1)
        self.starts = _tile_starts(tile_steps)
        self.n_tiles = self.batch // grad_rows

    def rows(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """a (T * B, K) @ b (K, N) -> (T * B, N) in a's dtype; rows past their utterance's
        length zero where their whole tile is."""
        n_rows, k_dim = a.shape
        n_cols = b.shape[1]
        bm, bn, bk = self.rows_tile
        bn, bk = _fitting("rows", n_cols, bn, "N"), _fitting("rows", k_dim, bk, "K")
        out = a.new_empty(n_rows, n_cols)
        grid = (triton.cdiv(n_rows, bm) * (n_cols // bn),)
        _rows_gemm_kernel[grid](
            a,
            b,
            out,
            self.lengths,
            n_rows,
            n_cols,
            k_dim,
            self.batch,
            a.stride(0),
            a.stride(1),
            b.stride(0),
            b.stride(1),
            out.stride(0),
            BM=bm,
            BN=bn,
            BK=bk,
            GROUP=GROUP_M,
            STAGES=ROWS_STAGES,
            PRECISION=_precision(a, b),
            num_warps=ROWS_WARPS,
        )
        return out

    def weight_grad(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """a (T * B, M)^T @ b (T * B, N) -> (M, N) in a's dtype, summed over the live row
        tiles (a must be zero at every padding row of them)."""
        m_dim, n_cols = a.shape[1], b.shape[1]
        bm, bn, br = self.grad_tile
        bm, bn = _fitting("weight_grad", m_dim, bm, "M"), _fitting("weight_grad", n_cols, bn, "N")
        if a.stride(1) != 1 or b.stride(1) != 1:
            raise ValueError("weight_grad: a and b need contiguous rows")
        tiles = (m_dim // bm) * (n_cols // bn)
        splits = max(1, min(16, triton.cdiv(SPLITS_PER_SM * _num_sms(a.device), tiles)))
        out_dtype = a.dtype if splits == 1 else torch.float32
        out = a.new_empty(splits, m_dim, n_cols, dtype=out_dtype)
        _weight_grad_kernel[(tiles, splits)](
            a,
            b,
            out,
            self.starts,
            m_dim,
            n_cols,
            self.batch,
            splits,
            a.stride(0),
            b.stride(0),
            out.stride(0),
            out.stride(1),
            N_TILES=self.n_tiles,
            TILES_P2=triton.next_power_of_2(self.n_tiles + 1),
            BM=bm,
            BN=bn,
            BR=br,
            GROUP=GROUP_M,
            STAGES=GRAD_STAGES,
            PRECISION=_precision(a, b),
            num_warps=GRAD_WARPS,
        )
        return out[0] if splits == 1 else out.sum(0).to(a.dtype)


def _tile_starts(counts: torch.Tensor) -> torch.Tensor:
    """[0, c0, c0 + c1, ...] as int32: where each tile's numbers start, and the total last."""
    starts = torch.zeros(counts.numel() + 1, dtype=torch.int32, device=counts.device)
    starts[1:] = counts.cumsum(0)
    return starts


def _precision(a: torch.Tensor, b: torch.Tensor) -> str:
    """tl.dot's input precision: fp32 operands in full fp32 (as torch's matmul by default, not
    TF32); the MMAs take fp16 and bf16 as they are."""
    if a.dtype != b.dtype or a.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(
            f"packed GEMMs: operands in one of float16, bfloat16 and float32, got {a.dtype} and "
            f"{b.dtype}"
        )
    return "ieee" if a.dtype == torch.float32 else "tf32"


def _fitting(what: str, size: int, tile: int, name: str) -> int:
    """The largest power-of-two tile up to `tile` that divides `size` (at least 16, what an
    MMA's K and N take)."""
    while tile > 16 and size % tile:
        tile //= 2
    if size % tile:
        raise ValueError(f"packed GEMMs: {what}'s {name} ({size}) must be a multiple of 16")
    return tile
