"""Manifest building: atomic writing, building from a LibriSpeech-layout corpus (validation,
max_duration, WAV conversion, token ids), the CLI and the preprocessing chain."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from rnnt.data.manifest import ManifestError, Utterance, read_manifest
from rnnt.data.tokenizer import Tokenizer, train_tokenizer
from rnnt.prep.manifests import build_manifest, wav_path, write_manifest
from rnnt.prep.validate import DatasetError

SR = 16000
TEXTS = [
    "THE QUICK BROWN FOX JUMPS OVER THE LAZY DOG",
    "PACK MY BOX WITH FIVE DOZEN LIQUOR JUGS",
    "HOW VEXINGLY QUICK DAFT ZEBRAS JUMP",
    "SPHINX OF BLACK QUARTZ JUDGE MY VOW",
    "THE FIVE BOXING WIZARDS JUMP QUICKLY",
    "IT'S NOT THE FOX IT'S THE DOG",
]


def _corpus(root: Path, split: str = "train-clean-100", texts: list[str] = TEXTS) -> dict:
    """`len(texts)` utterances over two chapters; returns utt_id -> samples (0.5 s .. 3 s)."""
    lengths = {}
    rng = np.random.default_rng(0)
    for i, text in enumerate(texts):
        spk, ch = ("103", "1240") if i % 2 == 0 else ("1034", "121119")
        utt = f"{spk}-{ch}-{i:04d}"
        d = root / split / spk / ch
        d.mkdir(parents=True, exist_ok=True)
        n = 8000 * (i + 1)
        sf.write(d / f"{utt}.flac", (0.1 * rng.standard_normal(n)).astype(np.float32), SR)
        with open(d / f"{spk}-{ch}.trans.txt", "a", encoding="utf-8") as fh:
            fh.write(f"{utt} {text}\n")
        lengths[utt] = n
    return lengths


def test_write_refuses_paths_outside_the_root(tmp_path):
    bad = [Utterance("a", "/abs/a.flac", 1.0, "a")]
    with pytest.raises(ManifestError, match="utterance a: audio '/abs/a.flac' is not inside"):
        write_manifest(tmp_path / "m.jsonl", bad)
    assert not (tmp_path / "m.jsonl").exists()


def test_build_keeps_all_without_max_duration_and_counts_drops_with_it(tmp_path):
    lengths = _corpus(tmp_path)
    utts, report = build_manifest(tmp_path, ["train-clean-100"])
    assert [u.utt_id for u in utts] == sorted(lengths)
    assert all(u.duration == lengths[u.utt_id] / SR for u in utts)
    assert utts[0].audio == "train-clean-100/103/1240/103-1240-0000.flac"
    assert utts[0].transcript == TEXTS[0].lower()
    assert report.kept == 6 and report.dropped == [] and report.problems == []

    utts, report = build_manifest(tmp_path, ["train-clean-100"], max_duration=1.6)
    assert sorted(u.duration for u in utts) == [0.5, 1.0, 1.5]
    assert report.kept == 3 and len(report.dropped) == 3
    assert str(report.dropped[0]) == (
        "train-clean-100/103/1240/103-1240-0004.flac: utterance 103-1240-0004: 2.500 s is "
        "longer than max_duration 1.6 s"
    )
    assert "3 utterances kept, 0 excluded by validation, 3 dropped by max_duration (1.6 s)" in (
        report.summary()
    )


def test_build_excludes_bad_utterances_or_fails_in_strict_mode(tmp_path):
    _corpus(tmp_path)
    d = tmp_path / "train-clean-100" / "103" / "1240"
    sf.write(d / "103-1240-0000.flac", np.zeros((8000, 2), np.float32), SR)
    sf.write(d / "103-1240-0099.flac", np.zeros(8000, np.float32), SR)
    with open(d / "103-1240.trans.txt", "a") as fh:
        fh.write("103-1240-0099 ROOM 101\n")
    utts, report = build_manifest(tmp_path, ["train-clean-100"])
    assert len(utts) == 5 and "103-1240-0000" not in {u.utt_id for u in utts}
    assert report.counts() == {"multi_channel": 1, "invalid_characters": 1}
    assert report.excluded == 2
    with pytest.raises(DatasetError) as err:
        build_manifest(tmp_path, ["train-clean-100"], strict=True)
    text = str(err.value)
    assert "2 validation problems (strict mode)" in text
    assert (
        "train-clean-100/103/1240/103-1240-0000.flac: utterance 103-1240-0000: "
        "2 channels (expected mono)" in text
    )
    assert "103-1240.trans.txt:4: utterance 103-1240-0099: characters outside" in text


def test_convert_to_wav_is_lossless_and_rerunnable(tmp_path):
    _corpus(tmp_path, texts=TEXTS[:3])
    utts, report = build_manifest(tmp_path, ["train-clean-100"], convert_to_wav=True, workers=2)
    assert report.kept == 3
    for u in utts:
        assert u.audio.startswith("train-clean-100-wav/") and u.audio.endswith(".wav")
        flac = tmp_path / u.audio.replace("-wav/", "/", 1).replace(".wav", ".flac")
        ref, _ = sf.read(flac, dtype="int16")
        got, rate = sf.read(tmp_path / u.audio, dtype="int16")
        assert rate == SR and sf.info(tmp_path / u.audio).subtype == "PCM_16"
        np.testing.assert_array_equal(got, ref)
        assert u.duration == len(ref) / SR
    stamp = {u.audio: os.stat(tmp_path / u.audio).st_mtime_ns for u in utts}
    again, _ = build_manifest(tmp_path, ["train-clean-100"], convert_to_wav=True)
    assert again == utts
    assert {u.audio: os.stat(tmp_path / u.audio).st_mtime_ns for u in again} == stamp


def test_wav_path_mapping():
    assert wav_path("dev-clean/1/2/1-2-0003.flac") == "dev-clean-wav/1/2/1-2-0003.wav"


def test_tokenized_manifest_round_trips_to_text(tmp_path):
    _corpus(tmp_path)
    utts, _ = build_manifest(tmp_path, ["train-clean-100"])
    model = train_tokenizer([u.transcript for u in utts], tmp_path / "sp" / "tok", 40)
    tok = Tokenizer(model)
    utts, _ = build_manifest(tmp_path, ["train-clean-100"], tokenizer=tok)
    path = tmp_path / "train.jsonl"
    write_manifest(path, utts)
    back = read_manifest(path, tmp_path)
    for u in back:
        assert u.tokens and 0 not in u.tokens
        assert u.tokens == tok.sp.encode(u.transcript)
        assert tok.decode(u.tokens) == u.transcript


def test_out_of_vocabulary_transcripts_are_excluded_and_counted(tmp_path):
    """Or fatal under strict; never kept with an <unk> id."""
    _corpus(tmp_path, texts=["A BAD CAB", "THE QUICK FOX", "DEAD BEEF"])
    model = train_tokenizer(["a b c d e f g h"] * 20, tmp_path / "sp" / "abc", 11)
    utts, report = build_manifest(tmp_path, ["train-clean-100"], tokenizer=Tokenizer(model))
    assert [u.utt_id for u in utts] == ["103-1240-0000", "103-1240-0002"]
    (problem,) = report.problems
    assert problem.kind == "out_of_vocabulary" and problem.utt_id == "1034-121119-0001"
    assert str(problem).startswith(
        "train-clean-100/1034/121119/1034-121119.trans.txt:1: utterance 1034-121119-0001: "
        "transcript maps to <unk>"
    )
    assert report.kept == 2 and "1  transcript outside the tokenizer's vocabulary" in (
        report.summary()
    )
    with pytest.raises(DatasetError, match=r"1 out-of-vocabulary transcripts \(strict mode\)"):
        build_manifest(tmp_path, ["train-clean-100"], tokenizer=Tokenizer(model), strict=True)


def _script(repo_root: Path):
    spec = importlib.util.spec_from_file_location(
        "build_manifest_cli", repo_root / "scripts" / "build_manifest.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cli_builds_then_tokenizes(tmp_path, repo_root, capsys):
    _corpus(tmp_path / "LS")
    (tmp_path / "LS/train-clean-100/103/1240/103-1240-0002.flac").unlink()
    cli = _script(repo_root)
    out = tmp_path / "LS" / "train.jsonl"
    rc = cli.main(
        ["--dataset-dir", str(tmp_path / "LS"), "--splits", "train-clean-100"]
        + ["--output", str(out), "--workers", "1", "--no-progress", "--max-duration", "2.2"]
    )
    captured = capsys.readouterr()
    assert rc == 0
    assert "103-1240.trans.txt:2: utterance 103-1240-0002: no audio file" in captured.err
    assert "3 utterances kept, 1 excluded by validation, 2 dropped by max_duration" in (
        captured.out
    )
    log = Path(f"{out}.report.txt").read_text()
    assert "utterance 1034-121119-0005: 3.000 s is longer than max_duration 2.2 s" in log
    assert len(read_manifest(out, tmp_path / "LS")) == 3

    model = train_tokenizer([t.lower() for t in TEXTS], tmp_path / "tok", 40)
    tokenized = tmp_path / "LS" / "train-tokens.jsonl"
    rc = cli.main(
        ["--dataset-dir", str(tmp_path / "LS"), "--from-manifest", str(out)]
        + ["--tokenizer", str(model), "--output", str(tokenized)]
    )
    assert rc == 0
    utts = read_manifest(tokenized, tmp_path / "LS")
    assert [Tokenizer(model).decode(u.tokens) for u in utts] == [
        u.transcript for u in read_manifest(out, tmp_path / "LS")
    ]
    assert json.loads(tokenized.read_text().splitlines()[0])["audio"].startswith("train-clean-100/")


def test_cli_tokenizing_a_manifest_excludes_out_of_vocabulary_lines(tmp_path, repo_root, capsys):
    _corpus(tmp_path / "LS", texts=["A BAD CAB", "THE QUICK FOX", "DEAD BEEF"])
    cli = _script(repo_root)
    raw = tmp_path / "LS" / "raw.jsonl"
    args = ["--dataset-dir", str(tmp_path / "LS"), "--workers", "1", "--no-progress"]
    assert cli.main([*args, "--splits", "train-clean-100", "--output", str(raw)]) == 0
    model = train_tokenizer(["a b c d e f g h"] * 20, tmp_path / "sp" / "abc", 11)
    out = tmp_path / "LS" / "tokens.jsonl"
    args = ["--dataset-dir", str(tmp_path / "LS"), "--from-manifest", str(raw)]
    args += ["--tokenizer", str(model), "--output", str(out)]
    capsys.readouterr()
    assert cli.main(args) == 0
    captured = capsys.readouterr()
    assert captured.err.startswith(f"{raw}:3: utterance 1034-121119-0001: transcript maps to")
    assert "2 utterances kept, 1 excluded by validation" in captured.out
    assert [u.utt_id for u in read_manifest(out, tmp_path / "LS")] == [
        "103-1240-0000",
        "103-1240-0002",
    ]
    # the full list goes to the report file, as when building from the splits
    report = Path(f"{out}.report.txt").read_text()
    assert (
        "1034-121119-0001" in report and f"full list of exclusions and drops: {out}" in captured.out
    )
    assert cli.main([*args, "--strict"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {raw}: 1 out-of-vocabulary transcripts (strict mode):\n")


def test_preprocess_chain_builds_then_skips_finished_stages(tmp_path, repo_root):
    root = tmp_path / "LibriSpeech"
    _corpus(root, "train-clean-100")
    _corpus(root, "dev-clean", texts=["A LAZY DOG", "QUICK BROWN ZEBRAS"])
    (root / "dev-clean/103/1240/103-1240-0000.flac").unlink()  # one bad eval utterance
    cmd = ["bash", str(repo_root / "scripts/preprocess_librispeech.sh"), str(root)]
    cmd += ["--workers", "1", "--vocab-size", "40"]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stderr
    tok = Tokenizer(tmp_path / "sentencepieces" / "librispeech40.model")
    train = read_manifest(root / "librispeech-train-clean-100-wav.jsonl", root)
    dev = read_manifest(root / "librispeech-dev-clean-wav.jsonl", root)
    assert len(train) == 6 and [u.utt_id for u in dev] == ["1034-121119-0001"]
    for u in train + dev:
        assert u.audio.endswith(".wav") and Path(u.audio).is_file()
        assert tok.decode(u.tokens) == u.transcript
    report = (root / "librispeech-dev-clean-wav-untokenized.jsonl.report.txt").read_text()
    assert "dev-clean/103/1240/103-1240.trans.txt:1: utterance 103-1240-0000: no audio" in report

    again = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    assert again.stdout.count("skipped") == 5  # 2 manifests, the tokenizer, 2 token stages
