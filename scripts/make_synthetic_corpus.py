#!/usr/bin/env python3
"""Synthesize a spoken corpus with espeak-ng in the LibriSpeech layout (train and dev splits).

The program is rnnt/cli/make_synthetic_corpus.py (installed as `rnnt-make-corpus`); this file
keeps `python scripts/make_synthetic_corpus.py ...` working.
"""

import sys

from rnnt.cli.make_synthetic_corpus import main

if __name__ == "__main__":
    sys.exit(main())
