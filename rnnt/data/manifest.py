"""JSON-Lines manifests: one utterance per line, audio paths relative to the dataset root.

`{"utt_id": "1272-128104-0000", "audio": "dev-clean/1272/128104/1272-128104-0000.flac",
"duration": 5.855, "transcript": "mister quilter ...", "tokens": [12, 5, ...]}`

The format and its strict reading, which every run does; manifests are written offline by
`rnnt.prep.manifests`.
"""

from __future__ import annotations

import gc
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

from rnnt.errors import UserError

_FIELDS = {"utt_id", "audio", "duration", "transcript", "tokens"}


class ManifestError(UserError, ValueError):
    """A malformed manifest; the message names the file and line."""


@dataclass
class Utterance:
    utt_id: str
    audio: str  # relative to the dataset root on disk; absolute once read by read_manifest
    duration: float  # seconds, from the audio header
    transcript: str  # normalized (rnnt.data.text)
    tokens: list[int] | None = None  # SentencePiece ids, when the manifest was tokenized

    def to_json(self) -> str:
        record = {
            "utt_id": self.utt_id,
            "audio": self.audio,
            "duration": self.duration,
            "transcript": self.transcript,
        }
        if self.tokens is not None:
            record["tokens"] = self.tokens
        return json.dumps(record, ensure_ascii=False)


def inside_root(root: str, rel: str) -> str | None:
    """`root/rel` normalized, or None if `rel` is absolute or climbs out of `root` (string
    operations: pathlib costs more than the JSON parse on a LibriSpeech-size manifest)."""
    if os.path.isabs(rel):
        return None
    norm = os.path.normpath(rel)
    if norm == ".." or norm.startswith(".." + os.sep) or norm == ".":
        return None
    return f"{root}{os.sep}{norm}"


def _parse_line(line: str, where: str, root: str) -> Utterance:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise ManifestError(f"{where}: not valid JSON: {err.msg} (column {err.colno})") from None
    if not isinstance(record, dict):
        raise ManifestError(f"{where}: expected a JSON object, got {type(record).__name__}")
    unknown = sorted(set(record) - _FIELDS)
    if unknown:
        raise ManifestError(f"{where}: unknown field {unknown[0]!r} (fields: {sorted(_FIELDS)})")
    for key in ("utt_id", "audio", "duration", "transcript"):
        if key not in record:
            raise ManifestError(f"{where}: missing field {key!r}")
    for key in ("utt_id", "audio", "transcript"):
        if not isinstance(record[key], str):
            raise ManifestError(f"{where}: field {key!r} must be a string, got {record[key]!r}")
    for key in ("utt_id", "audio"):
        if not record[key]:
            raise ManifestError(f"{where}: field {key!r} is empty")
    duration = record["duration"]
    if isinstance(duration, bool) or not isinstance(duration, (int, float)):
        raise ManifestError(f"{where}: field 'duration' must be a number, got {duration!r}")
    if not math.isfinite(duration) or duration <= 0:
        raise ManifestError(f"{where}: field 'duration' must be positive, got {duration!r}")
    tokens = record.get("tokens")
    # type() is int, not isinstance: a bool is an int to isinstance
    if tokens is not None and not (
        isinstance(tokens, list) and set(map(type, tokens)) <= {int} and min(tokens, default=0) >= 0
    ):
        raise ManifestError(f"{where}: field 'tokens' must be a list of non-negative integers")
    audio = inside_root(root, record["audio"])
    if audio is None:
        raise ManifestError(
            f"{where}: audio path {record['audio']!r} escapes the dataset root {root}"
        )
    return Utterance(record["utt_id"], audio, float(duration), record["transcript"], tokens)


def scan_manifest(
    path: str | Path, dataset_dir: str | Path
) -> tuple[list[tuple[str, Utterance]], list[tuple[str, str]]]:
    """Every line of a manifest: ("file:line", Utterance) for each good one, and ("file:line",
    message) for each bad one, so that a caller can list every problem at once.
    A manifest that cannot be read at all raises ManifestError. Files are not opened."""
    path = Path(path)
    root = os.path.abspath(dataset_dir)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ManifestError(f"{path}: manifest not found") from None
    except UnicodeDecodeError as err:
        raise ManifestError(f"{path}: not UTF-8 text ({err})") from None
    except OSError as err:
        raise ManifestError(f"{path}: cannot be read ({err.strerror or err})") from None
    # millions of small objects and no reference cycles: at LibriSpeech's size the collector's
    # passes over them cost a third of the parse
    collecting = gc.isenabled()
    gc.disable()
    try:
        return _scan_lines(text, str(path), root)
    finally:
        if collecting:
            gc.enable()


def _scan_lines(
    text: str, path: str, root: str
) -> tuple[list[tuple[str, Utterance]], list[tuple[str, str]]]:
    entries: list[tuple[str, Utterance]] = []
    problems: list[tuple[str, str]] = []
    first_line: dict[str, int] = {}
    for lineno, line in enumerate(text.splitlines(), 1):
        where = f"{path}:{lineno}"
        if not line.strip():
            problems.append((where, "blank line"))
            continue
        try:
            utt = _parse_line(line, where, root)
        except ManifestError as err:
            problems.append((where, str(err).removeprefix(f"{where}: ")))
            continue
        if utt.utt_id in first_line:
            first = first_line[utt.utt_id]
            problems.append((where, f"duplicate utt_id {utt.utt_id!r} (first at line {first})"))
            continue
        first_line[utt.utt_id] = lineno
        entries.append((where, utt))
    return entries, problems


def read_manifest_entries(path: str | Path, dataset_dir: str | Path) -> list[tuple[str, Utterance]]:
    """("file:line", Utterance) of every line of a manifest; a bad line raises ManifestError
    naming it (and how many more there are)."""
    entries, problems = scan_manifest(path, dataset_dir)
    if problems:
        more = f" (and {len(problems) - 1} more bad lines)" if len(problems) > 1 else ""
        where, message = problems[0]
        raise ManifestError(f"{where}: {message}{more}")
    return entries


def read_manifest(path: str | Path, dataset_dir: str | Path) -> list[Utterance]:
    """Read and check a manifest; each `audio` comes back as an absolute path under
    `dataset_dir` (relative entries that climb out of it are errors). Files are not opened.
    A bad line raises ManifestError naming it (and how many more there are)."""
    return [utt for _, utt in read_manifest_entries(path, dataset_dir)]
