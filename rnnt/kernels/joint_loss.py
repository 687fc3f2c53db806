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
    1. `_hidden_kernel` writes h = keep * relu(f + g) (zero rows outside each utterance's
       lattice) and, when gradients are wanted, one bit per unit saying h != 0 (the gate).
       Dropout's 1 / (1 - p) is left to the fp32 steps: it rides on the row kernels'
       multiply-adds and on the final gradient scales, and costs no pass.
    2. cuBLAS: logits / (1 - p) = h @ W^T (tensor cores, fp32 accumulation).
    3. `_logit_stats_kernel` keeps each row's log-sum-exp and blank / target log-probabilities
       (the 1 / (1 - p) and the bias applied in fp32).
    On Hopper GPUs with fp16 operands (`gemm` 'auto' or 'sm90'), 2-3 are the CUDA C++ GEMM of
    rnnt.kernels.logits_gemm, whose epilogue leaves per-row softmax partials beside the same
    logits, and `_stats_from_partials_kernel`: no second pass over the logits.
    4. `_lattice_kernel` (or, where it builds, the same walk in CUDA C++:
       rnnt.kernels.lattice_walk) walks the chunk's utterances' lattices by anti-diagonals
       (alpha and beta in parallel programs), `_posteriors_kernel` turns them into each row's
       occupancy and blank / label transition posteriors.
    5. `_dlogits_kernel` overwrites the logits with d(logits) = occupancy * softmax - blank /
       label posteriors; cuBLAS forms dW += d(logits)^T h (fp32) and dh = d(logits) W; and
       `_grad_fg_kernel` reduces dh * gate over u (df) and over t (dg).
Steps 4-5 need the loss's output gradient only as a factor when that is one number (reduction
'mean' or 'sum', what training uses): they run in the forward pass, with unit weights, and the
backward scales the stored df, dg, dW, d bias. Three GEMMs of rows x H x V, h generated once.
With per-utterance output gradients (reduction 'none') the forward stops after step 3 and a
whole-batch lattice; the backward redoes steps 1-2 and runs 5 with each utterance's weight:
four GEMMs. All row-wise kernels read per-row vectors, so none of their loads waits on
another. The lattice values are addressed by row (no (B, T, U+1) copies) except the walk's: its
inputs, alpha and beta are diagonal-major (`_diagonals`), so a step's loads and stores are
contiguous; the stats kernels store the inputs there.

Measured on one H200 (fp16, dropout 0.3, torch 2.11, Triton 3.6), forward + backward of the
mean with cuBLAS logits: (B, T, U) = (192, 204, 44) 12.9-13.1 ms over three runs and 1.68 GiB
extra (the two-pass schedule, measured with earlier kernels and 1 GiB chunks: 17.3 ms, 1.27
GiB; torchaudio's padded joint + loss: 67 ms, 11 GiB); a LibriSpeech-shaped ragged batch of
192, packed, 19.6-19.8 ms. Where the kernel time goes, and the fused designs measured slower
(logits held in registers, Triton GEMMs with the softmax in their epilogues (warp-specialized
too), the softmax written in place of the logits, d(logits) in a GEMM prologue, L2-sized
sub-chunks, lattices or all the memory-bound kernels on a side stream, a hand-written sm90 dh
GEMM forming d(logits) as its A operand), are in docs/PERFORMANCE.md, with the one faster
design found: the sm90 GEMM above, whose softmax epilogue overlaps the other warp group's MMAs
(12.29 ms at (192, 204, 44) against 13.01 with cuBLAS, ragged 18.85 / 19.73). With the CUDA
lattice walk and df / dg reading gate bits: 11.4 ms and 1.70 GiB at (192, 204, 44), 18.0 ms on
the ragged batch (bench/joint_loss.py, 2026-11-23).

Row layouts: without host lengths the rows are the padded (B, T_max, U_max + 1) box (rows past
T_b or U_b are zeros, computed anyway). With `host_lens` (the input pipeline knows the lengths on
the host, so no sync) they are packed: only sum_b T_b (U_b + 1) rows (2.57M lattice cells of a
5.90M-cell box on the ragged batch above).

Dropout: unit k of cell (b, t, u) is kept when its 15 bits of an integer hash of (seed, b,
cell, k // 2) are >= p * 2^15 (one hash per pair of units); `dropout_keep_mask` materialises
the mask and `joint_hidden` the h rows, for tests.
Runs on CUDA tensors, and on CPU tensors under the Triton interpreter (TRITON_INTERPRET=1).
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import itertools
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from rnnt.host_lengths import HostLens, check_host_lens, to_device
from rnnt.kernels import lattice_walk, logits_gemm

_NEG = -1e30  # log(0) stand-in, as in rnnt.loss
_KNEG = tl.constexpr(_NEG)  # the same, readable inside kernels
_LOG2E = tl.constexpr(1.4426950408889634)
_LN2 = tl.constexpr(0.6931471805599453)
# Lanes per diagonal of the lattice walk's diagonal-major inputs are a multiple of this, so a
# diagonal starts 16-byte aligned (vector loads of fp32 lanes).
SKEW_ALIGN = tl.constexpr(4)

# Bytes of h, logits and dh per chunk of utterances. Each chunk walks its lattice after its
# stats, at a latency-bound cost per chunk, so fewer chunks are faster; 1.5 GiB keeps the extra
# memory of a step at (192, 204, 44) fp16 at 1.68 GiB (issue 7 allows 2 GB). Synchronized
# calls on an H200, (192, 204, 44) / ragged LibriSpeech batch of 192: 1 GiB 13.4-13.6 /
# 21.0-21.1 ms, 1.25 GiB 13.3-13.5 / 20.3, 1.5 GiB 13.1-13.2 / 19.9-20.0, 1.625 GiB 13.1-13.2 /
# 20.2-20.5 (two runs).
CHUNK_BYTES = 3 << 29
# Launch shapes of the memory-bound kernels (swept on an H200, fp16, at (192, 204, 44) and on
# a ragged LibriSpeech batch of 192; these are the fastest on both).
# The row-wise kernels take blocks of whole rows (classes padded to BN >= V): (elements per
# block, warps, persistent programs per SM).
STATS_LAUNCH = (1024, 1, 48)  # `_logit_stats_kernel`: one row per warp
PARTIALS_ROWS = 128  # rows per program of `_stats_from_partials_kernel`
DLOGITS_LAUNCH = (1024, 4, 8)  # `_dlogits_kernel`
HIDDEN_U_TILE = 16  # label states per program of `_hidden_kernel` (one frame, all of H)
HIDDEN_WARPS = 4
LATTICE_WARPS = 1  # `_lattice_kernel`: the diagonal's lane shifts stay inside one warp
FG_H_TILE = 64  # hidden units per program of the df / dg reduction
# Warps per df / dg program: 2, so each thread keeps twice the loads in flight of 4 warps.
# Probes on an H200, one chunk, BU = 64 / 128 rows x 64 units per program: reading h, 0.286 ->
# 0.230 ms at (192, 204, 44) and flat on the ragged batch (0.328 / 0.329); reading the gate
# bits, 0.30 -> 0.17 and 0.36 -> 0.29 ms.
FG_WARPS = 2
FG_PROGRAMS_PER_SM = 16  # frame splits are added until the reduction has this many programs
MAX_FG_U_TILE = 128  # label states per program there; more than this and df uses atomics
# Loads software-pipelined this many loop iterations deep (`tl.range` stages): each program
# then has the next blocks' loads in flight while it works on the current one. Against plain
# loops: d(logits) 2.04 -> 1.84 ms at (192, 204, 44); df / dg, together with its move from 32-
# to 64-unit slices, 1.42 -> 1.24 ms there and 3.11 -> 1.96 ms on a ragged LibriSpeech batch.
STATS_STAGES = 2
DLOGITS_STAGES = 3
FG_STAGES = 3


@triton.jit
def _mix(x):
    # A 32-bit integer hash (multiply / xor-shift rounds): a counter-based generator several
    # times cheaper than Philox. The hidden-unit kernels are bound by these integer ops (h is
    # regenerated in the backward pass), so each hash also serves two units.
    x = ((x >> 16) ^ x) * 0x45D9F3B
    x = ((x >> 16) ^ x) * 0x45D9F3B
    return (x >> 16) ^ x


@triton.jit
def _pair_bits(seed, b, t, u, U1, H, HP: tl.constexpr):
    """(M, HP // 2) hashes of (seed, b[m], t[m], u[m], j): unit pair j = (2j, 2j + 1) of cell
    (b[m], t[m], u[m])."""
    key = _mix((seed + b * 0x27D4EB2F).to(tl.uint32, bitcast=True))
    j = tl.arange(0, HP // 2)
    pair = ((t * U1 + u)[:, None] * ((H + 1) // 2) + j[None, :]).to(tl.uint32, bitcast=True)
    return _mix(pair ^ key[:, None])


@triton.jit
def _keep(seed, b, t, u, U1, H, drop_thr, HP: tl.constexpr):
    """Keep mask (M, HP) of units k < HP of cells (b[m], t[m], u[m]): units 2j and 2j + 1 take
    bits 0-14 and 16-30 of their pair's hash, kept when that 15-bit number is >= p * 2^15.
    (15, not 16: `_ASM_GATE` then compares both halves of a hash with one subtraction.)"""
    bits = _pair_bits(seed, b, t, u, U1, H, HP)
    return tl.interleave(bits & 0x7FFF, (bits >> 16) & 0x7FFF).to(tl.int32) >= drop_thr


@triton.jit
def _logaddexp(a, b, HW_LOG2: tl.constexpr):
    """log(e^a + e^b) = max + ln 2 log2(1 + 2^(-|a - b| log2 e)) of fp64 a, b: the max and the
    sum in fp64, the correction (in [0, ln 2]) in fp32 with one exp2 and one log2 on the
    lattice walk's critical path. HW_LOG2: the log2 as the MUFU instruction (its argument is in
    [1, 2], where it is good to 2^-22), not libdevice's polynomial, which is some 20 dependent
    FMAs; the interpreter cannot run the inline assembly."""
    top = tl.maximum(a, b)
    x = 1.0 + tl.exp2(-tl.abs(a - b).to(tl.float32) * _LOG2E)
    if HW_LOG2:
        lg = tl.inline_asm_elementwise(
            "lg2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        lg = tl.log2(x)
    return top + lg.to(tl.float64) * _LN2


@triton.jit
def _utterance_rows(b, u_len, offs_ptr, T, U1, PACKED: tl.constexpr):
    """(first row, rows per frame) of utterance b's lattice: cell (t, u) is row first + t
    stride + u (int64). Packed: from offs[b], U_b + 1 per frame; padded: the (B, T, U+1) box."""
    if PACKED:
        return tl.load(offs_ptr + b).to(tl.int64), (u_len + 1).to(tl.int64)
    return b.to(tl.int64) * T * U1, (U1 + 0 * u_len).to(tl.int64)


@triton.jit
def _diagonals(b, u_len, soffs_ptr, T, U1, PACKED: tl.constexpr):
    """(first cell, width) of utterance b's values in the lattice walk's diagonal-major layout:
    cell (t, u) at first + (t + u) width + u (int64), so a diagonal's cells are contiguous (in
    the rows, (t, u) with u fastest, they lie U_b + 1 apart, and each of the walk's T_b + U_b
    sequential steps waited on scattered loads and stores). Each diagonal is SKEW_ALIGN-aligned.
    Packed: from soffs[b], U_b + 1 lanes rounded up; padded: (T + U + 1) diagonals of the box's
    U + 1 lanes rounded up.

    The transition log-probabilities are stored at the cell that their move enters: lp_blank[t,
    u] at (t + 1, u), lp_label[t, u] at (t, u + 1), the next lane; so the walk's step to
    diagonal n reads both from diagonal n, lane u (alpha), or from diagonal n + 1 (beta)."""
    if PACKED:
        width = (u_len + SKEW_ALIGN) // SKEW_ALIGN * SKEW_ALIGN
        return tl.load(soffs_ptr + b).to(tl.int64), width.to(tl.int64)
    width = (U1 + SKEW_ALIGN - 1) // SKEW_ALIGN * SKEW_ALIGN + 0 * u_len
    return b.to(tl.int64) * (T + U1) * width, width.to(tl.int64)


@triton.jit
def _diagonal(skb_ptr, skl_ptr, sfirst, width, n, t_len, u_len, BLOCK_U: tl.constexpr,
              ALPHA: tl.constexpr):  # fmt: skip
    """Anti-diagonal n's lanes u: whether cell (n - u, u) is in the lattice, its diagonal-major
    index, and the two log-probabilities the recursion adds there (alpha: the blank from above
    and the label from the left; beta: the cell's own blank and label), log 0 where a move does
    not exist; both contiguous in u (`_diagonals`)."""
    u = tl.arange(0, BLOCK_U)
    t = n - u
    ok = (t >= 0) & (t < t_len) & (u <= u_len)
    cell = sfirst + n * width + u
    if ALPHA:
        lpb = tl.load(skb_ptr + cell, mask=ok & (t >= 1), other=_KNEG)
        lpl = tl.load(skl_ptr + cell, mask=ok & (u >= 1), other=_KNEG)
    else:  # the moves out of diagonal n are stored on n + 1
        lpb = tl.load(skb_ptr + cell + width, mask=ok, other=_KNEG)
        lpl = tl.load(skl_ptr + cell + width + 1, mask=ok & (u < u_len), other=_KNEG)
    return ok, cell, lpb, lpl


@triton.jit(do_not_specialize=["T", "U1", "b0"])
def _lattice_kernel(
    skb_ptr, skl_ptr, soffs_ptr, flen_ptr, tlen_ptr, alpha_ptr, beta_ptr, ll_ptr, b0, T, U1,
    BLOCK_U: tl.constexpr, PACKED: tl.constexpr, HW_LOG2: tl.constexpr,
):  # fmt: skip
    """alpha (program (i, 0)) or beta and log P (program (i, 1)) of utterance b0 + i, all
    diagonal-major (`_diagonals`). rnnt.kernels.lattice_walk runs the same arithmetic in CUDA
    C++ (bitwise the same outputs) in about half the time; this kernel is its reference and
    fallback.

    One anti-diagonal n = t + u per step, lane u holding cell (n - u, u): the diagonal stays in
    registers and the neighbour on the previous diagonal is a lane shift (`tl.gather`), so the
    only memory traffic of the sequential walk are the two transition log-probabilities per
    cell, loaded one diagonal ahead of their use (contiguous: `_diagonals`), and the diagonal's
    stores. Only cells inside the lattice are written.
    alpha and beta are summed in fp64: in fp32 their rounding (a few 1e-5 at -log P ~ 700)
    became 1.5e-4 relative errors in the posteriors exp(alpha + lp + beta - log P) and so in
    the gradients; in fp64 they are within 4e-6 of an fp64 reference.
    The walk is bound by latency. The log2 as one instruction (`_logaddexp`) took the fp32
    walk of seven chunks at (192, 204, 44) from 0.49 to 0.37 ms, and of the ragged LibriSpeech
    batch's eleven from 2.89 to 1.76 ms (H200); the fp64 sums then cost 14 % and 23 % (kernel
    time in the profile: 0.59 -> 0.67 ms, 1.76 -> 2.17 ms). Loading two diagonals ahead, or
    pipelining the loads with `tl.range` stages (2, 3, 4, 6), was slower at (192, 204, 44); so
    was this kernel reading diagonal-major inputs (stores still by row; 0.45 -> 0.61 ms per call
    there, 2026-11-23): only the CUDA walk's loads four diagonals ahead make them a gain.
    """
    b = b0 + tl.program_id(0)
    t_len = tl.load(flen_ptr + b)
    u_len = tl.load(tlen_ptr + b)
    sfirst, width = _diagonals(b, u_len, soffs_ptr, T, U1, PACKED)
    u = tl.arange(0, BLOCK_U)
    n_diag = t_len + u_len
    if tl.program_id(1) == 0:
        # alpha[t, u] = logaddexp(alpha[t-1, u] + lp_blank[t-1, u],
        #                         alpha[t, u-1] + lp_label[t, u-1]), diagonals 1, 2, ...
        left = tl.maximum(u - 1, 0)
        alpha = tl.where(u == 0, 0.0, _KNEG).to(tl.float64)
        tl.store(alpha_ptr + sfirst + u, alpha, mask=u == 0)
        ok, cell, lpb, lpl = _diagonal(skb_ptr, skl_ptr, sfirst, width, 1, t_len, u_len, BLOCK_U,
                                       True)  # fmt: skip
        for n in range(1, n_diag):
            nxt = _diagonal(skb_ptr, skl_ptr, sfirst, width, n + 1, t_len, u_len, BLOCK_U, True)
            emit = tl.gather(alpha, left, 0) + lpl
            alpha = tl.where(ok, _logaddexp(alpha + lpb, emit, HW_LOG2), _KNEG)
            tl.store(alpha_ptr + cell, alpha, mask=ok)
            ok, cell, lpb, lpl = nxt
    else:
        # beta[t, u] = logaddexp(beta[t+1, u] + lp_blank[t, u], beta[t, u+1] + lp_label[t, u]),
        # diagonals n_diag - 1 down to 0; leaving by the final blank from (T_b - 1, U_b) has
        # probability one, and beta[0, 0] = log P
        right = tl.minimum(u + 1, BLOCK_U - 1)
        beta = tl.where(u == u_len, 0.0, _KNEG).to(tl.float64)
        ok, cell, lpb, lpl = _diagonal(skb_ptr, skl_ptr, sfirst, width, n_diag - 1, t_len, u_len,
                                       BLOCK_U, False)  # fmt: skip
        for i in range(0, n_diag):
            nxt = _diagonal(skb_ptr, skl_ptr, sfirst, width, n_diag - 2 - i, t_len, u_len,
                            BLOCK_U, False)  # fmt: skip
            emit = tl.gather(beta, right, 0) + lpl
            beta = tl.where(ok, _logaddexp(beta + lpb, emit, HW_LOG2), _KNEG)
            tl.store(beta_ptr + cell, beta, mask=ok)
            ok, cell, lpb, lpl = nxt
        tl.store(ll_ptr + b, tl.sum(tl.where(u == 0, beta, 0.0), axis=0))


@triton.jit(do_not_specialize=["T", "U1", "b0"])
def _posteriors_kernel(
    skb_ptr, skl_ptr, offs_ptr, soffs_ptr, flen_ptr, tlen_ptr, alpha_ptr, beta_ptr, ll_ptr,
    weight_ptr, occ_ptr, wb_ptr, wl_ptr, b0, T, U1, BT: tl.constexpr, BLOCK_U: tl.constexpr,
    PACKED: tl.constexpr, WEIGHTED: tl.constexpr,
):  # fmt: skip
    """Transition posteriors of BT frames of utterance b0 + program_id(0), by rows, each in
    [0, 1] (times the utterance's weight, if WEIGHTED) and 0 outside the lattice: those of
    d(-log P)/d lp,
        w_blank[t, u] = exp(alpha[t, u] + lp_blank[t, u] + beta[t+1, u] - log P), with beta
            just past the last frame = 0 at u = U_b (the final blank) and log 0 elsewhere;
        w_label[t, u] = exp(alpha[t, u] + lp_label[t, u] + beta[t, u+1] - log P), u < U_b;
        occ = w_blank + w_label (the occupancy of the cell).
    Padded rows outside the lattice get 0 (the row kernels read every row of the box).
    """
    b = b0 + tl.program_id(0)
    t = tl.program_id(1) * BT + tl.arange(0, BT)[:, None]
    u = tl.arange(0, BLOCK_U)[None, :]
    t_len = tl.load(flen_ptr + b)
    u_len = tl.load(tlen_ptr + b)
    first, stride = _utterance_rows(b, u_len, offs_ptr, T, U1, PACKED)
    sfirst, width = _diagonals(b, u_len, soffs_ptr, T, U1, PACKED)
    row = first + t * stride + u
    cell = sfirst + (t + u) * width + u  # the lattice values are diagonal-major
    ok = (t < t_len) & (u <= u_len)
    alpha = tl.load(alpha_ptr + cell, mask=ok, other=_KNEG)
    after = tl.where(u == u_len, 0.0, _KNEG)
    stay = tl.load(beta_ptr + cell + width, mask=ok & (t + 1 < t_len), other=after)
    stay += tl.load(skb_ptr + cell + width, mask=ok, other=0.0)  # the move into (t + 1, u)
    ok_emit = ok & (u < u_len)
    emit = tl.load(beta_ptr + cell + width + 1, mask=ok_emit, other=_KNEG)
    emit += tl.load(skl_ptr + cell + width + 1, mask=ok_emit, other=0.0)  # into (t, u + 1)
    log_lik = tl.load(ll_ptr + b)
    # the fp64 sum is O(1): only then is it rounded for the exponential
    w_blank = tl.where(ok, tl.exp((alpha + stay - log_lik).to(tl.float32)), 0.0)
    w_label = tl.where(ok_emit, tl.exp((alpha + emit - log_lik).to(tl.float32)), 0.0)
    if WEIGHTED:
        weight = tl.load(weight_ptr + b)
        w_blank *= weight
        w_label *= weight
    store_ok = ok if PACKED else (t < T) & (u < U1)
    tl.store(wb_ptr + row, w_blank, mask=store_ok)
    tl.store(wl_ptr + row, w_label, mask=store_ok)
    tl.store(occ_ptr + row, w_blank + w_label, mask=store_ok)


@triton.jit
def _keep_mask_kernel(out_ptr, seed, T, U1, H, drop_thr, BU: tl.constexpr, HP: tl.constexpr):
    b = tl.program_id(0)
    t = tl.program_id(1)
    u = tl.program_id(2) * BU + tl.arange(0, BU)
    k = tl.arange(0, HP)
    keep = _keep(seed, b + 0 * u, t + 0 * u, u, U1, H, drop_thr, HP)
    ok = (u < U1)[:, None] & (k < H)[None, :]
    tl.store(out_ptr + ((b * T + t) * U1 + u)[:, None] * H + k[None, :], keep.to(tl.int8), mask=ok)


@triton.jit
def _chunk_row(b, t, u, u_len, pid, offs_ptr, row0, T, U1, PACKED: tl.constexpr):
    """Row of lattice cell (b, t, u) in its chunk's h / logits buffers (int64).

    Padded: chunk program pid = (b - b0) T + t owns rows pid (U+1) + u. Packed: utterance b's
    cells start at offs[b] of the whole batch (then t (U_b + 1) + u); the chunk at row0.
    """
    if PACKED:
        return tl.load(offs_ptr + b).to(tl.int64) - row0 + (t * (u_len + 1) + u).to(tl.int64)
    return (pid * U1 + u).to(tl.int64)


# One pair of 16-bit units per instance: h = keep ? relu(f + g) : 0 in packed half-precision
# math. The hidden kernel is bound by instruction issue, not memory, and this takes 752 sm_90
# instructions per thread (64 units) where fp32 math with per-unit compares and selects takes
# 1,152 (the dropout hash is most of what is left). $1, $2: f and g pairs;
# $3: the pair's hash; $4: the drop threshold in both 16-bit halves (0x80008000 drops both, a
# row outside the lattice). With the 15-bit halves of the hash topped up to 0x8000, the
# subtraction cannot borrow across halves, and bit 15 of each half says "kept"; prmt copies it
# over its half (sign-replicating bytes 1 and 3).
_ASM_GATE = """{
.reg .b32 s, y, z;
mov.b32 z, 0;
{add}
max.{ty}x2 s, s, z;
or.b32 y, $3, 0x80008000;
sub.u32 y, y, $4;
prmt.b32 y, y, y, 0xBB99;
and.b32 $0, s, y;
}"""
# f + g: add.bf16x2 needs sm_90, so bf16 takes an fma by 1.0 (exact, then rounded once, as the
# add), which sm_80 has; max.{f16,bf16}x2 need sm_80.
_ASM_ADD = {
    torch.float16: ("f16", "add.rn.f16x2 s, $1, $2;"),
    torch.bfloat16: ("bf16", "mov.b32 y, 0x3F803F80;\nfma.rn.bf16x2 s, $1, y, $2;"),
}


@functools.cache  # it runs before every call's first launch
def _gate_asm(dtype: torch.dtype, device: torch.device, hid: int) -> str:
    """`_ASM_GATE` for a half-precision dtype on an sm_80+ GPU, "" otherwise (fp32 math, and
    for an odd joint width, whose unit pairs would straddle rows)."""
    if dtype not in _ASM_ADD or hid % 2 or torch.cuda.get_device_capability(device) < (8, 0):
        return ""
    ty, add = _ASM_ADD[dtype]
    return _ASM_GATE.replace("{add}", add).replace("{ty}", ty)


@triton.jit
def _gate_pairs(fv, gv, bits, thr_row, ASM: tl.constexpr):
    """keep * relu(f + g) of (M, HP // 2) half-precision unit pairs held as 32-bit words, with
    the unit-pair hashes `bits` (M, HP // 2) and per-row thresholds `thr_row` (M,) (of `_keep`,
    > 2^15 - 1 drops the row), in packed math (ASM: `_gate_asm` of their dtype).

    Pairs as words, not (M, HP) halves with each hash interleaved twice: a thread then holds
    4 consecutive pairs (one 16-byte vector) and folds their 8 gate bits into a byte in its
    registers."""
    return tl.inline_asm_elementwise(
        ASM,
        "=r,r,r,r,r",
        [fv, gv, bits, tl.broadcast_to(thr_row[:, None], gv.shape)],
        dtype=tl.uint32,
        is_pure=True,
        pack=1,
    )


@triton.jit(do_not_specialize=["T", "U1", "seed", "b0", "row0"])
def _hidden_kernel(
    f_ptr, g_ptr, flen_ptr, tlen_ptr, offs_ptr, soffs_ptr, h_ptr, gate_ptr, tgt_ptr, tgt_stride,
    label_ptr, dest_ptr, b0, row0, T, U1, H, V, seed, drop_thr, BU: tl.constexpr,
    HP: tl.constexpr, DROPOUT: tl.constexpr, PACKED: tl.constexpr, GATE_ASM: tl.constexpr,
    LABELS: tl.constexpr, GATES: tl.constexpr,
):  # fmt: skip
    """h rows of one frame: h[(b, t, u)] = keep * relu(f[b, t] + g[b, u]), without dropout's
    1 / (1 - p) (the row kernels and the gradients apply it in fp32); padded rows outside the
    lattice are 0, packed chunks have none (and their programs past T_b or U_b return at once:
    on a ragged batch most of the (frame, label-tile) grid is such). With GATE_ASM (`_gate_asm`)
    the sum, ReLU and mask run in packed half-precision math, else in fp32.

    LABELS: also, at batch row row0 + row, the rows' target labels, targets[b, u] clamped to
    [0, V) (0 where u >= U_b, which no label transition reads), for the row kernels' gathers,
    and where the stats kernels store the rows' log-probabilities: the diagonal-major cell
    (t + 1, u) (`_diagonals`).
    GATES: also each row's gates, HP / 8 bytes at gate_ptr + row HP / 8: bit k % 8 of byte
    k // 8 is set where unit k's ReLU and dropout gate is open (h != 0), which is all that the
    df / dg reduction needs of h (it reads 1/16 of the bytes).
    """
    pid = tl.program_id(0)
    b = b0 + pid // T
    t = pid % T
    u = tl.program_id(1) * BU + tl.arange(0, BU)
    t_len = tl.load(flen_ptr + b)
    u_len = tl.load(tlen_ptr + b)
    live = True
    if PACKED:
        live = (t < t_len) & (tl.program_id(1) * BU <= u_len)
    if live:
        row_ok = (u <= u_len) & (t + 0 * u < t_len)
        row = _chunk_row(b, t, u, u_len, pid, offs_ptr, row0, T, U1, PACKED)
        rows_ok = row_ok if PACKED else u < U1  # the rows this program owns
        # f and g are read whatever the lengths (padding is finite, zeroed below): in the
        # padded layout these loads then do not wait for the lengths' loads.
        if GATE_ASM != "":
            # unit pairs (2j, 2j + 1) as 32-bit words (H is even)
            j = tl.arange(0, HP // 2)
            j_ok = j < H // 2
            f_off = (b * T + t).to(tl.int64) * (H // 2) + j
            fv = tl.load(f_ptr.to(tl.pointer_type(tl.uint32)) + f_off, mask=j_ok, other=0)
            g_off = (b * U1 + u).to(tl.int64)[:, None] * (H // 2) + j[None, :]
            gv = tl.load(g_ptr.to(tl.pointer_type(tl.uint32)) + g_off,
                         mask=(u < U1)[:, None] & j_ok[None, :], other=0)  # fmt: skip
            if DROPOUT:
                bits = _pair_bits(seed, b + 0 * u, t + 0 * u, u, U1, H, HP)
                thr = (drop_thr * 0x10001).to(tl.uint32, bitcast=True)
            else:
                bits = tl.zeros((BU, HP // 2), tl.uint32)
                thr = tl.zeros((), tl.uint32)
            thr_row = tl.where(row_ok, thr, tl.full((), 0x80008000, tl.uint32))
            pairs = _gate_pairs(fv[None, :], gv, bits, thr_row, GATE_ASM)
            h_off = row[:, None] * (H // 2) + j[None, :]
            tl.store(h_ptr.to(tl.pointer_type(tl.uint32)) + h_off, pairs,
                     mask=rows_ok[:, None] & j_ok[None, :])  # fmt: skip
            if GATES:
                # Bit 15 / 31 set where the low / high half is nonzero (-0 counts as closed, as
                # in h > 0): the sum of 15-bit halves carries into bit 15 exactly then. Pair i
                # of 4 moves them to bits 2i and 16 + 2i, folded into one byte. Three integer
                # ops a pair: compares and selects made the kernel 21-30 % slower, these 2-15 %.
                open_ = ((pairs & 0x7FFF7FFF) + 0x7FFF7FFF) & 0x80008000
                shift = (15 - 2 * tl.arange(0, 4)).to(tl.uint32)
                gates = tl.sum(tl.reshape(open_, (BU, HP // 8, 4)) >> shift[None, None, :], axis=2)
                gates = gates | (gates >> 15)
        else:
            k = tl.arange(0, HP)
            k_ok = k < H
            fv = tl.load(f_ptr + (b * T + t).to(tl.int64) * H + k, mask=k_ok, other=0.0)
            gv = tl.load(g_ptr + (b * U1 + u).to(tl.int64)[:, None] * H + k[None, :],
                         mask=(u < U1)[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
            h = tl.maximum(fv.to(tl.float32)[None, :] + gv.to(tl.float32), 0.0)
            if DROPOUT:
                keep = _keep(seed, b + 0 * u, t + 0 * u, u, U1, H, drop_thr, HP)
                h = tl.where(keep, h, 0.0)
            h = tl.where(row_ok[:, None], h, 0.0).to(h_ptr.dtype.element_ty)
            tl.store(h_ptr + row[:, None] * H + k[None, :], h,
                     mask=rows_ok[:, None] & k_ok[None, :])  # fmt: skip
            if GATES:
                open_ = tl.reshape((h != 0).to(tl.uint8), (BU, HP // 8, 8))
                gates = tl.sum(open_ << tl.arange(0, 8).to(tl.uint8)[None, None, :], axis=2)
        if GATES:
            kb = tl.arange(0, HP // 8)
            tl.store(gate_ptr + row[:, None] * (HP // 8) + kb[None, :], gates.to(tl.uint8),
                     mask=rows_ok[:, None])  # fmt: skip
        if LABELS:
            label = tl.load(tgt_ptr + b.to(tl.int64) * tgt_stride + u, mask=u < u_len, other=0)
            label = tl.minimum(tl.maximum(label, 0), V - 1).to(tl.int32)
            tl.store(label_ptr + row0 + row, label, mask=rows_ok)
            sfirst, width = _diagonals(b, u_len, soffs_ptr, T, U1, PACKED)
            dest = sfirst + (t + 1 + u) * width + u
            tl.store(dest_ptr + row0 + row, dest.to(tl.int32), mask=rows_ok)


@triton.jit(do_not_specialize=["row0", "n_rows"])
def _logit_stats_kernel(
    logits_ptr, bias_ptr, label_ptr, dest_ptr, lse_ptr, skb_ptr, skl_ptr, row0, n_rows, V,
    blank, gate_scale, BR: tl.constexpr, BN: tl.constexpr, EVEN: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    """Per chunk row r: the log-sum-exp over the classes (at batch row row0 + r) and the
    log-probabilities of blank and of the target label (at the row's diagonal-major cell, the
    label's one lane on: `_diagonals`; a row with no label move writes one that no kernel
    reads). The logits are gate_scale * (the buffer's h W^T, h without dropout's 1 / (1 - p))
    + bias, formed in fp32.

    Persistent: program p takes blocks p, p + P, ... of BR whole rows (BN >= V), so each logit
    is read once with no online rescale; the blank and target logits are two gathers. Every
    load depends only on the row number, so none waits for another. The sum runs in base 2 with
    the bias folded into one multiply-add per logit (EVEN: V == BN, no class masks): the kernel
    is bound by instruction issue as much as by memory.
    """
    cols = tl.arange(0, BN)
    c_ok = cols < V
    scale2 = gate_scale * _LOG2E
    bias2 = tl.load(bias_ptr + cols, mask=c_ok, other=0.0).to(tl.float32) * _LOG2E
    bias_blank = tl.load(bias_ptr + blank).to(tl.float32)
    for blk in tl.range(
        tl.program_id(0), tl.cdiv(n_rows, BR), tl.num_programs(0), num_stages=STAGES
    ):
        r = (blk * BR + tl.arange(0, BR)).to(tl.int64)
        ok = r < n_rows
        label = tl.load(label_ptr + row0 + r, mask=ok, other=0)
        if EVEN:
            s = tl.load(logits_ptr + r[:, None] * V + cols[None, :], mask=ok[:, None], other=0.0)
        else:
            s = tl.load(logits_ptr + r[:, None] * V + cols[None, :],
                        mask=ok[:, None] & c_ok[None, :], other=0.0)  # fmt: skip
        s_blank = tl.load(logits_ptr + r * V + blank, mask=ok, other=0.0).to(tl.float32)
        s_blank *= gate_scale
        s_label = tl.load(logits_ptr + r * V + label, mask=ok, other=0.0).to(tl.float32)
        s_label = s_label * gate_scale + tl.load(bias_ptr + label, mask=ok, other=0.0).to(
            tl.float32
        )
        s2 = s.to(tl.float32) * scale2 + bias2[None, :]  # logit * log2(e)
        if not EVEN:
            s2 = tl.where(c_ok[None, :], s2, _KNEG)
        top = tl.max(s2, axis=1)
        lse = (top + tl.log2(tl.sum(tl.exp2(s2 - top[:, None]), axis=1))) * _LN2
        dest = tl.load(dest_ptr + row0 + r, mask=ok, other=0)
        tl.store(lse_ptr + row0 + r, lse, mask=ok)
        tl.store(skb_ptr + dest, s_blank + bias_blank - lse, mask=ok)
        tl.store(skl_ptr + dest + 1, s_label - lse, mask=ok)


@triton.jit(do_not_specialize=["row0", "n_rows"])
def _stats_from_partials_kernel(
    part_ptr, logits_ptr, bias_ptr, label_ptr, dest_ptr, lse_ptr, skb_ptr, skl_ptr, row0, n_rows,
    V, blank, gate_scale, NT: tl.constexpr, NTP: tl.constexpr, BR: tl.constexpr,
):  # fmt: skip
    """`_logit_stats_kernel`'s outputs from the sm90 logits GEMM's partials (rnnt.kernels.
    logits_gemm): per chunk row NT (max, sum exp2(x - max)) pairs over 128-class tiles of the
    base-2 logits x, merged into the log-sum-exp; the blank and target logits are two gathers
    from the fp16 logits, as there."""
    r = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
    ok = r < n_rows
    k = tl.arange(0, NTP)
    pair_ok = ok[:, None] & (k < NT)[None, :]
    pair = part_ptr + (r[:, None] * NT + k[None, :]) * 2
    tile_max = tl.load(pair, mask=pair_ok, other=_KNEG)
    # masked pairs add 1 * exp2(-1e30 - top) = 0 (and rows past the chunk stay finite)
    tile_sum = tl.load(pair + 1, mask=pair_ok, other=1.0)
    top = tl.max(tile_max, axis=1)
    lse = (top + tl.log2(tl.sum(tile_sum * tl.exp2(tile_max - top[:, None]), axis=1))) * _LN2
    label = tl.load(label_ptr + row0 + r, mask=ok, other=0)
    s_blank = tl.load(logits_ptr + r * V + blank, mask=ok, other=0.0).to(tl.float32)
    s_blank = s_blank * gate_scale + tl.load(bias_ptr + blank).to(tl.float32)
    s_label = tl.load(logits_ptr + r * V + label, mask=ok, other=0.0).to(tl.float32)
    s_label = s_label * gate_scale + tl.load(bias_ptr + label, mask=ok, other=0.0).to(tl.float32)
    dest = tl.load(dest_ptr + row0 + r, mask=ok, other=0)
    tl.store(lse_ptr + row0 + r, lse, mask=ok)
    tl.store(skb_ptr + dest, s_blank - lse, mask=ok)
    tl.store(skl_ptr + dest + 1, s_label - lse, mask=ok)


@triton.jit(do_not_specialize=["row0", "n_rows"])
def _dlogits_kernel(
    logits_ptr, dl_ptr, bias_ptr, label_ptr, lse_ptr, occ_ptr, wb_ptr, wl_ptr, dbias_ptr, row0,
    n_rows, V, blank, gate_scale, BR: tl.constexpr, BN: tl.constexpr, EVEN: tl.constexpr,
    STAGES: tl.constexpr,
):  # fmt: skip
    """d loss / d logits of chunk row r (batch row row0 + r) = occ softmax - [blank] w_blank -
    [label] w_label, from per-row occupancy and transition weights that already carry the
    utterance's output-gradient ratio and are 0 on rows outside the lattice (padded layout);
    plus this program's column sums of it, added to its row of `dbias_ptr` (each program owns
    one row, so the chunks' launches accumulate there in stream order, and one reduction at the
    end replaces one per chunk).

    Persistent: program p takes blocks p, p + P, ... of BR whole rows. `dl_ptr` may alias
    `logits_ptr` (same dtype): each element is read before it is written (the pipelined loads
    run ahead only into the program's own later blocks, which nobody has written yet).
    """
    pid = tl.program_id(0)
    cols = tl.arange(0, BN)
    c_ok = cols < V
    bias2 = tl.load(bias_ptr + cols, mask=c_ok, other=0.0).to(tl.float32) * _LOG2E
    scale2 = gate_scale * _LOG2E  # the logits as in `_logit_stats_kernel`
    col_sum = tl.zeros((BR, BN), tl.float32)  # reduced over rows once, at the end
    for blk in tl.range(pid, tl.cdiv(n_rows, BR), tl.num_programs(0), num_stages=STAGES):
        r = (blk * BR + tl.arange(0, BR)).to(tl.int64)
        ok = r < n_rows
        tile_ok = ok[:, None] if EVEN else ok[:, None] & c_ok[None, :]
        s = tl.load(logits_ptr + r[:, None] * V + cols[None, :], mask=tile_ok, other=0.0)
        label = tl.load(label_ptr + row0 + r, mask=ok, other=0)
        # rows past n_rows: lse = +inf makes their softmax 0 whatever the bias (no inf * 0)
        lse2 = tl.load(lse_ptr + row0 + r, mask=ok, other=float("inf")) * _LOG2E
        occ = tl.load(occ_ptr + row0 + r, mask=ok, other=0.0)
        w_blank = tl.load(wb_ptr + row0 + r, mask=ok, other=0.0)
        w_label = tl.load(wl_ptr + row0 + r, mask=ok, other=0.0)
        # softmax in base 2, the bias folded into one multiply-add (as in the stats kernel)
        d = tl.exp2(s.to(tl.float32) * scale2 + (bias2[None, :] - lse2[:, None])) * occ[:, None]
        d -= tl.where(cols[None, :] == blank, w_blank[:, None], 0.0)
        d -= tl.where(cols[None, :] == label[:, None], w_label[:, None], 0.0)
        if not EVEN:
            d = tl.where(c_ok[None, :], d, 0.0)
        col_sum += d
        tl.store(dl_ptr + r[:, None] * V + cols[None, :], d.to(dl_ptr.dtype.element_ty),
                 mask=tile_ok)  # fmt: skip
    so_far = tl.load(dbias_ptr + pid * V + cols, mask=c_ok, other=0.0)
    tl.store(dbias_ptr + pid * V + cols, so_far + tl.sum(col_sum, axis=0), mask=c_ok)


@triton.jit(do_not_specialize=["T", "U1", "b0", "row0", "BC", "t_per_split"])
def _grad_fg_kernel(
    dh_ptr, gate_ptr, flen_ptr, tlen_ptr, offs_ptr, df_ptr, dg_part_ptr, b0, row0, BC, T, U1, H,
    t_per_split, BU: tl.constexpr, BK: tl.constexpr, HP: tl.constexpr, ATOMIC_DF: tl.constexpr,
    PACKED: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    """df[b, t] = sum_u dpre[b, t, u] and per frame-split partials of dg[b, u] = sum_t
    dpre[b, t, u], with dpre = dh * relu'.

    relu' (ReLU and dropout gate open, its value 1 / (1 - p) applied by the caller) comes from
    the rows' gate bits of `_hidden_kernel` (GATES, HP / 8 bytes per row). Program (utterance,
    H-slice, split x U-tile) walks its frames; df is stored directly when one U-tile covers
    U+1 (no atomics), and the dg partials (splits, BC >= chunk utterances, U+1, H) are summed
    by the caller (deterministic).
    """
    pid = tl.program_id(0)
    b = b0 + pid
    k = tl.program_id(1) * BK + tl.arange(0, BK)
    kb = tl.program_id(1) * (BK // 8) + tl.arange(0, BK // 8)  # the gate bytes of units k
    n_u_tiles = tl.cdiv(U1, BU)
    split = tl.program_id(2) // n_u_tiles
    u = (tl.program_id(2) % n_u_tiles) * BU + tl.arange(0, BU)
    k_ok = k < H
    t_len = tl.load(flen_ptr + b)
    u_len = tl.load(tlen_ptr + b)
    ok = (u <= u_len)[:, None] & k_ok[None, :]
    gates_ok = (u <= u_len)[:, None] & (kb < HP // 8)[None, :]
    dg = tl.zeros((BU, BK), tl.float32)
    t_start = split * t_per_split
    for t in tl.range(t_start, tl.minimum(t_start + t_per_split, t_len), num_stages=STAGES):
        row = _chunk_row(b, t, u, u_len, pid * T + t, offs_ptr, row0, T, U1, PACKED)
        dh = tl.load(dh_ptr + row[:, None] * H + k[None, :], mask=ok, other=0.0).to(tl.float32)
        gates = tl.load(gate_ptr + row[:, None] * (HP // 8) + kb[None, :], mask=gates_ok,
                        other=0)  # fmt: skip
        gates = tl.reshape(tl.broadcast_to(gates[:, :, None], (BU, BK // 8, 8)), (BU, BK))
        dpre = tl.where(((gates >> (k % 8)[None, :]) & 1) != 0, dh, 0.0)
        dg += dpre
        df_offs = (b * T + t).to(tl.int64) * H + k
        if ATOMIC_DF:
            tl.atomic_add(df_ptr + df_offs, tl.sum(dpre, axis=0), mask=k_ok)
        else:
            tl.store(df_ptr + df_offs, tl.sum(dpre, axis=0), mask=k_ok)
    out = ((split * BC + pid) * U1 + u).to(tl.int64)
    tl.store(dg_part_ptr + out[:, None] * H + k[None, :], dg,
             mask=(u < U1)[:, None] & k_ok[None, :])  # fmt: skip


# --------------------------------------------------------------------------------------------
# Host side


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
    _keep_mask_kernel[(b, t, triton.cdiv(u1, bu))](
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
    _hidden_kernel[(bsz * t_max, triton.cdiv(u1, HIDDEN_U_TILE))](
        f.contiguous(), g.contiguous(), *lens, unused, unused, out, unused, unused, 0, unused,
        unused, 0, 0, t_max, u1, hid, 1, seed, _threshold(p), BU=HIDDEN_U_TILE, HP=_hp(hid),
        DROPOUT=p > 0, PACKED=False,
        GATE_ASM=_gate_asm(f.dtype, f.device, hid) if packed_math and _compiled(f.device) else "",
        LABELS=False, GATES=False, num_warps=HIDDEN_WARPS,
    )  # fmt: skip
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
        # tables and the lengths' loads (measured 0.8 ms faster at (192, 204, 44)).
        self.starts = [0, *itertools.accumulate(sizes)]  # C loop: this runs before any launch
        self.packed = self.starts[-1] < bsz * t_max * u1
        # the walk's diagonal-major copies (`_diagonals`): T_b + U_b + 1 diagonals per utterance
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
        per_row = (hid * dtype.itemsize * (2 if backward else 1) + v * logits_dtype.itemsize
                   + (v * dtype.itemsize if separate_dl else 0)
                   + (part_width * 4 if partials else 0)
                   + (gate_bytes if backward else 0))  # fmt: skip
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

    def __init__(self, f, g, weight, bias, f_lens, targets, target_lens, host_lens, blank,
                 p_drop, seed, gemm):  # fmt: skip
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
        self.gate_asm = _gate_asm(f.dtype, self.dev, self.hid) if self.compiled else ""
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
            # before the first launch, and the GPU waits for that)
            host = [*host_lens[0], *host_lens[1]]
            if layout.packed:
                host += [*layout.starts, *layout.skew_starts]
            lens = to_device(host, self.dev)
            self.f_lens, self.target_lens = lens[: self.bsz], lens[self.bsz : 2 * self.bsz]
            # int32 row and diagonal-major offsets (B + 1,) of the packed layout; the padded
            # layout's kernels never read them, and get any int32 pointer
            self.offs = lens[2 * self.bsz : 3 * self.bsz + 1] if layout.packed else self.f_lens
            self.soffs = lens[3 * self.bsz + 1 :] if layout.packed else self.f_lens
        # per row: target label, diagonal-major cell (`_hidden_kernel` writes both)
        self.label_rows, self.dest_rows = torch.empty(
            2, layout.n_rows, dtype=torch.int32, device=self.dev
        )
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
        _hidden_kernel[(bc * self.t_max, triton.cdiv(self.u1, HIDDEN_U_TILE))](
            self.f, self.g, self.f_lens, self.target_lens, self.offs, self.soffs, h,
            h if chunk.gates is None else chunk.gates, self.targets, self.targets.stride(0),
            self.label_rows, self.dest_rows, b0, row0, self.t_max, self.u1, self.hid, self.v,
            *self.dropout, BU=HIDDEN_U_TILE, HP=_hp(self.hid), DROPOUT=self.has_dropout,
            PACKED=layout.packed, GATE_ASM=self.gate_asm, LABELS=forward,
            GATES=chunk.gates is not None, num_warps=HIDDEN_WARPS,
        )  # fmt: skip
        w_t = self.weight.t()
        if forward and self.sm90:
            if self.bias32 is None:
                # not before the first launch: a synchronized call's GPU waits for that
                self.bias32 = self.bias.float()
            logits_gemm.logits_with_partials(
                h, self.weight, self.bias32, self.gate_scale * _LOG2E.value, logits,
                chunk.partials,
            )  # fmt: skip
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
            _stats_from_partials_kernel[(triton.cdiv(n, PARTIALS_ROWS),)](
                chunk.partials, logits, self.bias, self.label_rows, self.dest_rows, lattice.lse,
                lattice.skew_blank, lattice.skew_label, row0, n, self.v, self.blank,
                self.gate_scale, NT=n_tiles, NTP=triton.next_power_of_2(n_tiles), BR=PARTIALS_ROWS,
                num_warps=4,
            )  # fmt: skip
            return
        br, bn, warps, programs = _row_launch(STATS_LAUNCH, self.v, n, self.dev)
        _logit_stats_kernel[(programs,)](
            logits, self.bias, self.label_rows, self.dest_rows, lattice.lse, lattice.skew_blank,
            lattice.skew_label, row0, n, self.v, self.blank, self.gate_scale, BR=br, BN=bn,
            EVEN=bn == self.v, STAGES=STATS_STAGES, num_warps=warps,
        )  # fmt: skip


class _Lattice:
    """Lattice values of a batch: per row of the layout the log-sum-exp and the posteriors
    (fp32); per diagonal-major cell (`_diagonals`) the transition log-probabilities (fp32) and
    alpha and beta (fp64); log P per utterance (fp64).
    """

    def __init__(self, prob: _Problem):
        self.prob = prob
        rows, cells, dev = prob.layout.n_rows, prob.layout.skew_cells, prob.dev
        self.lse, self.occ, self.w_blank, self.w_label = torch.empty(4, rows, device=dev)
        # cells no move enters stay unset (no kernel reads them); the CUDA walk reads up to
        # OVERREAD cells past the last diagonal
        self.skew_blank, self.skew_label = torch.empty(2, cells + lattice_walk.OVERREAD, device=dev)
        self.alpha, self.beta = torch.empty(2, cells, dtype=torch.float64, device=dev)
        self.log_lik = torch.empty(prob.bsz, dtype=torch.float64, device=dev)
        self.block_u = max(16, triton.next_power_of_2(prob.u1))

    def solve(self, b0: int, bc: int) -> None:
        """alpha, beta and log P of utterances [b0, b0 + bc), whose transition
        log-probabilities the stats kernels must have stored."""
        prob = self.prob
        packed = prob.layout.packed
        if prob.cuda_walk:
            lattice_walk.walk(
                self.skew_blank, self.skew_label, prob.soffs, prob.f_lens,
                prob.target_lens, self.alpha, self.beta, self.log_lik, b0, bc, prob.t_max,
                prob.u1, packed,
            )  # fmt: skip
            return
        _lattice_kernel[(bc, 2)](
            self.skew_blank, self.skew_label, prob.soffs, prob.f_lens, prob.target_lens,
            self.alpha, self.beta, self.log_lik, b0, prob.t_max, prob.u1, BLOCK_U=self.block_u,
            PACKED=packed, HW_LOG2=prob.compiled, num_warps=LATTICE_WARPS,
        )  # fmt: skip

    def posteriors(self, b0: int, bc: int, weights: torch.Tensor | None = None):
        """(occupancy, w_blank, w_label) rows, those of utterances [b0, b0 + bc) filled in (times
        weights[b] when given)."""
        prob = self.prob
        bt = max(1, 2048 // self.block_u)
        _posteriors_kernel[(bc, triton.cdiv(prob.t_max, bt))](
            self.skew_blank, self.skew_label, prob.offs, prob.soffs, prob.f_lens,
            prob.target_lens, self.alpha, self.beta, self.log_lik,
            self.log_lik if weights is None else weights,
            self.occ, self.w_blank, self.w_label, b0, prob.t_max, prob.u1, BT=bt,
            BLOCK_U=self.block_u, PACKED=prob.layout.packed, WEIGHTED=weights is not None,
        )  # fmt: skip
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
        self.bu = min(MAX_FG_U_TILE, max(16, triton.next_power_of_2(u1)))
        fg_tiles = chunks.max_bc * triton.cdiv(hid, FG_H_TILE) * triton.cdiv(u1, self.bu)
        self.splits = max(1, min(t_max, triton.cdiv(FG_PROGRAMS_PER_SM * _num_sms(dev), fg_tiles)))
        self.max_bc = chunks.max_bc
        self.dw = torch.zeros(v, hid, dtype=torch.float32, device=dev)
        self.dbias_part = torch.zeros(self.dl_launch[3], v, dtype=torch.float32, device=dev)
        self.df = torch.zeros(prob.bsz, t_max, hid, dtype=torch.float32, device=dev)
        self.dg = torch.empty(prob.bsz, u1, hid, dtype=torch.float32, device=dev)
        self.dg_part = torch.empty(self.splits, chunks.max_bc, u1, hid, dtype=torch.float32,
                                   device=dev)  # fmt: skip

    def add(self, prob: _Problem, chunk: _Chunk, lse: torch.Tensor, posteriors) -> None:
        b0, bc, row0, n, h, logits, dl, dh = chunk[:8]
        br, bn, warps, programs = self.dl_launch
        _dlogits_kernel[(programs,)](
            logits, dl, prob.bias, prob.label_rows, lse, *posteriors,
            self.dbias_part, row0, n, prob.v, prob.blank, prob.gate_scale, BR=br, BN=bn,
            EVEN=bn == prob.v, STAGES=DLOGITS_STAGES, num_warps=warps,
        )  # fmt: skip
        _add_mm_fp32(self.dw, dl.t(), h)
        torch.mm(dl, prob.weight, out=dh)
        t_per_split = triton.cdiv(prob.t_max, self.splits)
        grid = (bc, triton.cdiv(prob.hid, FG_H_TILE), self.splits * triton.cdiv(prob.u1, self.bu))
        _grad_fg_kernel[grid](
            dh, chunk.gates, prob.f_lens, prob.target_lens, prob.offs, self.df, self.dg_part, b0,
            row0, self.max_bc, prob.t_max, prob.u1, prob.hid, t_per_split, BU=self.bu,
            BK=FG_H_TILE, HP=_hp(prob.hid), ATOMIC_DF=prob.u1 > self.bu, PACKED=prob.layout.packed,
            STAGES=FG_STAGES, num_warps=FG_WARPS,
        )  # fmt: skip
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
    def forward(ctx, f, g, weight, bias, f_lens, targets, target_lens, host_lens, blank, p_drop,
                seed, reduction, one_pass, gemm):  # fmt: skip
        prob = _Problem(f, g, weight, bias, f_lens, targets, target_lens, host_lens, blank,
                        p_drop, seed, gemm)  # fmt: skip
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
            f, g, weight, bias, f_lens, targets, target_lens, host_lens, blank, float(dropout_p),
            seed, reduction, one_pass, gemm,
        )  # fmt: skip


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
