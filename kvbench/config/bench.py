"""The whole job's config (:class:`BenchConfig`, one field per Hydra group), the groups with no module
of their own (cache, runtime, wandb), the task registry and the rules every job obeys.

The YAML files under ``conf/<group>/`` only set values. Hydra composes them over the schemas'
defaults as plain values (:func:`register_configs`); ``kvbench.jobs.job_config.to_bench_config`` then
types the job's config against the dataclasses (unknown keys, wrong types and missing ``???``
values rejected), ``__post_init__`` checks the values, and the rules across groups follow. Checking
per job, not at composition, makes one bad value in a sweep that job's ``invalid`` record instead
of the end of the sweep. Every failure is a one-line :class:`ConfigError` that names the key and
the value.

Rules across groups that every job obeys (the attention against the model, the sequence against
``max_seq_len``) live in :class:`BenchConfig`; a task's own rules and reads beside its section
(:data:`TASKS`), a workload's with its dataclass. What each layer's layout runs with is the
layouts' to say (they read this config): ``kvbench.jobs.job_config`` checks it between the two.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, get_type_hints

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from kvbench.config.capacity import CAPACITY, CapacityConfig, SloConfig
from kvbench.config.compare import COMPARE, CompareConfig
from kvbench.config.model import AttentionConfig, ModelConfig, attention_type
from kvbench.config.recall import RECALL, RecallConfig
from kvbench.config.train import EVAL, TRAIN, DataConfig, TrainConfig
from kvbench.config.workload import BENCH, workload_config
from kvbench.core.dtypes import CACHE_DTYPES, CACHE_IMPLS, DTYPE_BYTES
from kvbench.core.errors import INT64_MAX, check, check_choice, check_numbers
from kvbench.core.task import Task


def _find_conf_dir() -> Path:
    """The Hydra configs: ``conf/`` beside the package in a checkout (and an editable install),
    ``kvbench/conf`` inside an installed wheel (pyproject maps the top-level ``conf/`` there)."""
    package = Path(__file__).resolve().parents[1]  # kvbench/
    for candidate in (package / "conf", package.parent / "conf"):
        if (candidate / "config.yaml").is_file() and (candidate / "model").is_dir():
            return candidate
    return package.parent / "conf"  # Hydra then names the missing directory itself


CONF_DIR = _find_conf_dir()

# No memory a torch device reads streams 100 TB/s: HBM3e, the fastest DRAM shipping, gives a device
# 8 TB/s, a CPU's last-level cache a few TB/s. The roofline's peak is refused (or re-probed) past it.
MAX_GB_PER_S = 1e5
# Every task= value: what it reads and its rules (kvbench/core/task.py); its code is registered in
# kvbench.jobs.runner.TASKS (task=inspect prints, in kvbench.cli_job).
TASKS: Dict[str, Task] = {"bench": BENCH, "inspect": BENCH, "train": TRAIN, "eval": EVAL, "capacity": CAPACITY,
                          "compare": COMPARE, "recall": RECALL}
COMPILE_MODES = ("false", "default", "graph")
OBJECTIVE_SYNTAX = re.compile(r"-?[A-Za-z_][A-Za-z0-9_]*")  # a metric name, optionally negated
COMPILE_ALIASES = {"true": "default"}  # runtime.compile=true, as before the modes


def objective_metric(objective: str) -> tuple[str, float]:
    """The metric an ``objective`` names and its sign: ``-decode_ms_p50`` -> (decode_ms_p50, -1)."""
    return (objective[1:], -1.0) if objective.startswith("-") else (objective, 1.0)


@dataclass
class CacheConfig:
    """KV-cache implementation, whether a multi-turn chat keeps its history between turns, and
    the precision K/V are stored in (``dtype``: auto = the compute dtype, or int8/float8_e4m3fn/4-bit
    codes with scales, quantized on write and dequantized on read); a recurrent layer's state is
    held in ``state_dtype`` (computed in float32 whatever it is held in)."""

    impl: str = "static"
    shared: bool = False
    dtype: str = "auto"
    # float32 as transformers keeps it; bfloat16 / float16 halve it (vLLM's mamba_ssm_cache_dtype)
    state_dtype: str = "float32"
    block_size: int = 16  # workload=serving, workload.store=paged: tokens per KV block

    def __post_init__(self) -> None:
        check_numbers("cache", self)
        check(self.block_size >= 1, "cache.block_size", self.block_size, "must be >= 1 tokens")
        check_choice("cache.impl", self.impl, CACHE_IMPLS)
        check_choice("cache.dtype", self.dtype, CACHE_DTYPES)
        check_choice("cache.state_dtype", self.state_dtype, tuple(DTYPE_BYTES))
        if self.dtype != "auto":
            check(self.impl == "static", "cache.impl", self.impl,
                   f"cache.dtype={self.dtype} is stored in a preallocated cache; use cache.impl=static")


MAX_MIN_TIME_S = 86_400.0  # a day: beyond it, a typo (ms for s) rather than a plan
# Ten minutes: W&B's own wait is 90 s; beyond it a run hangs on an unanswering server for as long as
# the value says (1e300 never ends), its service process waiting with it.
MAX_INIT_TIMEOUT_S = 600.0


@dataclass
class RuntimeConfig:
    """Where and how a run executes and is timed."""

    device: str = "auto"  # auto | cpu | cuda | cuda:N | cuda:free (kvbench/jobs/device.py)
    dtype: str = "float32"
    seed: int = 0
    warmup: int = 1
    repeats: int = 3
    # Keep running timed trials until both `repeats` and this many seconds of them are reached
    # (as optimum-benchmark does): short runs on fast hardware still get enough samples.
    min_time_s: float = 0.0
    # torch CPU threads; null keeps torch's default. 1 by default: on a shared machine each extra
    # thread is one more that can be descheduled, and every small operation waits for its slowest
    # (experiments/results/cpu_threads.md; the README's "CPU threads").
    threads: Optional[int] = 1
    # NVML background sampling period; 50 ms, not 10: the sampler thread took up to 1.4 % of a core
    # at 10 ms (experiments/results/nvml_overhead.md), more than the 1 % a timed loop may lose to it.
    nvml_interval_ms: float = 50.0
    # false: eager | default (or true): torch.compile the model, dynamic shapes | graph: compile
    # only the decode step, fixed shapes (CUDA graphs on GPUs); compile time is reported apart
    compile: str = "false"
    graph_bucket: int = 256  # compile=graph: the step reads the cache in multiples of this many positions
    peak_gb_per_s: Optional[float] = None  # roofline peak; null: the GEMV rate of a probe (see probe)
    probe: str = "cached"  # cached: probe once per machine | run: probe next to this run's trials
    fidelity: bool = True  # cached decode vs recompute (and vs float32) on 2 sequences after timing
    isolate: bool = True  # each job in a fresh process (kvbench/jobs/isolation.py); false: in the calling one
    # task=capacity: the memory a job may use, in GB (1e9 bytes); null: the CUDA device's memory
    # (on a CPU the task needs a value: a machine's RAM is shared, not a budget)
    memory_budget_gb: Optional[float] = None
    # one job as this many processes, the model split over them by heads and widths (kvbench/parallel/),
    # and the experts split over them by expert instead (expert_parallel = tensor_parallel)
    tensor_parallel: int = 1
    expert_parallel: int = 1

    def __post_init__(self) -> None:
        check_numbers("runtime", self)
        check_choice("runtime.dtype", self.dtype, tuple(DTYPE_BYTES))
        check(re.fullmatch(r"auto|cpu|cuda(:[0-9]+|:free)?", self.device) is not None,
               "runtime.device", self.device, "must be auto, cpu, cuda, cuda:N or cuda:free")
        # torch.manual_seed takes [-2**63, 2**64); a negative seed aliases a positive one.
        check(0 <= self.seed <= INT64_MAX, "runtime.seed", self.seed, "must be in [0, 2**63 - 1]")
        check(self.warmup >= 0, "runtime.warmup", self.warmup, "must be >= 0")
        check(self.repeats >= 1, "runtime.repeats", self.repeats, "must be >= 1")
        check(0 <= self.min_time_s <= MAX_MIN_TIME_S, "runtime.min_time_s", self.min_time_s,
               f"must be in [0, {MAX_MIN_TIME_S}] seconds")
        # More torch threads than CPUs only slows a benchmark down; 100,000 crash torch.
        cpus = os.cpu_count() or 1
        check(self.threads is None or 1 <= self.threads <= cpus, "runtime.threads", self.threads,
               f"must be null or in [1, {cpus}] (the CPUs of this machine)")
        check(self.nvml_interval_ms > 0, "runtime.nvml_interval_ms", self.nvml_interval_ms, "must be > 0")
        check(self.peak_gb_per_s is None or 0 < self.peak_gb_per_s <= MAX_GB_PER_S, "runtime.peak_gb_per_s",
               self.peak_gb_per_s, f"must be null or in (0, {MAX_GB_PER_S:.0e}] GB/s (no device memory streams more)")
        # YAML and overrides give booleans (true/false, strings once typed); one spelling per mode.
        mode = str(self.compile).lower()
        self.compile = COMPILE_ALIASES.get(mode, mode)
        check_choice("runtime.compile", self.compile, COMPILE_MODES)
        check(self.graph_bucket >= 1, "runtime.graph_bucket", self.graph_bucket, "must be >= 1")
        check_choice("runtime.probe", self.probe, ("cached", "run"))
        check(self.memory_budget_gb is None or self.memory_budget_gb > 0, "runtime.memory_budget_gb",
               self.memory_budget_gb, "must be > 0 or null")


@dataclass
class WandbConfig:
    """Weights & Biases settings. ``offline`` needs no account or network."""

    mode: str = "offline"  # offline | online | disabled
    project: str = "kvbench"
    entity: Optional[str] = None
    group: Optional[str] = None  # null: the sweep directory's name
    tags: List[str] = field(default_factory=list)
    # online: how long wandb.init may try to reach the server before the job falls back to
    # writing the run offline (W&B's own default is 90 s, per job; raise it on a slow link).
    init_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        check_numbers("wandb", self)
        check_choice("wandb.mode", self.mode, ("offline", "online", "disabled"))
        check(0 < self.init_timeout_s <= MAX_INIT_TIMEOUT_S, "wandb.init_timeout_s", self.init_timeout_s,
              f"must be in (0, {MAX_INIT_TIMEOUT_S:g}] seconds")


@dataclass
class BenchConfig:
    """The whole run: one field per Hydra group, plus the task to run."""

    task: str = "bench"
    model: ModelConfig = MISSING
    attention: AttentionConfig = MISSING
    workload: Any = MISSING  # one of config.workload.WORKLOADS, typed by its name
    cache: CacheConfig = MISSING
    runtime: RuntimeConfig = MISSING
    wandb: WandbConfig = MISSING
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    slo: SloConfig = field(default_factory=SloConfig)
    capacity: CapacityConfig = field(default_factory=CapacityConfig)
    compare: CompareConfig = field(default_factory=CompareConfig)
    recall: RecallConfig = field(default_factory=RecallConfig)
    # A multirun into an existing sweep dir skips jobs whose results.json is ok for the same
    # config; rerun=true runs them again.
    rerun: bool = False
    # What a job returns to a search sweeper (hydra/sweeper=optuna): a metric of its record,
    # ``-name`` for its negative (so that one direction, maximize, serves every metric); null
    # returns nothing (a grid sweep). Checked against the metrics the task reports by
    # kvbench.jobs.runner.check_objective; read from the record by kvbench.results.objective_value.
    objective: Optional[str] = None
    # metric -> the most it may be: a job above any cap returns no objective (a failed trial).
    objective_caps: Dict[str, float] = field(default_factory=dict)

    def reads(self, key: str) -> bool:
        """Whether this job's task reads ``key`` (``section.name``) of the config."""
        return TASKS[self.task].reads_key(key, self.workload)

    def layout_settings(self) -> Dict[str, Any]:
        """The settings a layer's layout may not run with (:class:`kvbench.layouts.Limit`), of those the
        task reads: its cache (a shared prefix only where a multi-turn chat shares one), the compiled
        step, the serving store."""
        settings = {"cache.impl": self.cache.impl, "cache.dtype": self.cache.dtype, "cache.shared": False,
                    "runtime.compile": self.runtime.compile}
        if TASKS[self.task].runs_workload:
            settings.update(self.workload.layout_settings(self))
        settings.update(TASKS[self.task].settings(self))
        return {key: value for key, value in settings.items() if self.reads(key)}

    def __post_init__(self) -> None:
        """Each field's values, and the attention resolved against the model; a copy made by
        ``dataclasses.replace`` runs this again, not :meth:`check_rules`."""
        check_choice("task", self.task, tuple(TASKS))
        if self.objective is not None:
            check(OBJECTIVE_SYNTAX.fullmatch(self.objective) is not None, "objective", self.objective,
                  "must be a metric name, or -name to minimise it (e.g. tokens_per_s, -decode_ms_p50)")
        for name, cap in self.objective_caps.items():
            check(math.isfinite(cap), f"objective_caps.{name}", cap, "must be a finite number")
        self.workload = workload_config(self.workload)
        task = TASKS[self.task]
        # task=eval takes its shape from train.checkpoint, which only the task reads: the
        # attention is resolved against the checkpoint there, not against the model preset.
        if not task.own_shape:
            self.attention = self.attention.resolved(self.model)

    def check_rules(self) -> None:
        """The rules across groups: the task's, the workload's and its length against
        ``model.max_seq_len``, the compiled step's cache. Run once per job by
        ``kvbench.jobs.job_config.check_job``, after what each layer's layout does not run with."""
        task = TASKS[self.task]
        task.check(self)
        if task.runs_workload:
            w = self.workload
            w.check_run(self)
            check(w.total_len <= self.model.max_seq_len, w.LENGTH_KEY, getattr(w, w.LENGTH_KEY.split(".")[1]),
                  f"the workload needs {w.total_len} positions, more than model.max_seq_len="
                  f"{self.model.max_seq_len}")
        if self.reads("runtime.compile") and self.runtime.compile == "graph":
            check(not self.reads("cache.impl") or self.cache.impl == "static", "cache.impl", self.cache.impl,
                  "runtime.compile=graph reads a preallocated cache in fixed shapes; use cache.impl=static")
            # The fixed-shape step writes K/V with index_copy_ into the storage itself: a quantized
            # cache would need its quantize/dequantize inside the compiled step (not built).
            check(not self.reads("cache.dtype") or self.cache.dtype == "auto", "cache.dtype", self.cache.dtype,
                  "runtime.compile=graph is not supported with a quantized cache; use cache.dtype=auto "
                  "or runtime.compile=false|default")


def schema_defaults() -> DictConfig:
    """What Hydra composes the YAML files over, as plain values (no types): the defaults of
    ``task``, ``rerun`` and the tasks' sections, and an empty node for each group the defaults
    list fills (``model`` ... ``wandb``), so that a ``???`` in a group's YAML file is not merged
    over a default and lost. Every group node is open: an override of a key the chosen YAML
    file does not list (``model.rope_theta`` for ``model=tiny``) needs no ``+``, and a misspelt
    key reaches ``kvbench.jobs.job_config.to_bench_config``, which rejects it naming the nearest real key."""
    node = OmegaConf.create(OmegaConf.to_container(OmegaConf.structured(BenchConfig)))
    for name in get_type_hints(BenchConfig):
        if OmegaConf.is_missing(node, name):  # chosen in conf/config.yaml's defaults list
            node[name] = {}
        if isinstance(node[name], DictConfig):  # objective_caps.<metric>=... needs no + either
            OmegaConf.set_struct(node[name], False)
    return node


# ``${kvbench_attention_type:${model.num_heads},${attention.num_kv_heads}}``: the attention type a
# KV-head count is, so that a search over attention.num_kv_heads (experiment=search) needs no
# type to go with each count.
OmegaConf.register_new_resolver("kvbench_attention_type", lambda h, kv: attention_type(int(h), int(kv)),
                                replace=True)


def register_configs() -> None:
    """Register :func:`schema_defaults` (``kvbench_defaults`` in conf/config.yaml) with Hydra.

    Not the typed schema: Hydra types a structured config when it composes, and a sweep
    composes every job before the first one runs, so one job's bad value would end the whole
    sweep with no record. ``kvbench.jobs.job_config.to_bench_config`` types each job instead."""
    cs = ConfigStore.instance()
    cs.store(name="kvbench_defaults", node=schema_defaults())

