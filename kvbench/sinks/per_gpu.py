"""The report's capacity per GPU: each ``task=capacity`` record's ``tables.per_gpu`` (per split of a
node, TP/DP/EP: a rank's KV per token and sequence, the replication, its weights and the sequences
that fit per GPU and per node; computed from the record's configuration, docs/capacity-per-gpu.md)."""

from __future__ import annotations

from typing import List, Sequence

from kvbench.sinks.markdown import md_text
from kvbench.sinks.tables import Record, natural
from kvbench.sinks.views import RecordView
from kvbench.units import human_bytes

HEADER = ["variant", "job", "context", "split", "KV / token / rank", "KV / sequence / rank", "replication",
          "weights / GPU", "KV budget / GPU", "sequences / GPU", "sequences / node"]
KEYS = ("context", "kv_bytes_per_token_rank", "kv_bytes_per_sequence_rank", "kv_replication", "weight_bytes_rank",
        "kv_budget_bytes_gpu", "sequences_per_gpu", "sequences_per_node")


def markdown(records: Sequence[Record]) -> List[str]:
    """The section (nothing when no ok record holds the table); a row missing a figure is left out."""
    views = sorted((RecordView.of(rec) for rec in records), key=lambda v: natural(v.job or ""))
    lines = []
    for view in views:
        if view.status != "ok" or view.task != "capacity":
            continue
        for row in view.table("per_gpu"):
            if not isinstance(row.get("split"), str) or not all(isinstance(row.get(k), (int, float)) for k in KEYS):
                continue
            budget = human_bytes(row["kv_budget_bytes_gpu"]) if row["kv_budget_bytes_gpu"] > 0 else "weights do not fit"
            cells = [view.variant.label, view.job or "", f"{row['context']:,}", row["split"],
                     f"{row['kv_bytes_per_token_rank']:,.0f}", human_bytes(row["kv_bytes_per_sequence_rank"]),
                     f"{row['kv_replication']:.3g}x", human_bytes(row["weight_bytes_rank"]), budget,
                     _count(row["sequences_per_gpu"]), _count(row["sequences_per_node"])]
            lines.append("| " + " | ".join(md_text(c) for c in cells) + " |")
    if not lines:
        return []
    return ["## Capacity per GPU (TP, DP, EP)", "",
            "Per capacity run and split of a node of `capacity.gpus_per_node` GPUs, each GPU's memory the run's "
            "budget: a rank's share of a sequence's KV (heads split over the TP ranks, a layout of fewer heads "
            "than ranks replicated), its weights, and the sequences that fit. Computed from the record's "
            "configuration, not measured (docs/capacity-per-gpu.md).", "",
            "| " + " | ".join(HEADER) + " |", "|---|---|" + "---:|" + "---|" + "---:|" * (len(HEADER) - 4),
            *lines, ""]


def _count(n: float) -> str:
    """``2720`` -> ``2,720``; a share of a GPU to two places: ``8.25``."""
    return f"{n:,.0f}" if float(n).is_integer() else f"{n:,.2f}"
