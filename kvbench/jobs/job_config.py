"""A job's config typed and checked, once per job: :func:`to_bench_config`.

Above both the config and the layouts: the layouts read the config, so the config cannot ask a
layer what it does not run with. Here every rule runs in one order: each field's values (the
dataclasses' ``__post_init__``), what each layer's layout and the MoE do not run with (the layouts'
:class:`~kvbench.layouts.base.Limit`s), then the rules across groups
(:meth:`~kvbench.config.bench.BenchConfig.check_rules`). Torch-free: the CLI types every job of a
command line with it before any job runs.
"""

from __future__ import annotations

import dataclasses
from typing import Any, List, Mapping, Sequence

from omegaconf import DictConfig

from kvbench.config.bench import TASKS, BenchConfig
from kvbench.core.errors import ConfigError, typed
from kvbench.core.moe import check_run
from kvbench.layouts.build import build_layouts
from kvbench.parallel.plan import check_parallel


def check_job(job: BenchConfig) -> BenchConfig:
    """Refuse, in one line naming the key and the value, what ``job`` (built, so its fields are
    checked and its attention resolved) may not run: a setting some layer's layout or the MoE
    does not run with, then a rule across groups. Returns ``job``."""
    task = TASKS[job.task]
    if not task.own_shape:  # task=eval: its checkpoint sets the shape, checked where the task reads it
        settings = job.layout_settings()
        for where, attention in task.attentions(job):
            try:
                build_layouts(job.model, attention).check(settings)
            except ConfigError as exc:
                raise ConfigError(f"{where}{exc}") from None
        check_run(job.model.moe, settings)
    job.check_rules()
    check_parallel(job)  # the ranks a job runs as (kvbench.parallel)
    return job


def to_bench_config(cfg: DictConfig | Mapping[str, Any] | BenchConfig) -> BenchConfig:
    """Typed, validated config (raises :class:`~kvbench.core.errors.ConfigError` naming the bad
    key); a :class:`BenchConfig` passes as it is (checked where it was typed)."""
    return cfg if isinstance(cfg, BenchConfig) else check_job(typed(BenchConfig, cfg))


# where a task takes what an unread key would have set
_INSTEAD = {("capacity", "workload.prompt_len"): "its contexts are capacity.context_lens",
            ("capacity", "workload.batch_size"): "the batch is what it searches, up to capacity.max_batch",
            ("compare", "workload.prompt_len"): "its contexts are compare.contexts"}


def unread_overrides(job: BenchConfig, overrides: Sequence[str]) -> List[str]:
    """One line for each command-line ``key=value`` the job's task does not read (a value that would
    change nothing, and that its record leaves out): ``task=capacity workload.prompt_len=256`` searched
    capacity.context_lens and said nothing. Group choices, ``model.*`` (every task's), ``wandb.*``, keys
    outside a config section (``hydra.*``, ``objective_caps.<metric>``) and deletions are not checked."""
    lines = []
    for override in overrides:
        key, eq, value = override.lstrip("+").partition("=")
        section = key.split(".")[0]
        if not eq or override.startswith("~") or "." not in key or section in ("model", "wandb") or \
                not dataclasses.is_dataclass(getattr(job, section, None)):  # hydra.*, objective_caps.<metric>
            continue
        if not job.reads(key):
            instead = _INSTEAD.get((job.task, key))
            lines.append(f"{key}={value}: task={job.task} does not read it, so it changes nothing"
                         + (f" ({instead})" if instead else ""))
    return lines
