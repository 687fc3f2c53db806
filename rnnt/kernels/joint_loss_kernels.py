"""Triton kernels of the fused joint + loss; rnnt.kernels.joint_loss launches them.

Each works on a chunk's lattice rows, one row per cell (b, t, u) of the utterances' T_b x
(U_b + 1) lattices:
- `hidden_kernel`: h = keep * relu(f + g), and per row its target label and its gate bits;
- `logit_stats_kernel` (or `stats_from_partials_kernel`, after the sm90 logits GEMM): each row's
  log-sum-exp and blank / label log-probabilities;
- `lattice_kernel`: alpha, beta and log P, one anti-diagonal per step (rnnt.kernels.lattice_walk
  is its CUDA C++ twin);
- `posteriors_kernel`: each row's occupancy and blank / label transition posteriors;
- `dlogits_kernel`: d(logits) in place of the logits, and d bias;
- `grad_fg_kernel`: df and dg from dh and the gate bits;
- `keep_mask_kernel`: the dropout mask, for tests.

Dropout: unit k of cell (b, t, u) is kept when its 15 bits of an integer hash of (seed, b,
cell, k // 2) are >= p * 2^15 (one hash per pair of units), so the backward regenerates h
instead of storing a mask. The kernels run compiled on CUDA, and on CPU tensors under Triton's
interpreter (TRITON_INTERPRET=1), which cannot run inline assembly (`gate_asm` gives "" there).
The measurements behind their designs: docs/PERFORMANCE.md "The fused loss's choices, with
their numbers".
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

_NEG = -1e30  # log(0) stand-in, as in rnnt.loss
_KNEG = tl.constexpr(_NEG)  # the same, readable inside kernels
LOG2E = tl.constexpr(1.4426950408889634)
_LN2 = tl.constexpr(0.6931471805599453)
# Lanes per diagonal of the lattice walk's diagonal-major inputs are a multiple of this, so a
# diagonal starts 16-byte aligned (vector loads of fp32 lanes).
SKEW_ALIGN = tl.constexpr(4)


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
    x = 1.0 + tl.exp2(-tl.abs(a - b).to(tl.float32) * LOG2E)
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
def _diagonal(
    skb_ptr, skl_ptr, sfirst, width, n, t_len, u_len, BLOCK_U: tl.constexpr, ALPHA: tl.constexpr
):
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
def lattice_kernel(
    skb_ptr,
    skl_ptr,
    soffs_ptr,
    flen_ptr,
    tlen_ptr,
    alpha_ptr,
    beta_ptr,
    ll_ptr,
    b0,
    T,
    U1,
    BLOCK_U: tl.constexpr,
    PACKED: tl.constexpr,
    HW_LOG2: tl.constexpr,
):
    """alpha (program (i, 0)) or beta and log P (program (i, 1)) of utterance b0 + i, all
    diagonal-major (`_diagonals`). rnnt.kernels.lattice_walk runs the same arithmetic in CUDA
    C++ (bitwise the same outputs), faster; this kernel is its reference and fallback.

    One anti-diagonal n = t + u per step, lane u holding cell (n - u, u): the diagonal stays in
    registers and the neighbour on the previous diagonal is a lane shift (`tl.gather`), so the
    only memory traffic of the sequential walk are the two transition log-probabilities per
    cell, loaded one diagonal ahead of their use (contiguous: `_diagonals`), and the diagonal's
    stores. Only cells inside the lattice are written.
    alpha and beta are summed in fp64: fp32 rounding showed in the posteriors exp(alpha + lp +
    beta - log P), and so in the gradients. The walk is bound by latency, hence the log2 as one
    instruction (`_logaddexp`) and loads only one diagonal ahead (docs/PERFORMANCE.md "The
    lattice walk's arithmetic").
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
        ok, cell, lpb, lpl = _diagonal(
            skb_ptr, skl_ptr, sfirst, width, 1, t_len, u_len, BLOCK_U, True
        )
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
        ok, cell, lpb, lpl = _diagonal(
            skb_ptr, skl_ptr, sfirst, width, n_diag - 1, t_len, u_len, BLOCK_U, False
        )
        for i in range(0, n_diag):
            nxt = _diagonal(
                skb_ptr, skl_ptr, sfirst, width, n_diag - 2 - i, t_len, u_len, BLOCK_U, False
            )
            emit = tl.gather(beta, right, 0) + lpl
            beta = tl.where(ok, _logaddexp(beta + lpb, emit, HW_LOG2), _KNEG)
            tl.store(beta_ptr + cell, beta, mask=ok)
            ok, cell, lpb, lpl = nxt
        tl.store(ll_ptr + b, tl.sum(tl.where(u == 0, beta, 0.0), axis=0))


@triton.jit(do_not_specialize=["T", "U1", "b0"])
def posteriors_kernel(
    skb_ptr,
    skl_ptr,
    offs_ptr,
    soffs_ptr,
    flen_ptr,
    tlen_ptr,
    alpha_ptr,
    beta_ptr,
    ll_ptr,
    weight_ptr,
    occ_ptr,
    wb_ptr,
    wl_ptr,
    b0,
    T,
    U1,
    BT: tl.constexpr,
    BLOCK_U: tl.constexpr,
    PACKED: tl.constexpr,
    WEIGHTED: tl.constexpr,
):
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
def keep_mask_kernel(out_ptr, seed, T, U1, H, drop_thr, BU: tl.constexpr, HP: tl.constexpr):
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
# math. The hidden kernel is bound by instruction issue, not memory, and this takes a third
# fewer instructions than fp32 math with per-unit compares and selects (docs/PERFORMANCE.md "h
# in packed half-precision math"). $1, $2: f and g pairs;
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
def gate_asm(dtype: torch.dtype, device: torch.device, hid: int) -> str:
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
    > 2^15 - 1 drops the row), in packed math (ASM: `gate_asm` of their dtype).

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


# tgt_stride is the batch's longest transcript: specialized on, it would compile per batch
@triton.jit(do_not_specialize=["tgt_stride", "T", "U1", "seed", "b0", "row0"])
def hidden_kernel(
    f_ptr,
    g_ptr,
    flen_ptr,
    tlen_ptr,
    offs_ptr,
    soffs_ptr,
    h_ptr,
    gate_ptr,
    tgt_ptr,
    tgt_stride,
    label_ptr,
    dest_ptr,
    b0,
    row0,
    T,
    U1,
    H,
    V,
    seed,
    drop_thr,
    BU: tl.constexpr,
    HP: tl.constexpr,
    DROPOUT: tl.constexpr,
    PACKED: tl.constexpr,
    GATE_ASM: tl.constexpr,
    LABELS: tl.constexpr,
    GATES: tl.constexpr,
):
    """h rows of one frame: h[(b, t, u)] = keep * relu(f[b, t] + g[b, u]), without dropout's
    1 / (1 - p) (the row kernels and the gradients apply it in fp32); padded rows outside the
    lattice are 0, packed chunks have none (and their programs past T_b or U_b return at once:
    on a ragged batch most of the (frame, label-tile) grid is such). With GATE_ASM (`gate_asm`)
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
            gv = tl.load(
                g_ptr.to(tl.pointer_type(tl.uint32)) + g_off,
                mask=(u < U1)[:, None] & j_ok[None, :],
                other=0,
            )
            if DROPOUT:
                bits = _pair_bits(seed, b + 0 * u, t + 0 * u, u, U1, H, HP)
                thr = (drop_thr * 0x10001).to(tl.uint32, bitcast=True)
            else:
                bits = tl.zeros((BU, HP // 2), tl.uint32)
                thr = tl.zeros((), tl.uint32)
            thr_row = tl.where(row_ok, thr, tl.full((), 0x80008000, tl.uint32))
            pairs = _gate_pairs(fv[None, :], gv, bits, thr_row, GATE_ASM)
            h_off = row[:, None] * (H // 2) + j[None, :]
            tl.store(
                h_ptr.to(tl.pointer_type(tl.uint32)) + h_off,
                pairs,
                mask=rows_ok[:, None] & j_ok[None, :],
            )
            if GATES:
                # Bit 15 / 31 set where the low / high half is nonzero (-0 counts as closed, as
                # in h > 0): the sum of 15-bit halves carries into bit 15 exactly then. Pair i
                # of 4 moves them to bits 2i and 16 + 2i, folded into one byte. Three integer
                # ops a pair, cheaper than compares and selects (the same section of the docs).
                open_ = ((pairs & 0x7FFF7FFF) + 0x7FFF7FFF) & 0x80008000
                shift = (15 - 2 * tl.arange(0, 4)).to(tl.uint32)
                gates = tl.sum(tl.reshape(open_, (BU, HP // 8, 4)) >> shift[None, None, :], axis=2)
                gates = gates | (gates >> 15)
        else:
            k = tl.arange(0, HP)
            k_ok = k < H
            fv = tl.load(f_ptr + (b * T + t).to(tl.int64) * H + k, mask=k_ok, other=0.0)
            gv = tl.load(
                g_ptr + (b * U1 + u).to(tl.int64)[:, None] * H + k[None, :],
                mask=(u < U1)[:, None] & k_ok[None, :],
                other=0.0,
            )
            h = tl.maximum(fv.to(tl.float32)[None, :] + gv.to(tl.float32), 0.0)
            if DROPOUT:
                keep = _keep(seed, b + 0 * u, t + 0 * u, u, U1, H, drop_thr, HP)
                h = tl.where(keep, h, 0.0)
            h = tl.where(row_ok[:, None], h, 0.0).to(h_ptr.dtype.element_ty)
            tl.store(
                h_ptr + row[:, None] * H + k[None, :], h, mask=rows_ok[:, None] & k_ok[None, :]
            )
            if GATES:
                open_ = tl.reshape((h != 0).to(tl.uint8), (BU, HP // 8, 8))
                gates = tl.sum(open_ << tl.arange(0, 8).to(tl.uint8)[None, None, :], axis=2)
        if GATES:
            kb = tl.arange(0, HP // 8)
            tl.store(
                gate_ptr + row[:, None] * (HP // 8) + kb[None, :],
                gates.to(tl.uint8),
                mask=rows_ok[:, None],
            )
        if LABELS:
            label = tl.load(tgt_ptr + b.to(tl.int64) * tgt_stride + u, mask=u < u_len, other=0)
            label = tl.minimum(tl.maximum(label, 0), V - 1).to(tl.int32)
            tl.store(label_ptr + row0 + row, label, mask=rows_ok)
            sfirst, width = _diagonals(b, u_len, soffs_ptr, T, U1, PACKED)
            dest = sfirst + (t + 1 + u) * width + u
            tl.store(dest_ptr + row0 + row, dest.to(tl.int32), mask=rows_ok)


@triton.jit(do_not_specialize=["row0", "n_rows"])
def logit_stats_kernel(
    logits_ptr,
    bias_ptr,
    label_ptr,
    dest_ptr,
    lse_ptr,
    skb_ptr,
    skl_ptr,
    row0,
    n_rows,
    V,
    blank,
    gate_scale,
    BR: tl.constexpr,
    BN: tl.constexpr,
    EVEN: tl.constexpr,
    STAGES: tl.constexpr,
):
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
    scale2 = gate_scale * LOG2E
    bias2 = tl.load(bias_ptr + cols, mask=c_ok, other=0.0).to(tl.float32) * LOG2E
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
            s = tl.load(
                logits_ptr + r[:, None] * V + cols[None, :],
                mask=ok[:, None] & c_ok[None, :],
                other=0.0,
            )
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
def stats_from_partials_kernel(
    part_ptr,
    logits_ptr,
    bias_ptr,
    label_ptr,
    dest_ptr,
    lse_ptr,
    skb_ptr,
    skl_ptr,
    row0,
    n_rows,
    V,
    blank,
    gate_scale,
    NT: tl.constexpr,
    NTP: tl.constexpr,
    BR: tl.constexpr,
):
    """`logit_stats_kernel`'s outputs from the sm90 logits GEMM's partials (rnnt.kernels.
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
def dlogits_kernel(
    logits_ptr,
    dl_ptr,
    bias_ptr,
    label_ptr,
    lse_ptr,
    occ_ptr,
    wb_ptr,
    wl_ptr,
    dbias_ptr,
    row0,
    n_rows,
    V,
    blank,
    gate_scale,
    BR: tl.constexpr,
    BN: tl.constexpr,
    EVEN: tl.constexpr,
    STAGES: tl.constexpr,
):
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
    bias2 = tl.load(bias_ptr + cols, mask=c_ok, other=0.0).to(tl.float32) * LOG2E
    scale2 = gate_scale * LOG2E  # the logits as in `logit_stats_kernel`
    col_sum = tl.zeros((BR, BN), tl.float32)  # reduced over rows once, at the end
    for blk in tl.range(pid, tl.cdiv(n_rows, BR), tl.num_programs(0), num_stages=STAGES):
        r = (blk * BR + tl.arange(0, BR)).to(tl.int64)
        ok = r < n_rows
        tile_ok = ok[:, None] if EVEN else ok[:, None] & c_ok[None, :]
        s = tl.load(logits_ptr + r[:, None] * V + cols[None, :], mask=tile_ok, other=0.0)
        label = tl.load(label_ptr + row0 + r, mask=ok, other=0)
        # rows past n_rows: lse = +inf makes their softmax 0 whatever the bias (no inf * 0)
        lse2 = tl.load(lse_ptr + row0 + r, mask=ok, other=float("inf")) * LOG2E
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
        tl.store(
            dl_ptr + r[:, None] * V + cols[None, :], d.to(dl_ptr.dtype.element_ty), mask=tile_ok
        )
    so_far = tl.load(dbias_ptr + pid * V + cols, mask=c_ok, other=0.0)
    tl.store(dbias_ptr + pid * V + cols, so_far + tl.sum(col_sum, axis=0), mask=c_ok)


@triton.jit(do_not_specialize=["T", "U1", "b0", "row0", "BC", "t_per_split"])
def grad_fg_kernel(
    dh_ptr,
    gate_ptr,
    flen_ptr,
    tlen_ptr,
    offs_ptr,
    df_ptr,
    dg_part_ptr,
    b0,
    row0,
    BC,
    T,
    U1,
    H,
    t_per_split,
    BU: tl.constexpr,
    BK: tl.constexpr,
    HP: tl.constexpr,
    ATOMIC_DF: tl.constexpr,
    PACKED: tl.constexpr,
    STAGES: tl.constexpr,
):
    """df[b, t] = sum_u dpre[b, t, u] and per frame-split partials of dg[b, u] = sum_t
    dpre[b, t, u], with dpre = dh * relu'.

    relu' (ReLU and dropout gate open, its value 1 / (1 - p) applied by the caller) comes from
    the rows' gate bits of `hidden_kernel` (GATES, HP / 8 bytes per row). Program (utterance,
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
        gates = tl.load(gate_ptr + row[:, None] * (HP // 8) + kb[None, :], mask=gates_ok, other=0)
        gates = tl.reshape(tl.broadcast_to(gates[:, :, None], (BU, BK // 8, 8)), (BU, BK))
        dpre = tl.where(((gates >> (k % 8)[None, :]) & 1) != 0, dh, 0.0)
        dg += dpre
        df_offs = (b * T + t).to(tl.int64) * H + k
        if ATOMIC_DF:
            tl.atomic_add(df_ptr + df_offs, tl.sum(dpre, axis=0), mask=k_ok)
        else:
            tl.store(df_ptr + df_offs, tl.sum(dpre, axis=0), mask=k_ok)
    out = ((split * BC + pid) * U1 + u).to(tl.int64)
    tl.store(
        dg_part_ptr + out[:, None] * H + k[None, :], dg, mask=(u < U1)[:, None] & k_ok[None, :]
    )
