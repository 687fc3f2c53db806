"""Hand-written kernels, one module each, imported where they are used (importing this package
loads nothing: Triton takes seconds to import and CPU runs never need it).

- joint_loss: the fused joint + RNN-T loss (`loss.backend: fused`): its host schedule and
  autograd over the Triton kernels of joint_loss_kernels and two CUDA C++ kernels, logits_gemm
  (the Hopper logits GEMM) and lattice_walk (the lattice walk);
- lstm_wave: the encoder's LSTM stacks as waves of Hopper kernels (`model.encoder_lstm: wave`);
- lamb: LAMB's elementwise step in one Triton kernel;
- cuda_build: compiles and caches the CUDA C++ sources of csrc/ with the machine's nvcc.
"""

import importlib.util


def triton_available() -> bool:
    """Whether Triton is installed, found without importing it."""
    return importlib.util.find_spec("triton") is not None
