"""Transcript normalization: the model's alphabet is lower-case letters, space and apostrophe."""

from __future__ import annotations

import re

ALPHABET = frozenset("abcdefghijklmnopqrstuvwxyz '")
_SPACES = re.compile(r"\s+")


def normalize_transcript(text: str) -> str:
    """Lower-case and collapse white space. Characters outside ALPHABET are kept, so that
    validation can report them instead of silently changing what was said."""
    return _SPACES.sub(" ", text.lower()).strip()


def invalid_characters(text: str) -> str:
    """The distinct characters of `text` outside ALPHABET, in order of first appearance."""
    seen: dict[str, None] = {}
    for ch in text:
        if ch not in ALPHABET:
            seen.setdefault(ch, None)
    return "".join(seen)
