"""JSON-Lines manifests: one utterance per line, audio paths relative to the dataset root.

`{"utt_id": "1272-128104-0000", "audio": "dev-clean/1272/128104/1272-128104-0000.flac",
"duration": 5.855, "transcript": "mister quilter ...", "tokens": [12, 5, ...]}`

`build_manifest` walks LibriSpeech-layout splits through `rnnt.prep.validate`, optionally
converts FLAC to 16-bit WAV (into `<split>-wav/`, beside the split, so paths stay relative to
the same root) and stores token ids so that training never tokenizes on the fly.
"""

from __future__ import annotations

import gc
import json
import math
import os
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import soundfile as sf

from rnnt.data.tokenizer import Tokenizer, TokenizerError
from rnnt.errors import UserError
from rnnt.prep.validate import (
    TOO_LONG,
    Candidate,
    DatasetError,
    Problem,
    Report,
    parallel_map,
    validate_split,
)

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


def _inside(root: str, rel: str) -> str | None:
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
    audio = _inside(root, record["audio"])
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


def write_manifest(
    path: str | Path, utts: Iterable[Utterance], dataset_dir: str | Path | None = None
) -> None:
    """Write atomically (a reader never sees half a manifest). Audio paths are written relative
    to `dataset_dir` when it is given (as read_manifest returns them), else as they are, which
    must then be relative."""
    path = Path(path)
    root = Path(os.path.abspath(dataset_dir)) if dataset_dir is not None else None
    lines = []
    for utt in utts:
        audio = utt.audio
        if root is not None:
            audio = os.path.relpath(os.path.abspath(audio), root)
        if _inside(".", audio) is None:
            where = f"dataset root {root}" if root is not None else "the dataset root"
            raise ManifestError(
                f"{path}: utterance {utt.utt_id}: audio {utt.audio!r} is not inside {where}"
            )
        lines.append(
            Utterance(
                utt.utt_id, Path(audio).as_posix(), utt.duration, utt.transcript, utt.tokens
            ).to_json()
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write("".join(line + "\n" for line in lines))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def tokenize(
    utts: Sequence[Utterance], tokenizer: Tokenizer, wheres: Sequence[str]
) -> tuple[list[Utterance], Report]:
    """Copies of `utts` with token ids. One whose transcript needs <unk> (out of the
    vocabulary) is left out and reported at its place in `wheres` ("file:line"), never kept
    with an <unk> id."""
    out, report = [], Report()
    for u, where in zip(utts, wheres):
        try:
            tokens = tokenizer.encode(u.transcript, u.utt_id)
        except TokenizerError as err:
            reason = str(err).removeprefix(f"utterance {u.utt_id}: ")
            report.add("out_of_vocabulary", where, reason, u.utt_id)
            continue
        out.append(Utterance(u.utt_id, u.audio, u.duration, u.transcript, tokens))
    report.kept = len(out)
    return out, report


# ------------------------------------------------------------------------------ WAV conversion


def wav_path(rel_audio: str) -> str:
    """`dev-clean/1/2/1-2-0003.flac` -> `dev-clean-wav/1/2/1-2-0003.wav`."""
    split, _, rest = Path(rel_audio).as_posix().partition("/")
    return f"{split}-wav/{Path(rest).with_suffix('.wav').as_posix()}"


def convert_to_wav(src: str, dst: str) -> str:
    """Decode `src` and write 16-bit PCM WAV `dst` atomically; '' on success, else the error.
    An existing `dst` with the same sample count and rate is kept (reruns are cheap)."""
    try:
        info = sf.info(src)
        if os.path.exists(dst):
            have = sf.info(dst)
            if (have.frames, have.samplerate, have.channels) == (
                info.frames,
                info.samplerate,
                info.channels,
            ):
                return ""
        data, rate = sf.read(src, dtype="int16", always_2d=False)
        if len(data) != info.frames:
            return f"decoded {len(data)} of {info.frames} samples"
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        tmp = f"{dst}.tmp{os.getpid()}"
        sf.write(tmp, data, rate, subtype="PCM_16", format="WAV")
        os.replace(tmp, dst)
        return ""
    except Exception as err:  # libsndfile raises several types
        return f"conversion to WAV failed: {err}"


def _convert_star(args: tuple[str, str]) -> str:
    return convert_to_wav(*args)


# ------------------------------------------------------------------------------------ building


def build_manifest(
    dataset_dir: str | Path,
    splits: Sequence[str],
    *,
    tokenizer: Tokenizer | None = None,
    max_duration: float | None = None,
    convert_to_wav: bool = False,
    workers: int = 1,
    strict: bool = False,
    full_decode: bool = False,
    sample_rate: int = 16000,
    min_samples: int = 320,
    progress: bool = False,
) -> tuple[list[Utterance], Report]:
    """Validate `splits` of `dataset_dir` and return their good utterances, sorted by id within
    each split, with audio paths relative to `dataset_dir`.

    Bad utterances are excluded and reported (`strict` raises DatasetError instead), and so
    are transcripts the `tokenizer` cannot encode without <unk>. Only when
    `max_duration` is given (train manifests) are longer utterances dropped; they are counted
    in `report.dropped`. `convert_to_wav` writes `<split>-wav/...wav` and points the manifest at
    it; a file that fails to decode there is excluded like any other bad audio.
    """
    root = Path(dataset_dir)
    report = Report(max_duration=max_duration)
    kept: list[Candidate] = []
    for split in splits:
        valid, split_report = validate_split(
            root,
            split,
            sample_rate=sample_rate,
            min_samples=min_samples,
            full_decode=full_decode,
            workers=workers,
            progress=progress,
        )
        report.merge(split_report)
        kept += valid
    if strict and report.problems:
        raise report.strict_error(root)
    if max_duration is not None:
        short = []
        for c in kept:
            if c.duration > max_duration:
                report.dropped.append(
                    Problem(
                        TOO_LONG,
                        c.audio,
                        f"utterance {c.utt_id}: {c.duration:.3f} s is longer than "
                        f"max_duration {max_duration} s",
                        c.utt_id,
                    )
                )
            else:
                short.append(c)
        kept = short
    audio_paths = [c.audio for c in kept]
    if convert_to_wav:
        jobs = [
            (str(root / c.audio), str(root / wav_path(c.audio)))
            for c in kept
            if not c.audio.endswith(".wav")
        ]
        errors = iter(parallel_map(_convert_star, jobs, workers, "FLAC -> WAV", progress))
        converted = []
        for c in kept:
            if c.audio.endswith(".wav"):
                converted.append(c.audio)
                continue
            err = next(errors)
            if err:
                report.add("truncated_audio", c.audio, err, c.utt_id)
                converted.append("")
            else:
                converted.append(wav_path(c.audio))
        if strict and any(not a for a in converted):
            raise DatasetError(f"{root}: WAV conversion failed (strict mode)\n{report.summary()}")
        pairs = [(c, a) for c, a in zip(kept, converted) if a]
        kept, audio_paths = [c for c, _ in pairs], [a for _, a in pairs]
    utts = [Utterance(c.utt_id, a, c.duration, c.transcript) for c, a in zip(kept, audio_paths)]
    if tokenizer is not None:
        utts, out_of_vocabulary = tokenize(utts, tokenizer, [c.where for c in kept])
        report.merge(out_of_vocabulary)
        if strict and out_of_vocabulary.problems:
            raise out_of_vocabulary.strict_error(root, "out-of-vocabulary transcripts")
    report.kept = len(utts)
    return utts, report
