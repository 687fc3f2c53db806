"""Project a full run's time to train from a short run's MLPerf log.

The timed region of an MLPerf run goes from `run_start` to `run_stop`: every epoch's training,
then its evaluation and whatever else the loop does between two epochs (checkpoints, the
sampler's next plan). A short run (synthetic batches at real lengths, a few hundred steps per
epoch) measures each part on the machine at hand; the projection scales them to the full
training set and the epochs a converging run takes:

    per step     = median over epochs of (epoch_stop - epoch_start) / steps in that epoch
    per epoch    = per step x floor(train utterances / global batch)
    between      = median over epochs of the rest of each epoch's cycle (evaluation included)
    time to train = epochs x (per epoch + between)

The first epoch is left out of the medians when there are others: it pays for warm-up (cuDNN
plans, allocator growth). Initialization (`init_start` to `run_start`: graph capture, kernel
builds) is outside MLPerf's timed region and is printed beside it.

    python bench/project_ttt.py results/run --epochs 49 --train-utterances 278528

Defaults: 49 epochs (the RCP mean at a global batch of 1536) and NVIDIA's epoch of 278,528
utterances (docs/SPEC.md, "Published results").
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from rnnt.run_log import read_metrics

PUBLISHED_MINUTES = {"NVIDIA 3.1, 8 x H100 (mean of 10)": 16.7, "fastest published, 8 x H100": 16.2}


def read_mlperf_log(path: Path) -> list[dict]:
    """The `:::MLLOG {...}` events of a log, in order; other lines are skipped."""
    events = []
    for lineno, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.startswith(":::MLLOG "):
            continue
        try:
            events.append(json.loads(line[len(":::MLLOG ") :]))
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{lineno}: not an MLPerf log event ({err.msg})") from None
    return events


@dataclass
class Measured:
    """What the short run measured, in seconds."""

    global_batch: int
    epochs: list[int]
    steps: dict[int, int]  # steps per epoch
    train_s: dict[int, float]  # epoch_start -> epoch_stop
    cycle_s: dict[int, float]  # epoch_start -> the next epoch_start (or run_stop)
    eval_s: dict[int, float]  # eval_start -> eval_stop
    init_s: float  # init_start -> run_start
    timed_s: float  # run_start -> run_stop

    def _typical(self, values: dict[int, float]) -> float:
        later = [values[e] for e in self.epochs[1:]] or [values[self.epochs[0]]]
        return statistics.median(later)

    @property
    def step_s(self) -> float:
        return self._typical({e: self.train_s[e] / self.steps[e] for e in self.epochs})

    @property
    def between_s(self) -> float:
        return self._typical({e: self.cycle_s[e] - self.train_s[e] for e in self.epochs})

    @property
    def evaluation_s(self) -> float:
        return self._typical(self.eval_s)


def measure(run_dir: Path) -> Measured:
    events = read_mlperf_log(run_dir / "mlperf.log")

    def times(key: str) -> dict[int | None, float]:
        out = {}
        for ev in events:
            if ev["key"] == key:
                out[(ev.get("metadata") or {}).get("epoch_num")] = ev["time_ms"] / 1e3
        return out

    starts, stops = times("epoch_start"), times("epoch_stop")
    eval_starts, eval_stops = times("eval_start"), times("eval_stop")
    (run_start,), (run_stop,) = times("run_start").values(), times("run_stop").values()
    (init_start,) = times("init_start").values()
    (global_batch,) = [ev["value"] for ev in events if ev["key"] == "global_batch_size"]
    epochs = sorted(e for e in stops if e in starts and e in eval_stops)
    if not epochs:
        raise ValueError(f"{run_dir / 'mlperf.log'}: no complete epoch")
    last_step: dict[int, int] = {}
    for record in read_metrics(run_dir / "metrics.jsonl"):
        if record["kind"] == "train":
            last_step[record["epoch"]] = max(last_step.get(record["epoch"], 0), record["step"])
    steps = {e: last_step[e] - last_step.get(e - 1, 0) for e in epochs}
    next_start = {e: starts.get(e + 1, run_stop) for e in epochs}
    return Measured(
        global_batch=int(global_batch),
        epochs=epochs,
        steps=steps,
        train_s={e: stops[e] - starts[e] for e in epochs},
        cycle_s={e: next_start[e] - starts[e] for e in epochs},
        eval_s={e: eval_stops[e] - eval_starts[e] for e in epochs},
        init_s=run_start - init_start,
        timed_s=run_stop - run_start,
    )


def project(m: Measured, epochs: int, train_utterances: int) -> dict[str, float]:
    steps_per_epoch = train_utterances // m.global_batch
    epoch_s = m.step_s * steps_per_epoch
    return {
        "steps_per_epoch": steps_per_epoch,
        "step_s": m.step_s,
        "epoch_s": epoch_s,
        "between_s": m.between_s,
        "evaluation_s": m.evaluation_s,
        "time_to_train_s": epochs * (epoch_s + m.between_s),
        "init_s": m.init_s,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="a run's output folder (mlperf.log, metrics)")
    parser.add_argument("--epochs", type=int, default=49, help="epochs the full run takes")
    parser.add_argument(
        "--train-utterances",
        type=int,
        default=278_528,
        help="utterances of one epoch of the full training set",
    )
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    args = parser.parse_args(argv)
    try:
        m = measure(args.run_dir)
    except (OSError, ValueError, KeyError) as err:
        print(f"error: {args.run_dir}: {err}", file=sys.stderr)
        return 2
    p = project(m, args.epochs, args.train_utterances)
    minutes = p["time_to_train_s"] / 60
    print(
        f"measured: {len(m.epochs)} epoch(s) of {sorted(set(m.steps.values()))} steps at global "
        f"batch {m.global_batch}; timed region {m.timed_s:.1f} s, initialization {m.init_s:.1f} s"
    )
    print(
        f"per step {p['step_s'] * 1e3:.1f} ms x {p['steps_per_epoch']} steps "
        f"({args.train_utterances} // {m.global_batch}) = {p['epoch_s']:.1f} s per epoch"
    )
    print(f"between epochs {p['between_s']:.2f} s (evaluation {p['evaluation_s']:.2f} s of it)")
    print(
        f"time to train = {args.epochs} x ({p['epoch_s']:.1f} + {p['between_s']:.2f}) s "
        f"= {p['time_to_train_s']:.0f} s = {minutes:.1f} min, plus {m.init_s:.0f} s of "
        "initialization outside the timed region"
    )
    for name, published in PUBLISHED_MINUTES.items():
        print(f"  {name}: {published} min ({minutes / published:.2f}x)")
    if args.json:
        args.json.write_text(json.dumps({**p, "epochs": args.epochs}, indent=1) + "\n")
    return 0 if math.isfinite(p["time_to_train_s"]) else 1


if __name__ == "__main__":
    sys.exit(main())
