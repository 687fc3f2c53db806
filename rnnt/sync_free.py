"""Reading training scalars on the host without stalling the GPU.

A training step leaves its loss, loss scale and skipped-step counters on the device. Reading one
with `.item()` or `float()` waits for every kernel queued before it, which empties the GPU's
queue once per step. `AsyncScalars.record` instead snapshots the scalars on the device and
queues their copy into pinned host memory on a side stream; `read` waits only for that copy,
at a logging point, by which time it has long finished.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class AsyncScalars:
    """A fixed set of named scalars, copied device -> pinned host memory asynchronously.

    `record(name=value, ...)` takes every name once: 0-d (or 1-element) tensors on the device,
    or host numbers (stored as they are: the learning rate is computed on the host). `read()`
    returns the most recent record as floats. On CPU the copy is an ordinary copy.
    """

    def __init__(self, names: Sequence[str], device: torch.device | str) -> None:
        if not names or len(set(names)) != len(names):
            raise ValueError(f"AsyncScalars needs distinct names, got {list(names)}")
        self.names = tuple(names)
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        # float64 holds int64 counters exactly up to 2**53 and every float32/fp16 value
        self._host = torch.zeros(len(self.names), dtype=torch.float64, pin_memory=self._cuda)
        self._numbers: dict[str, float] = {}
        self._stream = torch.cuda.Stream(self.device) if self._cuda else None
        self._done = torch.cuda.Event() if self._cuda else None
        self._recorded = False

    def record(self, **values: torch.Tensor | float | int) -> None:
        missing = [n for n in self.names if n not in values]
        unknown = [n for n in values if n not in self.names]
        if missing or unknown:
            raise ValueError(
                f"AsyncScalars.record: missing {missing}, unknown {unknown} "
                f"(expected exactly {list(self.names)})"
            )
        numbers = {}
        tensors = []
        for name in self.names:
            value = values[name]
            if isinstance(value, torch.Tensor):
                if value.numel() != 1:
                    raise ValueError(f"AsyncScalars.record: '{name}' has {value.numel()} elements")
                tensors.append(value.detach().reshape(()).to(self.device, torch.float64))
            else:
                numbers[name] = float(value)
                tensors.append(torch.zeros((), dtype=torch.float64, device=self.device))
        # the snapshot is taken on the current stream, so later in-place updates of the
        # originals (loss accumulators, counters) cannot race with the copy below
        snapshot = torch.stack(tensors)
        if self._cuda:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                self._host.copy_(snapshot, non_blocking=True)
                self._done.record()
            # keep the caching allocator from reusing the snapshot before the copy has run
            snapshot.record_stream(self._stream)
        else:
            self._host.copy_(snapshot)
        self._numbers = numbers
        self._recorded = True

    def ready(self) -> bool:
        """True when the last record has reached host memory (never blocks)."""
        return not self._cuda or self._done.query()

    def read(self) -> dict[str, float]:
        """The last recorded values; waits only for their copy (not for later GPU work)."""
        if not self._recorded:
            raise RuntimeError("AsyncScalars.read before any record")
        if self._cuda:
            self._done.synchronize()
        values = dict(zip(self.names, self._host.tolist()))
        values.update(self._numbers)
        return values
