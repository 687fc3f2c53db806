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
    """Levenshtein distance (unit costs for substitution, insertion and deletion).

    Bit-parallel (Myers 1999, in Hyyrö's form for the global distance): the column of the
    dynamic programme over the reference's words is held as bit vectors of its +1 / -1
    vertical steps in two Python ints, so each hypothesis word costs a dozen integer
    operations instead of a loop over the reference. Every evaluation scores the whole dev
    set on the host (docs/PERFORMANCE.md, "Scoring the dev set")."""
    # Greedy decoding of a trained model mostly agrees with the reference: the shared prefix
    # and suffix cost nothing
    start = 0
    end_h, end_r = len(hyp), len(ref)
    while start < end_h and start < end_r and hyp[start] == ref[start]:
        start += 1
    while end_h > start and end_r > start and hyp[end_h - 1] == ref[end_r - 1]:
        end_h -= 1
        end_r -= 1
    hyp, ref = hyp[start:end_h], ref[start:end_r]
    m = len(ref)
    if not hyp or not m:
        return len(hyp) + m
    matches: dict[str, int] = {}  # word -> bit i set where ref[i] is that word
    for i, word in enumerate(ref):
        matches[word] = matches.get(word, 0) | (1 << i)
    mask, top = (1 << m) - 1, 1 << (m - 1)
    plus, minus, distance = mask, 0, m  # vertical +1 / -1 steps; D[m][0] = m
    for word in hyp:
        eq = matches.get(word, 0)
        xv = eq | minus
        xh = ((((eq & plus) + plus) & mask) ^ plus) | eq
        h_plus = minus | (~(xh | plus) & mask)
        h_minus = plus & xh
        if h_plus & top:
            distance += 1
        elif h_minus & top:
            distance -= 1
        # the top row is D[0][j] = j: a +1 step enters at row 0 of every column
        h_plus = ((h_plus << 1) | 1) & mask
        h_minus = (h_minus << 1) & mask
        plus = h_minus | (~(xv | h_plus) & mask)
        minus = h_plus & xv
    return distance


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
