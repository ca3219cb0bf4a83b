"""One job as ``runtime.tensor_parallel`` processes, started as torch starts them
(``torch.multiprocessing.spawn``; the rendezvous a ``torchrun`` gives, on this host): gloo between CPU
ranks, NCCL between GPUs (rank r on ``cuda:r``). Each rank runs the same job on its part of the model
(:func:`kvbench.tasks.common.build_model` cuts it, :mod:`kvbench.parallel.tensor`), so every forward
meets the same all-reduces in the same order; rank 0 writes the job's ``results.json`` and rank r its
own under ``ranks/r/``. Once all have ended, rank 0's record gains ``tables.ranks``: each rank's
status, the KV and weight bytes it allocated beside the formula's, and the time its all-reduces took.
A rank that fails is recorded in that table and makes the job's status its own.
"""

from __future__ import annotations

import socket
import statistics
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch

from kvbench.core.errors import ConfigError, one_line
from kvbench.metrics import record_methods
from kvbench.parallel import tensor
from kvbench.results import RecordError, RunResult, read_record, save

RANKS_DIR = "ranks"
# a rank waits this long at an all-reduce for the others (one that died leaves the rest waiting)
COLLECTIVE_TIMEOUT = timedelta(minutes=5)
# worst first: the job's status is its worst rank's
STATUS_ORDER = ("interrupted", "error", "oom", "invalid", "ok")

RANK_KEYS = ("kv_cache_bytes", "kv_cache_bytes_formula", "weight_bytes", "num_params", "allreduce_ms_per_step",
             "decode_ms_p50")


def run_ranks(job: Any, out_dir: Path, overrides: List[str], run_job: Callable[..., RunResult],
              device: torch.device) -> RunResult:
    """Run ``job`` (a BenchConfig) as its ``runtime.tensor_parallel`` ranks, each through ``run_job``;
    returns rank 0's record, with every rank's figures."""
    ranks = job.runtime.tensor_parallel
    if device.type == "cuda" and torch.cuda.device_count() < ranks:
        raise ConfigError(f"runtime.tensor_parallel={ranks}: more ranks than this machine's "
                          f"{torch.cuda.device_count()} GPUs")
    if device.type == "cpu" and ranks > (len(_cpus()) or 1):
        raise ConfigError(f"runtime.tensor_parallel={ranks}: more ranks than the {len(_cpus())} CPUs this job may use")
    port = _free_port()
    failure: Optional[str] = None
    try:
        torch.multiprocessing.spawn(_rank, args=(ranks, port, job, str(out_dir), overrides, run_job, device.type),
                                    nprocs=ranks, join=True)
    except Exception as exc:  # noqa: BLE001 — a rank's failure is recorded, the others' records kept
        failure = one_line(f"{type(exc).__name__}: {exc}")
    return merge_ranks(Path(out_dir), ranks, failure)


def _rank(rank: int, ranks: int, port: int, job: Any, out_dir: str, overrides: List[str],
          run_job: Callable[..., RunResult], device_type: str) -> None:
    import torch.distributed as dist

    if device_type == "cuda":
        torch.cuda.set_device(rank)
        job = replace(job, runtime=replace(job.runtime, device=f"cuda:{rank}"))
    dist.init_process_group(backend(device_type), init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=ranks, timeout=COLLECTIVE_TIMEOUT)
    group = tensor.RankGroup(rank, ranks, job.runtime.expert_parallel)
    tensor.join(group)
    where = Path(out_dir) if rank == 0 else Path(out_dir) / RANKS_DIR / str(rank)
    try:
        result = run_job(job, where, overrides)
        result.methods.update(record_methods(tensor.RANK_METRICS))
        result.metrics.update(tensor_parallel_ranks=ranks, allreduce_calls=group.calls,
                              allreduce_ms_per_step=(statistics.median(group.decode_ms) * group.hooks
                                                     if group.decode_ms else None))
        save(result, where)
    finally:
        dist.destroy_process_group()


def backend(device_type: str) -> str:
    """The torch.distributed backend between ranks on ``device_type``: NCCL between GPUs, gloo between CPUs."""
    return "nccl" if device_type == "cuda" else "gloo"


def merge_ranks(out_dir: Path, ranks: int, failure: Optional[str] = None) -> RunResult:
    """Rank 0's record with ``tables.ranks`` (each rank's record's figures, or why it has none), its
    status the worst rank's; written again, atomically."""
    rows: List[Dict[str, Any]] = []
    records: List[Optional[RunResult]] = []
    for rank in range(ranks):
        where = out_dir if rank == 0 else out_dir / RANKS_DIR / str(rank)
        try:
            record: Optional[RunResult] = read_record(where)
        except RecordError as exc:
            record, why = None, str(exc)
        records.append(record)
        rows.append({"rank": rank, "status": record.status if record else "error",
                     **({k: record.metrics.get(k) for k in RANK_KEYS} if record else {"error": why})})
    head = records[0]
    if head is None:  # rank 0 never wrote: the job's record says why
        head = RunResult(status="error", config={}, error=failure or rows[0].get("error"))
    worst = min((row["status"] for row in rows), key=STATUS_ORDER.index)
    if STATUS_ORDER.index(worst) < STATUS_ORDER.index(head.status):
        bad = next(row for row in rows if row["status"] == worst)
        head.status = worst
        head.error = one_line(f"rank {bad['rank']}: " + (records[bad["rank"]].error if records[bad["rank"]]
                                                          else bad.get("error", failure or worst)))
    head.tables["ranks"] = rows
    head.methods.update(record_methods(tensor.RANK_METRICS))
    save(head, out_dir)
    return head


def _cpus() -> List[int]:
    import os

    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
