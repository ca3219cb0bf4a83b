"""The table of a ``task=compare`` record: the variants timed in one process, interleaved, with
paired ratios to the first (and, for a windowed variant, its KV cost below and past W)."""

from __future__ import annotations

from typing import Any, List, Mapping, Tuple

from kvbench.sinks.tables import NO_INTERVAL, NOT_SIGNIFICANT, Record, fmt, interval, ratio_text, with_interval
from kvbench.sinks.views import RecordView


def _contexts(view: RecordView, row: Mapping[str, Any]) -> List[int]:
    """The contexts the job timed (its ``compare.contexts``) that the table has a column for."""
    contexts = view.get("compare.contexts")
    numbers = {c for c in contexts if isinstance(c, int)} if isinstance(contexts, list) else set()
    return sorted(c for c in numbers if f"step_ms_ctx{c}" in row)


def _ratio_cell(row: Mapping[str, Any], key: str, baseline: bool) -> str:
    """A paired ratio with its interval; ``not significant`` where the interval holds 1."""
    if baseline:
        return "1 (baseline)"
    value, ci = row.get(key), interval(row, key)
    if value is None:
        return "-"
    text = ratio_text(value)
    if ci is None:
        return f"{text}, {NO_INTERVAL}"
    return f"{text} [{ci[0]:#.3g}, {ci[1]:#.3g}]" + (f", {NOT_SIGNIFICANT}" if ci[0] <= 1 <= ci[1] else "")


def interleaved_table(record: Record) -> Tuple[List[str], List[List[str]]]:
    """(header, rows) of a ``task=compare`` record's ``tables.compare``; empty for any other record."""
    view = RecordView.of(record)
    rows = view.table("compare")
    contexts = _contexts(view, rows[0]) if rows else []
    if not contexts:
        return [], []
    longest = contexts[-1]
    header = ["variant", *[f"step ms @{c}" for c in contexts], "KV µs / 1k ctx", "slope ratio",
              "KV bytes ratio", f"step ratio @{longest}", f"KV share @{longest}"]
    # a variant by its label (row["layout"]), as its progress line and every other table name it; a
    # record from before the label was kept shows its metric prefix
    out = [[row.get("layout") or row["variant"], *[with_interval(row, f"step_ms_ctx{c}", "{:.3f}") for c in contexts],
            with_interval(row, "decode_us_per_1k_ctx", "{:.1f}"), _ratio_cell(row, "slope_ratio", i == 0),
            ratio_text(row.get("kv_bytes_ratio")), _ratio_cell(row, f"step_ratio_ctx{longest}", i == 0),
            fmt(row.get(f"kv_share_ctx{longest}"), "{:.1%}")] for i, row in enumerate(rows)]
    if any("kv_bytes_per_1k_ctx" in row for row in rows):  # what the cache adds: only layers holding positions
        header.append("KV bytes / 1k ctx")
        for line, row in zip(out, rows):
            line.append(fmt(row.get("kv_bytes_per_1k_ctx"), "bytes"))
    if any(row.get("kv_state_bytes") for row in rows):  # a Gated DeltaNet layer's, whatever the context
        header.append("state / sequence")
        for line, row in zip(out, rows):
            line.append(fmt(row.get("kv_state_bytes"), "bytes"))
    if any("decode_us_per_1k_ctx_past_w" in row for row in rows):  # a windowed variant: below and past W
        W, base = view.metric("window_split_ctx"), rows[0]["kv_bytes_per_1k_ctx_past_w"] or 1
        header += [f"KV µs / 1k ctx ≤{W}", f"KV µs / 1k ctx ≥{W}", f"slope ratio ≥{W} (KV bytes ratio)"]
        for i, (line, row) in enumerate(zip(out, rows)):
            line += [with_interval(row, f"decode_us_per_1k_ctx_{side}_w", "{:.1f}") for side in ("below", "past")]
            line.append(f"{_ratio_cell(row, 'slope_ratio_past_w', i == 0)} "
                        f"({ratio_text((row['kv_bytes_per_1k_ctx_past_w'] or 0) / base)})")
    return header, out


def interleaved_notes(record: Record) -> List[str]:
    """What a reader of :func:`interleaved_table` needs to know: why a ratio has no interval (the
    record's own reason), why a slope, its ratio or a KV share is negative, and what a variant's step
    moves beyond the bytes it holds (its ``kv_step_note``)."""
    view = RecordView.of(record)
    rows = view.table("compare")
    if not rows or not _contexts(view, rows[0]):
        return []
    reasons = sorted({str(row[k]) for row in rows for k in row if k.endswith("_ci_reason") and row[k]
                      and (k.startswith(("slope_ratio", "step_ratio")))})
    notes = [f"{NO_INTERVAL}: {reason}" for reason in reasons]
    slopes = [k for k in ("decode_us_per_1k_ctx", "decode_us_per_1k_ctx_below_w", "decode_us_per_1k_ctx_past_w")
              if any(isinstance(row.get(k), (int, float)) and row[k] < 0 for row in rows)]
    if slopes:
        notes.append("a negative µs / 1k ctx (and the ratio and KV share taken from it): the step time fell as the "
                     "context grew, so the context's cost is smaller than the noise at these contexts (more rounds, "
                     "runtime.repeats, or longer compare.contexts measure it)")
    notes += [f"{row.get('layout') or row['variant']}: {row['kv_step_note']}"
              for row in rows if row.get("kv_step_note")]
    return notes
