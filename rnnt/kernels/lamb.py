"""LAMB's elementwise step in one Triton kernel (the plain-PyTorch maths in rnnt/optim/lamb.py
is its reference).

Per element of a parameter group's flat fp32 buffers, with the device scalars coef (unscale x
clip), keep (0 on a skipped step) and the bias corrections bc1 = 1 - b1^t, bc2 = 1 - b2^t:

    g <- coef g, or 0 when the step is skipped
    m <- m + keep (1 - b1) (g - m)
    v <- (1 - keep (1 - b2)) v + (1 - b2) g^2
    u <- m / (sqrt(v / bc2) + eps) / bc1 + weight_decay w          (written over g)

That is four reads and three writes of the buffers, where the eleven PyTorch elementwise ops
it replaces make about thirteen passes (what that cost: docs/PERFORMANCE.md, "Numbers the
code's comments used to quote").
Division and square root are IEEE round-to-nearest, as in PyTorch, so both paths agree to an
ulp or so.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048
WARPS = 8


@triton.jit
def _lamb_update_kernel(
    g_ptr,
    m_ptr,
    v_ptr,
    w_ptr,
    coef_ptr,
    keep_ptr,
    bc1_ptr,
    bc2_ptr,
    n,
    one_minus_b1,
    one_minus_b2,
    eps,
    weight_decay,
    SKIPPABLE: tl.constexpr,
    DECAY: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    g = tl.load(g_ptr + offs, mask=ok, other=0.0) * tl.load(coef_ptr)
    w1 = one_minus_b1
    w2 = one_minus_b2
    if SKIPPABLE:
        keep = tl.load(keep_ptr)
        g = tl.where(keep > 0, g, 0.0)  # also drops the inf / nan of an overflowed step
        w1 = keep * w1
        w2 = keep * w2
    m = tl.load(m_ptr + offs, mask=ok, other=0.0)
    m = m + w1 * (g - m)
    v = tl.load(v_ptr + offs, mask=ok, other=0.0)
    v = v * (1.0 - w2) + one_minus_b2 * g * g
    denom = tl.sqrt_rn(tl.div_rn(v, tl.load(bc2_ptr))) + eps
    u = tl.div_rn(tl.div_rn(m, denom), tl.load(bc1_ptr))
    if DECAY:
        u += weight_decay * tl.load(w_ptr + offs, mask=ok, other=0.0)
    tl.store(m_ptr + offs, m, mask=ok)
    tl.store(v_ptr + offs, v, mask=ok)
    tl.store(g_ptr + offs, u, mask=ok)


def lamb_update_(
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    weight: torch.Tensor,
    coef: torch.Tensor,
    keep: torch.Tensor | None,
    bias_correction1: torch.Tensor,
    bias_correction2: torch.Tensor,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
) -> torch.Tensor:
    """Update exp_avg / exp_avg_sq in place and overwrite `grad` with the LAMB update u
    (before the trust ratio). All flat contiguous fp32 (n,) on one device; coef, keep and the
    bias corrections are 0-dim fp32 tensors there (no host sync)."""
    for name, x in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq), ("weight", weight)):
        if x.shape != grad.shape or x.dtype != torch.float32 or not x.is_contiguous():
            raise ValueError(f"lamb_update_: {name} must be a contiguous fp32 {tuple(grad.shape)}")
    n = grad.numel()
    _lamb_update_kernel[(triton.cdiv(n, BLOCK),)](
        grad,
        exp_avg,
        exp_avg_sq,
        weight,
        coef,
        coef if keep is None else keep,
        bias_correction1,
        bias_correction2,
        n,
        1.0 - betas[0],
        1.0 - betas[1],
        eps,
        weight_decay,
        SKIPPABLE=keep is not None,
        DECAY=weight_decay != 0,
        BLOCK=BLOCK,
        num_warps=WARPS,
    )
    return grad
