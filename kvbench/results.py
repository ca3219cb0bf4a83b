"""The record of a run, ``results.json`` in its job directory: the only reader and writer of records
(everything downstream reads :class:`RunResult` / :func:`read_record`). Records are written
atomically and as strict JSON: a NaN or an infinity becomes null, and ``null_reasons`` says which.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import math
import re
import stat
import typing
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

from kvbench.config.bench import TASKS, BenchConfig, objective_metric
from kvbench.config.record import attention_record, cache_record, model_record
from kvbench.config.workload import DEFAULT_WORKLOAD, WORKLOADS, own_keys
from kvbench.core.task import ALL, kept
from kvbench.jsonio import find_named, plain, read_json, write_json_atomic
from kvbench.measure import plausibility
from kvbench.metrics import matches

RESULTS_FILE = "results.json"
CHECKPOINT_NAME = "checkpoint.pt"  # task=train's checkpoint, beside its results.json
# interrupted: stopped from outside before it finished (Ctrl-C, SIGTERM, preemption, a kill);
# it keeps the metrics complete by then, and resume runs the job again.
STATUSES = ("ok", "invalid", "oom", "error", "interrupted")
# 2: ``units`` (each declared metric's unit as data). A record of schema 1 has none: its units are
# the heads of its ``methods`` lines, which kvbench.sinks.views reads for such records only.
# 3: "window" names an attention window only; two spans of time or tokens got their own names
# (RENAMED_IN_3), which kvbench.sinks.views gives an older record's metrics as it reads them.
SCHEMA_VERSION = 3
RENAMED_IN_3 = {"energy_window_s": "energy_span_s", "eval_tokens_per_window": "eval_seq_len"}
# a record is small; a far larger file is not one, and reading it whole could exhaust memory
MAX_RECORD_BYTES = 64 * 2**20


class RecordError(ValueError):
    """A results.json that cannot be read as a record."""


@dataclass
class RunResult:
    """One job's outcome: scalar ``metrics``, per-step ``series``, ``tables`` of rows, each metric's
    ``methods`` line and ``units`` (the :class:`~kvbench.metrics.Metric` registry's), and
    ``null_reasons``: a metric (or dotted path) -> why it is null (``nan``, ``inf``, or words)."""

    status: str
    config: Dict[str, Any]
    metrics: Dict[str, Any] = field(default_factory=dict)
    series: Dict[str, List[float]] = field(default_factory=dict)
    tables: Dict[str, List[Dict[str, Any]]] = field(default_factory=dict)
    env: Dict[str, Any] = field(default_factory=dict)
    error: Optional[str] = None
    overrides: List[str] = field(default_factory=list)
    started_at: Optional[str] = None
    finished_at: Optional[str] = None
    methods: Dict[str, str] = field(default_factory=dict)
    units: Dict[str, str] = field(default_factory=dict)
    null_reasons: Dict[str, str] = field(default_factory=dict)
    # null: the run measured the named model's own KV-head count; else what was changed
    # (config.kv_layout_change: from_kv_heads, to_kv_heads, method, text)
    kv_conversion: Optional[Dict[str, Any]] = None
    # figures that break a physical bound of the machine (measure/plausibility.py): each
    # {metric, value, bound, reason}; the figure stays in metrics, flagged, never silently true
    implausible: List[Dict[str, Any]] = field(default_factory=list)
    schema_version: int = SCHEMA_VERSION
    # not part of the record: why results.json could not be written, so it can be handed over another way
    unsaved: Optional[str] = field(default=None, compare=False, repr=False)
    # not part of the record either: the file it was written to
    written_to: Optional[Path] = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status={self.status!r}: must be one of {', '.join(STATUSES)}")

    def to_dict(self) -> Dict[str, Any]:
        data = asdict(self)
        del data["unsaved"], data["written_to"]
        return data

    def get(self, dotted: str) -> Any:
        """A config value by its dotted key (``attention.num_kv_heads``); None when absent."""
        return lookup(self.config, dotted)

    def write(self, directory: Path | str) -> Path:
        """Write results.json, non-finite numbers as nulls. A worse record never replaces a trusted
        ``ok`` one (a ``rerun=true`` interrupted, say): it goes beside it as ``results.<status>.json``."""
        self.null_nonfinite()
        directory = Path(directory)
        if self.status != "ok":
            try:
                earlier = read_record(directory)
            except RecordError:
                earlier = None
            if earlier is not None and earlier.status == "ok" and distrust(earlier) is None:
                return write_json_atomic(directory / f"results.{self.status}.json", self.to_dict())
        return write_json_atomic(directory / RESULTS_FILE, self.to_dict())

    def null_nonfinite(self) -> None:
        """Replace every NaN / infinity by None, saying why in ``null_reasons`` (memory matches disk)."""
        data, reasons = without_nonfinite({k: v for k, v in self.to_dict().items() if k != "null_reasons"})
        for name, value in data.items():
            setattr(self, name, value)
        self.null_reasons.update({k[len("metrics."):] if k.startswith("metrics.") else k: why
                                  for k, why in reasons.items()})

    @classmethod
    def from_dict(cls, data: Dict[str, Any]) -> "RunResult":
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__ and k not in ("unsaved", "written_to")}
        known.setdefault("schema_version", 1)  # a record without the field is from before it
        return cls(**known)


# The JSON type of each field: a file that parses but has, say, a list for its metrics is
# unreadable here, not a crash later in a sink.
_FIELD_TYPES = {"config": dict, "metrics": dict, "series": dict, "tables": dict, "env": dict,
                "error": (str, type(None)), "overrides": list, "started_at": (str, type(None)),
                "finished_at": (str, type(None)), "methods": dict, "units": dict, "null_reasons": dict,
                "kv_conversion": (dict, type(None)), "implausible": list, "schema_version": int}


def _shape_error(data: Dict[str, Any]) -> Optional[str]:
    """What is wrong with the structure of a parsed record, or None."""
    for name, kind in _FIELD_TYPES.items():
        if name in data and not isinstance(data[name], kind):
            return f"{name} has type {type(data[name]).__name__}"
    scalars = (int, float, str, bool, type(None))
    if not all(isinstance(v, scalars) for v in data.get("metrics", {}).values()):
        return "metrics holds a value that is not a number, string, boolean or null"
    if not all(isinstance(v, list) for v in data.get("series", {}).values()):
        return "series holds a value that is not a list"
    for name, rows in data.get("tables", {}).items():
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            return f"tables.{name} is not a list of rows"
    if not all(isinstance(o, str) for o in data.get("overrides", [])):
        return "overrides holds a value that is not a string"
    if data.get("status") == "ok":  # the resolved config: what the sinks compute from
        return _config_type_error(data["config"])
    return None


def _json_types(hint: Any) -> Optional[tuple]:
    """The JSON types a schema annotation allows (an int for a float too), None: not checked."""
    if dataclasses.is_dataclass(hint) or typing.get_origin(hint) is dict or hint is dict:
        return (dict,)
    if typing.get_origin(hint) is list or hint is list:
        return (list,)
    if typing.get_origin(hint) is typing.Union:
        parts = [_json_types(a) for a in typing.get_args(hint) if a is not type(None)]
        return None if None in parts else (type(None), *[t for p in parts for t in p])
    return {int: (int,), float: (int, float), str: (str,), bool: (bool,)}.get(hint)


def _schema(cls: type) -> Dict[str, tuple]:
    hints = typing.get_type_hints(cls)
    return {f.name: kinds for f in dataclasses.fields(cls) if (kinds := _json_types(hints[f.name])) is not None}


# BenchConfig's keys and each group's: the JSON types an ok record's config holds there.
_CONFIG_SCHEMA = _schema(BenchConfig)
_GROUP_SCHEMAS = {name: _schema(hint) for name, hint in typing.get_type_hints(BenchConfig).items()
                  if dataclasses.is_dataclass(hint)}


def _config_type_error(config: Mapping[str, Any]) -> Optional[str]:
    """A key of an ok record's config whose value has another type than the schema's (the sinks that
    compute from it would crash); keys the schema does not know are left alone."""
    for name, value in config.items():
        kinds = _CONFIG_SCHEMA.get(name)
        if kinds is not None and not _has_type(value, kinds):
            return f"config.{name} has type {type(value).__name__}"
        for key, item in (value.items() if name in _GROUP_SCHEMAS and isinstance(value, dict) else ()):
            kinds = _GROUP_SCHEMAS[name].get(key)
            if kinds is not None and not _has_type(item, kinds):
                return f"config.{name}.{key} has type {type(item).__name__}"
    return None


def _has_type(value: Any, kinds: tuple) -> bool:
    # bool is an int to isinstance; a flag is no count
    return isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)


def save(result: RunResult, out_dir: Path | str) -> None:
    """Write the record; when the file system refuses (a full disk), keep the reason in
    ``result.unsaved`` so the CLI can print the record instead of losing it."""
    try:
        result.written_to = result.write(out_dir)
    except OSError as exc:
        result.unsaved = f"cannot write {Path(out_dir) / RESULTS_FILE}: {exc.strerror or exc}"


def utc_now() -> str:
    """The time a record is stamped with: UTC, ISO 8601, to the second."""
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def read_record(path: Path | str) -> RunResult:
    """The record at ``path`` (a results.json or its job directory); anything else is a RecordError."""
    path = Path(path)
    if path.is_dir():
        path = path / RESULTS_FILE
    try:
        info = path.stat()
    except OSError as exc:
        raise RecordError(f"{path}: {exc}") from None
    # A FIFO or a device named results.json would block or never end (jsonio.read_regular checks again
    # on the open descriptor).
    if not stat.S_ISREG(info.st_mode):
        raise RecordError(f"{path}: not a regular file")
    if info.st_size > MAX_RECORD_BYTES:
        raise RecordError(f"{path}: {info.st_size} bytes, too large for a record")
    try:  # bounded, and nested too deeply is a ValueError too (jsonio.read_json)
        data = read_json(path, MAX_RECORD_BYTES)
    except (OSError, ValueError) as exc:  # UnicodeDecodeError included
        raise RecordError(f"{path}: {exc}" if str(path) not in str(exc) else str(exc)) from None
    if not isinstance(data, dict) or "status" not in data or not isinstance(data.get("config"), dict):
        raise RecordError(f"{path}: not a kvbench record (needs a status and a config mapping)")
    problem = _shape_error(data)
    if problem:
        raise RecordError(f"{path}: not a kvbench record ({problem})")
    try:
        return RunResult.from_dict(data)
    except (TypeError, ValueError) as exc:
        raise RecordError(f"{path}: {exc}") from None


def nonfinite_kind(value: Any) -> Optional[str]:
    """``nan``, ``inf`` or ``-inf`` for a float that is not finite; None for anything else."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else "inf" if value > 0 else "-inf"
    return None


def trustworthy_ok(metrics: Mapping[str, Any]) -> bool:
    """Whether an ``ok`` record's metrics can stand for a finished job: at least one, none NaN or
    infinite (older records could hold a bare ``NaN``); one that fails is measured again on resume.
    :func:`distrust` checks the whole record."""
    return bool(metrics) and not nonfinite_metrics(metrics)


# Units whose figures may lie below zero: a fitted slope (a KV cost on a drifting machine), ratios and
# shares made from one, logit differences. Every other numeric unit counts or measures something.
SIGNED_UNITS = ("ratio", "fraction", "%", "logits", "nats per position", "µs per 1,000 tokens of context",
                "µs per 1,000 positions", "bytes per 1,000 tokens of context")
SIGNED_NAMES = ("_at_ctx0",)  # a fit's intercept (decode_ms_at_ctx0): in ms, and signed
# the last word of a metric that is words about another (peak_rss_reason, ttft_ms_p99_warning)
TEXT_WORDS = ("reason", "warning", "method", "source", "label", "note")


def metric_unit(name: str, units: Mapping[str, Any]) -> Optional[str]:
    """The unit of metric ``name``: the record's ``units`` (by name or pattern; an interval's bound has
    its estimate's), else read off the vocabulary of its name (``_ms``, ``_bytes``, ``_s``) for a record
    that declares none; None when neither says."""
    words = name.split("_")
    if isinstance(units.get(name), str):
        return units[name]
    if words[-1] in TEXT_WORDS:  # before the patterns: <v>_step_ms_ctx<C> matches ..._ctx16_ci_reason too
        return "text"
    for key in (name, _estimate(name)):
        if isinstance(units.get(key), str):
            return units[key]
        unit = next((u for p, u in units.items() if "<" in p and isinstance(u, str) and matches(p, key)), None)
        if unit is not None:
            return unit
    if "per" in words[:-1] and words[-1] in ("ctx", "w"):
        return None  # a rate over context (decode_us_per_1k_ctx): signed
    return next((unit for word, unit in (("bytes", "bytes"), ("ms", "ms"), ("s", "s")) if word in words), None)


def _estimate(name: str) -> str:
    """The figure an interval bound belongs to (``x`` for ``x_ci_low``)."""
    return re.sub(r"_ci_(low|high)$", "", name)


def distrust(record: RunResult) -> Optional[str]:
    """Why an ``ok`` record cannot stand for a finished job, or None: the checks the runner wrote it
    under, made again (a hand-edited or foreign record fails them), so resume measures it again.
    A schema this kvbench does not know; no metrics, or one not finite; a figure whose value is not
    of its unit (``"fast"`` in ms); a figure past a physical bound (measure/plausibility.py) that the
    record does not flag ``implausible``; a negative count, size or time that no bound flags."""
    version = record.schema_version
    if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version <= SCHEMA_VERSION:
        return f"schema_version={version!r}: this kvbench reads 1 to {SCHEMA_VERSION}"
    if not record.metrics:
        return "metrics is empty"
    try:  # the physical bounds the runner checked before writing it, on the record as it is now
        found = plausibility.check(record.to_dict())
    except Exception as exc:  # noqa: BLE001 — a record the check cannot read is no record it wrote
        return f"its figures cannot be checked against the machine's bounds ({type(exc).__name__}: {exc})"
    recorded = {item.get("metric") for item in record.implausible if isinstance(item, dict)}
    for item in found:
        if item["metric"] not in recorded:
            name = str(item["metric"])
            where, value = (name, item["value"]) if name.startswith("tables.") else (
                f"metrics.{name}", record.metrics.get(name, item["value"]))  # as the record holds it
            return f"{where}={value!r}: past a physical bound ({item['bound']}) the record does not flag"
    flagged = {item["metric"] for item in found}
    for name, value in record.metrics.items():
        kind = nonfinite_kind(value)
        if kind:
            return f"metrics.{name}={kind}: not a finite number"
        unit = metric_unit(name, record.units)
        if value is None or unit is None or unit in ("", "text"):
            continue
        if unit == "bool":
            if not isinstance(value, bool):
                return f"metrics.{name}={value!r}: not true or false"
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"metrics.{name}={value!r}: not a number ({unit})"
        signed = unit in SIGNED_UNITS or _estimate(name).endswith(SIGNED_NAMES) or name in flagged
        if value < 0 and not signed:
            return f"metrics.{name}={value!r}: negative, which no {unit} figure is"
    return None


def nonfinite_metrics(metrics: Mapping[str, Any]) -> Dict[str, str]:
    """name -> ``nan`` / ``inf`` / ``-inf`` for each scalar metric that is not a finite number."""
    return {name: kind for name, value in metrics.items() if (kind := nonfinite_kind(plain(value)))}


def without_nonfinite(tree: Any) -> Tuple[Any, Dict[str, str]]:
    """``tree`` with non-finite floats as None, and each one's dotted path -> its kind (``nan (3 values)``)."""
    found: Dict[str, List[str]] = {}

    def walk(node: Any, path: str) -> Any:
        node = plain(node)
        kind = nonfinite_kind(node)
        if kind:
            found.setdefault(path, []).append(kind)
            return None
        if isinstance(node, Mapping):
            return {k: walk(v, f"{path}.{k}" if path else str(k)) for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            return [walk(v, path) for v in node]  # a list's values share its path
        return node

    clean = walk(tree, "")
    reasons = {path: ", ".join(sorted(set(kinds))) + (f" ({len(kinds)} values)" if len(kinds) > 1 else "")
               for path, kinds in found.items()}
    return clean, reasons


def find_results(root: Path | str, unlisted: Optional[List[Tuple[Path, OSError]]] = None) -> List[Path]:
    """Every results.json under ``root``, in path order; unlistable directories go to ``unlisted``."""
    return find_named(root, RESULTS_FILE, unlisted)


def objective_value(record: RunResult, objective: str,
                    caps: Optional[Mapping[str, float]] = None) -> Tuple[Optional[float], Optional[str]]:
    """What a job returns to a search sweeper: (the ``objective`` metric, negated for ``-name``, None),
    or (None, why not): not ok, no number, or a ``caps`` metric above its cap or missing. Optuna
    records a None as a failed trial, never the best one whichever the direction."""
    if record.status != "ok":
        return None, f"the job is {record.status}" + (f": {record.error}" if record.error else "")
    for name, cap in (caps or {}).items():
        value, why = _number(record, name)
        if why:
            return None, f"objective_caps.{name}: cannot be checked, {why}"
        if value > cap:
            return None, f"{name}={value:g} is above objective_caps.{name}={cap:g}"
    name, sign = objective_metric(objective)
    value, why = _number(record, name)
    return (None, why) if why else (sign * value, None)


def _number(record: RunResult, name: str) -> Tuple[Optional[float], Optional[str]]:
    if name not in record.metrics:
        return None, f"the record has no {name}"
    value = record.metrics[name]
    if value is None:
        # why: null_reasons (a NaN or an infinity), else the record's nearest *_reason field
        # (energy_reason for energy_mj_per_token, peak_rss_reason for peak_rss_bytes)
        stems = [k[: -len("_reason")] for k in record.metrics if k.endswith("_reason") and record.metrics[k]]
        stem = max((s for s in stems if name.startswith(s)), key=len, default=None)
        reason = record.null_reasons.get(name) or (record.metrics[f"{stem}_reason"] if stem else None)
        return None, f"{name} is null in the record" + (f" ({reason})" if reason else "")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None, f"{name}={value!r} is not a finite number"
    return float(value), None


# ---- what a record keeps ---------------------------------------------------------------------

# every record keeps these, whatever its task reads
ALWAYS_KEPT = ("task", "model", "wandb", "rerun", "objective", "objective_caps")


def record_config(config: Dict[str, Any]) -> Dict[str, Any]:
    """The part of a job's config its record keeps: what its task reads (``TASKS``), its workload
    option's own fields and the attention's; a config whose task is unknown keeps everything."""
    if not isinstance(config, dict):
        return config
    task = TASKS.get(config.get("task", "bench"))
    if task is None:
        return dict(config)
    w = config.get("workload")
    schema = WORKLOADS.get(w.get("name", DEFAULT_WORKLOAD)) if isinstance(w, dict) else None
    reads = task.sections(schema)
    if task.runs_workload and schema is None:  # an unknown workload: what it reads is unknown too
        reads.setdefault("cache", ALL)
    out: Dict[str, Any] = {}
    for name, value in config.items():
        if name in ALWAYS_KEPT:
            out[name] = value
        elif name in reads:
            if name == "workload" and isinstance(value, dict) and schema is not None:
                value = own_keys(value, schema)
            out[name] = kept(value, reads[name]) if isinstance(value, dict) else value
    if isinstance(out.get("attention"), dict):
        out["attention"] = attention_record(out["attention"])
    if isinstance(out.get("model"), dict):
        out["model"] = model_record(out["model"])
    if isinstance(out.get("cache"), dict):
        out["cache"] = cache_record(out["cache"])
    return out


def lookup(config: Any, dotted: str) -> Any:
    """``config["a"]["b"]`` for ``"a.b"``; None when any part is missing."""
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def flatten(tree: Mapping[str, Any], prefix: str = "") -> Dict[str, Any]:
    """``{"attention": {"type": "gqa"}}`` -> ``{"attention.type": "gqa"}``; lists stay values."""
    flat: Dict[str, Any] = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{dotted}."))
        else:
            flat[dotted] = value
    return flat
