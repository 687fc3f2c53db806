"""Fused RNN-T joint network + loss: the (B, T, U+1, V) logits never exist.

What it computes, for every lattice cell (b, t, u) with t < T_b and u <= U_b:

    h = dropout(relu(f[b, t] + g[b, u]))              (H,)   f (B, T, H), g (B, U+1, H)
    logits = h @ W^T + bias                           (V,)   W (V, H) = Joint.fc.weight
    lp_blank = logits[blank] - logsumexp(logits),  lp_label = logits[y[b, u]] - logsumexp(logits)

and the per-utterance loss -log P(y_b | x_b) from the forward/backward variables over those
(B, T, U+1) values. It is exact: every cell and every class is used (no pruning).

The lattice is walked in chunks of whole utterances whose h (rows x H) and logits (rows x V)
fit in CHUNK_BYTES; nothing proportional to B T (U+1) H or B T (U+1) V is ever allocated.
Per chunk, forward:
    1. `_hidden_kernel` writes h (relu, dropout, zero rows outside each utterance's lattice).
    2. cuBLAS: logits = h @ W^T (tensor cores, fp32 accumulation).
    3. `_logit_stats_kernel` keeps log-sum-exp, blank and target logit per row (bias added in
       fp32); the chunk's logits buffer is then reused.
The row-wise kernels read and write per-row vectors (target label, log-sum-exp, transition
weights) gathered from / scattered to the (B, T, U+1) lattice by index, so none of their loads
waits on another. Then `_lattice_kernel` (one program per utterance, anti-diagonal steps)
gives alpha, beta and log P from those (B, T, U+1) values. Backward, per chunk: h and the
logits are recomputed (steps 1-2), `_dlogits_kernel` overwrites the logits with d(logits) =
occupancy * softmax - blank/label posteriors, cuBLAS forms dW += d(logits)^T h (fp32 output)
and dh = d(logits) W, and `_grad_fg_kernel` reduces dh * relu' over u (df) and over t (dg).
That is four GEMMs of rows x H x V per step, the minimum with recomputation; everything else
is one pass over memory.

Measured on one H200 (fp16, dropout 0.3, torch 2.11, Triton 3.6) at (B, T, U) = (192, 204, 44):
16.8-17.7 ms forward + backward across runs, 1.27 GiB extra (torchaudio's padded joint +
loss: 67 ms, 11 GiB).
The four GEMMs take 9.4 ms at ~790 TFLOP/s; the memory-bound kernels most of the rest
(d(logits) 2.2 ms, df/dg 1.5 ms, h 1.4 ms, logit stats 1.1 ms), near 3 TB/s each. Two fused
designs measured slower:
  - one Triton kernel with the logits only in registers (the previous version of this file):
    the backward needs dW, a reduction over all rows, and dh, a reduction over all V, from the
    same d(logits) tile, so holding either accumulator on chip recomputes the logits GEMM per
    H- or V-slice: 74 ms without dropout, 97 ms with it;
  - Triton GEMMs with the log-sum-exp / d(logits) work in their epilogues (no logits written
    at all): 21.4 ms at the best of nine tile shapes, because Triton's GEMM at K = 512 runs
    well below cuBLAS and the epilogue's exponentials do not overlap the MMAs.
Row layouts: without host lengths the rows are the padded (B, T_max, U_max + 1) box (rows past
T_b or U_b are zeros, computed anyway). With `host_lens` (the input pipeline knows the lengths on
the host, so no sync) they are packed: only sum_b T_b (U_b + 1) rows. On a LibriSpeech-shaped
ragged batch of 192 (2.57M lattice cells in a 5.90M-cell box) that is 27.7 ms instead of 53.5 ms.

Dropout: unit k of cell (b, t, u) is kept when its 16 bits of an integer hash of (seed, b,
cell, k // 2) are >= p * 2^16 (one hash per pair of units), regenerated identically in forward
and backward; `dropout_keep_mask` materialises it for tests.
Runs on CUDA tensors, and on CPU tensors under the Triton interpreter (TRITON_INTERPRET=1).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

_NEG = -1e30  # log(0) stand-in, as in rnnt.loss
_KNEG = tl.constexpr(_NEG)  # the same, readable inside kernels

# Bytes of h, logits and dh per chunk of utterances. 1 GiB keeps the extra memory of a step at
# (192, 204, 44) fp16 near 1.3 GiB while each GEMM is still ~250k rows (full tensor-core speed;
# 512 MiB measured 10% slower, 2 GiB 3% faster at twice the memory).
CHUNK_BYTES = 1 << 30
# Launch shapes of the memory-bound kernels (swept on an H200, fp16, at (192, 204, 44) and on
# a ragged LibriSpeech batch of 192; these are the fastest on both).
# The row-wise kernels take blocks of whole rows (classes padded to BN >= V): (elements per
# block, warps, persistent programs per SM).
STATS_LAUNCH = (1024, 1, 64)  # `_logit_stats_kernel`: one row per warp
DLOGITS_LAUNCH = (2048, 8, 8)  # `_dlogits_kernel`
HIDDEN_U_TILE = 16  # label states per program of `_hidden_kernel` (one frame, all of H)
HIDDEN_WARPS = 4
FG_H_TILE = 32  # hidden units per program of the df / dg reduction
FG_PROGRAMS_PER_SM = 16  # frame splits are added until the reduction has this many programs
MAX_FG_U_TILE = 128  # label states per program there; more than this and df uses atomics


@triton.jit
def _mix(x):
    # A 32-bit integer hash (multiply / xor-shift rounds): a counter-based generator several
    # times cheaper than Philox. The hidden-unit kernels are bound by these integer ops (h is
    # regenerated in the backward pass), so each hash also serves two units.
    x = ((x >> 16) ^ x) * 0x45D9F3B
    x = ((x >> 16) ^ x) * 0x45D9F3B
    return (x >> 16) ^ x


@triton.jit
def _keep(seed, b, t, u, U1, H, drop_thr, HP: tl.constexpr):
    """Keep mask (M, HP) of units k < HP of cells (b[m], t[m], u[m]): units 2j and 2j + 1
    take the low and high 16 bits of one hash of (seed, b, t, u, j), kept when >= p * 2^16."""
    key = _mix((seed + b * 0x27D4EB2F).to(tl.uint32, bitcast=True))
    j = tl.arange(0, HP // 2)
    pair = ((t * U1 + u)[:, None] * ((H + 1) // 2) + j[None, :]).to(tl.uint32, bitcast=True)
    bits = _mix(pair ^ key[:, None])
    return tl.interleave(bits & 0xFFFF, bits >> 16).to(tl.int32) >= drop_thr


@triton.jit
def _logaddexp(a, b):
    top = tl.maximum(a, b)
    return top + tl.log(tl.exp(a - top) + tl.exp(b - top))


@triton.jit(do_not_specialize=["T", "U1"])
def _lattice_kernel(
    lpb_ptr, lpl_ptr, flen_ptr, tlen_ptr, alpha_ptr, beta_ptr, ll_ptr, T, U1,
    BLOCK_U: tl.constexpr,
):  # fmt: skip
    """alpha, beta (B, T, U+1) and log P (B,) for one utterance per program.

    Buffers start at _NEG; only cells inside the utterance's lattice are written.
    """
    b = tl.program_id(0)
    t_len = tl.load(flen_ptr + b)
    u_len = tl.load(tlen_ptr + b)
    base = b * T * U1
    u = tl.arange(0, BLOCK_U)
    n_diag = t_len + u_len
    for n in range(0, n_diag):
        t = n - u
        ok = (t >= 0) & (t < t_len) & (u <= u_len)
        ok_stay = ok & (t >= 1)
        stay = tl.load(alpha_ptr + base + (t - 1) * U1 + u, mask=ok_stay, other=_KNEG)
        stay += tl.load(lpb_ptr + base + (t - 1) * U1 + u, mask=ok_stay, other=0.0)
        ok_emit = ok & (u >= 1)
        emit = tl.load(alpha_ptr + base + t * U1 + u - 1, mask=ok_emit, other=_KNEG)
        emit += tl.load(lpl_ptr + base + t * U1 + u - 1, mask=ok_emit, other=0.0)
        a = tl.where((t == 0) & (u == 0), 0.0, _logaddexp(stay, emit))
        tl.store(alpha_ptr + base + t * U1 + u, a, mask=ok)
        tl.debug_barrier()  # the next diagonal reads what other threads just wrote
    for i in range(0, n_diag):
        n = n_diag - 1 - i
        t = n - u
        ok = (t >= 0) & (t < t_len) & (u <= u_len)
        lpb = tl.load(lpb_ptr + base + t * U1 + u, mask=ok, other=0.0)
        # Leaving the lattice by the final blank has probability one from (T_b-1, U_b).
        after = tl.where(u == u_len, 0.0, _KNEG)
        stay = tl.load(beta_ptr + base + (t + 1) * U1 + u, mask=ok & (t + 1 < t_len), other=after)
        ok_emit = ok & (u < u_len)
        emit = tl.load(beta_ptr + base + t * U1 + u + 1, mask=ok_emit, other=_KNEG)
        emit += tl.load(lpl_ptr + base + t * U1 + u, mask=ok_emit, other=0.0)
        tl.store(beta_ptr + base + t * U1 + u, _logaddexp(stay + lpb, emit), mask=ok)
        tl.debug_barrier()
    tl.store(ll_ptr + b, tl.load(beta_ptr + base))


@triton.jit(do_not_specialize=["T", "U1"])
def _posteriors_kernel(
    lpb_ptr, lpl_ptr, flen_ptr, tlen_ptr, alpha_ptr, beta_ptr, ll_ptr, occ_ptr, wb_ptr, wl_ptr,
    T, U1, BT: tl.constexpr, BLOCK_U: tl.constexpr,
):  # fmt: skip
    """Transition posteriors (B, T, U+1) of BT frames of one utterance, each in [0, 1] and 0
    outside the lattice (every cell of the box is written): those of d(-log P)/d lp,
        w_blank[t, u] = exp(alpha[t, u] + lp_blank[t, u] + beta[t+1, u] - log P), with beta
            just past the last frame = 0 at u = U_b (the final blank) and log 0 elsewhere;
        w_label[t, u] = exp(alpha[t, u] + lp_label[t, u] + beta[t, u+1] - log P), u < U_b;
        occ = w_blank + w_label (the occupancy of the cell).
    """
    b = tl.program_id(0)
    t = tl.program_id(1) * BT + tl.arange(0, BT)[:, None]
    u = tl.arange(0, BLOCK_U)[None, :]
    t_len = tl.load(flen_ptr + b)
    u_len = tl.load(tlen_ptr + b)
    log_lik = tl.load(ll_ptr + b)
    at = (b * T + t) * U1 + u
    ok = (t < t_len) & (u <= u_len)
    alpha = tl.load(alpha_ptr + at, mask=ok, other=_KNEG)
    after = tl.where(u == u_len, 0.0, _KNEG)
    stay = tl.load(beta_ptr + at + U1, mask=ok & (t + 1 < t_len), other=after)
    stay += tl.load(lpb_ptr + at, mask=ok, other=0.0)
    ok_emit = ok & (u < u_len)
    emit = tl.load(beta_ptr + at + 1, mask=ok_emit, other=_KNEG)
    emit += tl.load(lpl_ptr + at, mask=ok_emit, other=0.0)
    w_blank = tl.where(ok, tl.exp(alpha + stay - log_lik), 0.0)
    w_label = tl.where(ok_emit, tl.exp(alpha + emit - log_lik), 0.0)
    in_box = (t < T) & (u < U1)
    tl.store(wb_ptr + at, w_blank, mask=in_box)
    tl.store(wl_ptr + at, w_label, mask=in_box)
    tl.store(occ_ptr + at, w_blank + w_label, mask=in_box)


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
        return tl.load(offs_ptr + b) - row0 + (t * (u_len + 1) + u).to(tl.int64)
    return (pid * U1 + u).to(tl.int64)


@triton.jit(do_not_specialize=["T", "U1", "seed", "b0", "row0"])
def _hidden_kernel(
    f_ptr, g_ptr, flen_ptr, tlen_ptr, offs_ptr, h_ptr, b0, row0, T, U1, H, seed, drop_thr,
    scale, BU: tl.constexpr, HP: tl.constexpr, DROPOUT: tl.constexpr, PACKED: tl.constexpr,
):  # fmt: skip
    """h rows of one frame: h[(b, t, u)] = dropout(relu(f[b, t] + g[b, u])); padded rows
    outside the lattice are 0, packed chunks have none (and their programs past T_b or U_b
    return at once: on a ragged batch most of the (frame, label-tile) grid is such)."""
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
        k = tl.arange(0, HP)
        k_ok = k < H
        row_ok = (u <= u_len) & (t + 0 * u < t_len)
        # f and g are read whatever the lengths (padding is finite, zeroed below): in the
        # padded layout these loads then do not wait for the lengths' loads.
        fv = tl.load(f_ptr + (b * T + t).to(tl.int64) * H + k, mask=k_ok, other=0.0)
        gv = tl.load(g_ptr + (b * U1 + u).to(tl.int64)[:, None] * H + k[None, :],
                     mask=(u < U1)[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
        h = tl.maximum(fv.to(tl.float32)[None, :] + gv.to(tl.float32), 0.0)
        if DROPOUT:
            keep = _keep(seed, b + 0 * u, t + 0 * u, u, U1, H, drop_thr, HP)
            h = tl.where(keep, h * scale, 0.0)
        row = _chunk_row(b, t, u, u_len, pid, offs_ptr, row0, T, U1, PACKED)
        if PACKED:
            store_ok = row_ok[:, None] & k_ok[None, :]
        else:
            h = tl.where(row_ok[:, None], h, 0.0)
            store_ok = (u < U1)[:, None] & k_ok[None, :]
        tl.store(h_ptr + row[:, None] * H + k[None, :], h.to(h_ptr.dtype.element_ty),
                 mask=store_ok)  # fmt: skip


@triton.jit(do_not_specialize=["row0", "n_rows"])
def _logit_stats_kernel(
    logits_ptr, bias_ptr, label_ptr, lse_ptr, blank_ptr, target_ptr, row0, n_rows, V, blank,
    BR: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    """Per chunk row r: log-sum-exp over the classes, the blank logit and the target logit
    (bias added in fp32), written at batch row row0 + r.

    Persistent: program p takes blocks p, p + P, ... of BR whole rows (BN >= V), so each logit
    is read once with no online rescale; the blank and target logits are two gathers. Every
    load depends only on the row number, so none waits for another.
    """
    cols = tl.arange(0, BN)
    c_ok = cols < V
    bias = tl.load(bias_ptr + cols, mask=c_ok, other=0.0).to(tl.float32)
    bias_blank = tl.load(bias_ptr + blank).to(tl.float32)
    for blk in range(tl.program_id(0), tl.cdiv(n_rows, BR), tl.num_programs(0)):
        r = (blk * BR + tl.arange(0, BR)).to(tl.int64)
        ok = r < n_rows
        label = tl.load(label_ptr + row0 + r, mask=ok, other=0)
        s = tl.load(logits_ptr + r[:, None] * V + cols[None, :],
                    mask=ok[:, None] & c_ok[None, :], other=0.0)  # fmt: skip
        s_blank = tl.load(logits_ptr + r * V + blank, mask=ok, other=0.0).to(tl.float32)
        s_label = tl.load(logits_ptr + r * V + label, mask=ok, other=0.0).to(tl.float32)
        s_label += tl.load(bias_ptr + label, mask=ok, other=0.0).to(tl.float32)
        s = tl.where(c_ok[None, :], s.to(tl.float32) + bias[None, :], _KNEG)
        top = tl.max(s, axis=1)
        lse = top + tl.log(tl.sum(tl.exp(s - top[:, None]), axis=1))
        tl.store(lse_ptr + row0 + r, lse, mask=ok)
        tl.store(blank_ptr + row0 + r, s_blank + bias_blank, mask=ok)
        tl.store(target_ptr + row0 + r, s_label, mask=ok)


@triton.jit(do_not_specialize=["row0", "n_rows"])
def _dlogits_kernel(
    logits_ptr, dl_ptr, bias_ptr, label_ptr, lse_ptr, occ_ptr, wb_ptr, wl_ptr, dbias_ptr, row0,
    n_rows, V, blank, BR: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    """d loss / d logits of chunk row r (batch row row0 + r) = occ softmax - [blank] w_blank -
    [label] w_label, from per-row occupancy and transition weights that already carry the
    utterance's output-gradient ratio and are 0 on rows outside the lattice (padded layout);
    plus this program's column sums of it (its d bias share, one row of `dbias_ptr`).

    Persistent: program p takes blocks p, p + P, ... of BR whole rows. `dl_ptr` may alias
    `logits_ptr` (same dtype): each element is read before it is written.
    """
    pid = tl.program_id(0)
    cols = tl.arange(0, BN)
    c_ok = cols < V
    bias = tl.load(bias_ptr + cols, mask=c_ok, other=0.0).to(tl.float32)
    col_sum = tl.zeros((BR, BN), tl.float32)  # reduced over rows once, at the end
    for blk in range(pid, tl.cdiv(n_rows, BR), tl.num_programs(0)):
        r = (blk * BR + tl.arange(0, BR)).to(tl.int64)
        ok = r < n_rows
        s = tl.load(logits_ptr + r[:, None] * V + cols[None, :],
                    mask=ok[:, None] & c_ok[None, :], other=0.0)  # fmt: skip
        label = tl.load(label_ptr + row0 + r, mask=ok, other=0)
        lse = tl.load(lse_ptr + row0 + r, mask=ok, other=0.0)
        occ = tl.load(occ_ptr + row0 + r, mask=ok, other=0.0)
        w_blank = tl.load(wb_ptr + row0 + r, mask=ok, other=0.0)
        w_label = tl.load(wl_ptr + row0 + r, mask=ok, other=0.0)
        d = tl.exp(s.to(tl.float32) + bias[None, :] - lse[:, None]) * occ[:, None]
        d -= tl.where(cols[None, :] == blank, w_blank[:, None], 0.0)
        d -= tl.where(cols[None, :] == label[:, None], w_label[:, None], 0.0)
        d = tl.where(ok[:, None] & c_ok[None, :], d, 0.0)
        col_sum += d
        tl.store(dl_ptr + r[:, None] * V + cols[None, :], d.to(dl_ptr.dtype.element_ty),
                 mask=ok[:, None] & c_ok[None, :])  # fmt: skip
    tl.store(dbias_ptr + pid * V + cols, tl.sum(col_sum, axis=0), mask=c_ok)


@triton.jit(do_not_specialize=["T", "U1", "b0", "row0", "BC", "t_per_split"])
def _grad_fg_kernel(
    dh_ptr, h_ptr, flen_ptr, tlen_ptr, offs_ptr, df_ptr, dg_part_ptr, b0, row0, BC, T, U1, H,
    t_per_split, BU: tl.constexpr, BK: tl.constexpr, ATOMIC_DF: tl.constexpr,
    PACKED: tl.constexpr,
):  # fmt: skip
    """df[b, t] = sum_u dpre[b, t, u] and per frame-split partials of dg[b, u] = sum_t
    dpre[b, t, u], with dpre = dh * relu'.

    h holds dropout(relu(.)) * scale, so h > 0 is exactly where the gate is open (the gate's
    value, `scale`, is applied by the caller). Program (utterance, H-slice, split x U-tile)
    walks its frames; df is stored directly when one U-tile covers U+1 (no atomics), and the
    dg partials (splits, BC >= chunk utterances, U+1, H) are summed by the caller
    (deterministic).
    """
    pid = tl.program_id(0)
    b = b0 + pid
    k = tl.program_id(1) * BK + tl.arange(0, BK)
    n_u_tiles = tl.cdiv(U1, BU)
    split = tl.program_id(2) // n_u_tiles
    u = (tl.program_id(2) % n_u_tiles) * BU + tl.arange(0, BU)
    k_ok = k < H
    t_len = tl.load(flen_ptr + b)
    u_len = tl.load(tlen_ptr + b)
    ok = (u <= u_len)[:, None] & k_ok[None, :]
    dg = tl.zeros((BU, BK), tl.float32)
    t_start = split * t_per_split
    for t in range(t_start, tl.minimum(t_start + t_per_split, t_len)):
        row = _chunk_row(b, t, u, u_len, pid * T + t, offs_ptr, row0, T, U1, PACKED)
        offs = row[:, None] * H + k[None, :]
        dh = tl.load(dh_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        h = tl.load(h_ptr + offs, mask=ok, other=0.0)
        dpre = tl.where(h > 0, dh, 0.0)
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
    # The drop probability is p rounded to a multiple of 2^-16 (at most 7.6e-6 off); the
    # kept units are still scaled by 1 / (1 - p), as torch's dropout does.
    return round(p * 2**16)


def dropout_keep_mask(seed: int, b: int, t: int, u1: int, h: int, p: float, device) -> torch.Tensor:
    """The fused kernels' dropout keep mask, (B, T, U+1, H) bool, for tests and debugging."""
    out = torch.empty(b, t, u1, h, dtype=torch.int8, device=device)
    bu = 8
    _keep_mask_kernel[(b, t, triton.cdiv(u1, bu))](
        out, seed, t, u1, h, _threshold(p), BU=bu, HP=_hp(h)
    )
    return out.bool()


def _mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b with fp32 output: half inputs keep tensor-core speed, the sum keeps fp32 range."""
    if a.dtype == torch.float32:
        return a @ b
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


class _Layout:
    """Where each utterance's lattice rows (t, u) live, and their chunks of whole utterances.

    Padded: utterance b owns rows [b T (U+1), (b+1) T (U+1)), the (B, T, U+1) box, so rows
    past T_b or U_b are computed too, and row = lattice cell. Packed (lengths known on the
    host, and some padding to skip): it owns T_b (U_b + 1) rows from starts[b], nothing else.
    `starts` (B + 1,) are host ints; `offs` is their device copy for the kernels and `cells`
    (packed only) the lattice cell b T (U+1) + t (U+1) + u of every row.
    """

    def __init__(self, host_lens, bsz, t_max, u1, dev):
        self.shape = (bsz, t_max, u1)
        sizes = [t_max * u1] * bsz
        if host_lens is not None:
            sizes = [t * (u + 1) for t, u in zip(*host_lens, strict=True)]
        # Without padding the packed rows are the padded ones, whose kernels skip the row
        # tables and the lengths' loads (measured 0.8 ms faster at (192, 204, 44)).
        self.packed = sum(sizes) < bsz * t_max * u1
        self.starts = [0]
        for n in sizes:
            self.starts.append(self.starts[-1] + n)
        if self.packed:
            bsz1 = len(self.starts)
            host = self.starts + [u + 1 for u in host_lens[1]]
            self.offs, u1s = _to_device(host, dev, torch.int64).split([bsz1, bsz1 - 1])
            n_rows = self.starts[-1]
            row_b = torch.repeat_interleave(
                torch.arange(bsz, device=dev), self.offs.diff(), output_size=n_rows
            )
            u1_b = u1s[row_b]
            local = torch.arange(n_rows, device=dev) - self.offs[row_b]
            t = local // u1_b
            self.cells = (row_b * t_max + t) * u1 + (local - t * u1_b)
        else:
            self.offs = torch.zeros(1, dtype=torch.int64, device=dev)  # the kernels never read it

    def rows(self, lattice: torch.Tensor) -> torch.Tensor:
        """(B, T, U+1) lattice values -> one per row (contiguous)."""
        flat = lattice.reshape(-1)
        return flat[self.cells] if self.packed else flat.contiguous()

    def lattice(self, rows: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """One value per row -> (B, T, U+1), `fill` at cells that have no row."""
        if not self.packed:
            return rows.view(self.shape)
        out = torch.full(self.shape, fill, dtype=rows.dtype, device=rows.device)
        out.view(-1)[self.cells] = rows
        return out

    def chunks(self, rows_per_chunk: int) -> list[tuple[int, int]]:
        """(b0, bc) of consecutive utterances whose rows fit in rows_per_chunk (at least one)."""
        out, b0 = [], 0
        bsz = len(self.starts) - 1
        while b0 < bsz:
            b1 = b0 + 1
            while b1 < bsz and self.starts[b1 + 1] - self.starts[b0] <= rows_per_chunk:
                b1 += 1
            out.append((b0, b1 - b0))
            b0 = b1
        return out


class _Chunks:
    """Lattice rows in chunks of whole utterances, with the per-chunk buffers reused.

    A chunk's rows of h (H wide) and of logits (V wide) are the only buffers proportional to
    H or V, bounded by CHUNK_BYTES whatever the batch (or one utterance, if that is larger).
    """

    def __init__(self, layout, hid, v, dtype, device, backward):
        logits_dtype = _logits_dtype(dtype)
        separate_dl = backward and logits_dtype != dtype
        per_row = (hid * dtype.itemsize * (2 if backward else 1) + v * logits_dtype.itemsize
                   + (v * dtype.itemsize if separate_dl else 0))  # fmt: skip
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
        self.dh = torch.empty(rows, hid, dtype=dtype, device=device) if backward else self.h
        self.rows = rows

    def __iter__(self):
        for b0, bc, row0, n in self.spans:
            yield b0, bc, row0, n, self.h[:n], self.logits[:n], self.dl[:n], self.dh[:n]


class _FusedJointLoss(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, f, g, weight, bias, f_lens, targets, target_lens, host_lens, blank, p_drop, seed
    ):
        bsz, t_max, hid = f.shape
        u1 = g.shape[1]
        v = weight.shape[0]
        dev = f.device
        f, g, weight, bias = (x.contiguous() for x in (f, g, weight, bias))
        f_lens = f_lens.to(dev, torch.int32).contiguous()
        target_lens = target_lens.to(dev, torch.int32).contiguous()
        tgt = torch.zeros(bsz, u1, dtype=torch.int32, device=dev)
        tgt[:, : u1 - 1] = targets.clamp(0, v - 1)
        dropout = p_drop > 0.0
        scale = 1.0 / (1.0 - p_drop) if dropout else 1.0
        consts = (seed, _threshold(p_drop), scale, dropout)
        layout = _Layout(host_lens, bsz, t_max, u1, dev)
        label_rows = layout.rows(tgt.unsqueeze(1).expand(bsz, t_max, u1))
        n_rows = layout.starts[-1]
        lse_rows, blank_rows, target_rows = torch.empty(3, n_rows, dtype=torch.float32, device=dev)
        chunks = _Chunks(layout, hid, v, f.dtype, dev, backward=False)
        w_t = weight.t()
        br, bn, warps, programs = _row_launch(STATS_LAUNCH, v, chunks.rows, dev)
        for b0, bc, row0, n, h, logits, _, _ in chunks:
            _hidden(f, g, f_lens, target_lens, layout, h, b0, bc, row0, *consts)
            _logits(h, w_t, logits)
            _logit_stats_kernel[(programs,)](
                logits, bias, label_rows, lse_rows, blank_rows, target_rows, row0, n, v, blank,
                BR=br, BN=bn, num_warps=warps,
            )  # fmt: skip
        del chunks
        lp_blank = layout.lattice(blank_rows - lse_rows)
        lp_label = layout.lattice(target_rows - lse_rows)
        log_lik, posteriors = _lattice(lp_blank, lp_label, f_lens, target_lens)
        ctx.save_for_backward(f, g, weight, bias, f_lens, target_lens, label_rows, lse_rows,
                              posteriors)  # fmt: skip
        ctx.consts = (blank, consts)
        ctx.layout = layout
        return -log_lik

    @staticmethod
    def backward(ctx, grad_nll):
        (f, g, weight, bias, f_lens, target_lens, label_rows, lse_rows,
         posteriors) = ctx.saved_tensors  # fmt: skip
        blank, consts = ctx.consts
        bsz, t_max, hid = f.shape
        u1 = g.shape[1]
        v = weight.shape[0]
        dev = f.device
        # The kernels work on ratio_b = go_b / max|go| so that half-precision d(logits) stay in
        # [-1, 1] and never shrink into subnormals under a 1/B mean; max|go| is applied to the
        # fp32 results at the end (a device tensor: no host sync).
        go = grad_nll.float()
        go_max = go.abs().amax().clamp_min(1e-30)
        ratio = (go / go_max).view(-1, 1, 1)
        layout = ctx.layout
        occ, w_blank, w_label = (layout.rows(w * ratio) for w in posteriors)

        sms = _num_sms(dev)
        chunks = _Chunks(layout, hid, v, f.dtype, dev, backward=True)
        br, bn, warps, dl_programs = _row_launch(DLOGITS_LAUNCH, v, chunks.rows, dev)
        bu = min(MAX_FG_U_TILE, max(16, triton.next_power_of_2(u1)))
        fg_tiles = chunks.max_bc * triton.cdiv(hid, FG_H_TILE) * triton.cdiv(u1, bu)
        splits = max(1, min(t_max, triton.cdiv(FG_PROGRAMS_PER_SM * sms, fg_tiles)))
        t_per_split = triton.cdiv(t_max, splits)

        dw = torch.zeros(v, hid, dtype=torch.float32, device=dev)
        dbias_part = torch.empty(dl_programs, v, dtype=torch.float32, device=dev)
        dbias = torch.zeros(v, dtype=torch.float32, device=dev)
        df = torch.zeros(bsz, t_max, hid, dtype=torch.float32, device=dev)
        dg = torch.zeros(bsz, u1, hid, dtype=torch.float32, device=dev)
        dg_part = torch.empty(splits, chunks.max_bc, u1, hid, dtype=torch.float32, device=dev)
        w_t = weight.t()
        for b0, bc, row0, n, h, logits, dl, dh in chunks:
            _hidden(f, g, f_lens, target_lens, layout, h, b0, bc, row0, *consts)
            _logits(h, w_t, logits)
            _dlogits_kernel[(dl_programs,)](
                logits, dl, bias, label_rows, lse_rows, occ, w_blank, w_label, dbias_part, row0,
                n, v, blank, BR=br, BN=bn, num_warps=warps,
            )  # fmt: skip
            dbias += dbias_part.sum(0)
            dw += _mm_fp32(dl.t(), h)
            torch.mm(dl, weight, out=dh)
            _grad_fg_kernel[(bc, triton.cdiv(hid, FG_H_TILE), splits * triton.cdiv(u1, bu))](
                dh, h, f_lens, target_lens, layout.offs, df, dg_part, b0, row0, chunks.max_bc,
                t_max, u1, hid, t_per_split, BU=bu, BK=FG_H_TILE, ATOMIC_DF=u1 > bu,
                PACKED=layout.packed,
            )  # fmt: skip
            dg[b0 : b0 + bc] += dg_part[:, :bc].sum(0)
        gate = go_max * consts[2]
        return (
            (df * gate).to(f.dtype), (dg * gate).to(g.dtype), (dw * go_max).to(weight.dtype),
            (dbias * go_max).to(bias.dtype), None, None, None, None, None, None, None,
        )  # fmt: skip


def _lattice(lp_blank, lp_label, f_lens, target_lens):
    """log P (B,) and the transition posteriors (occupancy, blank, label), (3, B, T, U+1), of
    the lattices of log-probabilities lp_blank / lp_label (B, T, U+1) fp32."""
    bsz, t_max, u1 = lp_blank.shape
    alpha = torch.full_like(lp_blank, _NEG)
    beta = torch.full_like(lp_blank, _NEG)
    log_lik = torch.empty(bsz, dtype=torch.float32, device=lp_blank.device)
    block_u = max(16, triton.next_power_of_2(u1))
    _lattice_kernel[(bsz,)](
        lp_blank, lp_label, f_lens, target_lens, alpha, beta, log_lik, t_max, u1,
        BLOCK_U=block_u,
    )  # fmt: skip
    posteriors = torch.empty(3, bsz, t_max, u1, dtype=torch.float32, device=lp_blank.device)
    bt = max(1, 2048 // block_u)
    _posteriors_kernel[(bsz, triton.cdiv(t_max, bt))](
        lp_blank, lp_label, f_lens, target_lens, alpha, beta, log_lik, *posteriors, t_max, u1,
        BT=bt, BLOCK_U=block_u,
    )  # fmt: skip
    return log_lik, posteriors


def _logits_dtype(dtype: torch.dtype) -> torch.dtype:
    # bf16 logits (8-bit mantissa) would cost ~0.05 in a logit of 10; fp16 ones ~0.005.
    return torch.float32 if dtype == torch.bfloat16 else dtype


def _hidden(f, g, f_lens, target_lens, layout, h, b0, bc, row0, seed, drop_thr, scale, dropout):
    t_max, hid = f.shape[1], f.shape[2]
    u1 = g.shape[1]
    _hidden_kernel[(bc * t_max, triton.cdiv(u1, HIDDEN_U_TILE))](
        f, g, f_lens, target_lens, layout.offs, h, b0, row0, t_max, u1, hid, seed, drop_thr,
        scale, BU=HIDDEN_U_TILE, HP=_hp(hid), DROPOUT=dropout, PACKED=layout.packed,
        num_warps=HIDDEN_WARPS,
    )  # fmt: skip


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


def _logits(h, w_t, out):
    if out.dtype == h.dtype:
        torch.mm(h, w_t, out=out)
    else:
        # bf16: the fp32 product is a temporary of the chunk's logits size, so a bf16 step
        # holds about one more logits chunk than CHUNK_BYTES accounts for.
        out.copy_(_mm_fp32(h, w_t))


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
    host_lens: tuple[Sequence[int], Sequence[int]] | None = None,
) -> torch.Tensor:
    """Per-utterance RNN-T loss (B,) fp32 of the joint fc(dropout(relu(f + g))), fused.

    f (B, T, H), g (B, U+1, H), weight (V, H), bias (V,) in one float dtype (fp32, fp16 or
    bf16); f_lens (B,) in [1, T]; targets (B, U) in [0, V); target_lens (B,) in [0, U].
    Device lengths are trusted (checking them would cost a host sync). `seed` fixes the dropout
    mask (drawn from torch's CPU generator when None, so torch.manual_seed makes runs
    repeatable).

    host_lens: the same (f_lens, target_lens) as host integers, when the caller has them (the
    input pipeline does). The lattice rows are then packed: only sum_b T_b (U_b + 1) rows are
    computed instead of the padded B T (U+1), and these host lengths are the ones used (copied
    to the device without a sync); they are checked against the shapes.
    """
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
    if seed is None:
        seed = int(torch.randint(0, 2**31 - 1, (1,)).item()) if dropout_p > 0 else 0
    if host_lens is not None:
        host_lens = _check_host_lens(host_lens, f.shape[0], f.shape[1], g.shape[1] - 1)
        f_lens, target_lens = _to_device([*host_lens[0], *host_lens[1]], f.device).chunk(2)
    return _FusedJointLoss.apply(
        f, g, weight, bias, f_lens, targets, target_lens, host_lens, blank, float(dropout_p), seed
    )


def _check_host_lens(host_lens, bsz: int, t_max: int, u_max: int) -> tuple[list, list]:
    t_lens, u_lens = ([int(x) for x in lens] for lens in host_lens)
    if len(t_lens) != bsz or len(u_lens) != bsz:
        raise ValueError(
            f"host_lens: expected {bsz} frame and {bsz} label lengths, got {len(t_lens)} and "
            f"{len(u_lens)}"
        )
    for b, (t, u) in enumerate(zip(t_lens, u_lens, strict=True)):
        if not (1 <= t <= t_max and 0 <= u <= u_max):
            raise ValueError(
                f"host_lens: utterance {b} has (T, U) = ({t}, {u}); the inputs allow T in "
                f"[1, {t_max}] and U in [0, {u_max}]"
            )
    return t_lens, u_lens


def _to_device(
    values: list[int], device: torch.device, dtype: torch.dtype = torch.int32
) -> torch.Tensor:
    # One pinned buffer (so the copy does not block the host) per call: callers put all their
    # small host arrays in one list, as each pinning costs ~0.1-0.5 ms of host time.
    host = torch.empty(len(values), dtype=dtype, pin_memory=device.type == "cuda")
    host.numpy()[:] = values
    return host.to(device, non_blocking=True)
