"""The attention variants of a sweep side by side: a block of rows per cell (one combination of the
other swept axes), a column per variant, each metric's value and its ratio to the cell's baseline
(MHA, else the variant with the most KV heads).

When a ratio is called significant. Every job is a separate process that ran at its own moment of
the machine's load, and a job's own interval (over its trials or steps) leaves out the drift
between jobs: on a loaded machine two runs of one sweep gave GQA's decode p50 2.18x MHA's, then
0.955x, the first read as significant from intervals that did not overlap. So a ratio of timed
figures is judged only on the spread between jobs:

- a variant's figure is the median of its ok jobs in the cell (jobs that differ only in
  :data:`REPEAT_KEYS` repeat one config);
- the ratio is tested (Mann-Whitney, 5%) when both sides have enough jobs for the test to reject at
  all and ran interleaved in time, so that a drift of the machine falls on both alike
  (``kvbench -m runtime.seed=0,1,2,3 attention=mha,gqa,mqa``); otherwise it is *untested*.

Exact figures (bytes, counts) carry no mark.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from kvbench.measure.stats import CONFIDENCE
from kvbench.sinks.tables import (
    COLUMNS,
    KIND_TITLES,
    NOT_SIGNIFICANT,
    VARIANT_KEYS,
    Axis,
    Column,
    Record,
    by_kind,
    fmt,
    job_axes,
    natural,
    ratio_text,
    spec_for,
    swept_axes,
)
from kvbench.sinks.views import RecordView, Variant, in_order

# Keys whose values repeat one measurement rather than change it: a seed draws other weights and
# tokens of the same shapes, which time the same.
REPEAT_KEYS = ("runtime.seed",)
# More jobs of one variant than this in a row (in the order they started) and a drift of the
# machine could fall on one variant only: the ratio is not tested.
MAX_IN_A_ROW = 2
UNTESTED = "untested"
SIGNIFICANT = "significant"
LEGEND = {
    UNTESTED: "untested: separate jobs, whose own intervals leave out the drift between jobs; to test a ratio "
              "repeat each config as 4+ jobs interleaved in time (runtime.seed=0,1,2,3 first in the sweep) or "
              "time the variants in one process (task=compare)",
    SIGNIFICANT: "tested on the spread between repeated jobs (Mann-Whitney, 5%): a timed ratio without a mark is "
                 f"significant, one marked {NOT_SIGNIFICANT} is not",
    "jobs": "jobs: each value is the median of that many ok jobs of one config (runtime.seed repeats a config)",
    "noisy": "noisy: other work competed for the cores around the job (load above its CPUs): its times are "
             "unreliable",
}


def interleaved(a: Sequence[RecordView], b: Sequence[RecordView]) -> bool:
    """Whether two groups of jobs ran interleaved in time: in the order they started (then by job:
    a sweep numbers its jobs in launch order), never more than :data:`MAX_IN_A_ROW` of one group in
    a row. False when a job does not say when it started."""
    jobs = [(r.started_at, natural(r.job or ""), side) for side, group in enumerate((a, b)) for r in group]
    if any(start is None for start, _, _ in jobs):
        return False
    longest = run = 0
    last = None
    for _, _, side in sorted(jobs, key=lambda j: (j[0], j[1])):
        run = run + 1 if side == last else 1
        last, longest = side, max(longest, run)
    return longest <= MAX_IN_A_ROW


def enough_jobs(n_a: int, n_b: int) -> bool:
    """Whether a two-sided rank test can reject at 5% at all: its smallest p-value is
    2 / C(n_a + n_b, n_a) (3 and 3 jobs: 0.1, never; 4 and 4: 0.029)."""
    return n_a >= 1 and n_b >= 1 and 2 / math.comb(n_a + n_b, n_a) <= 1 - CONFIDENCE


def rank_test(a: Sequence[float], b: Sequence[float]) -> float:
    """The two-sided Mann-Whitney p-value; 1 where every value is the same."""
    from scipy.stats import mannwhitneyu  # ~1 s at import: only a sweep of repeated jobs pays it

    p = float(mannwhitneyu(a, b, alternative="two-sided").pvalue)
    return 1.0 if math.isnan(p) else p


@dataclass
class Cell:
    """One combination of the swept axes other than the variant, and its jobs by variant (in the
    order the records came: several when a config was repeated)."""

    values: List[Any]
    jobs: Dict[str, List[RecordView]] = field(default_factory=dict)

    def ok(self, label: Optional[str]) -> List[RecordView]:
        return [r for r in self.jobs.get(label or "", ()) if r.ok]

    def baseline(self) -> Optional[str]:
        """The variant ratios are taken to: MHA, else the most KV heads; of those, unquantized, then
        with every layer over the whole context."""
        ok = [(label, jobs[0].variant) for label, jobs in self.jobs.items() if self.ok(label)]
        if not ok:
            return None
        return max(ok, key=lambda item: (item[1].layout == "mha", item[1].num_kv_heads or 0,
                                         not item[1].quantized, item[1].full_context))[0]


def _numbers(jobs: Sequence[RecordView], key: str) -> List[float]:
    return [n for n in (r.number(key) for r in jobs) if n is not None]


@dataclass
class Comparison:
    """The attention variants of one kind of job side by side: a block of rows per cell, a
    column per variant, in each the metric's value and its ratio to the cell's baseline."""

    kind: str
    axes: List[Axis]
    variants: List[str]
    columns: List[Column]
    cells: List[Cell]
    notes: List[str] = field(default_factory=list)

    def value(self, cell: Cell, label: Optional[str], column: Column) -> Optional[float]:
        """The median of the variant's ok jobs' ``column``."""
        numbers = _numbers(cell.ok(label), column.key)
        return statistics.median(numbers) if numbers else None

    def ratio(self, cell: Cell, label: str, column: Column) -> Optional[float]:
        base = cell.baseline()
        if base is None or label == base or not cell.ok(label):
            return None
        a, b = self.value(cell, label, column), self.value(cell, base, column)
        return a / b if a is not None and b else None

    def sampled(self, cell: Cell, label: str, column: Column) -> bool:
        """Whether ``column`` is a statistic of samples, whose ratio needs a test (bytes and counts are
        exact)."""
        return column.sampled or any(r.declares_interval(column.key)
                                     for r in cell.ok(label) + cell.ok(cell.baseline()))

    def verdict(self, cell: Cell, label: str, column: Column) -> Optional[str]:
        """None for an exact figure; else :data:`SIGNIFICANT`, ``not significant`` or :data:`UNTESTED`."""
        if not self.sampled(cell, label, column):
            return None
        jobs = [[r for r in cell.ok(v) if r.number(column.key) is not None] for v in (label, cell.baseline())]
        if not enough_jobs(*map(len, jobs)) or not interleaved(*jobs):
            return UNTESTED
        a, b = (_numbers(group, column.key) for group in jobs)
        return SIGNIFICANT if rank_test(a, b) <= 1 - CONFIDENCE else NOT_SIGNIFICANT

    def text(self, cell: Cell, label: str, column: Column) -> str:
        """The cell's value and its ratio, marked ``untested`` or ``not significant``."""
        jobs, ok = cell.jobs.get(label), cell.ok(label)
        if not jobs:
            return ""
        if not ok:
            return jobs[0].status
        value = ok[0].metric(column.key) if len(ok) == 1 else self.value(cell, label, column)
        text, ratio = fmt(value, spec_for(ok[0], column)), ratio_text(self.ratio(cell, label, column))
        if not ratio:
            return text
        mark = self.verdict(cell, label, column)
        return f"{text} ({ratio}{f', {mark}' if mark not in (None, SIGNIFICANT) else ''})"

    def jobs_text(self, cell: Cell, label: str) -> str:
        jobs, ok = cell.jobs.get(label, []), cell.ok(label)
        return "" if not jobs else str(len(ok)) if len(ok) == len(jobs) else f"{len(ok)} of {len(jobs)} ok"

    def noisy_text(self, cell: Cell, label: str) -> str:
        flags = [r.metric("noisy") for r in cell.ok(label)]
        if len(flags) == 1:
            return {True: "yes", False: "no"}.get(flags[0], "-")
        return f"{sum(f is True for f in flags)} of {len(flags)}" if flags else ""

    def extra_rows(self) -> List[Tuple[str, Callable[[Cell, str], str]]]:
        """(title, cell text) of the ``jobs`` and ``noisy`` rows, where the comparison needs them."""
        jobs = [r for c in self.cells for group in c.jobs.values() for r in group]
        rows = []
        if any(len(group) > 1 for c in self.cells for group in c.jobs.values()):
            rows.append(("jobs", self.jobs_text))
        if any(r.ok and r.metric("noisy") is True for r in jobs):
            rows.append(("noisy", self.noisy_text))
        return rows

    def legend(self) -> List[str]:
        """What each mark and extra row the table shows means."""
        marks = {self.verdict(c, label, col) for c in self.cells for label in c.jobs for col in self.columns
                 if self.ratio(c, label, col) is not None}
        lines = [LEGEND[UNTESTED]] if UNTESTED in marks else []
        if marks & {SIGNIFICANT, NOT_SIGNIFICANT}:
            lines.append(LEGEND[SIGNIFICANT])
        return lines + [LEGEND[title] for title, _ in self.extra_rows()]

    def variant_of(self, label: str) -> Variant:
        return next(c.jobs[label][0].variant for c in self.cells if label in c.jobs)

    def baselines(self) -> List[str]:
        labels = {b for b in (c.baseline() for c in self.cells) if b}
        return in_order(list(labels), {label: self.variant_of(label) for label in labels})

    def title(self) -> str:
        bases = self.baselines()
        to = (f"{bases[0]} of the same row" if len(bases) == 1
              else "the row's MHA, else its variant with the most KV heads: see 'ratio to'")
        return f"{KIND_TITLES.get(self.kind, self.kind)}: attention variants side by side, value (ratio to {to})"

    def table(self) -> Tuple[List[str], List[List[str]], List[int]]:
        """(header, rows, index of the first row of each cell)."""
        several = len(self.baselines()) > 1
        header = [t for _, t in self.axes] + (["ratio to"] if several else []) + ["metric"] + self.variants
        extra = self.extra_rows()
        rows: List[List[str]] = []
        starts: List[int] = []
        for cell in self.cells:
            columns = [c for c in self.columns
                       if any(r.metric(c.key) is not None for group in cell.jobs.values() for r in group)]
            lines = [[c.title, *(self.text(cell, label, c) for label in self.variants)] for c in columns]
            lines += [[title, *(text(cell, label) for label in self.variants)] for title, text in extra]
            starts.append(len(rows))
            first = [fmt(v, "{}") for v in cell.values] + ([cell.baseline() or "-"] if several else [])
            rows += [(first if i == 0 else [""] * len(first)) + line for i, line in enumerate(lines)]
        return header, rows, starts


def comparisons(records: Sequence[Record], axes: Optional[Sequence[Axis]] = None) -> List[Comparison]:
    """One :class:`Comparison` per kind of job with two or more variants in one cell."""
    axes = list(axes) if axes is not None else swept_axes(records)
    out = []
    for kind_name, group in by_kind(records).items():
        if kind_name == "compare":  # its variants are inside each record: interleaved_table
            continue
        cell_axes = [a for a in job_axes(group, axes)
                     if a[0] not in VARIANT_KEYS + REPEAT_KEYS + ("task", "workload.name")]
        cells: Dict[str, Cell] = {}
        for view in map(RecordView.of, group):
            values = [view.get(key) for key, _ in cell_axes]
            cells.setdefault(repr(values), Cell(values)).jobs.setdefault(view.variant.label, []).append(view)
        if not any(sum(bool(c.ok(label)) for label in c.jobs) >= 2 for c in cells.values()):
            continue
        # A variant with no ok job anywhere (an invalid KV-head count) has nothing to compare.
        ran = {label: jobs[0].variant for c in cells.values() for label, jobs in c.jobs.items() if c.ok(label)}
        failed = sorted({f"{r.label} ({r.status_text}, job {r.job})" for c in cells.values()
                         for label, jobs in c.jobs.items() if label not in ran for r in jobs}, key=natural)
        notes = ["not compared, no ok job: " + ", ".join(failed)] if failed else []
        ordered = sorted(cells.values(), key=lambda c: [natural(repr(v)) for v in c.values])
        out.append(Comparison(kind_name, cell_axes, in_order(list(ran), ran), [c for c in COLUMNS[kind_name]
                              if c.compared] if kind_name in COLUMNS else [], ordered, notes))
    return out
