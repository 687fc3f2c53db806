"""The preflight: every problem of the manifests, audio paths, token ids and tokenizer listed
at once with its file:line, or excluded and counted under data.skip_bad."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from rnnt.config import DataConfig
from rnnt.data.preflight import STAT_PROBE, PreflightError, check_audio_files, preflight
from rnnt.data.tokenizer import Tokenizer, train_tokenizer

N_CLASSES = 12  # 11 pieces + blank


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    """11 pieces over the letters a-e: any other letter is out of the vocabulary."""
    texts = ["a b c d e", "ab cd e", "bad cab", "dead bead", "ace bed"] * 40
    return train_tokenizer(texts, tmp_path_factory.mktemp("sp") / "abcde", N_CLASSES - 1)


def write(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def line(utt_id: str, tokens: list[int] | None = (3, 4), text: str = "a bed", duration=1.5):
    record = {
        "utt_id": utt_id,
        "audio": f"train/{utt_id}.wav",
        "duration": duration,
        "transcript": text,
    }
    if tokens is not None:
        record["tokens"] = list(tokens)
    return record


@pytest.fixture
def data(tmp_path, tokenizer) -> DataConfig:
    """A dataset root with the audio files u0..u9 (a few bytes each) and no manifests yet."""
    root = tmp_path / "root"
    (root / "train").mkdir(parents=True)
    for i in range(10):
        (root / "train" / f"u{i}.wav").write_bytes(b"RIFF")
    return DataConfig(dataset_dir=str(root), tokenizer=str(tokenizer))


def test_clean_inputs_pass_and_missing_tokens_come_from_the_tokenizer(data, tmp_path):
    data.train_manifests = [str(write(tmp_path / "t.jsonl", [line("u0"), line("u1", None)]))]
    data.val_manifests = [str(write(tmp_path / "d.jsonl", [line("u2", None, "zebra")]))]
    checked = preflight(data, N_CLASSES)
    checked.raise_for_problems()
    tok = Tokenizer(data.tokenizer)
    assert [u.tokens for u in checked.train] == [[3, 4], tok.encode("a bed")]
    assert [u.utt_id for u in checked.val] == ["u2"]  # dev transcripts are never tokenized
    assert checked.checked == 3 and checked.summary().startswith("preflight: 3 utterances")


def test_every_problem_is_listed_at_once_with_file_and_line(data, tmp_path):
    root = Path(data.dataset_dir)
    outside = tmp_path / "secret.wav"
    outside.write_bytes(b"not audio of this dataset")
    os.symlink(outside, root / "train" / "link.wav")
    os.symlink(tmp_path, root / "train" / "elsewhere")  # a folder that leads out of the root
    (root / "train" / "empty.wav").write_bytes(b"")
    (root / "train" / "folder.wav").mkdir()
    manifest = write(
        tmp_path / "t.jsonl",
        [
            line("u0"),
            '{"utt_id": "u1", "audio": ',
            line("u2", duration=0),
            line("gone"),
            {**line("u3"), "audio": "train/link.wav"},
            {**line("u4"), "audio": "train/elsewhere/secret.wav"},
            {**line("u5"), "audio": "train/empty.wav"},
            {**line("u6"), "audio": "train/folder.wav"},
            line("u7", [3, 999, 4]),
            line("u8", [3, N_CLASSES - 1]),  # blank is not a target
            line("u9", [0, 5]),  # <unk>
            line("u0"),
        ],
    )
    data.train_manifests = [str(manifest)]
    with pytest.raises(PreflightError) as info:
        preflight(data, N_CLASSES).raise_for_problems()
    lines = str(info.value).splitlines()
    where = [text.split(": ")[0] for text in lines[:-1]]
    assert where == [f"{manifest}:{n}" for n in range(2, 13)]
    real = os.path.realpath(data.dataset_dir)
    assert "not valid JSON" in lines[0] and "'duration' must be positive, got 0" in lines[1]
    assert lines[2].endswith(f"audio file not found: {root}/train/gone.wav")
    assert lines[3].endswith(f"resolves to {outside}, outside the dataset root {real}")
    assert lines[4].endswith(f"resolves to {outside}, outside the dataset root {real}")
    assert lines[5].endswith("train/empty.wav is empty")
    assert lines[6].endswith("train/folder.wav is not a regular file")
    assert lines[7].endswith("token id 999 is outside [0, 11) (model.n_classes=12; 11 is blank)")
    assert "token id 11 is outside" in lines[8]
    assert "token id 0 is <unk>" in lines[9]
    assert lines[10].endswith("duplicate utt_id 'u0' (first at line 1)")
    assert lines[-1] == (
        "preflight: 11 problems (1 audio file not found, 2 audio outside the dataset root, "
        "2 audio path not a non-empty regular file, 3 malformed manifest line, "
        "1 out-of-vocabulary transcript, 2 token id outside the model's classes); "
        "fix them, or set data.skip_bad=true to exclude such utterances"
    )


def test_skip_bad_excludes_and_counts(data, tmp_path):
    data.train_manifests = [
        str(write(tmp_path / "t.jsonl", [line("u0"), line("gone"), line("u1", None, "xyz")]))
    ]
    data.skip_bad = True
    checked = preflight(data, N_CLASSES)
    checked.raise_for_problems()  # nothing fatal: the bad ones are left out
    assert [u.utt_id for u in checked.train] == ["u0"]
    assert [p.kind for p in checked.problems] == ["audio_missing", "out_of_vocabulary"]
    assert "utterance u1: transcript maps to <unk>" in str(checked.problems[1])
    assert checked.summary().endswith(
        "(1 train, 0 dev kept); 2 excluded by data.skip_bad: 1 audio file not found, "
        "1 out-of-vocabulary transcript"
    )


def test_one_problem_is_one_line(data, tmp_path):
    manifest = write(tmp_path / "t.jsonl", [line("u0"), line("gone")])
    data.train_manifests = [str(manifest)]
    with pytest.raises(PreflightError) as info:
        preflight(data, N_CLASSES).raise_for_problems()
    assert str(info.value) == (
        f"{manifest}:2: utterance gone: audio file not found: {data.dataset_dir}/train/gone.wav; "
        "fix it, or set data.skip_bad=true to exclude such utterances"
    )


def test_whole_inputs_are_fatal_even_when_skipping(data, tmp_path):
    data.skip_bad = True
    data.train_manifests = [str(tmp_path / "nope.jsonl")]
    with pytest.raises(PreflightError, match=r"^.*nope.jsonl: manifest not found$"):
        preflight(data, N_CLASSES).raise_for_problems()
    data.train_manifests = [str(write(tmp_path / "t.jsonl", [line("u0")]))]
    with pytest.raises(PreflightError, match=r"model.n_classes=30 but tokenizer .* 11 pieces"):
        preflight(data, 30).raise_for_problems()
    data.tokenizer = str(tmp_path / "missing.model")
    with pytest.raises(PreflightError, match=r"tokenizer model not found: .*missing.model"):
        preflight(data, N_CLASSES).raise_for_problems()
    data.tokenizer, data.skip_bad = "", False
    data.train_manifests = [str(write(tmp_path / "t.jsonl", [line("u0", None)]))]
    with pytest.raises(PreflightError, match=r"t.jsonl:1: utterance u0: no 'tokens' and no"):
        preflight(data, N_CLASSES).raise_for_problems()


def test_evaluation_checks_only_the_dev_manifests(data, tmp_path):
    data.train_manifests = [str(tmp_path / "never-read.jsonl")]
    data.val_manifests = [str(write(tmp_path / "d.jsonl", [line("u0", [999]), line("u1")]))]
    checked = preflight(data, N_CLASSES, train=False)
    checked.raise_for_problems()
    assert [u.utt_id for u in checked.val] == ["u0", "u1"] and checked.train == []


def test_the_fingerprint_tells_ranks_that_disagree(data, tmp_path):
    data.skip_bad = True
    data.train_manifests = [str(write(tmp_path / "t.jsonl", [line("u0"), line("u1")]))]
    same = preflight(data, N_CLASSES).fingerprint()
    assert preflight(data, N_CLASSES).fingerprint() == same
    (Path(data.dataset_dir) / "train" / "u1.wav").unlink()  # what another node might see
    assert preflight(data, N_CLASSES).fingerprint() != same


def test_the_stat_threads_give_the_verdicts_of_one(tmp_path):
    """The thread pool (forced: on cached metadata the preflight stats alone) sees what a
    single thread sees, in order, past the files it probes alone."""
    root = tmp_path / "root"
    (root / "a").mkdir(parents=True)
    paths = []
    for i in range(STAT_PROBE + 300):
        path = root / "a" / f"{i}.wav"
        if i % 97:  # every 97th is missing
            path.write_bytes(b"RIFF")
        paths.append(str(path))
    alone = check_audio_files(paths, str(root), threads=1)
    pooled = check_audio_files(paths, str(root), threads=4, slow_stat_s=0.0)
    assert pooled == alone
    assert [i for i, v in enumerate(alone) if v] == list(range(0, STAT_PROBE + 300, 97))
