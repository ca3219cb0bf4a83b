"""What a person sees in the terminal: progress bars and summary tables (rich, on stderr/stdout)."""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager, nullcontext
from typing import Any, Dict, Iterable, List, Optional, Sequence

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvbench.results import lookup
from kvbench.units import human_bytes

# A log file or CI page is not 80 columns wide: let sweep tables breathe there.
stdout = Console(highlight=False, width=None if sys.stdout.isatty() else 200)
stderr = Console(stderr=True, highlight=False, width=None if sys.stderr.isatty() else 200)

# (metric key, column title, format) shown for every job: the headline numbers.
HEADLINE = [
    ("prefill_ms", "TTFT ms", "{:.2f}"),
    ("decode_ms_p50", "decode p50 ms", "{:.3f}"),
    ("decode_ms_p99", "p99 ms", "{:.3f}"),
    ("tokens_per_s", "tok/s", "{:.1f}"),
    ("percent_of_peak", "% BW peak", "{:.0f}"),
    ("kv_cache_bytes", "KV cache", "bytes"),
    ("kv_cache_bytes_formula", "KV formula", "bytes"),
    ("peak_rss_bytes", "peak RSS", "bytes"),
    ("torch_peak_allocated_bytes", "CUDA peak", "bytes"),
    ("fidelity_max_abs_logit_diff", "cache Δlogit", "{:.2e}"),
    ("dtype_max_abs_logit_diff", "vs fp32 Δlogit", "{:.2e}"),
    ("dtype_top1_agreement", "vs fp32 top-1", "{:.1%}"),
    ("val_loss", "val loss", "{:.4f}"),
    ("ppl_before_uptrain", "ppl before uptrain", "{:.3f}"),
    ("perplexity", "perplexity", "{:.3f}"),
    ("bits_per_byte", "bits/byte", "{:.3f}"),
]
# The columns of a sweep table (one row per job; summary.csv has every metric).
SWEEP_HEADLINE = ["prefill_ms", "decode_ms_p50", "tokens_per_s", "percent_of_peak", "kv_cache_bytes",
                  "dtype_max_abs_logit_diff", "ppl_before_uptrain", "perplexity"]
# (config path, column title) identifying a job in a sweep table.
AXES = [
    ("attention.type", "attn"), ("attention.num_kv_heads", "kv"), ("workload.name", "workload"),
    ("workload.batch_size", "B"), ("workload.prompt_len", "prompt"), ("runtime.dtype", "dtype"),
    ("cache.impl", "cache"), ("cache.shared", "shared"), ("model.name", "model"), ("task", "task"),
    ("workload.system_len", "system"), ("workload.turns", "turns"), ("train.steps", "train steps"),
]


def relevant(key: str, config: Dict[str, Any]) -> bool:
    """Whether an axis means anything for this job (no prompt_len for a chat, no cache for training)."""
    task, workload = config.get("task", "bench"), lookup(config, "workload.name")
    if key.startswith("train."):
        return task == "train"
    if key.startswith(("workload.", "cache.")) and task in ("train", "eval"):
        return False
    if key in ("workload.prompt_len",):
        return workload == "decode"
    if key in ("cache.shared", "workload.system_len", "workload.turns"):
        return workload == "multiturn"
    return True


def fmt(value: Any, spec: str) -> str:
    if value is None:
        return "-"
    if spec == "bytes":
        return human_bytes(value)
    try:
        return spec.format(value)
    except (TypeError, ValueError):
        return str(value)


@contextmanager
def trial_progress(label: str, total: int):
    """A transient progress bar over a job's trials or steps; yields ``tick(description=None)``."""
    progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=stderr, transient=True)
    with progress:
        task = progress.add_task(label, total=total)
        yield lambda description=None: progress.update(task, advance=1, description=description)


def run_table(record: Dict[str, Any]) -> Table:
    """A single job as two columns: its axes, status, headline metrics (for one run)."""
    table = Table(title="kvbench result", title_justify="left", show_header=False)
    table.add_column("key", style="bold")
    table.add_column("value", justify="right")
    config = record.get("config", {})
    for key, name in AXES:
        if relevant(key, config):
            table.add_row(name, fmt(lookup(config, key), "{}"))
    table.add_row("status", record.get("status", "?"))
    metrics = record.get("metrics", {})
    for key, name, spec in HEADLINE:
        if metrics.get(key) is not None:
            table.add_row(name, fmt(metrics[key], spec))
    return table


def progress_bar(label: str, total: int):
    """:func:`trial_progress` when there is more than one trial to show, else nothing. Where
    stderr is no terminal (a log file, a pipe) a bar would not show: a line as the trials
    start and one as they end instead."""
    if total <= 1:
        return nullcontext(None)
    return trial_progress(label, total) if stderr.is_terminal else progress_lines(label, total)


@contextmanager
def progress_lines(label: str, total: int):
    """``  <label>: 0/<total>`` now and ``  <label>: <done>/<total> in <s> s`` at the end."""
    stderr.print(f"  {label}: 0/{total}", markup=False, soft_wrap=True)
    start, done = time.perf_counter(), [0]

    def tick(description=None):
        done[0] += 1

    try:
        yield tick
    finally:
        stderr.print(f"  {label}: {done[0]}/{total} in {time.perf_counter() - start:.1f} s", markup=False,
                     soft_wrap=True)


def results_table(title: str, records: Sequence[Dict[str, Any]], extra: Iterable = ()) -> Table:
    """One row per results.json record: the axes that vary across records, status and
    headline metrics (columns no record has are left out)."""
    table = Table(title=title, title_justify="left")
    table.add_column("job")
    axes = [(key, name) for key, name in AXES
            if len({repr(lookup(r.get("config", {}), key)) for r in records}) > 1] or AXES[:2]
    for _, name in axes:
        table.add_column(name)
    table.add_column("status")
    columns: List = [c for c in [h for h in HEADLINE if h[0] in SWEEP_HEADLINE] + list(extra)
                     if any(r.get("metrics", {}).get(c[0]) is not None for r in records)]
    for _, name, _ in columns:
        table.add_column(name, justify="right")
    for rec in records:
        metrics = rec.get("metrics", {})
        status = rec.get("status", "?")
        style = {"ok": "green", "invalid": "yellow", "oom": "magenta", "running": "cyan"}.get(status, "red")
        row = [str(rec.get("job", ""))] + [fmt(lookup(rec.get("config", {}), key), "{}") for key, _ in axes]
        row.append(f"[{style}]{status}[/]")
        row += [fmt(metrics.get(key), spec) for key, _, spec in columns]
        table.add_row(*row)
    return table


# (row key, column title, format) of a multi-turn chat's per-turn table.
TURN_COLUMNS = [
    ("turn", "turn", "{}"), ("ttft_ms", "TTFT ms", "{:.2f}"), ("prefill_tokens", "prefill", "{:,}"),
    ("reused_tokens", "reused", "{:,}"), ("context_tokens", "context", "{:,}"),
    ("decode_ms_p50", "decode p50 ms", "{:.3f}"), ("kv_cache_bytes", "KV cache", "bytes"),
    ("kv_cache_bytes_formula", "KV formula", "bytes"),
]


def turns_table(record: Dict[str, Any]) -> Table:
    """A multi-turn job's ``tables.turns``: one row per turn (token counts summed over the
    batch, context per conversation)."""
    shared = lookup(record.get("config", {}), "cache.shared")
    table = Table(title=f"turns (cache.shared={shared})", title_justify="left")
    for _, name, _ in TURN_COLUMNS:
        table.add_column(name, justify="right")
    for row in record["tables"]["turns"]:
        table.add_row(*[fmt(row.get(key), spec) for key, _, spec in TURN_COLUMNS])
    return table


def ttft_side_by_side(records: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Pair results.json records that differ only in ``cache.shared``: per turn, TTFT without
    and with sharing and their ratio. Records without a turns table are ignored."""
    groups: Dict[str, Dict[bool, Dict[str, Any]]] = {}
    for rec in records:
        if rec.get("status") != "ok" or not (rec.get("tables") or {}).get("turns"):
            continue
        config = {k: v for k, v in rec["config"].items() if k != "cache"}
        config["cache_impl"] = lookup(rec["config"], "cache.impl")
        groups.setdefault(repr(config), {})[bool(lookup(rec["config"], "cache.shared"))] = rec
    rows = []
    for pair in groups.values():
        if set(pair) != {False, True}:
            continue
        off, on = pair[False], pair[True]
        label = f"{lookup(off['config'], 'attention.type')} kv={lookup(off['config'], 'attention.num_kv_heads')}"
        for a, b in zip(off["tables"]["turns"], on["tables"]["turns"]):
            rows.append({"variant": label, "turn": a["turn"], "ttft_ms_unshared": a["ttft_ms"],
                         "ttft_ms_shared": b["ttft_ms"], "speedup": a["ttft_ms"] / b["ttft_ms"],
                         "prefill_tokens_unshared": a["prefill_tokens"], "prefill_tokens_shared": b["prefill_tokens"]})
    return rows


def ttft_comparison_table(records: Sequence[Dict[str, Any]]) -> Optional[Table]:
    """TTFT per turn without and with ``cache.shared`` side by side, for every pair of
    multi-turn records that differ only in it; None when there is no such pair."""
    rows = ttft_side_by_side(records)
    if not rows:
        return None
    table = Table(title="multi-turn TTFT: cache.shared=false vs true", title_justify="left")
    for name in ("variant", "turn", "TTFT ms unshared", "TTFT ms shared", "unshared / shared",
                 "prefilled unshared", "prefilled shared"):
        table.add_column(name, justify="left" if name == "variant" else "right")
    for r in rows:
        table.add_row(r["variant"], str(r["turn"]), f"{r['ttft_ms_unshared']:.2f}", f"{r['ttft_ms_shared']:.2f}",
                      f"{r['speedup']:.2f}x", f"{r['prefill_tokens_unshared']:,}", f"{r['prefill_tokens_shared']:,}")
    return table
