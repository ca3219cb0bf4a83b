"""What a metric is: ``Metric(name, unit, method)``, the unit as data next to the method that took it.

Each module that measures declares a ``*_METRICS`` table beside the code that takes them. A
record keeps each as one ``methods`` line (``"ms; median decode step ..."``), but code that needs
a unit reads :attr:`Metric.unit`, never that line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, Iterable, Mapping


@dataclass(frozen=True)
class Metric:
    """One metric (or table, ``tables.<name>``, or method note) a job may record; ``unit`` is ``text``
    for a string and empty for a table or note. A name with ``<...>`` parts is a pattern."""

    name: str
    unit: str
    method: str

    @property
    def text(self) -> str:
        """The line a record's ``methods`` keeps for it: ``unit; method``."""
        return f"{self.unit}; {self.method}" if self.unit else self.method

    @property
    def numeric(self) -> bool:
        """A number a sweeper can optimise: not text, not a table or series."""
        return self.unit not in ("", "text", "bool") and "." not in self.name


def metric_table(*metrics: Metric) -> Dict[str, Metric]:
    """name -> metric, in order; a later declaration refines an earlier one (a task's table a shared one)."""
    return {m.name: m for m in metrics}


def record_methods(metrics: Mapping[str, Metric] | Iterable[Metric]) -> Dict[str, str]:
    """What a record's ``methods`` holds for ``metrics``: name -> ``unit; method``."""
    values = metrics.values() if isinstance(metrics, Mapping) else metrics
    return {m.name: m.text for m in values}


def matches(pattern: str, name: str) -> bool:
    """Whether ``name`` is one of a pattern's (each ``<...>`` part a word: ``<v>_step_ms_ctx<C>``)."""
    if "<" not in pattern:
        return pattern == name
    regex = "".join(r"\w+" if part.startswith("<") else re.escape(part) for part in re.split(r"(<[^>]+>)", pattern))
    return re.fullmatch(regex, name) is not None
