"""What a ``task=`` value reads of the config, declared once beside the task's own section, and the
rules it adds across groups. A record keeps what its task reads (:func:`kvbench.results.record_config`),
so a record of one task never carries another task's settings. Torch-free: resume and the sinks read
these declarations in a process that runs no model."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple

ALL = None  # every key of the section


class Without(tuple):
    """Every key of the section but these."""

    def __new__(cls, *keys: str) -> "Without":
        return super().__new__(cls, keys)


Keys = Optional[Tuple[str, ...]]  # ALL, the keys kept, or Without(...)
QUALITY_RUNTIME = ("device", "dtype", "seed", "threads")  # training and scoring time nothing
TIMED_RUNTIME = Without("memory_budget_gb")  # the memory budget is task=capacity's


@dataclass(frozen=True)
class Asked:
    """A setting's ``value`` as the job asks it by another key: ``named`` (``recall.uptrain_steps=200``
    asks ``kv_conversion`` mean-pool), which a refusal names, and what to do ``instead``."""

    value: Any
    named: str
    instead: str = ""


def no_rules(cfg: Any) -> None:
    """A task that adds no rule across groups."""


def no_settings(cfg: Any) -> Dict[str, Any]:
    """A task that asks a layer's layout nothing beyond the job's cache and runtime."""
    return {}


def the_job_attention(cfg: Any) -> Tuple[Tuple[str, Any], ...]:
    """A task that runs the job's own attention (``attention``, resolved against ``model``)."""
    return (("", cfg.attention),)


@dataclass(frozen=True)
class Task:
    """One ``task=`` value. ``reads``: section -> the keys the task reads besides ``model``,
    ``wandb`` and the top-level keys. ``runs_workload``: it feeds the model its workload, so the
    workload's own rules, its length and what it reads (``READS`` of its dataclass) apply too;
    ``by_workload``: keys that differ per workload option. ``own_shape``: the model's shape comes
    from the task's checkpoint, which resolves the attention itself. ``check``: its rules across
    groups, given the job's config with its attention resolved. ``settings``: what of the job a layer's
    layout may refuse beyond its cache and runtime (:class:`kvbench.layouts.base.Limit` keys).
    ``attentions``: each attention the job runs, resolved, with what a refusal of it is prefixed by."""

    reads: Mapping[str, Keys]
    runs_workload: bool = False
    by_workload: Mapping[str, Mapping[str, Keys]] = field(default_factory=dict)
    own_shape: bool = False
    check: Callable[[Any], None] = no_rules
    settings: Callable[[Any], Dict[str, Any]] = no_settings
    attentions: Callable[[Any], Sequence[Tuple[str, Any]]] = the_job_attention

    def reads_key(self, key: str, workload: Any) -> bool:
        """Whether a job with ``workload`` reads ``key`` (``section.name``; a key without a section is
        the task's own setting, always read)."""
        section, dot, name = key.partition(".")
        return not dot or bool(kept({name: None}, self.sections(workload).get(section, ())))

    def sections(self, workload: Any) -> Dict[str, Keys]:
        """What a job of this task with ``workload`` (its dataclass, or None) reads, by section."""
        reads = dict(self.reads)
        if self.runs_workload and workload is not None:
            reads.update(workload.READS)
        name = getattr(workload, "name", None)
        reads.update(self.by_workload.get(name, {}) if isinstance(name, str) else {})
        return reads


def kept(section: Mapping[str, Any], keys: Keys) -> Dict[str, Any]:
    """The keys of ``section`` that ``keys`` names (ALL, a tuple, or Without(...))."""
    if keys is ALL:
        return dict(section)
    if isinstance(keys, Without):
        return {k: v for k, v in section.items() if k not in keys}
    return {k: v for k, v in section.items() if k in keys}
