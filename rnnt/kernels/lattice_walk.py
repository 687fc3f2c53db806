"""The fused loss's lattice walk in CUDA C++ (`csrc/lattice_walk.cu`), used in place of the
Triton `lattice_kernel` wherever it builds: the same arithmetic, bitwise the same alpha, beta
and log P (tests/unit/test_lattice_walk.py), faster: a walk is a chain of dependent steps, and
this kernel issues each step's contiguous diagonal-major loads as vectors four diagonals ahead
(docs/PERFORMANCE.md "The lattice walk in CUDA C++ over diagonal-major inputs").

Built by the machine's nvcc for the GPU's architecture on first use (`rnnt.kernels.cuda_build`);
where that fails (no nvcc), the Triton kernel runs, and `resolve` says why (a run prints it in
its backend line). The walk takes lattices of up to MAX_U1 label states (U_max + 1), wider ones
take the Triton kernel.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from rnnt.kernels.cuda_build import BuildError, load

SOURCE = Path(__file__).parent / "csrc" / "lattice_walk.cu"
MAX_U1 = 256
# cells the kernel may read past the last diagonal-major cell: a warp loads MAX_U1 lanes of a
# diagonal whatever its width
OVERREAD = MAX_U1


def _flags(capability: tuple[int, int]) -> tuple[str, ...]:
    arch = f"{capability[0]}{capability[1]}"
    return (
        "-O3",
        "-std=c++17",
        f"-gencode=arch=compute_{arch},code=sm_{arch}",
        "-Xcompiler",
        "-fPIC",
        "-shared",
    )


def library(capability: tuple[int, int]) -> ctypes.CDLL:
    """The walk built for GPUs of `capability` (compiled on first use; raises BuildError)."""
    lib = load(SOURCE, _flags(capability))
    if not getattr(lib, "_typed", False):
        lib.lattice_walk_launch.argtypes = (
            [ctypes.c_void_p] * 8 + [ctypes.c_int] * 6 + [ctypes.c_void_p]
        )
        lib.lattice_walk_launch.restype = ctypes.c_int
        lib.lattice_walk_error.argtypes = [ctypes.c_int]
        lib.lattice_walk_error.restype = ctypes.c_char_p
        lib._typed = True
    return lib


@functools.cache
def resolve(device: torch.device) -> tuple[str, str]:
    """("cuda" or "triton", reason): the walk the fused loss takes on `device` (building the
    CUDA one the first time)."""
    if device.type != "cuda":
        return "triton", f"the CUDA walk needs a CUDA device, not {device.type}"
    try:
        library(torch.cuda.get_device_capability(device))
    except BuildError as err:
        return "triton", f"the CUDA walk does not build here ({err})"
    return "cuda", f"built for this GPU (lattices over {MAX_U1} label states take Triton's)"


def available(device: torch.device) -> bool:
    """Whether the CUDA walk runs on `device`."""
    return resolve(device)[0] == "cuda"


def walk(
    skew_blank,
    skew_label,
    soffs,
    f_lens,
    target_lens,
    alpha,
    beta,
    log_lik,
    b0: int,
    bc: int,
    t_max: int,
    u1: int,
    packed: bool,
) -> None:
    """alpha, beta (diagonal-major, fp64) and log P (B, fp64) of utterances [b0, b0 + bc),
    queued on the current stream: the arguments of joint_loss.lattice_kernel, on one CUDA
    device, with OVERREAD readable cells past the diagonal-major inputs."""
    device = alpha.device
    lib = library(torch.cuda.get_device_capability(device))
    rc = lib.lattice_walk_launch(
        skew_blank.data_ptr(),
        skew_label.data_ptr(),
        soffs.data_ptr(),
        f_lens.data_ptr(),
        target_lens.data_ptr(),
        alpha.data_ptr(),
        beta.data_ptr(),
        log_lik.data_ptr(),
        b0,
        bc,
        t_max,
        u1,
        int(packed),
        device.index,
        torch.cuda.current_stream(device).cuda_stream,
    )
    if rc:
        raise RuntimeError(f"CUDA lattice walk: {lib.lattice_walk_error(rc).decode()}")
