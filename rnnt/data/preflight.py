"""Preflight: every input of a run is checked before the first training step, so that a bad
manifest line, a missing audio file or a token the model has no output for stops the run in
seconds, listed with the others, instead of an hour later inside a batch.

Checks, each problem named by its manifest `file:line`:
- every line of every manifest parses (`rnnt.data.manifest.scan_manifest`: JSON, fields,
  positive durations, relative paths, unique ids);
- every audio path, symlinks resolved (realpath), lies inside the dataset root and is a
  non-empty regular file;
- training utterances: their token ids (from the manifest, else from the tokenizer) lie in
  [0, n_classes - 1) (the last class is blank) and none is `<unk>`, so an out-of-vocabulary
  transcript is refused, never trained on as `<unk>`;
- the tokenizer exists and has n_classes - 1 pieces.

A missing manifest or tokenizer is fatal. A bad utterance is fatal too, unless
`data.skip_bad`: then it is excluded and counted. The audio files are only stat'ed, in a
thread pool when the stat calls wait on I/O (they release the GIL, so the waits of a network
file system overlap); the decoding checks of `rnnt.prep.validate` belong to dataset
preparation.
"""

from __future__ import annotations

import os
import stat
import time
import zlib
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

from rnnt.config import DataConfig
from rnnt.data.manifest import ManifestError, Utterance, scan_manifest
from rnnt.data.tokenizer import UNK_ID, Tokenizer, TokenizerError
from rnnt.errors import UserError

# kind -> what the summary calls it
KINDS = {
    "bad_line": "malformed manifest line",
    "audio_missing": "audio file not found",
    "audio_outside_root": "audio outside the dataset root",
    "audio_unusable": "audio path not a non-empty regular file",
    "no_tokens": "no token ids",
    "token_out_of_range": "token id outside the model's classes",
    "out_of_vocabulary": "out-of-vocabulary transcript",
}
STAT_THREADS = 16
STAT_PROBE = 2_000  # files stat'ed first, alone, to tell cached metadata from waiting I/O
SLOW_STAT_S = 50e-6  # a cached stat takes a few microseconds, a network round trip hundreds


class PreflightError(UserError):
    """Inputs that cannot train or be scored; the message lists every problem."""


@dataclass(frozen=True)
class Problem:
    kind: str  # a key of KINDS
    where: str  # "manifest:line" (or the file concerned)
    message: str

    def __str__(self) -> str:
        return f"{self.where}: {self.message}"


@dataclass
class PreflightResult:
    train: list[Utterance]
    val: list[Utterance]
    tokenizer: Tokenizer | None
    skip_bad: bool
    problems: list[Problem] = field(default_factory=list)  # of single utterances
    fatal: list[str] = field(default_factory=list)  # of whole inputs
    checked: int = 0
    seconds: float = 0.0

    def counts(self) -> str:
        counts = Counter(p.kind for p in self.problems)
        return ", ".join(f"{n} {KINDS[k]}" for k, n in sorted(counts.items()))

    def summary(self) -> str:
        text = (
            f"preflight: {self.checked} utterances checked in {self.seconds:.1f} s "
            f"({len(self.train)} train, {len(self.val)} dev kept)"
        )
        if self.problems:
            text += f"; {len(self.problems)} excluded by data.skip_bad: {self.counts()}"
        return text

    def fingerprint(self) -> int:
        """Equal on every rank that found the same problems (ranks compare it before acting)."""
        text = "\n".join([*self.fatal, *map(str, self.problems)])
        return zlib.crc32(f"{len(self.train)} {len(self.val)}\n{text}".encode())

    def raise_for_problems(self) -> None:
        """PreflightError listing every problem, unless there is none or only skipped ones:
        one line for one problem, else one line each and a summary line last."""
        if not self.fatal and (self.skip_bad or not self.problems):
            return
        lines = [*self.fatal, *map(str, self.problems)]
        hint = (
            "" if self.fatal else "; fix it, or set data.skip_bad=true to exclude such utterances"
        )
        if len(lines) == 1:
            raise PreflightError(lines[0] + hint)
        last = f"preflight: {len(lines)} problems"
        if self.problems:
            last += f" ({self.counts()})"
        raise PreflightError("\n".join([*lines, last + hint.replace("fix it", "fix them")]))


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root + os.sep)


def check_audio_files(
    paths: Sequence[str],
    dataset_dir: str,
    threads: int = STAT_THREADS,
    slow_stat_s: float = SLOW_STAT_S,
) -> list[tuple[str, str] | None]:
    """(kind, message) for each path that is not a non-empty regular file inside the dataset
    root once symlinks are resolved, None for each good one. `threads` stat the files after
    the first STAT_PROBE when those took more than `slow_stat_s` each (0: always)."""
    root = os.path.realpath(dataset_dir)
    real_dirs: dict[str, str] = {}  # a few thousand directories hold the files

    def check(path: str) -> tuple[str, str] | None:
        directory, name = os.path.split(path)
        real_dir = real_dirs.get(directory)
        if real_dir is None:
            real_dir = real_dirs[directory] = os.path.realpath(directory)
        try:
            info = os.lstat(path)
            real = os.path.join(real_dir, name)
            if stat.S_ISLNK(info.st_mode):
                real = os.path.realpath(path)
                info = os.stat(real)
        except FileNotFoundError:
            return "audio_missing", f"audio file not found: {path}"
        except OSError as err:
            return "audio_unusable", f"{path}: {err.strerror or err}"
        if not _inside(real, root):
            return (
                "audio_outside_root",
                f"{path} resolves to {real}, outside the dataset root {root}",
            )
        if not stat.S_ISREG(info.st_mode):
            return "audio_unusable", f"{path} is not a regular file"
        if info.st_size == 0:
            return "audio_unusable", f"{path} is empty"
        return None

    def check_chunk(chunk: Sequence[str]) -> list[tuple[str, str] | None]:
        return [check(p) for p in chunk]

    # Threads pay only where a stat waits on a disk or a file server; on cached metadata they
    # contend for the GIL instead (16 threads took 4x as long as one on 2 cores:
    # docs/PERFORMANCE.md). The first files tell which it is.
    start = time.perf_counter()
    head = check_chunk(paths[:STAT_PROBE])
    rest = paths[STAT_PROBE:]
    slow = (time.perf_counter() - start) / max(1, len(head)) >= slow_stat_s
    if threads <= 1 or not rest or not slow:
        return head + check_chunk(rest)
    size = max(1, -(-len(rest) // threads))
    chunks = [rest[i : i + size] for i in range(0, len(rest), size)]
    with ThreadPoolExecutor(max_workers=min(threads, len(chunks))) as pool:
        return head + [result for part in pool.map(check_chunk, chunks) for result in part]


def _token_problem(tokens: list[int], n_classes: int) -> tuple[str, str] | None:
    """(kind, message) when `tokens` cannot be a training target of n_classes outputs."""
    if not tokens:
        return "no_tokens", "no token ids (an empty transcript)"
    low, high = min(tokens), max(tokens)
    if low < 0 or high >= n_classes - 1:
        return "token_out_of_range", (
            f"token id {low if low < 0 else high} is outside [0, {n_classes - 1}) "
            f"(model.n_classes={n_classes}; {n_classes - 1} is blank)"
        )
    if UNK_ID in tokens:
        return "out_of_vocabulary", (
            f"token id {UNK_ID} is <unk>: the transcript is out of the vocabulary"
        )
    return None


def _position(where: str, order: dict[str, int]) -> tuple[int, int]:
    """(manifest index, line) of a "manifest:line" place, for listing problems in file order."""
    manifest, _, line = where.rpartition(":")
    return order.get(manifest, len(order)), int(line) if line.isdigit() else 0


def load_tokenizer(path: str, n_classes: int) -> Tokenizer | None:
    """The tokenizer of data.tokenizer (None when unset), checked against model.n_classes."""
    if not path:
        return None
    tokenizer = Tokenizer(path)
    if tokenizer.vocab_size + 1 != n_classes:
        raise TokenizerError(
            f"model.n_classes={n_classes} but tokenizer {path} has {tokenizer.vocab_size} "
            "pieces (n_classes must be pieces + 1 for blank)"
        )
    return tokenizer


def preflight(
    data: DataConfig, n_classes: int, train: bool = True, threads: int = STAT_THREADS
) -> PreflightResult:
    """Check the manifests of `data` (the train ones only when `train`) and the tokenizer
    against a model of `n_classes`. Never raises for what it finds: the caller compares the
    result across ranks, then calls `raise_for_problems()`."""
    start = time.perf_counter()
    fatal: list[str] = []
    problems: list[Problem] = []
    try:
        tokenizer = load_tokenizer(data.tokenizer, n_classes)
    except TokenizerError as err:
        fatal.append(str(err))
        tokenizer = None
    kept: dict[str, list[tuple[str, Utterance]]] = {"train": [], "val": []}
    manifests = [("val", m) for m in data.val_manifests]
    if train:
        manifests = [("train", m) for m in data.train_manifests] + manifests
    for split, manifest in manifests:
        try:
            entries, bad_lines = scan_manifest(manifest, data.dataset_dir)
        except ManifestError as err:
            fatal.append(str(err))
            continue
        problems += [Problem("bad_line", where, message) for where, message in bad_lines]
        kept[split] += entries
    checked = sum(map(len, kept.values())) + len(problems)

    for split, entries in kept.items():
        verdicts = check_audio_files([u.audio for _, u in entries], data.dataset_dir, threads)
        good = []
        for (where, utt), verdict in zip(entries, verdicts):
            if verdict is None:
                good.append((where, utt))
            else:
                kind, message = verdict
                problems.append(Problem(kind, where, f"utterance {utt.utt_id}: {message}"))
        kept[split] = good

    train_utts = []
    for where, utt in kept["train"]:
        if utt.tokens is None and tokenizer is None:
            problems.append(
                Problem(
                    "no_tokens",
                    where,
                    f"utterance {utt.utt_id}: no 'tokens' and no data.tokenizer to make them "
                    "(build the manifest with --tokenizer, or set data.tokenizer)",
                )
            )
            continue
        if utt.tokens is None:
            try:
                utt = replace(utt, tokens=tokenizer.encode(utt.transcript, utt.utt_id))
            except TokenizerError as err:
                problems.append(Problem("out_of_vocabulary", where, str(err)))
                continue
        problem = _token_problem(utt.tokens, n_classes)
        if problem is not None:
            kind, message = problem
            problems.append(Problem(kind, where, f"utterance {utt.utt_id}: {message}"))
            continue
        train_utts.append(utt)
    order = {str(Path(m)): i for i, (_, m) in enumerate(manifests)}
    problems.sort(key=lambda p: _position(p.where, order))
    return PreflightResult(
        train=train_utts,
        val=[u for _, u in kept["val"]],
        tokenizer=tokenizer,
        skip_bad=data.skip_bad,
        problems=problems,
        fatal=fatal,
        checked=checked,
        seconds=time.perf_counter() - start,
    )
