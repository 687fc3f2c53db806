"""Triton kernels; reached through `loss.backend: fused` (see rnnt/kernels/joint_loss.py)."""

from rnnt.kernels.joint_loss import dropout_keep_mask, fused_joint_loss

__all__ = ["dropout_keep_mask", "fused_joint_loss"]
