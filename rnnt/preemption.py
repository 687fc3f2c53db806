"""Preemption: a signal asks the run to checkpoint and stop at the next step boundary.

SIGTERM (what a cluster sends before it kills a job, and what torchrun forwards) and SIGUSR1
(what SLURM sends ahead of the time limit with `sbatch --signal=USR1@120`) only set a flag here:
a signal can arrive in the middle of a CUDA call or a collective, where nothing may be saved.
The trainer sums every rank's flag with its log point's other numbers (one collective queued
with the step, read once the next step is queued): all ranks learn it at the same log point,
save one consistent checkpoint at that step boundary and leave with EXIT_PREEMPTED, which a
launcher reads as "requeue me and pass --resume"; rank 0 also leaves PREEMPTED_MARKER in
output_dir, which says the same where the exit status gets lost.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

# sysexits.h's EX_TEMPFAIL: a temporary failure, the user is invited to retry
EXIT_PREEMPTED = 75
# In output_dir, written by rank 0 once every rank has saved: the launcher's sign to requeue.
# An exit status alone does not carry it through srun: under --kill-on-bad-exit the first
# rank to leave with 75 gets the others killed while they leave too, and srun reports their
# SIGTERM (143) instead.
PREEMPTED_MARKER = "PREEMPTED"


def mark_preempted(out_dir: Path, checkpoint: str) -> None:
    """Leave the marker, naming the checkpoint to resume from (written whole or not at all)."""
    tmp = out_dir / f".{PREEMPTED_MARKER}.tmp"
    tmp.write_text(checkpoint + "\n")
    os.replace(tmp, out_dir / PREEMPTED_MARKER)


def clear_preempted(out_dir: Path) -> None:
    """A starting run removes an earlier run's marker: a launcher that finds one after a crash
    would requeue it forever."""
    (out_dir / PREEMPTED_MARKER).unlink(missing_ok=True)


class Preempted(Exception):
    """The run saved its state after a preemption signal and should exit with EXIT_PREEMPTED."""


class PreemptionFlag:
    """Set by SIGTERM or SIGUSR1 once `install()` has run (main thread only)."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self) -> None:
        self.signal: int | None = None
        self._previous: dict[int, object] = {}

    def install(self) -> PreemptionFlag:
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        self.signal = signum

    @property
    def requested(self) -> bool:
        return self.signal is not None
