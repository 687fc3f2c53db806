"""Train the SentencePiece tokenizer of SPEC.md (unigram, coverage 1.0, no BOS/EOS) on the
training transcripts, read from JSON Lines manifests or a text file with one transcript a line.

    python scripts/train_tokenizer.py --manifests train.jsonl --vocab-size 1023 \
        --output-prefix tokenizers/librispeech1023
    python scripts/train_tokenizer.py --transcripts digits.txt --vocab-size 24 \
        --output-prefix tokenizers/digits24
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rnnt.data.text import invalid_characters, normalize_transcript
from rnnt.data.tokenizer import Tokenizer, TokenizerError, train_tokenizer
from rnnt.errors import reports_user_errors


def manifest_transcripts(path: Path) -> list[tuple[str, str]]:
    """The "transcript" field of every line, read with plain json (no dependency on the
    manifest module) and checked enough to name the line of any problem."""
    texts = []
    with path.open() as fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise TokenizerError(f"{path}:{number}: not valid JSON ({err})") from None
            if not isinstance(record, dict) or not isinstance(record.get("transcript"), str):
                raise TokenizerError(f'{path}:{number}: no string "transcript" field')
            texts.append((f"{path}:{number}", record["transcript"]))
    return texts


def file_transcripts(path: Path) -> list[tuple[str, str]]:
    with path.open() as fh:
        return [(f"{path}:{n}", line) for n, line in enumerate(fh, 1) if line.strip()]


@reports_user_errors
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--manifests", nargs="+", type=Path, help="JSON Lines training manifests")
    source.add_argument("--transcripts", type=Path, help="text file, one transcript per line")
    parser.add_argument(
        "--vocab-size",
        type=int,
        required=True,
        help="pieces (1023 for LibriSpeech, a few dozen for the synthetic corpora)",
    )
    parser.add_argument(
        "--output-prefix", required=True, help="writes PREFIX.model and PREFIX.vocab"
    )
    args = parser.parse_args(argv)

    sources = args.manifests or [args.transcripts]
    located = []
    for path in sources:
        if not path.is_file():
            raise TokenizerError(f"{path}: no such file")
        located += manifest_transcripts(path) if args.manifests else file_transcripts(path)
    if not located:
        raise TokenizerError(f"no transcripts in {', '.join(map(str, sources))}")
    texts = []
    for where, text in located:
        text = normalize_transcript(text)
        bad = invalid_characters(text)
        if bad:
            raise TokenizerError(f"{where}: characters {bad!r} outside the alphabet in {text!r}")
        texts.append(text)
    model = train_tokenizer(texts, args.output_prefix, args.vocab_size)
    tokenizer = Tokenizer(model)
    print(f"{model}: vocab size {tokenizer.vocab_size} from {len(texts)} transcripts")
    return 0


if __name__ == "__main__":
    sys.exit(main())
