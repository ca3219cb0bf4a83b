"""The single record of a run: ``results.json`` in the Hydra job directory.

This module is the only reader and writer of records. Everything downstream (W&B, the sweep
table, the report, resumption) reads a record through :class:`RunResult` /
:func:`read_record`. A record is written atomically (temporary file in the same directory,
fsync, rename), so a reader or a job killed mid-write never sees a torn file.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

from kvbench.config import record_view

RESULTS_FILE = "results.json"
STATUSES = ("ok", "invalid", "oom", "error")
SCHEMA_VERSION = 1
# Keys of a job's config that say how it is scheduled or recorded, not what it measures.
NOT_IDENTITY = ("rerun", "wandb")


class RecordError(ValueError):
    """A results.json that cannot be read as a record. The message names the file."""


@dataclass
class RunResult:
    """One job's outcome. ``metrics`` holds scalars; ``series`` per-step lists; ``tables`` rows;
    ``methods`` the unit and method of each metric the job reported."""

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
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status={self.status!r}: must be one of {', '.join(STATUSES)}")

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)

    def get(self, dotted: str) -> Any:
        """A config value by its dotted key (``attention.num_kv_heads``); None when absent."""
        return lookup(self.config, dotted)

    def write(self, directory: Path | str) -> Path:
        return write_json_atomic(Path(directory) / RESULTS_FILE, self.to_dict())

    @classmethod
    def from_dict(cls, data: Dict[str, Any]) -> "RunResult":
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**known)


def read_json(path: Path | str) -> Any:
    """Parsed JSON of ``path``; OSError / ValueError pass through."""
    return json.loads(Path(path).read_text())


def read_record(path: Path | str) -> RunResult:
    """The record at ``path`` (a results.json or its job directory).

    Raises :class:`RecordError` naming the file when it is missing, does not parse or is not a
    kvbench record (no status, an unknown status, a config that is not a mapping)."""
    path = Path(path)
    if path.is_dir():
        path = path / RESULTS_FILE
    try:
        data = read_json(path)
    except (OSError, ValueError) as exc:
        raise RecordError(f"{path}: {exc}") from None
    if not isinstance(data, dict) or "status" not in data or not isinstance(data.get("config"), dict):
        raise RecordError(f"{path}: not a kvbench record (needs a status and a config mapping)")
    try:
        return RunResult.from_dict(data)
    except (TypeError, ValueError) as exc:
        raise RecordError(f"{path}: {exc}") from None


def write_json_atomic(path: Path, data: Any) -> Path:
    """Write JSON to ``path`` so that it is either the old file or the complete new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2, sort_keys=False, default=_json_default)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _json_default(obj: Any) -> Any:
    # torch / numpy scalars and paths end up in metrics and env; store them as plain values.
    if hasattr(obj, "item"):
        return obj.item()
    return str(obj)


def find_results(root: Path | str) -> List[Path]:
    """Every results.json under ``root`` (a job directory or a sweep), in path order."""
    root = Path(root)
    return sorted(root.rglob(RESULTS_FILE))


def completed_record(out_dir: Path | str, config: Dict[str, Any]) -> Optional[RunResult]:
    """The record in ``out_dir`` if it is ``ok`` and was produced by the same ``config`` (the
    job's validated config as a dict), else None: resume's "is this job done?".

    A missing, unreadable or non-ok record, or one for a different config (the sweep's override
    list changed, so this job number now means another job), means the job must run."""
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
