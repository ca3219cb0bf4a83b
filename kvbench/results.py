"""The single record of a run: ``results.json`` in the Hydra job directory.

Everything downstream (W&B, the sweep report, resumption) reads this record and nothing else.
It is written atomically (temporary file in the same directory, fsync, rename), so a reader or
a job killed mid-write never sees a torn file.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

RESULTS_FILE = "results.json"
STATUSES = ("ok", "invalid", "oom", "error")
SCHEMA_VERSION = 1

# Unit and method of every metric a run can report; written into each record and the README.
METRIC_METHODS: Dict[str, str] = {
    "prefill_ms": "ms; time to first token: prompt forward + argmax, median over timed trials",
    "decode_ms_p50": "ms; per-token decode step latency, 50th percentile over every step of every timed trial",
    "decode_ms_p90": "ms; per-token decode step latency, 90th percentile",
    "decode_ms_p99": "ms; per-token decode step latency, 99th percentile",
    "decode_ms_mean": "ms; mean per-token decode step latency",
    "tokens_per_s": "tokens/s; batch_size x gen_len / decode time of a trial, median over timed trials",
    "e2e_ms": "ms; prefill + all decode steps of a trial, median over timed trials",
    "kv_cache_bytes": "bytes; storage held by the cache tensors at the end of a trial (untyped_storage().nbytes())",
    "kv_cache_bytes_formula": "bytes; 2 * layers * kv_heads * head_dim * seq_len * batch * bytes_per_element",
    "weight_bytes": "bytes; parameters (numel * element_size)",
    "timing_method": "cuda_events (synchronised once after the trial) on CUDA, perf_counter on CPU",
}


@dataclass
class RunResult:
    """One job's outcome. ``metrics`` holds scalars; ``series`` per-step lists; ``tables`` rows."""

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
    methods: Dict[str, str] = field(default_factory=lambda: dict(METRIC_METHODS))
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status={self.status!r}: must be one of {', '.join(STATUSES)}")

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)

    def write(self, directory: Path | str) -> Path:
        return write_json_atomic(Path(directory) / RESULTS_FILE, self.to_dict())

    @classmethod
    def from_dict(cls, data: Dict[str, Any]) -> "RunResult":
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**known)

    @classmethod
    def read(cls, path: Path | str) -> "RunResult":
        path = Path(path)
        if path.is_dir():
            path = path / RESULTS_FILE
        return cls.from_dict(json.loads(path.read_text()))


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
