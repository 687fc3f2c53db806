"""Manifest building: LibriSpeech-layout splits, validated, to JSON-Lines manifests (the format
and its reading: `rnnt.data.manifest`).

`build_manifest` walks the splits through `rnnt.prep.validate`, optionally converts FLAC to
16-bit WAV (into `<split>-wav/`, beside the split, so paths stay relative to the same root) and
stores token ids so that training never tokenizes on the fly.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

import soundfile as sf

from rnnt.data.manifest import ManifestError, Utterance, inside_root
from rnnt.data.tokenizer import Tokenizer, TokenizerError
from rnnt.prep.validate import (
    TOO_LONG,
    Candidate,
    DatasetError,
    Problem,
    Report,
    parallel_map,
    validate_split,
)


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
        if inside_root(".", audio) is None:
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
