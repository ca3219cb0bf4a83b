"""Typed configuration: one dataclass per Hydra group, registered in Hydra's ConfigStore.

The YAML files under ``conf/<group>/`` only set values; types come from these schemas and
value checks from ``__post_init__``, so a bad value is rejected where it enters, with a
one-line :class:`ConfigError` that names the key and the value.

Cross-group rules (the attention type against the model's head count, the sequence
against ``max_seq_len``) live in :class:`BenchConfig`, which owns both sides.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
ATTENTION_TYPES = ("mha", "gqa", "mqa")
CACHE_IMPLS = ("static", "concat", "none")
WORKLOADS = ("decode", "multiturn")
TASKS = ("bench", "inspect", "train", "eval")


class ConfigError(ValueError):
    """A configuration value is invalid. The message names the key and the value."""


def _check(ok: bool, key: str, value, why: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r}: {why}")


def _check_choice(key: str, value, choices) -> None:
    _check(value in choices, key, value, f"must be one of {', '.join(choices)}")


def _check_positive(prefix: str, obj, names) -> None:
    for name in names:
        value = getattr(obj, name)
        _check(value >= 1, f"{prefix}.{name}", value, "must be >= 1")


@dataclass
class ModelConfig:
    """Decoder shape. ``num_kv_heads`` is the preset's published KV-head count (used by
    ``attention=gqa`` when no count is given); the count a run uses is ``attention.num_kv_heads``."""

    name: str = "custom"
    num_layers: int = 2
    d_model: int = 64
    num_heads: int = 8
    num_kv_heads: int = 8
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
        _check_positive("model", self, ("num_layers", "d_model", "num_heads", "ffn_dim",
                                        "vocab_size", "max_seq_len"))
        if self.head_dim is None:
            _check(self.d_model % self.num_heads == 0, "model.d_model", self.d_model,
                   f"must be divisible by model.num_heads={self.num_heads} when model.head_dim is null")
            self.head_dim = self.d_model // self.num_heads
        _check(self.head_dim >= 2 and self.head_dim % 2 == 0, "model.head_dim", self.head_dim,
               "must be even and >= 2 (rotary embeddings rotate pairs of dimensions)")
        _check(1 <= self.num_kv_heads <= self.num_heads and self.num_heads % self.num_kv_heads == 0,
               "model.num_kv_heads", self.num_kv_heads,
               f"must divide model.num_heads={self.num_heads}")


    def _shape_from_checkpoint(self) -> None:
        from kvbench.checkpoint import CheckpointError, read_llama_config  # checkpoint imports this module

        try:
            shape = read_llama_config(self.path)
        except CheckpointError as exc:
            raise ConfigError(f"model.path={self.path!r}: {exc}") from None
        for name in ("num_layers", "d_model", "num_heads", "num_kv_heads", "head_dim", "ffn_dim",
                     "vocab_size", "max_seq_len", "rope_theta", "norm_eps"):
            setattr(self, name, getattr(shape, name))


@dataclass
class AttentionConfig:
    """Attention variant. The variant *is* the KV-head count; ``type`` is a name that must agree
    with it (mha: num_kv_heads == num_heads, mqa: 1, gqa: strictly between)."""

    type: str = "gqa"
    num_kv_heads: Optional[int] = None  # null: mha -> num_heads, mqa -> 1, gqa -> the model's own

    def __post_init__(self) -> None:
        _check_choice("attention.type", self.type, ATTENTION_TYPES)
        if self.num_kv_heads is not None:
            _check(self.num_kv_heads >= 1, "attention.num_kv_heads", self.num_kv_heads, "must be >= 1")

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
        expected = "mha" if kv == h else "mqa" if kv == 1 else "gqa"
        _check(self.type == expected, "attention.type", self.type,
               f"contradicts attention.num_kv_heads={kv} with model.num_heads={h} (that is {expected})")
        return AttentionConfig(type=self.type, num_kv_heads=kv)


def default_gqa_kv_heads(model: ModelConfig) -> int:
    """The preset's own KV-head count if it is a GQA model, else the divisor of num_heads
    closest to num_heads / 4 (e.g. 32 -> 8), the common GQA ratio."""
    h = model.num_heads
    if 1 < model.num_kv_heads < h:
        return model.num_kv_heads
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
        _check_choice("cache.impl", self.impl, CACHE_IMPLS)


@dataclass
class RuntimeConfig:
    """Where and how a run executes and is timed."""

    device: str = "auto"  # auto | cpu | cuda | cuda:N | cuda:free (kvbench/cluster.py)
    dtype: str = "float32"
    seed: int = 0
    warmup: int = 1
    repeats: int = 3
    threads: Optional[int] = None  # torch CPU threads; null keeps torch's default
    nvml_interval_ms: float = 10.0  # NVML background sampling period
    compile: bool = False  # torch.compile the model; compile time is reported apart
    peak_gb_per_s: Optional[float] = None  # roofline peak; null: a cached probe of this machine
    fidelity: bool = True  # cached decode vs recompute (and vs float32) on 2 sequences after timing

    def __post_init__(self) -> None:
        _check_choice("runtime.dtype", self.dtype, tuple(DTYPE_BYTES))
        _check(self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:"),
               "runtime.device", self.device, "must be auto, cpu, cuda or cuda:N")
        _check(self.warmup >= 0, "runtime.warmup", self.warmup, "must be >= 0")
        _check(self.repeats >= 1, "runtime.repeats", self.repeats, "must be >= 1")
        _check(self.nvml_interval_ms > 0, "runtime.nvml_interval_ms", self.nvml_interval_ms, "must be > 0")
        _check(self.peak_gb_per_s is None or self.peak_gb_per_s > 0, "runtime.peak_gb_per_s",
               self.peak_gb_per_s, "must be > 0 or null")


@dataclass
class WandbConfig:
    """Weights & Biases settings. ``offline`` needs no account or network."""

    mode: str = "offline"  # offline | online | disabled
    project: str = "kvbench"
    entity: Optional[str] = None
    group: Optional[str] = None  # null: the sweep directory's name
    tags: List[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        _check_choice("wandb.mode", self.mode, ("offline", "online", "disabled"))


@dataclass
class DataConfig:
    """Text for training and perplexity, read as bytes (a byte-level tokenizer: vocab 256)."""

    path: Optional[str] = None  # a text file or directory; null: the Python standard library's sources
    val_fraction: float = 0.1
    max_bytes: Optional[int] = 4_000_000  # cap on bytes read, in a deterministic file order

    def __post_init__(self) -> None:
        _check(0 < self.val_fraction < 1, "data.val_fraction", self.val_fraction, "must be in (0, 1)")


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
        self.attention = self.attention.resolved(self.model)
        w = self.workload
        length_key = "workload.system_len" if w.name == "multiturn" else "workload.prompt_len"
        _check(w.total_len <= self.model.max_seq_len, length_key,
               getattr(w, length_key.split(".")[1]),
               f"the workload needs {w.total_len} positions, more than model.max_seq_len="
               f"{self.model.max_seq_len}")
        if w.name == "multiturn" and self.cache.shared:
            _check(self.cache.impl != "none", "cache.impl", self.cache.impl,
                   "keeps no history, so cache.shared=true has nothing to share (use static or concat)")


def register_configs() -> None:
    """Register the schemas so YAML files are typed and checked when Hydra composes them."""
    cs = ConfigStore.instance()
    cs.store(name="kvbench_schema", node=BenchConfig)


def dtype_bytes(dtype: str) -> int:
    return DTYPE_BYTES[dtype]
