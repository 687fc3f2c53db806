"""Score a checkpoint: greedy-decode a manifest and print its WER and throughput.

The program is rnnt/cli/eval.py (installed as `rnnt-eval`); this file keeps
`python eval.py ...` working.
"""

import sys

from rnnt.cli.eval import main

if __name__ == "__main__":
    sys.exit(main())
