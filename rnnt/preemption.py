"""Preemption: a signal asks the run to checkpoint and stop at the next step boundary.

SIGTERM (what a cluster sends before it kills a job, and what torchrun forwards) and SIGUSR1
(what SLURM sends ahead of the time limit with `sbatch --signal=USR1@120`) only set a flag here:
a signal can arrive in the middle of a CUDA call or a collective, where nothing may be saved.
The trainer asks `requested_anywhere` at its log points, which already synchronize with the host:
all ranks agree there, save one consistent checkpoint and leave with EXIT_PREEMPTED, which a
launcher reads as "requeue me and pass --resume".
"""

from __future__ import annotations

import signal

from rnnt.distributed import DistContext, any_rank

# sysexits.h's EX_TEMPFAIL: a temporary failure, the user is invited to retry
EXIT_PREEMPTED = 75


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

    def requested_anywhere(self, ctx: DistContext) -> bool:
        """True on every rank when any rank received a signal (a collective and a host sync)."""
        return any_rank(self.requested, ctx)
