"""Score a checkpoint: greedy-decode a manifest and print its WER and throughput.

python eval.py configs/tiny.yaml results/tiny/checkpoints/ckpt_e<E>_s<S>
python eval.py CONFIG CKPT --mode cg_unroll_pipeline --manifest dev.jsonl --weights model
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rnnt.config import add_config_args, load_config
from rnnt.errors import UserError, reports_user_errors


def build_parser() -> argparse.ArgumentParser:
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
    parser.add_argument(
        "--weights",
        choices=["ema", "model"],
        default="ema",
        help="score the EMA of the weights (what the training run's evaluations score) or "
        "the raw trained weights",
    )
    parser.add_argument(
        "--manifest",
        action="append",
        default=None,
        help="manifest(s) to score (default: data.val_manifests)",
    )
    parser.add_argument(
        "--output", default=None, help="hypotheses JSON lines (default: next to the checkpoint)"
    )
    parser.add_argument(
        "--device",
        default="auto",
        choices=["auto", "cuda", "cpu"],
        help="where to decode (auto: CUDA when this machine has it, else the CPU)",
    )
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


@reports_user_errors
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    overrides = list(args.overrides)
    if args.mode:
        overrides.append(f"eval.mode={args.mode}")
    if args.manifest:
        overrides.append(f"data.val_manifests={json.dumps(args.manifest)}")
    cfg = load_config(args.config, overrides)

    # torch loads only once the command line is known to be good
    from rnnt.distributed import init_distributed
    from rnnt.evaluation import load_for_eval, score

    ctx = init_distributed(args.device)
    setup = load_for_eval(cfg, args.checkpoint, ctx, weights=args.weights)
    setup.announce(ctx)
    if ctx.is_main:
        print(setup.inputs.summary())
        for problem in setup.inputs.problems:
            print(f"excluded: {problem}")
    result = score(setup, ctx)
    output = Path(args.output) if args.output else Path(args.checkpoint).with_suffix(".hyps.jsonl")
    if ctx.is_main:
        try:
            with output.open("w") as fh:
                for utt_id, hyp, ref in result.rows:
                    row = {"utt_id": utt_id, "hypothesis": hyp, "reference": ref}
                    fh.write(json.dumps(row) + "\n")
        except OSError as err:
            raise UserError(f"--output {output}: cannot write ({err.strerror or err})") from None
        print(f"utterances: {result.utterances}  words: {result.words}  errors: {result.errors}")
        print(
            f"throughput: {result.utterances_per_second:.1f} utterances/s "
            f"({result.seconds:.2f} s, {result.data_seconds:.2f} s of it waiting for data, "
            f"mode {cfg.eval.mode})"
        )
        print(f"hypotheses: {output}")
        print(f"WER: {result.wer:.6f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
