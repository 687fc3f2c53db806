"""Fused RNN-T joint network + loss in Triton: the (B, T, U+1, V) logits never exist.

What it computes, for every lattice cell (b, t, u) with t < T_b and u <= U_b:

    h = dropout(relu(f[b, t] + g[b, u]))              (H,)   f (B, T, H), g (B, U+1, H)
    logits = h @ W^T + bias                           (V,)   W (V, H) = Joint.fc.weight
    lp_blank = logits[blank] - logsumexp(logits),  lp_label = logits[y[b, u]] - logsumexp(logits)

and the per-utterance loss -log P(y_b | x_b) from the forward/backward variables over those
(B, T, U+1) values. It is exact: every cell and every class is used (no pruning).

Passes (all tiles are BT frames x BU label states = M lattice rows, fp32 accumulation):
    1. `_forward_kernel`, grid (B x T-tiles, U-tiles): h for the tile (full H kept on chip),
       then the logits V-tile by V-tile with an online log-sum-exp; keeps lse, the blank logit
       and the target logit per cell. Tiles past (T_b, U_b) exit at once (ragged batches).
    2. `_lattice_kernel`, grid (B,): alpha and beta along anti-diagonals t + u = n, one
       vector of U+1 cells per step, synchronised through global memory with a CTA barrier.
       The transition posteriors (occupancy, blank and label weights) follow elementwise in
       PyTorch; they are all the backward pass needs from the lattice.
    3. `_grad_fg_kernel`, grid (B, T-tiles): for each U-tile up to U_b, recompute the logits
       tile by tile, form dlogits = occupancy * softmax - blank/label posteriors, accumulate
       dh = dlogits @ W over V, mask it with relu' and dropout, and reduce it over u (df, kept
       in registers for the program's frames: no atomics) and over t (dg, one atomic add per
       tile and label state).
    4. `_grad_w_kernel`, grid (V-tiles, S splits of the lattice tiles): each program holds one
       V-tile of W, walks its share of the lattice tiles, recomputes h and dlogits and
       accumulates dW = dlogits^T @ h and dbias in registers, then writes an S x V x H fp32
       partial that torch sums (no atomics on W).

Memory: O(B T (U+1)) fp32 for lse / logits / alpha / beta / weights, O(S V H) for the dW
partials, nothing of size B T (U+1) V or B T (U+1) H. Compute: the logits GEMM is recomputed
once in each backward pass (5 GEMMs of B T (U+1) x H x V in all, against 3 without
recomputation).

Measured on one H200 (fp16, dropout 0.3, forward + backward, bench/joint_loss.py, torch 2.11,
Triton 3.6): 97 ms / 0.32 GiB extra at (B, T, U) = (192, 204, 44) (torchaudio: 68 ms / 11 GiB),
348 ms / 0.56 GiB at (192, 279, 125) (torchaudio: illegal memory access), 148 ms / 0.52 GiB on a
LibriSpeech-shaped ragged batch. Far from issue 7's 12 ms target: the passes hold h (M x H) and
the dh / dW accumulators (M x H, BN x H fp32) in registers with one pipeline stage, and the dW
pass regenerates h once per class tile (V / BN times); see the kernel tests' xfail.

Dropout: element (b, t, u, k) is kept when 24 bits of an integer hash of (seed, b,
(t (U+1) + u) H + k) are >= p * 2^24, regenerated identically in every pass;
`dropout_keep_mask` materialises it for tests.
Runs on CUDA tensors, and on CPU tensors under the Triton interpreter (TRITON_INTERPRET=1).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_NEG = -1e30  # log(0) stand-in, as in rnnt.loss
_KNEG = tl.constexpr(_NEG)  # the same, readable inside kernels
# Integer arguments that change from batch to batch. Triton would otherwise compile a variant
# per value class (== 1, divisible by 16) of each, i.e. dozens of seconds-long compiles during
# the first training steps (the seed alone changes every step).
_RUNTIME_INTS = ["T", "U1", "seed", "n_t_tiles"]

# Launch configurations by element size of the inputs: per pass (BT, BU, BN, num_warps), with
# M = BT * BU lattice rows and BN classes per logits tile. A tile keeps h (M x H) and a W tile
# (BN x H) on chip whole, so fp32 gets smaller tiles; one pipeline stage keeps shared memory
# within an H100/H200 SM at H = 512.
TILES = {
    2: {"fwd": (8, 16, 64, 8), "grad_fg": (4, 8, 64, 8), "grad_w": (4, 16, 64, 8)},
    4: {"fwd": (4, 8, 32, 8), "grad_fg": (4, 4, 32, 8), "grad_w": (4, 8, 32, 8)},
}
NUM_STAGES = 1
# dW programs per SM (each owns one class tile and a share of the lattice tiles); more of them
# hide latency better but each writes its own V x H fp32 partial.
GRAD_W_PROGRAMS_PER_SM = 8


@triton.jit
def _joint_rows(f_ptr, g_ptr, b, t0, u0, t, u, row_ok, k, k_ok, T, U1, H, seed, drop_thr,
                scale, BT: tl.constexpr, BU: tl.constexpr,
                DROPOUT: tl.constexpr):  # fmt: skip
    """h (M, HP) and gate (M, HP) = d h / d(f + g) for lattice rows (b, t[m], u[m]),
    t[m] = t0 + m // BU, u[m] = u0 + m % BU."""
    # BT frames and BU label states are loaded once and broadcast to the M = BT x BU rows.
    tt = t0 + tl.arange(0, BT)
    uu = u0 + tl.arange(0, BU)
    fv = tl.load(f_ptr + (b * T + tt)[:, None] * H + k[None, :],
                 mask=(tt < T)[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
    gv = tl.load(g_ptr + (b * U1 + uu)[:, None] * H + k[None, :],
                 mask=(uu < U1)[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
    pre = fv.to(tl.float32)[:, None, :] + gv.to(tl.float32)[None, :, :]
    pre = tl.where(row_ok[:, None], tl.reshape(pre, (BT * BU, k.shape[0])), 0.0)
    gate = tl.where(pre > 0.0, 1.0, 0.0)
    if DROPOUT:
        keep = _keep(seed, b, t, u, k, U1, H, drop_thr)
        gate = tl.where(keep, gate * scale, 0.0)
    return pre * gate, gate


@triton.jit
def _mix(x):
    # A 32-bit integer hash (multiply / xor-shift rounds): a counter-based generator that is
    # several times cheaper than Philox, which matters because the backward passes regenerate
    # the mask once per class tile.
    x = ((x >> 16) ^ x) * 0x45D9F3B
    x = ((x >> 16) ^ x) * 0x45D9F3B
    return (x >> 16) ^ x


@triton.jit
def _keep(seed, b, t, u, k, U1, H, drop_thr):
    """Keep mask (M, HP) of elements (b, t[m], u[m], k): 24 hash bits compared to p * 2^24."""
    key = _mix((seed + b * 0x27D4EB2F).to(tl.uint32, bitcast=True))
    idx = ((t * U1 + u)[:, None] * H + k[None, :]).to(tl.uint32, bitcast=True)
    return (_mix(idx ^ key) >> 8).to(tl.int32) >= drop_thr


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def _forward_kernel(
    f_ptr, g_ptr, w_ptr, bias_ptr, tgt_ptr, flen_ptr, tlen_ptr,
    lse_ptr, blank_ptr, label_ptr,
    T, U1, H, V, blank, seed, drop_thr, scale, n_t_tiles,
    BT: tl.constexpr, BU: tl.constexpr, BN: tl.constexpr, HP: tl.constexpr,
    DROPOUT: tl.constexpr, DOT_PREC: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    b = pid // n_t_tiles
    t0 = (pid % n_t_tiles) * BT
    u0 = tl.program_id(1) * BU
    t_len = tl.load(flen_ptr + b)
    u_len = tl.load(tlen_ptr + b)
    if (t0 < t_len) & (u0 <= u_len):
        m = tl.arange(0, BT * BU)
        t = t0 + m // BU
        u = u0 + m % BU
        row_ok = (t < t_len) & (u <= u_len)
        k = tl.arange(0, HP)
        k_ok = k < H
        h, _ = _joint_rows(f_ptr, g_ptr, b, t0, u0, t, u, row_ok, k, k_ok, T, U1, H, seed,
                           drop_thr, scale, BT, BU, DROPOUT)  # fmt: skip
        h = h.to(w_ptr.dtype.element_ty)
        label = tl.load(tgt_ptr + b * U1 + u, mask=row_ok, other=0)
        run_max = tl.full((BT * BU,), _KNEG, tl.float32)
        run_sum = tl.zeros((BT * BU,), tl.float32)
        blank_logit = tl.zeros((BT * BU,), tl.float32)
        label_logit = tl.zeros((BT * BU,), tl.float32)
        for n0 in range(0, V, BN):
            cols = n0 + tl.arange(0, BN)
            c_ok = cols < V
            w = tl.load(w_ptr + cols[:, None] * H + k[None, :],
                        mask=c_ok[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
            bias = tl.load(bias_ptr + cols, mask=c_ok, other=0.0).to(tl.float32)
            s = tl.dot(h, tl.trans(w), input_precision=DOT_PREC) + bias[None, :]
            s = tl.where(c_ok[None, :], s, _KNEG)
            new_max = tl.maximum(run_max, tl.max(s, axis=1))
            run_sum = run_sum * tl.exp(run_max - new_max) + tl.sum(
                tl.exp(s - new_max[:, None]), axis=1
            )
            run_max = new_max
            blank_logit += tl.sum(tl.where(cols[None, :] == blank, s, 0.0), axis=1)
            label_logit += tl.sum(tl.where(cols[None, :] == label[:, None], s, 0.0), axis=1)
        cell = (b * T + t) * U1 + u
        tl.store(lse_ptr + cell, run_max + tl.log(run_sum), mask=row_ok)
        tl.store(blank_ptr + cell, blank_logit, mask=row_ok)
        tl.store(label_ptr + cell, label_logit, mask=row_ok)


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


@triton.jit
def _dlogits(h, w, bias, cols, c_ok, row_ok, label, lse, occ, w_blank, w_label, blank,
             DOT_PREC: tl.constexpr):  # fmt: skip
    """d loss / d logits for M rows x BN classes: occupancy * softmax - transition weights."""
    s = tl.dot(h, tl.trans(w), input_precision=DOT_PREC) + bias[None, :]
    ok = row_ok[:, None] & c_ok[None, :]
    d = tl.where(ok, tl.exp(s - lse[:, None]), 0.0) * occ[:, None]
    d -= tl.where(cols[None, :] == blank, w_blank[:, None], 0.0)
    d -= tl.where(cols[None, :] == label[:, None], w_label[:, None], 0.0)
    return tl.where(ok, d, 0.0)


@triton.jit
def _cell_stats(lse_ptr, occ_ptr, wb_ptr, wl_ptr, tgt_ptr, b, t, u, row_ok, T, U1):
    """Per lattice cell (b, t, u): log-sum-exp, occupancy, blank and label posteriors, label."""
    cell = (b * T + t) * U1 + u
    lse = tl.load(lse_ptr + cell, mask=row_ok, other=0.0)
    occ = tl.load(occ_ptr + cell, mask=row_ok, other=0.0)
    w_blank = tl.load(wb_ptr + cell, mask=row_ok, other=0.0)
    w_label = tl.load(wl_ptr + cell, mask=row_ok, other=0.0)
    label = tl.load(tgt_ptr + b * U1 + u, mask=row_ok, other=0)
    return lse, occ, w_blank, w_label, label


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def _grad_fg_kernel(
    f_ptr, g_ptr, w_ptr, bias_ptr, tgt_ptr, flen_ptr, tlen_ptr,
    lse_ptr, occ_ptr, wb_ptr, wl_ptr, go_ptr, df_ptr, dg_ptr,
    T, U1, H, V, blank, seed, drop_thr, scale, n_t_tiles,
    BT: tl.constexpr, BU: tl.constexpr, BN: tl.constexpr, HP: tl.constexpr,
    DROPOUT: tl.constexpr, DOT_PREC: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    t0 = tl.program_id(1) * BT
    t_len = tl.load(flen_ptr + b)
    u_len = tl.load(tlen_ptr + b)
    if t0 < t_len:
        go = tl.load(go_ptr + b)
        m = tl.arange(0, BT * BU)
        k = tl.arange(0, HP)
        k_ok = k < H
        df = tl.zeros((BT, HP), tl.float32)
        for u0 in range(0, u_len + 1, BU):
            t = t0 + m // BU
            u = u0 + m % BU
            row_ok = (t < t_len) & (u <= u_len)
            h, gate = _joint_rows(f_ptr, g_ptr, b, t0, u0, t, u, row_ok, k, k_ok, T, U1, H, seed,
                                  drop_thr, scale, BT, BU, DROPOUT)  # fmt: skip
            h = h.to(w_ptr.dtype.element_ty)
            lse, occ, w_blank, w_label, label = _cell_stats(
                lse_ptr, occ_ptr, wb_ptr, wl_ptr, tgt_ptr, b, t, u, row_ok, T, U1
            )
            dh = tl.zeros((BT * BU, HP), tl.float32)
            for n0 in range(0, V, BN):
                cols = n0 + tl.arange(0, BN)
                c_ok = cols < V
                w = tl.load(w_ptr + cols[:, None] * H + k[None, :],
                            mask=c_ok[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
                bias = tl.load(bias_ptr + cols, mask=c_ok, other=0.0).to(tl.float32)
                d = _dlogits(h, w, bias, cols, c_ok, row_ok, label, lse, occ, w_blank, w_label,
                             blank, DOT_PREC)  # fmt: skip
                dh += tl.dot(d.to(w.dtype), w, input_precision=DOT_PREC)
            dpre = tl.reshape(dh * gate, (BT, BU, HP))
            df += tl.sum(dpre, axis=1)
            uu = u0 + tl.arange(0, BU)
            dg = tl.sum(dpre, axis=0) * go
            tl.atomic_add(dg_ptr + (b * U1 + uu)[:, None] * H + k[None, :], dg,
                          mask=(uu <= u_len)[:, None] & k_ok[None, :])  # fmt: skip
        tt = t0 + tl.arange(0, BT)
        tl.store(df_ptr + (b * T + tt)[:, None] * H + k[None, :], df * go,
                 mask=(tt < t_len)[:, None] & k_ok[None, :])  # fmt: skip


@triton.jit(do_not_specialize=_RUNTIME_INTS + ["n_u_tiles", "n_tiles", "n_splits"])
def _grad_w_kernel(
    f_ptr, g_ptr, w_ptr, bias_ptr, tgt_ptr, flen_ptr, tlen_ptr,
    lse_ptr, occ_ptr, wb_ptr, wl_ptr, go_ptr, dw_ptr, dbias_ptr,
    T, U1, H, V, blank, seed, drop_thr, scale, n_t_tiles, n_u_tiles, n_tiles, n_splits,
    BT: tl.constexpr, BU: tl.constexpr, BN: tl.constexpr, HP: tl.constexpr,
    DROPOUT: tl.constexpr, DOT_PREC: tl.constexpr,
):  # fmt: skip
    n0 = tl.program_id(0) * BN
    split = tl.program_id(1)
    cols = n0 + tl.arange(0, BN)
    c_ok = cols < V
    k = tl.arange(0, HP)
    k_ok = k < H
    w = tl.load(w_ptr + cols[:, None] * H + k[None, :], mask=c_ok[:, None] & k_ok[None, :],
                other=0.0)  # fmt: skip
    bias = tl.load(bias_ptr + cols, mask=c_ok, other=0.0).to(tl.float32)
    dw = tl.zeros((BN, HP), tl.float32)
    dbias = tl.zeros((BN,), tl.float32)
    m = tl.arange(0, BT * BU)
    per_utt = n_t_tiles * n_u_tiles
    for idx in range(split, n_tiles, n_splits):
        b = idx // per_utt
        t0 = (idx % per_utt) // n_u_tiles * BT
        u0 = (idx % n_u_tiles) * BU
        t_len = tl.load(flen_ptr + b)
        u_len = tl.load(tlen_ptr + b)
        if (t0 < t_len) & (u0 <= u_len):
            t = t0 + m // BU
            u = u0 + m % BU
            row_ok = (t < t_len) & (u <= u_len)
            h, _ = _joint_rows(f_ptr, g_ptr, b, t0, u0, t, u, row_ok, k, k_ok, T, U1, H, seed,
                               drop_thr, scale, BT, BU, DROPOUT)  # fmt: skip
            h = h.to(w_ptr.dtype.element_ty)
            lse, occ, w_blank, w_label, label = _cell_stats(
                lse_ptr, occ_ptr, wb_ptr, wl_ptr, tgt_ptr, b, t, u, row_ok, T, U1
            )
            d = _dlogits(h, w, bias, cols, c_ok, row_ok, label, lse, occ, w_blank, w_label,
                         blank, DOT_PREC)  # fmt: skip
            go = tl.load(go_ptr + b)
            dw += tl.dot(tl.trans(d.to(h.dtype)), h, input_precision=DOT_PREC) * go
            dbias += tl.sum(d, axis=0) * go
    out = split * V + cols
    tl.store(dw_ptr + out[:, None] * H + k[None, :], dw, mask=c_ok[:, None] & k_ok[None, :])
    tl.store(dbias_ptr + out, dbias, mask=c_ok)


@triton.jit
def _keep_mask_kernel(out_ptr, seed, T, U1, H, drop_thr, BU: tl.constexpr, HP: tl.constexpr):
    b = tl.program_id(0)
    t = tl.program_id(1)
    u = tl.program_id(2) * BU + tl.arange(0, BU)
    k = tl.arange(0, HP)
    keep = _keep(seed, b, t + 0 * u, u, k, U1, H, drop_thr)
    ok = (u < U1)[:, None] & (k < H)[None, :]
    tl.store(out_ptr + ((b * T + t) * U1 + u)[:, None] * H + k[None, :], keep.to(tl.int8), mask=ok)


# --------------------------------------------------------------------------------------------
# Host side


def _hp(h: int) -> int:
    return max(16, triton.next_power_of_2(h))


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs get true fp32 products (TF32 would miss the 1e-4 parity with the reference)
    return "ieee" if dtype == torch.float32 else "tf32"


def _threshold(p: float) -> int:
    return round(p * 2**24)


def dropout_keep_mask(seed: int, b: int, t: int, u1: int, h: int, p: float, device) -> torch.Tensor:
    """The fused kernels' dropout keep mask, (B, T, U+1, H) bool, for tests and debugging."""
    out = torch.empty(b, t, u1, h, dtype=torch.int8, device=device)
    bu = 8
    _keep_mask_kernel[(b, t, triton.cdiv(u1, bu))](
        out, seed, t, u1, h, _threshold(p), BU=bu, HP=_hp(h)
    )
    return out.bool()


def _num_splits(device: torch.device, n_v_tiles: int, n_tiles: int) -> int:
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
    else:
        sms = 2
    return max(1, min(n_tiles, triton.cdiv(GRAD_W_PROGRAMS_PER_SM * sms, n_v_tiles)))


class _FusedJointLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, f, g, weight, bias, f_lens, targets, target_lens, blank, p_drop, seed):
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
        drop_thr = _threshold(p_drop)
        prec = _dot_precision(weight.dtype)
        hp = _hp(hid)

        lse = torch.zeros(bsz, t_max, u1, dtype=torch.float32, device=dev)
        blank_logit = torch.zeros_like(lse)
        label_logit = torch.zeros_like(lse)
        tiles = TILES[weight.element_size()]
        bt, bu, bn, warps = tiles["fwd"]
        n_t_tiles = triton.cdiv(t_max, bt)
        _forward_kernel[(bsz * n_t_tiles, triton.cdiv(u1, bu))](
            f, g, weight, bias, tgt, f_lens, target_lens, lse, blank_logit, label_logit,
            t_max, u1, hid, v, blank, seed, drop_thr, scale, n_t_tiles,
            BT=bt, BU=bu, BN=bn, HP=hp, DROPOUT=dropout, DOT_PREC=prec,
            num_warps=warps, num_stages=NUM_STAGES,
        )  # fmt: skip
        lp_blank = blank_logit - lse
        lp_label = label_logit - lse
        alpha = torch.full_like(lse, _NEG)
        beta = torch.full_like(lse, _NEG)
        log_lik = torch.empty(bsz, dtype=torch.float32, device=dev)
        _lattice_kernel[(bsz,)](
            lp_blank, lp_label, f_lens, target_lens, alpha, beta, log_lik, t_max, u1,
            BLOCK_U=max(16, triton.next_power_of_2(u1)),
        )  # fmt: skip
        ctx.save_for_backward(f, g, weight, bias, f_lens, target_lens, tgt, lse, lp_blank,
                              lp_label, alpha, beta, log_lik)  # fmt: skip
        ctx.consts = (blank, drop_thr, scale, seed, dropout, prec, hp)
        return -log_lik

    @staticmethod
    def backward(ctx, grad_nll):
        (f, g, weight, bias, f_lens, target_lens, tgt, lse, lp_blank, lp_label, alpha, beta,
         log_lik) = ctx.saved_tensors  # fmt: skip
        blank, drop_thr, scale, seed, dropout, prec, hp = ctx.consts
        bsz, t_max, hid = f.shape
        u1 = g.shape[1]
        v = weight.shape[0]
        occ, w_blank, w_label = _transition_weights(
            alpha, beta, lp_blank, lp_label, log_lik, f_lens, target_lens
        )
        go = grad_nll.float().contiguous()
        args = (f, g, weight, bias, tgt, f_lens, target_lens, lse, occ, w_blank, w_label, go)
        consts = (t_max, u1, hid, v, blank, seed, drop_thr, scale)

        df = torch.zeros(bsz, t_max, hid, dtype=torch.float32, device=f.device)
        dg = torch.zeros(bsz, u1, hid, dtype=torch.float32, device=f.device)
        tiles = TILES[weight.element_size()]
        bt, bu, bn, warps = tiles["grad_fg"]
        n_t_tiles = triton.cdiv(t_max, bt)
        _grad_fg_kernel[(bsz, n_t_tiles)](
            *args, df, dg, *consts, n_t_tiles,
            BT=bt, BU=bu, BN=bn, HP=hp, DROPOUT=dropout, DOT_PREC=prec,
            num_warps=warps, num_stages=NUM_STAGES,
        )  # fmt: skip

        bt, bu, bn, warps = tiles["grad_w"]
        n_t_tiles = triton.cdiv(t_max, bt)
        n_u_tiles = triton.cdiv(u1, bu)
        n_tiles = bsz * n_t_tiles * n_u_tiles
        n_v_tiles = triton.cdiv(v, bn)
        splits = _num_splits(f.device, n_v_tiles, n_tiles)
        dw = torch.empty(splits, v, hid, dtype=torch.float32, device=f.device)
        dbias = torch.empty(splits, v, dtype=torch.float32, device=f.device)
        _grad_w_kernel[(n_v_tiles, splits)](
            *args, dw, dbias, *consts, n_t_tiles, n_u_tiles, n_tiles, splits,
            BT=bt, BU=bu, BN=bn, HP=hp, DROPOUT=dropout, DOT_PREC=prec,
            num_warps=warps, num_stages=NUM_STAGES,
        )  # fmt: skip
        return (
            df.to(f.dtype), dg.to(g.dtype), dw.sum(0).to(weight.dtype),
            dbias.sum(0).to(bias.dtype), None, None, None, None, None, None,
        )  # fmt: skip


def _transition_weights(alpha, beta, lp_blank, lp_label, log_lik, f_lens, target_lens):
    """Posterior of each transition: (occupancy, blank, label), each (B, T, U+1) in [0, 1].

    The kernels multiply by d loss_b only after their products, so fp16/bf16 operands never
    hold posteriors shrunk by a 1/B mean into the subnormal range.

    d(-log P)/d lp_blank[t, u] = -exp(alpha[t, u] + lp_blank[t, u] + beta[t+1, u] - log P),
    with beta just past the last frame = 0 at u = U_b (the final blank) and log 0 elsewhere.
    """
    bsz, t_max, u1 = alpha.shape
    t = torch.arange(t_max, device=alpha.device).view(1, -1, 1)
    u = torch.arange(u1, device=alpha.device).view(1, 1, -1)
    t_len = f_lens.view(-1, 1, 1).long()
    u_len = target_lens.view(-1, 1, 1).long()
    beta_next_t = torch.nn.functional.pad(beta[:, 1:], (0, 0, 0, 1), value=_NEG)
    beta_next_t = torch.where((t == t_len - 1) & (u == u_len), 0.0, beta_next_t)
    beta_next_u = torch.nn.functional.pad(beta[:, :, 1:], (0, 1), value=_NEG)
    inside = (t < t_len) & (u <= u_len)
    ll = log_lik.view(-1, 1, 1)
    w_blank = torch.where(inside, torch.exp(alpha + lp_blank + beta_next_t - ll), 0.0)
    w_label = torch.where(inside & (u < u_len), torch.exp(alpha + lp_label + beta_next_u - ll), 0.0)
    return (w_blank + w_label).contiguous(), w_blank.contiguous(), w_label.contiguous()


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
) -> torch.Tensor:
    """Per-utterance RNN-T loss (B,) fp32 of the joint fc(dropout(relu(f + g))), fused.

    f (B, T, H), g (B, U+1, H), weight (V, H), bias (V,) in one float dtype (fp32, fp16 or
    bf16); f_lens (B,) in [1, T]; targets (B, U) in [0, V); target_lens (B,) in [0, U].
    Lengths are trusted (checking them would cost a host sync). `seed` fixes the dropout mask
    (drawn from torch's CPU generator when None, so torch.manual_seed makes runs repeatable).
    """
    if not (f.dtype == g.dtype == weight.dtype == bias.dtype):
        raise TypeError(
            f"fused joint loss needs one dtype for f, g, weight and bias, got {f.dtype}, "
            f"{g.dtype}, {weight.dtype}, {bias.dtype}"
        )
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {dropout_p}")
    if seed is None:
        seed = int(torch.randint(0, 2**31 - 1, (1,)).item()) if dropout_p > 0 else 0
    return _FusedJointLoss.apply(
        f, g, weight, bias, f_lens, targets, target_lens, blank, float(dropout_p), seed
    )
