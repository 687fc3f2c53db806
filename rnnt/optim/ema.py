"""Exponential moving average of the weights, kept in fp32; evaluation uses it (docs/SPEC.md
"Training")."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


def _tensors(source: nn.Module | Iterable[torch.Tensor]) -> list[torch.Tensor]:
    return list(source.parameters()) if isinstance(source, nn.Module) else list(source)


class EMA:
    """fp32 EMA of a list of weights: ema <- decay * ema + (1 - decay) * w after every step.

    Built from a model or a parameter list, whose current values start the average. The update
    takes any float weights (best the optimizer's fp32 masters, `Lamb.master_params()`, so the
    average does not accumulate fp16 rounding); all maths is foreach, without host syncs.
    NVIDIA's MLPerf runs update the EMA after every optimizer step, skipped (overflow) steps
    included: the weights are unchanged then, and so is what the average moves towards.
    """

    def __init__(self, source: nn.Module | Iterable[torch.Tensor], decay: float) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"EMA: decay must be in [0, 1), got {decay}")
        self.decay = float(decay)
        with torch.no_grad():
            self.weights = [t.detach().to(torch.float32, copy=True) for t in _tensors(source)]
        if not self.weights:
            raise ValueError("EMA: no weights to average")

    def _check(self, tensors: list[torch.Tensor], what: str) -> None:
        if len(tensors) != len(self.weights):
            raise ValueError(
                f"EMA.{what}: got {len(tensors)} tensors, the EMA holds {len(self.weights)}"
            )
        for i, (t, e) in enumerate(zip(tensors, self.weights)):
            if t.shape != e.shape:
                raise ValueError(
                    f"EMA.{what}: tensor {i} has shape {tuple(t.shape)}, the EMA {tuple(e.shape)}"
                )

    @torch.no_grad()
    def update(self, source: nn.Module | Iterable[torch.Tensor]) -> None:
        """Move the average towards the current weights (a model or tensors in EMA order)."""
        tensors = _tensors(source)
        self._check(tensors, "update")
        tensors = [t.detach() if t.dtype == torch.float32 else t.detach().float() for t in tensors]
        torch._foreach_lerp_(self.weights, tensors, 1.0 - self.decay)

    @torch.no_grad()
    def copy_to(self, model: nn.Module) -> None:
        """Write the average into the model's existing parameter tensors (cast to their dtype):
        their storage stays where it is, so CUDA graphs captured on the model remain valid."""
        params = list(model.parameters())
        self._check(params, "copy_to")
        torch._foreach_copy_(params, self.weights)

    def state_dict(self) -> dict:
        return {"decay": self.decay, "weights": list(self.weights)}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Copy saved averages into the existing buffers; the decay of the saved run is kept."""
        for key in ("decay", "weights"):
            if key not in state:
                raise KeyError(f"EMA.load_state_dict: missing key '{key}'")
        self._check(state["weights"], "load_state_dict")
        self.decay = float(state["decay"])
        torch._foreach_copy_(self.weights, list(state["weights"]))
