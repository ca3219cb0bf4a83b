"""Weights & Biases sink: one W&B run per job, made from the job's results.json record.

It runs after results.json is written, so nothing here can lose or change that record: every W&B
error is one warning (through ``logging``, so it also lands in Hydra's job log). ``wandb`` is
imported only when a run is made. What a run holds is described in docs/tracking.md.

``online`` never stalls a sweep: a run that cannot reach the server within
``wandb.init_timeout_s`` (W&B's default is 90 s) is written offline, and a marker file sends the
sweep's later jobs straight offline, so the wait is paid once. W&B's error reporting is off unless
``WANDB_ERROR_REPORTING`` says otherwise: its OpenTelemetry exit hook waits 10 s on a server that
never answers. An unwritable W&B directory is one warning and no run, checked before W&B starts
(wandb-core prints 17 lines of its log to stderr when it cannot make its log directory).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional

from kvbench.config.bench import MAX_INIT_TIMEOUT_S, WandbConfig
from kvbench.core.errors import one_line
from kvbench.jsonio import real_dir, write_text_atomic
from kvbench.results import RESULTS_FILE, RunResult
from kvbench.sinks.views import RecordView

log = logging.getLogger(__name__)

MODES = ("offline", "online", "disabled")
STEP_AXIS = "step"  # x axis of every per-step series; W&B's own _step counts log calls
# Tables whose rows are steps of something: their numeric columns are also logged as history
# ``<table>/<column>`` against the step column (a line per run in W&B).
TABLE_STEPS = {"turns": "turn", "serving_rate_curve": "rate"}  # a rate search's curve: latency by rate
# Series logged against another series of the record instead of ``step``: a serving run's
# scheduler state (running, waiting, blocks in use) against its time, ``serving_t_s``.
SERIES_AXES = {"serving_": "serving_t_s"}
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


def run_name(overrides: Iterable[str], swept: Optional[Iterable[str]] = None,
             config: Optional[Mapping[str, Any]] = None) -> str:
    """The job's overrides of the ``swept`` keys, else (a single run) :func:`short_name`."""
    swept = set(swept or ())
    kept = [o for o in overrides if not o.lstrip("+~").startswith(_NAME_SKIP) and _override_key(o) in swept]
    name = " ".join(kept) or short_name(config or {})
    return name if len(name) <= _NAME_MAX else name[:_NAME_MAX - 1] + "…"


def short_name(config: Mapping[str, Any]) -> str:
    """``tiny gqa kv=2 decode``: the model, the attention and the workload (or task) a job ran."""
    view = RecordView({"config": dict(config)})
    v = view.variant
    parts = [view.get("model.name"), v.label if v.named else None,
             view.get("workload.name") if view.task == "bench" else view.task]
    return " ".join(str(p) for p in parts if p is not None) or "defaults"


def _override_key(override: str) -> str:
    return override.lstrip("+~").split("=", 1)[0]


def swept_keys(sweep_dir: Optional[Path | str]) -> List[str]:
    """The keys a sweep varies, from the command line and ``hydra.sweeper.params`` that Hydra saved in
    ``multirun.yaml``; empty without that file."""
    path = Path(sweep_dir) / "multirun.yaml" if sweep_dir is not None else None
    if path is None or not path.is_file():
        return []
    try:
        from hydra.core.override_parser.overrides_parser import OverridesParser
        from omegaconf import OmegaConf

        saved = OmegaConf.load(path)
        preset = OmegaConf.select(saved, "hydra.sweeper.params") or {}
        task = OmegaConf.select(saved, "hydra.overrides.task") or []
        arguments = [f"{k}={v}" for k, v in preset.items()] + list(task)
        parsed = OverridesParser.create().parse_overrides(arguments)
    except Exception:  # noqa: BLE001 — a name is a nicety: without the sweep's keys, the short name
        return []
    return list(dict.fromkeys(o.key_or_group for o in parsed if o.is_sweep_override()))


def run_config(result: RunResult | RecordView) -> Dict[str, Any]:
    """The resolved config as nested dicts (W&B flattens them to ``attention.type``), the overrides,
    ``env``, and ``units`` (each summary metric's unit, so W&B need not parse it from the name)."""
    view = RecordView.of(result)
    units = {k: unit for k in run_summary(view) if (unit := view.unit(k))}
    return {**copy.deepcopy(dict(view.config)), "overrides": view.overrides, "env": copy.deepcopy(dict(view.env)),
            "units": units}


# Units whose smaller number is better (time, energy, loss) and whose larger is (throughput, capacity),
# as the Metric registry writes them.
LOWER_UNITS = ("ms", "mJ", "mJ/token", "µs per 1,000 positions", "µs per 1,000 tokens of context",
               "nats/token", "bits/byte")
HIGHER_UNITS = ("tokens/s", "sequences")
# Bytes a job is given or reads off the machine, not bytes it holds: no direction.
_GIVEN_BYTES = ("weight_bytes", "weight_bytes_measured", "weight_bytes_stored", "memory_budget_bytes", "corpus_bytes",
                "nvml_device_used_bytes", "bytes_read_per_step")
_LOWER_IS_BETTER = ("perplexity", "ppl_before_uptrain")  # unit "ratio": a ratio has no direction of its own


def metric_goal(key: str, unit: Optional[str]) -> Optional[str]:
    """``min`` (lower is better), ``max``, or None for a metric without a direction (counts,
    ratios, interval fields)."""
    if key.endswith(("_ci_low", "_ci_high", "_n")):
        return None
    if unit in HIGHER_UNITS or key in _HIGHER_IS_BETTER:
        return "max"
    if unit in LOWER_UNITS or (unit == "bytes" and key not in _GIVEN_BYTES) or key in _LOWER_IS_BETTER:
        return "min"
    return None


_HIGHER_IS_BETTER = ("max_rate_under_slo", "goodput", "request_throughput")  # requests/s: a rate tried has no direction


def run_summary(result: RunResult | RecordView) -> Dict[str, Any]:
    """Every scalar metric (W&B drops nulls, so they are left out), the status and the error."""
    view = RecordView.of(result)
    summary = {k: v for k, v in view.metrics.items()
               if v is not None and isinstance(v, (bool, int, float, str))}
    summary["status"] = view.status
    if view.error:
        summary["error"] = view.error
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
    with _wandb_logs_kept_to_wandb():
        try:
            return _track(result, wandb_cfg, out_dir, sweep_dir, task)
        except BaseException:  # Ctrl-C, SIGTERM (Interrupted), SystemExit: stop W&B before going on
            _kill_service()
            raise


def _kill_service() -> None:
    """Stop W&B's service process at once, then drop W&B's state in this process.

    Interrupted mid-call (a ``wandb.init`` waiting on a server that never answers), the service is
    still waiting on the server: a graceful teardown (kvbench's or W&B's own exit hook) waits with it
    until ``wandb.init_timeout_s`` runs out, and a process that exits without one leaves the service
    running, holding the terminal's (or the caller's pipe's) stdout and stderr for minutes. Its
    handle is W&B's private state; a W&B without it is torn down the graceful way."""
    setup = sys.modules.get("wandb.sdk.wandb_setup")
    connection = getattr(getattr(setup, "_singleton", None), "_connection", None)
    process = getattr(getattr(connection, "_proc", None), "_process", None)
    if isinstance(process, subprocess.Popen) and process.poll() is None:
        process.kill()
        process.wait()
    if "wandb" in sys.modules:
        _teardown(sys.modules["wandb"])


@contextlib.contextmanager
def _wandb_logs_kept_to_wandb():
    """W&B's own log records go only to its run's debug.log while kvbench drives it.

    A handler attached to every non-propagating logger (pytest's log capture, a user's logging
    setup) would otherwise show W&B's internals beside kvbench's one line."""
    logger = logging.getLogger("wandb")
    foreign = [h for h in logger.handlers if not _is_wandb_handler(h)]
    for handler in foreign:
        logger.removeHandler(handler)
    try:
        yield
    finally:
        for handler in foreign:
            if handler not in logger.handlers:
                logger.addHandler(handler)


def _is_wandb_handler(handler: logging.Handler) -> bool:
    # W&B installs a NullHandler and one FileHandler per run, filtered by the run's id.
    return type(handler) is logging.NullHandler or any(
        type(f).__module__.startswith("wandb.") for f in handler.filters)


def _track(result: RunResult, wandb_cfg: Mapping[str, Any], out_dir: Path | str,
           sweep_dir: Optional[Path | str], task: str) -> Optional[Path]:
    stage = "config"
    try:
        view = RecordView.of(result)
        mode = resolve_mode(wandb_cfg.get("mode", "offline"))
        if mode == "disabled":
            return None
        stage = "import"
        # Before wandb's import: its telemetry recorder and service read it when they start.
        os.environ.setdefault("WANDB_ERROR_REPORTING", "false")
        import wandb

        stage = "dirs"
        unwritable = _unwritable_dir(wandb, Path(out_dir))
        if unwritable is not None:
            log.warning("W&B run not made: %s (results.json is unaffected)", unwritable)
            return None

        def start(mode: str):
            return wandb.init(
                project=wandb_cfg.get("project") or "kvbench", entity=wandb_cfg.get("entity"),
                group=wandb_cfg.get("group") or sweep_group(sweep_dir),
                job_type=(view.get("workload.name") or task) if task == "bench" else task,
                name=run_name(view.overrides, swept_keys(sweep_dir), view.config),
                tags=list(wandb_cfg.get("tags") or []) or None,
                notes=view.error, config=run_config(view), dir=str(out_dir), mode=mode,
                # No console capture or system-metrics thread; git state is in config env.
                settings=wandb.Settings(silent=True, console="off", x_disable_stats=True, disable_git=True,
                                        save_code=False, init_timeout=_init_timeout(wandb_cfg)),
            )

        stage = "init"
        run = (_start_online(wandb, start, Path(out_dir), sweep_dir, _init_timeout(wandb_cfg)) if mode == "online"
               else start(mode))
        logged = False
        try:
            stage = "log"
            _log_record(wandb, run, view, Path(out_dir))
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
        if "wandb" in sys.modules:  # a run that failed to start leaves W&B's service up until the exit
            _teardown(sys.modules["wandb"])
        return None


def _init_timeout(wandb_cfg: Mapping[str, Any]) -> float:
    # An invalid job's record holds its config as given: never wait on a value that was rejected.
    timeout = wandb_cfg.get("init_timeout_s")
    valid = isinstance(timeout, (int, float)) and 0 < timeout <= MAX_INIT_TIMEOUT_S
    return float(timeout) if valid else WandbConfig.init_timeout_s


def _start_online(wandb, start, out_dir: Path, sweep_dir: Optional[Path | str], timeout_s: float):
    """An online run, or an offline one when W&B cannot be reached (said once per sweep)."""
    marker = Path(sweep_dir) / UNREACHABLE_MARKER if sweep_dir is not None else None
    if marker is not None and marker.exists():
        return start("offline")
    try:
        # Without stored credentials an online run would open an interactive login prompt and
        # block the sweep: find the key without prompting. Silent, or login looks the user's
        # name up on the server just to print it (5 s without a network). A W&B set up earlier in
        # this process keeps the environment of its time (WANDB_BASE_URL, the key): start afresh.
        _teardown(wandb)
        wandb.setup(wandb.Settings(silent=True))
        if not wandb.login(prompt=False, verify=False):
            raise RuntimeError("no credentials (run `wandb login` or set WANDB_API_KEY)")
        return start("online")
    except Exception as exc:  # noqa: BLE001 — whatever stopped it, the run is kept offline
        _teardown(wandb)  # the service may still be retrying the server
        why = _online_failure(exc, timeout_s)
    run = start("offline")  # an error here is the caller's one warning (W&B tracking failed at init)
    if marker is not None:
        what, where = "this and every later run of this sweep are", f"{sweep_dir}/*/wandb/offline-run-*"
        try:
            write_text_atomic(marker, why + "\n")
        except OSError:
            pass  # then the next job tries (and warns) again
    else:
        what, where = "the run is", run.settings.sync_dir
    log.warning("W&B online failed (%s): %s kept offline; upload later with `wandb sync %s`", why, what, where)
    return run


def _online_failure(exc: Exception, timeout_s: float) -> str:
    """Why an online start failed, in one line; W&B's advice to raise its ``init_timeout`` is
    replaced by the kvbench key that sets it."""
    why = re.sub(r"\s*Consider increasing the init_timeout setting.*", "", f"{type(exc).__name__}: {exc}", flags=re.S)
    if "Timed out" in why:
        why += f" (no answer within wandb.init_timeout_s={timeout_s:g} s)"
    return one_line(why, 300)


def _unwritable_dir(wandb, out_dir: Path) -> Optional[str]:
    """The first directory W&B must write that cannot be written, with why; None when all can.
    The run directory goes through :func:`kvbench.jsonio.real_dir`: a link planted there would send
    the run into its target."""
    import platformdirs  # a dependency of wandb

    cache_root = os.environ.get("WANDB_CACHE_DIR") or platformdirs.user_cache_dir()
    # W&B's own directories first: nothing is made in the job directory for a run not made.
    dirs = [("WANDB_CACHE_DIR (wandb-core's logs)", Path(cache_root) / "wandb" / "logs"),
            ("WANDB_DATA_DIR (artifact staging)", Path(wandb.env.get_data_dir())),
            ("the run directory", out_dir / "wandb")]
    for what, path in dirs:
        try:
            real_dir(path) if path == out_dir / "wandb" else path.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=path):
                pass
        except OSError as exc:
            return one_line(f"{what} {path} is not writable ({type(exc).__name__}: {exc.strerror or exc})", 300)
    return None


def _teardown(wandb) -> None:
    try:
        wandb.teardown()
    except Exception:  # noqa: BLE001 — teardown is cleanup; the run is already recorded
        pass


def _log_record(wandb, run, result: RecordView, out_dir: Path) -> None:
    """Series against the ``step`` axis, tables, the summary and the results artifact."""
    series = {k: v for k in result.series_names
              if (v := result.series(k)) and all(isinstance(x, (int, float)) for x in v)}
    if series:
        run.define_metric(STEP_AXIS, hidden=True, summary="none")
        for key in series:
            # summary="none": the headline numbers (decode_ms_p50, ...) already summarise it.
            axis = next((a for p, a in SERIES_AXES.items() if key.startswith(p) and a in series and a != key),
                        STEP_AXIS)
            run.define_metric(key, step_metric=axis, summary="none")
        for i in range(max(len(v) for v in series.values())):
            run.log({STEP_AXIS: i, **{k: v[i] for k, v in series.items() if i < len(v)}})
    for key in result.table_names:
        rows = result.table(key)
        if rows:
            run.log({key: _table(wandb, rows)})
            _log_steps(run, key, rows)
    for key, value in run_summary(result).items():
        goal = metric_goal(key, result.unit(key)) if isinstance(value, (int, float)) and not isinstance(value, bool) \
            else None
        if goal is not None:
            # Which way is better (W&B 0.31 has no ``goal`` argument: the summary aggregation says
            # it); the summary itself holds the record's value, set below.
            run.define_metric(key, summary=goal)
    # After the logs, so no logged value overwrites a metric of the same name.
    run.summary.update(run_summary(result))
    artifact = wandb.Artifact(_artifact_name(f"results-{run.id}"), type="results",
                              metadata={"status": result.status})
    artifact.add_file(str(out_dir / RESULTS_FILE))
    if (out_dir / "error.txt").exists():
        artifact.add_file(str(out_dir / "error.txt"))
    run.log_artifact(artifact)


def _log_steps(run, key: str, rows: List[Mapping[str, Any]]) -> None:
    """The numeric columns of a stepped table as history ``key/column`` against its step column."""
    step = TABLE_STEPS.get(key)
    if step is None or not all(isinstance(row.get(step), (int, float)) and not isinstance(row.get(step), bool)
                               for row in rows):
        return
    run.define_metric(step, hidden=True, summary="none")
    columns = {c for row in rows for c, v in row.items()
               if c != step and isinstance(v, (int, float)) and not isinstance(v, bool)}
    for column in sorted(columns):
        run.define_metric(f"{key}/{column}", step_metric=step, summary="none")
    for row in rows:
        run.log({step: row[step], **{f"{key}/{c}": row[c] for c in sorted(columns) if row.get(c) is not None}})


def _table(wandb, rows: List[Mapping[str, Any]]):
    columns: List[str] = []
    for row in rows:
        columns += [c for c in row if c not in columns]
    return wandb.Table(columns=columns, data=[[row.get(c) for c in columns] for row in rows])


def _artifact_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "-", name)


def _finish(wandb, run, exit_code: int, raise_errors: bool = False) -> None:
    """Finish the run, then stop W&B's service so it cannot perturb the next job's timing."""
    try:
        run.finish(exit_code=exit_code)
    except Exception:
        if raise_errors:
            raise
    finally:
        _teardown(wandb)
