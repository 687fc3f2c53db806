"""Triton kernels: the fused joint + loss (`loss.backend: fused`, rnnt/kernels/joint_loss.py)
and LAMB's elementwise step (rnnt/kernels/lamb.py, used by rnnt.optim.lamb.Lamb on CUDA); and
the fused loss's CUDA C++ kernels (csrc/, built by cuda_build.py): the Hopper logits GEMM
(logits_gemm.py) and the lattice walk (lattice_walk.py)."""

from rnnt.kernels.joint_loss import dropout_keep_mask, fused_joint_loss

__all__ = ["dropout_keep_mask", "fused_joint_loss"]
