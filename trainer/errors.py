"""The run's own exceptions, apart from the modules that raise them (no import circles), and the
one way a rank writes a line of its own to stderr."""

import sys


class UserError(RuntimeError):
    """A problem with the user's input found at run time (printed without a traceback)."""


class StopTraining(RuntimeError):
    """A guard or the non-finite counter asked the run to stop."""


def say(line: str) -> None:
    """`line` to stderr in one write: every rank writes to the same stream, and `print`'s separate
    write of the newline let another rank's line run into this one."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
