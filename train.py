"""Train the MLPerf RNN-T.

The program is rnnt/cli/train.py (installed as `rnnt-train`); this file keeps
`python train.py ...` working.
"""

import sys

from rnnt.cli.train import main

if __name__ == "__main__":
    sys.exit(main())
