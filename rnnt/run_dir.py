"""A run's output folder (`training.output_dir`), made usable before any work starts, and never
shared by two runs.

A folder that is a file or cannot be created is a one-line error up front, not a traceback from
whichever component first writes there. A fresh run (no --resume) into a folder that holds an
earlier run's checkpoints is refused: otherwise the two runs' checkpoints mix, and a later
--resume would continue whichever is newer. --overwrite deletes them first.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from rnnt.checkpoint import checkpoint_dirs
from rnnt.errors import UserError

CHECKPOINTS = "checkpoints"


class OutputDirError(UserError):
    """training.output_dir cannot hold this run."""


def prepare_output_dir(
    out_dir: str | Path, resume: bool = False, overwrite: bool = False, is_main: bool = True
) -> Path:
    """Create `out_dir` (and its parents) unless it is there; refuse a fresh run where another
    run left checkpoints, unless `overwrite`, which deletes them (on the main rank: the others
    only check)."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise OutputDirError(f"training.output_dir {out}: exists and is not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise OutputDirError(
            f"training.output_dir {out}: cannot be created ({err.strerror or err})"
        ) from None
    earlier = checkpoint_dirs(out / CHECKPOINTS)
    if earlier and not resume:
        if not overwrite:
            raise OutputDirError(
                f"training.output_dir {out} holds {len(earlier)} checkpoint(s) of an earlier "
                f"run (newest {earlier[0].name}): continue it with --resume, train into another "
                "training.output_dir, or pass --overwrite to delete them"
            )
        if is_main:
            shutil.rmtree(out / CHECKPOINTS)
    return out
