"""A multirun's jobs, and what is on disk for each: the end-of-sweep table counts these.

Hydra's BasicSweeper splits a sweep into jobs; :func:`sweep_jobs` makes the same split from the
config (the preset's ``hydra.sweeper.params`` and the command line), so that the end of a sweep
accounts for exactly its own jobs, not for whatever an earlier sweep left in the directory.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

from omegaconf import DictConfig, OmegaConf, open_dict

from kvbench.config.layer_pattern import job_variant_label
from kvbench.jobs.claim import claim_holder, job_overrides
from kvbench.jobs.job_config import to_bench_config
from kvbench.results import RESULTS_FILE, RecordError, find_results, read_record


@dataclass
class SweepJob:
    """One job of a multirun as Hydra's basic sweeper numbers it; ``dir`` is None when
    ``hydra.sweep.subdir`` cannot be resolved outside Hydra."""

    num: int
    overrides: List[str]
    dir: Optional[Path]


def sweep_jobs(config: DictConfig) -> List[SweepJob]:
    """The jobs a basic-sweeper multirun of ``config`` launches, in job-number order."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    preset = OmegaConf.select(config, "hydra.sweeper.params") or {}
    arguments = [f"{k}={v}" for k, v in preset.items()] + override_list(config.hydra.overrides.task)
    [jobs] = BasicSweeper.split_arguments(parser.parse_overrides(arguments), None)
    return [SweepJob(num, list(job), _job_dir(config, num, job, parser)) for num, job in enumerate(jobs)]


def override_list(overrides: Any) -> List[str]:
    """The command line's overrides as written, unresolved (OmegaConf would resolve
    ``model.name=${oops}`` on reading and raise instead of naming its key)."""
    if OmegaConf.is_config(overrides):
        return [str(o) for o in OmegaConf.to_container(overrides, resolve=False)]
    return [str(o) for o in overrides]


def sweep_size(config: DictConfig) -> int:
    """Number of jobs a basic-sweeper multirun will launch (CLI sweeps x preset sweeper params)."""
    return len(sweep_jobs(config))


def _job_dir(config: DictConfig, num: int, overrides: List[str], parser) -> Optional[Path]:
    """``hydra.sweep.dir / hydra.sweep.subdir`` for job ``num``, resolved as Hydra does."""
    from hydra._internal.config_loader_impl import get_overrides_dirname

    sweep = Path(config.hydra.sweep.dir)
    subdir = OmegaConf.to_container(config.hydra.sweep, resolve=False).get("subdir")
    if subdir == "${hydra.job.num}":  # the default, and kvbench's
        return sweep / str(num)
    try:
        node = copy.deepcopy(config)
        OmegaConf.set_readonly(node, False)
        OmegaConf.set_struct(node, False)
        dirname = node.hydra.job.config.override_dirname
        node.hydra.job.num = num
        node.hydra.job.override_dirname = get_overrides_dirname(
            parser.parse_overrides(overrides), list(dirname.exclude_keys), dirname.item_sep, dirname.kv_sep)
        return sweep / str(node.hydra.sweep.subdir)
    except Exception:  # noqa: BLE001 — a subdir that needs Hydra's runtime: match records by overrides
        return None


def sweep_records(sweep_dir: Path | str, config: DictConfig) -> List[Dict[str, Any]]:
    """One row per job of the sweep ``config`` describes, from what is on disk, whatever that is; a
    record another sweep left in the directory (other overrides) is not this sweep's."""
    sweep_dir, jobs = Path(sweep_dir), sweep_jobs(config)
    # With a custom hydra.sweep.subdir, any job directory may hold a job: match by overrides.
    anywhere = [path.parent for path in find_results(sweep_dir)] if any(j.dir is None for j in jobs) else []
    rows, labels = [], {}
    for job in jobs:
        row = None
        for job_dir in [job.dir] if job.dir is not None else anywhere:
            row = _job_row(job_dir, job.overrides, sweep_dir, exact=job.dir is not None)
            if row is not None:
                break
        rows.append(row or {"job": str(job.num), "status": "not run", "config": {}, "metrics": {},
                            "overrides": job.overrides, "error": "no record of this job"})
        if not rows[-1]["config"]:  # no record: named as its job line names it, not "None kv=None"
            # composed once per variant (a few tenths of a second each): a value of these groups'
            # keys names no variant (kv_memory's 27 jobs are 3)
            key = tuple(o for o in job.overrides if not o.startswith(_NOT_VARIANT))
            if key not in labels:
                labels[key] = planned_label(config, job.overrides)
            if labels[key] is not None:
                rows[-1]["label"] = labels[key]
    return rows


_NOT_VARIANT = ("workload.", "runtime.", "wandb.", "slo.", "hydra.")  # dotted keys: a value, no preset


def planned_label(config: DictConfig, overrides: List[str]) -> Optional[str]:
    """The variant a job of the sweep ``config`` runs, as its job line names it (``gqa kv=2``): its
    config composed from ``overrides`` as Hydra's sweeper composes it, typed. None where it cannot be
    (no Hydra loaded, a config that is invalid): the job is then named by its overrides."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from kvbench.config.bench import CONF_DIR

    try:
        if GlobalHydra.instance().is_initialized():  # in the sweep: its own config path and plugins
            composed = GlobalHydra.instance().config_loader().load_sweep_config(config, list(overrides))
        else:  # kvbench-report, a test: kvbench's own conf/
            with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
                composed = GlobalHydra.instance().config_loader().load_sweep_config(config, list(overrides))
        with open_dict(composed):
            del composed["hydra"]
        return job_variant_label(to_bench_config(composed))
    except Exception:  # noqa: BLE001 — a name for a row; the row and its overrides stay as they are
        return None


def _job_row(job_dir: Path, overrides: List[str], sweep_dir: Path, exact: bool) -> Optional[Dict[str, Any]]:
    """The row of the job with ``overrides`` in ``job_dir``; without ``exact``, None unless the
    directory holds that job's record."""
    rel = os.path.relpath(job_dir, sweep_dir)
    row = {"job": rel, "config": {}, "metrics": {}, "overrides": overrides}
    record, problem = None, None
    try:
        record = read_record(job_dir).to_dict()
    except RecordError as exc:
        problem = exc
    holder = claim_holder(job_dir) if exact else None  # a job being run has no final record yet
    if record is not None and job_overrides(record.get("overrides")) == job_overrides(overrides) and holder is None:
        return {**record, "job": rel}
    if not exact:
        return None
    if holder is not None:
        return {**row, "status": "running", "error": f"claimed by {holder}"}
    if problem is not None and _present(job_dir / RESULTS_FILE):
        return {**row, "status": "unreadable", "error": str(problem)}
    # Hydra writes .hydra/overrides.yaml as a job starts
    started = job_overrides(_read_overrides(job_dir)) == job_overrides(overrides)
    return {**row, "status": "missing" if started else "not run",
            "error": "no results.json: the job was killed" if started else "this sweep has not run it"}


def _present(path: Path) -> bool:
    """``path`` is there, or kvbench may not look (a job directory of mode 000: EACCES, which
    pathlib's exists() raises): either way not a job that never ran."""
    try:
        path.stat()
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError:
        return True
    return True


def _read_overrides(job_dir: Path) -> Any:
    path = job_dir / ".hydra" / "overrides.yaml"
    if not path.is_file():  # a FIFO would block the read
        return None
    try:
        return OmegaConf.to_container(OmegaConf.load(path))
    except Exception:  # noqa: BLE001 — absent or not YAML: the job never started here
        return None
