"""Manifests: strict JSON-Lines reading, every bad line named by file and line, and the round
trip through the writer (rnnt.prep.manifests)."""

from __future__ import annotations

import json
import os

import pytest

from rnnt.data.manifest import ManifestError, Utterance, read_manifest
from rnnt.prep.manifests import write_manifest


def test_write_read_round_trip_and_relative_paths(tmp_path):
    utts = [
        Utterance("1-2-0000", "dev-clean/1/2/1-2-0000.flac", 5.855, "mister quilter", [3, 4]),
        Utterance("1-2-0001", "dev-clean/1/2/1-2-0001.flac", 0.02, "it's", None),
    ]
    path = tmp_path / "m.jsonl"
    write_manifest(path, utts)
    lines = path.read_text().splitlines()
    assert json.loads(lines[0]) == {
        "utt_id": "1-2-0000",
        "audio": "dev-clean/1/2/1-2-0000.flac",
        "duration": 5.855,
        "transcript": "mister quilter",
        "tokens": [3, 4],
    }
    assert "tokens" not in json.loads(lines[1])
    got = read_manifest(path, tmp_path / "root")
    assert got[0].audio == str((tmp_path / "root/dev-clean/1/2/1-2-0000.flac").absolute())
    assert [(u.utt_id, u.duration, u.transcript, u.tokens) for u in got] == [
        (u.utt_id, u.duration, u.transcript, u.tokens) for u in utts
    ]
    again = tmp_path / "again.jsonl"
    write_manifest(again, got, tmp_path / "root")
    assert again.read_bytes() == path.read_bytes()
    assert sorted(os.listdir(tmp_path)) == ["again.jsonl", "m.jsonl"]  # no temp files left


GOOD = '{"utt_id": "u1", "audio": "a/u1.flac", "duration": 1.5, "transcript": "hi"}'


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"utt_id": "u2", "audio": ', "not valid JSON"),
        ("[1, 2]", "expected a JSON object, got list"),
        ('{"utt_id": "u2", "audio": "a.flac", "duration": 1.0}', "missing field 'transcript'"),
        (GOOD.replace("u1", "u2").replace("1.5", '"1.5"'), "'duration' must be a number"),
        (GOOD.replace("u1", "u2").replace("1.5", "true"), "'duration' must be a number"),
        (GOOD.replace("u1", "u2").replace("1.5", "-1"), "'duration' must be positive"),
        (GOOD.replace("u1", "u2").replace('"hi"', "3"), "'transcript' must be a string"),
        (GOOD.replace("u1", "u2").replace('"hi"}', '"hi", "tokens": [1, -2]}'), "'tokens'"),
        (GOOD.replace("u1", "u2").replace('"hi"}', '"hi", "token": [1]}'), "unknown field 'token'"),
        (GOOD.replace("a/u1.flac", "../x/u2.flac").replace("u1", "u2"), "escapes the dataset"),
        (GOOD.replace("a/u1.flac", "/data/u2.flac").replace("u1", "u2"), "escapes the dataset"),
        (GOOD.replace("a/u1.flac", "a/../../u2.flac").replace("u1", "u2"), "escapes the dataset"),
        (GOOD.replace('"a/u1', '"b/u1'), "duplicate utt_id 'u1' \\(first at line 1\\)"),
        ("", "blank line"),
    ],
)
def test_read_errors_name_file_and_line(tmp_path, line, message):
    path = tmp_path / "m.jsonl"
    path.write_text(GOOD + "\n" + line + "\n" + GOOD.replace("u1", "u3") + "\n")
    with pytest.raises(ManifestError, match=f"^{path}:2: .*{message}"):
        read_manifest(path, tmp_path)


def test_read_missing_manifest(tmp_path):
    with pytest.raises(ManifestError, match="nope.jsonl: manifest not found"):
        read_manifest(tmp_path / "nope.jsonl", tmp_path)
