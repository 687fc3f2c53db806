"""Train the MLPerf RNN-T.

python train.py configs/tiny.yaml
torchrun --nproc_per_node 8 train.py configs/baseline_v3-1023sp.yaml --num_cg 4
python train.py CONFIG --set training.batch_size=64 --set optimizer.preset=gbs512 --resume
"""

from __future__ import annotations

import argparse
import sys

from rnnt.config import ConfigError, add_config_args, load_config_or_exit
from rnnt.distributed import init_distributed, shutdown


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    add_config_args(parser)
    parser.add_argument(
        "--num_cg",
        type=int,
        default=None,
        help="CUDA graphs per network, same as --set training.num_cg=N",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest complete checkpoint in output_dir",
    )
    parser.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
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
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    overrides = list(args.overrides)
    if args.num_cg is not None:
        overrides.append(f"training.num_cg={args.num_cg}")
    cfg = load_config_or_exit(args.config, overrides)

    from pathlib import Path

    from rnnt.mlperf import MLPerfLogger
    from rnnt.preemption import EXIT_PREEMPTED, Preempted, PreemptionFlag
    from rnnt.run_log import METRICS_FILE
    from rnnt.trainer import NonFiniteLossError, Trainer

    ctx = init_distributed(args.device, cfg.training.collective_timeout_s)
    preemption = PreemptionFlag().install()
    log_path = args.mlperf_log or str(Path(cfg.training.output_dir) / "mlperf.log")
    if ctx.is_main:
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        if not args.resume:  # a fresh run starts its logs afresh (checkpoints are kept)
            Path(log_path).unlink(missing_ok=True)  # one run per MLPerf log
            (Path(cfg.training.output_dir) / METRICS_FILE).unlink(missing_ok=True)
    mlperf = MLPerfLogger(log_path, ctx.rank)
    mlperf.submission_info(org=args.org, platform=args.platform, division="closed", status="onprem")
    mlperf.cache_clear(args.cache_cleared)
    mlperf.init_start()
    try:
        trainer = Trainer(cfg, ctx, mlperf, resume=args.resume)
        trainer.preemption = preemption
        if args.resume and not trainer.resume():
            trainer.log.info(
                f"--resume: no checkpoint in {cfg.training.output_dir}, starting fresh"
            )
        reached = trainer.fit()
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except NonFiniteLossError as err:
        print(f"error: {err}", file=sys.stderr)
        return 3
    except Preempted as err:
        print(f"preempted: state saved in {err}; rerun with --resume", file=sys.stderr)
        return EXIT_PREEMPTED
    finally:
        shutdown(ctx)
    if ctx.is_main:
        out = Path(cfg.training.output_dir)
        print(
            f"target {'reached' if reached else 'NOT reached'}; "
            f"MLPerf log: {log_path}; metrics: {out / 'metrics.jsonl'}; "
            f"checkpoints: {out / 'checkpoints'}"
        )
    return 0 if reached else 1


if __name__ == "__main__":
    sys.exit(main())
