import random

import jiwer
import pytest

from rnnt.metrics import wer, word_errors

WORDS = ["a", "b", "c", "the", "cat", "sat"]


def _sentence(rng: random.Random, max_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(0, max_words)))


def _jiwer_edits(hyp: str, ref: str) -> int:
    out = jiwer.process_words(ref, hyp)
    return out.substitutions + out.deletions + out.insertions


def test_word_errors_match_jiwer_on_random_pairs():
    rng = random.Random(0)
    for _ in range(600):
        ref, hyp = _sentence(rng, 12), _sentence(rng, 12)
        if rng.random() < 0.3:  # near-copies exercise the prefix/suffix trimming
            words = ref.split()
            if words:
                words[rng.randrange(len(words))] = rng.choice(WORDS)
            hyp = " ".join(words)
        errors, n_ref = word_errors(hyp, ref)
        assert errors == _jiwer_edits(hyp, ref), (hyp, ref)
        assert n_ref == len(ref.split())


def test_long_transcripts_match_jiwer():
    """Past 64 reference words the bit vectors span several machine words (Python ints)."""
    rng = random.Random(2)
    for _ in range(60):
        ref, hyp = _sentence(rng, 240), _sentence(rng, 240)
        if rng.random() < 0.5:
            words = ref.split()
            for _ in range(rng.randint(1, 8)):
                if words:
                    words[rng.randrange(len(words))] = rng.choice(WORDS + ["dog"])
            hyp = " ".join(words)
        assert word_errors(hyp, ref)[0] == _jiwer_edits(hyp, ref), (hyp, ref)


def test_corpus_wer_matches_jiwer_including_empty_hypotheses_and_references():
    rng = random.Random(1)
    for _ in range(50):
        refs = [_sentence(rng, 8) for _ in range(rng.randint(1, 20))]
        hyps = [_sentence(rng, 8) for _ in refs]
        assert wer(hyps, refs) == pytest.approx(jiwer.wer(refs, hyps), abs=1e-12)


def test_all_empty_references_follow_jiwer():
    # jiwer 4: no reference words -> WER is the number of inserted words
    assert wer(["a b", ""], ["", ""]) == pytest.approx(jiwer.wer(["", ""], ["a b", ""])) == 2.0
    assert wer(["", ""], ["", ""]) == jiwer.wer(["", ""], ["", ""]) == 0.0
    assert word_errors("", "") == (0, 0)


def test_known_values_and_whitespace():
    assert word_errors("the cat sat", "the cat sat") == (0, 3)
    assert word_errors("", "the cat sat") == (3, 3)
    assert word_errors("the bat sat on", "the cat sat") == (2, 3)  # 1 substitution + 1 insertion
    assert word_errors("  the   cat\tsat ", "the cat sat") == (0, 3)
    # corpus level: (1 + 0) / (2 + 2), not the mean of per-utterance rates
    assert wer(["a", "c d"], ["a b", "c d"]) == pytest.approx(0.25)


def test_length_mismatch_is_an_error():
    with pytest.raises(ValueError, match="2 hypotheses but 1 references"):
        wer(["a", "b"], ["a"])
