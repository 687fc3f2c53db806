"""Word error rate: word-level Levenshtein distance, summed over a set of utterances.

Words are the whitespace-separated tokens of a string (`str.split()`), so leading, trailing and
repeated whitespace never count. The corpus WER is the sum of edits over the sum of reference
words (docs/SPEC.md "Evaluation"), not the mean of per-utterance rates.

Empty references follow jiwer 4: a set whose references hold no words at all has
WER = total edits (every hypothesis word is an insertion), i.e. edits / max(ref_words, 1);
such a set scores 0.0 only when every hypothesis is empty too.
"""

from __future__ import annotations

from collections.abc import Sequence


def _edit_distance(hyp: list[str], ref: list[str]) -> int:
    """Levenshtein distance (unit costs for substitution, insertion and deletion)."""
    # Greedy decoding of a trained model mostly agrees with the reference, so trimming the
    # shared prefix and suffix leaves a tiny table for the dynamic programme.
    start = 0
    end_h, end_r = len(hyp), len(ref)
    while start < end_h and start < end_r and hyp[start] == ref[start]:
        start += 1
    while end_h > start and end_r > start and hyp[end_h - 1] == ref[end_r - 1]:
        end_h -= 1
        end_r -= 1
    hyp, ref = hyp[start:end_h], ref[start:end_r]
    if not hyp or not ref:
        return len(hyp) + len(ref)
    prev = list(range(len(ref) + 1))
    for i, h_word in enumerate(hyp, 1):
        cur = [i]
        for j, r_word in enumerate(ref, 1):
            cur.append(
                min(
                    prev[j] + 1,  # hypothesis word inserted
                    cur[j - 1] + 1,  # reference word deleted
                    prev[j - 1] + (h_word != r_word),  # match or substitution
                )
            )
        prev = cur
    return prev[-1]


def word_errors(hyp: str, ref: str) -> tuple[int, int]:
    """(word edit distance between hyp and ref, number of reference words)."""
    ref_words = ref.split()
    return _edit_distance(hyp.split(), ref_words), len(ref_words)


def wer(hyps: Sequence[str], refs: Sequence[str]) -> float:
    """Corpus WER: sum of word edits / sum of reference words (see the module docstring for
    the all-empty-references case)."""
    if len(hyps) != len(refs):
        raise ValueError(f"wer: {len(hyps)} hypotheses but {len(refs)} references")
    errors = words = 0
    for hyp, ref in zip(hyps, refs):
        e, w = word_errors(hyp, ref)
        errors += e
        words += w
    return errors / max(words, 1)
