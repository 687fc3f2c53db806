"""The MLPerf RNN-T learning-rate policy (docs/SPEC.md "Training"), as a pure function of step
and epoch."""

from __future__ import annotations

from rnnt.config import OptimizerConfig


def lr_at(step: int, epoch: int, steps_per_epoch: int, cfg: OptimizerConfig) -> float:
    """Learning rate of one optimizer step: linear warmup, hold, then exponential decay per epoch.

    `step` and `epoch` are 1-based, the convention of the MLPerf reference and of NVIDIA's
    submissions that the GBS presets were tuned with: the first step of a run is step 1 of
    epoch 1, and the step counter runs on across epochs (epoch e holds steps
    (e - 1) * steps_per_epoch + 1 ... e * steps_per_epoch). With W = warmup_epochs *
    steps_per_epoch and H = hold_epochs * steps_per_epoch:

        step < W:      a = (step + 1) / (W + 1)
        step < W + H:  a = 1
        otherwise:     a = lr_decay_gamma ** (epoch - warmup_epochs - hold_epochs)
        lr = max(a * lr, min_lr)

    So warmup reaches the full rate at the last step of epoch `warmup_epochs`, and the first
    decayed epoch is warmup_epochs + hold_epochs + 1 (at gamma ** 1).
    """
    if step < 1 or epoch < 1:
        raise ValueError(f"lr_at: step and epoch are 1-based, got step={step}, epoch={epoch}")
    if steps_per_epoch < 1:
        raise ValueError(f"lr_at: steps_per_epoch must be >= 1, got {steps_per_epoch}")
    warmup_steps = cfg.warmup_epochs * steps_per_epoch
    hold_steps = cfg.hold_epochs * steps_per_epoch
    if step < warmup_steps:
        a = (step + 1) / (warmup_steps + 1)
    elif step < warmup_steps + hold_steps:
        a = 1.0
    else:
        a = cfg.lr_decay_gamma ** (epoch - cfg.warmup_epochs - cfg.hold_epochs)
    return max(a * cfg.lr, cfg.min_lr)
