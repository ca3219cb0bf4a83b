"""The progress callback a job is handed (:data:`Progress`) and the one that shows nothing.
Torch-free, so that the process that starts a job's own process names it without importing
what runs the job."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, ContextManager, Optional

# progress(label, total) -> a context manager yielding tick(description=None), called once per
# trial or training step; the CLI passes rich progress bars, the default shows nothing.
Progress = Callable[[str, int], ContextManager[Optional[Callable[..., None]]]]


@contextmanager
def no_progress(label: str, total: int):
    yield None


def guarded(progress: Progress) -> Progress:
    """``progress`` that never fails the job it shows: a display that cannot be written (a closed
    terminal's EIO, a pipe's EPIPE) goes quiet and the job measures on (until SIGHUP or SIGPIPE)."""

    @contextmanager
    def shown(label: str, total: int):
        try:
            context = progress(label, total)
            tick = context.__enter__()
        except OSError:
            yield None
            return

        def safe_tick(*args, **kwargs) -> None:
            try:
                tick(*args, **kwargs)
            except OSError:
                pass

        try:
            yield None if tick is None else safe_tick
        except BaseException as exc:
            try:
                if context.__exit__(type(exc), exc, exc.__traceback__):
                    return
            except OSError:
                pass
            raise
        else:
            try:
                context.__exit__(None, None, None)
            except OSError:
                pass

    return shown
