"""User errors: what the person running a program can fix (a config key, a manifest line, a
file, a checkpoint, the machine), as opposed to bugs.

Every such error derives from `UserError` and carries a message that names the file, line or
key. The command-line programs wrap their `main` in `reports_user_errors`, which prints that
message as `error: ...` and exits with status 2 (argparse's status for a bad command line);
anything else still ends in a traceback, because it is a bug. Imports nothing heavy, so a
program's `--help` stays fast.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

EXIT_USER_ERROR = 2


class UserError(Exception):
    """A problem in what the user gave the program; its message names where it is."""


def reports_user_errors(main: Callable[..., int]) -> Callable[..., int]:
    """`main(argv)` that prints a UserError as one `error:` line on stderr and returns 2."""

    @functools.wraps(main)
    def run(argv: list[str] | None = None) -> int:
        try:
            return main(argv)
        except UserError as err:
            print(f"error: {err}", file=sys.stderr)
            return EXIT_USER_ERROR

    return run
