"""Build a JSON-Lines manifest from LibriSpeech-layout splits, or add token ids to one.

  python scripts/build_manifest.py --dataset-dir datasets/LibriSpeech --splits dev-clean \
      --output datasets/LibriSpeech/librispeech-dev-clean-wav.jsonl --convert-to-wav
  python scripts/build_manifest.py --dataset-dir datasets/LibriSpeech \
      --from-manifest M.jsonl --tokenizer T.model --output M-tokens.jsonl

Bad utterances are excluded and listed (every one, with file and line, on stderr and in the
report file), and so are transcripts the tokenizer cannot encode without <unk>; --strict makes
any problem fatal (exit 2).
"""

from __future__ import annotations

import argparse
import os
import sys

from rnnt.data.manifest import read_manifest_entries
from rnnt.data.tokenizer import Tokenizer
from rnnt.errors import reports_user_errors
from rnnt.prep.manifests import build_manifest, tokenize, write_manifest


@reports_user_errors
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--dataset-dir", required=True, help="dataset root (manifest paths are relative to it)"
    )
    source = ap.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--splits", nargs="+", help="split directories under the root, e.g. dev-clean"
    )
    source.add_argument("--from-manifest", help="existing manifest to tokenize (needs --tokenizer)")
    ap.add_argument("--output", required=True, help="manifest to write (.jsonl)")
    ap.add_argument("--tokenizer", help="SentencePiece .model: store token ids per utterance")
    ap.add_argument("--max-duration", type=float, help="drop longer utterances (train manifests)")
    ap.add_argument("--convert-to-wav", action="store_true", help="decode FLAC into <split>-wav/")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--strict", action="store_true", help="fail on any validation problem")
    ap.add_argument(
        "--full-decode",
        action="store_true",
        help="decode every sample to find corruption inside files (default: header + tail)",
    )
    ap.add_argument("--report", help="full problem list (default: <output>.report.txt)")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)

    tokenizer = Tokenizer(args.tokenizer) if args.tokenizer else None
    if args.from_manifest:
        if tokenizer is None:
            ap.error("--from-manifest needs --tokenizer")
        entries = read_manifest_entries(args.from_manifest, args.dataset_dir)
        utts, report = tokenize([u for _, u in entries], tokenizer, [w for w, _ in entries])
        if args.strict and report.problems:
            raise report.strict_error(args.from_manifest, "out-of-vocabulary transcripts")
        write_manifest(args.output, utts, args.dataset_dir)
        print(f"{args.output}: {len(utts)} utterances with token ids ({args.tokenizer})")
        return _report(report, args)
    utts, report = build_manifest(
        args.dataset_dir,
        args.splits,
        tokenizer=tokenizer,
        max_duration=args.max_duration,
        convert_to_wav=args.convert_to_wav,
        workers=args.workers,
        strict=args.strict,
        full_decode=args.full_decode,
        progress=not args.no_progress,
    )
    write_manifest(args.output, utts)
    print(f"{args.output}: {', '.join(args.splits)}")
    return _report(report, args)


def _report(report, args: argparse.Namespace) -> int:
    """Every problem on stderr, the summary on stdout, the full list in the report file."""
    for problem in report.problems:
        print(problem, file=sys.stderr)
    report_path = args.report or f"{args.output}.report.txt"
    report.write(report_path)
    print(report.summary())
    print(f"full list of exclusions and drops: {report_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
