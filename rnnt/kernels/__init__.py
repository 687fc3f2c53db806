"""Triton kernels: the fused joint + loss (`loss.backend: fused`, rnnt/kernels/joint_loss.py)
and LAMB's elementwise step (rnnt/kernels/lamb.py, used by rnnt.optim.lamb.Lamb on CUDA)."""

from rnnt.kernels.joint_loss import dropout_keep_mask, fused_joint_loss

__all__ = ["dropout_keep_mask", "fused_joint_loss"]
