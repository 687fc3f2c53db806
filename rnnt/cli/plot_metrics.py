"""Draw the training loss (with the learning rate) and the dev WER of runs to a PNG.

python scripts/plot_metrics.py results/metrics.jsonl [--out results/metrics.png]
python scripts/plot_metrics.py fast/metrics.jsonl plain/metrics.jsonl --labels fast plain \
    --out curves.png --table
python scripts/plot_metrics.py f1.jsonl f2.jsonl p1.jsonl p2.jsonl \
    --labels "fast s1" "fast s2" "plain s1" "plain s2" --band plain --out forks.png

Several runs are drawn over each other. `--table` prints, per epoch, each run's mean training
loss and its dev WER as a Markdown table; every call prints each run's summary (median step
time and data wait over its logged windows, last WER). `--band PREFIX` makes the runs whose
labels start with PREFIX a reference group: a third panel draws every other run's dev WER
relative to the group's mean, epoch by epoch, over the group's range, and the call prints how
many runs lie inside, above and below that range at each epoch. Runs that differ by chance
alone sit a point or less apart on the full scale, where no difference can be read. A run's
scores inside epochs (`training.eval_every_steps`) join its dev WER curve and the band at
fractional epochs; the table uses the epochs' own. `--paired PREFIX` pairs runs labelled
"GROUP sN" with "PREFIX sN" (the same seed, so the same batches) and prints how many steps
each group trails the PREFIX runs: per epoch in training loss, and in dev WER at each step
where all of them were scored.
"""

from __future__ import annotations

import argparse
import math
import re
import statistics
import sys
from pathlib import Path
from typing import NamedTuple

import matplotlib

matplotlib.use("Agg")  # files only: no display on training machines
import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from rnnt.run_log import read_metrics


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _numeric(records: list[dict], x: str, y: str) -> tuple[list[float], list[float]]:
    """(x, y) pairs where y is a number ("nan"/"inf" strings are left out)."""
    pairs = [(r[x], r[y]) for r in records if _is_number(r.get(y)) and _is_number(r.get(x))]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def _train(records: list[dict]) -> list[dict]:
    return [r for r in records if r["kind"] == "train"]


def _evals(records: list[dict]) -> list[dict]:
    return [r for r in records if r["kind"] == "eval"]


def _wers(records: list[dict]) -> dict[int, float]:
    return {r["epoch"]: r["wer"] for r in _evals(records) if _is_number(r.get("wer"))}


def mid_epoch_points(records: list[dict]) -> list[tuple[float, float]]:
    """(epoch, WER) of the run's `mid_epoch_eval` records (`training.eval_every_steps`), the
    epoch fractional: an epoch's own evaluation sits at its number, so a score after a third
    of epoch 10's steps at 9.33. The steps an epoch takes come from two epochs' evaluations;
    with fewer there is no scale, and no points."""
    ends = sorted((r["step"], r["epoch"]) for r in _evals(records) if _is_number(r.get("step")))
    if len(ends) < 2:
        return []
    (step0, epoch0), (step1, epoch1) = ends[-2], ends[-1]
    per_epoch = (step1 - step0) / (epoch1 - epoch0)
    return [
        (epoch1 + (r["step"] - step1) / per_epoch, r["wer"])
        for r in records
        if r["kind"] == "mid_epoch_eval" and _is_number(r.get("wer"))
    ]


class Band(NamedTuple):
    """The reference group of `--band`: the epochs (fractional inside epochs) at which every
    one of its runs was scored, and there its mean dev WER and the lowest and highest
    relative to that mean (%)."""

    epochs: list[float]
    mean: list[float]
    low: list[float]
    high: list[float]


def _scores(records: list[dict]) -> dict[float, float]:
    """epoch -> dev WER of every score of the run: the epochs' own at their numbers (int), the
    ones inside epochs at fractional epochs (`mid_epoch_points`, rounded so that runs scored
    at the same steps share them)."""
    points: dict[float, float] = dict(_wers(records))
    points.update((round(x, 6), wer) for x, wer in mid_epoch_points(records))
    return points


def _epoch_name(epoch: float) -> str:
    return str(epoch) if isinstance(epoch, int) else f"{epoch:.2f}"


def band(runs: dict[str, list[dict]], prefix: str) -> tuple[Band, dict[str, list[tuple]]]:
    """The group of runs labelled PREFIX..., and each other run's (epoch, dev WER relative to
    the group's mean in %) at the group's scores: its epochs, and the fractional epochs of
    scores inside them where every run of the group has one there. ValueError if fewer than
    two runs match or they share no score (with a WER above 0)."""
    group = {name: _scores(r) for name, r in runs.items() if name.startswith(prefix)}
    if len(group) < 2:
        raise ValueError(
            f"--band {prefix}: needs at least two runs labelled {prefix}..., got {len(group)}"
        )
    shared = sorted(set.intersection(*(set(w) for w in group.values())))
    # relative to a mean WER of 0 is undefined: such epochs are left out
    epochs = [e for e in shared if any(w[e] > 0 for w in group.values())]
    if not epochs:
        raise ValueError(f"--band {prefix}: its runs share no evaluated epoch with a WER above 0")
    mean = [statistics.fmean(w[e] for w in group.values()) for e in epochs]

    def relative(wer: float, m: float) -> float:
        return 100 * (wer / m - 1)

    low = [relative(min(w[e] for w in group.values()), m) for e, m in zip(epochs, mean)]
    high = [relative(max(w[e] for w in group.values()), m) for e, m in zip(epochs, mean)]
    others = {}
    for name, records in runs.items():
        if name in group:
            continue
        wers = _scores(records)
        others[name] = [
            (e, relative(wers[e], m)) for e, m in zip(epochs, mean, strict=True) if e in wers
        ]
    return Band(epochs, mean, low, high), others


def band_lines(prefix: str, ref: Band, others: dict[str, list[tuple]]) -> list[str]:
    """Per score of the band (an epoch, or a fractional epoch inside one): the group's mean
    and range, and how many other runs lie inside, above and below it."""
    lines = []
    for i, e in enumerate(ref.epochs):
        rel = [r for points in others.values() for ep, r in points if ep == e]
        above = sum(r > ref.high[i] for r in rel)
        below = sum(r < ref.low[i] for r in rel)
        lines.append(
            f"epoch {_epoch_name(e)}: {prefix} mean {100 * ref.mean[i]:.2f}% (range "
            f"{ref.low[i]:+.1f}% to {ref.high[i]:+.1f}%); others "
            f"{len(rel) - above - below} of {len(rel)} inside, "
            f"{above} above, {below} below"
        )
    return lines


def run_colors(names: list[str]) -> dict[str, tuple]:
    """One color per run, the same in every panel. Up to 10 runs take tab10's colors; beyond,
    tab20's ten dark shades come first and then its light ones, so runs 1 and 11 share a hue
    but not a shade (a cycle of ten gave them one color)."""
    if len(names) <= 10:
        palette = list(plt.get_cmap("tab10").colors)
    else:
        tab20 = plt.get_cmap("tab20").colors
        palette = list(tab20[0::2]) + list(tab20[1::2])
    return {name: palette[i % len(palette)] for i, name in enumerate(names)}


def figure(
    runs: dict[str, list[dict]],
    against: tuple[str, Band, dict[str, list[tuple]]] | None = None,
) -> Figure:
    """The loss and dev WER panels; with `against` ((prefix, *band(runs, prefix))), a third
    with the other runs' dev WER relative to that group. With several runs one legend below
    the panels names each run once, so that no legend covers the curves."""
    several = len(runs) > 1
    # the shared legend's rows: the runs, the learning rate, the target and the band, 6 a row
    legend_rows = -(-(len(runs) + 2 + bool(against)) // 6) if several else 0
    fig, axes = plt.subplots(
        1, 3 if against else 2, figsize=(18 if against else 12, 4.5 + 0.3 * legend_rows)
    )
    ax_loss, ax_wer = axes[:2]
    ax_lr = ax_loss.twinx()
    colors = run_colors(list(runs))
    for name, records in runs.items():
        steps, losses = _numeric(_train(records), "step", "loss")
        ax_loss.plot(steps, losses, color=colors[name], label=name if several else "train loss")
        epochs, wers = _numeric(_evals(records), "epoch", "wer")
        inside = mid_epoch_points(records)
        ax_wer.plot(
            epochs,
            [100 * w for w in wers],
            marker="o",
            linestyle="none" if inside else "-",  # the line runs through the scores inside
            color=colors[name],
            label=name if several else "dev WER",
        )
        if inside:
            points = sorted([*zip(epochs, wers), *inside])
            ax_wer.plot(
                [x for x, _ in points],
                [100 * w for _, w in points],
                marker=".",
                linewidth=0.8,
                color=colors[name],
            )
    first = next(iter(runs.values()))
    lr_steps, lrs = _numeric(_train(first), "step", "lr")
    ax_lr.plot(lr_steps, lrs, color="tab:gray", linestyle="--", label="learning rate")
    ax_lr.set_ylabel("learning rate")
    if all(v > 0 for line in ax_loss.get_lines() for v in line.get_ydata()) and any(
        len(line.get_ydata()) for line in ax_loss.get_lines()
    ):
        ax_loss.set_yscale("log")
    ax_loss.set_xlabel("optimizer step")
    ax_loss.set_ylabel("loss (mean per-utterance NLL)")
    ax_loss.set_title("training")
    ax_wer.axhline(5.8, color="tab:red", linestyle=":", label="MLPerf target 5.8%")
    ax_wer.set_xlabel("epoch")
    ax_wer.set_ylabel("WER (%)")
    ax_wer.set_title("evaluation (EMA weights)")
    extras = ax_lr.get_lines() + ax_wer.get_lines()[-1:]
    if against:
        band_of, ref, others = against
        ax_band = axes[2]
        shade = ax_band.fill_between(
            ref.epochs,
            ref.low,
            ref.high,
            color="tab:gray",
            alpha=0.3,
            label=f"{band_of} runs' range",
        )
        ax_band.axhline(0.0, color="tab:gray", linewidth=0.8)
        for name, points in others.items():
            ax_band.plot(
                [e for e, _ in points], [r for _, r in points], marker="o", color=colors[name]
            )
        ax_band.set_xlabel("epoch")
        ax_band.set_ylabel(f"dev WER relative to the {band_of} runs' mean (%)")
        ax_band.set_title(f"against the {band_of} runs")
        extras.append(shade)
    if several:
        handles = ax_loss.get_lines() + extras
        fig.legend(handles, [h.get_label() for h in handles], loc="lower center", ncol=6)
        height = fig.get_figheight()
        fig.tight_layout(rect=(0, (0.3 * legend_rows + 0.15) / height, 1, 1))
    else:
        lines = ax_loss.get_lines() + ax_lr.get_lines()
        ax_loss.legend(lines, [line.get_label() for line in lines], loc="upper right")
        ax_wer.legend(loc="upper right")
        if against:
            axes[2].legend(loc="best", fontsize="small")
        fig.tight_layout()
    return fig


def _seeded(label: str) -> tuple[str, str] | None:
    """("GROUP", "N") of a label "GROUP sN", else None."""
    found = re.fullmatch(r"(.+) s(\d+)", label)
    return (found.group(1), found.group(2)) if found else None


def _pair_by_seed(runs: dict[str, list[dict]], prefix: str, series) -> tuple[dict, dict]:
    """{seed: series(records)} of the "PREFIX sN" runs, and {group: {seed: ...}} of the other
    seeded runs; at least two reference seeds, or ValueError."""
    refs, groups = {}, {}
    for label, records in runs.items():
        if (parts := _seeded(label)) is None:
            continue
        group, seed = parts
        target = refs if group == prefix else groups.setdefault(group, {})
        target[seed] = series(records)
    if len(refs) < 2:
        raise ValueError(f"--paired {prefix}: needs runs labelled '{prefix} sN' for 2+ seeds")
    return refs, groups


def _mean_and_error(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) / len(values) ** 0.5


def paired_lag(runs: dict[str, list[dict]], prefix: str) -> list[str]:
    """`--paired PREFIX`: how many steps each group of runs trails the reference runs in
    training loss, epoch by epoch, then in dev WER at each step where they were scored.

    Labels "GROUP sN" pair runs by seed N: runs of one seed see the same batches, so the log
    ratio of two runs' losses at the steps both logged holds no batch-to-batch noise. Per
    epoch and group: the mean over seeds of each pair's mean log ratio (GROUP against
    "PREFIX sN"), its standard error over the seeds, and both divided by how fast the
    reference runs' log loss falls per step in that epoch, which turns a loss ratio into
    steps behind (negative: ahead). Epochs where the loss does not fall have no such scale.
    The dev WER lines (`paired_wer_lag`) do the same with the scores.
    """

    def losses(records: list[dict]) -> dict[int, tuple[int, float]]:
        return {
            r["step"]: (r["epoch"], r["loss"])
            for r in _train(records)
            if _is_number(r.get("loss")) and r["loss"] > 0 and _is_number(r.get("step"))
        }

    refs, groups = _pair_by_seed(runs, prefix, losses)
    lines = []
    for group, by_seed in groups.items():
        epochs = sorted({e for seed in by_seed for e, _ in by_seed[seed].values()})
        for epoch in epochs:
            ratios = []
            for seed, ours in by_seed.items():
                ref = refs.get(seed)
                steps = [k for k in ours if ours[k][0] == epoch and ref and k in ref]
                if steps:
                    ratios.append(statistics.fmean(math.log(ours[k][1] / ref[k][1]) for k in steps))
            slopes = []
            for ref in refs.values():
                steps = sorted(k for k, (e, _) in ref.items() if e == epoch)
                if len(steps) >= 2:
                    rise = math.log(ref[steps[-1]][1] / ref[steps[0]][1])
                    slopes.append(rise / (steps[-1] - steps[0]))
            if len(ratios) < 2 or not slopes:
                continue
            mean, error = _mean_and_error(ratios)
            slope = statistics.fmean(slopes)
            line = (
                f"{group} against {prefix}, epoch {epoch}: training loss {100 * mean:+.2f}% "
                f"(+-{100 * error:.2f}%, {len(ratios)} seeds)"
            )
            if slope < 0:
                line += f", {mean / -slope:+.1f} +- {error / -slope:.1f} steps behind"
            lines.append(line)
    return lines + paired_wer_lag(runs, prefix)


def paired_wer_lag(runs: dict[str, list[dict]], prefix: str) -> list[str]:
    """The dev WER half of `--paired PREFIX`: at each step where every reference run was
    scored (an epoch's evaluation, or one inside it with `training.eval_every_steps`), each
    group's mean difference in WER to the same seed's reference run, in points, its standard
    error over the seeds, and both divided by how fast the reference runs' mean WER falls per
    step there (from the scores before and after, one side at the ends) into steps behind.
    The dev set and the weights' state are all there is to a score, so a group that learns as
    the reference does but some steps later sits that many steps behind at every score; one
    that learns something else shows a gap that does not follow the slope."""

    def scores(records: list[dict]) -> dict[int, tuple[int, float]]:
        return {
            r["step"]: (r["epoch"], r["wer"])
            for r in records
            if r["kind"] in ("eval", "mid_epoch_eval")
            and _is_number(r.get("wer"))
            and _is_number(r.get("step"))
        }

    refs, groups = _pair_by_seed(runs, prefix, scores)
    steps = sorted(set.intersection(*(set(ref) for ref in refs.values())))
    if len(steps) < 2:
        return []
    ref_mean = {k: statistics.fmean(ref[k][1] for ref in refs.values()) for k in steps}
    lines = []
    for group, by_seed in groups.items():
        for i, step in enumerate(steps):
            gaps = [
                ours[step][1] - refs[seed][step][1]
                for seed, ours in by_seed.items()
                if seed in refs and step in ours
            ]
            if len(gaps) < 2:
                continue
            before, after = steps[max(i - 1, 0)], steps[min(i + 1, len(steps) - 1)]
            slope = (ref_mean[after] - ref_mean[before]) / (after - before)
            mean, error = _mean_and_error(gaps)
            epoch = next(iter(refs.values()))[step][0]
            line = (
                f"{group} against {prefix}, dev WER at step {step} (epoch {epoch}): "
                f"{100 * mean:+.2f} points (+-{100 * error:.2f}, {len(gaps)} seeds)"
            )
            if slope < 0:
                line += f", {mean / -slope:+.1f} +- {error / -slope:.1f} steps behind"
            lines.append(line)
    return lines


def plot(
    runs: dict[str, list[dict]],
    out: Path,
    against: tuple[str, Band, dict[str, list[tuple]]] | None = None,
) -> None:
    """`figure` drawn to the PNG `out`."""
    fig = figure(runs, against)
    fig.savefig(out, dpi=100)
    plt.close(fig)


def epoch_table(runs: dict[str, list[dict]]) -> str:
    """Markdown: per epoch, each run's mean logged training loss and its dev WER (%)."""
    per_run = {}
    for name, records in runs.items():
        losses: dict[int, list[float]] = {}
        for r in _train(records):
            if _is_number(r.get("loss")):
                losses.setdefault(r["epoch"], []).append(r["loss"])
        wers = {r["epoch"]: r["wer"] for r in _evals(records) if _is_number(r.get("wer"))}
        per_run[name] = ({e: statistics.fmean(v) for e, v in losses.items()}, wers)
    epochs = sorted({e for loss, wer in per_run.values() for e in (*loss, *wer)})
    header = "| epoch | " + " | ".join(f"{n} loss | {n} WER %" for n in runs) + " |"
    rule = "| --- |" + " --- | --- |" * len(runs)
    rows = [header, rule]
    for e in epochs:
        cells = []
        for loss, wer in per_run.values():
            cells.append(f"{loss[e]:.2f}" if e in loss else "")
            cells.append(f"{100 * wer[e]:.2f}" if e in wer else "")
        rows.append(f"| {e} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def summary(name: str, records: list[dict]) -> str:
    """Median step time, data-wait share and (on a GPU) host lead over the logged windows
    (each epoch's first one, which holds warm-up, CUDA graph capture or the evaluation's
    aftermath, left out), the same median over the last epoch's alone where there are several,
    and the run's first window on its own: what the start inside the timed region cost."""
    train = _train(records)
    seen, steady = set(), []
    for r in train:
        if r["epoch"] in seen:
            steady.append(r)
        seen.add(r["epoch"])
    steady = steady or train
    step_ms = [r["step_ms"] for r in steady if _is_number(r.get("step_ms"))]
    waits = [r["data_wait_share"] for r in steady if _is_number(r.get("data_wait_share"))]
    evals = [r for r in _evals(records) if _is_number(r.get("wer"))]
    parts = [f"{name}: {len(train)} log points"]
    if step_ms:
        parts.append(f"median step {statistics.median(step_ms):.2f} ms over {len(step_ms)} windows")
    epochs = sorted({r["epoch"] for r in steady})
    last = [r["step_ms"] for r in steady if r["epoch"] == max(epochs, default=None)]
    last = [ms for ms in last if _is_number(ms)]
    if len(epochs) > 1 and last:
        # the first epoch also holds one-off costs past its first window (the dev set's
        # workers start halfway through it): the last epoch's windows are the steady state
        parts.append(
            f"last epoch's median step {statistics.median(last):.2f} ms over {len(last)} windows"
        )
    if waits:
        # with the loader's parts of it (rnnt.data.device_stage.LoaderTime), each its median
        split = []
        for part in ("workers", "queueing", "stage"):
            shares = [r.get(f"data_wait_{part}_share") for r in steady]
            shares = [share for share in shares if _is_number(share)]
            if shares:
                split.append(f"{part} {100 * statistics.median(shares):.1f}%")
        of_which = f" ({', '.join(split)})" if split else ""
        parts.append(f"median data wait {100 * statistics.median(waits):.1f}%{of_which}")
    leads = [r["host_lead_ms"] for r in steady if _is_number(r.get("host_lead_ms"))]
    if leads:  # on a GPU (rnnt.throughput)
        parts.append(f"median host lead {statistics.median(leads):.1f} ms")
    first = train[0] if train else {}
    if _is_number(first.get("step_ms")) and _is_number(first.get("data_wait_share")):
        parts.append(
            f"first window {first['step_ms']:.1f} ms per step over {first['window_steps']} steps"
            f" ({100 * first['data_wait_share']:.1f}% data wait)"
        )
    if evals:
        parts.append(f"last WER {100 * evals[-1]['wer']:.2f}% (epoch {evals[-1]['epoch']})")
    return ", ".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("metrics", type=Path, nargs="+", help="metrics.jsonl written by training")
    parser.add_argument("--labels", nargs="+", default=None, help="one name per metrics file")
    parser.add_argument("--out", type=Path, default=None, help="PNG (default: beside METRICS)")
    parser.add_argument("--table", action="store_true", help="print the per-epoch table")
    parser.add_argument("--summary-only", action="store_true", help="draw nothing")
    parser.add_argument(
        "--band",
        metavar="PREFIX",
        default=None,
        help="the runs labelled PREFIX... as a reference group: the others' dev WER against it",
    )
    parser.add_argument(
        "--paired",
        metavar="PREFIX",
        default=None,
        help="runs labelled 'GROUP sN' against 'PREFIX sN' of the same seed: steps behind",
    )
    args = parser.parse_args(argv)
    labels = args.labels or [p.parent.name or str(p) for p in args.metrics]
    if len(labels) != len(args.metrics) or len(set(labels)) != len(labels):
        print(
            f"error: {len(args.metrics)} metrics files need as many distinct labels, got {labels}",
            file=sys.stderr,
        )
        return 2
    runs = {}
    for label, path in zip(labels, args.metrics, strict=True):
        if not path.is_file():
            print(f"error: metrics file not found: {path}", file=sys.stderr)
            return 2
        try:
            runs[label] = read_metrics(path)
        except ValueError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
    for label, records in runs.items():
        print(summary(label, records))
    if args.table:
        print(epoch_table(runs))
    against = None
    if args.band is not None:
        try:
            against = (args.band, *band(runs, args.band))
        except ValueError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        print("\n".join(band_lines(*against)))
    if args.paired is not None:
        try:
            print("\n".join(paired_lag(runs, args.paired)))
        except ValueError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
    if not args.summary_only:
        out = args.out or args.metrics[0].with_suffix(".png")
        plot(runs, out, against)
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
