"""Which jobs sit side by side, and how their numbers are written: the data behind every table.

The axes a job is identified by, the metric columns of each kind of job (a decode row carries no
chat or training column), the swept axes and the variant. Rendering is elsewhere (console, report,
plots). Every value is written by :func:`value_text`, so a value's interval is added in one place.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from kvbench.results import flatten, record_config
from kvbench.sinks.views import NONE_IS_VALUE_KEYS, VARIANT_COLUMNS, RecordView
from kvbench.sinks.views import VARIANT_KEYS as VIEW_VARIANT_KEYS
from kvbench.units import human_bytes

# A record as report.collect reads it (a mapping), a RunResult or a view: read through RecordView.
Record = Any
Axis = Tuple[str, str]  # (config key, column title)

AXES: List[Axis] = [
    ("model.name", "model"), *VARIANT_COLUMNS,
    ("workload.name", "workload"), ("workload.batch_size", "B"), ("workload.prompt_len", "prompt"),
    ("workload.gen_len", "gen"), ("runtime.dtype", "dtype"), ("cache.impl", "cache"), ("cache.dtype", "KV dtype"),
    ("cache.shared", "shared"),
    ("task", "task"), ("workload.system_len", "system"), ("workload.turns", "turns"),
    ("train.steps", "train steps"), ("train.init_from", "init from"),
]
VARIANT_KEYS = VIEW_VARIANT_KEYS
VARIANT_AXES: List[Axis] = [a for a in AXES if a[0] in VARIANT_KEYS]
# The variant as one column of a table a person reads: its label (views.Variant.label), the name its
# progress line gives it, in place of the attention keys' columns (a layer pattern, a layer option
# and the KV dtype are in the label: no column shows them apart).
VARIANT_AXIS: Axis = ("variant", "variant")
_NOT_AXES = ("wandb.", "rerun")  # how a job was recorded or scheduled, not what it measured


@dataclass(frozen=True)
class Column:
    """A metric as a table shows it: ``spec`` is a format string, ``bytes`` (binary units) or
    ``sig`` (3 significant digits: a small percentage stays readable). ``brief``: also in the
    one-row-per-job sweep table; ``compared``: in the side-by-side comparison; ``sampled``: a
    statistic of timed samples, whose ratio means something only beside intervals."""

    key: str
    title: str
    spec: str = "{:.2f}"
    brief: bool = False
    compared: bool = False
    sampled: bool = False


_TTFT = Column("prefill_ms", "TTFT ms", "{:.2f}", brief=True, compared=True, sampled=True)
_DECODE_P50 = Column("decode_ms_p50", "decode p50 ms", "{:.3f}", brief=True, compared=True, sampled=True)
_P99 = Column("decode_ms_p99", "p99 ms", "{:.3f}", sampled=True)
_TOKENS = Column("tokens_per_s", "tok/s", "{:.1f}", brief=True, compared=True, sampled=True)
_KV = Column("kv_cache_bytes", "KV cache", "bytes", brief=True, compared=True)
_KV_FORMULA = Column("kv_cache_bytes_formula", "KV formula", "bytes")
_RSS = Column("peak_rss_bytes", "peak RSS", "bytes")
_CUDA = Column("torch_peak_allocated_bytes", "CUDA peak", "bytes")
_PPL = Column("perplexity", "perplexity", "{:.3f}", brief=True, compared=True)
_VAL = Column("val_loss", "val loss", "{:.4f}")
_BPB = Column("bits_per_byte", "bits/byte", "{:.3f}")
_PARAMS = Column("num_params", "params", "{:,}")
_CONVERSION = Column("kv_heads_conversion", "KV conversion", "{}", brief=True)
_NOISY = Column("noisy", "noisy", "{}", brief=True)  # the machine was oversubscribed around the job
_KV_SLOPE = Column("decode_us_per_1k_ctx", "µs/1k ctx", "{:.2f}", brief=True, compared=True,
                   sampled=True)

# The columns of each kind of job (see :func:`kind`), headline first; summary.csv has every metric.
COLUMNS: Dict[str, List[Column]] = {
    "decode": [_TTFT, _DECODE_P50, _P99, _TOKENS, _KV_SLOPE, Column("percent_of_peak", "% BW peak", "sig", brief=True),
               _KV, _KV_FORMULA, _RSS, _CUDA, Column("compile_s", "compile s", "{:.1f}", brief=True),
               _CONVERSION, Column("fidelity_max_abs_logit_diff", "cache Δlogit", "{:.2e}"),
               Column("dtype_max_abs_logit_diff", "vs fp32 Δlogit", "{:.2e}", brief=True),
               Column("dtype_top1_agreement", "vs fp32 top-1", "{:.1%}"), _NOISY],
    "multiturn": [Column("turn1_ttft_ms", "TTFT turn 1 ms", "{:.2f}", brief=True, compared=True, sampled=True),
                  Column("mean_ttft_ms_turns_2_n", "TTFT turns 2-N ms", "{:.2f}", brief=True, compared=True,
                         sampled=True),
                  _DECODE_P50, _P99, _TOKENS, _KV, _KV_FORMULA,
                  Column("total_prefill_tokens", "prefilled", "{:,}", brief=True),
                  Column("total_reused_tokens", "reused", "{:,}"), _RSS, _CUDA, _NOISY],
    "train": [_VAL, _PPL, Column("ppl_before_uptrain", "ppl before uptrain", "{:.3f}", brief=True, compared=True),
              _BPB, Column("train_seconds", "train s", "{:.0f}", brief=True), _CONVERSION, _PARAMS, _NOISY],
    "eval": [_VAL, _PPL, _BPB, _CONVERSION, Column("eval_seconds", "eval s", "{:.1f}"), _PARAMS, _NOISY],
    "capacity": [Column("max_batch_longest", "max batch", "{}", brief=True, compared=True),
                 Column("stopped_by_longest", "stopped by", "{}", brief=True),
                 Column("decode_ms_p50_longest", "decode p50 ms (B=1)", "{:.3f}", brief=True, compared=True),
                 Column("tokens_per_s_longest", "tok/s at max batch", "{:.1f}", brief=True, compared=True),
                 Column("kv_bytes_per_token", "KV / token", "bytes", brief=True, compared=True),
                 Column("memory_budget_bytes", "budget", "bytes"), Column("probes_run", "probes", "{}", brief=True),
                 _NOISY],
    "serving": [Column("max_rate_under_slo", "max rate in SLO", "{:.3g}", brief=True, compared=True),
                Column("max_rate_bound", "limited by", "{}", brief=True),
                *(Column(k, t, "{:.2f}", brief=True, compared=True, sampled=True)
                  for k, t in (("ttft_ms_p99", "p99 TTFT ms"), ("tpot_ms_p99", "p99 TPOT ms"))),
                Column("goodput", "goodput req/s", "{:.3g}", brief=True, compared=True), Column("output_throughput",
                "out tok/s", "{:.1f}", brief=True, compared=True), Column("preemptions", "preempted", "{}", brief=True),
                Column("kv_block_usage_max", "peak KV blocks", "{:.0%}", brief=True), _NOISY],
    # per turn index: tables.conversation_turns
    "conversations": [
        *(Column(k, t, "{:.2f}", brief=True, compared=True, sampled=True) for k, t in (
            ("ttft_ms_p99", "p99 TTFT ms"), ("returning_cached_ttft_ms_p50", "p50 TTFT cached ms"),
            ("returning_evicted_ttft_ms_p50", "p50 TTFT evicted ms"))),
        Column("returning_evicted", "evicted turns", "{}", brief=True, compared=True),
        Column("returning_turns", "returning turns", "{}", brief=True),
        Column("history_recomputed_tokens", "recomputed", "{:,}", brief=True, compared=True),
        Column("prefix_hit_rate", "prefix hits", "{:.0%}", brief=True, compared=True),
        Column("max_rate_under_slo", "max rate in SLO", "{:.3g}", brief=True, compared=True),
        Column("preemptions", "preempted", "{}", brief=True), _NOISY],
    # its variants' metrics are per variant: :func:`interleaved_table` shows them
    "compare": [Column("rounds", "rounds", "{}", brief=True), _NOISY],
    # per condition: kvbench/sinks/recall.py
    "recall": [Column("accuracy", "recall acc", "{:.3f}", brief=True, compared=True),
               Column("accuracy_before_uptrain", "acc before uptrain", "{:.3f}", brief=True, compared=True),
               Column("chance_accuracy", "chance", "{:.3f}"), Column("copy_accuracy", "copy baseline", "{:.3f}"),
               Column("accuracy_seeds", "seeds", "{}", brief=True),
               Column("kv_bytes_per_token", "KV / token", "bytes", brief=True, compared=True),
               Column("decode_ms_p50", "decode p50 ms", "{:.3f}", brief=True, compared=True),
               Column("train_seconds", "train s", "{:.0f}", brief=True), _CONVERSION, _PARAMS, _NOISY],
}
KIND_TITLES = {"decode": "decode", "multiturn": "multi-turn chat", "train": "training", "eval": "evaluation",
               "capacity": "capacity at the longest context", "compare": "interleaved comparison",
               "recall": "recall", "serving": "serving (open-loop arrivals, continuous batching)",
               "conversations": "conversations (multi-turn chats, continuous batching)"}


def kind(record: Record) -> str:
    """The kind of job: its workload for task=bench, else its task."""
    return RecordView.of(record).kind


def by_kind(records: Sequence[Record]) -> Dict[str, List[Record]]:
    """Records grouped by :func:`kind`, in the order of :data:`COLUMNS`."""
    groups: Dict[str, List[Record]] = {}
    for rec in records:
        groups.setdefault(kind(rec), []).append(rec)
    order = list(COLUMNS)
    return {k: groups[k] for k in sorted(groups, key=lambda k: (order.index(k) if k in order else len(order), k))}


def natural(text: str) -> List[Any]:
    """Sort key that puts ``2`` before ``10`` and ``prompt=64`` before ``prompt=256``."""
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in re.split(r"(\d+)", str(text))]


# ---- formatting ---------------------------------------------------------------------------------

def fmt(value: Any, spec: str) -> str:
    """``value`` as ``spec`` says (see :class:`Column`); None is ``-``."""
    if value is None:
        return "-"
    if spec == "bytes":
        return human_bytes(value)
    if spec == "sig":
        return f"{value:.3g}" if isinstance(value, (int, float)) else str(value)
    try:
        return spec.format(value)
    except (TypeError, ValueError):
        return str(value)


def interval(values: Mapping[str, Any], key: str) -> Optional[Tuple[float, float]]:
    """The 95% interval ``<key>_ci_low`` / ``<key>_ci_high``; None where either bound is missing
    (older records carry none)."""
    low, high = values.get(f"{key}_ci_low"), values.get(f"{key}_ci_high")
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (low, high))
    return (low, high) if numbers else None


def with_interval(values: Mapping[str, Any], key: str, spec: str) -> str:
    """``values[key]`` with its interval ``[low, high]`` when it has one (bootstrap intervals are
    not symmetric, so both ends are shown)."""
    text, ci = fmt(values.get(key), spec), interval(values, key)
    if values.get(key) is None or ci is None or spec == "bytes":
        return text
    return f"{text} [{fmt(ci[0], spec)}, {fmt(ci[1], spec)}]"


NOT_SIGNIFICANT = "not significant"
# A paired ratio (task=compare) without an interval (too few rounds: measure/stats.py's rule) says
# so: a bare ratio would read as a difference the data supports.
NO_INTERVAL = "no interval"


def spec_for(record: Record, column: Column) -> str:
    """The record's registry decides bytes or not; the column's format applies where the record
    declares no unit."""
    unit = RecordView.of(record).unit(column.key)
    if unit == "bytes":
        return "bytes"
    return "{:,}" if column.spec == "bytes" and unit is not None else column.spec


def value_text(record: Record, column: Column) -> str:
    """A metric of a record as a table cell, with its interval where the record has one."""
    view = RecordView.of(record)
    return with_interval(view.metrics, column.key, spec_for(view, column))


def ratio_text(ratio: Optional[float]) -> str:
    """``0.250×``, ``1.10×``, ``12.0×``: three significant digits, trailing zeros kept."""
    return "" if ratio is None else f"{ratio:#.3g}".rstrip(".") + "×"


# ---- axes -----------------------------------------------------------------------------------------

def _values(records: Sequence[Record], key: str) -> List[str]:
    # None is "left to its default" (or a key the job's kind does not read), so it never makes a key
    # look swept, except where the variant reads None as a value (views.NONE_IS_VALUE_KEYS).
    none_is_value = key in NONE_IS_VALUE_KEYS
    return [repr(v) for v in (RecordView.of(r).get(key) for r in records) if v is not None or none_is_value]


def determined_by(records: Sequence[Record], key: str, by: str) -> bool:
    """Whether ``key``'s value is a function of ``by``'s across ``records`` (ignoring unset values)."""
    seen: Dict[str, str] = {}
    for view in map(RecordView.of, records):
        value, cause = view.get(key), view.get(by)
        if value is None or cause is None:
            continue
        if seen.setdefault(repr(cause), repr(value)) != repr(value):
            return False
    return True


def swept_axes(records: Sequence[Record]) -> List[Axis]:
    """(config key, column title) of every key that differs across records, the usual axes first;
    a key that is a function of one already chosen is dropped (``model.d_model`` of ``model.name``)."""
    keys = {k for view in map(RecordView.of, records) for k in flatten(view.config)}
    varying = {k for k in keys if not k.startswith(_NOT_AXES) and len(set(_values(records, k))) > 1}
    chosen = [(k, t) for k, t in AXES if k in varying]
    for key in sorted(varying - {k for k, _ in chosen}):
        if not any(determined_by(records, key, by) for by, _ in chosen):
            chosen.append((key, key))
    return chosen


def viewed(record: Record) -> Record:
    """The record with only the config keys its task reads (older records and Hydra's saved
    configs hold the others)."""
    view = RecordView.of(record)
    return {**view.to_dict(), "config": record_config(dict(view.config))}


# ---- one row per job ------------------------------------------------------------------------------

def job_columns(records: Sequence[Record], kind_name: str, brief: bool = False) -> List[Column]:
    """The columns of ``kind_name`` (only the brief ones with ``brief``) that some record has."""
    return [c for c in COLUMNS.get(kind_name, COLUMNS["decode"]) if (c.brief or not brief)
            and any(RecordView.of(r).metric(c.key) is not None for r in records)]


def job_axes(records: Sequence[Record], axes: Sequence[Axis]) -> List[Axis]:
    """The axes among ``axes`` that vary within ``records`` (the variant when none does)."""
    return [a for a in axes if len(set(_values(records, a[0]))) > 1] or VARIANT_AXES


# A short title where a table shows a key as text of its own (:func:`axis_text`)
_TITLES = {"attention.layer_types": "layers (s/f/l)"}


def _label_tells_apart(records: Sequence[Record], key: str) -> bool:
    """Whether the variant's label alone tells ``key``'s values apart across ``records`` (the order
    of the local and global layers is not in it: ``w=8 1:1`` is s,f or f,s)."""
    seen: Dict[str, str] = {}
    for view in map(RecordView.of, records):
        value = view.get(key)
        if value is None and key not in NONE_IS_VALUE_KEYS:  # left unset: the label says what it resolves to
            continue
        if seen.setdefault(view.variant.label, repr(value)) != repr(value):
            return False
    return True


def shown_axes(axes: Sequence[Axis], records: Sequence[Record] = ()) -> List[Axis]:
    """``axes`` as a table a person reads shows them: the variant's keys as one :data:`VARIANT_AXIS`
    where the first of them was (:func:`job_axes` gives them all where nothing varies), followed by
    those of them whose values the label leaves apart in ``records``."""
    out: List[Axis] = []
    for axis in axes:
        shown = VARIANT_AXIS if axis[0] in VARIANT_KEYS else axis
        if shown not in out:
            out.append(shown)
    apart = [(key, _TITLES.get(key, title)) for key, title in axes
             if key in VARIANT_KEYS and not _label_tells_apart(records, key)]
    if apart:
        at = out.index(VARIANT_AXIS) + 1
        out[at:at] = apart
    return out


def table_axes(records: Sequence[Record], axes: Sequence[Axis], kind_name: str) -> List[Axis]:
    """The axes a jobs table of ``kind_name`` shows: :func:`job_axes` as :func:`shown_axes`, less the
    task and the workload (a table is of one kind) and, for task=compare, the variant (a comparison
    holds several)."""
    hidden = ("task", "workload.name") + ((*VARIANT_KEYS, VARIANT_AXIS[0]) if kind_name == "compare" else ())
    return [a for a in shown_axes(job_axes(records, axes), records) if a[0] not in hidden]


def _length_text(value: Mapping[str, Any]) -> str:
    """A length distribution (config.conversations.LengthConfig) as ``uniform 4 (2-6)``."""
    number = lambda v: fmt(v, "{:g}")  # noqa: E731
    return f"{value.get('dist')} {number(value.get('mean'))} ({number(value.get('lo'))}-{number(value.get('hi'))})"


def axis_text(record: Record, key: str) -> str:
    """A job's value of an axis as a table cell: the variant's label for :data:`VARIANT_AXIS`; the
    turns a conversation's file gave it, not the synthetic distribution that file replaced."""
    view = RecordView.of(record)
    if key == VARIANT_AXIS[0]:
        return view.label  # a job with no record: as its job line named it
    value = view.get(key)
    if key.split(".")[:2] == ["workload", "turns"] and view.kind == "conversations":  # turns, or turns.mean
        source = "trace" if view.get("workload.arrival") == "trace" else "sharegpt" if view.get(
            "workload.sharegpt") else None
        if source:
            return f"from workload.{source}"
    if isinstance(value, Mapping) and "dist" in value:
        return _length_text(value)
    if key == "attention.layer_types" and isinstance(value, list):  # s f l: sliding, full, linear (transformers')
        return "".join(str(t)[:1] for t in value)
    return fmt(value, "{}")


def job_cells(record: Record, axes: Sequence[Axis], columns: Sequence[Column]) -> Tuple[List[str], List[str]]:
    """(axis values, metric values) of one job as text."""
    view = RecordView.of(record)
    return ([axis_text(view, key) for key, _ in axes], [value_text(view, c) for c in columns])


# ---- the variant ------------------------------------------------------------------------------------

def variant(record: Record) -> str:
    """``mha kv=8``, ``gqa kv=2 w=1024 5:1``, ``mla r=32 int8``: as every table and plot names it."""
    return RecordView.of(record).variant.label
