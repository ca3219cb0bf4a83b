"""Typed configuration: one dataclass per Hydra group.

The YAML files under ``conf/<group>/`` only set values. Hydra composes them over the schemas'
defaults as plain values (:func:`register_configs`); :func:`to_bench_config` then types the
job's config against these dataclasses (unknown keys, wrong types and missing ``???`` values
rejected) and ``__post_init__`` checks the values. Checking per job, not at composition, makes
one bad value in a sweep that job's ``invalid`` record instead of the end of the sweep. Every
failure is a one-line :class:`ConfigError` that names the key and the value.

Cross-group rules (the attention type against the model's head count, the sequence
against ``max_seq_len``) live in :class:`BenchConfig`, which owns both sides.

This module imports nothing from kvbench: every other module may import it. It reads one
kind of file itself, a checkpoint's ``config.json`` (:meth:`ModelConfig.from_hf_config`).
"""

from __future__ import annotations

import difflib
import json
import math
import os
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Type, TypeVar, get_type_hints

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException


def _find_conf_dir() -> Path:
    """The Hydra configs: ``conf/`` beside the package in a checkout (and an editable install),
    ``kvbench/conf`` inside an installed wheel (pyproject maps the top-level ``conf/`` there)."""
    package = Path(__file__).resolve().parent
    for candidate in (package / "conf", package.parent / "conf"):
        if (candidate / "config.yaml").is_file() and (candidate / "model").is_dir():
            return candidate
    return package.parent / "conf"  # Hydra then names the missing directory itself


CONF_DIR = _find_conf_dir()

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
ATTENTION_TYPES = ("mha", "gqa", "mqa")
CACHE_IMPLS = ("static", "concat", "none")
WORKLOADS = ("decode", "multiturn")
TASKS = ("bench", "inspect", "train", "eval")
COMPILE_MODES = ("false", "default", "graph")
COMPILE_ALIASES = {"true": "default"}  # runtime.compile=true, as before the modes


# An error line kept in a record or printed is at most this long: a malformed file once produced
# a 28 MB message, copied into every sink.
MAX_ERROR_CHARS = 1000
INT64_MAX = 2**63 - 1


def one_line(text: Any, limit: int = MAX_ERROR_CHARS) -> str:
    """``text`` as one line of at most ``limit`` characters (plus a note of what was cut):
    whitespace runs become one space and the head of the text is kept."""
    text = str(text)
    head = " ".join(text[: limit * 4].split())  # bounded work whatever the input's size
    if len(head) <= limit and len(text) <= limit * 4:
        return head
    return f"{head[:limit]}… [cut: {len(text):,} characters in all]"


class ConfigError(ValueError):
    """A configuration value is invalid. The message names the key and the value, on one
    bounded line (:func:`one_line`)."""

    def __init__(self, message: Any) -> None:
        super().__init__(one_line(message))


def _check(ok: bool, key: str, value, why: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r}: {why}")


def _check_numbers(prefix: str, obj) -> None:
    """Every float field finite, every int field within 64 bits: NaN slips through every
    comparison (``nan > 0`` is False, ``nan < 1`` too), infinity through every lower bound,
    and torch overflows on larger ints."""
    for f in fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, float):
            _check(math.isfinite(value), f"{prefix}.{f.name}", value, "must be a finite number")
        elif isinstance(value, int) and not isinstance(value, bool):
            _check(abs(value) <= INT64_MAX, f"{prefix}.{f.name}", value, "must fit in 64 bits")


def _check_choice(key: str, value, choices) -> None:
    _check(value in choices, key, value, f"must be one of {', '.join(choices)}")


def _check_positive(prefix: str, obj, names) -> None:
    for name in names:
        value = getattr(obj, name)
        _check(value >= 1, f"{prefix}.{name}", value, "must be >= 1")


def attention_type(num_heads: int, num_kv_heads: int) -> str:
    """The name of a KV-head count: ``mha`` (one per query head), ``mqa`` (one), else ``gqa``.
    The one place this rule is written."""
    return "mha" if num_kv_heads == num_heads else "mqa" if num_kv_heads == 1 else "gqa"


# Keys that were renamed: an override of the old name fails with a one-line hint (the CLI
# reads this table) instead of Hydra's "key not in struct".
RENAMED_KEYS = {
    "model.num_kv_heads": "model.preset_kv_heads (the preset's published KV-head count; the count a "
                          "run uses is attention.num_kv_heads)",
}

# transformers architectures whose config.json and tensor names the decoder reads.
HF_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")


@dataclass
class ModelConfig:
    """Decoder shape. ``preset_kv_heads`` is the preset's (or checkpoint's) published KV-head
    count, used by ``attention=gqa`` when no count is given; the one count a run uses is
    ``attention.num_kv_heads``."""

    name: str = "custom"
    num_layers: int = 2
    d_model: int = 64
    num_heads: int = 8
    preset_kv_heads: int = 8
    head_dim: Optional[int] = None  # derived as d_model // num_heads when null
    ffn_dim: int = 128
    vocab_size: int = 256
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    path: Optional[str] = None  # a local Llama-format checkpoint dir: its config.json sets the shape

    def __post_init__(self) -> None:
        if self.path:
            self._shape_from_checkpoint()
        _check_numbers("model", self)
        _check_positive("model", self, ("num_layers", "d_model", "num_heads", "ffn_dim",
                                        "vocab_size", "max_seq_len", "preset_kv_heads"))
        _check(self.rope_theta > 0, "model.rope_theta", self.rope_theta, "must be > 0")
        _check(self.norm_eps > 0, "model.norm_eps", self.norm_eps, "must be > 0")
        if self.head_dim is None:
            _check(self.d_model % self.num_heads == 0, "model.d_model", self.d_model,
                   f"must be divisible by model.num_heads={self.num_heads} when model.head_dim is null")
            self.head_dim = self.d_model // self.num_heads
        _check(self.head_dim >= 2 and self.head_dim % 2 == 0, "model.head_dim", self.head_dim,
               "must be even and >= 2 (rotary embeddings rotate pairs of dimensions)")
        _check(self.preset_kv_heads <= self.num_heads and self.num_heads % self.preset_kv_heads == 0,
               "model.preset_kv_heads", self.preset_kv_heads,
               f"must divide model.num_heads={self.num_heads}")

    @classmethod
    def from_dict(cls, data: Dict[str, Any]) -> "ModelConfig":
        """A ModelConfig from ``asdict`` output, older spellings included (checkpoints written
        before ``num_kv_heads`` became ``preset_kv_heads``)."""
        data = dict(data)
        if "num_kv_heads" in data:
            data.setdefault("preset_kv_heads", data.pop("num_kv_heads"))
        return typed(cls, {k: v for k, v in data.items() if k in cls.__dataclass_fields__}, "model.")

    @classmethod
    def from_hf_config(cls, cfg: Dict[str, Any], where: str = "config.json",
                       max_seq_len: Optional[int] = None, **fields: Any) -> "ModelConfig":
        """The decoder shape a transformers ``config.json`` (as a dict) describes; ``where``
        names the file in errors (every error names it: the file is the user's input). Refuses
        what the decoder does not model; values of the wrong type name their key."""
        if not isinstance(cfg, Mapping):
            raise ConfigError(f"{where}: not a JSON object")
        try:
            return cls._from_hf_config(cfg, where, max_seq_len, fields)
        except ConfigError as exc:
            raise ConfigError(exc if where in str(exc) else f"{where}: {exc}") from None
        except (TypeError, AttributeError, ValueError, ZeroDivisionError) as exc:
            raise ConfigError(f"{where}: malformed ({type(exc).__name__}: {exc})") from None

    @classmethod
    def _from_hf_config(cls, cfg: Mapping[str, Any], where: str, max_seq_len: Optional[int],
                        fields: Dict[str, Any]) -> "ModelConfig":
        archs = cfg.get("architectures") or [cfg.get("model_type", "unknown")]
        if not any(a in HF_ARCHITECTURES for a in archs):
            raise ConfigError(f"{where}: architecture {', '.join(map(str, archs))} is not supported "
                              f"(supported: {', '.join(HF_ARCHITECTURES)})")
        # transformers >= 5 keeps rope settings in rope_parameters; older configs in rope_theta/rope_scaling.
        rope = cfg.get("rope_parameters") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if cfg.get("rope_scaling") or rope_type != "default":
            raise ConfigError(f"{where}: rope scaling ({cfg.get('rope_scaling') or rope_type}) is not "
                              "supported; only plain rotary embeddings")
        for key in ("attention_bias", "mlp_bias"):
            if cfg.get(key):
                raise ConfigError(f"{where}: {key}=true is not supported (the decoder has no biases)")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"{where}: hidden_act={cfg['hidden_act']!r} is not supported (silu only)")
        positions = cfg.get("max_position_embeddings", 2048)
        if cfg.get("sliding_window") and cfg["sliding_window"] < (max_seq_len or positions):
            raise ConfigError(f"{where}: sliding_window={cfg['sliding_window']} is not supported; "
                              f"pass max_seq_len <= {cfg['sliding_window']}")
        try:
            heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
            shape = dict(
                num_layers=cfg["num_hidden_layers"], d_model=hidden, num_heads=heads,
                preset_kv_heads=cfg.get("num_key_value_heads") or heads,
                # transformers' default; left to ModelConfig's checks when the values are not counts
                head_dim=cfg.get("head_dim") or (hidden // heads if _counts(hidden, heads) else None),
                ffn_dim=cfg["intermediate_size"], vocab_size=cfg["vocab_size"],
                max_seq_len=max_seq_len or positions,
                rope_theta=rope.get("rope_theta", cfg.get("rope_theta", 10000.0)),
                norm_eps=cfg.get("rms_norm_eps", 1e-6))
        except KeyError as e:
            raise ConfigError(f"{where}: missing key {e.args[0]!r}") from None
        # Typed like a Hydra config: a string or a list where a number belongs names its key.
        return typed(cls, {"name": cfg.get("_name_or_path") or Path(where).parent.name, **shape, **fields})

    def _shape_from_checkpoint(self) -> None:
        path = Path(self.path) / "config.json"
        if path.exists() and not path.is_file():  # a FIFO would block the read forever
            raise ConfigError(f"model.path={self.path!r}: {path} is not a regular file")
        try:
            hf = json.loads(path.read_bytes())
        except (OSError, ValueError) as exc:  # UnicodeDecodeError is a ValueError
            raise ConfigError(f"model.path={self.path!r}: cannot read {path} ({exc})") from None
        try:
            shape = ModelConfig.from_hf_config(hf, str(path))
        except ConfigError as exc:
            raise ConfigError(f"model.path={self.path!r}: {exc}") from None
        for name in ("num_layers", "d_model", "num_heads", "preset_kv_heads", "head_dim", "ffn_dim",
                     "vocab_size", "max_seq_len", "rope_theta", "norm_eps"):
            setattr(self, name, getattr(shape, name))


@dataclass
class AttentionConfig:
    """Attention variant. The variant *is* the KV-head count; ``type`` is a name that must agree
    with it (mha: num_kv_heads == num_heads, mqa: 1, gqa: strictly between)."""

    type: str = "gqa"
    num_kv_heads: Optional[int] = None  # null: mha -> num_heads, mqa -> 1, gqa -> the model's own

    def __post_init__(self) -> None:
        _check_numbers("attention", self)
        _check_choice("attention.type", self.type, ATTENTION_TYPES)
        if self.num_kv_heads is not None:
            _check(self.num_kv_heads >= 1, "attention.num_kv_heads", self.num_kv_heads, "must be >= 1")

    @classmethod
    def for_heads(cls, num_heads: int, num_kv_heads: int) -> "AttentionConfig":
        """The config whose type is what ``num_kv_heads`` of ``num_heads`` is."""
        return cls(type=attention_type(num_heads, num_kv_heads), num_kv_heads=num_kv_heads)

    def resolved(self, model: ModelConfig) -> "AttentionConfig":
        """This config with ``num_kv_heads`` filled in for ``model`` and checked against it."""
        h = model.num_heads
        kv = self.num_kv_heads
        if kv is None:
            kv = {"mha": h, "mqa": 1}.get(self.type) or default_gqa_kv_heads(model)
        key = "attention.num_kv_heads"
        _check(kv <= h, key, kv, f"must be <= model.num_heads={h}")
        _check(h % kv == 0, key, kv,
               f"must divide model.num_heads={h} (every KV group needs the same number of query heads)")
        expected = attention_type(h, kv)
        _check(self.type == expected, "attention.type", self.type,
               f"contradicts attention.num_kv_heads={kv} with model.num_heads={h} (that is {expected})")
        return AttentionConfig(type=self.type, num_kv_heads=kv)


def default_gqa_kv_heads(model: ModelConfig) -> int:
    """The preset's own KV-head count if it is a GQA model, else the divisor of num_heads
    closest to num_heads / 4 (e.g. 32 -> 8), the common GQA ratio."""
    h = model.num_heads
    if attention_type(h, model.preset_kv_heads) == "gqa":
        return model.preset_kv_heads
    divisors = [d for d in range(2, h) if h % d == 0]
    if not divisors:
        raise ConfigError(f"model.num_heads={h}: has no GQA split (no divisor between 1 and itself); "
                          "use attention=mha or attention=mqa")
    return min(divisors, key=lambda d: (abs(d - h / 4), d))


@dataclass
class WorkloadConfig:
    """What a run feeds the model. ``decode``: prefill ``prompt_len`` then ``gen_len`` greedy
    steps. ``multiturn``: a chat of ``turns`` turns after a shared system prompt."""

    name: str = "decode"
    batch_size: int = 1
    prompt_len: int = 512
    gen_len: int = 64
    # multiturn
    system_len: int = 512
    turns: int = 4
    user_len: int = 64
    reply_len: int = 32

    def __post_init__(self) -> None:
        _check_numbers("workload", self)
        _check_choice("workload.name", self.name, WORKLOADS)
        _check_positive("workload", self, ("batch_size", "prompt_len", "gen_len", "system_len",
                                           "turns", "user_len", "reply_len"))

    @property
    def total_len(self) -> int:
        """Longest sequence the workload builds (what the cache must hold)."""
        if self.name == "multiturn":
            return self.system_len + self.turns * (self.user_len + self.reply_len)
        return self.prompt_len + self.gen_len


@dataclass
class CacheConfig:
    """KV-cache implementation and whether a multi-turn chat keeps its history between turns."""

    impl: str = "static"
    shared: bool = False

    def __post_init__(self) -> None:
        _check_numbers("cache", self)
        _check_choice("cache.impl", self.impl, CACHE_IMPLS)


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
    isolate: bool = True  # each job in a fresh process (kvbench/isolation.py); false: in the calling one

    def __post_init__(self) -> None:
        _check_numbers("runtime", self)
        _check_choice("runtime.dtype", self.dtype, tuple(DTYPE_BYTES))
        _check(re.fullmatch(r"auto|cpu|cuda(:[0-9]+|:free)?", self.device) is not None,
               "runtime.device", self.device, "must be auto, cpu, cuda, cuda:N or cuda:free")
        # torch.manual_seed takes [-2**63, 2**64); a negative seed aliases a positive one.
        _check(0 <= self.seed <= INT64_MAX, "runtime.seed", self.seed, "must be in [0, 2**63 - 1]")
        _check(self.warmup >= 0, "runtime.warmup", self.warmup, "must be >= 0")
        _check(self.repeats >= 1, "runtime.repeats", self.repeats, "must be >= 1")
        _check(0 <= self.min_time_s <= MAX_MIN_TIME_S, "runtime.min_time_s", self.min_time_s,
               f"must be in [0, {MAX_MIN_TIME_S}] seconds")
        # More torch threads than CPUs only slows a benchmark down; 100,000 crash torch.
        cpus = os.cpu_count() or 1
        _check(self.threads is None or 1 <= self.threads <= cpus, "runtime.threads", self.threads,
               f"must be null or in [1, {cpus}] (the CPUs of this machine)")
        _check(self.nvml_interval_ms > 0, "runtime.nvml_interval_ms", self.nvml_interval_ms, "must be > 0")
        _check(self.peak_gb_per_s is None or self.peak_gb_per_s > 0, "runtime.peak_gb_per_s",
               self.peak_gb_per_s, "must be > 0 or null")
        # YAML and overrides give booleans (true/false, strings once typed); one spelling per mode.
        mode = str(self.compile).lower()
        self.compile = COMPILE_ALIASES.get(mode, mode)
        _check_choice("runtime.compile", self.compile, COMPILE_MODES)
        _check(self.graph_bucket >= 1, "runtime.graph_bucket", self.graph_bucket, "must be >= 1")
        _check_choice("runtime.probe", self.probe, ("cached", "run"))


@dataclass
class WandbConfig:
    """Weights & Biases settings. ``offline`` needs no account or network."""

    mode: str = "offline"  # offline | online | disabled
    project: str = "kvbench"
    entity: Optional[str] = None
    group: Optional[str] = None  # null: the sweep directory's name
    tags: List[str] = field(default_factory=list)
    # online: how long wandb.init may try to reach the server before the job falls back to
    # writing the run offline (W&B's own default is 90 s, per job).
    init_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        _check_numbers("wandb", self)
        _check_choice("wandb.mode", self.mode, ("offline", "online", "disabled"))
        _check(self.init_timeout_s > 0, "wandb.init_timeout_s", self.init_timeout_s, "must be > 0")


@dataclass
class DataConfig:
    """Text for training and perplexity, read as bytes (a byte-level tokenizer: vocab 256)."""

    path: Optional[str] = None  # a text file or directory; null: the Python standard library's sources
    val_fraction: float = 0.1
    max_bytes: Optional[int] = 4_000_000  # cap on bytes read, in a deterministic file order; null: no cap

    def __post_init__(self) -> None:
        _check_numbers("data", self)
        _check(0 < self.val_fraction < 1, "data.val_fraction", self.val_fraction, "must be in (0, 1)")
        _check(self.max_bytes is None or self.max_bytes >= 1, "data.max_bytes", self.max_bytes,
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
    checkpoint: Optional[str] = None  # task=eval: kvbench checkpoint file or Llama-format directory

    def __post_init__(self) -> None:
        _check_numbers("train", self)
        _check(self.steps >= 0, "train.steps", self.steps, "must be >= 0")
        _check_positive("train", self, ("batch_size", "seq_len", "warmup_steps", "eval_batches",
                                        "eval_every", "log_every"))
        _check(self.lr > 0, "train.lr", self.lr, "must be > 0")
        _check(0 <= self.min_lr_ratio <= 1, "train.min_lr_ratio", self.min_lr_ratio, "must be in [0, 1]")
        _check(self.weight_decay >= 0, "train.weight_decay", self.weight_decay, "must be >= 0")
        _check(self.grad_clip > 0, "train.grad_clip", self.grad_clip, "must be > 0")


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
    # A multirun into an existing sweep dir skips jobs whose results.json is ok for the same
    # config; rerun=true runs them again.
    rerun: bool = False

    def __post_init__(self) -> None:
        _check_choice("task", self.task, TASKS)
        # task=eval takes its shape from train.checkpoint, which only the task reads: the
        # attention is resolved against the checkpoint there, not against the model preset.
        if self.task != "eval":
            self.attention = self.attention.resolved(self.model)
        w = self.workload
        length_key = "workload.system_len" if w.name == "multiturn" else "workload.prompt_len"
        _check(w.total_len <= self.model.max_seq_len, length_key,
               getattr(w, length_key.split(".")[1]),
               f"the workload needs {w.total_len} positions, more than model.max_seq_len="
               f"{self.model.max_seq_len}")
        if self.runtime.compile == "graph":
            _check(self.cache.impl == "static", "cache.impl", self.cache.impl,
                   "runtime.compile=graph reads a preallocated cache in fixed shapes; use cache.impl=static")
        if w.name == "multiturn" and self.cache.shared:
            _check(self.cache.impl != "none", "cache.impl", self.cache.impl,
                   "keeps no history, so cache.shared=true has nothing to share (use static or concat)")


def _counts(*values: Any) -> bool:
    return all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values)


# ---- typing a composed config ----------------------------------------------------------------

T = TypeVar("T")


def typed(schema: Type[T], data: Any, prefix: str = "") -> T:
    """``data`` (a DictConfig or a mapping) as an instance of the dataclass ``schema``.

    A mandatory ``???`` left unset, an unknown key, a value of the wrong type and an
    interpolation that does not resolve are each a :class:`ConfigError` naming the key
    (``prefix`` + its dotted path) and the value; then the dataclasses are built, whose
    ``__post_init__`` checks the values. Keys ``data`` lacks take the schema's defaults."""
    try:
        # Before the merge: merging ``???`` over a default keeps the default (OmegaConf's rule),
        # which once benchmarked a random model for model=llama_dir without model.path.
        missing = sorted(OmegaConf.missing_keys(data))
        node = OmegaConf.merge(OmegaConf.structured(schema), data)
        missing = missing or sorted(OmegaConf.missing_keys(node))  # a group no option filled
        if missing:
            key = prefix + missing[0]
            raise ConfigError(f"{key}=???: a value is required and none was given (add {key}=...)")
        return OmegaConf.to_object(node)
    except OmegaConfBaseException as exc:
        raise ConfigError(_omegaconf_error(exc, schema, data, prefix)) from None


_ABSENT = object()


def _omegaconf_error(exc: OmegaConfBaseException, schema: type, data: Any, prefix: str) -> str:
    """One line for an OmegaConf error: ``key=value: what is wrong`` (a renamed key: its new name;
    an unknown key: the nearest known one)."""
    key = getattr(exc, "full_key", None) or ""
    if prefix + key in RENAMED_KEYS:
        return f"{prefix}{key}: renamed to {RENAMED_KEYS[prefix + key]}"
    # OmegaConf's text goes on with full_key / object_type lines: keep its first line.
    why = str(getattr(exc, "msg", None) or exc).strip().splitlines()[0]
    parent, _, name = key.rpartition(".")
    if isinstance(exc, ConfigKeyError) and name:
        group = schema
        for part in parent.split(".") if parent else ():
            group = get_type_hints(group).get(part, object)
        known = [f.name for f in fields(group)] if hasattr(group, "__dataclass_fields__") else []
        close = difflib.get_close_matches(name, known, n=1)
        why = (f"unknown key (did you mean {prefix}{parent + '.' if parent else ''}{close[0]}?)" if close
               else f"unknown key ({prefix}{parent or 'the config'} has {', '.join(known)})")
    value = _raw(data, key)
    return f"{prefix}{key}={value!r}: {why}" if value is not _ABSENT else f"{prefix}{key}: {why}"


def _raw(data: Any, key: str) -> Any:
    """The value at dotted ``key`` as the user wrote it (interpolations unresolved)."""
    node = OmegaConf.to_container(data, resolve=False) if isinstance(data, DictConfig) else data
    for part in key.split(".") if key else ():
        if not isinstance(node, Mapping) or part not in node:
            return _ABSENT
        node = node[part]
    return node if key else _ABSENT


def schema_defaults() -> DictConfig:
    """What Hydra composes the YAML files over, as plain values (no types): the defaults of
    ``task``, ``rerun``, ``data`` and ``train``, and an empty node for each group the defaults
    list fills (``model`` ... ``wandb``), so that a ``???`` in a group's YAML file is not merged
    over a default and lost. Every group node is open: an override of a key the chosen YAML
    file does not list (``model.rope_theta`` for ``model=tiny``) needs no ``+``, and a misspelt
    key reaches :func:`to_bench_config`, which rejects it naming the nearest real key."""
    node = OmegaConf.create(OmegaConf.to_container(OmegaConf.structured(BenchConfig)))
    for name, kind in get_type_hints(BenchConfig).items():
        if not hasattr(kind, "__dataclass_fields__"):
            continue
        if OmegaConf.is_missing(node, name):  # chosen in conf/config.yaml's defaults list
            node[name] = {}
        OmegaConf.set_struct(node[name], False)
    return node


# ---- what a record keeps ---------------------------------------------------------------------

# The keys of each section that a job's task (and, for task=bench, its workload) reads. A key
# that means nothing for a job (train.* for a decode run, workload.* for training) is left out
# of its record, so the record describes what was measured and nothing else.
_WORKLOAD_KEYS = {"decode": ("name", "batch_size", "prompt_len", "gen_len"),
                  "multiturn": ("name", "batch_size", "system_len", "turns", "user_len", "reply_len")}
_CACHE_KEYS = {"decode": ("impl",), "multiturn": ("impl", "shared")}
_RUNTIME_KEYS_QUALITY = ("device", "dtype", "seed", "threads")  # train and eval time nothing
_TRAIN_KEYS_EVAL = ("checkpoint", "batch_size", "seq_len", "eval_batches")


def record_view(config: Dict[str, Any]) -> Dict[str, Any]:
    """The part of a job's config (``asdict`` of a :class:`BenchConfig`, or the mapping Hydra
    saved) that its task reads: a decode run keeps no ``train``/``data`` section and no chat
    keys, a multi-turn chat no prompt length, training no workload or cache. Unknown tasks and
    workloads keep everything; a partial config (an invalid run's) keeps what it has."""
    if not isinstance(config, dict):
        return config
    task = config.get("task", "bench")
    out = dict(config)

    def keep(section: str, keys) -> None:
        if isinstance(out.get(section), dict):
            out[section] = {k: v for k, v in out[section].items() if k in keys}

    if task in ("bench", "inspect"):
        out.pop("train", None)
        out.pop("data", None)
        w = out.get("workload")
        workload = w.get("name", "decode") if isinstance(w, dict) else None
        if workload in _WORKLOAD_KEYS:
            keep("workload", _WORKLOAD_KEYS[workload])
            keep("cache", _CACHE_KEYS[workload])
    elif task in ("train", "eval"):
        out.pop("workload", None)
        out.pop("cache", None)
        keep("runtime", _RUNTIME_KEYS_QUALITY)
        if task == "eval":
            keep("train", _TRAIN_KEYS_EVAL)
        elif isinstance(out.get("train"), dict):
            keep("train", [k for k in out["train"] if k != "checkpoint"])
    return out


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

