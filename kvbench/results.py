"""The single record of a run: ``results.json`` in the Hydra job directory.

This module is the only reader and writer of records. Everything downstream (W&B, the sweep
table, the report, resumption) reads a record through :class:`RunResult` /
:func:`read_record`. A record is written atomically (temporary file in the same directory,
fsync, rename), so a reader or a job killed mid-write never sees a torn file.

It also owns the job directory's other piece of state: the claim (:func:`claim_job`), an
``flock`` that says a process is running the job now, so that two kvbench processes never
measure one job at the same time.

Records are strict JSON: a NaN or an infinity is written as null, and ``null_reasons`` says
which value was what.
"""

from __future__ import annotations

import datetime as dt
import errno
import fcntl
import json
import math
import os
import secrets
import socket
import stat
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

from kvbench.config import objective_metric, record_view

RESULTS_FILE = "results.json"
# interrupted: stopped from outside before it finished (Ctrl-C, SIGTERM, preemption, a kill);
# it keeps the metrics complete by then, and resume runs the job again.
STATUSES = ("ok", "invalid", "oom", "error", "interrupted")
SCHEMA_VERSION = 1
CLAIM_FILE = ".kvbench-claim"
# A record is small (metrics, one series, a few tables); anything far larger is not one, and
# reading it whole could exhaust memory.
MAX_RECORD_BYTES = 64 * 2**20
# Keys of a job's config that say how it is scheduled or recorded, not what it measures.
NOT_IDENTITY = ("rerun", "wandb", "objective", "objective_caps")


class RecordError(ValueError):
    """A results.json that cannot be read as a record. The message names the file."""


@dataclass
class RunResult:
    """One job's outcome. ``metrics`` holds scalars; ``series`` per-step lists; ``tables`` rows;
    ``methods`` the unit and method of each metric the job reported; ``null_reasons`` why a
    value is null: a metric's name (or the dotted path of a value elsewhere in the record) ->
    ``nan`` / ``inf`` / ``-inf``, the non-finite number it was, or in words why a measurement is
    null (nothing seen, too few samples)."""

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
    null_reasons: Dict[str, str] = field(default_factory=dict)
    # null: the run measured the named model's own KV-head count; else what was changed
    # (config.kv_layout_change: from_kv_heads, to_kv_heads, method, text)
    kv_conversion: Optional[Dict[str, Any]] = None
    # figures that break a physical bound of the machine (measure/plausibility.py): each
    # {metric, value, bound, reason}; the figure stays in metrics, flagged, never silently true
    implausible: List[Dict[str, Any]] = field(default_factory=list)
    schema_version: int = SCHEMA_VERSION
    # Not part of the record: why results.json could not be written (the disk was full, say),
    # so that whoever prints the outcome can hand the record over another way.
    unsaved: Optional[str] = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status={self.status!r}: must be one of {', '.join(STATUSES)}")

    def to_dict(self) -> Dict[str, Any]:
        data = asdict(self)
        del data["unsaved"]
        return data

    def get(self, dotted: str) -> Any:
        """A config value by its dotted key (``attention.num_kv_heads``); None when absent."""
        return lookup(self.config, dotted)

    def write(self, directory: Path | str) -> Path:
        """Write results.json; non-finite numbers become nulls first (see :meth:`null_nonfinite`)."""
        self.null_nonfinite()
        return write_json_atomic(Path(directory) / RESULTS_FILE, self.to_dict())

    def null_nonfinite(self) -> None:
        """Replace every NaN / infinity in the record by None and say why in ``null_reasons``,
        so that the record in memory is the strict JSON written to disk."""
        data, reasons = without_nonfinite({k: v for k, v in self.to_dict().items() if k != "null_reasons"})
        for name, value in data.items():
            setattr(self, name, value)
        self.null_reasons.update({k[len("metrics."):] if k.startswith("metrics.") else k: why
                                  for k, why in reasons.items()})

    @classmethod
    def from_dict(cls, data: Dict[str, Any]) -> "RunResult":
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__ and k != "unsaved"}
        return cls(**known)


# The JSON type each field of a record must have (None allowed where the field is Optional);
# what sinks index into must be what they expect, so a file that parses but has, say, a list
# for its metrics is unreadable, not a crash later.
_FIELD_TYPES = {"config": dict, "metrics": dict, "series": dict, "tables": dict, "env": dict,
                "error": (str, type(None)), "overrides": list, "started_at": (str, type(None)),
                "finished_at": (str, type(None)), "methods": dict, "null_reasons": dict,
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
    return None
def read_regular(path: Path | str, limit: Optional[int] = None) -> bytes:
    """At most ``limit`` bytes of ``path`` (all of it for None). Anything but a regular file is
    an OSError: a FIFO blocks its reader until a writer comes (forever, in a job) and a device
    such as /dev/zero never ends. The check is made on the descriptor, opened non-blocking, so
    a file replaced after it was listed cannot slip through."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        return f.read() if limit is None else f.read(limit)


def read_json(path: Path | str) -> Any:
    """Parsed JSON of the regular file ``path``; OSError / ValueError pass through."""
    return json.loads(read_regular(path).decode("utf-8"))  # bytes would let json guess UTF-16


def read_record(path: Path | str) -> RunResult:
    """The record at ``path`` (a results.json or its job directory).

    Raises :class:`RecordError` naming the file when it is missing, is not a regular file of a
    sane size, does not parse or is not a kvbench record (no status, an unknown status, a field
    of the wrong type)."""
    path = Path(path)
    if path.is_dir():
        path = path / RESULTS_FILE
    try:
        info = path.stat()
    except OSError as exc:
        raise RecordError(f"{path}: {exc}") from None
    # A FIFO or a device named results.json would block or never end (read_regular checks again
    # on the open descriptor).
    if not stat.S_ISREG(info.st_mode):
        raise RecordError(f"{path}: not a regular file")
    if info.st_size > MAX_RECORD_BYTES:
        raise RecordError(f"{path}: {info.st_size} bytes, too large for a record")
    try:
        data = json.loads(read_regular(path, MAX_RECORD_BYTES + 1).decode("utf-8"))
    except (OSError, ValueError) as exc:  # UnicodeDecodeError included
        raise RecordError(f"{path}: {exc}") from None
    except RecursionError:
        raise RecordError(f"{path}: nested too deeply to be a record") from None
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


def nonfinite_metrics(metrics: Mapping[str, Any]) -> Dict[str, str]:
    """name -> ``nan`` / ``inf`` / ``-inf`` for each scalar metric that is not a finite number."""
    return {name: kind for name, value in metrics.items() if (kind := nonfinite_kind(_plain(value)))}


def without_nonfinite(tree: Any) -> Tuple[Any, Dict[str, str]]:
    """``tree`` with every non-finite float replaced by None, and the dotted path of each
    replaced value -> its kind (``nan (3 values)`` for several in one list)."""
    found: Dict[str, List[str]] = {}

    def walk(node: Any, path: str) -> Any:
        node = _plain(node)
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


def _plain(value: Any) -> Any:
    # torch / numpy scalars end up in metrics; compare and store them as plain numbers.
    return value.item() if hasattr(value, "item") and not isinstance(value, (Mapping, list, tuple)) else value


def write_json_atomic(path: Path, data: Any) -> Path:
    """Write ``data`` to ``path`` as strict JSON (a NaN or an infinity is a ValueError, never a
    bare ``NaN`` that strict parsers reject), so that it is either the old file or the complete
    new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = _create_temp(path)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2, sort_keys=False, default=_json_default, allow_nan=False)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _create_temp(path: Path) -> tuple[int, str]:
    """A new temporary file beside ``path``, created with mode 0666 less the umask, as
    ``open()`` would (``tempfile.mkstemp`` makes 0600, and other users could not read records)."""
    while True:
        tmp = str(path.parent / f".{path.name}.{secrets.token_hex(4)}.tmp")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), tmp
        except FileExistsError:
            continue


def _json_default(obj: Any) -> Any:
    # torch / numpy scalars and paths end up in metrics and env; store them as plain values.
    plain = _plain(obj)
    return str(obj) if plain is obj else plain


class JobClaim:
    """This process is running the job in ``directory``: an exclusive ``flock`` on its claim
    file, which names the host, pid and start. Released by :meth:`release` or when the process
    ends in any way (the kernel drops the lock, even on SIGKILL), so a claim never goes stale."""

    def __init__(self, directory: Path, handle: Any):
        self.directory, self._handle = directory, handle

    def release(self) -> None:
        if self._handle is not None:
            self._handle.close()  # closing the last descriptor drops the flock
            self._handle = None

    def __enter__(self) -> "JobClaim":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


def claim_job(directory: Path | str) -> Optional[JobClaim]:
    """Claim the job in ``directory`` for this process; None when another process holds it
    (another kvbench, or a job process a killed sweep left running)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    handle = open(directory / CLAIM_FILE, "a+")  # not "w": that would erase the holder's name
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        return None
    handle.seek(0)
    handle.truncate()
    since = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    handle.write(f"{socket.gethostname()} pid {os.getpid()} since {since}\n")
    handle.flush()
    return JobClaim(directory, handle)


def claim_holder(directory: Path | str) -> Optional[str]:
    """Who holds the claim on ``directory`` (``"host pid N since T"``), or None when nobody
    does. A claim this process holds through another :class:`JobClaim` counts as held."""
    path = Path(directory) / CLAIM_FILE
    try:
        handle = open(path)
    except OSError:
        return None
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return handle.read(200).strip() or "another process"
        except OSError:
            return None
        return None  # closing the file drops the shared lock just taken


def find_results(root: Path | str) -> List[Path]:
    """Every results.json under ``root`` (a job directory or a sweep), in path order."""
    root = Path(root)
    return sorted(root.rglob(RESULTS_FILE))


def completed_record(out_dir: Path | str, config: Dict[str, Any]) -> Optional[RunResult]:
    """The record in ``out_dir`` if it is ``ok`` and was produced by the same ``config`` (the
    job's validated config as a dict), else None: resume's "is this job done?".

    A missing, unreadable or non-ok record (``interrupted`` included), or one for a different
    config (the sweep's override list changed, so this job number now means another job), means
    the job must run."""
    try:
        record = read_record(out_dir)
    except RecordError:
        return None
    if record.status != "ok":
        return None
    return record if _identity(record.config) == _identity(config) else None


def _identity(config: Any) -> Any:
    # Compare as results.json stores it (JSON types), the keys the job's task reads (a record
    # written before records left the others out compares the same), without the keys that do
    # not change a job.
    if not isinstance(config, dict):
        return None
    plain = json.loads(json.dumps(record_view(config), default=str))
    return {k: v for k, v in plain.items() if k not in NOT_IDENTITY}


def objective_value(record: RunResult, objective: str,
                    caps: Optional[Mapping[str, float]] = None) -> Tuple[Optional[float], Optional[str]]:
    """What a job returns to a search sweeper: the metric ``objective`` of ``record`` as a float
    (negated for ``-name``), and None; or None and why there is no value: the job is not ``ok``,
    a metric is missing, null or not a number, or a metric of ``caps`` is above its cap (or
    absent, so the cap cannot be checked). Optuna's sweeper records a None as a failed trial:
    never the best one, whichever the direction."""
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
