"""Joint network + RNN-T loss, forward and backward: time and peak extra memory per backend.

    python bench/joint_loss.py [--backends torchaudio reference fused fused-packed:cublas
                               fused-packed] [--dtype fp16]
                               [--repeats 10] [--json results/bench_joint_loss.json]

Shapes (B, T, U) with T in encoder frames (after stack time): the typical MLPerf batch
(192, 204, 44), the longest (192, 279, 125), a small batch of the longest (32, 279, 125), and a
LibriSpeech-shaped ragged batch: 192 utterances drawn from the train-clean-5 length table
(durations <= 16.7 s), T = ceil(ceil(100 d / 3) / 2) (10 ms frames, splicing by 3, stack time 2),
U = transcript length in pieces of a 1023-piece tokenizer trained on those transcripts.

Each (backend, shape) runs in its own process, so an out-of-memory error or a CUDA fault (the
padded torchaudio joint at the longest shapes) is recorded in the table instead of ending the
run. Times are medians over `--repeats` of CUDA-event timings of loss + backward (all of f, g,
W, bias get gradients); memory is the peak allocated during those steps minus what was allocated
before (inputs, weights). The joint is in training mode (dropout 0.3) for every backend.
`fused` computes the padded (B, T_max, U_max + 1) box; `fused-packed` is the same backend given
the lengths on the host (as the trainer does), so it computes only the lattice cells. A
`:cublas` or `:sm90` suffix picks the fused backend's logits GEMM (`loss.fused_gemm`; 'auto'
without one: the sm90 kernel on Hopper GPUs, reported in the `gemm` column). `apex`
(NVIDIA's transducer joint + loss, packed; needs apex built with its transducer extensions) is
given the host lengths too.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
FIXED_SHAPES = {
    "192x204x44": (192, 204, 44),
    "192x279x125": (192, 279, 125),
    "32x279x125": (32, 279, 125),
}
RAGGED = "librispeech_ragged_192"
# The fused joint + loss's time target on an H200 at the typical MLPerf batch, fp16 (the size
# the performance work was judged by, docs/PERFORMANCE.md "Fused joint + loss at (192, 204,
# 44)"): the summary says whether each fused row meets it.
TARGET_MS = {"192x204x44": 12.0}
LENGTHS_TSV = ROOT / "rnnt" / "data" / "lengths" / "librispeech_train-clean-5_lengths.tsv"


def ragged_lengths(tsv: Path, batch: int, seed: int) -> list[tuple[int, int]]:
    """(T, U) of `batch` utterances sampled from a LibriSpeech length table."""
    from rnnt.data.text import normalize_transcript
    from rnnt.data.tokenizer import Tokenizer, train_tokenizer

    rows = []
    for line_no, line in enumerate(tsv.read_text().splitlines(), 1):
        if not line or line.startswith("#"):
            continue
        parts = line.split("\t")
        if len(parts) != 3:
            raise ValueError(f"{tsv}:{line_no}: expected 3 tab-separated fields")
        rows.append((float(parts[1]), normalize_transcript(parts[2])))
    rows = [r for r in rows if r[0] <= 16.7]
    with tempfile.TemporaryDirectory() as tmp:
        tok = Tokenizer(train_tokenizer([t for _, t in rows], Path(tmp) / "tok", 1023))
        picked = random.Random(seed).sample(rows, batch)
        return [
            (math.ceil(math.ceil(d * 100 / 3) / 2), len(tok.encode(text))) for d, text in picked
        ]


def run_one(
    backend: str, shape: str, dtype_name: str, repeats: int, warmup: int, lengths: Path
) -> dict:
    import torch

    from rnnt.config import ModelConfig
    from rnnt.loss import TransducerLoss
    from rnnt.model import Joint

    dtype = getattr(torch, DTYPES[dtype_name])
    dev = torch.device("cuda")
    if shape == RAGGED:
        lens = ragged_lengths(lengths, 192, seed=0)
    else:
        b, t, u = FIXED_SHAPES[shape]
        lens = [(t, u)] * b
    bsz = len(lens)
    t_max = max(t for t, _ in lens)
    u_max = max(u for _, u in lens)
    cfg = ModelConfig()
    torch.manual_seed(0)
    joint = Joint(cfg).to(dev, dtype).train()
    f = torch.randn(bsz, t_max, cfg.joint_n_hid, device=dev, dtype=dtype, requires_grad=True)
    g = torch.randn(bsz, u_max + 1, cfg.joint_n_hid, device=dev, dtype=dtype, requires_grad=True)
    f_lens = torch.tensor([t for t, _ in lens], device=dev)
    target_lens = torch.tensor([u for _, u in lens], device=dev)
    targets = torch.randint(0, cfg.blank_idx, (bsz, u_max), device=dev)
    # fused-packed: the fused backend given the lengths on the host (as the trainer does), so
    # it computes only the sum_b T_b (U_b + 1) lattice rows; plain fused computes the box.
    backend, _, gemm = backend.partition(":")
    packed = backend == "fused-packed"
    loss_fn = TransducerLoss("fused" if packed else backend, cfg.blank_idx, gemm or "auto")
    chosen, _ = loss_fn.prepare(joint)  # e.g. fused(gemm=sm90, walk=cuda)
    # apex packs either way; host lengths spare it the host sync that sizes its packing
    host = packed or backend == "apex"
    host_lens = ([t for t, _ in lens], [u for _, u in lens]) if host else None

    def step():
        loss = loss_fn(joint, f, g, f_lens, targets, target_lens, host_lens=host_lens)
        loss.backward()
        f.grad = g.grad = None
        joint.zero_grad(set_to_none=True)
        return loss

    for _ in range(warmup):
        loss = step()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeats):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        loss = step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    lattice = sum(t * (u + 1) for t, u in lens)
    return {
        "median_ms": times[len(times) // 2],
        "min_ms": times[0],
        "extra_gib": (torch.cuda.max_memory_allocated() - base) / 2**30,
        "loss": float(loss),
        "gemm": chosen.partition("gemm=")[2].partition(",")[0] or "-",
        "backend_choice": chosen,
        "lattice_cells": lattice,
        "padded_logits": bsz * t_max * (u_max + 1) * cfg.n_classes,
        "B": bsz,
        "T_max": t_max,
        "U_max": u_max,
    }


def worker(args) -> int:
    try:
        row = run_one(
            args.backend, args.shape, args.dtype, args.repeats, args.warmup, Path(args.lengths)
        )
        row["status"] = "ok"
    except Exception as err:  # recorded in the table; the parent goes on with the next case
        row = {"status": "error", "error": f"{type(err).__name__}: {str(err).splitlines()[0]}"}
        traceback.print_exc(file=sys.stderr)
    print("RESULT " + json.dumps(row), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--backends",
        nargs="+",
        default=["torchaudio", "reference", "fused", "fused-packed:cublas", "fused-packed"],
    )
    parser.add_argument("--shapes", nargs="+", default=[*FIXED_SHAPES, RAGGED])
    parser.add_argument("--dtype", choices=DTYPES, default="fp16")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per case")
    parser.add_argument("--json", default="results/bench_joint_loss.json")
    parser.add_argument("--lengths", default=str(LENGTHS_TSV), help="length table (ragged)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--backend", help=argparse.SUPPRESS)
    parser.add_argument("--shape", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    for shape in args.shapes:
        if shape not in FIXED_SHAPES and shape != RAGGED:
            parser.error(f"unknown shape {shape!r} (choose from {[*FIXED_SHAPES, RAGGED]})")

    import torch
    import triton

    if not torch.cuda.is_available():
        print("error: this benchmark needs a CUDA device", file=sys.stderr)
        return 2
    rows = []
    for shape in args.shapes:
        for backend in args.backends:
            cmd = [
                sys.executable,
                __file__,
                "--worker",
                "--backend",
                backend,
                "--shape",
                shape,
                "--dtype",
                args.dtype,
                "--repeats",
                str(args.repeats),
                "--warmup",
                str(args.warmup),
                "--lengths",
                args.lengths,
            ]
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
                lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
                if lines:
                    row = json.loads(lines[-1][len("RESULT ") :])
                else:
                    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
                    row = {"status": "error", "error": f"exit {proc.returncode}: {tail}"}
            except subprocess.TimeoutExpired:
                row = {"status": "error", "error": f"timed out after {args.timeout:.0f} s"}
            row.update(backend=backend, shape=shape, dtype=args.dtype)
            if backend.startswith("fused") and shape in TARGET_MS and row.get("status") == "ok":
                row["target_ms"] = TARGET_MS[shape]
                row["meets_target"] = row["median_ms"] <= TARGET_MS[shape]
            rows.append(row)
            print(_format_row(row), flush=True)

    print()
    print(f"{'shape':<24} {'backend':<20} {'gemm':<7} {'median ms':>10} {'extra GiB':>10}  status")
    for row in rows:
        print(_format_row(row))
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "dtype": args.dtype,
        "repeats": args.repeats,
    }
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    for row in rows:
        if "target_ms" in row:
            verdict = "meets" if row["meets_target"] else "MISSES"
            print(
                f"{row['backend']} at {row['shape']}: {row['median_ms']:.2f} ms {verdict} the "
                f"{row['target_ms']:g} ms target ({meta['device']}, {args.dtype})"
            )
    print(f"wrote {out}")
    return 0


def _format_row(row: dict) -> str:
    if row.get("status") == "ok":
        return (
            f"{row['shape']:<24} {row['backend']:<20} {row['gemm']:<7} "
            f"{row['median_ms']:>10.2f} {row['extra_gib']:>10.3f}  ok"
        )
    return f"{row['shape']:<24} {row['backend']:<20} {'-':<7} {'-':>10} {'-':>10}  {row['error']}"


if __name__ == "__main__":
    sys.exit(main())
