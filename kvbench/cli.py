"""The entry point ``kvbench`` (Hydra). With :mod:`kvbench.cli_job` (one Hydra job) and
:mod:`kvbench.cli_sweep` (the sweep around its jobs) it wires the Hydra app to the jobs layer and
the sinks; nothing imports them back.

Exit codes: 0 ok; 2 a single run with an invalid value (one line on stderr naming the key),
or a command line Hydra cannot compose (an unknown group option, bad override syntax);
3 out of memory; 1 an internal error, or a record that could not be written; 128 + the signal
when interrupted (130 for Ctrl-C, 143 for SIGTERM, 129 for SIGHUP: the terminal was closed).
A multirun records invalid and oom jobs as data and exits 1 when a job of this sweep errored,
was interrupted or has no readable record.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import List, Optional

import hydra
from omegaconf import DictConfig, OmegaConf

from kvbench.cli_help import group_options
from kvbench.cli_job import hydra_job
from kvbench.cli_sweep import SweepRefused, sweep_end
from kvbench.config.bench import CONF_DIR, register_configs, schema_defaults
from kvbench.core.errors import config_error_line, is_composition_error, one_line
from kvbench.jobs.interrupts import exit_on_stop
from kvbench.jobs.outcome import EXIT_CODES, OUTCOME
from kvbench.jsonio import os_error_line
from kvbench.sinks.console import stderr

register_configs()



@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def _hydra_main(cfg: DictConfig) -> Optional[float]:
    # Launchers (submitit, joblib) pickle this function by value, with the globals it names:
    # it names only an importable function, which is pickled by reference.
    return hydra_job(cfg)


def main() -> None:
    """Console script ``kvbench``."""
    try:
        _main()
    finally:
        # Done, whichever way: a signal while the interpreter shuts down (W&B's and torch's exit
        # hooks) is one line and 128 + the signal, not a KeyboardInterrupt traceback from a hook.
        exit_on_stop(line="kvbench: interrupted by {signal}")


def _main() -> None:
    # Let Hydra's composition errors reach us (instead of its multi-line report and exit 1):
    # a bad value is the user's input, so one line naming the key and exit 2. A user who set
    # HYDRA_FULL_ERROR=1 gets the traceback, as Hydra documents.
    full_error = os.environ.get("HYDRA_FULL_ERROR") == "1"
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        bad_path = _group_path_override(sys.argv[1:])
        if bad_path is not None:
            stderr.print(f"kvbench: invalid config: {bad_path}", markup=False, soft_wrap=True)
            sys.exit(EXIT_CODES["invalid"])
        _hydra_main()
    except SweepRefused as exc:
        stderr.print(exc.line(), markup=False, soft_wrap=True)
        sys.exit(exc.code)
    except Exception as exc:
        if isinstance(exc, OSError) and not full_error and not is_composition_error(exc):
            # outside any job: an output directory that cannot be made, say (Hydra's missing
            # config option is an OSError too, and a composition error: below)
            stderr.print(f"kvbench: {one_line(os_error_line(exc))}", markup=False, soft_wrap=True)
            if OUTCOME.sweep is not None:
                sweep_end(OUTCOME.sweep)
            sys.exit(EXIT_CODES["error"])
        if OUTCOME.sweep is not None and not full_error and not is_composition_error(exc):
            # The sweeper failed after its jobs (Optuna's, when no trial has a value): what the
            # jobs recorded is still this sweep's table and report.
            sys.exit(sweep_end(OUTCOME.sweep, failure=f"the sweeper failed: {one_line(f'{type(exc).__name__}: {exc}')}")
                     or EXIT_CODES["error"])
        if full_error or not is_composition_error(exc):
            raise
        stderr.print(f"kvbench: invalid config: {config_error_line(exc, _top_level_names())}", markup=False,
                     soft_wrap=True)
        sys.exit(EXIT_CODES["invalid"])
    except KeyboardInterrupt as exc:  # Ctrl-C, SIGTERM or SIGHUP (Interrupted): what finished, then 128 + signal
        signum = getattr(exc, "signum", signal.SIGINT)
        line = f"kvbench: interrupted by {signal.Signals(signum).name}"
        # A second signal while the sweep's table is written ends the process at once, with this line.
        exit_on_stop(128 + signum, line)
        if OUTCOME.sweep is not None and OUTCOME.sweep.get("task") != "inspect":
            sweep_end(OUTCOME.sweep, interrupted=True)
        stderr.print(line, markup=False)
        sys.exit(128 + signum)
    sys.exit(OUTCOME.exit_code)


def _group_path_override(arguments: List[str]) -> Optional[str]:
    """One line for a group override whose option is a path rather than an option of the group
    (``workload=../config`` composed conf/config.yaml as a workload and failed on ``workload/slo=none``,
    naming neither the override nor the problem; ``workload=../workload/decode`` ran;
    ``hydra/sweeper=../config`` named ``hydra/sweeper/..=config``): the override and the group's
    options. None when no group override's option is a path."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    for argument in (a for a in arguments if not a.startswith("-")):
        group = argument.lstrip("+~").partition("=")[0]
        if "=" not in argument or not group or "." in group or "@" in group:  # a key, or a package
            continue
        try:
            [override] = OverridesParser.create().parse_overrides([argument])
            values = list(override.sweep_string_iterator()) if override.is_sweep_override() else [override.value()]
        except Exception:  # noqa: BLE001 — bad syntax is Hydra's to name, with its own line
            continue
        # ``..`` or a root leaves the group; a nested name (``team/mine`` of a --config-dir) is Hydra's to find
        if any(isinstance(v, str) and (".." in v.replace("\\", "/").split("/") or v.startswith(("/", "\\")))
               for v in values):
            options = _group_options(group)
            if options is not None:
                return one_line(f"{argument}: no such option in {group}/ (a path is no option; available: "
                                f"{', '.join(options)})")
    return None


def _group_options(group: str) -> Optional[List[str]]:
    """The options of config group ``group`` as Hydra finds them (kvbench's conf/ and Hydra's plugins:
    ``hydra/sweeper``); None when ``group`` is no group."""
    try:  # Hydra's own repository (an internal API): kvbench's groups and the plugins'
        from hydra._internal.config_repository import ConfigRepository
        from hydra._internal.utils import create_config_search_path

        repository = ConfigRepository(create_config_search_path(str(CONF_DIR)))
        return repository.get_group_options(group) if repository.group_exists(group) else None
    except Exception:  # noqa: BLE001 — another Hydra: the groups of conf/ alone
        return group_options(CONF_DIR / group) if (CONF_DIR / group).is_dir() else None


def _top_level_names() -> list:
    """The config groups (conf/ folders) and top-level keys a command line may name."""
    groups = [p.name for p in CONF_DIR.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))]
    return sorted(set(groups) | set(OmegaConf.to_container(schema_defaults()).keys()))


if __name__ == "__main__":
    # `python -m kvbench.cli`: run the importable module's copy, so that what launchers pickle
    # refers to kvbench.cli, not to __main__ (which a worker process cannot import).
    from kvbench import cli

    cli.main()
