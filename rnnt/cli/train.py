"""Train the MLPerf RNN-T.

python train.py configs/tiny.yaml
torchrun --nproc_per_node 8 train.py configs/baseline_v3-1023sp.yaml --num_cg 4
python train.py CONFIG --set training.batch_size=64 --set optimizer.preset=gbs512 --resume
python train.py CONFIG --init-from results/a/checkpoints/ckpt_e8 --set training.seed=2 \
    --set training.output_dir=results/b

Exit status: 0 when the run reached training.target_wer, or ran all its epochs with the
target off (0); 1 when it ran all its epochs without reaching the target; 2 for a mistake in
what it was given (one `error:` line); 3 when the loss stayed non-finite; 75 when preempted
(state saved, rerun with --resume).
"""

from __future__ import annotations

import argparse
import sys

from rnnt.config import add_config_args, load_config
from rnnt.errors import reports_user_errors

EXIT_TARGET_MISSED = 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    add_config_args(parser)
    parser.add_argument(
        "--num_cg",
        type=int,
        default=None,
        help="CUDA graphs per network, same as --set training.num_cg=N",
    )
    fresh = parser.add_mutually_exclusive_group()
    fresh.add_argument(
        "--resume",
        action="store_true",
        help="continue the run of output_dir from its newest complete checkpoint",
    )
    fresh.add_argument(
        "--overwrite",
        action="store_true",
        help="start a fresh run in an output_dir that holds another run's checkpoints, "
        "deleting them (without it, such a run is refused)",
    )
    parser.add_argument(
        "--init-from",
        metavar="CHECKPOINT",
        default=None,
        help="start this fresh run where another run's checkpoint directory left off (its "
        "weights, optimizer, EMA, epoch, step and data order), with this run's own seed for "
        "dropout and augmentation; not with --resume",
    )
    parser.add_argument(
        "--device",
        default="auto",
        choices=["auto", "cuda", "cpu"],
        help="where to train (auto: CUDA when this machine has it, else the CPU)",
    )
    parser.add_argument(
        "--mlperf-log", default=None, help="MLPerf log file (default: OUTPUT_DIR/mlperf.log)"
    )
    parser.add_argument("--org", default="rnnt-open", help="MLPerf submitter organization")
    parser.add_argument("--platform", default="unspecified", help="MLPerf platform, e.g. 8xH100")
    parser.add_argument(
        "--cache-cleared",
        action="store_true",
        help="the launcher dropped the file-system caches before this run",
    )
    return parser


def check_init_from(path: str, resume: bool, output_dir: str) -> None:
    """--init-from names a complete checkpoint outside the new run's folder (a fresh run with
    --overwrite deletes the checkpoints there before it would read them)."""
    from pathlib import Path

    from rnnt.checkpoint import open_checkpoint
    from rnnt.errors import UserError

    if resume:
        raise UserError("--init-from starts a fresh run; --resume continues one: pass one")
    checkpoint = open_checkpoint(path)
    out = Path(output_dir).resolve()
    if checkpoint.path.resolve().is_relative_to(out):
        raise UserError(
            f"--init-from {path}: lies inside training.output_dir {output_dir}; start the new "
            "run in another training.output_dir"
        )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


@reports_user_errors
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    overrides = list(args.overrides)
    if args.num_cg is not None:
        overrides.append(f"training.num_cg={args.num_cg}")
    cfg = load_config(args.config, overrides)
    if args.init_from is not None:
        check_init_from(args.init_from, args.resume, cfg.training.output_dir)

    # torch and the training stack load only once the command line is known to be good
    from pathlib import Path

    from rnnt.distributed import init_distributed, shutdown
    from rnnt.mlperf import MLPerfLogger
    from rnnt.preemption import (
        EXIT_PREEMPTED,
        Preempted,
        PreemptionFlag,
        clear_preempted,
        mark_preempted,
    )
    from rnnt.run_dir import prepare_output_dir
    from rnnt.run_log import METRICS_FILE
    from rnnt.trainer import NonFiniteLossError, Trainer

    ctx = init_distributed(args.device, cfg.training.collective_timeout_s)
    try:
        out = prepare_output_dir(
            cfg.training.output_dir, args.resume, args.overwrite, is_main=ctx.is_main
        )
        preemption = PreemptionFlag().install()
        log_path = args.mlperf_log or str(out / "mlperf.log")
        if ctx.is_main:
            clear_preempted(out)
            Path(log_path).parent.mkdir(parents=True, exist_ok=True)
            if not args.resume:  # a fresh run starts its logs afresh
                Path(log_path).unlink(missing_ok=True)  # one run per MLPerf log
                (out / METRICS_FILE).unlink(missing_ok=True)
        mlperf = MLPerfLogger(log_path, ctx.rank)
        mlperf.submission_info(
            org=args.org, platform=args.platform, division="closed", status="onprem"
        )
        mlperf.cache_clear(args.cache_cleared)
        mlperf.init_start()
        trainer = Trainer(cfg, ctx, mlperf, resume=args.resume)
        trainer.preemption = preemption
        if args.resume and not trainer.resume():
            trainer.log.info(f"--resume: no checkpoint in {out}, starting fresh")
        if args.init_from is not None:
            trainer.start_from(args.init_from)
        reached = trainer.fit()
    except NonFiniteLossError as err:
        print(f"error: {err}", file=sys.stderr)
        return 3
    except Preempted as err:
        if ctx.is_main:
            mark_preempted(out, str(err))
        print(f"preempted: state saved in {err}; rerun with --resume", file=sys.stderr)
        return EXIT_PREEMPTED
    finally:
        shutdown(ctx)
    target = cfg.training.target_wer
    if ctx.is_main:
        verdict = (
            f"target {'reached' if reached else 'NOT reached'} (dev WER {target})"
            if target > 0
            else "no target (training.target_wer: 0), every epoch run"
        )
        print(
            f"run {trainer.run_id}: {verdict}; MLPerf log: {log_path}; "
            f"metrics: {out / METRICS_FILE}; checkpoints: {out / 'checkpoints'}"
        )
    return 0 if reached or target == 0 else EXIT_TARGET_MISSED


if __name__ == "__main__":
    sys.exit(main())
