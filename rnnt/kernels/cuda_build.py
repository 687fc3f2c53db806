"""CUDA C++ sources of this package, compiled once with the machine's nvcc into a cache and
loaded with ctypes.

Why not a torch C++ extension: the kernels here talk to PyTorch only through raw pointers and a
stream handle, so a plain shared library (CUDA runtime linked statically, nvcc's default) builds
in about 2 s without the torch headers, ninja or a host compiler matching torch's ABI.

The cache key is the source text (with the text of every header it includes by a quoted
relative name, recursively), the flags and nvcc's version, so an edited source or header or
another toolkit builds a new library; each build goes to a temporary file renamed into place,
so ranks building at once, or a build that dies half-way, never leave a broken library behind.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

CACHE_ENV = "RNNT_KERNEL_CACHE"  # where built libraries go (default ~/.cache/rnnt-mlperf)
BUILD_TIMEOUT_S = 300
# a shared library of Hopper kernels (wgmma and TMA need the architecture-specific sm_90a)
SM90A_FLAGS = (
    "-O3",
    "-std=c++17",
    "-gencode=arch=compute_90a,code=sm_90a",
    "-Xcompiler",
    "-fPIC",
    "-shared",
)


class BuildError(RuntimeError):
    """A CUDA source could not be compiled or loaded here; the message says why."""


def hopper_missing(device) -> str | None:
    """What a torch `device` lacks to run sm_90a code, as the object of "needs" (None if
    nothing): the kernels' `unsupported` checks all start here."""
    if device.type != "cuda":
        return f"a CUDA device, not {device}"
    import torch  # the build helpers themselves need no torch

    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) != (9, 0):
        name = torch.cuda.get_device_name(device)
        return f"a Hopper GPU (compute capability 9.0); {name} is {major}.{minor}"
    return None


def find_nvcc() -> Path | None:
    """nvcc of $CUDA_HOME, else the one on PATH, else /usr/local/cuda's."""
    candidates = []
    if os.environ.get("CUDA_HOME"):
        candidates.append(Path(os.environ["CUDA_HOME"]) / "bin" / "nvcc")
    on_path = shutil.which("nvcc")
    if on_path:
        candidates.append(Path(on_path))
    candidates.append(Path("/usr/local/cuda/bin/nvcc"))
    return next((c for c in candidates if c.is_file() and os.access(c, os.X_OK)), None)


_LOCAL_INCLUDE = re.compile(rb'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', re.MULTILINE)


def source_closure(source: Path) -> list[Path]:
    """`source` and the headers it includes by quoted names found beside the including file,
    recursively, each once, in the order first met."""
    seen: list[Path] = []
    todo = [source.resolve()]
    while todo:
        path = todo.pop(0)
        if path in seen:
            continue
        seen.append(path)
        for name in _LOCAL_INCLUDE.findall(path.read_bytes()):
            header = path.parent / name.decode()
            if header.is_file():
                todo.append(header.resolve())
    return seen


def cache_dir() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "rnnt-mlperf"


def build(source: Path, flags: Sequence[str]) -> Path:
    """The shared library of `source` compiled with `flags`: from the cache, or built now."""
    nvcc = find_nvcc()
    if nvcc is None:
        raise BuildError(
            f"building {source.name} needs nvcc (CUDA 12 or newer; tested with 13.0): set "
            "CUDA_HOME or put nvcc on PATH"
        )
    try:
        version = subprocess.run(
            [str(nvcc), "--version"], capture_output=True, text=True, check=True, timeout=60
        ).stdout
    except (OSError, subprocess.SubprocessError) as err:
        raise BuildError(f"{nvcc} --version failed: {err}") from None
    texts = [path.read_bytes() for path in source_closure(source)]
    key = hashlib.sha256(b"\0".join([*texts, " ".join(flags).encode(), version.encode()]))
    out_dir = cache_dir()
    lib = out_dir / f"{source.stem}-{key.hexdigest()[:16]}.so"
    if lib.is_file():
        return lib
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=f".{lib.stem}-", suffix=".so")
        os.close(fd)
    except OSError as err:
        raise BuildError(
            f"cannot write the kernel cache {out_dir} ({err}); set {CACHE_ENV} to a writable "
            "directory"
        ) from None
    cmd = [str(nvcc), *flags, "-o", tmp, str(source)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError) as err:
        os.unlink(tmp)
        raise BuildError(f"{' '.join(cmd)} failed to run: {err}") from None
    if done.returncode != 0:
        os.unlink(tmp)
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-20:])
        raise BuildError(f"{' '.join(cmd)} exited with {done.returncode}:\n{tail}")
    os.replace(tmp, lib)
    return lib


@functools.cache
def load(source: Path, flags: tuple[str, ...]) -> ctypes.CDLL:
    """`build` and dlopen, once per process."""
    lib = build(source, flags)
    try:
        return ctypes.CDLL(str(lib))
    except OSError as err:
        raise BuildError(f"cannot load {lib} (built from {source.name}): {err}") from None
