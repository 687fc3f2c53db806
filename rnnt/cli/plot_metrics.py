"""Draw the training loss (with the learning rate) and the dev WER of a run to a PNG.

python scripts/plot_metrics.py results/metrics.jsonl [--out results/metrics.png]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on training machines
import matplotlib.pyplot as plt

from rnnt.run_log import read_metrics


def _numeric(records: list[dict], x: str, y: str) -> tuple[list[float], list[float]]:
    """(x, y) pairs where y is a number ("nan"/"inf" strings are left out)."""
    pairs = [
        (r[x], r[y])
        for r in records
        if isinstance(r.get(y), (int, float)) and isinstance(r.get(x), (int, float))
    ]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def plot(records: list[dict], out: Path) -> None:
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    fig, (ax_loss, ax_wer) = plt.subplots(1, 2, figsize=(12, 4.5))

    steps, losses = _numeric(train, "step", "loss")
    ax_loss.plot(steps, losses, color="tab:blue", label="train loss")
    ax_loss.set_xlabel("optimizer step")
    ax_loss.set_ylabel("loss (mean per-utterance NLL)")
    if losses and min(losses) > 0:
        ax_loss.set_yscale("log")
    ax_lr = ax_loss.twinx()
    lr_steps, lrs = _numeric(train, "step", "lr")
    ax_lr.plot(lr_steps, lrs, color="tab:orange", linestyle="--", label="learning rate")
    ax_lr.set_ylabel("learning rate")
    ax_loss.set_title("training")
    lines = ax_loss.get_lines() + ax_lr.get_lines()
    ax_loss.legend(lines, [line.get_label() for line in lines], loc="upper right")

    epochs, wers = _numeric(evals, "epoch", "wer")
    ax_wer.plot(epochs, [100 * w for w in wers], marker="o", color="tab:green", label="dev WER")
    ax_wer.axhline(5.8, color="tab:red", linestyle=":", label="MLPerf target 5.8%")
    ax_wer.set_xlabel("epoch")
    ax_wer.set_ylabel("WER (%)")
    ax_wer.set_title("evaluation (EMA weights)")
    ax_wer.legend(loc="upper right")

    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("metrics", type=Path, help="metrics.jsonl written by training")
    parser.add_argument("--out", type=Path, default=None, help="PNG (default: beside METRICS)")
    args = parser.parse_args(argv)
    if not args.metrics.is_file():
        print(f"error: metrics file not found: {args.metrics}", file=sys.stderr)
        return 2
    try:
        records = read_metrics(args.metrics)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    out = args.out or args.metrics.with_suffix(".png")
    plot(records, out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
