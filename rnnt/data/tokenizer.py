"""SentencePiece tokenizer of docs/SPEC.md "Tokenizer": unigram, character coverage 1.0, no BOS/EOS.

Id 0 is `<unk>`: a transcript that needs it cannot be learned, so encoding one is an error that
names the utterance. The model's classes are the pieces plus blank (`vocab_size + 1`).
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterable
from pathlib import Path

import sentencepiece as spm

from rnnt.errors import UserError

UNK_ID = 0


class TokenizerError(UserError, ValueError):
    """A missing or unusable tokenizer, or text it cannot encode."""


def train_tokenizer(texts: Iterable[str], model_prefix: str | Path, vocab_size: int) -> Path:
    """Train a unigram SentencePiece model on `texts`; returns the `.model` path.

    `hard_vocab_limit` stays on: the vocabulary must be exactly `vocab_size` (the model's
    output layer is sized from it), so too little text is an error rather than a smaller model.
    """
    model_prefix = Path(model_prefix)
    model_prefix.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "transcripts.txt"
        lines = 0
        with corpus.open("w") as fh:
            for line in texts:
                fh.write(line.strip() + "\n")
                lines += 1
        try:
            spm.SentencePieceTrainer.train(
                input=str(corpus),
                model_prefix=str(model_prefix),
                vocab_size=vocab_size,
                model_type="unigram",
                character_coverage=1.0,
                bos_id=-1,
                eos_id=-1,
                unk_id=UNK_ID,
                pad_id=-1,
                minloglevel=2,
            )
        except RuntimeError as err:
            # SentencePiece prefixes its reason with a source location and a failed check.
            reason = str(err).rsplit("] ", 1)[-1]
            raise TokenizerError(
                f"cannot train a {vocab_size}-piece tokenizer at {model_prefix} on "
                f"{lines} transcripts: {reason}"
            ) from None
    return Path(f"{model_prefix}.model")  # not with_suffix: prefixes may contain dots


class Tokenizer:
    def __init__(self, model_path: str | Path) -> None:
        path = Path(model_path)
        if not path.is_file():
            raise TokenizerError(f"tokenizer model not found: {path}")
        self.path = path
        self.sp = spm.SentencePieceProcessor(model_file=str(path))

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    def encode(self, text: str, utt_id: str = "<unknown>") -> list[int]:
        ids = self.sp.encode(text, out_type=int)
        if UNK_ID in ids:
            pieces = self.sp.encode(text, out_type=str)
            bad = [p for p, i in zip(pieces, ids) if i == UNK_ID]
            raise TokenizerError(
                f"utterance {utt_id}: transcript maps to <unk> at {bad!r} "
                f"(tokenizer {self.path}); text: {text!r}"
            )
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        return self.sp.decode([int(i) for i in ids])
