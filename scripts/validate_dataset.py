#!/usr/bin/env python3
"""Validate LibriSpeech-layout splits without writing anything.

The program is rnnt/cli/validate_dataset.py (installed as `rnnt-validate-dataset`); this file keeps
`python scripts/validate_dataset.py ...` working.
"""

import sys

from rnnt.cli.validate_dataset import main

if __name__ == "__main__":
    sys.exit(main())
