"""User-facing errors: one line naming the problem, never a traceback."""


class FasttrainError(Exception):
    """A mistake in what the user asked for (bad recipe, unknown workload, impossible combo).

    The CLI prints ``str(err)`` on one line and exits with status 2.
    """


def describe_error(err: BaseException, width: int = 300) -> str:
    """``Type: first line`` of an exception, plus the first exception of its chain when that is a
    different one: a CUDA graph capture reports "operation failed due to a previous error during
    capture", while the cause is the exception raised inside the capture."""
    def line(e: BaseException) -> str:
        text = str(e).splitlines()[0][:width] if str(e) else ""
        return f"{type(e).__name__}: {text}" if text else type(e).__name__

    def before(e: BaseException) -> BaseException | None:
        return e.__cause__ or (None if e.__suppress_context__ else e.__context__)

    root, seen = err, {id(err)}
    while (nxt := before(root)) is not None and id(nxt) not in seen:
        root = nxt
        seen.add(id(nxt))
    return line(err) if root is err else f"{line(err)} (first: {line(root)})"
