"""What a person sees in the terminal: progress and summary tables (rich, on stderr/stdout).

The tables' data comes from :mod:`kvbench.sinks.tables`; this module only lays it out.
"""

from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

from rich.console import Console, Group
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.text import Text

from kvbench.sinks import recall as recall_sink
from kvbench.sinks.choose import Choice, choices
from kvbench.sinks.comparison import Comparison, comparisons
from kvbench.sinks.grid import Grid
from kvbench.sinks.interleaved import interleaved_notes, interleaved_table
from kvbench.sinks.tables import (
    AXES,
    COLUMNS,
    KIND_TITLES,
    VARIANT_AXIS,
    axis_text,
    by_kind,
    fmt,
    job_cells,
    job_columns,
    natural,
    shown_axes,
    swept_axes,
    table_axes,
    value_text,
    viewed,
)
from kvbench.sinks.views import RecordView, views

PIPED_WIDTH = 100  # columns of output that goes to a file or a pipe, unless COLUMNS says otherwise


def piped_width(environ: Mapping[str, str] = os.environ) -> int:
    """How wide to lay out output that is no terminal's: ``COLUMNS`` where it is a width, else
    :data:`PIPED_WIDTH`, which a CI page or an 80-to-100-column terminal shows without wrapping a
    table's line mid-cell (rich wraps inside cells instead)."""
    columns = environ.get("COLUMNS", "").strip()
    return int(columns) if columns.isdigit() and 20 <= int(columns) <= 1000 else PIPED_WIDTH


def _console(to_stderr: bool) -> Console:
    stream = sys.stderr if to_stderr else sys.stdout
    return Console(stderr=to_stderr, highlight=False, width=None if stream.isatty() else piped_width())


stdout, stderr = _console(False), _console(True)

PROGRESS_LINES = 10  # without a terminal, about this many progress lines per bar
QUIET_S = 60.0  # without a terminal, the longest a job's progress goes without a line (but at a tick)


@contextmanager
def trial_progress(label: str, total: int):
    """Progress over a job's trials or steps; yields ``tick(description=None)``. Without a terminal,
    a plain line every ~1/10 of the way, so a long job is never silent."""
    if not stderr.is_terminal:
        yield _progress_lines(label, total)
        return
    progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=stderr, transient=True)
    with progress:
        task = progress.add_task(label, total=total)
        yield lambda description=None: progress.update(task, advance=1, description=description)


def _progress_lines(label: str, total: int) -> Callable[..., None]:
    every, done, start = max(1, total // PROGRESS_LINES), 0, time.perf_counter()

    def tick(description: Optional[str] = None) -> None:
        nonlocal done
        done += 1
        if done % every == 0 or done == total:
            stderr.print(f"  {label}: {done}/{total}{f' {description}' if description else ''} "
                         f"({time.perf_counter() - start:.0f} s)", markup=False, soft_wrap=True)
    return tick


def progress_bar(label: str, total: int):
    """:func:`trial_progress` when there is more than one trial, else nothing; without a terminal,
    a line as the trials start and one as they end."""
    if total <= 1:
        return nullcontext(None)
    return trial_progress(label, total) if stderr.is_terminal else progress_lines(label, total)


@contextmanager
def progress_lines(label: str, total: int):
    """``  <label>: 0/<total>`` now, then a line every ~1/10 of the way and at any tick a minute or more
    after the last line (with what the tick says: ``compare: prefill 2/7``, ``compare: round 3/10``),
    and ``  <label>: <done>/<total> in <s> s`` at the end: a log of a long job is never silent for long."""
    stderr.print(f"  {label}: 0/{total}", markup=False, soft_wrap=True)
    every, start, done, last = max(1, total // PROGRESS_LINES), time.perf_counter(), [0], [time.perf_counter()]

    def tick(description=None):
        done[0] += 1
        now = time.perf_counter()
        if done[0] < total and (done[0] % every == 0 or now - last[0] >= QUIET_S):
            last[0] = now
            stderr.print(f"  {label}: {done[0]}/{total}{f' {description}' if description else ''} "
                         f"({now - start:.0f} s)", markup=False, soft_wrap=True)

    try:
        yield tick
    finally:
        stderr.print(f"  {label}: {done[0]}/{total} in {time.perf_counter() - start:.1f} s", markup=False,
                     soft_wrap=True)


def run_table(record: Dict[str, Any]) -> Group:
    """A single job as two columns (axes, status, headline metrics), then :func:`record_notes` below
    the table, so that a long reason wraps instead of pushing the values off to the right."""
    record = RecordView(viewed(record))
    # the keys the job's kind reads; the variant by its label, as its progress line named it
    axes = [a for a in shown_axes([a for a in AXES if record.get(a[0]) is not None])
            if a != VARIANT_AXIS or record.variant.named]
    rows = [[name, axis_text(record, key)] for key, name in axes] + [["status", record.status_text]]
    metrics = record.metrics
    for column in COLUMNS.get(record.kind, COLUMNS["decode"]):
        if metrics.get(column.key) is not None:
            rows.append([column.title, value_text(record, column)])
    notes = [Text.from_markup(f"{key}: {text}") for key, text in record_notes(record)]
    table = Grid("kvbench result", ["key", "value"], rows, right={1}, show_header=False, key_style="bold")
    return Group(table, *notes)


def record_notes(record: Any) -> List[tuple]:
    """(key, text) a person must read beside the figures (warnings, noise, a KV conversion,
    implausible figures, nulls and their reasons), markup included."""
    record = RecordView.of(record)
    metrics = record.metrics
    rows = [(f"[yellow]{key}[/]", f"[yellow]{escape(str(metrics[key]))}[/]")
            for key in sorted(k for k in metrics if k.endswith("_warning") or k == "noisy_reason") if metrics[key]]
    conversion = record.kv_conversion
    if conversion:
        text = escape(str(conversion.get("text", dict(conversion))))
        rows.append(("[yellow]kv_conversion[/]", f"[yellow]{text}[/]"))
    for item in record.implausible:
        rows.append((f"[red]implausible {escape(str(item.get('metric')))}[/]",
                     f"[red]{escape(str(item.get('reason')))}[/]"))
    reasons = record.null_reasons
    for name in sorted(reasons):
        if record.metrics.get(name, 0) is None and reasons[name] not in ("nan", "inf", "-inf"):
            rows.append((f"null {escape(name)}", escape(str(reasons[name]))))
    return rows


_STATUS_STYLE = {"ok": "green", "invalid": "yellow", "oom": "magenta", "running": "cyan"}


def jobs_table(title: str, records: Sequence[Dict[str, Any]], axes, kind_name: str) -> Grid:
    """One row per job of one kind: the varying axes (the variant by its label), status and the kind's
    brief columns; the job and its axes name each row of every table the columns are split into."""
    axes = table_axes(records, axes, kind_name)
    columns = job_columns(records, kind_name, brief=True)
    rows: List[List[Any]] = []
    for rec in views(records):
        values, metrics = job_cells(rec, axes, columns)
        status = Text(rec.status_text, style=_STATUS_STYLE.get(rec.status, "red"))
        rows.append([rec.job or "", *values, status, *metrics])
    header = ["job", *(name for _, name in axes), "status", *(c.title for c in columns)]
    return Grid(title, header, rows, keys=1 + len(axes), right=range(len(header) - len(columns), len(header)))


def comparison_table(comparison: Comparison) -> Grid:
    """The variants of each cell side by side (as many as fit a table, the cell and metric repeated)."""
    header, rows, starts = comparison.table()
    first = len(header) - len(comparison.variants)
    return Grid(comparison.title(), header, rows, keys=first, right=range(first, len(header)),
                sections={i - 1 for i in starts}, caption="\n".join(comparison.legend() + comparison.notes) or None)


def choice_tables(choice: Choice) -> List[Grid]:
    """The article's comparison with measured numbers and its recommendations; then the multi-turn
    capacity when measured."""
    lines = [f"{scenario}: {line}" for scenario, line in choice.recommendations] + choice.notes
    cell = f" ({choice.cell})" if choice.cell else ""
    tables = []
    for title, header, rows, caption in (
            ("which attention to deploy", choice.header, choice.rows, "\n".join(lines) or None),
            ("max batch by context", choice.context_header, choice.context_rows, None),
            ("multi-turn: concurrent conversations", choice.chat_header, choice.chat_rows, None)):
        if not header:
            continue
        tables.append(Grid(title + cell, header, rows, right=range(1, len(header)), caption=caption))
    return tables


def sweep_tables(title: str, records: Sequence[Dict[str, Any]]) -> List[Grid]:
    """The end of a sweep: one table of jobs per kind, in job order (2 before 10), then the
    comparisons."""
    records = sorted((viewed(r) for r in records), key=lambda r: natural(RecordView(r).job or ""))
    axes = swept_axes(records)
    groups = by_kind(records)
    tables = [jobs_table(f"{title}: {KIND_TITLES.get(k, k)}" if len(groups) > 1 else title, group, axes, k)
              for k, group in groups.items()]
    tables += [comparison_table(c) for c in comparisons(records, axes)]
    tables += [t for c in choices(records) for t in choice_tables(c)]
    tables += [recall_table(g) for g in recall_sink.groups(records)]
    ttft = ttft_comparison_table(records)
    return tables + ([ttft] if ttft is not None else [])


def recall_table(group: Sequence[Dict[str, Any]]) -> Grid:
    """``task=recall`` records of one setting: accuracy per condition per variant, gaps, costs."""
    header, rows = recall_sink.recall_table(group)
    costs = sum(row[0] in recall_sink.COST_ROWS for row in rows)  # the conditions, then KV / token and decode
    return Grid(recall_sink.title(group), header, rows, right=range(1, len(header)), sections={len(rows) - costs - 1},
                caption=recall_sink.COPY_NOTE)


def variants_table(record: Dict[str, Any]) -> Grid:
    """A ``task=compare`` record's variants, with what its ratios and shares mean below."""
    header, rows = interleaved_table(record)
    rounds = RecordView.of(record).metric("rounds")
    return Grid(f"interleaved comparison: {rounds} rounds, median [95% interval]; ratios to the first variant, "
                "paired over rounds", header, rows, right=range(1, len(header)),
                caption="\n".join(interleaved_notes(record)) or None)


# (row key, column title, format)
TURN_COLUMNS = [
    ("turn", "turn", "{}"), ("ttft_ms", "TTFT ms", "{:.2f}"), ("prefill_tokens", "prefill", "{:,}"),
    ("reused_tokens", "reused", "{:,}"), ("context_tokens", "context", "{:,}"),
    ("decode_ms_p50", "decode p50 ms", "{:.3f}"), ("kv_cache_bytes", "KV cache", "bytes"),
    ("kv_cache_bytes_formula", "KV formula", "bytes"),
]


def turns_table(record: Dict[str, Any]) -> Grid:
    """A multi-turn job's ``tables.turns`` (token counts summed over the batch, context per
    conversation)."""
    record = RecordView.of(record)
    rows = [[fmt(row.get(key), spec) for key, _, spec in TURN_COLUMNS] for row in record.table("turns")]
    return Grid(f"turns (cache.shared={record.get('cache.shared')})", [name for _, name, _ in TURN_COLUMNS], rows,
                right=range(len(TURN_COLUMNS)))


CONVERSATION_TURN_COLUMNS = [
    ("turn", "turn", "{}"), ("turns", "turns", "{}"), ("ttft_ms_p50", "p50 TTFT ms", "{:.2f}"),
    ("ttft_ms_p90", "p90 TTFT ms", "{:.2f}"), ("prefix_hit_rate", "prefix hits", "{:.0%}"), ("cached", "cached", "{}"),
    ("evicted", "evicted", "{}"), ("ttft_ms_p50_cached", "p50 TTFT cached", "{:.2f}"),
    ("ttft_ms_p50_evicted", "p50 TTFT evicted", "{:.2f}"),
]


def conversation_turns_table(record: Dict[str, Any]) -> Grid:
    """A conversation job's ``tables.conversation_turns``."""
    record = RecordView.of(record)
    rows = [[fmt(row.get(key), spec) for key, _, spec in CONVERSATION_TURN_COLUMNS]
            for row in record.table("conversation_turns")]
    return Grid("turns of the conversations", [name for _, name, _ in CONVERSATION_TURN_COLUMNS], rows,
                right=range(len(CONVERSATION_TURN_COLUMNS)))


def ttft_side_by_side(records: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Per turn of records that differ only in ``cache.shared``: TTFT without and with sharing."""
    groups: Dict[str, Dict[bool, RecordView]] = {}
    for rec in views(records):
        if not rec.ok or not rec.table("turns"):
            continue
        config = {k: v for k, v in rec.config.items() if k != "cache"}
        config["cache_impl"] = rec.get("cache.impl")
        groups.setdefault(repr(config), {})[bool(rec.shared)] = rec
    rows = []
    for pair in groups.values():
        if set(pair) != {False, True}:
            continue
        off, on = pair[False], pair[True]
        label = off.variant.label
        for a, b in zip(off.table("turns"), on.table("turns")):
            rows.append({"variant": label, "turn": a["turn"], "ttft_ms_unshared": a["ttft_ms"],
                         "ttft_ms_shared": b["ttft_ms"], "speedup": a["ttft_ms"] / b["ttft_ms"],
                         "prefill_tokens_unshared": a["prefill_tokens"], "prefill_tokens_shared": b["prefill_tokens"]})
    return rows


def ttft_comparison_table(records: Sequence[Dict[str, Any]]) -> Optional[Grid]:
    """:func:`ttft_side_by_side` as a table; None when no pair differs only in ``cache.shared``."""
    rows = ttft_side_by_side(records)
    if not rows:
        return None
    header = ["variant", "turn", "TTFT ms unshared", "TTFT ms shared", "unshared / shared", "prefilled unshared",
              "prefilled shared"]
    cells = [[r["variant"], str(r["turn"]), f"{r['ttft_ms_unshared']:.2f}", f"{r['ttft_ms_shared']:.2f}",
              f"{r['speedup']:.2f}x", f"{r['prefill_tokens_unshared']:,}", f"{r['prefill_tokens_shared']:,}"]
             for r in rows]
    return Grid("multi-turn TTFT: cache.shared=false vs true", header, cells, keys=2, right=range(1, len(header)))
