"""The run's own exceptions, apart from the modules that raise them (no import circles)."""


class UserError(RuntimeError):
    """A problem with the user's input found at run time (printed without a traceback)."""


class StopTraining(RuntimeError):
    """A guard or the non-finite counter asked the run to stop."""
