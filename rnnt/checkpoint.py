"""Atomic, verifiable training checkpoints with keep-last-N + best-WER retention and fall-back.

A checkpoint is `ckpt_e{epoch}_s{step}.pt` (torch.save of a dict of tensors, numbers, strings,
lists and dicts: nothing that needs pickle, so it loads with `torch.load(weights_only=True)`)
plus a sidecar `ckpt_e{epoch}_s{step}.json` with its size and SHA-256. Both are written to a
temporary file in the same directory, fsynced and renamed, then the directory is fsynced; the
sidecar is written last, so a checkpoint without a sidecar, or whose size or hash disagrees
with it, was interrupted or damaged and is never loaded. `load_latest` reports such a file
loudly and falls back to the previous one; when checkpoints exist but none loads it raises
rather than let a run silently start from scratch.

A save inside the timed part of a run can go to a background thread: the call returns once the
state sits in host memory, and the file appears (atomically, as above) while training goes on.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)

_NAME = re.compile(r"^ckpt_e(\d+)_s(\d+)\.pt$")
_TMP_SUFFIX = ".tmp"


class CheckpointError(RuntimeError):
    """Checkpoints exist but none of them can be loaded."""


class _HashingWriter:
    """File wrapper that hashes and counts bytes as torch.save writes them (no second read)."""

    def __init__(self, f) -> None:
        self.f = f
        self.sha256 = hashlib.sha256()
        self.size = 0

    def write(self, data) -> int:
        self.sha256.update(data)
        self.size += len(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, write) -> Any:
    """Write via `write(file)` to a temp file beside `path`, fsync, rename over `path`."""
    tmp = path.with_name(path.name + _TMP_SUFFIX)
    try:
        with open(tmp, "wb") as f:
            result = write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(path.parent)
    return result


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


class CheckpointManager:
    """Saves and finds checkpoints in `directory` (only the main rank should save).

    Retention after each save: the `keep_last` newest complete checkpoints, plus (keep_best)
    the one with the lowest WER among those saved with a WER, which is never deleted.
    """

    def __init__(self, directory: str | Path, keep_last: int = 2, keep_best: bool = True) -> None:
        if keep_last < 1:
            raise ValueError(f"CheckpointManager: keep_last must be >= 1, got {keep_last}")
        self.directory = Path(directory)
        self.keep_last = keep_last
        self.keep_best = keep_best
        self._writer: threading.Thread | None = None
        self._error: BaseException | None = None

    # ------------------------------------------------------------------------------ listing
    def _checkpoints(self) -> list[tuple[int, int, Path]]:
        """(step, epoch, path) of every checkpoint file, newest first."""
        if not self.directory.is_dir():
            return []
        found = []
        for path in self.directory.iterdir():
            match = _NAME.match(path.name)
            if match:
                found.append((int(match.group(2)), int(match.group(1)), path))
        return sorted(found, reverse=True)

    @staticmethod
    def _sidecar(path: Path) -> Path:
        return path.with_suffix(".json")

    def _read_sidecar(self, path: Path) -> dict:
        """The sidecar of `path` after checking it against the file; ValueError says why not."""
        sidecar = self._sidecar(path)
        if not sidecar.is_file():
            raise ValueError(f"no completeness record {sidecar.name} (save interrupted?)")
        try:
            meta = json.loads(sidecar.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ValueError(f"{sidecar.name} is not valid JSON ({err})") from None
        size = path.stat().st_size
        if size != meta.get("size"):
            raise ValueError(f"size {size} bytes, but {meta.get('size')} were written (truncated?)")
        if _sha256_file(path) != meta.get("sha256"):
            raise ValueError("SHA-256 differs from the one recorded at save (corrupted)")
        return meta

    # ------------------------------------------------------------------------------ saving
    def save(
        self, state: dict, epoch: int, step: int, wer: float | None, background: bool = False
    ) -> Path:
        """Write `state` atomically, record its completeness, apply retention; returns the path.

        The state is first copied to host memory, so training may change its tensors as soon
        as this returns. background=True then writes the file on a thread (one write at a
        time: a new save waits for the previous one); `wait()` joins it and re-raises its error.
        """
        self.wait()
        host_state = _to_host(state)
        path = self.directory / f"ckpt_e{epoch}_s{step}.pt"
        if not background:
            self._write(host_state, path, epoch, step, wer)
            return path

        def write() -> None:
            try:
                self._write(host_state, path, epoch, step, wer)
            except BaseException as err:  # handed to the training thread by wait()
                self._error = err

        # not a daemon: an exiting interpreter finishes the write rather than drop it
        self._writer = threading.Thread(target=write, name="checkpoint-writer")
        self._writer.start()
        return path

    def wait(self) -> None:
        """Block until a background save has finished; raise what it failed with, if anything."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        if self._error is not None:
            err, self._error = self._error, None
            raise CheckpointError(
                f"writing a checkpoint in {self.directory} failed: {err}"
            ) from err

    def _write(self, state: dict, path: Path, epoch: int, step: int, wer: float | None) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        sidecar = self._sidecar(path)
        sidecar.unlink(missing_ok=True)  # an older record must never vouch for the new file

        def write_state(f) -> _HashingWriter:
            writer = _HashingWriter(f)
            torch.save(state, writer)
            return writer

        writer = _write_atomic(path, write_state)
        meta = {
            "file": path.name,
            "size": writer.size,
            "sha256": writer.sha256.hexdigest(),
            "epoch": epoch,
            "step": step,
            "wer": wer,
            "saved_at": time.time(),
        }
        _write_atomic(sidecar, lambda f: f.write(json.dumps(meta, indent=1).encode()))
        self._retain()

    def _retain(self) -> None:
        complete, incomplete = [], []
        for _, _, path in self._checkpoints():
            sidecar = self._sidecar(path)
            meta = None
            if sidecar.is_file():
                try:
                    meta = json.loads(sidecar.read_text())
                except (json.JSONDecodeError, UnicodeDecodeError):
                    meta = None
            (complete if meta is not None else incomplete).append((path, meta))
        keep = {path for path, _ in complete[: self.keep_last]}
        with_wer = [(meta["wer"], path) for path, meta in complete if meta.get("wer") is not None]
        if self.keep_best and with_wer:
            keep.add(min(with_wer)[1])
        for path, _ in complete + incomplete:
            if path not in keep:
                # the record goes first: a half-deleted checkpoint reads as incomplete
                self._sidecar(path).unlink(missing_ok=True)
                path.unlink(missing_ok=True)
        for tmp in self.directory.glob(f"*{_TMP_SUFFIX}"):
            tmp.unlink(missing_ok=True)

    # ------------------------------------------------------------------------------ loading
    def best(self) -> tuple[Path, float] | None:
        """The complete checkpoint with the lowest recorded WER, if any."""
        best = None
        for _, _, path in self._checkpoints():
            try:
                meta = json.loads(self._sidecar(path).read_text())
            except (OSError, json.JSONDecodeError, UnicodeDecodeError):
                continue
            if meta.get("wer") is not None and (best is None or meta["wer"] < best[1]):
                best = (path, float(meta["wer"]))
        return best

    def load_latest(self, map_location=None) -> tuple[dict, Path] | None:
        """The newest checkpoint that is complete and loads, as (state, path); None when the
        directory holds no checkpoint. Damaged newer ones are logged as errors and skipped."""
        candidates = self._checkpoints()
        if not candidates:
            return None
        problems = []
        for _, _, path in candidates:
            try:
                self._read_sidecar(path)
                state = torch.load(path, map_location=map_location, weights_only=True)
            except Exception as err:  # any unreadable file must fall back, with its reason
                reason = f"{type(err).__name__}: {err}".splitlines()[0]
                log.error("checkpoint %s cannot be used: %s; trying an older one", path, reason)
                problems.append(f"{path}: {reason}")
                continue
            if problems:
                log.error("resuming from the older checkpoint %s", path)
            return state, path
        raise CheckpointError(
            f"{len(candidates)} checkpoint(s) in {self.directory} but none can be loaded "
            "(refusing to start from scratch):\n  " + "\n  ".join(problems)
        )


def _to_host(state: Any) -> Any:
    """A copy of a state tree whose tensors live in host memory and share nothing with the
    originals. GPU tensors go to pinned memory in asynchronous copies and one wait at the end:
    for the full model (0.9 GB) that holds training for a fraction of what copies into pageable
    memory take (docs/PERFORMANCE.md), and the pinned blocks are reused by the next save."""
    devices: set[torch.device] = set()

    def copy(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            obj = obj.detach()
            if obj.device.type == "cpu":
                return obj.clone()
            if obj.device.type != "cuda":
                return obj.to("cpu")
            devices.add(obj.device)
            host = torch.empty(obj.shape, dtype=obj.dtype, pin_memory=True)
            return host.copy_(obj, non_blocking=True)
        if isinstance(obj, dict):
            return {k: copy(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(copy(v) for v in obj)
        return obj

    host_state = copy(state)
    for device in devices:
        torch.cuda.synchronize(device)
    return host_state


# ---------------------------------------------------------------------------------- RNG state
def capture_rng_state() -> dict:
    """Torch CPU, every CUDA device, numpy and python `random` generator states, as tensors,
    numbers and lists only (so checkpoints load with weights_only=True)."""
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    py_version, py_internal, py_gauss_next = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": {
            "name": np_name,
            "keys": torch.from_numpy(np_keys.astype(np.int64)),
            "pos": int(np_pos),
            "has_gauss": int(np_has_gauss),
            "cached_gaussian": float(np_gauss),
        },
        "python": [py_version, list(py_internal), py_gauss_next],
    }


def restore_rng_state(state: dict) -> None:
    """Inverse of `capture_rng_state` (tensors may come back on any device)."""
    torch.set_rng_state(state["torch"].cpu())
    if state["cuda"] and torch.cuda.is_available():
        count = min(len(state["cuda"]), torch.cuda.device_count())
        for device in range(count):
            torch.cuda.set_rng_state(state["cuda"][device].cpu(), device)
    npst = state["numpy"]
    np.random.set_state(
        (
            npst["name"],
            npst["keys"].cpu().numpy().astype(np.uint32),
            npst["pos"],
            npst["has_gauss"],
            npst["cached_gaussian"],
        )
    )
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
