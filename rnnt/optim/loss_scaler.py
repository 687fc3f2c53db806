"""Dynamic fp16 loss scaling driven by one found-inf flag that the trainer computes.

`torch.amp.GradScaler` decides by itself whether a step overflowed: it scans every `.grad` it
can see. The trainer also needs that decision (to count skipped steps, and, with a sharded
optimizer, each rank sees only its shard), so two scans could disagree. Here the caller computes
found-inf once (over the loss and the gradients, agreed across ranks) and hands the same tensor
to the optimizer and to `update`. The scale follows GradScaler's rule through the same op
(`torch._amp_update_scale_`): halve on overflow and reset the growth count, double after
`growth_interval` finite steps in a row. Everything stays on the device: no host sync.
"""

from __future__ import annotations

import torch


class DynamicLossScaler:
    """The loss scale and growth tracker of GradScaler, as 0-dim device tensors.

    enabled=False (fp32, bf16) keeps a scale of 1 that never changes; `scale_loss` is then the
    identity and `grad_scale` is None, so the optimizer skips the unscaling.
    """

    def __init__(
        self,
        device: torch.device | str,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
    ) -> None:
        if init_scale <= 0 or growth_factor <= 1.0 or not 0.0 < backoff_factor < 1.0:
            raise ValueError(
                "DynamicLossScaler: need init_scale > 0, growth_factor > 1, 0 < backoff < 1; got "
                f"{init_scale}, {growth_factor}, {backoff_factor}"
            )
        if growth_interval < 1:
            raise ValueError(f"DynamicLossScaler: growth_interval {growth_interval} must be >= 1")
        self.enabled = enabled
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        device = torch.device(device)
        self._scale = torch.full((), init_scale if enabled else 1.0, device=device)
        self._growth_tracker = torch.zeros((), dtype=torch.int32, device=device)

    @property
    def scale(self) -> torch.Tensor:
        """The current scale, a 0-dim float32 device tensor (read it without a sync)."""
        return self._scale

    @property
    def grad_scale(self) -> torch.Tensor | None:
        """What the gradients are multiplied by, for the optimizer to divide out; None when off."""
        return self._scale if self.enabled else None

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self._scale.to(loss.dtype) if self.enabled else loss

    def update(self, found_inf: torch.Tensor) -> None:
        """Back off after an overflow step, grow after growth_interval clean ones.

        found_inf: 0-dim float32 on the scale's device, nonzero when the step was skipped.
        """
        if not self.enabled:
            return
        torch._amp_update_scale_(
            self._scale,
            self._growth_tracker,
            found_inf,
            self.growth_factor,
            self.backoff_factor,
            self.growth_interval,
        )

    def get_scale(self) -> float:
        """The scale as a number: a host sync, for log points only."""
        return float(self._scale)

    def state_dict(self) -> dict:
        """GradScaler's keys and meaning, so either kind of checkpoint loads in the other."""
        return {
            "scale": self.get_scale(),
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "_growth_tracker": int(self._growth_tracker),
        }

    def load_state_dict(self, state: dict) -> None:
        if not self.enabled:
            return
        for key in ("scale", "_growth_tracker"):
            if key not in state:
                raise KeyError(f"DynamicLossScaler.load_state_dict: missing key '{key}'")
        self._scale.fill_(float(state["scale"]))
        self._growth_tracker.fill_(int(state["_growth_tracker"]))
        self.growth_factor = float(state.get("growth_factor", self.growth_factor))
        self.backoff_factor = float(state.get("backoff_factor", self.backoff_factor))
        self.growth_interval = int(state.get("growth_interval", self.growth_interval))
