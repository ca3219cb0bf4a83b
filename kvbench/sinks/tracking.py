"""Weights & Biases sink: one W&B run per job, made from the job's results.json record.

The CLI calls :func:`track` after the runner has written results.json, so nothing here can lose
or change that record: every W&B error is caught and reported as one warning (through
``logging``, so it also lands in Hydra's job log beside results.json). ``wandb`` is imported only
when a run is made; ``wandb.mode=disabled`` never imports it.

What a run holds:
- group = the sweep (its multirun directory name) unless ``wandb.group`` is set; job_type = the
  workload (or the task); name = the job's overrides.
- config = the resolved config flattened to dotted top-level keys (``attention.type``,
  ``workload.prompt_len``, ...), which W&B can group and filter by, plus ``overrides`` and the
  environment as ``env.*``. Flat keys, not nested dicts, so no key is shown twice in the UI.
- summary = every scalar metric, ``status`` and ``error``.
- every per-step series (``decode_ms``) logged against its own ``step`` axis, every table
  (the multi-turn ``turns``) as a ``wandb.Table``, and results.json as a ``results`` artifact.

``online`` never stalls a sweep: ``wandb.init`` may try to reach the server for
``wandb.init_timeout_s`` seconds (W&B's own default is 90 s), and when it cannot (no network,
no credentials) the run is written offline instead, to be uploaded later with ``wandb sync``.
A marker file in the sweep directory then sends the sweep's later jobs straight to offline, so
the warning is said once per sweep and the wait paid once.
"""

from __future__ import annotations

import logging
import math
import os
import re
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional

from kvbench.config import WandbConfig, one_line
from kvbench.results import RESULTS_FILE, RunResult, flatten

log = logging.getLogger(__name__)

MODES = ("offline", "online", "disabled")
STEP_AXIS = "step"  # x axis of every per-step series; W&B's own _step counts log calls
_NAME_MAX = 128
# Overrides that say where or how a run is recorded, not what was measured.
_NAME_SKIP = ("hydra.", "wandb.", "wandb=")
# In a sweep directory: W&B online failed for an earlier job of this sweep (the file says why).
UNREACHABLE_MARKER = ".kvbench-wandb-unreachable"


def sweep_group(sweep_dir: Optional[Path | str]) -> Optional[str]:
    """The W&B group of a sweep: its path below ``multirun/`` joined by ``_``
    (``multirun/2026-11-29/08-50-00`` -> ``2026-11-29_08-50-00``), else the directory's name."""
    if sweep_dir is None:
        return None
    parts = Path(sweep_dir).parts
    if "multirun" in parts[:-1]:
        below = parts[len(parts) - parts[::-1].index("multirun"):]
        return "_".join(below)
    return Path(sweep_dir).name or None


def run_name(overrides: Iterable[str]) -> str:
    """A display name from the job's overrides (``attention=gqa workload.batch_size=8``)."""
    kept = [o for o in overrides if not o.lstrip("+~").startswith(_NAME_SKIP)]
    name = " ".join(kept) or "defaults"
    return name if len(name) <= _NAME_MAX else name[:_NAME_MAX - 1] + "…"


def run_config(result: RunResult) -> Dict[str, Any]:
    """The W&B config of a job: flat dotted keys of the resolved config, overrides, env.*."""
    config = flatten(result.config)
    config["overrides"] = list(result.overrides)
    config.update(flatten(result.env, "env."))
    return config


def run_summary(result: RunResult) -> Dict[str, Any]:
    """Every scalar metric (W&B drops nulls, so they are left out), the status and the error."""
    summary = {k: v for k, v in result.metrics.items()
               if v is not None and isinstance(v, (bool, int, float, str))}
    summary["status"] = result.status
    if result.error:
        summary["error"] = result.error
    return summary


def resolve_mode(mode: Any) -> str:
    """The config's mode, except that ``WANDB_MODE=disabled`` in the environment always wins
    (CI and tests turn W&B off that way)."""
    if os.environ.get("WANDB_MODE") == "disabled":
        return "disabled"
    if mode not in MODES:
        raise ValueError(f"wandb.mode={mode!r}: must be one of {', '.join(MODES)}")
    return mode


def new_sweep(sweep_dir: Path | str) -> None:
    """A sweep starts in ``sweep_dir``: W&B being unreachable for an earlier sweep into the same
    directory says nothing about this one."""
    try:
        (Path(sweep_dir) / UNREACHABLE_MARKER).unlink(missing_ok=True)
    except OSError:
        pass  # an unwritable sweep dir fails the jobs' own writes, with their own message


def track(result: RunResult, wandb_cfg: Mapping[str, Any], out_dir: Path | str,
          sweep_dir: Optional[Path | str] = None, task: str = "bench") -> Optional[Path]:
    """Record one finished job as a W&B run in ``out_dir/wandb``; returns the run's directory
    (None when disabled or when W&B failed, which is logged as a warning and never raised)."""
    stage = "config"
    try:
        mode = resolve_mode(wandb_cfg.get("mode", "offline"))
        if mode == "disabled":
            return None
        stage = "import"
        import wandb

        def start(mode: str):
            return wandb.init(
                project=wandb_cfg.get("project") or "kvbench", entity=wandb_cfg.get("entity"),
                group=wandb_cfg.get("group") or sweep_group(sweep_dir),
                job_type=result.config.get("workload", {}).get("name", task) if task == "bench" else task,
                name=run_name(result.overrides), tags=list(wandb_cfg.get("tags") or []) or None,
                notes=result.error, config=run_config(result), dir=str(out_dir), mode=mode,
                # No console capture or system-metrics thread; git state is in config env.*.
                settings=wandb.Settings(silent=True, console="off", x_disable_stats=True, disable_git=True,
                                        save_code=False, init_timeout=_init_timeout(wandb_cfg)),
            )

        stage = "init"
        run = _start_online(wandb, start, Path(out_dir), sweep_dir) if mode == "online" else start(mode)
        logged = False
        try:
            stage = "log"
            _log_record(wandb, run, result, Path(out_dir))
            run_dir = Path(run.settings.sync_dir)
            logged = True
        finally:
            # Always finish, so the next job of a multirun starts clean; a finish error only
            # counts when nothing failed before it.
            stage = "finish" if logged else stage
            _finish(wandb, run, exit_code=0 if logged else 1, raise_errors=logged)
        return run_dir
    except Exception as exc:  # noqa: BLE001 — a sink never costs the run; say what failed
        log.warning("W&B tracking failed at %s: %s: %s (results.json is unaffected)",
                    stage, type(exc).__name__, exc)
        return None


def _init_timeout(wandb_cfg: Mapping[str, Any]) -> float:
    # An invalid job's record holds its config as given: never wait on a value that was rejected.
    timeout = wandb_cfg.get("init_timeout_s")
    valid = isinstance(timeout, (int, float)) and 0 < timeout < math.inf
    return float(timeout) if valid else WandbConfig.init_timeout_s


def _start_online(wandb, start, out_dir: Path, sweep_dir: Optional[Path | str]):
    """An online run, or an offline one when W&B cannot be reached: said once per sweep, after
    which the sweep's later jobs go offline without trying (the marker file)."""
    marker = Path(sweep_dir) / UNREACHABLE_MARKER if sweep_dir is not None else None
    if marker is not None and marker.exists():
        return start("offline")
    try:
        # Without stored credentials an online run would open an interactive login prompt and
        # block the sweep: find the key without prompting. Silent, or login looks the user's
        # name up on the server just to print it (5 s without a network).
        wandb.setup(wandb.Settings(silent=True))
        if not wandb.login(prompt=False, verify=False):
            raise RuntimeError("no credentials (run `wandb login` or set WANDB_API_KEY)")
        return start("online")
    except Exception as exc:  # noqa: BLE001 — whatever stopped it, the run is kept offline
        _teardown(wandb)  # the service may still be retrying the server
        why = one_line(f"{type(exc).__name__}: {exc}", 300)
        where = f"{sweep_dir}/*/wandb/offline-run-*" if marker is not None else f"{out_dir}/wandb/offline-run-*"
        log.warning("W&B online failed (%s): writing %s offline instead; upload later with `wandb sync %s`",
                    why, "this and every later run of this sweep" if marker is not None else "the run", where)
        if marker is not None:
            try:
                marker.write_text(why + "\n")
            except OSError:
                pass  # then the next job tries (and warns) again
        return start("offline")


def _teardown(wandb) -> None:
    try:
        wandb.teardown()
    except Exception:  # noqa: BLE001 — teardown is cleanup; the run is already recorded
        pass


def _log_record(wandb, run, result: RunResult, out_dir: Path) -> None:
    """Series against the ``step`` axis, tables, the summary and the results artifact."""
    series = {k: v for k, v in result.series.items()
              if isinstance(v, list) and all(isinstance(x, (int, float)) for x in v) and v}
    if series:
        run.define_metric(STEP_AXIS, hidden=True, summary="none")
        for key in series:
            # summary="none": the headline numbers (decode_ms_p50, ...) already summarise it.
            run.define_metric(key, step_metric=STEP_AXIS, summary="none")
        for i in range(max(len(v) for v in series.values())):
            run.log({STEP_AXIS: i, **{k: v[i] for k, v in series.items() if i < len(v)}})
    for key, rows in result.tables.items():
        if rows:
            run.log({key: _table(wandb, rows)})
    # After the logs, so no logged value overwrites a metric of the same name.
    run.summary.update(run_summary(result))
    artifact = wandb.Artifact(_artifact_name(f"results-{run.id}"), type="results",
                              metadata={"status": result.status})
    artifact.add_file(str(out_dir / RESULTS_FILE))
    if (out_dir / "error.txt").exists():
        artifact.add_file(str(out_dir / "error.txt"))
    run.log_artifact(artifact)


def _table(wandb, rows: List[Mapping[str, Any]]):
    columns: List[str] = []
    for row in rows:
        columns += [c for c in row if c not in columns]
    return wandb.Table(columns=columns, data=[[row.get(c) for c in columns] for row in rows])


def _artifact_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "-", name)


def _finish(wandb, run, exit_code: int, raise_errors: bool = False) -> None:
    """Finish the run, then stop W&B's service process so it cannot perturb the timing of the
    next job of a multirun (the next ``wandb.init`` starts a fresh one)."""
    try:
        run.finish(exit_code=exit_code)
    except Exception:
        if raise_errors:
            raise
    finally:
        _teardown(wandb)
