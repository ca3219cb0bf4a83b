"""Typed configuration: one dataclass per Hydra group.

The YAML files under ``conf/<group>/`` only set values. Hydra composes them over the schemas'
defaults as plain values (:func:`register_configs`); :func:`to_bench_config` then types the
job's config against these dataclasses (unknown keys, wrong types and missing ``???`` values
rejected) and ``__post_init__`` checks the values. Checking per job, not at composition, makes
one bad value in a sweep that job's ``invalid`` record instead of the end of the sweep. Every
failure is a one-line :class:`ConfigError` that names the key and the value.

Cross-group rules (the attention type against the model's head count, the sequence
against ``max_seq_len``) live in :class:`BenchConfig`, which owns both sides.

Below it are only its errors (:mod:`kvbench.config.errors`: ConfigError, typing a composed
config) and a checkpoint's ``config.json`` (:mod:`kvbench.config.hf`, which
:meth:`ModelConfig.from_hf_config` types); every other module may import it.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, get_type_hints

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from kvbench.config.capacity import SLO_STATS, CapacityConfig, SloConfig  # noqa: F401 (re-exported)
from kvbench.config.dtypes import (  # noqa: F401 (re-exported: what a stored element costs)
    CACHE_DTYPE_BYTES,
    CACHE_DTYPES,
    CACHE_IMPLS,
    DTYPE_BYTES,
    SCALE_BYTES,
    element_bytes,
)
from kvbench.config.errors import INT64_MAX, ConfigError, check, check_choice, check_numbers, check_positive, typed
from kvbench.config.model import (  # noqa: F401 (variant_label, variant_key: re-exported for the sinks)
    ATTENTION_TYPES,
    AttentionConfig,
    ModelConfig,
    attention_type,
    variant_key,
    variant_label,
)
from kvbench.config.moe import check_run
from kvbench.config.recall import RecallConfig, check_recall_run
from kvbench.config.serving import check_serving_run
from kvbench.config.workload import WORKLOADS, WorkloadConfig  # noqa: F401 (re-exported)
from kvbench.layouts.build import build_layouts


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
TASKS = ("bench", "inspect", "train", "eval", "capacity", "compare", "recall")
COMPILE_MODES = ("false", "default", "graph")
OBJECTIVE_SYNTAX = re.compile(r"-?[A-Za-z_][A-Za-z0-9_]*")  # a metric name, optionally negated
COMPILE_ALIASES = {"true": "default"}  # runtime.compile=true, as before the modes


def objective_metric(objective: str) -> tuple[str, float]:
    """The metric an ``objective`` names and its sign: ``-decode_ms_p50`` -> (decode_ms_p50, -1)."""
    return (objective[1:], -1.0) if objective.startswith("-") else (objective, 1.0)


@dataclass
class CacheConfig:
    """KV-cache implementation, whether a multi-turn chat keeps its history between turns, and
    the precision K/V are stored in (``dtype``: auto = the compute dtype, or int8/float8_e4m3fn
    codes with scales, quantized on write and dequantized on read)."""

    impl: str = "static"
    shared: bool = False
    dtype: str = "auto"
    block_size: int = 16  # workload=serving, workload.store=paged: tokens per KV block

    def __post_init__(self) -> None:
        check_numbers("cache", self)
        check(self.block_size >= 1, "cache.block_size", self.block_size, "must be >= 1 tokens")
        check_choice("cache.impl", self.impl, CACHE_IMPLS)
        check_choice("cache.dtype", self.dtype, CACHE_DTYPES)
        if self.dtype != "auto":
            check(self.impl == "static", "cache.impl", self.impl,
                   f"cache.dtype={self.dtype} is stored in a preallocated cache; use cache.impl=static")


MAX_MIN_TIME_S = 86_400.0  # a day: beyond it, a typo (ms for s) rather than a plan


@dataclass
class RuntimeConfig:
    """Where and how a run executes and is timed."""

    device: str = "auto"  # auto | cpu | cuda | cuda:N | cuda:free (kvbench/device.py)
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
        check(self.init_timeout_s > 0, "wandb.init_timeout_s", self.init_timeout_s, "must be > 0")


@dataclass
class DataConfig:
    """Text for training and perplexity, read as bytes (a byte-level tokenizer: vocab 256)."""

    path: Optional[str] = None  # a text file or directory; null: the Python standard library's sources
    val_fraction: float = 0.1
    max_bytes: Optional[int] = 4_000_000  # cap on bytes read, in a deterministic file order; null: no cap

    def __post_init__(self) -> None:
        check_numbers("data", self)
        check(0 < self.val_fraction < 1, "data.val_fraction", self.val_fraction, "must be in (0, 1)")
        check(self.max_bytes is None or self.max_bytes >= 1, "data.max_bytes", self.max_bytes,
               "must be >= 1 or null (no cap)")


@dataclass
class TrainConfig:
    """Training / evaluation of the decoder for quality (``task=train`` / ``task=eval``)."""

    # Defaults fit model=train_small on a 2-core CPU in about three minutes (~2M tokens).
    steps: int = 1000  # 0 with init_from: evaluate the converted checkpoint without uptraining
    batch_size: int = 16
    seq_len: int = 128
    lr: float = 3e-3
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1  # cosine decay ends at lr * min_lr_ratio
    weight_decay: float = 0.1  # weight matrices only; norms are not decayed
    grad_clip: float = 1.0  # max global gradient norm
    eval_batches: int = 20
    eval_every: int = 200
    log_every: int = 20
    init_from: Optional[str] = None  # checkpoint to start from (converted to attention.num_kv_heads)
    checkpoint: Optional[str] = None  # task=eval: kvbench checkpoint file or transformers checkpoint directory

    def __post_init__(self) -> None:
        check_numbers("train", self)
        check(self.steps >= 0, "train.steps", self.steps, "must be >= 0")
        check_positive("train", self, ("batch_size", "seq_len", "warmup_steps", "eval_batches",
                                        "eval_every", "log_every"))
        check(self.lr > 0, "train.lr", self.lr, "must be > 0")
        check(0 <= self.min_lr_ratio <= 1, "train.min_lr_ratio", self.min_lr_ratio, "must be in [0, 1]")
        check(self.weight_decay >= 0, "train.weight_decay", self.weight_decay, "must be >= 0")
        check(self.grad_clip > 0, "train.grad_clip", self.grad_clip, "must be > 0")


# compare.variants options after the layout (``gqa:w1024:g6``): a window, every k-th layer global,
# MLA's latent rank; the AttentionConfig field each sets.
VARIANT_OPTIONS = {"w": "window", "g": "global_every", "r": "kv_lora_rank"}


def variant_fields(spec: str, variants: Any = None) -> Dict[str, Any]:
    """AttentionConfig fields of one ``compare.variants`` entry: ``<type or KV-head count>`` then
    options ``:w<W>`` (a window of W positions on local layers), ``:g<k>`` (every k-th layer
    global, needs :w) and ``:r<R>`` (attention=mla's kv_lora_rank); no ``:w`` is no window."""
    where = ("compare.variants", spec if variants is None else variants)
    head, *options = str(spec).split(":")
    check(head in ATTENTION_TYPES or (head.isdigit() and int(head) >= 1), *where,
          f"{spec!r} is neither an attention type ({', '.join(ATTENTION_TYPES)}) nor a KV-head count >= 1 "
          "(options: :w<window>, :g<every k-th layer global>, :r<mla kv_lora_rank>, e.g. gqa:w1024:g6)")
    out: Dict[str, Any] = {"type": head} if head in ATTENTION_TYPES else {"num_kv_heads": int(head)}
    for option in options:
        key = VARIANT_OPTIONS.get(option[:1])
        check(key is not None and option[1:].isdigit() and int(option[1:]) >= 1 and key not in out, *where,
              f"{spec!r}: option {option!r} must be one of :w<W>, :g<k>, :r<R> with a number >= 1, each once")
        out[key] = int(option[1:])
    check("global_every" not in out or "window" in out, *where,
          f"{spec!r}: :g<k> says which layers are global, and needs a window (:w<W>) for the others")
    out.setdefault("window", 0)  # no option: no window, whatever the model's own
    return out


@dataclass
class CompareConfig:
    """``task=compare``: attention variants timed in one process, alternating trial by trial.

    ``variants``: attention types (``mha``, ``gqa``, ``mqa``, ``mla``) or KV-head counts, each
    optionally with a window (``mha:w1024``: every layer local; ``gqa:w1024:g6``: Gemma 3's five
    local to one global) or MLA's rank (``mla:r256``), see :func:`variant_fields`; the first is
    the baseline of every ratio. ``contexts``: the context lengths (positions already in the
    cache) a decode step is timed at; three or more distinct ones give the KV cost slope (three on
    each side of a window give the slope below and past it). ``steps``: timed steps per context
    per trial."""

    variants: List[str] = field(default_factory=lambda: ["mha", "gqa", "mqa"])
    contexts: List[int] = field(default_factory=lambda: [256, 512, 1024, 1536, 2048])
    steps: int = 8

    def __post_init__(self) -> None:
        check_positive("compare", self, ("steps",))
        check(len(self.variants) >= 2, "compare.variants", self.variants, "needs two or more variants to compare")
        for v in self.variants:
            variant_fields(v, self.variants)
        check(len(self.contexts) >= 1 and all(c >= 1 for c in self.contexts), "compare.contexts", self.contexts,
               "must list one or more context lengths >= 1")
        check(len(set(self.contexts)) == len(self.contexts), "compare.contexts", self.contexts,
               "lists a context length twice")

    def attentions(self, model: "ModelConfig") -> List["AttentionConfig"]:
        """Each variant as a resolved :class:`AttentionConfig` for ``model`` (a count is typed by
        :func:`attention_type`); a variant the model cannot have names ``compare.variants``."""
        out = []
        for v in self.variants:
            fields_ = variant_fields(v, self.variants)
            if "num_kv_heads" in fields_:
                fields_["type"] = attention_type(model.num_heads, fields_["num_kv_heads"])
            try:
                out.append(AttentionConfig(**fields_).resolved(model))
            except ConfigError as exc:
                raise ConfigError(f"compare.variants={self.variants!r}: {v!r}: {exc}") from None
        labels = [variant_label(a, num_layers=model.num_layers) for a in out]
        check(len(set(labels)) == len(labels), "compare.variants", self.variants,
               f"two variants are the same layout ({', '.join(labels)})")
        return out


@dataclass
class BenchConfig:
    """The whole run: one field per Hydra group, plus the task to run."""

    task: str = "bench"
    model: ModelConfig = MISSING
    attention: AttentionConfig = MISSING
    workload: WorkloadConfig = MISSING
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

    def layout_settings(self) -> Dict[str, Any]:
        """The settings a layer's layout may not run with (:class:`kvbench.layouts.Limit`): its cache
        (a shared prefix only where a multi-turn chat shares one), the compiled step, the serving
        store (None when the job serves nothing)."""
        serving = self.workload.name == "serving" and self.task == "bench"
        return {"cache.impl": self.cache.impl, "cache.dtype": self.cache.dtype,
                "cache.shared": self.cache.shared and self.workload.name == "multiturn",
                "runtime.compile": self.runtime.compile, "workload.store": self.workload.store if serving else None}

    def __post_init__(self) -> None:
        check_choice("task", self.task, TASKS)
        if self.objective is not None:
            check(OBJECTIVE_SYNTAX.fullmatch(self.objective) is not None, "objective", self.objective,
                   "must be a metric name, or -name to minimise it (e.g. tokens_per_s, -decode_ms_p50)")
        for name, cap in self.objective_caps.items():
            check(math.isfinite(cap), f"objective_caps.{name}", cap, "must be a finite number")
        # task=eval takes its shape from train.checkpoint, which only the task reads: the
        # attention is resolved against the checkpoint there, not against the model preset.
        if self.task != "eval":
            self.attention = self.attention.resolved(self.model)
            build_layouts(self.model, self.attention).check(self.layout_settings())
            check_run(self.model.moe, self.layout_settings())
        w = self.workload
        if self.task == "capacity":
            self._check_capacity()
        if w.name == "serving" and self.task == "bench":
            check_serving_run(self)
        if self.task == "recall":
            check_recall_run(self.recall, self.model.max_seq_len, self.model.num_heads, self.attention)
        if self.task == "train":  # train.init_from's checkpoint must have the model's max_seq_len (quality/train.py)
            check(self.train.seq_len <= self.model.max_seq_len, "train.seq_len", self.train.seq_len,
                  f"longer than model.max_seq_len={self.model.max_seq_len}")
        length_key = {"multiturn": "workload.system_len", "serving": "workload.prompt"}.get(w.name,
                                                                                           "workload.prompt_len")
        # task=compare reads only the batch size of the workload: its lengths are compare.contexts
        check(self.task in ("compare", "recall") or w.total_len <= self.model.max_seq_len, length_key,
               getattr(w, length_key.split(".")[1]),
               f"the workload needs {w.total_len} positions, more than model.max_seq_len="
               f"{self.model.max_seq_len}")
        if self.task == "compare":
            self.compare.attentions(self.model)
            longest = max(self.compare.contexts)
            check(longest < self.model.max_seq_len, "compare.contexts", self.compare.contexts,
                   f"a step at context {longest} needs {longest + 1} positions, more than model.max_seq_len="
                   f"{self.model.max_seq_len}")
            check(self.cache.impl == "static", "cache.impl", self.cache.impl,
                   "task=compare sets the filled length of a preallocated cache; use cache.impl=static")
            check(self.runtime.compile == "false", "runtime.compile", self.runtime.compile,
                   "task=compare times eager steps only (use task=bench for compiled decoding)")
        if self.runtime.compile == "graph":
            check(self.cache.impl == "static", "cache.impl", self.cache.impl,
                   "runtime.compile=graph reads a preallocated cache in fixed shapes; use cache.impl=static")
            # The fixed-shape step writes K/V with index_copy_ into the storage itself: a quantized
            # cache would need its quantize/dequantize inside the compiled step (not built).
            check(self.cache.dtype == "auto", "cache.dtype", self.cache.dtype,
                   "runtime.compile=graph is not supported with a quantized cache; use cache.dtype=auto "
                   "or runtime.compile=false|default")
        if w.name == "multiturn" and self.cache.shared:
            check(self.cache.impl != "none", "cache.impl", self.cache.impl,
                   "keeps no history, so cache.shared=true has nothing to share (use static or concat)")

    def _check_capacity(self) -> None:
        w = self.workload
        check(self.slo.e2e_ms is None, "slo.e2e_ms", self.slo.e2e_ms,
               "task=capacity judges TTFT and TPOT only (an E2E target is workload=serving's)")
        # the probes' caches are in the compute dtype, as the KV formula they are judged by
        check(self.cache.dtype == "auto", "cache.dtype", self.cache.dtype,
               "task=capacity stores K/V in the compute dtype only; use cache.dtype=auto")
        if self.slo.tpot_x_batch1 is not None:
            check(self.cache.impl != "none", "cache.impl", self.cache.impl,
                   "keeps no history, and slo.tpot_x_batch1 times a probe's filled cache stepping again; "
                   "use static or concat")
        if w.name == "multiturn":  # one chat, its length the workload's (checked for every task)
            check(w.reply_len >= 2 or (self.slo.tpot_ms is None and self.slo.tpot_x_batch1 is None),
                   "workload.reply_len", w.reply_len, "a one-token reply has no decode step to judge against "
                   "slo.tpot_ms / slo.tpot_x_batch1; use >= 2, or no TPOT target")
            return
        longest = max(self.capacity.context_lens) + w.gen_len
        check(longest <= self.model.max_seq_len, "capacity.context_lens", self.capacity.context_lens,
               f"the longest context + workload.gen_len is {longest} positions, more than "
               f"model.max_seq_len={self.model.max_seq_len}")


def schema_defaults() -> DictConfig:
    """What Hydra composes the YAML files over, as plain values (no types): the defaults of
    ``task``, ``rerun``, ``data`` and ``train``, and an empty node for each group the defaults
    list fills (``model`` ... ``wandb``), so that a ``???`` in a group's YAML file is not merged
    over a default and lost. Every group node is open: an override of a key the chosen YAML
    file does not list (``model.rope_theta`` for ``model=tiny``) needs no ``+``, and a misspelt
    key reaches :func:`to_bench_config`, which rejects it naming the nearest real key."""
    node = OmegaConf.create(OmegaConf.to_container(OmegaConf.structured(BenchConfig)))
    OmegaConf.set_struct(node.objective_caps, False)  # objective_caps.<metric>=... needs no +
    for name, kind in get_type_hints(BenchConfig).items():
        if not hasattr(kind, "__dataclass_fields__"):
            continue
        if OmegaConf.is_missing(node, name):  # chosen in conf/config.yaml's defaults list
            node[name] = {}
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
    sweep with no record. :func:`to_bench_config` types each job instead."""
    cs = ConfigStore.instance()
    cs.store(name="kvbench_defaults", node=schema_defaults())


def to_bench_config(cfg: DictConfig | Mapping[str, Any] | BenchConfig) -> BenchConfig:
    """Typed, validated config (raises :class:`ConfigError` naming the bad key)."""
    return cfg if isinstance(cfg, BenchConfig) else typed(BenchConfig, cfg)

