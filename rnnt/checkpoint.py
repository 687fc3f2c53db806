"""Atomic, verifiable, sharded training checkpoints with retention and fall-back.

A checkpoint is a directory `ckpt_e{epochs}_s{steps}/` (the epochs and optimizer steps completed
when it was taken) in which every rank writes its own files in parallel: rank 0 `model.pt` (the
model, the EMA, the run's progress and config), and each rank `rank{r}.pt` (its optimizer shard
and its random-number generators). Each file is a torch.save
of tensors, numbers, strings, lists and dicts (nothing that needs pickle: it loads with
`torch.load(weights_only=True)`), written to a temporary name, fsynced and renamed; then a
sidecar `NAME.json` records its size and SHA-256. Rank 0 writes `complete.json` last, once every
rank's sidecar of this save is there, listing every file with its size and hash. Only a
directory with `complete.json` is a checkpoint; loading checks each file it reads against it,
and when the newest checkpoint cannot be used on some rank, every rank falls back to the same
older one (loudly); when none can be used, loading raises rather than let a run start afresh.
A file whose floating-point tensors hold a NaN or inf counts as damaged too.

A save inside the timed part of a run can go to a background thread: the call returns once the
state sits in host memory, and the files appear while training goes on. The ranks need no
collective for it: rank 0's writer waits for the other ranks' sidecars on the file system.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rnnt.errors import UserError

log = logging.getLogger(__name__)

_NAME = re.compile(r"^ckpt_e(\d+)_s(\d+)$")
_TMP_SUFFIX = ".tmp"
COMPLETE = "complete.json"


class CheckpointError(UserError, RuntimeError):
    """Checkpoints exist but none of them can be loaded, or one could not be written."""


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


def _write_json(path: Path, record: dict) -> None:
    _write_atomic(path, lambda f: f.write(json.dumps(record, indent=1).encode()))


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _read_json(path: Path) -> dict | None:
    try:
        record = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    return record if isinstance(record, dict) else None


class Checkpoint:
    """One complete checkpoint directory; `load(name)` verifies a file before reading it."""

    def __init__(self, path: Path, record: dict) -> None:
        self.path = path
        self.record = record
        self.meta: dict = record.get("meta", {})

    @property
    def files(self) -> list[str]:
        return sorted(self.record["files"])

    def verify(self, name: str) -> None:
        """Raise CheckpointError when `name`'s file is missing, truncated or altered."""
        entry = self.record["files"].get(name)
        if entry is None:
            raise CheckpointError(f"{self.path.name} has no file '{name}'")
        path = self.path / f"{name}.pt"
        if not path.is_file():
            raise CheckpointError(f"{path} is missing")
        size = path.stat().st_size
        if size != entry["size"]:
            raise CheckpointError(f"{path}: size {size} bytes, but {entry['size']} were written")
        if _sha256_file(path) != entry["sha256"]:
            raise CheckpointError(
                f"{path}: SHA-256 differs from the one recorded at save (corrupted)"
            )

    def load(self, name: str, map_location=None, verified: bool = False) -> dict:
        if not verified:
            self.verify(name)
        path = self.path / f"{name}.pt"
        try:
            state = torch.load(path, map_location=map_location, weights_only=True)
        except Exception as err:  # a damaged archive or pickle raises many types
            reason = f"{type(err).__name__}: {err}".splitlines()[0]
            raise CheckpointError(f"{path}: cannot be read ({reason})") from None
        # a file can match its record and still hold NaN weights (bytes flipped before the
        # hash was taken): training or scoring from them would only produce NaN
        where = _non_finite(state)
        if where is not None:
            raise CheckpointError(f"{path}: {where} holds NaN or inf values (not a sound state)")
        return state


def open_checkpoint(path: str | Path) -> Checkpoint:
    """A checkpoint directory (or a file inside it) written by CheckpointManager."""
    path = Path(path)
    directory = path if path.is_dir() else path.parent
    record = _read_json(directory / COMPLETE)
    if record is None or "files" not in record:
        raise CheckpointError(f"{directory} is not a complete checkpoint (no {COMPLETE})")
    return Checkpoint(directory, record)


def checkpoint_dirs(directory: str | Path) -> list[Path]:
    """Every checkpoint directory in `directory` (complete or not), newest first."""
    return [path for _, _, path in _directories(Path(directory))]


def _directories(directory: Path) -> list[tuple[int, int, Path]]:
    """(step, epoch, path) of every checkpoint directory, newest first."""
    try:
        entries = list(directory.iterdir())
    except (FileNotFoundError, NotADirectoryError):  # none yet, or deleted under our feet
        return []
    found = []
    for path in entries:
        match = _NAME.match(path.name)
        if match and path.is_dir():
            found.append((int(match.group(2)), int(match.group(1)), path))
    return sorted(found, reverse=True)


class CheckpointManager:
    """Saves and finds checkpoints in `directory`; every rank makes one and calls `save` at the
    same points of the run.

    Retention (rank 0, after each complete save): the `keep_last` newest checkpoints, plus
    (keep_best) the one with the lowest WER among those saved with a WER, which is never
    deleted; unfinished directories older than the newest complete one go too. With a
    `run_id`, every save records it and retention counts and deletes only that run's
    checkpoints: another run's are never touched.
    """

    def __init__(
        self,
        directory: str | Path,
        keep_last: int = 2,
        keep_best: bool = True,
        rank: int = 0,
        world_size: int = 1,
        commit_timeout_s: float = 600.0,
        run_id: str | None = None,
    ) -> None:
        if keep_last < 1:
            raise ValueError(f"CheckpointManager: keep_last must be >= 1, got {keep_last}")
        self.directory = Path(directory)
        self.keep_last = keep_last
        self.keep_best = keep_best
        self.rank = rank
        self.world_size = world_size
        self.commit_timeout_s = commit_timeout_s
        self.run_id = run_id
        self._saves = 0
        self._writer: threading.Thread | None = None
        self._error: BaseException | None = None

    # ------------------------------------------------------------------------------ listing
    def complete(self) -> list[Checkpoint]:
        """Every complete checkpoint, newest first."""
        out = []
        for _, _, path in _directories(self.directory):
            record = _read_json(path / COMPLETE)
            if record is not None and "files" in record:
                out.append(Checkpoint(path, record))
        return out

    def best(self) -> tuple[Path, float] | None:
        """The complete checkpoint with the lowest recorded WER, if any."""
        with_wer = [
            (c.meta["wer"], c.path) for c in self.complete() if c.meta.get("wer") is not None
        ]
        if not with_wer:
            return None
        wer, path = min(with_wer)
        return path, float(wer)

    # ------------------------------------------------------------------------------ saving
    def save(
        self,
        files: dict[str, dict],
        epoch: int,
        step: int,
        meta: dict | None = None,
        background: bool = False,
    ) -> Path:
        """Write this rank's `files` (name -> state) into the checkpoint of (epoch, step): the
        epochs and steps completed, which name it (`ckpt_e{epoch}_s{step}`).

        Rank 0 also commits the checkpoint once every rank's files are written. The states are
        first copied to host memory, so training may change its tensors as soon as this
        returns; background=True then writes on a thread (one save at a time: a new save waits
        for the previous one), and `wait()` joins it and raises what it failed with.
        """
        self.wait()
        self._saves += 1
        token = f"{self.run_id}:{epoch}:{step}:{self._saves}"
        host_files = _to_host(files)
        path = self.directory / f"ckpt_e{epoch}_s{step}"
        record = {"epoch": epoch, "step": step, **(meta or {})}
        if self.run_id is not None:
            record["run_id"] = self.run_id

        def write() -> None:
            self._write(host_files, path, token, record)

        if not background:
            write()
            return path

        def write_in_background() -> None:
            try:
                write()
            except BaseException as err:  # handed to the training thread by wait()
                self._error = err

        # not a daemon: an exiting interpreter finishes the write rather than drop it
        self._writer = threading.Thread(target=write_in_background, name="checkpoint-writer")
        self._writer.start()
        return path

    def wait(self) -> None:
        """Block until a background save has finished; raise what it failed with, if anything."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        if self._error is not None:
            err, self._error = self._error, None
            raise CheckpointError(f"writing a checkpoint in {self.directory}: {err}") from err

    def _write(self, files: dict[str, dict], path: Path, token: str, record: dict) -> None:
        path.mkdir(parents=True, exist_ok=True)
        if self.rank == 0:
            (path / COMPLETE).unlink(missing_ok=True)  # an older record must never vouch
        for name, state in files.items():
            sidecar = path / f"{name}.json"
            sidecar.unlink(missing_ok=True)

            def write_state(f, state=state) -> _HashingWriter:
                writer = _HashingWriter(f)
                torch.save(state, writer)
                return writer

            writer = _write_atomic(path / f"{name}.pt", write_state)
            _write_json(
                sidecar, {"size": writer.size, "sha256": writer.sha256.hexdigest(), "token": token}
            )
        if self.rank == 0:
            self._commit(path, token, record)
            self._retain()

    def _commit(self, path: Path, token: str, record: dict) -> None:
        """Wait for every rank's sidecars of this save, then write the completeness record."""
        deadline = time.monotonic() + self.commit_timeout_s
        while True:
            entries = {}
            for sidecar in path.glob("*.json"):
                if sidecar.name == COMPLETE:
                    continue
                entry = _read_json(sidecar)
                if entry is not None and entry.get("token") == token:
                    entries[sidecar.stem] = {"size": entry["size"], "sha256": entry["sha256"]}
            ranks = {f"rank{r}" for r in range(self.world_size)}
            if ranks <= set(entries):
                break
            if time.monotonic() > deadline:
                missing = sorted(ranks - set(entries))
                raise CheckpointError(
                    f"{path}: {', '.join(missing)} not written within "
                    f"{self.commit_timeout_s:.0f} s; the checkpoint stays incomplete"
                )
            time.sleep(0.05)
        _write_json(
            path / COMPLETE,
            {
                "files": entries,
                "world_size": self.world_size,
                "saved_at": time.time(),
                "meta": record,
            },
        )

    def _of_this_run(self, path: Path) -> bool:
        """Whether the checkpoint directory `path` was written by this manager's run: its
        record says so, or, unfinished, one of its sidecars does."""
        if self.run_id is None:
            return True
        record = _read_json(path / COMPLETE)
        if record is not None:
            return record.get("meta", {}).get("run_id") == self.run_id
        tokens = (_read_json(sidecar) or {} for sidecar in path.glob("*.json"))
        return any(str(entry.get("token", "")).startswith(f"{self.run_id}:") for entry in tokens)

    def _retain(self) -> None:
        complete = [c for c in self.complete() if self._of_this_run(c.path)]
        keep = {c.path for c in complete[: self.keep_last]}
        with_wer = [(c.meta["wer"], c.path) for c in complete if c.meta.get("wer") is not None]
        if self.keep_best and with_wer:
            keep.add(min(with_wer)[1])
        newest_step = int(_NAME.match(complete[0].path.name).group(2)) if complete else None
        for step, _, path in _directories(self.directory):
            if path in keep or not self._of_this_run(path):
                continue
            if not (path / COMPLETE).is_file() and (newest_step is None or step >= newest_step):
                continue  # a save still being written (or newer than every complete one)
            # the record goes first: a half-deleted checkpoint reads as incomplete
            (path / COMPLETE).unlink(missing_ok=True)
            shutil.rmtree(path, ignore_errors=True)

    # ------------------------------------------------------------------------------ loading
    def load_latest(
        self,
        names: Callable[[Checkpoint], list[str]],
        map_location=None,
        agree: Callable[[bool], bool] = lambda ok: ok,
    ) -> tuple[dict[str, dict], Checkpoint] | None:
        """The newest checkpoint that loads on every rank, as ({name: state}, checkpoint); None
        when the directory holds no complete checkpoint.

        names(checkpoint): the files this rank reads from it. agree(ok): True when `ok` is true
        on every rank (a collective): a checkpoint damaged on one rank is skipped by all.
        """
        candidates = self.complete()
        if not candidates:
            return None
        problems = []
        for checkpoint in candidates:
            states: dict[str, dict] = {}
            try:
                for name in names(checkpoint):
                    states[name] = checkpoint.load(name, map_location)
                ok = True
            except Exception as err:  # any unreadable file must fall back, with its reason
                reason = f"{type(err).__name__}: {err}".splitlines()[0]
                log.error("checkpoint %s cannot be used: %s", checkpoint.path, reason)
                problems.append(f"{checkpoint.path}: {reason}")
                ok = False
            if not agree(ok):
                if ok:
                    problems.append(f"{checkpoint.path}: unusable on another rank")
                continue
            if problems:
                log.error("resuming from the older checkpoint %s", checkpoint.path)
            return states, checkpoint
        raise CheckpointError(
            f"{len(candidates)} checkpoint(s) in {self.directory} but none can be loaded "
            "(refusing to start from scratch):\n  " + "\n  ".join(problems)
        )


def _non_finite(state: Any, key: str = "") -> str | None:
    """The key of the first floating-point tensor in `state` with a NaN or inf, else None."""
    if isinstance(state, torch.Tensor):
        if state.is_floating_point() and not bool(torch.isfinite(state).all()):
            return key or "the state"
        return None
    if isinstance(state, dict):
        items = ((f"{key}.{k}" if key else str(k), v) for k, v in state.items())
    elif isinstance(state, (list, tuple)):
        items = ((f"{key}[{i}]", v) for i, v in enumerate(state))
    else:
        return None
    for sub_key, value in items:
        where = _non_finite(value, sub_key)
        if where is not None:
            return where
    return None


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
    """Torch CPU, the current CUDA device, numpy and python `random` generator states, as
    tensors, numbers and lists only (so checkpoints load with weights_only=True)."""
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    py_version, py_internal, py_gauss_next = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
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
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"].cpu())
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
