"""Which implementation runs each part of a run, and why, as one line and one record.

Every automatic choice is made by a resolver beside the part it chooses for, and each returns
(choice, reason):
- data: rnnt.data.loader.resolve_backend (dali, torch or synthetic; and where the feature stage
  runs, data.device);
- encoder_lstm: rnnt.model.resolve_encoder_lstm (the wave kernels or nn.LSTM), and at
  evaluation rnnt.model.resolve_eval_encoder_lstm (eval_encoder_lstm);
- loss: rnnt.loss.TransducerLoss.prepare, and for the fused loss its logits GEMM and lattice
  walk (rnnt.kernels.logits_gemm.resolve, rnnt.kernels.lattice_walk.resolve);
- lamb: rnnt.optim.lamb.resolve_update (the Triton step or PyTorch's).
The components call the same resolvers when they run, so the line says what ran.
"""

from __future__ import annotations

import torch

from rnnt.config import Config
from rnnt.data.loader import resolve_backend
from rnnt.model import resolve_encoder_lstm, resolve_eval_encoder_lstm

Choice = tuple[str, str]  # (choice, reason)


def data_choice(cfg: Config) -> Choice:
    """The input pipeline: "torch/cpu" is the torch backend with its feature stage on the CPU."""
    backend, reason = resolve_backend(cfg.data.backend)
    if backend == "synthetic":
        return backend, reason
    reason = f"{reason}; features on data.device: {cfg.data.device}"
    if backend == "torch" and cfg.data.device == "gpu":
        # rnnt.data.features dispatches float32 batches on a GPU to them
        reason += " (resampling, silence trim and framing in Triton kernels)"
    return f"{backend}/{cfg.data.device}", reason


def eval_choices(cfg: Config, device: torch.device) -> dict[str, Choice]:
    """The automatic choices of an evaluation (no loss, no optimizer)."""
    return {
        "data": data_choice(cfg),
        "encoder_lstm": resolve_eval_encoder_lstm(cfg.eval.encoder_lstm, cfg.model, device),
    }


def training_choices(cfg: Config, device: torch.device, loss: Choice, lamb: Choice):
    """The automatic choices of training; `loss` and `lamb` as the built loss and optimizer
    report them (TransducerLoss.prepare, DistributedLamb.backend)."""
    return {
        "data": data_choice(cfg),
        "encoder_lstm": resolve_encoder_lstm(cfg.model, device, cfg.training.batch_size),
        "loss": loss,
        "lamb": lamb,
        "eval_encoder_lstm": resolve_eval_encoder_lstm(cfg.eval.encoder_lstm, cfg.model, device),
    }


def backend_line(choices: dict[str, Choice]) -> str:
    """'backends: data=torch/cpu encoder_lstm=cudnn loss=reference lamb=torch'."""
    return "backends: " + " ".join(f"{part}={choice}" for part, (choice, _) in choices.items())
