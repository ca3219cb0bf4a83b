"""The report's serving capacity table: per serving record, the sequences that fit the budget by the
layouts' formula and by the allocator's plan (computed, not measured), beside what the store
allocated and the highest rate within the SLO (measured).
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence

from kvbench.jsonio import as_int
from kvbench.sinks.markdown import md_text
from kvbench.sinks.serving import max_rate_text, serving_records
from kvbench.sinks.tables import Record, natural
from kvbench.sinks.views import RecordView
from kvbench.units import human_bytes

FIGURES = ("kv_budget_bytes", "kv_sequence_positions", "kv_bytes_per_token", "kv_sequence_bytes_formula",
           "kv_sequences_fit_formula", "kv_sequence_reserved_bytes", "kv_sequences_fit", "kv_reserved_bytes",
           "kv_store_bytes")
HEADER = ["variant (with its KV precision)", "allocator", "budget", "context", "bytes / token (formula)",
          "bytes / sequence (formula)", "fit (formula)", "reserved / sequence (allocator's plan)",
          "fit (allocator's plan)", "reserved for them (plan)", "pools reserve (plan)", "store allocated (measured)",
          "highest rate in SLO (measured)"]


def _count(value: Any) -> bool:
    return as_int(value) is not None and value >= 0


def rows(records: Sequence[Record]) -> List[Dict[str, Any]]:
    """One row per ok serving record that holds every capacity figure as a whole number."""
    out = []
    for rec in serving_records(records):
        m = {k: RecordView.of(rec).metric(k) for k in FIGURES}
        if not all(_count(v) for v in m.values()):
            continue
        out.append({**m, "variant": rec.variant.label, "order": rec.variant.order, "job": rec.job,
                    "precision": rec.get("cache.dtype") or "auto", "allocator": rec.metric("kv_allocator") or "?",
                    "rate": max_rate_text(rec) if rec.metric("max_rate_probes") else "-"})
    return sorted(out, key=lambda r: (r["order"], r["precision"], r["allocator"], natural(r["job"])))


def table(found: Sequence[Dict[str, Any]]) -> List[List[str]]:
    b = human_bytes
    return [[r["variant"], r["allocator"], b(r["kv_budget_bytes"]), f"{r['kv_sequence_positions']}",
             f"{r['kv_bytes_per_token']:,}", b(r["kv_sequence_bytes_formula"]), f"{r['kv_sequences_fit_formula']:,}",
             b(r["kv_sequence_reserved_bytes"]), f"{r['kv_sequences_fit']:,}",
             b(r["kv_sequences_fit"] * r["kv_sequence_reserved_bytes"]), b(r["kv_reserved_bytes"]),
             b(r["kv_store_bytes"]), r["rate"]] for r in found]


def markdown(records: Sequence[Record]) -> List[str]:
    """The report's section (nothing when no serving record holds the capacity figures)."""
    found = rows(records)
    if not found:
        return []
    return ["## Serving capacity per layout, KV precision and allocator", "",
            "Per serving run, at its longest request's positions (context): bytes per sequence and the sequences "
            "that fit the budget by the layouts' formula (the positions each layer holds, a constant state once), and "
            "by the run's "
            "allocator (`workload.allocator`): what one sequence reserves at its worst while it decodes (block "
            "rounding, a local layer's ring blocks kept whole, a state page) and how many its pools hold at once. Both "
            "are computed from the record's configuration, not measured; the store's allocated bytes and the "
            "highest rate within the SLO are measured. `experiments/capacity_report.py` gives the same figures "
            "for real models' presets.", "",
            "| " + " | ".join(HEADER) + " |", "|" + "---|" * 2 + "---:|" * (len(HEADER) - 3) + "---|",
            *["| " + " | ".join(md_text(c) for c in row) + " |" for row in table(found)], ""]
