"""The ``workload`` group: one dataclass per option (``conf/workload/<name>.yaml``), what a run
feeds the model, and :func:`workload_config`, which types a job's ``workload`` by its ``name``. A
new workload is its dataclass and one entry in :data:`WORKLOADS`; the code that runs it is
``kvbench/workloads/<name>.py``, registered in :data:`kvbench.tasks.bench.WORKLOADS`.

Each dataclass declares what else of the config it reads (``READS``: its record keeps it), the
key named when it does not fit the model (``LENGTH_KEY``), and its rules across groups
(``check_run``)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar, Dict, Mapping

from kvbench.config.conversations import ConversationsWorkload
from kvbench.config.serving import ServingWorkload
from kvbench.core.errors import check, check_choice, check_numbers, check_positive, typed
from kvbench.core.task import ALL, TIMED_RUNTIME, Keys, Task


@dataclass
class DecodeWorkload:
    """Prefill ``prompt_len`` tokens, then ``gen_len`` greedy decode steps, ``batch_size`` sequences."""

    name: str = "decode"  # the option, conf/workload/<name>.yaml
    batch_size: int = 1  # sequences decoded together (B)
    prompt_len: int = 512  # prompt tokens prefilled (time to first token)
    gen_len: int = 64  # greedy decode steps after the prompt

    READS: ClassVar[Dict[str, Keys]] = {"cache": ("impl", "dtype", "state_dtype")}
    LENGTH_KEY: ClassVar[str] = "workload.prompt_len"

    def __post_init__(self) -> None:
        check_numbers("workload", self)
        check_choice("workload.name", self.name, ("decode",))
        check_positive("workload", self, ("batch_size", "prompt_len", "gen_len"))

    @property
    def total_len(self) -> int:
        """Longest sequence the workload builds (what the cache must hold)."""
        return self.prompt_len + self.gen_len

    def check_run(self, cfg: Any) -> None:
        """No rule across groups."""

    def layout_settings(self, cfg: Any) -> Dict[str, Any]:
        """What of it a layer's layout may refuse (kvbench.layouts.Limit): nothing."""
        return {}


@dataclass
class MultiturnWorkload:
    """A chat: ``batch_size`` conversations share a system prompt of ``system_len`` tokens; each of
    ``turns`` turns is a user message of ``user_len`` tokens, then a greedy reply of ``reply_len``.
    ``cache.shared`` chooses whether the history is kept between turns."""

    name: str = "multiturn"  # the option, conf/workload/<name>.yaml
    batch_size: int = 1  # conversations served together
    system_len: int = 512  # the system prompt's tokens, the same for every conversation
    turns: int = 4
    user_len: int = 64  # tokens of each user message
    reply_len: int = 32  # greedy tokens of each reply

    READS: ClassVar[Dict[str, Keys]] = {"cache": ("impl", "shared", "dtype", "state_dtype")}
    LENGTH_KEY: ClassVar[str] = "workload.system_len"

    def __post_init__(self) -> None:
        check_numbers("workload", self)
        check_choice("workload.name", self.name, ("multiturn",))
        check_positive("workload", self, ("batch_size", "system_len", "turns", "user_len", "reply_len"))

    @property
    def total_len(self) -> int:
        """Positions one conversation holds at its end."""
        return self.system_len + self.turns * (self.user_len + self.reply_len)

    def layout_settings(self, cfg: Any) -> Dict[str, Any]:
        return {"cache.shared": cfg.cache.shared}  # a shared system prompt's K/V

    def check_run(self, cfg: Any) -> None:
        if cfg.cache.shared:
            check(cfg.cache.impl != "none", "cache.impl", cfg.cache.impl,
                  "keeps no history, so cache.shared=true has nothing to share (use static or concat)")


WORKLOADS = {"decode": DecodeWorkload, "multiturn": MultiturnWorkload, "serving": ServingWorkload,
             "conversations": ConversationsWorkload}
DEFAULT_WORKLOAD = "decode"


def workload_schema(name: Any) -> type:
    """The dataclass of the option ``workload.name=name``."""
    check_choice("workload.name", name, tuple(WORKLOADS))
    return WORKLOADS[name]


def workload_config(data: Any) -> Any:
    """A job's ``workload`` typed by the dataclass of its ``name`` (an instance passes through).

    Keys that only other options have are left out, not refused: a sweep's overrides reach every
    workload option it sweeps, and experiment=choose sets the chat's lengths for its decode jobs
    too. A key no option has is refused, naming the nearest key of this option."""
    if not isinstance(data, Mapping):
        return data
    schema = workload_schema(data.get("name", DEFAULT_WORKLOAD))
    return typed(schema, own_keys(data, schema), "workload.")


def own_keys(data: Mapping[str, Any], schema: type) -> Dict[str, Any]:
    """``data`` without the keys of other workload options."""
    own = {f.name for f in fields(schema)}
    others = {f.name for cls in WORKLOADS.values() for f in fields(cls)} - own
    return {k: v for k, v in data.items() if k not in others}


# task=bench (and task=inspect, which prints what it would run): the workload on the decoder.
BENCH = Task(reads={"attention": ALL, "workload": ALL, "runtime": TIMED_RUNTIME}, runs_workload=True)
