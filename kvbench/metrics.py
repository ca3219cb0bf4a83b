"""What a metric is: ``Metric(name, unit, method)``, the unit as data next to the method that took it.

Every module that measures declares its metrics as a table of :class:`Metric` (``*_METRICS``,
:func:`metric_table`) beside the code that takes them; a record keeps each one's unit and method
as one line in its ``methods`` (``"ms; median decode step ..."``, :func:`record_methods`), the
format results.json has always had. Code that needs a unit (which metrics an ``objective`` may
name, the docs) reads :attr:`Metric.unit`, never the record's line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, Iterable, Mapping


@dataclass(frozen=True)
class Metric:
    """One metric (or one table, ``tables.<name>``, or one method note) a job may record.
    ``unit``: what its number counts (``ms``, ``bytes``, ``tokens/s``, ``count``, ``ratio``;
    ``text`` for a string; empty for a table or a note); ``method``: how it was taken. A name
    with ``<...>`` parts is a pattern (``<v>_step_ms_ctx<C>``: one per variant and context)."""

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
    """name -> metric, in order; a later declaration of a name refines the earlier one (as a
    task's table refines a shared one: eval's val_loss says how a quantized cache is scored)."""
    return {m.name: m for m in metrics}


def record_methods(metrics: Mapping[str, Metric] | Iterable[Metric]) -> Dict[str, str]:
    """What a record's ``methods`` holds for ``metrics``: name -> ``unit; method``."""
    values = metrics.values() if isinstance(metrics, Mapping) else metrics
    return {m.name: m.text for m in values}


def matches(pattern: str, name: str) -> bool:
    """Whether the metric ``name`` is one of a pattern's (``<v>_step_ms_ctx<C>``: each ``<...>`` part
    stands for a word, ``mha_kv8_step_ms_ctx256``); a name without ``<`` matches only itself."""
    if "<" not in pattern:
        return pattern == name
    regex = "".join(r"\w+" if part.startswith("<") else re.escape(part) for part in re.split(r"(<[^>]+>)", pattern))
    return re.fullmatch(regex, name) is not None
