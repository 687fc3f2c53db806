"""Fused RNN-T joint network + loss: the (B, T, U+1, V) logits never exist.

What it computes, for every lattice cell (b, t, u) with t < T_b and u <= U_b:

    h = dropout(relu(f[b, t] + g[b, u]))              (H,)   f (B, T, H), g (B, U+1, H)
    logits = h @ W^T + bias                           (V,)   W (V, H) = Joint.fc.weight
    lp_blank = logits[blank] - logsumexp(logits),  lp_label = logits[y[b, u]] - logsumexp(logits)

and the per-utterance loss -log P(y_b | x_b) from the forward/backward variables over those
(B, T, U+1) values. It is exact: every cell and every class is used (no pruning).

The lattice rows are walked in chunks of whole utterances whose h (rows x H), logits and
d(logits) (rows x V, one buffer) and dh fit in CHUNK_BYTES; nothing proportional to
B T (U+1) H or B T (U+1) V is ever allocated. Per chunk:
    1. `hidden_kernel` writes h = keep * relu(f + g) (zero rows outside each utterance's
       lattice) and, when gradients are wanted, one bit per unit saying h != 0 (the gate).
       Dropout's 1 / (1 - p) is left to the fp32 steps: it rides on the row kernels'
       multiply-adds and on the final gradient scales, and costs no pass.
    2. cuBLAS: logits / (1 - p) = h @ W^T (tensor cores, fp32 accumulation).
    3. `logit_stats_kernel` keeps each row's log-sum-exp and blank / target log-probabilities
       (the 1 / (1 - p) and the bias applied in fp32).
    On Hopper GPUs with fp16 operands (`gemm` 'auto' or 'sm90'), 2-3 are the CUDA C++ GEMM of
    rnnt.kernels.logits_gemm, whose epilogue leaves per-row softmax partials beside the same
    logits, and `stats_from_partials_kernel`: no second pass over the logits.
    4. `lattice_kernel` (or, where it builds, the same walk in CUDA C++:
       rnnt.kernels.lattice_walk) walks the chunk's utterances' lattices by anti-diagonals
       (alpha and beta in parallel programs), `posteriors_kernel` turns them into each row's
       occupancy and blank / label transition posteriors.
    5. `dlogits_kernel` overwrites the logits with d(logits) = occupancy * softmax - blank /
       label posteriors; cuBLAS forms dW += d(logits)^T h (fp32) and dh = d(logits) W; and
       `grad_fg_kernel` reduces dh * gate over u (df) and over t (dg).
Steps 4-5 need the loss's output gradient only as a factor when that is one number (reduction
'mean' or 'sum', what training uses): they run in the forward pass, with unit weights, and the
backward scales the stored df, dg, dW, d bias. Three GEMMs of rows x H x V, h generated once.
With per-utterance output gradients (reduction 'none') the forward stops after step 3 and a
whole-batch lattice; the backward redoes steps 1-2 and runs 5 with each utterance's weight:
four GEMMs. All row-wise kernels read per-row vectors, so none of their loads waits on
another. The lattice values are addressed by row (no (B, T, U+1) copies) except the walk's: its
inputs, alpha and beta are diagonal-major (`joint_loss_kernels._diagonals`), so a step's loads
and stores are contiguous; the stats kernels store the inputs there.

Where the time goes, the designs measured slower and the numbers behind the constants below
are in docs/PERFORMANCE.md ("Fused joint + loss at (192, 204, 44)" and "The fused loss's
choices, with their numbers").

Row layouts: without host lengths the rows are the padded (B, T_max, U_max + 1) box (rows past
T_b or U_b are zeros, computed anyway). With `host_lens` (the input pipeline knows the lengths on
the host, so no sync) they are packed: only sum_b T_b (U_b + 1) rows.

The kernels and their dropout hash are rnnt.kernels.joint_loss_kernels'; `dropout_keep_mask`
materialises the mask and `joint_hidden` the h rows, for tests. Runs on CUDA tensors, and on
CPU tensors under the Triton interpreter (TRITON_INTERPRET=1).
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import os
from typing import NamedTuple

import torch
import triton

from rnnt.host_lengths import HostLens, check_host_lens, to_device
from rnnt.kernels import lattice_walk, logits_gemm
from rnnt.kernels.joint_loss_kernels import (
    LOG2E,
    SKEW_ALIGN,
    dlogits_kernel,
    gate_asm,
    grad_fg_kernel,
    hidden_kernel,
    keep_mask_kernel,
    lattice_kernel,
    logit_stats_kernel,
    posteriors_kernel,
    stats_from_partials_kernel,
)

# Bytes of h, logits and dh per chunk of utterances. Each chunk walks its lattice after its
# stats, a latency-bound wait, so fewer chunks are faster; this many keeps the extra memory of
# a (192, 204, 44) fp16 step under 2 GB (docs/PERFORMANCE.md "Chunk size").
CHUNK_BYTES = 3 << 29
# Launch shapes of the memory-bound kernels: the fastest of sweeps at (192, 204, 44) and on a
# ragged LibriSpeech batch of 192 (docs/PERFORMANCE.md "Launch shapes").
# The row-wise kernels take blocks of whole rows (classes padded to BN >= V): (elements per
# block, warps, persistent programs per SM).
STATS_LAUNCH = (1024, 1, 48)  # `logit_stats_kernel`: one row per warp
PARTIALS_ROWS = 128  # rows per program of `stats_from_partials_kernel`
DLOGITS_LAUNCH = (1024, 4, 8)  # `dlogits_kernel`
HIDDEN_U_TILE = 16  # label states per program of `hidden_kernel` (one frame, all of H)
HIDDEN_WARPS = 4
LATTICE_WARPS = 1  # `lattice_kernel`: the diagonal's lane shifts stay inside one warp
FG_H_TILE = 64  # hidden units per program of the df / dg reduction
# Warps per df / dg program: 2, so each thread keeps twice the loads in flight of 4 warps.
FG_WARPS = 2
FG_PROGRAMS_PER_SM = 16  # frame splits are added until the reduction has this many programs
MAX_FG_U_TILE = 128  # label states per program there; more than this and df uses atomics
# Loads software-pipelined this many loop iterations deep (`tl.range` stages): each program
# then has the next blocks' loads in flight while it works on the current one.
STATS_STAGES = 2
DLOGITS_STAGES = 3
FG_STAGES = 3


def _hp(h: int) -> int:
    return max(16, triton.next_power_of_2(h))


def _threshold(p: float) -> int:
    # The drop probability is p rounded to a multiple of 2^-15 (at most 1.6e-5 off); the
    # kept units are still scaled by 1 / (1 - p), as torch's dropout does.
    return round(p * 2**15)


def _compiled(device: torch.device) -> bool:
    """Whether the kernels are compiled for `device` (else the Triton interpreter runs them,
    which cannot run inline assembly)."""
    return device.type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1"


def dropout_keep_mask(seed: int, b: int, t: int, u1: int, h: int, p: float, device) -> torch.Tensor:
    """The fused kernels' dropout keep mask, (B, T, U+1, H) bool, for tests and debugging."""
    out = torch.empty(b, t, u1, h, dtype=torch.int8, device=device)
    bu = 8
    keep_mask_kernel[(b, t, triton.cdiv(u1, bu))](
        out, seed, t, u1, h, _threshold(p), BU=bu, HP=_hp(h)
    )
    return out.bool()


def joint_hidden(f, g, f_lens, target_lens, p: float, seed: int, packed_math: bool = True):
    """The fused kernels' h rows of the padded lattice, (B, T, U+1, H) in f's dtype:
    keep * relu(f + g) (without dropout's 1 / (1 - p)), 0 past each utterance's lengths; for
    tests. packed_math=False takes the fp32 path that half precision skips on CUDA."""
    bsz, t_max, hid = f.shape
    u1 = g.shape[1]
    out = torch.empty(bsz, t_max, u1, hid, dtype=f.dtype, device=f.device)
    lens = (x.to(f.device, torch.int32).contiguous() for x in (f_lens, target_lens))
    unused = torch.zeros(1, dtype=torch.int32, device=f.device)  # offsets, labels, cells
    hidden_kernel[(bsz * t_max, triton.cdiv(u1, HIDDEN_U_TILE))](
        f.contiguous(),
        g.contiguous(),
        *lens,
        unused,
        unused,
        out,
        unused,
        unused,
        0,
        unused,
        unused,
        0,
        0,
        t_max,
        u1,
        hid,
        1,
        seed,
        _threshold(p),
        BU=HIDDEN_U_TILE,
        HP=_hp(hid),
        DROPOUT=p > 0,
        PACKED=False,
        GATE_ASM=gate_asm(f.dtype, f.device, hid) if packed_math and _compiled(f.device) else "",
        LABELS=False,
        GATES=False,
        num_warps=HIDDEN_WARPS,
    )
    return out


def _mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b with fp32 output: half inputs keep tensor-core speed, the sum keeps fp32 range."""
    if a.dtype == torch.float32:
        return a @ b
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


def _add_mm_fp32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc (fp32) += a @ b, accumulated by the GEMM itself where it can (no product temporary,
    no separate add)."""
    if a.dtype == torch.float32:
        torch.addmm(acc, a, b, out=acc)
    elif a.is_cuda:
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc += a.float() @ b.float()


class _Layout:
    """Where each utterance's lattice rows (t, u) live, and their chunks of whole utterances.

    Padded: utterance b owns rows [b T (U+1), (b+1) T (U+1)), the (B, T, U+1) box, so rows
    past T_b or U_b are computed too, and row = lattice cell. Packed (lengths known on the
    host, and some padding to skip): it owns T_b (U_b + 1) rows from starts[b], nothing else:
    cell (t, u) is row starts[b] + t (U_b + 1) + u. `starts` (B + 1,) are host ints (the
    kernels read a device copy).
    """

    def __init__(self, host_lens, bsz, t_max, u1):
        sizes = [t_max * u1] * bsz
        if host_lens is not None:
            sizes = [t * (u + 1) for t, u in zip(*host_lens, strict=True)]
        # Without padding the packed rows are the padded ones, whose kernels skip the row
        # tables and the lengths' loads (docs/PERFORMANCE.md "The padded layout when nothing is
        # padded").
        self.starts = [0, *itertools.accumulate(sizes)]  # C loop: this runs before any launch
        self.packed = self.starts[-1] < bsz * t_max * u1
        # the walk's diagonal-major copies (`joint_loss_kernels._diagonals`): T_b + U_b + 1
        # diagonals per utterance
        align = SKEW_ALIGN.value
        if self.packed:
            skew = [(t + u + 1) * ((u + align) // align * align) for t, u in zip(*host_lens)]
            self.skew_starts = [0, *itertools.accumulate(skew)]
            self.skew_cells = self.skew_starts[-1]
        else:
            self.skew_starts = []  # the kernels compute the padded layout's
            self.skew_cells = bsz * (t_max + u1) * ((u1 + align - 1) // align * align)

    @property
    def n_rows(self) -> int:
        return self.starts[-1]

    def chunks(self, rows_per_chunk: int) -> list[tuple[int, int]]:
        """(b0, bc) of consecutive utterances whose rows fit in rows_per_chunk (at least one)."""
        out, b0 = [], 0
        bsz = len(self.starts) - 1
        while b0 < bsz:
            # the last utterance whose rows end within the budget (bisect: this runs before the
            # first launch, once per chunk instead of once per utterance)
            b1 = bisect.bisect_right(self.starts, self.starts[b0] + rows_per_chunk, b0 + 2) - 1
            out.append((b0, b1 - b0))
            b0 = b1
        return out


class _Chunk(NamedTuple):
    """Utterances [b0, b0 + bc), whose n lattice rows start at batch row row0, and the views
    of the chunk buffers that hold their rows."""

    b0: int
    bc: int
    row0: int
    n: int
    h: torch.Tensor  # (n, H) keep * relu(f + g)
    logits: torch.Tensor  # (n, V), overwritten by d(logits) when `dl` is the same buffer
    dl: torch.Tensor  # (n, V)
    dh: torch.Tensor | None  # (n, H); None without gradients
    partials: torch.Tensor | None  # (n, V / 128, 2) of the sm90 logits GEMM; None with cuBLAS
    gates: torch.Tensor | None  # (n, HP / 8) uint8 gate bits of h; None without gradients


class _Chunks:
    """Lattice rows in chunks of whole utterances, with the per-chunk buffers reused.

    A chunk's rows of h (H wide) and of logits (V wide) are the only buffers proportional to
    H or V, bounded by CHUNK_BYTES whatever the batch (or one utterance, if that is larger).
    """

    def __init__(self, layout, hid, v, dtype, device, backward, partials):
        logits_dtype = _logits_dtype(dtype)
        separate_dl = backward and logits_dtype != dtype
        part_width = v // logits_gemm.TILE_N * 2
        gate_bytes = _hp(hid) // 8
        per_row = (
            hid * dtype.itemsize * (2 if backward else 1)
            + v * logits_dtype.itemsize
            + (v * dtype.itemsize if separate_dl else 0)
            + (part_width * 4 if partials else 0)
            + (gate_bytes if backward else 0)
        )
        starts = layout.starts
        self.spans = [
            (b0, bc, starts[b0], starts[b0 + bc] - starts[b0])
            for b0, bc in layout.chunks(max(1, CHUNK_BYTES // per_row))
        ]
        self.max_bc = max(bc for _, bc, _, _ in self.spans)
        rows = max(1, max(n for _, _, _, n in self.spans))
        self.h = torch.empty(rows, hid, dtype=dtype, device=device)
        self.logits = torch.empty(rows, v, dtype=logits_dtype, device=device)
        # d(logits) overwrite the logits in place unless those are wider (bf16 inputs)
        self.dl = torch.empty(rows, v, dtype=dtype, device=device) if separate_dl else self.logits
        self.dh = torch.empty(rows, hid, dtype=dtype, device=device) if backward else None
        self.gates = None
        if backward:
            self.gates = torch.empty(rows, gate_bytes, dtype=torch.uint8, device=device)
        self.partials = None
        if partials:
            self.partials = torch.empty(rows, part_width // 2, 2, device=device)
        self.rows = rows

    def __iter__(self):
        for b0, bc, row0, n in self.spans:
            dh = None if self.dh is None else self.dh[:n]
            part = None if self.partials is None else self.partials[:n]
            gates = None if self.gates is None else self.gates[:n]
            yield _Chunk(b0, bc, row0, n, self.h[:n], self.logits[:n], self.dl[:n], dh, part, gates)


class _Problem:
    """One call's inputs as the kernels take them: contiguous operands, int32 lengths on the
    device, the row layout (and its device row offsets `offs`), the per-row target labels'
    buffer (filled by the hidden kernel), the dropout constants and the logits GEMM (`gemm`:
    one of rnnt.kernels.logits_gemm.GEMMS)."""

    def __init__(
        self, f, g, weight, bias, f_lens, targets, target_lens, host_lens, blank, p_drop, seed, gemm
    ):
        self.bsz, self.t_max, self.hid = f.shape
        self.u1 = g.shape[1]
        self.v = weight.shape[0]
        self.dev = f.device
        self.f, self.g, self.weight, self.bias = (x.contiguous() for x in (f, g, weight, bias))
        self.targets = targets.contiguous()
        self.blank = blank
        self.has_dropout = p_drop > 0.0
        self.gate_scale = 1.0 / (1.0 - p_drop) if self.has_dropout else 1.0
        self.dropout = (seed, _threshold(p_drop))  # the hidden kernel's args
        self.compiled = _compiled(self.dev)  # not the interpreter: inline assembly allowed
        self.gate_asm = gate_asm(f.dtype, self.dev, self.hid) if self.compiled else ""
        self.layout = layout = _Layout(host_lens, self.bsz, self.t_max, self.u1)
        if max(layout.n_rows, layout.skew_cells) >= 2**31:
            raise ValueError(
                f"fused joint loss: {layout.n_rows} lattice rows (B T (U+1)) and "
                f"{layout.skew_cells} diagonal-major cells must each stay below 2^31 (int32 "
                "offsets); split the batch"
            )
        if host_lens is None:
            self.f_lens = f_lens.to(self.dev, torch.int32).contiguous()
            self.target_lens = target_lens.to(self.dev, torch.int32).contiguous()
            self.offs = self.soffs = self.f_lens  # never packed: no kernel reads the offsets
        else:
            # one host-to-device copy for the lengths and the row offsets (each costs host time
            # before the first launch, and the GPU waits for that); each section starts 16 bytes
            # aligned whatever the batch size (see `label_rows`)
            sections = [host_lens[0], host_lens[1]]
            if layout.packed:
                sections += [layout.starts, layout.skew_starts]
            host, starts = [], []
            for section in sections:
                starts.append(len(host))
                host += [*section, *[0] * (-len(section) % 4)]
            lens = to_device(host, self.dev)
            self.f_lens = lens[starts[0] : starts[0] + self.bsz]
            self.target_lens = lens[starts[1] : starts[1] + self.bsz]
            # int32 row and diagonal-major offsets (B + 1,) of the packed layout; the padded
            # layout's kernels never read them, and get any int32 pointer
            if layout.packed:
                self.offs = lens[starts[2] : starts[2] + self.bsz + 1]
                self.soffs = lens[starts[3] : starts[3] + self.bsz + 1]
            else:
                self.offs = self.soffs = self.f_lens
        # per row: target label, diagonal-major cell (`hidden_kernel` writes both); each its
        # own allocation, like every buffer a kernel takes: Triton specializes a kernel on its
        # pointers' 16-byte alignment, and rows of one (2, n_rows) tensor would change it with
        # each batch's lattice size (a compile in the middle of the run)
        self.label_rows = torch.empty(layout.n_rows, dtype=torch.int32, device=self.dev)
        self.dest_rows = torch.empty(layout.n_rows, dtype=torch.int32, device=self.dev)
        self.sm90 = self.compiled and logits_gemm.use_sm90(
            gemm, self.dev, f.dtype, self.hid, self.v
        )
        self.cuda_walk = (
            self.compiled and self.u1 <= lattice_walk.MAX_U1 and lattice_walk.available(self.dev)
        )
        self.bias32 = None  # the sm90 GEMM's fp32 bias, made after the first launch

    def chunks(self, backward: bool, stats: bool) -> _Chunks:
        """Chunk buffers for `logits` (with `stats`: the forward's, which also fill what `stats`
        reads) and, if `backward`, for the gradients."""
        partials = self.sm90 and stats
        return _Chunks(self.layout, self.hid, self.v, self.f.dtype, self.dev, backward, partials)

    def logits(self, chunk: _Chunk, forward: bool = True) -> None:
        """h and logits of a chunk; in the `forward`, also its rows' target labels and what
        `stats` reads (the backward's recomputation needs neither)."""
        b0, bc, row0, n, h, logits = chunk[:6]
        layout = self.layout
        hidden_kernel[(bc * self.t_max, triton.cdiv(self.u1, HIDDEN_U_TILE))](
            self.f,
            self.g,
            self.f_lens,
            self.target_lens,
            self.offs,
            self.soffs,
            h,
            h if chunk.gates is None else chunk.gates,
            self.targets,
            self.targets.stride(0),
            self.label_rows,
            self.dest_rows,
            b0,
            row0,
            self.t_max,
            self.u1,
            self.hid,
            self.v,
            *self.dropout,
            BU=HIDDEN_U_TILE,
            HP=_hp(self.hid),
            DROPOUT=self.has_dropout,
            PACKED=layout.packed,
            GATE_ASM=self.gate_asm,
            LABELS=forward,
            GATES=chunk.gates is not None,
            num_warps=HIDDEN_WARPS,
        )
        w_t = self.weight.t()
        if forward and self.sm90:
            if self.bias32 is None:
                # not before the first launch: a synchronized call's GPU waits for that
                self.bias32 = self.bias.float()
            logits_gemm.logits_with_partials(
                h,
                self.weight,
                self.bias32,
                self.gate_scale * LOG2E.value,
                logits,
                chunk.partials,
            )
        elif logits.dtype == h.dtype:
            torch.mm(h, w_t, out=logits)
        else:
            # bf16: the fp32 product is a temporary of the chunk's logits size, so a bf16 step
            # holds about one more logits chunk than CHUNK_BYTES accounts for.
            logits.copy_(_mm_fp32(h, w_t))

    def stats(self, chunk: _Chunk, lattice: _Lattice) -> None:
        """The chunk rows' log-sum-exp and transition log-probabilities, from its logits."""
        row0, n, logits = chunk.row0, chunk.n, chunk.logits
        if self.sm90:
            n_tiles = self.v // logits_gemm.TILE_N
            stats_from_partials_kernel[(triton.cdiv(n, PARTIALS_ROWS),)](
                chunk.partials,
                logits,
                self.bias,
                self.label_rows,
                self.dest_rows,
                lattice.lse,
                lattice.skew_blank,
                lattice.skew_label,
                row0,
                n,
                self.v,
                self.blank,
                self.gate_scale,
                NT=n_tiles,
                NTP=triton.next_power_of_2(n_tiles),
                BR=PARTIALS_ROWS,
                num_warps=4,
            )
            return
        br, bn, warps, programs = _row_launch(STATS_LAUNCH, self.v, n, self.dev)
        logit_stats_kernel[(programs,)](
            logits,
            self.bias,
            self.label_rows,
            self.dest_rows,
            lattice.lse,
            lattice.skew_blank,
            lattice.skew_label,
            row0,
            n,
            self.v,
            self.blank,
            self.gate_scale,
            BR=br,
            BN=bn,
            EVEN=bn == self.v,
            STAGES=STATS_STAGES,
            num_warps=warps,
        )


class _Lattice:
    """Lattice values of a batch: per row of the layout the log-sum-exp and the posteriors
    (fp32); per diagonal-major cell (`joint_loss_kernels._diagonals`) the transition
    log-probabilities (fp32) and alpha and beta (fp64); log P per utterance (fp64).
    """

    def __init__(self, prob: _Problem):
        self.prob = prob
        rows, cells, dev = prob.layout.n_rows, prob.layout.skew_cells, prob.dev
        # separate allocations: see `_Problem.label_rows`
        self.lse, self.occ, self.w_blank, self.w_label = (
            torch.empty(rows, device=dev) for _ in range(4)
        )
        # cells no move enters stay unset (no kernel reads them); the CUDA walk reads up to
        # OVERREAD cells past the last diagonal
        self.skew_blank, self.skew_label = (
            torch.empty(cells + lattice_walk.OVERREAD, device=dev) for _ in range(2)
        )
        self.alpha, self.beta = (
            torch.empty(cells, dtype=torch.float64, device=dev) for _ in range(2)
        )
        self.log_lik = torch.empty(prob.bsz, dtype=torch.float64, device=dev)
        self.block_u = _label_tile(prob.u1)

    def solve(self, b0: int, bc: int) -> None:
        """alpha, beta and log P of utterances [b0, b0 + bc), whose transition
        log-probabilities the stats kernels must have stored."""
        prob = self.prob
        packed = prob.layout.packed
        if prob.cuda_walk:
            lattice_walk.walk(
                self.skew_blank,
                self.skew_label,
                prob.soffs,
                prob.f_lens,
                prob.target_lens,
                self.alpha,
                self.beta,
                self.log_lik,
                b0,
                bc,
                prob.t_max,
                prob.u1,
                packed,
            )
            return
        lattice_kernel[(bc, 2)](
            self.skew_blank,
            self.skew_label,
            prob.soffs,
            prob.f_lens,
            prob.target_lens,
            self.alpha,
            self.beta,
            self.log_lik,
            b0,
            prob.t_max,
            prob.u1,
            BLOCK_U=self.block_u,
            PACKED=packed,
            HW_LOG2=prob.compiled,
            num_warps=LATTICE_WARPS,
        )

    def posteriors(self, b0: int, bc: int, weights: torch.Tensor | None = None):
        """(occupancy, w_blank, w_label) rows, those of utterances [b0, b0 + bc) filled in (times
        weights[b] when given)."""
        prob = self.prob
        bt = max(1, 2048 // self.block_u)
        posteriors_kernel[(bc, triton.cdiv(prob.t_max, bt))](
            self.skew_blank,
            self.skew_label,
            prob.offs,
            prob.soffs,
            prob.f_lens,
            prob.target_lens,
            self.alpha,
            self.beta,
            self.log_lik,
            self.log_lik if weights is None else weights,
            self.occ,
            self.w_blank,
            self.w_label,
            b0,
            prob.t_max,
            prob.u1,
            BT=bt,
            BLOCK_U=self.block_u,
            PACKED=prob.layout.packed,
            WEIGHTED=weights is not None,
        )
        return self.occ, self.w_blank, self.w_label


class _Gradients:
    """fp32 gradients of the posterior-weighted loss w.r.t. the joint's pre-gate f and g, W and
    bias, accumulated chunk by chunk from the chunk's h and logits: d(logits) in place of the
    logits, then dW += d(logits)^T h, dh = d(logits) W and the df / dg reductions."""

    def __init__(self, prob: _Problem, chunks: _Chunks):
        dev = prob.dev
        hid, v, u1, t_max = prob.hid, prob.v, prob.u1, prob.t_max
        self.dtypes = tuple(x.dtype for x in (prob.f, prob.g, prob.weight, prob.bias))
        self.gate_scale = prob.gate_scale
        self.dl_launch = _row_launch(DLOGITS_LAUNCH, v, chunks.rows, dev)
        self.bu = min(MAX_FG_U_TILE, _label_tile(u1))
        fg_tiles = chunks.max_bc * triton.cdiv(hid, FG_H_TILE) * triton.cdiv(u1, self.bu)
        self.splits = max(1, min(t_max, triton.cdiv(FG_PROGRAMS_PER_SM * _num_sms(dev), fg_tiles)))
        self.max_bc = chunks.max_bc
        self.dw = torch.zeros(v, hid, dtype=torch.float32, device=dev)
        self.dbias_part = torch.zeros(self.dl_launch[3], v, dtype=torch.float32, device=dev)
        self.df = torch.zeros(prob.bsz, t_max, hid, dtype=torch.float32, device=dev)
        self.dg = torch.empty(prob.bsz, u1, hid, dtype=torch.float32, device=dev)
        self.dg_part = torch.empty(
            self.splits, chunks.max_bc, u1, hid, dtype=torch.float32, device=dev
        )

    def add(self, prob: _Problem, chunk: _Chunk, lse: torch.Tensor, posteriors) -> None:
        b0, bc, row0, n, h, logits, dl, dh = chunk[:8]
        br, bn, warps, programs = self.dl_launch
        dlogits_kernel[(programs,)](
            logits,
            dl,
            prob.bias,
            prob.label_rows,
            lse,
            *posteriors,
            self.dbias_part,
            row0,
            n,
            prob.v,
            prob.blank,
            prob.gate_scale,
            BR=br,
            BN=bn,
            EVEN=bn == prob.v,
            STAGES=DLOGITS_STAGES,
            num_warps=warps,
        )
        _add_mm_fp32(self.dw, dl.t(), h)
        torch.mm(dl, prob.weight, out=dh)
        t_per_split = triton.cdiv(prob.t_max, self.splits)
        grid = (bc, triton.cdiv(prob.hid, FG_H_TILE), self.splits * triton.cdiv(prob.u1, self.bu))
        grad_fg_kernel[grid](
            dh,
            chunk.gates,
            prob.f_lens,
            prob.target_lens,
            prob.offs,
            self.df,
            self.dg_part,
            b0,
            row0,
            self.max_bc,
            prob.t_max,
            prob.u1,
            prob.hid,
            t_per_split,
            BU=self.bu,
            BK=FG_H_TILE,
            HP=_hp(prob.hid),
            ATOMIC_DF=prob.u1 > self.bu,
            PACKED=prob.layout.packed,
            STAGES=FG_STAGES,
            num_warps=FG_WARPS,
        )
        # chunks hold whole utterances: each row of dg is written once
        torch.sum(self.dg_part[:, :bc], 0, out=self.dg[b0 : b0 + bc])

    def drop_scratch(self) -> None:
        """Free the per-chunk partial sums once every chunk is in (what `results` reads stays)."""
        self.dg_part = None

    def results(self, scale: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(df, dg, dW, d bias) times `scale` (a device scalar) in the operands' dtypes, with
        dropout's 1 / (1 - p) applied to df, dg and dW (h holds keep * relu(.) without it)."""
        gate = scale * self.gate_scale
        dbias = self.dbias_part.sum(0)
        grads = ((self.df, gate), (self.dg, gate), (self.dw, gate), (dbias, scale))
        # one kernel each: the product is cast as it is written
        return tuple(
            torch.mul(x, factor, out=torch.empty_like(x, dtype=dtype))
            for (x, factor), dtype in zip(grads, self.dtypes, strict=True)
        )


REDUCTIONS = ("none", "sum", "mean")


class _FusedJointLoss(torch.autograd.Function):
    """Two schedules over the same kernels.

    reduction 'sum' / 'mean' with gradients wanted: one pass. The output gradient of a scalar
    loss is one number, so each chunk's gradients can be formed right after its logits, before
    that gradient is known, and scaled in `backward`: per chunk h, logits, stats, the lattice
    of its utterances, d(logits), dW, dh, df / dg. Three GEMMs per chunk and h generated once.
    reduction 'none' (or no gradient wanted): the forward keeps only the per-row statistics;
    the backward, given one output gradient per utterance, recomputes h and the logits chunk by
    chunk (four GEMMs).
    """

    @staticmethod
    def forward(
        ctx,
        f,
        g,
        weight,
        bias,
        f_lens,
        targets,
        target_lens,
        host_lens,
        blank,
        p_drop,
        seed,
        reduction,
        one_pass,
        gemm,
    ):
        prob = _Problem(
            f, g, weight, bias, f_lens, targets, target_lens, host_lens, blank, p_drop, seed, gemm
        )
        chunks = prob.chunks(backward=one_pass, stats=True)
        lattice = grads = None
        for chunk in chunks:
            prob.logits(chunk)
            if lattice is None:
                # made once the first GEMM is queued, so the GPU is not idle while the host
                # allocates them (the time before the first launch is the call's latency)
                lattice = _Lattice(prob)
                grads = _Gradients(prob, chunks) if one_pass else None
            prob.stats(chunk, lattice)
            if one_pass:
                b0, bc = chunk[:2]
                lattice.solve(b0, bc)
                grads.add(prob, chunk, lattice.lse, lattice.posteriors(b0, bc))
        del chunks
        if one_pass:
            grads.drop_scratch()
        if not one_pass:
            lattice.solve(0, prob.bsz)
        nll = -lattice.log_lik.float()
        ctx.reduction, ctx.bsz = reduction, prob.bsz
        if one_pass:
            ctx.grads = grads
        else:
            # the operands go through save_for_backward (in-place changes are then caught)
            ctx.save_for_backward(prob.f, prob.g, prob.weight, prob.bias)
            prob.f = prob.g = prob.weight = prob.bias = None
            ctx.prob, ctx.lattice = prob, lattice
        if reduction == "sum":
            return nll.sum()
        return nll.mean() if reduction == "mean" else nll

    @staticmethod
    def backward(ctx, grad_out):
        if ctx.reduction != "none":
            scale = grad_out.float() / (ctx.bsz if ctx.reduction == "mean" else 1)
            return (*ctx.grads.results(scale), *[None] * 10)
        prob = ctx.prob
        prob.f, prob.g, prob.weight, prob.bias = ctx.saved_tensors
        # The kernels work on weight_b = go_b / max|go| so that half-precision d(logits) stay in
        # [-1, 1] and never shrink into subnormals under a 1/B mean; max|go| is applied to the
        # fp32 results at the end (a device tensor: no host sync).
        go = grad_out.float()
        go_max = go.abs().amax().clamp_min(1e-30)
        lattice = ctx.lattice
        posteriors = lattice.posteriors(0, prob.bsz, weights=go / go_max)
        chunks = prob.chunks(backward=True, stats=False)  # logits recomputed only
        grads = _Gradients(prob, chunks)
        for chunk in chunks:
            prob.logits(chunk, forward=False)
            grads.add(prob, chunk, lattice.lse, posteriors)
        return (*grads.results(go_max), *[None] * 10)


def _logits_dtype(dtype: torch.dtype) -> torch.dtype:
    # bf16 logits (8-bit mantissa) would cost ~0.05 in a logit of 10; fp16 ones ~0.005.
    return torch.float32 if dtype == torch.bfloat16 else dtype


def _label_tile(u1: int) -> int:
    """Label states a program of the lattice, posterior and df / dg kernels spans (a
    compile-time size: each tile is a kernel variant of its own)."""
    return max(16, triton.next_power_of_2(u1))


def warm_up_label_states(longest_tokens: int) -> list[int]:
    """U + 1 of the stand-in batches that compile the kernel variants a training run uses:
    those of the two largest label tiles up to the training set's longest transcript. The
    other kernel arguments that vary by batch are not specialized on, and every buffer is 16
    bytes aligned. A batch's longest transcript, the longest of many, lies in those tiles
    unless the transcripts are far shorter than the longest."""
    top = _label_tile(longest_tokens + 1)
    return sorted({top, _label_tile(top // 2)})


def _row_launch(launch, v: int, rows: int, device) -> tuple[int, int, int, int]:
    """(rows per block, classes per block, warps, programs) of a row-wise kernel."""
    elements, warps, per_sm = launch
    bn = max(16, triton.next_power_of_2(v))
    br = max(1, elements // bn)
    return br, bn, warps, max(1, min(triton.cdiv(rows, br), per_sm * _num_sms(device)))


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 2  # the CPU interpreter: a small count still exercises multi-program paths
    return torch.cuda.get_device_properties(device).multi_processor_count


def fused_joint_loss(
    f: torch.Tensor,
    g: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    f_lens: torch.Tensor,
    targets: torch.Tensor,
    target_lens: torch.Tensor,
    blank: int,
    dropout_p: float = 0.0,
    seed: int | None = None,
    host_lens: HostLens | None = None,
    reduction: str = "none",
    gemm: str = "auto",
) -> torch.Tensor:
    """RNN-T loss of the joint fc(dropout(relu(f + g))), fused: per utterance (B,) fp32 with
    reduction 'none', else their 'sum' or 'mean' (a scalar).

    f (B, T, H), g (B, U+1, H), weight (V, H), bias (V,) in one float dtype (fp32, fp16 or
    bf16); f_lens (B,) in [1, T]; targets (B, U) in [0, V); target_lens (B,) in [0, U].
    Device lengths are trusted (checking them would cost a host sync). `seed` fixes the dropout
    mask (drawn from torch's CPU generator when None, so torch.manual_seed makes runs
    repeatable).

    host_lens: the same (f_lens, target_lens) as host integers, when the caller has them (the
    input pipeline does). The lattice rows are then packed: only sum_b T_b (U_b + 1) rows are
    computed instead of the padded B T (U+1), and these host lengths are the ones used (copied
    to the device without a sync); they are checked against the shapes.

    'sum' and 'mean' compute the gradients in the forward pass, when any operand needs one
    (one pass over the lattice instead of two: see `_FusedJointLoss`).

    gemm: the forward's logits GEMM, 'auto', 'cublas' or 'sm90' (rnnt.kernels.logits_gemm).
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if gemm not in logits_gemm.GEMMS:
        raise ValueError(f"gemm must be one of {logits_gemm.GEMMS}, got {gemm!r}")
    if not (f.dtype == g.dtype == weight.dtype == bias.dtype):
        raise TypeError(
            f"fused joint loss needs one dtype for f, g, weight and bias, got {f.dtype}, "
            f"{g.dtype}, {weight.dtype}, {bias.dtype}"
        )
    if not f.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            f"loss.backend 'fused' runs on CUDA tensors (got {f.device}); use "
            "loss.backend=reference on CPU (TRITON_INTERPRET=1 runs the kernels on CPU for tests)"
        )
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {dropout_p}")
    bsz, u1 = g.shape[0], g.shape[1]
    if targets.shape != (bsz, u1 - 1):
        # the kernels read targets[b, u] for u < U_b without bounds of their own
        raise ValueError(
            f"targets must be (B, U) = ({bsz}, {u1 - 1}) for g of shape {tuple(g.shape)}, got "
            f"{tuple(targets.shape)}"
        )
    if seed is None:
        seed = int(torch.randint(0, 2**31 - 1, (1,)).item()) if dropout_p > 0 else 0
    if host_lens is not None:
        host_lens = check_host_lens(host_lens, f.shape[0], f.shape[1], g.shape[1] - 1)
    one_pass = (
        reduction != "none"
        and torch.is_grad_enabled()
        and any(x.requires_grad for x in (f, g, weight, bias))
    )
    # Triton launches on the current device, and the CUDA C++ launchers make theirs current:
    # run on f's device and give the caller's back (the backward runs on the autograd engine's
    # thread for f's device)
    with torch.cuda.device(f.device) if f.is_cuda else contextlib.nullcontext():
        return _FusedJointLoss.apply(
            f,
            g,
            weight,
            bias,
            f_lens,
            targets,
            target_lens,
            host_lens,
            blank,
            float(dropout_p),
            seed,
            reduction,
            one_pass,
            gemm,
        )


def resolve(
    gemm: str, device: torch.device, dtype: torch.dtype, hidden: int, vocab: int
) -> tuple[str, str]:
    """("fused(gemm=..., walk=...)", reason): the logits GEMM and the lattice walk that
    `fused_joint_loss` runs for these operands under `gemm` (building their CUDA code now)."""
    if not _compiled(device):
        return "fused(gemm=torch, walk=triton)", "Triton's interpreter runs the kernels"
    g, g_why = logits_gemm.resolve(gemm, device, dtype, hidden, vocab)
    w, w_why = lattice_walk.resolve(device)
    return f"fused(gemm={g}, walk={w})", f"gemm: {g_why}; walk: {w_why}"
