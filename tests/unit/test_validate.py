"""Validation of LibriSpeech-layout splits: every bad input yields its message and its count."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from rnnt.prep.validate import PROBLEM_KINDS, DatasetError, check_audio, validate_split

SR = 16000


def _tone(n: int, channels: int = 1, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = 0.3 * np.sin(np.arange(n) * 0.05) + 0.01 * rng.standard_normal(n)
    x = x.astype(np.float32)
    return np.stack([x] * channels, axis=1) if channels > 1 else x


def _audio(path: Path, n: int, sr: int = SR, channels: int = 1, seed: int = 0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    sf.write(path, _tone(n, channels, seed), sr, subtype="PCM_16")
    return path


def _trans(path: Path, lines: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")


def _good_corpus(root: Path) -> dict[str, int]:
    """Two chapters of valid utterances; returns utt_id -> number of samples."""
    lengths = {}
    for spk, ch, texts in [
        ("19", "198", ["HELLO WORLD", "IT'S A  TEST"]),
        ("26", "495", ["ONE TWO THREE"]),
    ]:
        d = root / "dev-clean" / spk / ch
        lines = []
        for i, text in enumerate(texts):
            utt = f"{spk}-{ch}-{i:04d}"
            n = 4000 + 1000 * len(lengths)
            _audio(d / f"{utt}.flac", n, seed=len(lengths))
            lengths[utt] = n
            lines.append(f"{utt} {text}")
        _trans(d / f"{spk}-{ch}.trans.txt", lines)
    return lengths


def test_good_split_keeps_everything_with_header_durations(tmp_path):
    lengths = _good_corpus(tmp_path)
    valid, report = validate_split(tmp_path, "dev-clean")
    assert report.problems == [] and report.kept == 3
    assert [c.utt_id for c in valid] == sorted(lengths)
    by_id = {c.utt_id: c for c in valid}
    for utt, n in lengths.items():
        assert by_id[utt].duration == n / SR
    assert by_id["19-198-0001"].transcript == "it's a test"
    assert by_id["19-198-0001"].audio == "dev-clean/19/198/19-198-0001.flac"
    assert by_id["19-198-0001"].where == "dev-clean/19/198/19-198.trans.txt:2"


def _broken_corpus(root: Path, outside: Path) -> None:
    """One good utterance and one instance of every problem kind, in dev-clean/1/2 unless
    the problem needs its own directory."""
    d = root / "dev-clean" / "1" / "2"
    _audio(d / "1-2-0000.flac", 8000)  # good
    junk = d / "1-2-0001.flac"
    junk.write_bytes(b"this is not audio at all" * 10)
    cut = _audio(d / "1-2-0002.flac", 16000)
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2])
    _audio(d / "1-2-0003.flac", 8000)  # empty transcript
    _audio(d / "1-2-0004.flac", 8000, channels=2)
    _audio(d / "1-2-0005.flac", 8000, sr=8000)
    _audio(d / "1-2-0006.wav", 0)
    _audio(d / "1-2-0007.flac", 100)
    # 1-2-0008: transcript line, no audio
    _audio(d / "1-2-0009.flac", 8000)  # audio, no transcript line
    _audio(d / "1-2-0010.flac", 8000)  # digits and punctuation
    cutwav = _audio(d / "1-2-0011.wav", 16000)
    cutwav.write_bytes(cutwav.read_bytes()[: cutwav.stat().st_size // 2])
    target = _audio(outside / "elsewhere.flac", 8000)
    os.symlink(target, d / "1-2-0012.flac")
    _audio(d / "1-2-0013.flac", 8000)
    _audio(d / "1-2-0013.wav", 8000)  # same id twice
    _trans(
        d / "1-2.trans.txt",
        [
            "1-2-0000 A GOOD ONE",
            "1-2-0001 JUNK",
            "1-2-0002 CUT SHORT",
            "1-2-0003",
            "1-2-0004 STEREO",
            "1-2-0005 NARROW BAND",
            "1-2-0006 NOTHING",
            "1-2-0007 TINY",
            "1-2-0008 NO AUDIO",
            "1-2-0010 ROOM 101!",
            "1-2-0011 CUT WAV",
            "1-2-0012 OUTSIDE",
            "1-2-0013 TWICE",
        ],
    )
    spaced = root / "dev-clean" / "3 3" / "4"
    _audio(spaced / "3-4-0000.flac", 8000)
    _trans(spaced / "3-4.trans.txt", ["3-4-0000 SPACED OUT"])
    bad_text = root / "dev-clean" / "5" / "6"
    _audio(bad_text / "5-6-0000.flac", 8000)
    (bad_text / "5-6.trans.txt").write_bytes(b"5-6-0000 CAF\xe9\n")
    dup = root / "dev-clean" / "7" / "8"
    _audio(dup / "7-8-0000.flac", 8000)
    _trans(dup / "7-8.trans.txt", ["7-8-0000 FIRST", "7-8-0000 SECOND"])


def test_every_problem_is_reported_with_file_line_and_counted(tmp_path):
    root = tmp_path / "LibriSpeech"
    _broken_corpus(root, tmp_path / "outside")
    valid, report = validate_split(root, "dev-clean")
    assert [c.utt_id for c in valid] == ["1-2-0000"]
    lines = {str(p) for p in report.problems}
    t = "dev-clean/1/2/1-2.trans.txt"
    a = "dev-clean/1/2/1-2-"
    expected = [
        f"{t}:4: utterance 1-2-0003: empty transcript",
        f"{t}:9: utterance 1-2-0008: no audio file for this transcript line",
        f"{t}:10: utterance 1-2-0010: characters outside the alphabet: '1', '0', '!'",
        f"{a}0004.flac: utterance 1-2-0004: 2 channels (expected mono)",
        f"{a}0005.flac: utterance 1-2-0005: 8000 Hz (expected 16000)",
        f"{a}0006.wav: utterance 1-2-0006: 0 samples",
        f"{a}0007.flac: utterance 1-2-0007: 100 samples, shorter than one 320-sample "
        "analysis window",
        f"{a}0009.flac: utterance 1-2-0009: no transcript line for this audio",
        f"{a}0013.wav: utterance 1-2-0013: also at dev-clean/1/2/1-2-0013.flac",
        "dev-clean/3 3/4/3-4-0000.flac: utterance 3-4-0000: white space in the audio path",
        "dev-clean/7/8/7-8.trans.txt:2: utterance 7-8-0000: also transcribed at "
        "dev-clean/7/8/7-8.trans.txt:1",
    ]
    for line in expected:
        assert line in lines, f"missing: {line}\nhave:\n" + "\n".join(sorted(lines))
    by_id = {p.utt_id: p for p in report.problems}
    assert by_id["1-2-0001"].kind == "unreadable_audio"
    assert by_id["1-2-0002"].kind == "truncated_audio"
    assert by_id["1-2-0011"].kind == "truncated_audio"
    assert "data chunk declares" in by_id["1-2-0011"].message
    assert by_id["1-2-0012"].kind == "path_escapes_root"
    assert by_id["1-2-0012"].where == "dev-clean/1/2/1-2-0012.flac"
    unreadable = [p for p in report.problems if p.kind == "unreadable_transcript"]
    assert [p.where for p in unreadable] == ["dev-clean/5/6/5-6.trans.txt"]

    counts = report.counts()
    # the corpus exercises every kind of the split walk (out_of_vocabulary comes with token
    # ids: tests/unit/test_manifests.py)
    walk_kinds = set(PROBLEM_KINDS) - {"out_of_vocabulary"}
    assert set(counts) == walk_kinds
    twice = {
        "truncated_audio": 2,  # a cut FLAC and a cut WAV
        "missing_transcript": 2,  # 1-2-0009, and 5-6-0000 whose transcript file is unreadable
        "duplicate_utterance": 2,  # one audio id twice, one transcript id twice
    }
    assert counts == {kind: twice.get(kind, 1) for kind in walk_kinds}
    assert report.kept == 1
    assert report.excluded == 17  # 1-2-0001..0013 but 0000, 3-4-0000, 5-6, 7-8, the file
    summary = report.summary()
    assert summary.splitlines()[0].startswith("1 utterances kept, 17 excluded by validation")
    assert "       2  truncated or corrupt audio (truncated_audio)" in summary


def test_full_decode_finds_corruption_inside_a_flac(tmp_path):
    path = _audio(tmp_path / "x.flac", 32000)
    data = bytearray(path.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 2000):
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))
    duration, problems = check_audio(str(path), SR, 320, full_decode=False)
    assert duration == 2.0 and problems == []  # the tail decodes: the cheap check misses it
    _, problems = check_audio(str(path), SR, 320, full_decode=True)
    assert [k for k, _ in problems] == ["truncated_audio"]


def test_parallel_workers_give_the_same_result(tmp_path):
    root = tmp_path / "LibriSpeech"
    _broken_corpus(root, tmp_path / "outside")
    serial = validate_split(root, "dev-clean", workers=1)
    parallel = validate_split(root, "dev-clean", workers=2)
    assert serial[0] == parallel[0]
    assert serial[1].problems == parallel[1].problems


def test_missing_split_is_an_error(tmp_path):
    with pytest.raises(DatasetError, match="dev-other: split directory not found"):
        validate_split(tmp_path, "dev-other")


def test_cli_reports_and_strict_fails(tmp_path, repo_root):
    root = tmp_path / "LibriSpeech"
    _broken_corpus(root, tmp_path / "outside")
    cmd = [sys.executable, str(repo_root / "scripts" / "validate_dataset.py")]
    cmd += ["--dataset-dir", str(root), "--splits", "dev-clean", "--workers", "1"]
    lenient = subprocess.run(cmd + ["--no-progress"], capture_output=True, text=True)
    assert lenient.returncode == 0, lenient.stderr
    assert "dev-clean/1/2/1-2.trans.txt:4: utterance 1-2-0003: empty transcript" in lenient.stdout
    assert "1 utterances kept, 17 excluded by validation" in lenient.stdout
    assert lenient.stdout.strip().splitlines()[-1] == (
        "validation found problems: 17 utterances would be excluded (--strict makes that exit "
        "with status 1)"
    )
    strict = subprocess.run(cmd + ["--no-progress", "--strict"], capture_output=True, text=True)
    assert strict.returncode == 1
    assert strict.stdout.strip().splitlines()[-1] == (
        "validation FAILED (--strict): 17 utterances excluded; exit status 1"
    )
    missing = subprocess.run(cmd + ["--splits", "dev-other"], capture_output=True, text=True)
    assert missing.returncode == 2
    assert missing.stderr == f"error: {root}/dev-other: split directory not found\n"


def test_cli_says_a_clean_split_passed(tmp_path, repo_root):
    _good_corpus(tmp_path)
    cmd = [sys.executable, str(repo_root / "scripts" / "validate_dataset.py"), "--no-progress"]
    cmd += ["--dataset-dir", str(tmp_path), "--splits", "dev-clean", "--workers", "1"]
    clean = subprocess.run(cmd + ["--strict"], capture_output=True, text=True)
    assert clean.returncode == 0, clean.stderr
    assert clean.stdout.strip().splitlines()[-1] == "validation passed: no problems found"
