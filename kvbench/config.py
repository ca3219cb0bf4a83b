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
# attention.type=model (conf/attention/model.yaml, the default): the named model's own layout,
# its preset's or checkpoint's KV-head count (model.preset_kv_heads), unless attention.num_kv_heads
# asks for another. Any other type is a conversion the user asked for.
MODEL_ATTENTION = "model"
CACHE_IMPLS = ("static", "concat", "none")
# cache.dtype: how K/V are stored. auto: the compute dtype (runtime.dtype); the others store codes
# of this many bytes per element plus a float32 scale per (sequence, KV head, position), K and V each.
CACHE_DTYPE_BYTES = {"int8": 1, "float8_e4m3fn": 1}
CACHE_DTYPES = ("auto", *CACHE_DTYPE_BYTES)
WORKLOADS = ("decode", "multiturn")
TASKS = ("bench", "inspect", "train", "eval", "capacity", "compare")
SLO_STATS = ("p50", "p99")
COMPILE_MODES = ("false", "default", "graph")
OBJECTIVE_SYNTAX = re.compile(r"-?[A-Za-z_][A-Za-z0-9_]*")  # a metric name, optionally negated
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


def objective_metric(objective: str) -> tuple[str, float]:
    """The metric an ``objective`` names and its sign: ``-decode_ms_p50`` -> (decode_ms_p50, -1)."""
    return (objective[1:], -1.0) if objective.startswith("-") else (objective, 1.0)


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

# The transformers architectures whose config.json and tensor names the decoder reads, each with
# the switches its attention needs (ModelConfig fields). The one list: the loader, the refusals
# and the README's table of accepted architectures follow it. Every architecture also takes the
# rope types in ROPE_TYPES; everything else (MoE, multimodal, a sliding window shorter than the
# run, biases beyond q/k/v, other rope types) is refused naming its config.json key.
HF_ARCHITECTURES: Dict[str, Dict[str, bool]] = {
    "LlamaForCausalLM": {"qkv_bias": False, "qk_norm": False},   # Llama 2, 3, 3.1, 3.2, 3.3
    "MistralForCausalLM": {"qkv_bias": False, "qk_norm": False},
    "Qwen2ForCausalLM": {"qkv_bias": True, "qk_norm": False},    # Qwen2, Qwen2.5: biases on q, k, v
    "Qwen3ForCausalLM": {"qkv_bias": False, "qk_norm": True},    # Qwen3 (dense): RMSNorm on q, k per head
}
# model.rope_type: rotary frequencies as transformers' rope types of the same names compute them.
ROPE_TYPES = ("default", "linear", "llama3")


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
    # Rotary scaling (ROPE_TYPES): linear divides every frequency by rope_factor; llama3
    # (Llama 3.1+) divides those with wavelengths above rope_original_max_seq_len /
    # rope_low_freq_factor, keeps those below rope_original_max_seq_len / rope_high_freq_factor,
    # and interpolates between.
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_seq_len: Optional[int] = None  # llama3: the pretraining context
    norm_eps: float = 1e-5
    qkv_bias: bool = False  # biases on the q, k and v projections (Qwen2)
    qk_norm: bool = False  # RMSNorm over head_dim on each query and key head before rotary (Qwen3)
    path: Optional[str] = None  # a local checkpoint dir (HF_ARCHITECTURES): its config.json sets the shape

    def __post_init__(self) -> None:
        if self.path:
            self._shape_from_checkpoint()
        _check_numbers("model", self)
        _check_positive("model", self, ("num_layers", "d_model", "num_heads", "ffn_dim",
                                        "vocab_size", "max_seq_len", "preset_kv_heads"))
        _check(self.rope_theta > 0, "model.rope_theta", self.rope_theta, "must be > 0")
        self._check_rope_scaling()
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

    def _check_rope_scaling(self) -> None:
        _check_choice("model.rope_type", self.rope_type, ROPE_TYPES)
        _check(self.rope_factor >= 1, "model.rope_factor", self.rope_factor,
               "must be >= 1 (the factor positions are stretched by)")
        if self.rope_type != "llama3":
            return
        _check(self.rope_original_max_seq_len is not None and self.rope_original_max_seq_len >= 1,
               "model.rope_original_max_seq_len", self.rope_original_max_seq_len,
               "must be >= 1 with model.rope_type=llama3 (the pretraining context)")
        _check(self.rope_low_freq_factor > 0, "model.rope_low_freq_factor", self.rope_low_freq_factor,
               "must be > 0")
        _check(self.rope_high_freq_factor > self.rope_low_freq_factor, "model.rope_high_freq_factor",
               self.rope_high_freq_factor, f"must be > model.rope_low_freq_factor={self.rope_low_freq_factor}")

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
        arch = next((a for a in archs if a in HF_ARCHITECTURES), None)
        if arch is None:
            raise ConfigError(f"{where}: architectures={archs!r}: not supported "
                              f"(accepted: {', '.join(HF_ARCHITECTURES)})")
        switches = HF_ARCHITECTURES[arch]
        refused = {  # key: why, for a value that is set and not the default
            "attention_bias": None if switches["qkv_bias"] else "biases on q, k, v and o (only Qwen2's "
                                                                 "q/k/v biases are modelled)",
            "mlp_bias": "the decoder's MLP has no biases",
            "text_config": "multimodal checkpoints are not supported",
            "vision_config": "multimodal checkpoints are not supported",
            "num_experts": "mixture-of-experts is not supported",
            "num_local_experts": "mixture-of-experts is not supported",
        }
        for key, why in refused.items():
            if why and cfg.get(key):
                raise ConfigError(f"{where}: {key}={cfg[key]!r}: {why}")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"{where}: hidden_act={cfg['hidden_act']!r}: not supported (silu only)")
        positions = cfg.get("max_position_embeddings", 2048)
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
        layer_types = cfg.get("layer_types")  # transformers >= 5 lists each layer's kind
        if layer_types is not None and "sliding_attention" not in layer_types:
            window = None
        if window and window < (max_seq_len or positions):
            raise ConfigError(f"{where}: sliding_window={window}: not supported (the decoder attends to "
                              f"every earlier token); pass max_seq_len <= {window}")
        try:
            heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
            shape = dict(
                num_layers=cfg["num_hidden_layers"], d_model=hidden, num_heads=heads,
                preset_kv_heads=cfg.get("num_key_value_heads") or heads,
                # transformers' default; left to ModelConfig's checks when the values are not counts
                head_dim=cfg.get("head_dim") or (hidden // heads if _counts(hidden, heads) else None),
                ffn_dim=cfg["intermediate_size"], vocab_size=cfg["vocab_size"],
                max_seq_len=max_seq_len or positions,
                norm_eps=cfg.get("rms_norm_eps", 1e-6), **switches, **_hf_rope(cfg, positions))
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
        for f in fields(self):  # everything but the preset's name and the path itself
            if f.name not in ("name", "path"):
                setattr(self, f.name, getattr(shape, f.name))


@dataclass
class AttentionConfig:
    """Attention variant. The variant *is* the KV-head count; ``type`` is a name that must agree
    with it (mha: num_kv_heads == num_heads, mqa: 1, gqa: strictly between). ``type=model`` (the
    default) is the model's own count, ``model.preset_kv_heads``: a run that names a model
    measures that model unless it asks for another layout."""

    type: str = MODEL_ATTENTION
    # null: model -> the model's own, mha -> num_heads, mqa -> 1, gqa -> the model's own if it is
    # GQA, else the divisor of num_heads closest to num_heads / 4
    num_kv_heads: Optional[int] = None

    def __post_init__(self) -> None:
        _check_numbers("attention", self)
        _check_choice("attention.type", self.type, (MODEL_ATTENTION, *ATTENTION_TYPES))
        if self.num_kv_heads is not None:
            _check(self.num_kv_heads >= 1, "attention.num_kv_heads", self.num_kv_heads, "must be >= 1")

    @classmethod
    def for_heads(cls, num_heads: int, num_kv_heads: int) -> "AttentionConfig":
        """The config whose type is what ``num_kv_heads`` of ``num_heads`` is."""
        return cls(type=attention_type(num_heads, num_kv_heads), num_kv_heads=num_kv_heads)

    def resolved(self, model: ModelConfig) -> "AttentionConfig":
        """This config with ``num_kv_heads`` filled in for ``model`` and checked against it;
        ``type=model`` becomes the name of the count it resolves to."""
        h = model.num_heads
        kv = self.num_kv_heads
        if kv is None:
            kv = {"mha": h, "mqa": 1, MODEL_ATTENTION: model.preset_kv_heads}.get(self.type) \
                or default_gqa_kv_heads(model)
        key = "attention.num_kv_heads"
        _check(kv <= h, key, kv, f"must be <= model.num_heads={h}")
        _check(h % kv == 0, key, kv,
               f"must divide model.num_heads={h} (every KV group needs the same number of query heads)")
        expected = attention_type(h, kv)
        _check(self.type in (expected, MODEL_ATTENTION), "attention.type", self.type,
               f"contradicts attention.num_kv_heads={kv} with model.num_heads={h} (that is {expected})")
        return AttentionConfig(type=expected, num_kv_heads=kv)


def default_gqa_kv_heads(model: ModelConfig) -> int:
    """``attention=gqa`` without a count: the preset's own KV-head count if it is a GQA model,
    else the divisor of num_heads closest to num_heads / 4 (e.g. 32 -> 8), the common GQA ratio.
    Only an explicit ``attention=gqa`` reaches this: the default is the model's own layout."""
    h = model.num_heads
    if attention_type(h, model.preset_kv_heads) == "gqa":
        return model.preset_kv_heads
    divisors = [d for d in range(2, h) if h % d == 0]
    if not divisors:
        raise ConfigError(f"model.num_heads={h}: has no GQA split (no divisor between 1 and itself); "
                          "use attention=mha or attention=mqa")
    return min(divisors, key=lambda d: (abs(d - h / 4), d))


def kv_layout_change(model: ModelConfig, attention: AttentionConfig, method: str) -> Optional[Dict[str, Any]]:
    """The record's ``kv_conversion``: null when the run measures the model's own KV-head count
    (``model.preset_kv_heads``), else ``{from_kv_heads, to_kv_heads, method, text}``; ``method``
    says what was done to the weights (``repeat`` exact, ``mean-pool`` approximate, ``random-init``
    a preset's shape drawn with random weights in the asked layout, ``shape`` task=inspect's
    arithmetic)."""
    old, new = model.preset_kv_heads, attention.num_kv_heads
    if new is None or old == new:
        return None
    how = {"repeat": "its K/V heads repeated (exact)", "mean-pool": "its K/V heads mean-pooled per group "
           "(an approximation of the model)", "random-init": "random weights drawn in the asked layout",
           "shape": "the arithmetic of the asked layout, not of the published model"}
    text = (f"attention converted: model {model.name} has {old} KV heads "
            f"({attention_type(model.num_heads, old)}); this run measures {new} "
            f"({attention_type(model.num_heads, new)}), {how.get(method, method)}")
    return {"from_kv_heads": old, "to_kv_heads": new, "method": method, "text": text}


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
    """KV-cache implementation, whether a multi-turn chat keeps its history between turns, and
    the precision K/V are stored in (``dtype``: auto = the compute dtype, or int8/float8_e4m3fn
    codes with scales, quantized on write and dequantized on read)."""

    impl: str = "static"
    shared: bool = False
    dtype: str = "auto"

    def __post_init__(self) -> None:
        _check_numbers("cache", self)
        _check_choice("cache.impl", self.impl, CACHE_IMPLS)
        _check_choice("cache.dtype", self.dtype, CACHE_DTYPES)
        if self.dtype != "auto":
            _check(self.impl == "static", "cache.impl", self.impl,
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
    isolate: bool = True  # each job in a fresh process (kvbench/isolation.py); false: in the calling one
    # task=capacity: the memory a job may use, in GB (1e9 bytes); null: the CUDA device's memory
    # (on a CPU the task needs a value: a machine's RAM is shared, not a budget)
    memory_budget_gb: Optional[float] = None

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
        _check(self.memory_budget_gb is None or self.memory_budget_gb > 0, "runtime.memory_budget_gb",
               self.memory_budget_gb, "must be > 0 or null")


@dataclass
class SloConfig:
    """Latency targets of ``task=capacity``: a batch meets them when the ``stat`` (p50 or p99) of
    its time to first token and of its time per output token are at most these (null: no target)."""

    name: str = "none"
    ttft_ms: Optional[float] = None
    tpot_ms: Optional[float] = None
    stat: str = "p99"
    # a TPOT target relative to the machine: at most this many times the variant's own batch-1
    # step at the same context, measured by the job (a load that slows every step alike cancels)
    tpot_x_batch1: Optional[float] = None

    def __post_init__(self) -> None:
        _check_numbers("slo", self)
        _check_choice("slo.stat", self.stat, SLO_STATS)
        for key in ("ttft_ms", "tpot_ms"):
            value = getattr(self, key)
            _check(value is None or value > 0, f"slo.{key}", value, "must be > 0 or null")
        _check(self.tpot_x_batch1 is None or self.tpot_x_batch1 >= 1, "slo.tpot_x_batch1", self.tpot_x_batch1,
               "must be >= 1 (a multiple of the batch-1 step) or null")


@dataclass
class CapacityConfig:
    """``task=capacity``: the contexts (prompt lengths) searched, and the search's range and
    resolution (an answer is within ``batch_step`` of the largest batch that fits)."""

    context_lens: List[int] = field(default_factory=lambda: [512, 1024, 2048])
    max_batch: int = 256
    batch_step: int = 1
    # slo.tpot_x_batch1: decode steps of a probe timed one by one against as many of one sequence
    tpot_pairs: int = 32

    def __post_init__(self) -> None:
        _check_numbers("capacity", self)
        _check(len(self.context_lens) > 0 and all(isinstance(n, int) and n >= 1 for n in self.context_lens),
               "capacity.context_lens", self.context_lens, "must be a non-empty list of lengths >= 1")
        _check_positive("capacity", self, ("max_batch", "batch_step", "tpot_pairs"))


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
    checkpoint: Optional[str] = None  # task=eval: kvbench checkpoint file or transformers checkpoint directory

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
class CompareConfig:
    """``task=compare``: attention variants timed in one process, alternating trial by trial.

    ``variants``: attention types (``mha``, ``gqa``, ``mqa``) or KV-head counts; the first is the
    baseline of every ratio. ``contexts``: the context lengths (positions already in the cache) a
    decode step is timed at; three or more distinct ones give the KV cost slope. ``steps``: timed
    steps per context per trial."""

    variants: List[str] = field(default_factory=lambda: ["mha", "gqa", "mqa"])
    contexts: List[int] = field(default_factory=lambda: [256, 512, 1024, 1536, 2048])
    steps: int = 8

    def __post_init__(self) -> None:
        _check_positive("compare", self, ("steps",))
        _check(len(self.variants) >= 2, "compare.variants", self.variants, "needs two or more variants to compare")
        for v in self.variants:
            _check(v in ATTENTION_TYPES or (v.isdigit() and int(v) >= 1), "compare.variants", self.variants,
                   f"{v!r} is neither an attention type ({', '.join(ATTENTION_TYPES)}) nor a KV-head count >= 1")
        _check(len(self.contexts) >= 1 and all(c >= 1 for c in self.contexts), "compare.contexts", self.contexts,
               "must list one or more context lengths >= 1")
        _check(len(set(self.contexts)) == len(self.contexts), "compare.contexts", self.contexts,
               "lists a context length twice")

    def attentions(self, model: "ModelConfig") -> List["AttentionConfig"]:
        """Each variant as a resolved :class:`AttentionConfig` for ``model`` (a count is typed by
        :func:`attention_type`); a variant the model cannot have names ``compare.variants``."""
        out = []
        for v in self.variants:
            try:
                cfg = (AttentionConfig(type=v) if v in ATTENTION_TYPES
                       else AttentionConfig.for_heads(model.num_heads, int(v)))
                out.append(cfg.resolved(model))
            except ConfigError as exc:
                raise ConfigError(f"compare.variants={self.variants!r}: {v!r}: {exc}") from None
        heads = [a.num_kv_heads for a in out]
        _check(len(set(heads)) == len(heads), "compare.variants", self.variants,
               f"two variants have the same KV-head count ({heads})")
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
    # A multirun into an existing sweep dir skips jobs whose results.json is ok for the same
    # config; rerun=true runs them again.
    rerun: bool = False
    # What a job returns to a search sweeper (hydra/sweeper=optuna): a metric of its record,
    # ``-name`` for its negative (so that one direction, maximize, serves every metric); null
    # returns nothing (a grid sweep). Checked against the metrics the task reports by
    # kvbench.runner.check_objective; read from the record by kvbench.results.objective_value.
    objective: Optional[str] = None
    # metric -> the most it may be: a job above any cap returns no objective (a failed trial).
    objective_caps: Dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_choice("task", self.task, TASKS)
        if self.objective is not None:
            _check(OBJECTIVE_SYNTAX.fullmatch(self.objective) is not None, "objective", self.objective,
                   "must be a metric name, or -name to minimise it (e.g. tokens_per_s, -decode_ms_p50)")
        for name, cap in self.objective_caps.items():
            _check(math.isfinite(cap), f"objective_caps.{name}", cap, "must be a finite number")
        # task=eval takes its shape from train.checkpoint, which only the task reads: the
        # attention is resolved against the checkpoint there, not against the model preset.
        if self.task != "eval":
            self.attention = self.attention.resolved(self.model)
        w = self.workload
        if self.task == "capacity":
            self._check_capacity()
        length_key = "workload.system_len" if w.name == "multiturn" else "workload.prompt_len"
        # task=compare reads only the batch size of the workload: its lengths are compare.contexts
        _check(self.task == "compare" or w.total_len <= self.model.max_seq_len, length_key,
               getattr(w, length_key.split(".")[1]),
               f"the workload needs {w.total_len} positions, more than model.max_seq_len="
               f"{self.model.max_seq_len}")
        if self.task == "compare":
            self.compare.attentions(self.model)
            longest = max(self.compare.contexts)
            _check(longest < self.model.max_seq_len, "compare.contexts", self.compare.contexts,
                   f"a step at context {longest} needs {longest + 1} positions, more than model.max_seq_len="
                   f"{self.model.max_seq_len}")
            _check(self.cache.impl == "static", "cache.impl", self.cache.impl,
                   "task=compare sets the filled length of a preallocated cache; use cache.impl=static")
            _check(self.runtime.compile == "false", "runtime.compile", self.runtime.compile,
                   "task=compare times eager steps only (use task=bench for compiled decoding)")
        if self.runtime.compile == "graph":
            _check(self.cache.impl == "static", "cache.impl", self.cache.impl,
                   "runtime.compile=graph reads a preallocated cache in fixed shapes; use cache.impl=static")
            # The fixed-shape step writes K/V with index_copy_ into the storage itself: a quantized
            # cache would need its quantize/dequantize inside the compiled step (not built).
            _check(self.cache.dtype == "auto", "cache.dtype", self.cache.dtype,
                   "runtime.compile=graph is not supported with a quantized cache; use cache.dtype=auto "
                   "or runtime.compile=false|default")
        if w.name == "multiturn" and self.cache.shared:
            _check(self.cache.impl != "none", "cache.impl", self.cache.impl,
                   "keeps no history, so cache.shared=true has nothing to share (use static or concat)")

    def _check_capacity(self) -> None:
        w = self.workload
        # the probes' caches are in the compute dtype, as the KV formula they are judged by
        _check(self.cache.dtype == "auto", "cache.dtype", self.cache.dtype,
               "task=capacity stores K/V in the compute dtype only; use cache.dtype=auto")
        if self.slo.tpot_x_batch1 is not None:
            _check(self.cache.impl != "none", "cache.impl", self.cache.impl,
                   "keeps no history, and slo.tpot_x_batch1 times a probe's filled cache stepping again; "
                   "use static or concat")
        if w.name == "multiturn":  # one chat, its length the workload's (checked for every task)
            _check(w.reply_len >= 2 or (self.slo.tpot_ms is None and self.slo.tpot_x_batch1 is None),
                   "workload.reply_len", w.reply_len, "a one-token reply has no decode step to judge against "
                   "slo.tpot_ms / slo.tpot_x_batch1; use >= 2, or no TPOT target")
            return
        longest = max(self.capacity.context_lens) + w.gen_len
        _check(longest <= self.model.max_seq_len, "capacity.context_lens", self.capacity.context_lens,
               f"the longest context + workload.gen_len is {longest} positions, more than "
               f"model.max_seq_len={self.model.max_seq_len}")


def _hf_rope(cfg: Mapping[str, Any], positions: Any) -> Dict[str, Any]:
    """ModelConfig's rope fields from a config.json: transformers >= 5 writes ``rope_parameters``
    (theta included), older versions ``rope_theta`` and ``rope_scaling`` (``type`` before 4.45).
    A rope type the decoder does not compute is refused naming the key."""
    key = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"
    rope = cfg.get(key) or {}
    if not isinstance(rope, Mapping):
        raise ConfigError(f"{key}={rope!r}: malformed (expected a JSON object)")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ConfigError(f"{key}.rope_type={rope_type!r}: not supported (accepted: {', '.join(ROPE_TYPES)})")
    for where, found in ((f"{key}.", rope), ("", cfg)):
        if found.get("partial_rotary_factor", 1.0) != 1.0:
            raise ConfigError(f"{where}partial_rotary_factor={found['partial_rotary_factor']!r}: not supported "
                              "(the decoder rotates every dimension)")
    out = {"rope_type": rope_type, "rope_theta": rope.get("rope_theta", cfg.get("rope_theta", 10000.0))}
    needed = {"linear": {"rope_factor": "factor"},
              "llama3": {"rope_factor": "factor", "rope_low_freq_factor": "low_freq_factor",
                         "rope_high_freq_factor": "high_freq_factor"}}.get(rope_type, {})
    for name, hf_name in needed.items():
        if hf_name not in rope:
            raise ConfigError(f"{key}.{hf_name}: missing (rope_type {rope_type!r} needs it)")
        out[name] = rope[hf_name]
    if rope_type == "llama3":  # transformers falls back to max_position_embeddings too
        out["rope_original_max_seq_len"] = rope.get("original_max_position_embeddings", positions)
    return out


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
    OmegaConf.set_struct(node.objective_caps, False)  # objective_caps.<metric>=... needs no +
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
# task=capacity searches the batch (and, for decode, the prompt length: capacity.context_lens)
_CAPACITY_WORKLOAD_KEYS = {"decode": ("name", "gen_len"),
                           "multiturn": ("name", "system_len", "turns", "user_len", "reply_len")}
_CACHE_KEYS = {"decode": ("impl", "dtype"), "multiturn": ("impl", "shared", "dtype")}
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

    if task != "compare":
        out.pop("compare", None)
    if task == "compare":  # many variants, none of them the record's attention
        out.pop("attention", None)
        out.pop("train", None)
        out.pop("data", None)
        keep("workload", ("batch_size",))
        keep("cache", ("impl",))
    if task != "capacity":
        out.pop("slo", None)
        out.pop("capacity", None)
        if isinstance(out.get("runtime"), dict):
            out["runtime"] = {k: v for k, v in out["runtime"].items() if k != "memory_budget_gb"}
    if task in ("bench", "inspect", "capacity"):
        out.pop("train", None)
        out.pop("data", None)
        w = out.get("workload")
        workload = w.get("name", "decode") if isinstance(w, dict) else None
        if task == "capacity" and workload in _CAPACITY_WORKLOAD_KEYS:
            keep("workload", _CAPACITY_WORKLOAD_KEYS[workload])
            keep("cache", _CACHE_KEYS[workload])
            if workload == "multiturn":
                keep("capacity", ("max_batch", "batch_step"))
        elif workload in _WORKLOAD_KEYS:
            keep("workload", _WORKLOAD_KEYS[workload])
            keep("cache", _CACHE_KEYS[workload])
    elif task in ("train", "eval"):
        out.pop("workload", None)
        if task == "eval":  # scored through a cache of cache.dtype (auto: none)
            keep("cache", ("dtype",))
        else:
            out.pop("cache", None)
        keep("runtime", _RUNTIME_KEYS_QUALITY)
        if task == "eval":
            keep("train", _TRAIN_KEYS_EVAL)
        elif isinstance(out.get("train"), dict):
            keep("train", [k for k in out["train"] if k != "checkpoint"])
    return out


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

