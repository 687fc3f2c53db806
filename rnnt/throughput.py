"""Throughput between log points, measured against the device.

The training step queues work and returns long before the GPU has run it, so a host clock read
right after a step measures how fast the host queues, not how fast the GPU trains. On a GPU a
window's ends are CUDA events recorded in the step's stream: its length is the time between
them on the device's clock, idle time included. The host never waits for the device to drain:
a window is closed when the log point's step is queued and read once the step after it is
queued too, so the GPU has that step to run while the host prints and fetches the next
batch (a device synchronize there cost every log point the time to queue the next step, and
the real-audio step's feature stage more than a synthetic batch's). Windows tile the epoch and
their times add up to the wall clock. Off CUDA the ends are host clock readings.

Per window: utterances per second, the mean step time, the share of the window the loop spent
waiting for the data loader (and, from a loader that times its parts, the shares of those
parts: the torch loader's workers, queueing its GPU stage, waiting for that stage), the peak
GPU memory, the caching allocator's retries (each one a
cudaMalloc that failed, after which the allocator freed its cache and synchronized: memory
pressure that slows the step and that a run's peak memory does not show), and the model FLOP
utilisation against a stated peak (`rnnt.flops`). On a GPU also the host's lead: how long
the host, having queued the step after the window, waited for the GPU to finish the window's
last step. While it is well above zero the GPU had work queued and a host-side wait (the data
wait included) cost no GPU time; near zero the GPU was the one waiting for the host.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class WindowStats:
    steps: int
    utterances: int
    seconds: float
    data_wait_seconds: float
    utts_per_s: float
    step_ms: float
    data_wait_share: float
    peak_memory_gib: float | None
    mfu: float | None
    alloc_retries: int | None = None
    data_wait_parts: dict[str, float] | None = None  # shares of the window, by part
    host_lead_ms: float | None = None  # on a GPU: the wait for the window's end when read


@dataclass(frozen=True)
class WindowCounts:
    """What the host counted in a window, fixed when it closes (the device may still run it)."""

    steps: int
    utterances: int
    flops: int
    data_wait: float  # seconds the loop waited for the loader
    peak_memory_gib: float | None
    alloc_retries: int | None
    wait_parts_spent: dict[str, float] | None  # the loader's seconds by part, in the window


class ClosedWindow:
    """A window whose end is queued on the device; `stats` waits for that end alone (not for
    anything queued after it) and gives its numbers."""

    def __init__(
        self,
        start: torch.cuda.Event | float,
        end: torch.cuda.Event | float,
        counts: WindowCounts,
        peak_flops: float | None,
    ) -> None:
        self.start, self.end = start, end
        self.counts = counts
        self.peak_flops = peak_flops
        self._stats: WindowStats | None = None
        self.host_lead_ms: float | None = None  # set by the first read on a GPU

    def seconds(self) -> float:
        if isinstance(self.end, float):
            return max(self.end - self.start, 1e-9)
        if self.host_lead_ms is None:
            waited = time.perf_counter()
            self.end.synchronize()
            self.host_lead_ms = 1e3 * (time.perf_counter() - waited)
        return max(self.start.elapsed_time(self.end) / 1e3, 1e-9)

    def stats(self) -> WindowStats:
        if self._stats is None:
            c, seconds = self.counts, self.seconds()
            spent = c.wait_parts_spent
            self._stats = WindowStats(
                steps=c.steps,
                utterances=c.utterances,
                seconds=seconds,
                data_wait_seconds=c.data_wait,
                utts_per_s=c.utterances / seconds,
                step_ms=1e3 * seconds / max(c.steps, 1),
                data_wait_share=c.data_wait / seconds,
                peak_memory_gib=c.peak_memory_gib,
                mfu=None if self.peak_flops is None else c.flops / seconds / self.peak_flops,
                alloc_retries=c.alloc_retries,
                data_wait_parts=None
                if spent is None
                else {name: part / seconds for name, part in spent.items()},
                host_lead_ms=self.host_lead_ms,
            )
        return self._stats


class ThroughputWindow:
    """Counts steps, utterances, data waits and model FLOPs between ends marked in the device's
    queue.

    peak_flops: the FLOP/s that MFU is relative to (None: MFU is not reported).
    wait_parts: the loader's cumulative seconds by part of its wait (None where it keeps none;
    rnnt.data.loader.TrainLoader.data_wait_parts), read at each window's ends.
    """

    def __init__(
        self,
        device: torch.device,
        peak_flops: float | None = None,
        wait_parts: Callable[[], dict[str, float] | None] | None = None,
    ) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.peak_flops = peak_flops
        self.wait_parts = wait_parts or (lambda: None)
        self._parts_before = self.wait_parts()
        self._start: torch.cuda.Event | float = 0.0
        self._retries_before = self.alloc_retries()
        self._reset_counts()

    def _reset_counts(self) -> None:
        self.steps = 0
        self.utterances = 0
        self.flops = 0
        self.data_wait = 0.0

    def alloc_retries(self) -> int | None:
        """The caching allocator's retries since the process started (None off CUDA)."""
        if not self.cuda:
            return None
        return int(torch.cuda.memory_stats(self.device).get("num_alloc_retries", 0))

    def _mark(self) -> torch.cuda.Event | float:
        """This point of the device's queue (CUDA: an event in the current stream)."""
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def start(self) -> None:
        """Begin a window after whatever ran before (evaluation, a checkpoint) has finished."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
        self._retries_before = self.alloc_retries()  # what ran before is not this window's
        self._begin(self._mark())

    def _begin(self, start: torch.cuda.Event | float) -> None:
        self._start = start
        self._parts_before = self.wait_parts()
        self._reset_counts()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def waited_for_data(self, seconds: float) -> None:
        self.data_wait += seconds

    def add_step(self, utterances: int, flops: int) -> None:
        self.steps += 1
        self.utterances += utterances
        self.flops += flops

    def close(self) -> ClosedWindow:
        """End the window after the work queued so far, without waiting for it; the next
        window starts there. The memory peak and the allocator's retries are the host's
        count of the allocations queued in the window."""
        end = self._mark()
        retries = self.alloc_retries()
        parts, before = self.wait_parts(), self._parts_before
        spent = None
        if parts is not None and before is not None:
            spent = {name: seconds - before[name] for name, seconds in parts.items()}
        counts = WindowCounts(
            steps=self.steps,
            utterances=self.utterances,
            flops=self.flops,
            data_wait=self.data_wait,
            peak_memory_gib=torch.cuda.max_memory_allocated(self.device) / 2**30
            if self.cuda
            else None,
            alloc_retries=None if retries is None else retries - self._retries_before,
            wait_parts_spent=spent,
        )
        closed = ClosedWindow(self._start, end, counts, self.peak_flops)
        self._retries_before = retries
        self._begin(end)
        return closed


class StepParts:
    """CUDA events at named points of training steps, to split a step's time into its parts
    (bench/train_step.py) without a second implementation of the step.

    The Trainer marks "start", "encoded" (encoder and prediction outputs queued), "loss",
    "joint_grads" (the gradients of the joint's inputs computed, so the joint and loss backward
    are done) and "end" (optimizer and EMA queued). Each name holds one event per step.
    """

    def __init__(self) -> None:
        self.events: dict[str, list[torch.cuda.Event]] = {}

    def mark(self, name: str) -> None:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self.events.setdefault(name, []).append(event)

    def mark_when_grads_reach(self, tensors: list[torch.Tensor], name: str) -> None:
        """Mark `name` once the backward has produced the gradient of every tensor given."""
        pending = [t for t in tensors if t.requires_grad]
        left = {"count": len(pending)}

        def hook(grad: torch.Tensor) -> None:
            left["count"] -= 1
            if left["count"] == 0:
                self.mark(name)

        for t in pending:
            t.register_hook(hook)

    def milliseconds(self, first: str, second: str) -> list[float]:
        """Per step, the time from `first` to `second` (synchronizes on the last event)."""
        a, b = self.events[first], self.events[second]
        if len(a) != len(b):
            raise ValueError(f"StepParts: {len(a)} '{first}' events but {len(b)} '{second}'")
        if b:
            b[-1].synchronize()
        return [x.elapsed_time(y) for x, y in zip(a, b)]
