"""Check a run's logged throughput against the wall clock of its own metrics file.

Every train record of `metrics.jsonl` gives the utterances per second of the window since the
previous record (`window_steps` steps, `utts_per_s`, `step_ms`), and its `time` stamp. Within an
epoch, consecutive stamps are one window apart, so the wall clock gives the same throughput a
second way: utterances of the window / (time - previous time). (On a GPU a record is written
once the next step is queued, when its own step has ended: its stamp lags that end by however
long the host took to get there, which the median absorbs.) The first window of each epoch
follows the evaluation and is left out. Prints one line per epoch and the median ratio of
logged to wall-clock throughput; exits 1 when it is off by more than --tolerance.

    python bench/log_truth.py results/metrics.jsonl --batch 192
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from rnnt.run_log import read_metrics


def compare(records: list[dict], global_batch: int) -> list[dict]:
    """Per window after the first of its epoch: logged and wall-clock utts/s."""
    rows = []
    train = [r for r in records if r["kind"] == "train"]
    for prev, cur in zip(train, train[1:]):
        if cur["epoch"] != prev["epoch"]:
            continue
        wall = cur["time"] - prev["time"]
        utterances = cur["window_steps"] * global_batch
        rows.append(
            {
                "epoch": cur["epoch"],
                "step": cur["step"],
                "logged": cur["utts_per_s"],
                "wall": utterances / wall,
                "ratio": cur["utts_per_s"] / (utterances / wall),
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("metrics", type=Path)
    parser.add_argument("--batch", type=int, required=True, help="the global batch size")
    parser.add_argument("--tolerance", type=float, default=0.02)
    args = parser.parse_args(argv)
    rows = compare(read_metrics(args.metrics), args.batch)
    if not rows:
        print("no window to compare (each epoch needs two log points)")
        return 1
    for epoch in sorted({r["epoch"] for r in rows}):
        part = [r for r in rows if r["epoch"] == epoch]
        print(
            f"epoch {epoch}: {len(part)} windows, logged median "
            f"{statistics.median(r['logged'] for r in part):.1f} utt/s, wall clock median "
            f"{statistics.median(r['wall'] for r in part):.1f} utt/s"
        )
    ratio = statistics.median(r["ratio"] for r in rows)
    worst = max(rows, key=lambda r: abs(r["ratio"] - 1))
    print(
        f"logged / wall clock: median {ratio:.4f}, worst {worst['ratio']:.4f} "
        f"(epoch {worst['epoch']} step {worst['step']})"
    )
    return 0 if abs(ratio - 1) <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
