""""Which attention should I deploy?": the article's comparison table filled with measured numbers.

From the ``task=capacity`` records of a sweep over attention (``experiment=choose``), one table per
combination of the other swept axes, plus the quality and serving figures the same records hold.
Each recommendation is derived from the numbers by :data:`RULES` (quoted in docs/capacity.md):
nothing here names a variant.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from kvbench.jsonio import as_int
from kvbench.sinks.serving import max_rate_by_variant
from kvbench.sinks.tables import VARIANT_KEYS, Record, fmt, natural, ratio_text, swept_axes
from kvbench.sinks.views import RecordView

AMPLE_SHARE = 0.5
RULES = {
    "memory ample": f"the variant with the most KV heads (closest to MHA's quality) whose max batch at the "
                    f"longest context is at least {AMPLE_SHARE:.0%} of the largest",
    "memory tight": "the variant with the largest max batch at the longest context (a tie: more KV heads)",
    "multi-turn": "the variant and cache.shared setting with the most concurrent conversations in this sweep's "
                  "task=capacity workload=multiturn jobs (a tie: more KV heads, then cache.shared=true); without "
                  "them, the memory-tight choice, with cache.shared=true when workload=multiturn bench jobs show it "
                  "lowering the mean TTFT of turns 2-N (else: not measured here)",
}
# The KV bytes per token column: one figure at a stated length (a layout with local layers depends on it)
KV_PER_TOKEN = "KV / token (at longest)"
# A state layer's bytes per sequence, whatever its length (Gated DeltaNet): a column where a variant has one
STATE = "state / sequence"
# What tells the rows of one table apart, not the tables: every field of a variant (views.VARIANT_KEYS),
# the kind of job and the shared cache.
_NOT_CELL = (*VARIANT_KEYS, "task", "workload.name", "cache.shared")


@dataclass
class Choice:
    """The article's table for one cell of the sweep and the recommendations it supports."""

    cell: str  # the other swept axes' values, "" when there are none
    header: List[str]
    rows: List[List[str]]
    recommendations: List[Tuple[str, str]]  # (scenario, one line)
    notes: List[str] = field(default_factory=list)
    chat_header: List[str] = field(default_factory=list)  # the multi-turn capacity table (empty: none)
    chat_rows: List[List[str]] = field(default_factory=list)
    # max batch (and what stopped it) per variant at every context: the capacity as a function of context
    context_header: List[str] = field(default_factory=list)
    context_rows: List[List[str]] = field(default_factory=list)


def _m(rec: Record, key: str) -> Any:
    return RecordView.of(rec).metric(key)


def _max_batch(rec: Record) -> Optional[int]:
    """The record's largest batch at the longest context, when it is a count >= 0: a value read back
    is checked, not trusted."""
    value = _m(rec, "max_batch_longest")
    return value if as_int(value) is not None and value >= 0 else None


def _longest(rec: Record) -> Optional[Mapping[str, Any]]:
    rows = [r for r in RecordView.of(rec).table("capacity")
            if isinstance(r.get("context"), int) and not isinstance(r.get("context"), bool)]
    return max(rows, key=lambda r: r["context"]) if rows else None


def _quality(records: Sequence[Record]) -> Dict[str, str]:
    """Perplexity per variant from the ok train/eval records (the last one of a variant wins), each
    cell naming its source: the job of a model of that variant's own layout."""
    out: Dict[str, str] = {}
    for rec in map(RecordView.of, records):
        if rec.kind in ("train", "eval") and rec.ok and rec.metric("perplexity") is not None:
            out[rec.variant.label] = f"{rec.metric('perplexity'):.3f} (task={rec.kind}, job {rec.job})"
    return out


# The short word of a pooled figure's source in its cell (the record's quality_source says it in full)
SOURCE_WORDS = {"pooled, not uptrained": "pooled, not uptrained", "pooled": "pooled", "MHA itself": "MHA itself",
                "the checkpoint's own": "the checkpoint's own heads"}


def _pooled(rec: RecordView) -> Tuple[Optional[float], Optional[float], str, Optional[str]]:
    """(KL, top-1, source word, why none) of a capacity record's pooled quality: only a figure measured
    on a model of the variant's own layouts (its quality_source). A record written before issue 59 has
    no source: its figure stands where pooling makes the variant (K/V heads over the whole context or a
    window, no recurrent layer, no compressed K/V, no layer option), else it was another model's."""
    kl, top1 = rec.metric("kv_pool_kl_nats"), rec.metric("kv_pool_top1_agreement")
    source, reason = rec.metric("quality_source"), rec.metric("quality_none_reason")
    if kl is None:
        return None, None, "none" if reason else "-", reason
    if source is None:
        v = rec.variant
        if v.stateful or not v.counts_kv_heads or v.options:
            return None, None, "none", ("a record before issue 59: its pooled figure was measured on a model "
                                        "without this variant's own layers")
        return kl, top1, "pooled", None
    return kl, top1, next((w for k, w in SOURCE_WORDS.items() if str(source).startswith(k)), str(source)), None


def _recall(records: Sequence[Record]) -> Dict[str, str]:
    """Recall accuracy [95% interval over seeds] per variant from the ok task=recall records."""
    out: Dict[str, str] = {}
    for rec in map(RecordView.of, records):
        if rec.kind == "recall" and rec.ok and rec.metric("accuracy") is not None:
            low, high = rec.metric("accuracy_ci_low"), rec.metric("accuracy_ci_high")
            out[rec.variant.label] = fmt(rec.metric("accuracy"), "{:.3f}") + (
                f" [{low:.3f}, {high:.3f}]" if low is not None and high is not None else "")
    return out


def is_chat(rec: Record) -> bool:
    """A ``task=capacity`` record of the multi-turn chat (its max batch counts conversations)."""
    return RecordView.of(rec).workload == "multiturn"


def decode_capacity(records: Sequence[Record]) -> List[Record]:
    """The ``task=capacity`` records of workload=decode: the article's table and the plot."""
    return [r for r in records if RecordView.of(r).kind == "capacity" and not is_chat(r)]


def chat_capacity(rows: Dict[Tuple[str, bool], Dict[str, Any]]) -> Optional[str]:
    """The multi-turn line from (variant, shared) -> {max_batch, kv_heads, ...} by :data:`RULES`."""
    ranked = [(key, r) for key, r in rows.items() if r.get("max_batch") is not None]
    if not ranked:
        return None
    (label, shared), best = max(ranked, key=lambda item: (item[1]["max_batch"], item[1]["kv_heads"], item[0][1]))
    other = rows.get((label, not shared), {}).get("max_batch")
    versus = (f" vs {other} with cache.shared={str(not shared).lower()}" if other is not None
              else f" (cache.shared={str(not shared).lower()} not measured)")
    return (f"{label} with cache.shared={str(shared).lower()}: the most concurrent conversations, "
            f"{best['max_batch']}{versus}")


def _multiturn(records: Sequence[Record]) -> Optional[str]:
    """The measured effect of cache.shared on turns 2-N, or None without both modes."""
    ttft: Dict[bool, List[float]] = {}
    for rec in map(RecordView.of, records):
        if rec.kind == "multiturn" and rec.ok and rec.metric("mean_ttft_ms_turns_2_n") is not None:
            ttft.setdefault(bool(rec.shared), []).append(rec.metric("mean_ttft_ms_turns_2_n"))
    if not (ttft.get(True) and ttft.get(False)):
        return None
    shared, unshared = min(ttft[True]), min(ttft[False])
    return (f"cache.shared=true: mean TTFT of turns 2-N {shared:.2f} ms vs {unshared:.2f} ms unshared "
            f"({ratio_text(shared / unshared)})" if shared < unshared else
            f"cache.shared=false: sharing did not lower the mean TTFT of turns 2-N ({shared:.2f} vs {unshared:.2f} ms)")


def recommend(rows: Dict[str, Dict[str, Any]], multiturn: Optional[str],
              chat: Optional[str] = None) -> List[Tuple[str, str]]:
    """The scenario lines from per-variant numbers (``max_batch``, ``kv_heads``), by :data:`RULES`;
    ``chat``: the line from multi-turn capacity jobs (:func:`chat_capacity`), which wins."""
    ranked = [(label, r) for label, r in rows.items() if r.get("max_batch") is not None]
    if not ranked:
        return [("all", "no ok capacity job: nothing to recommend")]
    best = max(r["max_batch"] for _, r in ranked)
    # ties: more KV heads, then every layer seeing the whole context (a local layer sees less)
    tight_label, tight = max(ranked, key=lambda item: (item[1]["max_batch"], item[1]["kv_heads"],
                                                       item[1].get("full_context", True)))
    ample = [(label, r) for label, r in ranked if r["max_batch"] >= AMPLE_SHARE * best]
    ample_label, ample_row = max(ample, key=lambda item: (item[1]["kv_heads"], item[1].get("full_context", True)))
    lines = [
        ("memory ample", f"{ample_label}: the most KV heads with a max batch of {ample_row['max_batch']} "
                         f"(>= {AMPLE_SHARE:.0%} of the best, {best})"),
        ("memory tight", f"{tight_label}: the largest max batch, {tight['max_batch']}"
                         + (f" ({ratio_text(tight['max_batch'] / rows[_baseline(rows)]['max_batch'])} "
                            f"{_baseline(rows)})" if rows[_baseline(rows)].get("max_batch") else "")),
        ("multi-turn", chat or f"{tight_label} with " + (
            multiturn or "cache.shared=true is the article's advice, not measured here: no workload=multiturn "
                         "jobs with cache.shared=false,true")),
    ]
    return lines


def _baseline(rows: Dict[str, Dict[str, Any]]) -> str:
    return max(rows, key=lambda label: rows[label]["kv_heads"])


def choices(records: Sequence[Record]) -> List[Choice]:
    """One :class:`Choice` per cell of the sweep's ``task=capacity`` records."""
    capacity = decode_capacity(records)
    if not capacity:
        return []
    axes = [a for a in swept_axes(capacity) if a[0] not in _NOT_CELL]
    quality = _quality(records)
    multiturn = _multiturn(records)
    cells: Dict[str, List[Record]] = {}
    chats: Dict[str, List[Record]] = {}
    for rec in records:
        if RecordView.of(rec).kind == "capacity":
            cell = " ".join(f"{t}={fmt(RecordView.of(rec).get(k), '{}')}" for k, t in axes)
            (chats if is_chat(rec) else cells).setdefault(cell, []).append(rec)
    out = []
    for cell in sorted(cells, key=natural):
        out.append(_choice(cell, cells[cell], quality, multiturn, chats.get(cell, []), records))
    return out


CHAT_HEADER = ["variant", "cache.shared", "positions / conversation", "KV / conversation", "max conversations",
               "stopped by", "memory-only prediction", "TTFT ms at max", "TPOT ms at max"]


def _chat_table(records: Sequence[Record]) -> Tuple[Dict[Tuple[str, bool], Dict[str, Any]], List[List[str]]]:
    """(variant, shared) -> numbers, and the rows of the multi-turn capacity table."""
    rows: Dict[Tuple[str, bool], Dict[str, Any]] = {}
    table = []
    for rec in sorted(map(RecordView.of, records), key=lambda r: (r.variant.order, bool(r.shared))):
        if not rec.ok or not _longest(rec):
            continue
        shared, row, label = bool(rec.shared), _longest(rec), rec.variant.label
        rows[(label, shared)] = {"max_batch": _max_batch(rec),
                                 "kv_heads": rec.variant.num_kv_heads or 0}
        table.append([label, str(shared).lower(), fmt(row.get("context"), "{}"),
                      fmt(row.get("kv_bytes_per_sequence"), "bytes"), fmt(row.get("max_batch"), "{}"),
                      fmt(row.get("stopped_by"), "{}"), fmt(row.get("predicted_max_batch"), "{}"),
                      fmt(row.get("ttft_ms_at_max"), "{:.1f}"), fmt(row.get("tpot_ms_at_max"), "{:.1f}")])
    return rows, table


def _choice(cell: str, records: Sequence[Record], quality: Dict[str, str], multiturn: Optional[str],
            chat_records: Sequence[Record] = (), all_records: Sequence[Record] = ()) -> Choice:
    rows: Dict[str, Dict[str, Any]] = {}
    notes = []
    for rec in sorted(map(RecordView.of, records), key=lambda r: r.variant.order):
        variant = rec.variant
        label = variant.label
        if not rec.ok:
            notes.append(f"{rec.label}: {rec.status_text} (job {rec.job})")
            continue
        longest = _longest(rec) or {}
        # the figure at the longest probe's length (tasks/capacity_search.kv_bytes_per_token); an older
        # record without kv_bytes_per_token_positions gets the same definition from its longest row
        kv_per_token = _m(rec, "kv_bytes_per_token")
        positions = (longest.get("context") or 0) + (rec.get("workload.gen_len") or 0)
        if (not variant.full_context and _m(rec, "kv_bytes_per_token_positions") is None
                and isinstance(longest.get("kv_bytes_per_sequence"), (int, float)) and positions):
            kv_per_token = longest["kv_bytes_per_sequence"] / positions
        rows[label] = {"kv_heads": variant.num_kv_heads or 0, "mha": variant.layout == "mha",
                       "full_context": variant.full_context, "beyond_heads": not variant.ranked_by_kv_heads,
                       "linear": variant.stateful,
                       "state": _m(rec, "kv_state_bytes_per_sequence"), "by_context": _by_context(rec),
                       "kv_per_token": kv_per_token, "untested": longest.get("tpot_untested"),
                       # a capacity the paired steps do not support is no number to rank by (issue 59)
                       "max_batch": None if longest.get("tpot_untested") else _max_batch(rec),
                       "stopped_by": _m(rec, "stopped_by_longest"), "context": longest.get("context"),
                       "decode_ms": _m(rec, "decode_ms_p50_longest"), "tokens_per_s": _m(rec, "tokens_per_s_longest"),
                       "predicted": longest.get("predicted_max_batch"),
                       # runtime.tensor_parallel / expert_parallel: a GPU's part under the job's split (formula)
                       "split": _m(rec, "gpu_split"), "gpu_kv": _m(rec, "kv_bytes_per_token_gpu"),
                       "gpu_seqs": _m(rec, "sequences_per_gpu"),
                       **dict(zip(("kl", "top1", "source", "no_quality"), _pooled(rec)))}
    with_state = any(r["state"] for r in rows.values())
    header = ["variant", KV_PER_TOKEN, "vs MHA", *([STATE] if with_state else []), "context", "decode p50 ms (B=1)",
              "tok/s at max batch", "max batch", "stopped by", "memory-only prediction"]
    splits = sorted({r["split"] for r in rows.values() if r["split"]})
    if splits:
        header += ["KV / token / GPU", "seqs / GPU"]
        notes.append(f"per GPU ({', '.join(splits)}: runtime.tensor_parallel / expert_parallel): a GPU's part of a "
                     "token's KV (heads split over the TP ranks, a layout of fewer heads than ranks replicated) and "
                     "the sequences at the longest context a GPU holds its part of, its memory budget less its "
                     "weights, by formula (kv_bytes_per_token_gpu, sequences_per_gpu)")
    with_pool = any(r["kl"] is not None or r["no_quality"] for r in rows.values())
    if with_pool:
        header += ["quality: KL vs MHA, nats (pooled)", "top-1 = MHA (pooled)", "quality source"]
        notes.append("quality (pooled): the MHA model of the same weights with its K/V heads mean-pooled to the "
                     "variant's count, KL(MHA || variant) per token and top-1 agreement on random tokens "
                     "(kv_pool_* in the records' methods), measured on a model of the variant's own layer "
                     "layouts (quality source: pooled from random weights; 'pooled, not uptrained' from a "
                     "checkpoint) or none")
        for label, r in rows.items():
            if r["no_quality"]:
                notes.append(f"quality of {label}: none pooled ({r['no_quality']}); a model of its layout measures "
                             "it: task=train or task=recall jobs of it in this sweep, or task=eval of a checkpoint")
    recall = _recall(all_records)
    with_recall = any(label in recall for label in rows)
    if with_recall:  # the quality a layout decides: the answer is a token stored far back
        header.append("recall accuracy [95%]")
        notes.append("recall: task=recall accuracy on held-out sequences of the same variant label (mean over "
                     "seeds [t-interval]); a variant's model there is trained from scratch, not these weights")
    model = RecordView.of(records[0]).get("model.name") if records else None
    # requests per second: a conversations search's rate counts conversations, another unit
    rates = max_rate_by_variant(all_records, {"workload.name": "serving", **({"model.name": model} if model else {})})
    with_rate = any(label in rates for label in rows)
    if with_rate:
        header.append("max rate under SLO")
        notes.append("max rate under SLO: workload=serving workload.search.enabled=true, the highest arrival rate "
                     "whose run met its SLO's p99 TTFT / TPOT with every request finished (in brackets: the target "
                     "that set the limit); its own arrivals, KV budget and SLO (the serving records' config)")
    with_quality = any(label in quality for label in rows)
    if with_quality:
        header.append("perplexity")
    else:
        notes.append("quality: no ok task=train or task=eval job of these variants in these records"
                     + (" (no perplexity)" if with_pool else ""))
    table = []
    if rows:
        base = rows[_baseline(rows)]
        for label, r in rows.items():
            share = r["kv_per_token"] / base["kv_per_token"] if r["kv_per_token"] and base["kv_per_token"] else None
            line = [label, fmt(r["kv_per_token"], "bytes"), fmt(share, "{:.3f}"),
                    *([fmt(r["state"] or 0, "bytes")] if with_state else []), fmt(r["context"], "{}"),
                    fmt(r["decode_ms"], "{:.3f}"), fmt(r["tokens_per_s"], "{:.1f}"),
                    "untested (tpot)" if r["untested"] else fmt(r["max_batch"], "{}"),
                    fmt(r["stopped_by"], "{}"), fmt(r["predicted"], "{}")]
            if splits:
                line += [fmt(r["gpu_kv"], "bytes"), fmt(r["gpu_seqs"], "{:.4g}")]
            if with_pool:
                line += [fmt(r["kl"], "{:.4f}"), fmt(r["top1"], "{:.3f}"), r["source"]]
            line += [recall.get(label, "-")] if with_recall else []
            line += [rates.get(label, "-")] if with_rate else []
            table.append(line + ([quality.get(label, "-")] if with_quality else []))
        if not any(r["mha"] for r in rows.values()):
            notes.append(f"no MHA job: 'vs MHA' is relative to {_baseline(rows)}")
        partial = [label for label, r in rows.items() if not r["full_context"]]
        if partial:
            notes.append(f"{KV_PER_TOKEN}: one sequence's KV cache at the longest context (+ workload.gen_len) over "
                         f"its positions, the jobs table's kv_bytes_per_token: for {', '.join(partial)} it falls as "
                         "the context grows (a local layer's ring holds at most W positions); for the others it is "
                         "any one position's")
        for label, r in rows.items():
            if r["untested"]:
                notes.append(f"max batch of {label}: untested, not a number: slo.tpot_x_batch1's verdicts are within "
                             f"the paired steps' noise ({r['untested']}); rerun on a quieter machine or with more "
                             "capacity.tpot_pairs")
        stateful = [label for label, r in rows.items() if r["state"]]
        if stateful:
            notes.append(f"{STATE}: what a sequence of {', '.join(stateful)} holds whatever its length (its recurrent "
                         f"layers' states and convolution tails); {KV_PER_TOKEN} counts it over "
                         "the sequence's positions, so it falls as the context grows towards the full layers' "
                         "K/V per token, and at short contexts the state is most of a sequence's cost")
        beyond = [label for label, r in rows.items() if r["beyond_heads"]]
        if beyond:
            notes.append(f"memory ample counts KV heads, the article's stand-in for quality; it cannot rank "
                         f"{', '.join(beyond)} (MLA caches one head per token in the absorbed decode; a local "
                         "layer sees only its last W positions; a recurrent layer keeps a fixed-size state, "
                         "not the tokens): "
                         "their quality is the recall column where this sweep has task=recall records "
                         "(experiment=recall), and is not measured otherwise")
    chat_rows, chat_table = _chat_table(chat_records)
    context_header, context_rows = _context_table(rows)
    return Choice(cell, header, table, recommend(rows, multiturn, chat_capacity(chat_rows)) if rows else [], notes,
                  CHAT_HEADER if chat_table else [], chat_table, context_header, context_rows)


def _by_context(rec: RecordView) -> Dict[int, Mapping[str, Any]]:
    """The record's answer at each context (``tables.capacity``), by context."""
    return {r["context"]: r for r in rec.table("capacity")
            if isinstance(r.get("context"), int) and not isinstance(r.get("context"), bool)}


def _context_table(rows: Dict[str, Dict[str, Any]]) -> Tuple[List[str], List[List[str]]]:
    """Max batch per variant at every context searched (what stopped it in brackets): a per-sequence
    state bounds short contexts, K/V per token long ones. Empty with one context."""
    contexts = sorted({c for r in rows.values() for c in r["by_context"]})
    if len(contexts) < 2:
        return [], []
    header = ["variant", *(f"max batch @{c}" for c in contexts)]
    table = []
    for label, r in rows.items():
        cells = [r["by_context"].get(c) for c in contexts]
        batches = [a.get("max_batch") for a in cells if a is not None and isinstance(a.get("max_batch"), int)]
        # a sequence holds more at a longer context, never less: a capacity that falls, then rises again,
        # moved with the machine (issue 59: MHA's 14 / 3 / 3 / 4 at 32-256 tokens, each bound by TPOT)
        steps = [later - earlier for earlier, later in zip(batches, batches[1:])]
        wobbles = any(d > 0 for i, d in enumerate(steps) if any(e < 0 for e in steps[:i]))
        table.append([label + (" (falls and rises with context: noise)" if wobbles else ""),
                      *("-" if a is None else "untested (tpot)" if a.get("tpot_untested") else
                        f"{fmt(a.get('max_batch'), '{}')} ({fmt(a.get('stopped_by'), '{}')})" for a in cells)])
    return header, table
