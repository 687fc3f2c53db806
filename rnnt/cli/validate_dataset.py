"""Validate LibriSpeech-layout splits without writing anything.

  python scripts/validate_dataset.py --dataset-dir datasets/LibriSpeech --splits dev-clean

Prints every problem as `file[:line]: message`, a summary with counts per problem type, and
last the verdict; exit status 1 with --strict when anything is wrong, 2 when the dataset cannot
be validated at all (a split that is not there).
"""

from __future__ import annotations

import argparse
import os
import sys

from rnnt.errors import reports_user_errors
from rnnt.prep.validate import Report, validate_split


@reports_user_errors
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dataset-dir", required=True)
    ap.add_argument("--splits", nargs="+", required=True)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--full-decode", action="store_true", help="decode every sample")
    ap.add_argument("--strict", action="store_true", help="exit 1 when any problem is found")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)

    total = Report()
    for split in args.splits:
        _, report = validate_split(
            args.dataset_dir,
            split,
            full_decode=args.full_decode,
            workers=args.workers,
            progress=not args.no_progress,
        )
        total.merge(report)
    for problem in total.problems:
        print(problem)
    print(total.summary())
    # the verdict stands last, where a log's tail shows it
    if not total.problems:
        print("validation passed: no problems found")
        return 0
    if args.strict:
        print(f"validation FAILED (--strict): {total.excluded} utterances excluded; exit status 1")
        return 1
    print(
        f"validation found problems: {total.excluded} utterances would be excluded "
        "(--strict makes that exit with status 1)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
