#!/usr/bin/env python3
"""Train the SentencePiece tokenizer of docs/SPEC.md "Tokenizer" (unigram, coverage 1.0, no
BOS/EOS) on the training transcripts.

The program is rnnt/cli/train_tokenizer.py (installed as `rnnt-train-tokenizer`); this file keeps
`python scripts/train_tokenizer.py ...` working.
"""

import sys

from rnnt.cli.train_tokenizer import main

if __name__ == "__main__":
    sys.exit(main())
