"""What this process reports when Hydra returns: its exit code, and the sweep that is running.

Hydra hands neither the job function's result nor the sweep callback's back to
:func:`kvbench.cli.main`: both report to the one :data:`OUTCOME` of the process, which ``main`` reads.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import Optional

from omegaconf import DictConfig

EXIT_CODES = {"ok": 0, "invalid": 2, "oom": 3, "error": 1, "interrupted": 128 + signal.SIGINT}


@dataclass
class Outcome:
    """``exit_code``: what the process exits with (the worst seen); ``sweep``: the running
    multirun's config, for ending it when the sweeper fails or the sweep is interrupted."""

    exit_code: int = 0
    sweep: Optional[DictConfig] = None

    def job_ended(self, code: int) -> None:
        """A single run's job (or inspect) ended with ``code``."""
        self.exit_code = code

    def sweep_started(self, config: DictConfig) -> None:
        self.sweep = config

    def sweep_ended(self, code: int) -> None:
        """The sweep's end table is written; ``code`` is its jobs' verdict."""
        self.sweep = None
        self.exit_code = max(self.exit_code, code)


OUTCOME = Outcome()
