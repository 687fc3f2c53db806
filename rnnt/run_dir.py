"""A run's output folder (`training.output_dir`), made usable before any work starts: a folder
that is a file or cannot be created is a one-line error up front, not a traceback from
whichever component first writes there."""

from __future__ import annotations

from pathlib import Path

from rnnt.errors import UserError


class OutputDirError(UserError):
    """training.output_dir cannot hold this run."""


def prepare_output_dir(out_dir: str | Path) -> Path:
    """Create `out_dir` (and its parents) unless it is there."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise OutputDirError(f"training.output_dir {out}: exists and is not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise OutputDirError(
            f"training.output_dir {out}: cannot be created ({err.strerror or err})"
        ) from None
    return out
