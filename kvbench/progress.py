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
