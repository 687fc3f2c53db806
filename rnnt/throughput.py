"""Throughput between log points, measured against the device.

The training step queues work and returns long before the GPU has run it, so a host clock read
right after a step measures how fast the host queues, not how fast the GPU trains. A window here
ends only after the device has finished everything queued in it (a synchronize), which is the
log point's one host sync; the next window starts at that same instant, so windows tile the
epoch and their times add up to the wall clock.

Per window: utterances per second, the mean step time, the share of the window the loop spent
waiting for the data loader (and, from a loader that times its parts, the shares of those
parts: the torch loader's workers, queueing its GPU stage, waiting for that stage), the peak
GPU memory, the caching allocator's retries (each one a
cudaMalloc that failed, after which the allocator freed its cache and synchronized: memory
pressure that slows the step and that a run's peak memory does not show), and the model FLOP
utilisation against a stated peak (`rnnt.flops`).
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


class ThroughputWindow:
    """Counts steps, utterances, data waits and model FLOPs between synchronized ends.

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
        self._start = 0.0
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

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def start(self) -> None:
        """Begin a window after whatever ran before (evaluation, a checkpoint) has finished."""
        self._sync()
        self._retries_before = self.alloc_retries()  # what ran before is not this window's
        self._begin(time.perf_counter())

    def _begin(self, now: float) -> None:
        self._start = now
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

    def close(self) -> WindowStats:
        """End the window once the device is idle; the next window starts now."""
        self._sync()
        now = time.perf_counter()
        seconds = max(now - self._start, 1e-9)
        peak_mem = torch.cuda.max_memory_allocated(self.device) / 2**30 if self.cuda else None
        retries = self.alloc_retries()
        parts, before, shares = self.wait_parts(), self._parts_before, None
        if parts is not None and before is not None:
            shares = {name: (spent - before[name]) / seconds for name, spent in parts.items()}
        stats = WindowStats(
            steps=self.steps,
            utterances=self.utterances,
            seconds=seconds,
            data_wait_seconds=self.data_wait,
            utts_per_s=self.utterances / seconds,
            step_ms=1e3 * seconds / max(self.steps, 1),
            data_wait_share=self.data_wait / seconds,
            peak_memory_gib=peak_mem,
            mfu=None if self.peak_flops is None else self.flops / seconds / self.peak_flops,
            alloc_retries=None if retries is None else retries - self._retries_before,
            data_wait_parts=shares,
        )
        self._retries_before = retries
        self._begin(now)
        return stats


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
