"""The decoder's shape: the ``model`` and ``attention`` groups' schema (one dataclass each).

A run's attention layout is its KV-head count, ``attention.num_kv_heads`` (mha: one per query head,
mqa: one, gqa: in between); :func:`attention_type` is the one place that rule is written. With
``model.path`` the checkpoint's ``config.json`` sets the shape (:mod:`kvbench.hf_config`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Dict, Mapping, Optional

from kvbench import hf_config
from kvbench.config_errors import ConfigError, check, check_choice, check_numbers, check_positive, typed
from kvbench.hf_config import ROPE_TYPES

ATTENTION_TYPES = ("mha", "gqa", "mqa")
# attention.type=model (conf/attention/model.yaml, the default): the named model's own layout,
# its preset's or checkpoint's KV-head count (model.preset_kv_heads), unless attention.num_kv_heads
# asks for another. Any other type is a conversion the user asked for.
MODEL_ATTENTION = "model"


def attention_type(num_heads: int, num_kv_heads: int) -> str:
    """The name of a KV-head count: ``mha`` (one per query head), ``mqa`` (one), else ``gqa``.
    The one place this rule is written."""
    return "mha" if num_kv_heads == num_heads else "mqa" if num_kv_heads == 1 else "gqa"


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
        check_numbers("model", self)
        check_positive("model", self, ("num_layers", "d_model", "num_heads", "ffn_dim",
                                        "vocab_size", "max_seq_len", "preset_kv_heads"))
        check(self.rope_theta > 0, "model.rope_theta", self.rope_theta, "must be > 0")
        self._check_rope_scaling()
        check(self.norm_eps > 0, "model.norm_eps", self.norm_eps, "must be > 0")
        if self.head_dim is None:
            check(self.d_model % self.num_heads == 0, "model.d_model", self.d_model,
                   f"must be divisible by model.num_heads={self.num_heads} when model.head_dim is null")
            self.head_dim = self.d_model // self.num_heads
        check(self.head_dim >= 2 and self.head_dim % 2 == 0, "model.head_dim", self.head_dim,
               "must be even and >= 2 (rotary embeddings rotate pairs of dimensions)")
        check(self.preset_kv_heads <= self.num_heads and self.num_heads % self.preset_kv_heads == 0,
               "model.preset_kv_heads", self.preset_kv_heads,
               f"must divide model.num_heads={self.num_heads}")

    def _check_rope_scaling(self) -> None:
        check_choice("model.rope_type", self.rope_type, ROPE_TYPES)
        check(self.rope_factor >= 1, "model.rope_factor", self.rope_factor,
               "must be >= 1 (the factor positions are stretched by)")
        if self.rope_type != "llama3":
            return
        check(self.rope_original_max_seq_len is not None and self.rope_original_max_seq_len >= 1,
               "model.rope_original_max_seq_len", self.rope_original_max_seq_len,
               "must be >= 1 with model.rope_type=llama3 (the pretraining context)")
        check(self.rope_low_freq_factor > 0, "model.rope_low_freq_factor", self.rope_low_freq_factor,
               "must be > 0")
        check(self.rope_high_freq_factor > self.rope_low_freq_factor, "model.rope_high_freq_factor",
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
        what the decoder does not model (:func:`kvbench.hf_config.model_fields`); values of the
        wrong type name their key."""
        if not isinstance(cfg, Mapping):
            raise ConfigError(f"{where}: not a JSON object")
        try:
            # Typed like a Hydra config: a string or a list where a number belongs names its key.
            return typed(cls, {**hf_config.model_fields(cfg, where, max_seq_len), **fields})
        except ConfigError as exc:
            raise ConfigError(exc if where in str(exc) else f"{where}: {exc}") from None
        except (TypeError, AttributeError, ValueError, ZeroDivisionError) as exc:
            raise ConfigError(f"{where}: malformed ({type(exc).__name__}: {exc})") from None

    def _shape_from_checkpoint(self) -> None:
        path = Path(self.path) / hf_config.CONFIG_FILE
        if path.exists() and not path.is_file():  # a FIFO would block the read forever
            raise ConfigError(f"model.path={self.path!r}: {path} is not a regular file")
        try:
            hf = hf_config.read_config_json(self.path)
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
        check_numbers("attention", self)
        check_choice("attention.type", self.type, (MODEL_ATTENTION, *ATTENTION_TYPES))
        if self.num_kv_heads is not None:
            check(self.num_kv_heads >= 1, "attention.num_kv_heads", self.num_kv_heads, "must be >= 1")

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
        check(kv <= h, key, kv, f"must be <= model.num_heads={h}")
        check(h % kv == 0, key, kv,
              f"must divide model.num_heads={h} (every KV group needs the same number of query heads)")
        expected = attention_type(h, kv)
        check(self.type in (expected, MODEL_ATTENTION), "attention.type", self.type,
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


_CONVERSION_WORDS = {"repeat": "its K/V heads repeated (exact)",
                     "mean-pool": "its K/V heads mean-pooled per group (an approximation of the model)",
                     "random-init": "random weights drawn in the asked layout",
                     "shape": "the arithmetic of the asked layout, not of the published model"}


def kv_layout_change(model: ModelConfig, attention: AttentionConfig, method: str) -> Optional[Dict[str, Any]]:
    """The record's ``kv_conversion``: null when the run measures the model's own KV-head count
    (``model.preset_kv_heads``), else ``{from_kv_heads, to_kv_heads, method, text}``; ``method``
    says what was done to the weights (``repeat`` exact, ``mean-pool`` approximate, ``random-init``
    a preset's shape drawn with random weights in the asked layout, ``shape`` task=inspect's
    arithmetic)."""
    old, new = model.preset_kv_heads, attention.num_kv_heads
    if new is None or old == new:
        return None
    text = (f"attention converted: model {model.name} has {old} KV heads "
            f"({attention_type(model.num_heads, old)}); this run measures {new} "
            f"({attention_type(model.num_heads, new)}), {_CONVERSION_WORDS.get(method, method)}")
    return {"from_kv_heads": old, "to_kv_heads": new, "method": method, "text": text}
