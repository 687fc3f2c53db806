"""SentencePiece tokenizer of docs/SPEC.md "Tokenizer" and scripts/train_tokenizer.py, on
small text sets."""

import json
import subprocess
import sys

import numpy as np
import pytest

from rnnt.data.tokenizer import UNK_ID, Tokenizer, TokenizerError, train_tokenizer
from rnnt.prep.synthetic_corpus import SentenceGenerator, digits_text


@pytest.fixture(scope="module")
def sentences() -> list[str]:
    gen = SentenceGenerator()
    rng = np.random.default_rng(5)
    # No "q": a character the tokenizer never sees in training.
    return [s for s in (gen.sentence(rng) for _ in range(3000)) if "q" not in s]


@pytest.fixture(scope="module")
def model(sentences, tmp_path_factory):
    return train_tokenizer(sentences, tmp_path_factory.mktemp("sp") / "sent", vocab_size=200)


def test_spec_settings(model):
    tok = Tokenizer(model)
    assert tok.vocab_size == 200
    assert tok.sp.id_to_piece(UNK_ID) == "<unk>" and tok.sp.unk_id() == UNK_ID
    assert tok.sp.bos_id() == -1 and tok.sp.eos_id() == -1 and tok.sp.pad_id() == -1
    # Unigram pieces carry log-probability scores; BPE's are merge ranks (whole numbers).
    scores = [tok.sp.get_score(i) for i in range(1, tok.vocab_size)]
    assert all(s < 0 for s in scores) and any(s != round(s) for s in scores)


def test_full_character_coverage(tmp_path):
    """character_coverage 1.0: a character seen once in training is still a piece, not <unk>."""
    rng = np.random.default_rng(3)
    texts = [digits_text(rng) for _ in range(2000)] + ["jazz"]
    tok = Tokenizer(train_tokenizer(texts, tmp_path / "cov", vocab_size=24))
    assert tok.decode(tok.encode("one jazz two", "u")) == "one jazz two"


def test_round_trip(model, sentences):
    tok = Tokenizer(model)
    for text in sentences[:300]:
        ids = tok.encode(text, "utt")
        assert ids and all(0 < i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text
    # The pieces themselves spell the text: "▁" marks a word start.
    text = sentences[0]
    pieces = [tok.sp.id_to_piece(i) for i in tok.encode(text)]
    assert "".join(pieces).replace("\u2581", " ").strip() == text


def test_unknown_character_names_the_utterance(model):
    tok = Tokenizer(model)
    with pytest.raises(TokenizerError, match=r"utterance 1272-128104-0007: .*<unk>.*'q"):
        tok.encode("the quick cat", "1272-128104-0007")


def test_too_little_text_for_the_vocabulary(tmp_path):
    texts = ["one two", "three"]
    with pytest.raises(TokenizerError, match=r"1023-piece tokenizer .* on 2 transcripts.*too high"):
        train_tokenizer(texts, tmp_path / "tiny", vocab_size=1023)
    assert not (tmp_path / "tiny.model").exists()


def test_digits_vocabulary_of_a_few_dozen(tmp_path):
    rng = np.random.default_rng(0)
    texts = [digits_text(rng) for _ in range(500)]
    tok = Tokenizer(train_tokenizer(texts, tmp_path / "digits", vocab_size=24))
    assert tok.vocab_size == 24
    for text in texts[:50]:
        assert tok.decode(tok.encode(text)) == text


def test_model_path_for_a_prefix_with_dots(tmp_path):
    rng = np.random.default_rng(2)
    texts = [digits_text(rng) for _ in range(300)]
    model = train_tokenizer(texts, tmp_path / "digits.v1", vocab_size=20)
    assert model == tmp_path / "digits.v1.model" and model.is_file()


def test_missing_model_file(tmp_path):
    with pytest.raises(TokenizerError, match="not found"):
        Tokenizer(tmp_path / "absent.model")


def run_script(repo_root, *args):
    script = repo_root / "scripts" / "train_tokenizer.py"
    return subprocess.run(
        [sys.executable, str(script), *map(str, args)], capture_output=True, text=True
    )


def test_script_from_manifests(repo_root, sentences, tmp_path):
    halves = (sentences[:1500], sentences[1500:])
    manifests = []
    for n, half in enumerate(halves):
        path = tmp_path / f"train{n}.jsonl"
        records = [
            {
                "utt_id": f"1-{n}-{i:04d}",
                "audio": "x.flac",
                "duration": 1.0,
                "transcript": t.upper(),
            }
            for i, t in enumerate(half)
        ]
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        manifests.append(path)
    done = run_script(
        repo_root, "--manifests", *manifests, "--vocab-size", 128, "--output-prefix", tmp_path / "m"
    )
    assert done.returncode == 0, done.stderr
    assert "vocab size 128" in done.stdout
    assert (tmp_path / "m.vocab").read_text().count("\n") == 128
    tok = Tokenizer(tmp_path / "m.model")
    assert tok.decode(tok.encode(sentences[-1])) == sentences[-1]  # upper case was normalized


def test_script_from_transcripts_and_its_errors(repo_root, tmp_path):
    text = tmp_path / "t.txt"
    rng = np.random.default_rng(1)
    text.write_text("".join(digits_text(rng) + "\n" for _ in range(200)))
    done = run_script(
        repo_root, "--transcripts", text, "--vocab-size", 20, "--output-prefix", tmp_path / "d"
    )
    assert done.returncode == 0 and "vocab size 20" in done.stdout, done.stderr

    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"transcript": "one"}\n{"transcript": 3}\n')
    done = run_script(
        repo_root, "--manifests", bad_json, "--vocab-size", 20, "--output-prefix", tmp_path / "x"
    )
    assert done.returncode == 2 and f"{bad_json}:2" in done.stderr
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("error: ")

    digits_line = tmp_path / "digit.txt"
    digits_line.write_text("one two\nroom 101\n")
    done = run_script(
        repo_root,
        "--transcripts",
        digits_line,
        "--vocab-size",
        20,
        "--output-prefix",
        tmp_path / "y",
    )
    assert done.returncode == 2 and f"{digits_line}:2" in done.stderr and "'1" in done.stderr
