"""The GPU streams of a torch.profiler Chrome trace, and how long the side streams' work waited.

Reads the trace that `rnnt/profiling.py` writes (`training.profile_from_step`; for the real-audio
step, `PROFILE_FROM=60 bash bench/gpu_session.sh realstep`), plain or gzipped. Per CUDA
stream: kernels, copies and memsets, and the time in which at least one of them ran. The
busiest stream is taken for the training step's; the work of every other stream (the input
pipeline's feature stage) is cut into bursts at gaps longer than --gap-ms, and each burst gets

- its span, from its first start to its last end, and its busy time;
- the busy time of the step's stream inside that span;
- the time it ran while the step's stream ran nothing (also per stream);
- the time it ran alone on the GPU, while no other stream ran anything (also per stream).
  A replayed CUDA graph runs its branches on streams of their own, so the step's work is not
  all on its busiest stream: time "without the step's stream" may still have the step's
  kernels beside it, while time alone on the GPU has nothing.

A burst whose span is much longer than its own busy time spent the rest waiting: its work was
queued behind the step's kernels, or its launches came late. A burst that ran alone held the
step up, or filled a gap that the step's stream left anyway: a kernel that fills every SM keeps
the next kernel of another stream of the same priority waiting until its last block starts, so
where the step's kernels follow each other, the side stream's large kernels run between them
(the real-audio step's feature stage: docs/PERFORMANCE.md). Also printed: the time in the
window in which no stream ran anything (the GPU idle), and the device time by kind of kernel
(`KINDS`, from the kernels' names), each instant shared evenly among the kinds running then, so
that the kinds and the idle time add up to the window. Last, the step's phases: where each
kind's work starts and ends inside a step, from the start of the step's first wave forward
(`--step-kind`), medians over the steps in the window; two trees' traces of the same batches
compare phase by phase.

    python bench/trace_streams.py RUN_DIR/profile/rank0_steps60-64.json [--gap-ms 2] [--json F]
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path
from statistics import median

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")

# a training step's device work by kind, from the kernels' names: the first kind with a name part
# in the kernel's name; what none names is "other"
KINDS = (
    ("wave LSTM backward", ("wave_bwd",)),
    ("wave LSTM forward", ("wave_t<",)),
    (
        "fused loss",
        ("logits_lse", "dlogits", "grad_fg", "hidden_kernel", "walk_kernel", "stats_from"),
    ),
    ("cuDNN RNN", ("RNN", "LSTM", "cudnn", "GENERIC_elementWise")),
    ("GEMM", ("nvjet", "gemm", "Gemm")),
    ("optimizer (multi-tensor)", ("_lamb_", "multi_tensor_apply")),
    ("copies and fills", ("direct_copy", "masked_fill", "memcpy", "Memcpy", "Memset")),
)

Interval = tuple[float, float]  # (start, end) in microseconds


def device_events(trace: dict) -> dict[int, list[Interval]]:
    """The complete events of the device's work, by stream, sorted by start."""
    streams: dict[int, list[Interval]] = {}
    for event in trace.get("traceEvents", []):
        if event.get("ph") != "X" or event.get("cat") not in DEVICE_CATEGORIES:
            continue
        try:
            stream = int(event.get("args", {}).get("stream", -1))
            start = float(event["ts"])
            end = start + float(event.get("dur", 0.0))
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"a {event.get('cat')} event without a usable {err}: {event}") from err
        streams.setdefault(stream, []).append((start, end))
    for intervals in streams.values():
        intervals.sort()
    return streams


def union(intervals: list[Interval]) -> list[Interval]:
    """Sorted intervals -> their union, as disjoint sorted intervals."""
    merged: list[Interval] = []
    for start, end in intervals:
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def covered(intervals: list[Interval], lo: float, hi: float) -> float:
    """How much of [lo, hi] the disjoint sorted `intervals` cover."""
    return sum(max(0.0, min(end, hi) - max(start, lo)) for start, end in intervals)


def overlap(a: list[Interval], b: list[Interval]) -> float:
    """How much time two lists of disjoint sorted intervals share."""
    shared, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        shared += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return shared


def bursts(intervals: list[Interval], gap_us: float) -> list[list[Interval]]:
    """Sorted intervals cut where the next one starts more than gap_us after all before it ended."""
    groups: list[list[Interval]] = []
    last_end = float("-inf")
    for start, end in intervals:
        if not groups or start - last_end > gap_us:
            groups.append([])
        groups[-1].append((start, end))
        last_end = max(last_end, end)
    return groups


def kind_of(name: str) -> str:
    return next((kind for kind, parts in KINDS if any(p in name for p in parts)), "other")


def time_by_kind(trace: dict) -> dict[str, float]:
    """Device time in milliseconds per kind of kernel (KINDS), each instant shared evenly among
    the kinds running then; "idle": no device work. Sums to the window."""
    edges = []
    for event in trace.get("traceEvents", []):
        if event.get("ph") != "X" or event.get("cat") not in DEVICE_CATEGORIES:
            continue
        start = float(event["ts"])
        kind = kind_of(str(event.get("name", "")))
        edges += [(start, 1, kind), (start + float(event.get("dur", 0.0)), -1, kind)]
    edges.sort()
    running: dict[str, int] = {}
    shares: dict[str, float] = {"idle": 0.0}
    last = edges[0][0] if edges else 0.0
    for at, change, kind in edges:
        live = [k for k, n in running.items() if n > 0]
        for k in live or ["idle"]:
            shares[k] = shares.get(k, 0.0) + (at - last) / max(1, len(live)) / 1e3
        running[kind] = running.get(kind, 0) + change
        last = at
    return shares


def step_phases(trace: dict, step_kind: str, step_gap_ms: float) -> dict | None:
    """Where each kind's work sits inside the training step, in milliseconds.

    A step starts at an event of `step_kind` that follows that kind's previous event by more
    than `step_gap_ms` (the first one too); the last started step ends at the window's last
    event. Per kind, and per step: from the step's start to the kind's first start and to its
    last end. Returned: "periods" (the whole steps' lengths) and, per kind, the medians of
    "first" and "last" over the steps that have the kind; None without `step_kind` work.
    """
    events = []
    for event in trace.get("traceEvents", []):
        if event.get("ph") == "X" and event.get("cat") in DEVICE_CATEGORIES:
            start, end = float(event["ts"]), float(event["ts"]) + float(event.get("dur", 0.0))
            events.append((start, end, kind_of(str(event.get("name", "")))))
    events.sort()
    starts, previous_end = [], None
    for start, end, kind in events:
        if kind != step_kind:
            continue
        if previous_end is None or start - previous_end > step_gap_ms * 1e3:
            starts.append(start)
        previous_end = end if previous_end is None else max(previous_end, end)
    if not starts:
        return None
    bounds = starts + [max(end for _, end, _ in events)]
    per_kind: dict[str, tuple[list[float], list[float]]] = {}
    for lo, hi in zip(bounds, bounds[1:]):
        seen: dict[str, list[float]] = {}
        for start, end, kind in events:
            if lo <= start < hi:
                span = seen.setdefault(kind, [start, end])
                span[1] = max(span[1], end)
        for kind, (first, last) in seen.items():
            firsts, lasts = per_kind.setdefault(kind, ([], []))
            firsts.append((first - lo) / 1e3)
            lasts.append((last - lo) / 1e3)
    return {
        "periods_ms": [(b - a) / 1e3 for a, b in zip(starts, starts[1:])],
        "kinds": {
            kind: {"first_ms": median(firsts), "last_ms": median(lasts), "steps": len(firsts)}
            for kind, (firsts, lasts) in per_kind.items()
        },
    }


def summarize(trace: dict, gap_ms: float = 2.0) -> dict:
    """Per stream and per side-stream burst, in milliseconds (see the module)."""
    streams = device_events(trace)
    if not streams:
        raise ValueError("the trace holds no kernels, copies or memsets (profiled on a CPU?)")
    merged = {stream: union(intervals) for stream, intervals in streams.items()}
    busy = {stream: sum(end - start for start, end in m) for stream, m in merged.items()}
    step_stream = max(busy, key=lambda stream: busy[stream])
    everything = union(sorted(i for intervals in streams.values() for i in intervals))
    window = (everything[0][0], everything[-1][1])
    gpu_busy = sum(end - start for start, end in everything)
    result = {
        "window_ms": (window[1] - window[0]) / 1e3,
        "gpu_idle_ms": (window[1] - window[0] - gpu_busy) / 1e3,
        "step_stream": step_stream,
        "kinds_ms": time_by_kind(trace),
        "streams": [],
    }
    for stream in sorted(streams, key=lambda s: -busy[s]):
        entry = {"stream": stream, "events": len(streams[stream]), "busy_ms": busy[stream] / 1e3}
        if stream != step_stream:
            # its work while the step's stream ran nothing: time the step waited for it, or
            # that it filled while the step's stream was idle anyway
            entry["alone_ms"] = (busy[stream] - overlap(merged[stream], merged[step_stream])) / 1e3
            others = union(
                sorted(i for other, found in streams.items() if other != stream for i in found)
            )
            entry["alone_on_gpu_ms"] = (busy[stream] - overlap(merged[stream], others)) / 1e3
            entry["bursts"] = []
            for group in bursts(streams[stream], gap_ms * 1e3):
                lo, hi = group[0][0], max(end for _, end in group)
                own = union(group)
                entry["bursts"].append(
                    {
                        "start_ms": (lo - window[0]) / 1e3,
                        "events": len(group),
                        "span_ms": (hi - lo) / 1e3,
                        "busy_ms": sum(end - start for start, end in own) / 1e3,
                        "step_busy_ms": covered(merged[step_stream], lo, hi) / 1e3,
                        "alone_ms": (
                            sum(end - start for start, end in own)
                            - overlap(own, merged[step_stream])
                        )
                        / 1e3,
                        "alone_on_gpu_ms": (
                            sum(end - start for start, end in own) - overlap(own, others)
                        )
                        / 1e3,
                    }
                )
        result["streams"].append(entry)
    return result


def load(path: Path) -> dict:
    """The trace at `path` (plain or gzipped JSON); ValueError naming the file otherwise."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt") as f:
            trace = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not a readable Chrome trace ({err})") from err
    if not isinstance(trace, dict):
        raise ValueError(f"{path}: not a Chrome trace (no traceEvents object)")
    return trace


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", type=Path)
    parser.add_argument("--gap-ms", type=float, default=2.0, help="a longer gap starts a burst")
    parser.add_argument("--json", default=None, help="write the summary here")
    parser.add_argument(
        "--step-kind",
        default="wave LSTM forward",
        choices=[kind for kind, _ in KINDS],
        help="the kind of work that starts a training step (phases table)",
    )
    parser.add_argument(
        "--step-gap-ms",
        type=float,
        default=20.0,
        help="a pause in --step-kind's work longer than this starts a step",
    )
    args = parser.parse_args()
    try:
        trace = load(args.trace)
        result = summarize(trace, args.gap_ms)
        result["phases"] = step_phases(trace, args.step_kind, args.step_gap_ms)
    except ValueError as err:
        message = str(err)
        named = message if message.startswith(str(args.trace)) else f"{args.trace}: {message}"
        raise SystemExit(named) from None
    print(
        f"{args.trace.name}: {result['window_ms']:.1f} ms window, GPU idle "
        f"{result['gpu_idle_ms']:.1f} ms; the step's stream: {result['step_stream']}"
    )
    for entry in result["streams"]:
        alone = (
            f", {entry['alone_ms']:.2f} ms of it without the step's stream, "
            f"{entry['alone_on_gpu_ms']:.2f} ms alone on the GPU"
            if "alone_ms" in entry
            else ""
        )
        print(
            f"stream {entry['stream']}: {entry['events']} events, {entry['busy_ms']:.2f} ms busy"
            + alone
        )
        for b in entry.get("bursts", []):
            print(
                f"  burst at {b['start_ms']:8.2f} ms: {b['events']:4d} events, span "
                f"{b['span_ms']:6.2f} ms, busy {b['busy_ms']:5.2f} ms, the step's stream busy "
                f"{b['step_busy_ms']:6.2f} ms of it, without it {b['alone_ms']:5.2f} ms, alone "
                f"on the GPU {b['alone_on_gpu_ms']:5.2f} ms"
            )
    print("device time by kind (shared where kinds overlap):")
    for kind, ms in sorted(result["kinds_ms"].items(), key=lambda item: -item[1]):
        print(f"  {kind:26s} {ms:9.2f} ms")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    phases = result["phases"]
    if phases is None:
        print(f"no {args.step_kind!r} work to find the steps by: no phases")
        return
    periods = ", ".join(f"{p:.2f}" for p in phases["periods_ms"])
    print(f"steps (from each {args.step_kind!r} start): periods {periods} ms")
    print("  kind                       first start  last end   (medians over steps, ms)")
    for kind, at in sorted(phases["kinds"].items(), key=lambda item: item[1]["first_ms"]):
        print(f"  {kind:26s} {at['first_ms']:11.2f} {at['last_ms']:9.2f}")


if __name__ == "__main__":
    main()
