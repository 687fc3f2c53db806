#!/usr/bin/env python3
"""Draw the training loss (with the learning rate) and the dev WER of a run to a PNG.

The program is rnnt/cli/plot_metrics.py (installed as `rnnt-plot-metrics`); this file keeps
`python scripts/plot_metrics.py ...` working.
"""

import sys

from rnnt.cli.plot_metrics import main

if __name__ == "__main__":
    sys.exit(main())
