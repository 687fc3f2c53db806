"""torch.profiler around a window of training steps (`training.profile_from_step`,
`training.profile_steps`): what the GPU and the host did in those steps, input pipeline
included, in the real trainer.

Each rank writes `OUTPUT_DIR/profile/rank<R>_steps<A>-<B>.json` (a Chrome trace: chrome://tracing
or https://ui.perfetto.dev) and `.txt`, its operators and kernels by device time (CPU time
where no GPU ran). The window opens before step A's batch is fetched, so the loader's
device work shows beside the steps; a step's graph replays appear as graph launches.
With `training.profile_host: false` a GPU run records its kernels, copies and memsets alone.
Recording every host operator slows the host until the GPU waits for it, and the trace then
shows a schedule the unprofiled run does not have (measured on the real-audio step:
docs/PERFORMANCE.md).
"""

from __future__ import annotations

from pathlib import Path

import torch


class StepProfiler:
    """Profiles steps [first, first + count); inactive when `first` is 0. host=False records
    only the GPU's work (on a GPU): the host then runs at its own pace."""

    def __init__(
        self,
        first: int,
        count: int,
        out_dir: Path,
        rank: int,
        device: torch.device,
        host: bool = True,
    ):
        self.first, self.last = first, first + count - 1
        self.out_dir = Path(out_dir) / "profile"
        self.rank = rank
        self.device = device
        self.activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            if not host:
                self.activities = []
            self.activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profile: torch.profiler.profile | None = None

    @property
    def enabled(self) -> bool:
        return self.first > 0

    def before_step(self, step: int) -> None:
        """Called before step `step` fetches its batch."""
        if self.enabled and step == self.first and self._profile is None:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self._profile = torch.profiler.profile(activities=self.activities)
            self._profile.__enter__()

    def after_step(self, step: int) -> str | None:
        """Called after step `step`; at the window's last step, writes the files and returns
        the line that names them."""
        if self._profile is None or step < self.last:
            return None
        return self.close()

    def close(self) -> str | None:
        """End the window (also where the run ends inside it); the line naming its files."""
        if self._profile is None:
            return None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        profile, self._profile = self._profile, None
        profile.__exit__(None, None, None)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        stem = self.out_dir / f"rank{self.rank}_steps{self.first}-{self.last}"
        profile.export_chrome_trace(str(stem.with_suffix(".json")))
        sort = "device_time_total" if self.device.type == "cuda" else "cpu_time_total"
        table = profile.key_averages().table(sort_by=sort, row_limit=40)
        stem.with_suffix(".txt").write_text(table + "\n")
        return f"profiled steps {self.first}-{self.last}: {stem}.json, by time in {stem}.txt"
