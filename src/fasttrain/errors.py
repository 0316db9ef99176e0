"""User-facing errors: one line naming the problem, never a traceback."""


class FasttrainError(Exception):
    """A mistake in what the user asked for (bad recipe, unknown workload, impossible combo).

    The CLI prints ``str(err)`` on one line and exits with status 2.
    """
