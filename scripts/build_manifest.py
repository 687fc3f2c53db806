#!/usr/bin/env python3
"""Build a JSON-Lines manifest from LibriSpeech-layout splits, or add token ids to one.

The program is rnnt/cli/build_manifest.py (installed as `rnnt-build-manifest`); this file keeps
`python scripts/build_manifest.py ...` working.
"""

import sys

from rnnt.cli.build_manifest import main

if __name__ == "__main__":
    sys.exit(main())
