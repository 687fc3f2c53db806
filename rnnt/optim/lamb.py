"""LAMB over flat fp32 buffers: sync-free, GradScaler-aware, with fp32 master weights.

The algorithm is LAMB of You et al. 2019 ("Large Batch Optimization for Deep Learning",
Algorithm 2) with bias correction and decoupled weight decay, as apex's `FusedLAMB` /
`DistributedFusedLAMB` (the optimizers of NVIDIA's MLPerf RNN-T submissions) compute it:

    g      <- g / max(1, ||g||_global / max_grad_norm)      clipping by the global L2 norm
    m      <- b1 m + (1 - b1) g
    v      <- b2 v + (1 - b2) g^2
    u      <- (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps) + weight_decay * w
    r      <- ||w|| / ||u|| per parameter tensor (1 when either norm is 0)
    w      <- w - lr * r * u

Clipping follows apex: the global norm is taken over the unscaled gradients of all parameters
(all groups), before the moments, and gradients are divided by norm / max_grad_norm only when
the norm exceeds max_grad_norm (no epsilon). Weight decay applies to every parameter, biases
included: NVIDIA's MLPerf RNN-T passes `model.parameters()` as one group with
weight_decay 1e-3. apex skips the trust ratio of groups with weight_decay 0 (unless
`use_nvlamb`); here the trust ratio always applies, which is the same at weight_decay 1e-3.

Layout: per parameter group, the first and second moments and the fp32 master weights are
single flat fp32 buffers; each step gathers the gradients into one flat fp32 buffer. The
elementwise maths then costs a fixed, small number of kernels whatever the number of
parameter tensors, and per-tensor norms are two `_foreach_norm` calls.

No host synchronisation in `step()`: the learning rate may be a 0-dim device tensor, the step
count is a device tensor, and a skipped step (non-finite gradients) is applied as an update
scaled by zero on the device, leaving weights, moments and step count bit-for-bit unchanged.

AMP: with `torch.amp.GradScaler`, `scaler.step(opt)` sets `opt.grad_scale` (the loss scale,
or None when `scaler.unscale_(opt)` already ran) and `opt.found_inf` before calling `step()`
(`_step_supports_amp_scaling`); the gradients are unscaled inside the maths here.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from rnnt.kernels import triton_available


def resolve_update(device: torch.device, fused: bool | None = None) -> tuple[str, str]:
    """("triton" or "torch", reason): what runs the elementwise step on `device`. fused: True
    or False forces one; None takes the Triton kernel on CUDA where Triton is installed."""
    if fused is not None:
        return ("triton", "fused=True") if fused else ("torch", "fused=False")
    if device.type != "cuda":
        return "torch", f"the Triton kernel runs on CUDA, not on {device.type}"
    if not triton_available():
        return "torch", "Triton is not installed"
    return "triton", "CUDA with Triton installed"


def update_function(choice: str):
    """rnnt.kernels.lamb.lamb_update_ for a "triton" choice, else None (the PyTorch maths)."""
    if choice != "triton":
        return None
    from rnnt.kernels.lamb import lamb_update_  # imports Triton: only where it runs

    return lamb_update_


def unscale_and_clip(
    norm: torch.Tensor, grad_scale: torch.Tensor | None, max_grad_norm: float
) -> torch.Tensor:
    """The one factor that unscales loss-scaled gradients of global L2 norm `norm` and clips
    them to max_grad_norm (0: no clipping), as apex does: divided by norm / max_grad_norm only
    when the unscaled norm exceeds it."""
    coef = torch.ones((), dtype=torch.float32, device=norm.device)
    if grad_scale is not None:
        inv_scale = 1.0 / grad_scale.to(torch.float32)
        norm = norm * inv_scale
        coef = coef * inv_scale
    if max_grad_norm > 0:
        coef = coef * (max_grad_norm / norm.clamp(min=max_grad_norm))
    return coef


def moments_and_update(
    g: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    w: torch.Tensor,
    coef: torch.Tensor,
    skip: torch.Tensor | None,
    keep: torch.Tensor | None,
    t: torch.Tensor,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    fused_update=None,
) -> torch.Tensor:
    """The elementwise part of a LAMB step on flat fp32 buffers, in place.

    g (n,): gradients, still loss-scaled; coef unscales and clips them. The moments move
    (unless `skip`, a 0-dim bool, is set: then they stay bit for bit) and g receives the update
    u = m_hat / (sqrt(v_hat) + eps) + weight_decay * w, which is returned. t: the step count
    for the bias corrections. fused_update: rnnt.kernels.lamb.lamb_update_, the same maths in
    one Triton kernel.
    """
    b1, b2 = betas
    bc1, bc2 = 1.0 - torch.pow(b1, t), 1.0 - torch.pow(b2, t)
    if fused_update is not None:
        return fused_update(
            g, exp_avg, exp_avg_sq, w, coef, keep, bc1, bc2, (b1, b2), eps, weight_decay
        )
    g.mul_(coef)
    w1, w2 = 1.0 - b1, 1.0 - b2
    if skip is not None:
        # non-finite gradients become 0 and the moment decays become 1: m, v unchanged
        g.masked_fill_(skip, 0.0)
        w1, w2 = keep * w1, keep * w2
    exp_avg.lerp_(g, w1)
    exp_avg_sq.mul_(1.0 - w2).addcmul_(g, g, value=1.0 - b2)
    # g is free again from here: it receives the update u
    torch.div(exp_avg_sq, bc2, out=g)
    g.sqrt_().add_(eps)
    torch.div(exp_avg, g, out=g)
    g.div_(bc1)
    if weight_decay != 0:
        g.add_(w, alpha=weight_decay)
    return g


class _FlatGroup:
    """Flat fp32 state of one parameter group. n = total elements of the group."""

    def __init__(self, params: list[torch.Tensor], keep_master: bool) -> None:
        device = params[0].device
        self.shapes = [p.shape for p in params]
        self.sizes = [p.numel() for p in params]
        self.numel = sum(self.sizes)
        self.exp_avg = torch.zeros(self.numel, dtype=torch.float32, device=device)
        self.exp_avg_sq = torch.zeros(self.numel, dtype=torch.float32, device=device)
        self.grad = torch.empty(self.numel, dtype=torch.float32, device=device)
        self.master: torch.Tensor | None = None
        if keep_master:
            self.master = torch.empty(self.numel, dtype=torch.float32, device=device)
            self.gather(params, self.master)

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Per-parameter views (in their shapes) of a flat (n,) buffer."""
        return [part.view(shape) for part, shape in zip(flat.split(self.sizes), self.shapes)]

    @staticmethod
    def gather(tensors: list[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        """Concatenate tensors of any float dtype into the fp32 (n,) buffer `out` (one kernel)."""
        return torch.cat([t.detach().reshape(-1) for t in tensors], out=out)


class Lamb(torch.optim.Optimizer):
    """LAMB (see the module docstring for the exact update).

    Args:
        params: parameters or parameter-group dicts (groups may override lr, betas, eps,
            weight_decay). All on one device.
        lr: learning rate, a float or a 0-dim tensor on the parameters' device (updating a
            tensor in place changes the rate without a host sync).
        max_grad_norm: clip the global gradient norm to this value; 0 disables clipping.
        master_weights: keep fp32 master copies of the weights in the optimizer, update them and
            write the cast result back to the parameters. None: only when some parameter is not
            fp32. True with fp32 parameters keeps a (redundant) flat fp32 copy. False with
            fp16/bf16 parameters updates the low-precision weights directly (computing in fp32).
        fused: do the moments and the update in one Triton kernel (rnnt/kernels/lamb.py)
            instead of eleven PyTorch elementwise ops; same maths. None: on CUDA when Triton is
            installed.
    """

    _step_supports_amp_scaling = True

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict],
        lr: float | torch.Tensor,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-9,
        weight_decay: float = 1e-3,
        max_grad_norm: float = 1.0,
        master_weights: bool | None = None,
        fused: bool | None = None,
    ) -> None:
        if max_grad_norm < 0:
            raise ValueError(f"Lamb: max_grad_norm must be >= 0, got {max_grad_norm}")
        self.max_grad_norm = float(max_grad_norm)
        self._master_weights = master_weights
        self._flat: list[_FlatGroup] = []
        super().__init__(
            params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        )
        self._device = self._flat[0].exp_avg.device
        self.backend = resolve_update(self._device, fused)
        self._fused_update = update_function(self.backend[0])
        # optimizer steps actually applied (skipped steps do not count); drives bias correction
        self._steps = torch.zeros((), dtype=torch.float32, device=self._device)

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        where = f"Lamb: parameter group {len(self.param_groups) - 1}"
        b1, b2 = group["betas"]
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
            raise ValueError(f"{where}: betas must be in [0, 1), got {group['betas']}")
        if group["eps"] < 0 or group["weight_decay"] < 0:
            raise ValueError(f"{where}: eps and weight_decay must be >= 0")
        params = group["params"]
        if not params:
            raise ValueError(f"{where} has no parameters")
        for p in params:
            if not p.is_floating_point():
                raise ValueError(f"{where}: parameter of dtype {p.dtype} is not floating point")
        device = self._flat[0].exp_avg.device if self._flat else params[0].device
        if any(p.device != device for p in params):
            raise ValueError(f"{where}: all parameters must be on one device ({device})")
        keep_master = self._master_weights
        if keep_master is None:
            keep_master = any(p.dtype != torch.float32 for p in params)
        self._flat.append(_FlatGroup(params, keep_master))

    # ------------------------------------------------------------------------------ access
    def master_params(self) -> list[torch.Tensor]:
        """fp32 weights in parameter order (master views, or the parameters themselves when
        they are fp32 without masters); for the EMA."""
        out: list[torch.Tensor] = []
        for group, flat in zip(self.param_groups, self._flat):
            out += flat.views(flat.master) if flat.master is not None else list(group["params"])
        return out

    @property
    def steps(self) -> torch.Tensor:
        """Number of applied (not skipped) steps, a 0-dim float32 device tensor."""
        return self._steps

    # ------------------------------------------------------------------------------ stepping
    @torch.no_grad()
    def step(
        self,
        closure=None,
        *,
        grad_scale: torch.Tensor | None = None,
        found_inf: torch.Tensor | None = None,
    ):
        """One LAMB step.

        grad_scale: the loss scale the gradients carry (divided out here); found_inf: a 0-dim
        device tensor, nonzero to skip the step on the device. The trainer passes both; under
        `torch.amp.GradScaler`, which sets them as attributes before calling `step()`, they
        come from there.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if grad_scale is None:
            grad_scale = getattr(self, "grad_scale", None)
        if found_inf is None:
            found_inf = getattr(self, "found_inf", None)
        self._update(grad_scale, found_inf)
        return loss

    def _update(self, grad_scale: torch.Tensor | None, found_inf: torch.Tensor | None) -> None:
        grads = []
        for gi, (group, flat) in enumerate(zip(self.param_groups, self._flat)):
            group_grads = []
            for pi, p in enumerate(group["params"]):
                if p.grad is None:
                    raise RuntimeError(
                        f"Lamb: parameter {pi} of group {gi} (shape {tuple(p.shape)}) has no "
                        "gradient; every optimized parameter needs one at each step"
                    )
                if (
                    flat.master is None
                    and self._master_weights is None
                    and p.dtype != torch.float32
                ):
                    raise RuntimeError(
                        f"Lamb: parameter {pi} of group {gi} became {p.dtype} after the optimizer "
                        "was built without master weights (its parameters were fp32 then); pass "
                        "master_weights=True to keep fp32 masters across the cast"
                    )
                group_grads.append(p.grad)
            grads.append(flat.gather(group_grads, flat.grad))

        # Global norm of the (still loss-scaled) gradients over every group, then one scalar
        # coefficient that unscales and clips.
        norms = [torch.linalg.vector_norm(g) for g in grads]
        norm = torch.linalg.vector_norm(torch.stack(norms)) if len(norms) > 1 else norms[0]
        coef = unscale_and_clip(norm, grad_scale, self.max_grad_norm)

        skip = keep = None
        if found_inf is not None:
            skip = found_inf.to(self._device) > 0
            keep = (~skip).to(torch.float32)
            self._steps.add_(keep)
        else:
            self._steps.add_(1.0)
        # After a skipped very first step t = 0; clamping keeps 1 - b^t away from 0 (the update
        # is multiplied by zero then, but must stay finite).
        t = self._steps.clamp(min=1.0)

        for group, flat, g in zip(self.param_groups, self._flat, grads):
            params = group["params"]
            w = flat.master
            if w is None:
                w = flat.gather(params, torch.empty_like(flat.exp_avg))
            # flat.grad receives the update u
            update = moments_and_update(
                g,
                flat.exp_avg,
                flat.exp_avg_sq,
                w,
                coef,
                skip,
                keep,
                t,
                group["betas"],
                group["eps"],
                group["weight_decay"],
                self._fused_update,
            )

            w_norms = torch.stack(torch._foreach_norm(w.split(flat.sizes)))
            u_norms = torch.stack(torch._foreach_norm(update.split(flat.sizes)))
            trust = torch.where((w_norms > 0) & (u_norms > 0), w_norms / u_norms, 1.0)
            scale = trust * group["lr"]
            if keep is not None:
                scale = scale * keep
            # Per-tensor scales applied to the views: a per-element (n,) scale made with
            # repeat_interleave costs an index search and a gather over every element
            # (docs/PERFORMANCE.md, "Numbers the code's comments used to quote").
            torch._foreach_mul_(update.split(flat.sizes), list(scale.unbind()))
            w.sub_(update)
            torch._foreach_copy_(list(params), flat.views(w))

    # ------------------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """Moments, master weights, step count and hyperparameters: tensors, numbers, lists
        only (loadable with torch.load(weights_only=True))."""
        groups = []
        for group, flat in zip(self.param_groups, self._flat):
            groups.append(
                {
                    "lr": group["lr"],
                    "betas": list(group["betas"]),
                    "eps": group["eps"],
                    "weight_decay": group["weight_decay"],
                    "numel": flat.numel,
                    "exp_avg": flat.exp_avg,
                    "exp_avg_sq": flat.exp_avg_sq,
                    "master": flat.master,
                }
            )
        return {"steps": self._steps, "max_grad_norm": self.max_grad_norm, "groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """Copy a `state_dict()` into the existing buffers (their addresses stay fixed).

        Masters missing from the state (saved by a run without them) are re-taken from the
        current parameters; saved masters that this optimizer does not keep are written to the
        parameters, so no fp32 information is dropped silently."""
        for key in ("steps", "max_grad_norm", "groups"):
            if key not in state_dict:
                raise KeyError(f"Lamb.load_state_dict: missing key '{key}'")
        saved_groups = state_dict["groups"]
        if len(saved_groups) != len(self._flat):
            raise ValueError(
                f"Lamb.load_state_dict: state has {len(saved_groups)} parameter groups, "
                f"the optimizer {len(self._flat)}"
            )
        for gi, (saved, flat) in enumerate(zip(saved_groups, self._flat)):
            if saved["numel"] != flat.numel:
                raise ValueError(
                    f"Lamb.load_state_dict: group {gi} holds {saved['numel']} elements in the "
                    f"state but {flat.numel} in the optimizer (a different model?)"
                )
        with torch.no_grad():
            self._steps.copy_(state_dict["steps"])
            self.max_grad_norm = float(state_dict["max_grad_norm"])
            for saved, group, flat in zip(saved_groups, self.param_groups, self._flat):
                if isinstance(group["lr"], torch.Tensor):
                    group["lr"].copy_(saved["lr"])
                else:
                    group["lr"] = float(saved["lr"])
                group["betas"] = tuple(float(b) for b in saved["betas"])
                group["eps"] = float(saved["eps"])
                group["weight_decay"] = float(saved["weight_decay"])
                flat.exp_avg.copy_(saved["exp_avg"])
                flat.exp_avg_sq.copy_(saved["exp_avg_sq"])
                params = list(group["params"])
                if flat.master is not None and saved["master"] is not None:
                    flat.master.copy_(saved["master"])
                elif flat.master is not None:
                    flat.gather(params, flat.master)
                elif saved["master"] is not None:
                    master = saved["master"].to(self._device, torch.float32)
                    torch._foreach_copy_(params, flat.views(master))
