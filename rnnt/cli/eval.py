"""Score a checkpoint: greedy-decode a manifest and print its WER and throughput.

python eval.py configs/tiny.yaml results/tiny/checkpoints/ckpt_e<E>_s<S>
python eval.py CONFIG CKPT --mode cg_unroll_pipeline --manifest dev.jsonl --weights model
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rnnt.config import ConfigError, add_config_args, load_config_or_exit


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    add_config_args(parser)
    parser.add_argument(
        "checkpoint", help="a checkpoint directory written by train.py (ckpt_e<E>_s<S>)"
    )
    parser.add_argument(
        "--mode",
        choices=["no_cg", "cg", "cg_unroll_pipeline"],
        default=None,
        help="decoder (default: eval.mode of the config)",
    )
    parser.add_argument("--weights", choices=["ema", "model"], default="ema")
    parser.add_argument(
        "--manifest",
        action="append",
        default=None,
        help="manifest(s) to score (default: data.val_manifests)",
    )
    parser.add_argument(
        "--output", default=None, help="hypotheses JSON lines (default: next to the checkpoint)"
    )
    parser.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    overrides = list(args.overrides)
    if args.mode:
        overrides.append(f"eval.mode={args.mode}")
    if args.manifest:
        overrides.append(f"data.val_manifests={json.dumps(args.manifest)}")
    cfg = load_config_or_exit(args.config, overrides)

    from rnnt.checkpoint import CheckpointError
    from rnnt.distributed import init_distributed
    from rnnt.evaluation import load_for_eval, score

    ctx = init_distributed(args.device)
    try:
        setup = load_for_eval(cfg, args.checkpoint, ctx, weights=args.weights)
    except (ConfigError, CheckpointError, FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    setup.announce(ctx)
    result = score(setup, ctx)
    output = Path(args.output) if args.output else Path(args.checkpoint).with_suffix(".hyps.jsonl")
    if ctx.is_main:
        with output.open("w") as fh:
            for utt_id, hyp, ref in result.rows:
                fh.write(json.dumps({"utt_id": utt_id, "hypothesis": hyp, "reference": ref}) + "\n")
        print(f"utterances: {result.utterances}  words: {result.words}  errors: {result.errors}")
        print(
            f"throughput: {result.utterances_per_second:.1f} utterances/s "
            f"({result.seconds:.2f} s, mode {cfg.eval.mode})"
        )
        print(f"hypotheses: {output}")
        print(f"WER: {result.wer:.6f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
