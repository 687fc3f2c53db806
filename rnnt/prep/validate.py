"""Dataset validation: walk one LibriSpeech-layout split and report every bad utterance.

A split is `<dataset_dir>/<split>/.../<dir>/` directories, each holding `*.trans.txt` files
(`UTTID TRANSCRIPT` per line) and one audio file `<UTTID>.flac` (or `.wav`) per utterance.
Every problem becomes a `Problem` naming the file (and line) it comes from; the utterance is
excluded and counted, never dropped silently. The caller decides whether problems are fatal.

The audio checks: the header read behind the duration; by default a truncation check, which
decodes the last 4096 samples of a FLAC (a cut FLAC cannot seek to its tail) and compares a
WAV's declared `data` chunk size with the file size (libsndfile silently shortens a cut WAV,
so its frame count cannot be trusted); `full_decode` decodes every sample, which also catches
corruption inside the file and costs far more (per-file costs: docs/PERFORMANCE.md, "Numbers
the code's comments used to quote").
"""

from __future__ import annotations

import multiprocessing
import os
import struct
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import soundfile as sf

from rnnt.data.text import invalid_characters, normalize_transcript
from rnnt.errors import UserError

AUDIO_SUFFIXES = (".flac", ".wav")
TRANSCRIPT_SUFFIX = ".trans.txt"
TAIL_SAMPLES = 4096

# kind -> the label the summary prints. Every exclusion has exactly one of these kinds.
PROBLEM_KINDS = {
    "unreadable_audio": "unreadable audio",
    "truncated_audio": "truncated or corrupt audio",
    "zero_length_audio": "zero-length audio",
    "sub_frame_audio": "audio shorter than one analysis window",
    "wrong_sample_rate": "wrong sample rate",
    "multi_channel": "multi-channel audio",
    "missing_audio": "transcript line without audio",
    "missing_transcript": "audio without transcript line",
    "empty_transcript": "empty transcript",
    "invalid_characters": "characters outside the alphabet",
    "path_escapes_root": "path escapes the dataset root",
    "whitespace_in_name": "white space in a path",
    "unreadable_transcript": "unreadable transcript file",
    "duplicate_utterance": "duplicate utterance id",
    # found when a manifest gets token ids (rnnt.prep.manifests.tokenize), not by validate_split
    "out_of_vocabulary": "transcript outside the tokenizer's vocabulary",
}
# Not a defect: valid utterances left out on request (train manifests only).
TOO_LONG = "longer_than_max_duration"


class DatasetError(UserError, ValueError):
    """The dataset cannot be processed at all, or has problems in strict mode."""


@dataclass(frozen=True)
class Problem:
    kind: str  # a key of PROBLEM_KINDS, or TOO_LONG
    where: str  # file relative to the dataset root, with ":line" for transcript lines
    message: str  # starts with "utterance <id>: " when one utterance is concerned
    utt_id: str = ""

    def __str__(self) -> str:
        return f"{self.where}: {self.message}"


@dataclass
class Report:
    """Problems and counts of one or more splits."""

    problems: list[Problem] = field(default_factory=list)  # validation failures
    dropped: list[Problem] = field(default_factory=list)  # valid, dropped by max_duration
    kept: int = 0
    max_duration: float | None = None

    def add(self, kind: str, where: str, message: str, utt_id: str = "") -> None:
        if kind not in PROBLEM_KINDS:
            raise KeyError(f"unknown problem kind {kind!r}")
        prefix = f"utterance {utt_id}: " if utt_id else ""
        self.problems.append(Problem(kind, where, prefix + message, utt_id))

    def merge(self, other: Report) -> None:
        self.problems += other.problems
        self.dropped += other.dropped
        self.kept += other.kept

    def counts(self) -> Counter:
        return Counter(p.kind for p in self.problems)

    @property
    def excluded(self) -> int:
        """Distinct utterances (or unnamed files) that failed validation."""
        return len({p.utt_id or p.where for p in self.problems})

    def write(self, path: str | Path) -> None:
        """Every problem and every max_duration drop, one per line, then the summary."""
        lines = [str(p) for p in self.problems + self.dropped] + [self.summary()]
        Path(path).write_text("\n".join(lines) + "\n", encoding="utf-8")

    def strict_error(self, source: str | Path, what: str = "validation problems") -> DatasetError:
        """The error of --strict: the first 20 problems, how many more, and the summary."""
        shown = "\n".join(str(p) for p in self.problems[:20])
        more = len(self.problems) - 20
        return DatasetError(
            f"{source}: {len(self.problems)} {what} (strict mode):\n{shown}"
            + (f"\n... and {more} more" if more > 0 else "")
            + f"\n{self.summary()}"
        )

    def summary(self) -> str:
        lines = [
            f"{self.kept} utterances kept, {self.excluded} excluded by validation, "
            f"{len(self.dropped)} dropped by max_duration"
            + (f" ({self.max_duration} s)" if self.max_duration is not None else "")
        ]
        for kind, n in sorted(self.counts().items(), key=lambda kv: (-kv[1], kv[0])):
            lines.append(f"  {n:8d}  {PROBLEM_KINDS[kind]} ({kind})")
        return "\n".join(lines)


class Candidate(NamedTuple):
    """One utterance whose transcript and audio both passed validation."""

    utt_id: str
    audio: str  # relative to the dataset root
    duration: float
    transcript: str  # normalized
    where: str  # its transcript line, "<file>:<line>"


# ------------------------------------------------------------------------------ audio checks


def _wav_declared_truncation(path: str) -> str | None:
    """Compare a RIFF/WAVE file's declared `data` size with the bytes actually present."""
    size = os.path.getsize(path)
    with open(path, "rb") as fh:
        head = fh.read(12)
        if len(head) < 12 or head[:4] != b"RIFF" or head[8:12] != b"WAVE":
            return None  # not plain RIFF (e.g. RF64): libsndfile's own checks apply
        pos = 12
        while pos + 8 <= size:
            fh.seek(pos)
            chunk_id, chunk_size = struct.unpack("<4sI", fh.read(8))
            if chunk_id == b"data":
                if chunk_size == 0xFFFFFFFF:  # streaming writers leave the size open
                    return None
                available = size - pos - 8
                if chunk_size > available:
                    return f"data chunk declares {chunk_size} bytes but {available} are present"
                return None
            pos += 8 + chunk_size + (chunk_size & 1)
    return "no data chunk"


def check_audio(
    path: str, sample_rate: int, min_samples: int, full_decode: bool
) -> tuple[float, list[tuple[str, str]]]:
    """(duration in seconds, [(kind, message), ...]) for one audio file; no problems = valid."""
    try:
        info = sf.info(path)
    except Exception as err:  # libsndfile raises several types for broken headers
        reason = getattr(err, "error_string", None) or str(err)  # without the path again
        return 0.0, [("unreadable_audio", f"cannot read audio header: {reason}")]
    problems = []
    if info.frames == 0:
        problems.append(("zero_length_audio", "0 samples"))
    elif info.frames < min_samples:
        problems.append(
            (
                "sub_frame_audio",
                f"{info.frames} samples, shorter than one {min_samples}-sample analysis window",
            )
        )
    if info.samplerate != sample_rate:
        problems.append(("wrong_sample_rate", f"{info.samplerate} Hz (expected {sample_rate})"))
    if info.channels != 1:
        problems.append(("multi_channel", f"{info.channels} channels (expected mono)"))
    if info.format == "WAV":
        reason = _wav_declared_truncation(path)
        if reason:
            problems.append(("truncated_audio", f"truncated WAV: {reason}"))
    if info.frames > 0 and not any(k == "truncated_audio" for k, _ in problems):
        try:
            with sf.SoundFile(path) as snd:
                start = 0 if full_decode else max(0, info.frames - TAIL_SAMPLES)
                snd.seek(start)
                got = len(snd.read(info.frames - start, dtype="int16"))
            if got != info.frames - start:
                problems.append(
                    ("truncated_audio", f"header says {info.frames} samples, decoded {start + got}")
                )
        except Exception as err:
            problems.append(("truncated_audio", f"decoding failed: {err}"))
    return info.frames / info.samplerate, problems


def _check_audio_star(args: tuple) -> tuple[float, list[tuple[str, str]]]:
    return check_audio(*args)


def parallel_map(
    fn: Callable[[Any], Any], items: Sequence[Any], workers: int, desc: str, progress: bool
) -> list[Any]:
    """`[fn(x) for x in items]` over `workers` processes, in order, with a progress bar."""
    from tqdm import tqdm

    bar = tqdm(total=len(items), desc=desc, unit="file", disable=not progress, leave=False)
    try:
        if workers <= 1 or len(items) < 2:
            out = []
            for item in items:
                out.append(fn(item))
                bar.update()
            return out
        # spawn: the parent may hold threads (torch, tqdm) that make fork unsafe
        ctx = multiprocessing.get_context("spawn")
        chunk = max(1, min(256, len(items) // (workers * 8)))
        with ctx.Pool(workers) as pool:
            out = []
            for result in pool.imap(fn, items, chunksize=chunk):
                out.append(result)
                bar.update()
            return out
    finally:
        bar.close()


# ------------------------------------------------------------------------------- the split walk


def _read_transcripts(
    path: Path, rel: str, report: Report
) -> Iterable[tuple[str, str, str]] | None:
    """(utt_id, raw text, "file:line") for each non-blank line, or None if unreadable."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        report.add("unreadable_transcript", rel, f"cannot read transcript file: {err}")
        return None
    out = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        parts = line.strip().split(maxsplit=1)
        out.append((parts[0], parts[1] if len(parts) > 1 else "", f"{rel}:{lineno}"))
    return out


def validate_split(
    dataset_dir: str | Path,
    split: str,
    *,
    sample_rate: int = 16000,
    min_samples: int = 320,
    full_decode: bool = False,
    workers: int = 1,
    progress: bool = False,
) -> tuple[list[Candidate], Report]:
    """Validate `<dataset_dir>/<split>`; returns its valid utterances (sorted by id) and a Report.

    `min_samples` is the analysis window (20 ms at 16 kHz): shorter audio yields no real frame.
    """
    root = Path(dataset_dir)
    real_root = root.resolve()
    split_dir = root / split
    if not split_dir.is_dir():
        raise DatasetError(f"{split_dir}: split directory not found")
    report = Report()
    transcripts: dict[str, tuple[str, str]] = {}  # utt_id -> (raw text, "file:line")
    audio: dict[str, str] = {}  # utt_id -> relative audio path
    bad_ids: set[str] = set()  # excluded for a reason found before the audio check
    seen_dirs: set[Path] = set()

    for dirpath, dirnames, filenames in os.walk(split_dir, followlinks=True):
        real = Path(dirpath).resolve()
        if real in seen_dirs:  # a symlink loop
            dirnames[:] = []
            continue
        seen_dirs.add(real)
        dirnames.sort()
        rel_dir = Path(dirpath).relative_to(root)
        for name in sorted(filenames):
            rel = (rel_dir / name).as_posix()
            if name.endswith(TRANSCRIPT_SUFFIX):
                lines = _read_transcripts(Path(dirpath) / name, rel, report)
                for utt_id, text, where in lines or []:
                    if utt_id in transcripts:
                        first = transcripts[utt_id][1]
                        report.add(
                            "duplicate_utterance", where, f"also transcribed at {first}", utt_id
                        )
                        bad_ids.add(utt_id)
                    else:
                        transcripts[utt_id] = (text, where)
            elif name.endswith(AUDIO_SUFFIXES):
                utt_id = name.rsplit(".", 1)[0]
                if utt_id in audio:
                    report.add("duplicate_utterance", rel, f"also at {audio[utt_id]}", utt_id)
                    bad_ids.add(utt_id)
                    continue
                audio[utt_id] = rel
                if any(ch.isspace() for ch in rel):
                    report.add("whitespace_in_name", rel, "white space in the audio path", utt_id)
                    bad_ids.add(utt_id)
                elif not (Path(dirpath) / name).resolve().is_relative_to(real_root):
                    report.add(
                        "path_escapes_root",
                        rel,
                        f"resolves to {(Path(dirpath) / name).resolve()}, outside {real_root}",
                        utt_id,
                    )
                    bad_ids.add(utt_id)

    to_check: list[tuple[str, str, str]] = []  # (utt_id, normalized text, where)
    for utt_id, (text, where) in sorted(transcripts.items()):
        if utt_id not in audio:
            report.add("missing_audio", where, "no audio file for this transcript line", utt_id)
            continue
        normalized = normalize_transcript(text)
        if not normalized:
            report.add("empty_transcript", where, "empty transcript", utt_id)
            bad_ids.add(utt_id)
        elif bad := invalid_characters(normalized):
            shown = ", ".join(repr(c) for c in bad)
            report.add(
                "invalid_characters", where, f"characters outside the alphabet: {shown}", utt_id
            )
            bad_ids.add(utt_id)
        if utt_id not in bad_ids:
            to_check.append((utt_id, normalized, where))
    for utt_id, rel in sorted(audio.items()):
        if utt_id not in transcripts and utt_id not in bad_ids:
            report.add("missing_transcript", rel, "no transcript line for this audio", utt_id)

    results = parallel_map(
        _check_audio_star,
        [(str(root / audio[u]), sample_rate, min_samples, full_decode) for u, _, _ in to_check],
        workers,
        f"checking {split}",
        progress,
    )
    valid = []
    for (utt_id, text, where), (duration, problems) in zip(to_check, results):
        for kind, message in problems:
            report.add(kind, audio[utt_id], message, utt_id)
        if not problems:
            valid.append(Candidate(utt_id, audio[utt_id], duration, text, where))
    report.kept = len(valid)
    return valid, report
