"""The typed, read-only views sinks read records through: :class:`RecordView` and :class:`Variant`.

A sink never indexes into a record's JSON mapping: every :class:`RecordView` accessor answers
``None`` (or an empty list / mapping) for what the record lacks, so an invalid, unfinished or
older record is read, never a ``KeyError``.

A :class:`Variant` is an attention layout as fields, not a label to parse: :attr:`Variant.label`
is the one place its name is built (``gqa kv=2 w=1024 5:1 int8``) and :attr:`Variant.order` the
one order every listing uses.

Units are data: a schema-2 record keeps them in ``units``; a schema-1 record kept them only in the
prose of its ``methods`` lines, so they come from :data:`kvbench.units_v1.V1_UNITS` by name. An
older record's metrics are read under their schema-3 names (:data:`kvbench.results.RENAMED_IN_3`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from kvbench.config.layer_options import LAYER_OPTIONS
from kvbench.config.layer_pattern import PATTERN_COLUMNS, PATTERN_KEYS, LayerPattern, variant_label
from kvbench.config.model import ATTENTION_TYPES, attention_type
from kvbench.jsonio import as_int
from kvbench.metrics import matches
from kvbench.results import RENAMED_IN_3
from kvbench.units_v1 import V1_UNITS

# Which layers are local or linear: their None is a value (config.layer_pattern.PATTERN_KEYS).
NONE_IS_VALUE_KEYS = tuple(f"attention.{key}" for key in PATTERN_KEYS)
# What a Variant's fields are read from in a record's config.
VARIANT_KEYS = ("attention.type", "attention.num_kv_heads", "attention.kv_lora_rank", *NONE_IS_VALUE_KEYS,
                *(f"attention.{option.key}" for option in LAYER_OPTIONS), "cache.dtype")
# The attention keys a jobs table shows as columns (config key, header), in its order; the KV dtype's
# column sits with the cache's, and the layer pattern and options show in the label only.
VARIANT_COLUMNS = (("attention.type", "attn"), ("attention.num_kv_heads", "kv"), ("attention.kv_lora_rank", "R"),
                   *((f"attention.{key}", header) for key, header in PATTERN_COLUMNS))
_EMPTY: Mapping[str, Any] = MappingProxyType({})


def _get(config: Any, dotted: str) -> Any:
    """``config["a"]["b"]`` for ``"a.b"`` over any mappings; None when a part is missing."""
    node = config
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


@dataclass(frozen=True)
class Variant:
    """An attention variant as its fields: ``layout`` mha | gqa | mqa | mla (None: unknown);
    ``num_kv_heads`` (MLA: 1, the cached head); ``pattern``: which layers are local, global or
    linear; ``cache_dtype`` (None: auto); ``state_dtype``: a recurrent state's (None: float32);
    ``shared``: a chat's shared prefix (None: not part of the variant); ``options``: the layer
    options that are on, as (key, value) in :data:`~kvbench.config.layer_options.LAYER_OPTIONS` order."""

    layout: Optional[str]
    num_heads: Optional[int] = None
    num_kv_heads: Optional[int] = None
    kv_lora_rank: Optional[int] = None
    qk_rope_head_dim: Optional[int] = None
    pattern: LayerPattern = LayerPattern()
    cache_dtype: Optional[str] = None
    state_dtype: Optional[str] = None
    shared: Optional[bool] = None
    model: Optional[str] = None
    options: Tuple[Tuple[str, Any], ...] = ()

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> "Variant":
        """The variant of a record's config (a nested mapping); absent keys are None."""
        config = config if isinstance(config, Mapping) else {}
        kind, heads, kv = (_get(config, k) for k in ("attention.type", "model.num_heads", "attention.num_kv_heads"))
        if as_int(kv) is None and kind in ATTENTION_TYPES:  # as the user wrote it (an invalid job's): resolve it
            kv = {"mha": heads, "mqa": 1}.get(kind, _get(config, "model.preset_kv_heads"))
        rank = as_int(_get(config, "attention.kv_lora_rank"))
        layout = kind if kind in ATTENTION_TYPES else None
        if layout is None and rank is not None:
            layout = "mla"
        elif layout is None and as_int(heads) and as_int(kv):
            layout = attention_type(heads, kv)
        elif layout is None and isinstance(kind, str):
            layout = kind  # a type the schema does not know (an invalid job's): shown as given
        dtype, state = _get(config, "cache.dtype"), _get(config, "cache.state_dtype")
        return cls(layout=layout, num_heads=as_int(heads), num_kv_heads=as_int(kv),
                   kv_lora_rank=rank, qk_rope_head_dim=as_int(_get(config, "attention.qk_rope_head_dim")),
                   pattern=LayerPattern.read(lambda key: _get(config, f"attention.{key}"),
                                             _get(config, "model.num_layers")),
                   cache_dtype=None if dtype in (None, "auto") else str(dtype),
                   state_dtype=None if state in (None, "float32") else str(state),
                   model=_get(config, "model.name") if isinstance(_get(config, "model.name"), str) else None,
                   options=tuple((option.key, value) for option in LAYER_OPTIONS
                                 if (value := option.on(_get(config, f"attention.{option.key}"))) is not None))

    @classmethod
    def of_attention(cls, attention: Any, cache_dtype: Optional[str] = None,
                     num_layers: Optional[int] = None) -> "Variant":
        """The variant of an ``AttentionConfig`` (resolved or not): a progress line's name."""
        fields = ("type", "num_kv_heads", "kv_lora_rank", "qk_rope_head_dim", *PATTERN_KEYS,
                  *(option.key for option in LAYER_OPTIONS))
        attn = {f: getattr(attention, f, None) for f in fields}
        return cls.from_config({"attention": attn, "cache": {"dtype": cache_dtype},
                                "model": {"num_layers": num_layers}})

    @property
    def quantized(self) -> bool:
        """True when the cache holds fewer bits than the compute dtype (``cache.dtype``)."""
        return self.cache_dtype is not None

    @property
    def full_context(self) -> bool:
        """True when every layer attends over the whole context (no layer keeps only its last W positions)."""
        return not self.pattern.has_local

    @property
    def plain(self) -> bool:
        """True for the layout as such, its label naming nothing else: no layer pattern, no layer
        option, the cache in the compute dtype."""
        return not (self.pattern.named or self.options or self.quantized)

    @property
    def counts_kv_heads(self) -> bool:
        """True when the cache's size is a count of K/V heads (not MLA's one cached head per token)."""
        return self.layout != "mla"

    @property
    def stateful(self) -> bool:
        """True when some layer keeps a fixed-size recurrent state (Gated DeltaNet), not its tokens' K/V."""
        return self.pattern.has_linear

    @property
    def ranked_by_kv_heads(self) -> bool:
        """True when its KV-head count alone says how much of the context it keeps: K/V heads, at every
        layer, over the whole context, no recurrent state (what a rule ranking by KV heads can compare)."""
        return self.counts_kv_heads and self.full_context and not self.stateful

    @property
    def named(self) -> bool:
        """True when the config names some attention field (a layout, a KV-head count or a rank)."""
        return self.layout is not None or self.num_kv_heads is not None or self.kv_lora_rank is not None

    @property
    def label(self) -> str:
        """``mha kv=8``, ``mla r=512``, ``gqa kv=2 w=1024 5:1`` (5 local layers to 1 global), then the
        cache dtype and a chat's ``shared=on|off`` (:func:`kvbench.config.layer_pattern.variant_label`)."""
        attention = {"type": self.layout, "num_kv_heads": self.num_kv_heads, "kv_lora_rank": self.kv_lora_rank,
                     **self.pattern.fields(), **dict(self.options)}
        parts = [variant_label(attention, self.cache_dtype, self.pattern.num_layers, self.state_dtype)]
        if self.shared is not None:
            parts.append(f"shared={'on' if self.shared else 'off'}")
        return " ".join(parts)

    @property
    def order(self) -> Tuple[Any, ...]:
        """The sort key of every listing: ATTENTION_TYPES' order (most KV heads or largest rank first);
        then the layer pattern's (:attr:`LayerPattern.order`); then the compute dtype before a
        quantized cache, an unshared cache before a shared one."""
        rank = ATTENTION_TYPES.index(self.layout) if self.layout in ATTENTION_TYPES else len(ATTENTION_TYPES)
        size = self.num_kv_heads if self.counts_kv_heads else self.kv_lora_rank
        return (rank, -size if isinstance(size, int) else 0, self.pattern.order, self.quantized, self.cache_dtype or "",
                self.state_dtype or "", self.shared is True, self.model or "", self.label)

    def with_sharing(self, shared: Optional[bool]) -> "Variant":
        """This variant with a chat's shared-prefix setting (named in its label)."""
        return replace(self, shared=None if shared is None else bool(shared))


def ordered(variants: Sequence[Variant]) -> List[Variant]:
    """``variants`` once each, in :attr:`Variant.order`."""
    return sorted(set(variants), key=lambda v: v.order)


def in_order(labels: Sequence[str], variants: Mapping[str, Variant]) -> List[str]:
    """``labels`` in their variants' order (``variants``: label -> variant), never by the text."""
    return sorted(labels, key=lambda label: variants[label].order)


# ---- a record ------------------------------------------------------------------------------------

def _schema_version(data: Mapping[str, Any]) -> int:
    """The record's schema (1 for records written before the field, and for report rows)."""
    version = as_int(data.get("schema_version"))
    return 1 if version is None else version


def _as_current(data: Mapping[str, Any]) -> Mapping[str, Any]:
    """``data`` (a record) as the current schema reads: a schema-1 record's units from its methods'
    names, and each metric keyed by its schema-3 name."""
    version = _schema_version(data)
    if version >= 3:
        return data
    out = dict(data)
    if version < 2:
        methods = data.get("methods")
        out["units"] = v1_units(methods if isinstance(methods, dict) else {})
    for section in ("metrics", "units", "methods", "null_reasons"):
        if isinstance(out.get(section), dict):
            out[section] = {RENAMED_IN_3.get(name, name): value for name, value in out[section].items()}
    return out


def v1_units(methods: Mapping[str, Any]) -> Dict[str, str]:
    """name -> unit of each metric a schema-1 record's ``methods`` declares (by name or pattern)."""
    out = {}
    for name in methods:
        unit = V1_UNITS.get(name)
        if unit is None:
            unit = next((u for pattern, u in V1_UNITS.items() if "<" in pattern and matches(pattern, name)), None)
        if unit is not None:
            out[name] = unit
    return out


class RecordView:
    """A read-only view of one record (a results.json mapping, a :class:`~kvbench.results.RunResult`
    or a report row with ``job``)."""

    __slots__ = ("_record", "_data", "_variant")

    def __init__(self, record: Any):
        data = record.to_dict() if hasattr(record, "to_dict") else record
        self._record: Mapping[str, Any] = data if isinstance(data, Mapping) else {}
        self._data = _as_current(self._record)
        self._variant: Optional[Variant] = None

    @classmethod
    def of(cls, record: Any) -> "RecordView":
        """``record`` as a view (itself when it is one already)."""
        return record if isinstance(record, RecordView) else cls(record)

    def _section(self, name: str) -> Mapping[str, Any]:
        value = self._data.get(name)
        return MappingProxyType(value) if isinstance(value, dict) else _EMPTY

    # -- what the job is ---------------------------------------------------------------------------
    @property
    def status(self) -> str:
        """ok | invalid | oom | error | interrupted, or a report's unreadable | missing | running."""
        status = self._data.get("status")
        return status if isinstance(status, str) else "?"

    @property
    def status_text(self) -> str:
        """The status as a table's cell shows it: an interrupted record that kept the figures of its
        complete rounds (task=compare's ``partial``) says so, ``interrupted (partial, 3 of 10 rounds)``:
        its figures are real but over fewer rounds than asked, which the error column alone hid."""
        metrics = self._section("metrics")
        if self.status != "interrupted" or metrics.get("partial") is not True:
            return self.status
        done, planned = metrics.get("rounds"), self.get("runtime.repeats")
        if not isinstance(done, int) or isinstance(done, bool):
            return f"{self.status} (partial)"
        of = f" of {planned}" if isinstance(planned, int) and not isinstance(planned, bool) else ""
        return f"{self.status} (partial, {done}{of} round{'s' if of or done != 1 else ''})"

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def job(self) -> Optional[str]:
        """The job's directory relative to the report's root (report rows only)."""
        job = self._data.get("job")
        return None if job is None else str(job)

    @property
    def error(self) -> Optional[str]:
        return self._data.get("error") if isinstance(self._data.get("error"), str) else None

    @property
    def started_at(self) -> Optional[str]:
        """When the job started (UTC, ISO 8601, to the second); None where the record does not say."""
        value = self._data.get("started_at")
        return value if isinstance(value, str) else None

    @property
    def schema_version(self) -> int:
        """The record's schema (1 for records written before the field, and for report rows)."""
        return _schema_version(self._data)

    @property
    def overrides(self) -> List[str]:
        value = self._data.get("overrides")
        return [str(o) for o in value] if isinstance(value, list) else []

    @property
    def label(self) -> str:
        """The job's variant as its job line and progress line name it: the record's variant; a job
        with no record (a sweep's ``not run``) by the label the sweep composed for it, else by its
        overrides as written; never ``None kv=None``."""
        if self.variant.named:
            return self.variant.label
        label = self._data.get("label")
        if isinstance(label, str) and label:
            return label
        return " ".join(self.overrides) or (f"job {self.job}" if self.job is not None else "(defaults)")

    @property
    def env(self) -> Mapping[str, Any]:
        return self._section("env")

    @property
    def kv_conversion(self) -> Optional[Mapping[str, Any]]:
        value = self._data.get("kv_conversion")
        return MappingProxyType(value) if isinstance(value, dict) else None

    @property
    def implausible(self) -> List[Mapping[str, Any]]:
        value = self._data.get("implausible")
        return [MappingProxyType(i) for i in value if isinstance(i, dict)] if isinstance(value, list) else []

    @property
    def null_reasons(self) -> Mapping[str, Any]:
        return self._section("null_reasons")

    # -- the config --------------------------------------------------------------------------------
    @property
    def config(self) -> Mapping[str, Any]:
        """The job's config (the keys its task reads) as a read-only mapping."""
        return self._section("config")

    def get(self, dotted: str) -> Any:
        """A config value by its dotted key (``attention.num_kv_heads``); None when absent."""
        return _get(self._data.get("config"), dotted)

    @property
    def task(self) -> str:
        task = self.config.get("task")
        return task if isinstance(task, str) else "bench"

    @property
    def kind(self) -> str:
        """The workload's name for task=bench (``decode``, ``multiturn``, ``serving``), else the task."""
        return (self.workload or "decode") if self.task == "bench" else self.task

    @property
    def workload(self) -> Optional[str]:
        """``workload.name`` where the record keeps it."""
        name = self.get("workload.name")
        return name if isinstance(name, str) else None

    def _count(self, dotted: str) -> Optional[int]:
        return as_int(self.get(dotted))

    @property
    def batch_size(self) -> Optional[int]:
        return self._count("workload.batch_size")

    @property
    def prompt_len(self) -> Optional[int]:
        return self._count("workload.prompt_len")

    @property
    def gen_len(self) -> Optional[int]:
        return self._count("workload.gen_len")

    @property
    def positions_held(self) -> Optional[int]:
        """Positions a decode run's cache holds at its end: prompt_len + gen_len (None unless both)."""
        prompt, gen = self.prompt_len, self.gen_len
        return None if prompt is None or gen is None else prompt + gen

    @property
    def variant(self) -> Variant:
        """The attention variant a table compares (a chat's sharing is its own axis there)."""
        if self._variant is None:
            self._variant = Variant.from_config(self.config)
        return self._variant

    @property
    def shared(self) -> Optional[bool]:
        """A chat's ``cache.shared`` (None when the record does not keep it)."""
        value = self.get("cache.shared")
        return None if value is None else bool(value)

    # -- what it measured --------------------------------------------------------------------------
    @property
    def metrics(self) -> Mapping[str, Any]:
        return self._section("metrics")

    def metric(self, name: str) -> Any:
        """The metric's value as recorded (a number, text, a boolean or None)."""
        return self.metrics.get(name)

    def number(self, name: str) -> Optional[float]:
        """The metric as a number; None when absent, null, text or a boolean."""
        value = self.metrics.get(name)
        return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None

    def interval(self, name: str) -> Optional[Tuple[float, float]]:
        """The 95% interval of ``name`` (``<name>_ci_low`` / ``_ci_high``); None when it has none."""
        low, high = self.number(f"{name}_ci_low"), self.number(f"{name}_ci_high")
        return None if low is None or high is None else (low, high)

    def declares_interval(self, name: str) -> bool:
        """Whether the record has an interval field for ``name`` (given or null)."""
        return f"{name}_ci_low" in self.metrics

    @property
    def units(self) -> Mapping[str, str]:
        """name (or pattern, ``<v>_step_ms_ctx<C>``) -> unit of every metric the job declared."""
        return self._section("units")

    def unit(self, name: str) -> Optional[str]:
        """The unit of metric ``name`` (``ms``, ``text``; ``""`` for a note); None when the record declares none."""
        units = self.units
        if name in units:
            return units[name]
        return next((unit for pattern, unit in units.items() if "<" in pattern and matches(pattern, name)), None)

    @property
    def series_names(self) -> List[str]:
        return [k for k, v in self._section("series").items() if isinstance(v, list)]

    def series(self, name: str) -> List[Any]:
        value = self._section("series").get(name)
        return list(value) if isinstance(value, list) else []

    @property
    def table_names(self) -> List[str]:
        return [k for k, v in self._section("tables").items() if isinstance(v, list)]

    def table(self, name: str) -> List[Mapping[str, Any]]:
        """The rows of ``tables.<name>`` (read-only); empty when the record has none."""
        rows = self._section("tables").get(name)
        return [MappingProxyType(r) for r in rows if isinstance(r, dict)] if isinstance(rows, list) else []

    def to_dict(self) -> Dict[str, Any]:
        """A copy of the record's mapping as written (for a sink that hands the whole record on: an artifact)."""
        return dict(self._record)

    def __repr__(self) -> str:
        return f"RecordView(job={self.job!r}, status={self.status!r}, variant={self.variant.label!r})"


def views(records: Sequence[Any]) -> List[RecordView]:
    """Each record as a :class:`RecordView`."""
    return [RecordView.of(r) for r in records]
