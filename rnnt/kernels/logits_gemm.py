"""The fused loss's logits GEMM with softmax partials in its epilogue, on Hopper GPUs.

`csrc/logits_lse_sm90.cu` (CUDA C++, wgmma + TMA, built by `rnnt.kernels.cuda_build`) writes
the fp16 logits h W^T of a chunk, as cuBLAS does (bitwise the same values), and per row and
128-class tile the base-2 (max, sum exp2) of the biased, dropout-scaled logits; the joint loss's
`stats_from_partials_kernel` then needs only those and two gathers instead of a second pass
over the logits, and the softmax epilogue runs while the other warp group's MMAs do
(docs/PERFORMANCE.md "The sm90 logits GEMM: the log-sum-exp in an overlapped epilogue").

`gemm` choices: 'cublas' (cuBLAS + the stats kernel: the reference this path is tested
against), 'sm90' (this kernel, or an error saying why it cannot run), 'auto' (this kernel where
it can run, else cuBLAS).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from rnnt.kernels.cuda_build import SM90A_FLAGS, BuildError, hopper_missing, load

GEMMS = ("auto", "cublas", "sm90")
SOURCE = Path(__file__).parent / "csrc" / "logits_lse_sm90.cu"
TILE_N = 128  # classes per partial: one (max, sum) per row and tile
TILE_K = 64
MAX_K = 512  # W's 128-class block (128 x K fp16) stays in shared memory


def library() -> ctypes.CDLL:
    """The built kernel library (compiled on first use; raises BuildError)."""
    lib = load(SOURCE, SM90A_FLAGS)
    if not getattr(lib, "_typed", False):
        lib.logits_lse_launch.argtypes = (
            [ctypes.c_void_p] * 5 + [ctypes.c_float] + [ctypes.c_int] * 5 + [ctypes.c_void_p]
        )
        lib.logits_lse_launch.restype = ctypes.c_int
        lib.logits_lse_error.argtypes = [ctypes.c_int]
        lib.logits_lse_error.restype = ctypes.c_char_p
        lib._typed = True
    return lib


def unsupported(device: torch.device, dtype: torch.dtype, hidden: int, vocab: int) -> str | None:
    """Why the kernel cannot compute h (rows x hidden) W^T (W: vocab x hidden) here, or None."""
    missing = hopper_missing(device)
    if missing is not None:
        return f"it needs {missing}"
    if dtype != torch.float16:
        return f"it takes fp16 operands, not {dtype}"
    if vocab % TILE_N or hidden % TILE_K or hidden > MAX_K:
        return (
            f"it needs a vocabulary that is a multiple of {TILE_N} (got {vocab}) and a joint "
            f"width that is a multiple of {TILE_K} and at most {MAX_K} (got {hidden})"
        )
    return None


@functools.cache
def resolve(
    gemm: str, device: torch.device, dtype: torch.dtype, hidden: int, vocab: int
) -> tuple[str, str]:
    """("sm90" or "cublas", reason): the GEMM the fused loss takes for these operands under
    `gemm` (see the module docstring); builds the library the first time it picks this kernel.
    Raises RuntimeError where `gemm` is 'sm90' and the kernel cannot run."""
    if gemm not in GEMMS:
        raise ValueError(f"logits GEMM must be one of {GEMMS}, got {gemm!r}")
    if gemm == "cublas":
        return "cublas", "loss.fused_gemm: cublas"
    reason = unsupported(device, dtype, hidden, vocab)
    if reason is None:
        try:
            library()
        except BuildError as err:
            reason = str(err)
    if reason is None:
        return "sm90", f"loss.fused_gemm: {gemm}, on a Hopper GPU with fp16 operands"
    if gemm == "sm90":
        raise RuntimeError(f"fused loss: the sm90 logits GEMM cannot run: {reason}")
    return "cublas", f"auto: the sm90 GEMM cannot run here ({reason})"


def use_sm90(gemm: str, device: torch.device, dtype: torch.dtype, hidden: int, vocab: int) -> bool:
    """Whether the fused loss takes this kernel for these operands under `gemm`."""
    return resolve(gemm, device, dtype, hidden, vocab)[0] == "sm90"


def logits_with_partials(
    h: torch.Tensor,
    weight: torch.Tensor,
    bias32: torch.Tensor,
    scale2: float,
    logits: torch.Tensor,
    partials: torch.Tensor,
) -> None:
    """logits (n, V) fp16 = h (n, H) W^T (W: V x H), and partials (n, V / 128, 2) fp32: per
    row and class tile the max and the sum of exp2(x - max) of x = logits * scale2 + bias32 *
    log2(e). Queued on the current stream; all operands contiguous on one device."""
    n, hid = h.shape
    vocab = weight.shape[0]
    for name, x in (("h", h), ("weight", weight), ("logits", logits), ("partials", partials)):
        if not x.is_contiguous() or x.data_ptr() % 16:
            raise ValueError(f"sm90 logits GEMM: {name} must be contiguous and 16-byte aligned")
    if logits.shape != (n, vocab) or partials.shape != (n, vocab // TILE_N, 2):
        raise ValueError(
            f"sm90 logits GEMM: logits {tuple(logits.shape)} / partials "
            f"{tuple(partials.shape)} do not fit h {tuple(h.shape)} and W {tuple(weight.shape)}"
        )
    device = h.device
    n_tiles = vocab // TILE_N
    grid = _grid(device, n_tiles)
    lib = library()
    rc = lib.logits_lse_launch(
        h.data_ptr(),
        weight.data_ptr(),
        logits.data_ptr(),
        partials.data_ptr(),
        bias32.data_ptr(),
        scale2,
        n,
        vocab,
        hid,
        grid,
        device.index,
        torch.cuda.current_stream(device).cuda_stream,
    )
    if rc:
        raise RuntimeError(f"sm90 logits GEMM: {lib.logits_lse_error(rc).decode()}")


@functools.cache
def _grid(device: torch.device, n_tiles: int) -> int:
    # every CTA keeps one class block, so the persistent grid is whole rounds of the N blocks
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, sms // n_tiles) * n_tiles
