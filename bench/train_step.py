r"""Training-step throughput of the real Trainer on synthetic batches at LibriSpeech lengths.

For each (per-GPU batch size, num_cg) this builds `rnnt.trainer.Trainer` from the config with
`data.backend: synthetic` (noise features at the lengths and token counts of a LibriSpeech
table, SpecAugment on the device) and runs `Trainer.train_step`, the step `train.py` runs:
forward, loss, backward, gradient all-reduce, non-finite check, loss scale, LAMB, EMA. The steps
are queued back to back with no host sync between them, as in training; CUDA events recorded
by the Trainer at the parts of each step (`Trainer.parts`) give

- the step time: from one step's start to the next one's (median over the timed steps);
- joint + loss: the loss forward, plus the backward up to the gradients of the joint's inputs;
- the rest: everything else in the step (encoder and prediction, their backward, optimizer).

Also reported: utterances/s, peak memory, and model FLOP utilisation against a fp16 matrix
product timed in the same run (`rnnt.flops` counts the FLOPs from each utterance's lengths).
`--checkpoint-cost` times a full checkpoint of the trained state: the part a background save
blocks training for, and the write. Under torchrun every rank runs its steps (batch sizes are
per GPU) and rank 0 reports: its step time includes waiting for the collectives.
`--wave-variants F B` runs the wave LSTM kernels' launch variants F and B instead of the defaults:
a kernel change timed in the real step, against the defaults in the same call.
With several ranks it also reports the exposed communication: the time, per step, during
which the compute stream waits for the gradients' reduce-scatter (what the backward did not
hide) and for the weights' all-gather, from CUDA events recorded by the optimizer.

    python bench/train_step.py --batch-sizes 16 64 192 --num-cg 0 4 --json results/step.json
    torchrun --nproc_per_node 4 bench/train_step.py --batch-sizes 192 24 --num-cg 4
    python bench/train_step.py --device cpu --config configs/tiny.yaml --batch-sizes 4 --steps 2 \
        --set data.max_duration=4 --set model.n_classes=1024

(The CPU line is a smoke run: the batches come from the LibriSpeech length table, whose
transcripts need a vocabulary of more pieces than the tiny config's 24, and short utterances
keep it to seconds.)
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from rnnt.config import LENGTHS_DIR, add_override_arg, load_config
from rnnt.data.batch import FeatureBatch
from rnnt.distributed import DistContext, init_distributed, shutdown
from rnnt.kernels import lstm_wave
from rnnt.kernels.cuda_build import BuildError
from rnnt.model import resolve_encoder_lstm
from rnnt.optim.schedule import lr_at
from rnnt.throughput import StepParts
from rnnt.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]


def matmul_peak_flops(device: torch.device) -> float:
    """Measured dense matmul FLOP/s: fp16 8192^3 on the GPU (fp32 1024^3 on CPU, a smoke value)."""
    cuda = device.type == "cuda"
    n, dtype, reps = (8192, torch.float16, 20) if cuda else (1024, torch.float32, 3)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    for _ in range(3):
        torch.matmul(a, b, out=out)
    best = math.inf
    for _ in range(3):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            torch.matmul(a, b, out=out)
        if cuda:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 * reps / best


def at_average_lengths(fb: FeatureBatch, frames: int, tokens: int, vocab: int) -> FeatureBatch:
    """The batch with every utterance at the table's mean duration and token count: the shape
    at which per-step targets "at average LibriSpeech lengths" are stated."""
    b, dev = len(fb), fb.feats.device
    gen = torch.Generator(device=dev).manual_seed(0)
    feats = torch.randn(b, fb.feats.shape[1], frames, generator=gen, device=dev)
    ids = torch.randint(1, vocab, (b, tokens), generator=gen, device=dev)
    full = torch.full((b,), frames, dtype=torch.int64, device=dev)
    host = (torch.full((b,), frames), torch.full((b,), tokens))
    return FeatureBatch(
        feats, full, ids, torch.full_like(full, tokens), fb.utt_ids, fb.transcripts, host
    )


def build_trainer(args, batch_size: int, num_cg: int, ctx: DistContext) -> Trainer:
    steps = args.warmup + args.steps
    overrides = [
        "data.backend=synthetic",
        "data.tokenizer=",
        f"data.synthetic_train_lengths={args.lengths_tsv}",
        f"data.synthetic_steps_per_epoch={steps}",
        f"training.batch_size={batch_size}",
        "training.grad_accumulation=1",
        f"training.num_cg={num_cg}",
        f"training.output_dir={args.cache_dir}",
        "optimizer.allow_gbs_mismatch=true",  # a speed run at any batch size
        *args.overrides,
    ]
    if ctx.device.type != "cuda":
        overrides += ["training.precision=fp32"]
    cfg = load_config(args.config, overrides)
    return Trainer(cfg, ctx)


def run_steps(trainer: Trainer, args) -> tuple[list, float, float]:
    """Warm-up steps, then the timed ones; returns (per-step host seconds, the model FLOPs of
    the timed steps, the last step's loss)."""
    cfg = trainer.cfg
    loader = trainer.train_loader
    loader.set_epoch(1)
    steps_per_epoch = len(loader)
    average = None
    if args.average_lengths:
        src = loader.backend  # the synthetic source: its lengths table
        frames = int(src.frames(np.array([src.durations.mean()]), np.ones(1))[0])
        tokens = round(float(np.mean([len(t) for t in src.tokens])))
        average = (frames, tokens, cfg.model.n_classes - 1)
    cuda = trainer.ctx.device.type == "cuda"
    host_seconds, flops = [], 0
    for i, batch in enumerate(loader):
        if average is not None:
            batch = at_average_lengths(batch, *average)
        if i == args.warmup and cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            trainer.parts = StepParts()
        lr = lr_at(trainer.progress.step + 1, 1, steps_per_epoch, cfg.optimizer)
        t0 = time.perf_counter()
        loss = trainer.train_step(batch, lr)
        trainer.progress.step += 1
        if i >= args.warmup:
            host_seconds.append(time.perf_counter() - t0)
            flops += trainer.last_step_flops
    if cuda:
        torch.cuda.synchronize()
    return host_seconds, flops, float(loss)


def checkpoint_cost(trainer: Trainer) -> dict:
    """Seconds a background save holds training (the copy to host memory) at the first save
    and at a later one (which reuses the first one's pinned host memory), seconds until the
    file is written, and its size."""
    held = []
    for _ in range(2):
        t0 = time.perf_counter()
        path = trainer.save(background=True)
        held.append(time.perf_counter() - t0)
        trainer.checkpoints.wait()
        total = time.perf_counter() - t0
    return {
        "checkpoint_gb": sum(f.stat().st_size for f in path.glob("*.pt")) / 1e9,
        "checkpoint_first_blocking_s": held[0],
        "checkpoint_blocking_s": held[1],
        "checkpoint_total_s": total,
    }


def bench_one(args, ctx: DistContext, batch_size: int, num_cg: int, peak: float) -> dict:
    trainer = build_trainer(args, batch_size, num_cg, ctx)
    host_seconds, flops, last_loss = run_steps(trainer, args)
    parts = trainer.parts
    if parts is not None:
        starts = parts.events["start"]
        step_ms = [a.elapsed_time(b) for a, b in zip(starts, starts[1:])]
        step_ms.append(parts.milliseconds("start", "end")[-1])
        total_s = starts[0].elapsed_time(parts.events["end"][-1]) * 1e-3
        forward = parts.milliseconds("encoded", "loss")
        backward = parts.milliseconds("loss", "joint_grads")
        joint_ms = [a + b for a, b in zip(forward, backward)]
        rest_ms = [s - j for s, j in zip(step_ms, joint_ms)]
        # the compute stream blocked on communication: the wait for the gradients'
        # reduce-scatter (what the backward did not hide) and the weights' all-gather
        waits = [
            a + b
            for a, b in zip(
                parts.milliseconds("reduce_wait", "reduced"),
                parts.milliseconds("publish", "published"),
            )
        ]
        peak_mem = torch.cuda.max_memory_allocated() / 2**30
    else:  # CPU: every op is synchronous, so host time is the step time
        step_ms = [1e3 * s for s in host_seconds]
        total_s = sum(host_seconds)
        joint_ms = rest_ms = waits = None
        peak_mem = 0.0
    median = statistics.median(step_ms)
    accumulation = trainer.cfg.training.grad_accumulation  # a step: every micro-batch of it
    result = {
        "world_size": ctx.world_size,
        "batch_size": batch_size,
        "num_cg": num_cg,
        "overlap_grad_reduce": trainer.cfg.training.overlap_grad_reduce,
        "exposed_comm_ms": statistics.median(waits) if waits and ctx.enabled else None,
        # what ran ("wave/packed", "cudnn", ...), not the config's "auto"
        "encoder_lstm": resolve_encoder_lstm(trainer.cfg.model, ctx.device, batch_size)[0],
        "loss_backend": trainer.cfg.loss.backend,
        "steps": len(step_ms),
        "median_step_ms": median,
        "mean_step_ms": 1e3 * total_s / len(step_ms),
        "grad_accumulation": accumulation,
        "utts_per_s": ctx.world_size * batch_size * accumulation / (median * 1e-3),
        "median_joint_loss_ms": statistics.median(joint_ms) if joint_ms else None,
        "median_rest_ms": statistics.median(rest_ms) if rest_ms else None,
        "peak_memory_gib": peak_mem,
        "mfu": flops / total_s / peak,  # this rank's FLOPs against one GPU's peak
        "final_loss": last_loss,
        "skipped_steps": int(trainer.skipped_total),
        "loss_scale": trainer.scaler.get_scale(),
    }
    if trainer.graphs is not None:
        result["feat_buckets"] = trainer.graphs.feat_buckets
        result["token_buckets"] = trainer.graphs.token_buckets
    if args.checkpoint_cost:
        result.update(checkpoint_cost(trainer))
    return result


def print_table(rows: list[dict], peak: float) -> None:
    print(f"matmul peak: {peak / 1e12:.3f} TFLOP/s")
    print(
        f"{'gpus':>4} {'batch':>5} {'num_cg':>6} {'lstm':>11} {'step ms':>8} {'utts/s':>8} "
        f"{'joint+loss ms':>13} {'rest ms':>8} {'peak GiB':>8} {'MFU':>6} {'exposed comm':>12}"
    )
    for r in rows:
        joint = "-" if r["median_joint_loss_ms"] is None else f"{r['median_joint_loss_ms']:.2f}"
        rest = "-" if r["median_rest_ms"] is None else f"{r['median_rest_ms']:.2f}"
        comm = "-" if r["exposed_comm_ms"] is None else f"{r['exposed_comm_ms']:.3f} ms"
        print(
            f"{r['world_size']:>4} {r['batch_size']:>5} {r['num_cg']:>6} {r['encoder_lstm']:>11} "
            f"{r['median_step_ms']:>8.2f} {r['utts_per_s']:>8.1f} {joint:>13} {rest:>8} "
            f"{r['peak_memory_gib']:>8.2f} {r['mfu']:>6.1%} {comm:>12}"
        )
        if "checkpoint_gb" in r:
            print(
                f"      checkpoint: {r['checkpoint_gb']:.2f} GB, training held "
                f"{r['checkpoint_first_blocking_s']:.2f} s at the first save and "
                f"{r['checkpoint_blocking_s']:.2f} s at the next, written after "
                f"{r['checkpoint_total_s']:.2f} s"
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(ROOT / "configs/baseline_v3-1023sp.yaml"))
    add_override_arg(parser)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[16, 64, 192])
    parser.add_argument(
        "--num-cg",
        type=int,
        nargs="+",
        default=None,
        help="graph counts to compare (default: 0 4 on CUDA, 0 on CPU)",
    )
    parser.add_argument("--steps", type=int, default=20, help="timed steps per configuration")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument(
        "--lengths-tsv",
        default=str(LENGTHS_DIR / "librispeech_train-clean-5_lengths.tsv"),
        help="the LibriSpeech lengths table the batches are drawn from",
    )
    parser.add_argument(
        "--cache-dir",
        default=str(Path(tempfile.gettempdir()) / "rnnt-bench"),
        help="the runs' output_dir (holds the tokenizer trained on the table, and checkpoints)",
    )
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument(
        "--average-lengths",
        action="store_true",
        help="every utterance at the table's mean duration and token count (no padding)",
    )
    parser.add_argument(
        "--wave-variants",
        type=int,
        nargs=2,
        metavar=("FORWARD", "BACKWARD"),
        default=None,
        help="the wave kernels' launch variants (rnnt/kernels/lstm_wave.py: FORWARD_VARIANT), "
        "to time one against another in the real Trainer",
    )
    parser.add_argument(
        "--checkpoint-cost",
        action="store_true",
        help="also time a full checkpoint of the trained state (background and total)",
    )
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device (use --device cpu for a smoke run)")
    ctx = init_distributed(device.type)
    if args.num_cg is None:
        args.num_cg = [0, 4] if device.type == "cuda" else [0]
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")

    if args.wave_variants is not None:
        try:
            lstm_wave.use_variants(*args.wave_variants)
        except (ValueError, BuildError) as e:
            parser.error(f"--wave-variants: {e}")
    peak = matmul_peak_flops(ctx.device)
    rows = []
    for batch_size in args.batch_sizes:
        for num_cg in args.num_cg:
            rows.append(bench_one(args, ctx, batch_size, num_cg, peak))
            if device.type == "cuda":
                torch.cuda.empty_cache()
    shutdown(ctx)
    if not ctx.is_main:
        return 0
    print_table(rows, peak)
    if args.json:
        meta = {
            "config": args.config,
            "overrides": args.overrides,
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "world_size": ctx.world_size,
            "torch": torch.__version__,
            "lengths_tsv": args.lengths_tsv,
            "average_lengths": args.average_lengths,
            "wave_variants": args.wave_variants,
            "matmul_peak_tflops": peak / 1e12,
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"meta": meta, "results": rows}, indent=2) + "\n")
    return 0 if all(math.isfinite(r["final_loss"]) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
