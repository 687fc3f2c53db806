"""Synthesize a spoken corpus with espeak-ng in the LibriSpeech layout (train and dev splits).

python scripts/make_synthetic_corpus.py digits datasets/digits --train 6000
python scripts/make_synthetic_corpus.py sentences datasets/sentences --train 20000 --seed 3
python scripts/make_synthetic_corpus.py sentences datasets/long --train 30000 \
    --durations librispeech --held-out-speakers 12
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict

from rnnt.errors import reports_user_errors
from rnnt.prep.synthetic_corpus import (
    DEFAULT_DEV_SIZE,
    DURATIONS,
    KINDS,
    build_corpus,
)


@reports_user_errors
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("kind", choices=KINDS, help="digits: 1-7 spoken digits; sentences: English")
    parser.add_argument("out_dir", help="corpus root; gets train/, dev/ and synthetic_corpus.json")
    parser.add_argument("--train", type=int, required=True, help="train utterances")
    parser.add_argument(
        "--dev",
        type=int,
        default=DEFAULT_DEV_SIZE,
        help=f"dev utterances (default {DEFAULT_DEV_SIZE}, dev-clean's size: an MLPerf log "
        "evaluated on fewer is not compliant)",
    )
    parser.add_argument("--seed", type=int, default=1, help="same seed, same corpus")
    parser.add_argument(
        "--durations",
        choices=DURATIONS,
        default="natural",
        help="librispeech: sentences joined to durations drawn from LibriSpeech (sentences only)",
    )
    parser.add_argument(
        "--held-out-speakers",
        type=int,
        default=0,
        metavar="N",
        help="N of the 84 speakers speak only in dev (default 0: dev shares train's speakers)",
    )
    parser.add_argument("--workers", type=int, default=None, help="processes (default: all CPUs)")
    parser.add_argument("--force", action="store_true", help="delete the splits and rebuild")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)

    start = time.perf_counter()
    summary = build_corpus(
        args.out_dir,
        args.kind,
        train=args.train,
        dev=args.dev,
        seed=args.seed,
        workers=args.workers,
        force=args.force,
        progress=not args.no_progress,
        durations=args.durations,
        held_out_speakers=args.held_out_speakers,
    )
    report = asdict(summary)
    report["wall_seconds"] = round(time.perf_counter() - start, 1)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
