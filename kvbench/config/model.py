"""The decoder's shape: the ``model`` and ``attention`` groups' schema (one dataclass each).

A run's attention layout is its KV-head count, ``attention.num_kv_heads`` (mha: one per query head,
mqa: one, gqa: in between); :func:`attention_type` is the one place that rule is written. With
``model.path`` the checkpoint's ``config.json`` sets the shape (:mod:`kvbench.config.hf`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

from kvbench.config import hf as hf_config
from kvbench.config.hf import ROPE_TYPES
from kvbench.config.hyper import HyperConnections
from kvbench.config.layer_options import LAYER_OPTIONS, PRESET_OPTIONS, resolve_options
from kvbench.config.layer_pattern import check_window_pattern, check_within_context, resolve_layer_pattern
from kvbench.config.multipliers import Multipliers
from kvbench.config.nope import NoPE
from kvbench.config.quant import check_weights_stored
from kvbench.config.residual import ResidualForm
from kvbench.core.errors import ConfigError, check, check_choice, check_numbers, check_positive, typed, typed_once
from kvbench.core.hf_keys import Source, in_file_keys
from kvbench.core.moe import MoEShape
from kvbench.jsonio import path_problem
from kvbench.layouts.kinds import by_layer_type, named_layer_types, recurrent_layer_types, registered
from kvbench.layouts.latent_config import MLA_FIELDS, MLAShape, check_indexer, check_mla_dims, indexer_defaults

# The attention layouts, in the order every table, plot and report lists them: the three KV-head counts,
# then multi-head latent attention (DeepSeek-V2/V3: a latent per token, not K/V heads).
ATTENTION_TYPES = ("mha", "gqa", "mqa", "mla")
MLA_DECODE_FORMS, MLP_ACTS = ("absorbed", "expanded"), ("silu", "relu2", "gelu_tanh")
# attention.type=model (conf/attention/model.yaml, the default): the named model's own layout,
# its preset's or checkpoint's KV-head count (model.preset_kv_heads) or latent (model.preset_mla),
# unless attention.num_kv_heads asks for another. Any other type is a conversion the user asked for.
MODEL_ATTENTION = "model"


def attention_type(num_heads: int, num_kv_heads: int) -> str:
    """The name of a KV-head count: ``mha`` (one per query head), ``mqa`` (one), else ``gqa`` (only here)."""
    return "mha" if num_kv_heads == num_heads else "mqa" if num_kv_heads == 1 else "gqa"


@dataclass
class ModelConfig:
    """Decoder shape. ``preset_kv_heads`` is the preset's (or checkpoint's) published KV-head count, used
    by ``attention=gqa`` when no count is given; the one count a run uses is ``attention.num_kv_heads``."""

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
    # Rotary scaling (ROPE_TYPES): linear divides every frequency by rope_factor; llama3 (Llama 3.1+) divides
    # those with wavelengths above rope_original_max_seq_len / rope_low_freq_factor, keeps those below
    # rope_original_max_seq_len / rope_high_freq_factor, and interpolates between.
    rope_type: str = "default"  # none: no rotary embeddings (NoPE: Nemotron-H's and Granite 4's attention)
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_seq_len: Optional[int] = None  # llama3, yarn: the pretraining context
    # yarn (transformers' names without rope_): the ramp between interpolated and extrapolated
    # frequencies, and the attention factors (DeepSeek scales its softmax by mscale(factor, all_dim)^2)
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_mscale: float = 0.0  # 0: not set
    rope_mscale_all_dim: float = 0.0  # 0: not set
    rope_attention_factor: Optional[float] = None  # null: from factor, mscale and mscale_all_dim
    rope_truncate: bool = True  # yarn: the ramp's ends rounded to whole dimensions (GPT-OSS: false)
    norm_eps: float = 1e-5
    qkv_bias: bool = False  # biases on the q, k and v projections (Qwen2)
    o_bias: bool = False  # a bias on the attention's output projection (GPT-OSS)
    mlp_bias: bool = False  # biases on the dense MLP's gate, up and down projections (Llama's mlp_bias)
    qk_norm: bool = False  # RMSNorm over head_dim on each query and key head before rotary (Qwen3)
    # Qwen3.5 / Qwen3-Next (transformers' Qwen3_5RMSNorm, Qwen3_5Attention):
    norm_zero_centered: bool = False  # every RMSNorm scales by (1 + weight), multiplied in float32
    attn_output_gate: bool = False  # q_proj emits [query | gate] per head; output x sigmoid(gate) before o_proj
    partial_rotary_factor: float = 1.0  # rotary embeddings turn the first int(head_dim x factor) dims of a head
    # Gated DeltaNet layers (layer_types' linear_attention), config.json's names: the weights' shape; null: in
    # Qwen3.5's proportions to the attention's (derived and checked by kvbench.layouts.gated_deltanet.model_shape).
    linear_num_key_heads: Optional[int] = None  # H_k, heads of q and k (null: num_heads)
    linear_num_value_heads: Optional[int] = None  # H_v, heads of v and of the state (null: 2 x num_heads)
    linear_key_head_dim: Optional[int] = None  # d_k (null: head_dim / 2)
    linear_value_head_dim: Optional[int] = None  # d_v (null: head_dim / 2)
    linear_conv_kernel_dim: Optional[int] = None  # taps of the causal short convolution over q, k, v (null: 4)
    path: Optional[str] = None  # a local checkpoint dir (HF_ARCHITECTURES): its config.json sets the shape
    # The model's own sliding window of W positions (a checkpoint's or preset's; the run's: attention.window)
    preset_window: Optional[int] = None
    preset_global_every: Optional[int] = None
    preset_layer_types: Optional[List[str]] = None
    preset_sinks: bool = False  # learned attention sinks in every layer (GPT-OSS)
    preset_mla: Optional[MLAShape] = None  # its own MLA shape (DeepSeek), attention=mla's without ranks; null: none
    preset_kv_shared_layers: int = 0  # the last N layers read an earlier layer's K/V (Gemma 3n)
    preset_k_eq_v: int = 0  # 1: a global layer's keys are its values, one tensor cached (Gemma 4's attention_k_eq_v)
    preset_chunk: int = 0  # the local layers attend within chunks of C (Llama 4's attention_chunk_size); 0: none
    moe: Optional[MoEShape] = None  # mixture-of-experts MLPs (kvbench.core.moe); null: every MLP dense, ffn_dim wide
    weights_stored: Optional[str] = None  # fp8_e4m3_MxN, mxfp4, nvfp4: the checkpoint's weights as stored; null: as run
    mlp_act: str = "silu"  # MLP_ACTS: silu, gated (SwiGLU); relu2, relu(up x)^2 ungated (Nemotron-H); gelu_tanh (GeGLU)
    no_mlp_layers: Optional[List[int]] = None  # layers whose block is its mixer alone, no MLP (nor its norm)
    layer_shapes: Optional[Dict[str, Any]] = None  # a layer kind's own shape by its name (LayerKind.build reads it)
    multipliers: Optional[Multipliers] = None  # Granite's scalings of embedding, residual, attention, logits
    v_norm: bool = False  # values RMS-normed per head without a scale (Gemma 4)
    residual: Optional[ResidualForm] = None  # Gemma 4's residual stream, embedding to logits (kvbench.config.residual)
    nope: Optional[NoPE] = None  # Llama 4's layers without rotary embeddings, their query temperature, the L2 norm
    hyper_connections: Optional[HyperConnections] = None  # DeepSeek-V4's residual streams (mHC); null: plain
    left_out: Optional[str] = None  # what of the published model this preset does not build (inspect, records)

    def __post_init__(self) -> None:
        if self.path:
            self._shape_from_checkpoint()
        for key, schema in (("preset_mla", MLAShape), ("moe", MoEShape), ("multipliers", Multipliers),
                            ("residual", ResidualForm), ("nope", NoPE), ("hyper_connections", HyperConnections)):
            if isinstance(getattr(self, key), Mapping):
                setattr(self, key, typed(schema, dict(getattr(self, key)), f"model.{key}."))
        for key, layers in (("moe.dense_layers", self.moe.dense_layers if self.moe else ()),
                            ("no_mlp_layers", self.no_mlp_layers or ()),
                            ("nope.layers", self.nope.layers if self.nope else ())):
            check(all(0 <= i < self.num_layers for i in layers), f"model.{key}", layers,
                  f"must name layers below model.num_layers={self.num_layers}")
        check_choice("model.mlp_act", self.mlp_act, MLP_ACTS)
        check(self.mlp_act != "gelu_tanh" or self.moe is None or self.moe.beside_dense, "model.mlp_act", self.mlp_act,
              "is a dense MLP's (GeGLU); experts run silu or relu2, GeGLU only beside a dense MLP "
              "(model.moe.beside_dense)")
        check_numbers("model", self)
        check_positive("model", self, ("num_layers", "d_model", "num_heads", "ffn_dim", "vocab_size", "max_seq_len",
                                        "preset_kv_heads"))
        check(self.rope_theta > 0, "model.rope_theta", self.rope_theta, "must be > 0")
        self._check_rope_scaling()
        check(self.norm_eps > 0, "model.norm_eps", self.norm_eps, "must be > 0")
        check_weights_stored(self.weights_stored)
        if self.head_dim is None:
            check(self.d_model % self.num_heads == 0, "model.d_model", self.d_model,
                   f"must be divisible by model.num_heads={self.num_heads} when model.head_dim is null")
            self.head_dim = self.d_model // self.num_heads
        check(self.head_dim >= 1, "model.head_dim", self.head_dim, "must be >= 1")
        if self.preset_mla is None and self.rope_type != "none":  # a latent's heads rotate preset_mla.qk_rope_head_dim
            self.check_rotary()
        for kind in registered():  # each kind's own model.* fields (a recurrent layer's shape)
            if kind.check_model:
                kind.check_model(self)
        check(self.preset_kv_heads <= self.num_heads and self.num_heads % self.preset_kv_heads == 0,
               "model.preset_kv_heads", self.preset_kv_heads, f"must divide model.num_heads={self.num_heads}")
        check_window_pattern("model.preset_", self.preset_window, self.preset_global_every,
                             self.preset_layer_types, self.num_layers)

    def check_rotary(self) -> None:
        """That a K/V-head layer's heads, which rotary embeddings turn, rotate pairs of dimensions."""
        check(self.head_dim >= 2 and self.head_dim % 2 == 0, "model.head_dim", self.head_dim,
              "must be even and >= 2 (rotary embeddings rotate pairs of dimensions)")
        rotated = self.rotary_dim
        check(0 < self.partial_rotary_factor <= 1 and rotated >= 2 and rotated % 2 == 0, "model.partial_rotary_factor",
              self.partial_rotary_factor, f"must be in (0, 1] and rotate an even number >= 2 of the head_dim="
              f"{self.head_dim} dimensions (int(head_dim x factor) = {rotated})")

    @property
    def rotary_dim(self) -> int:
        """The dimensions of a query or key head that rotary embeddings turn (transformers' int())."""
        return 0 if self.rope_type == "none" else int(self.head_dim * self.partial_rotary_factor)

    def without_pattern(self) -> "ModelConfig":
        """This shape with no layer pattern (window, chunk, recurrent or compressed layers, KV sharing): every layer
        full attention unless attention.* asks otherwise; Llama 4's NoPE layers, full already, kept. Not re-read
        from ``path``: a replace() of a config with one reads its checkpoint again, pattern and all."""
        return replace(self, path=None, preset_window=None, preset_global_every=None, preset_layer_types=None,
                       preset_kv_shared_layers=0, preset_chunk=0)

    def with_own_layout(self, attention: "AttentionConfig") -> "ModelConfig":
        """This shape whose own layout (what attention=model runs) is ``attention``, resolved against
        it: its KV heads or latent, its window pattern, its recurrent or compressed layers and its layer options."""
        window, types = attention.window or None, attention.layer_types
        latent = MLAShape(**{k: getattr(attention, k) for k in MLA_FIELDS}) if attention.latent else None
        return replace(self, preset_kv_heads=attention.num_kv_heads, preset_mla=latent, preset_window=window,
                       preset_global_every=attention.global_every if window else None,
                       preset_layer_types=types if window or set(types or ()) & set(named_layer_types()) else None,
                       **{o.preset: o.own(getattr(attention, o.key)) for o in PRESET_OPTIONS})

    def _check_rope_scaling(self) -> None:
        check_choice("model.rope_type", self.rope_type, (*ROPE_TYPES, "none"))
        check(self.rope_factor >= 1, "model.rope_factor", self.rope_factor,
               "must be >= 1 (the factor positions are stretched by)")
        if self.rope_type not in ("llama3", "yarn"):
            return
        check(self.rope_original_max_seq_len is not None and self.rope_original_max_seq_len >= 1,
              "model.rope_original_max_seq_len", self.rope_original_max_seq_len,
              f"must be >= 1 with model.rope_type={self.rope_type} (the pretraining context)")
        if self.rope_type == "yarn":
            check(self.rope_beta_fast > self.rope_beta_slow > 0, "model.rope_beta_fast", self.rope_beta_fast,
                  f"must be > model.rope_beta_slow={self.rope_beta_slow} > 0")
            return
        check(self.rope_low_freq_factor > 0, "model.rope_low_freq_factor", self.rope_low_freq_factor, "must be > 0")
        check(self.rope_high_freq_factor > self.rope_low_freq_factor, "model.rope_high_freq_factor",
               self.rope_high_freq_factor, f"must be > model.rope_low_freq_factor={self.rope_low_freq_factor}")

    @classmethod
    def from_dict(cls, data: Dict[str, Any]) -> "ModelConfig":
        """A ModelConfig from ``asdict`` output, older spellings included (checkpoints written
        before ``num_kv_heads`` became ``preset_kv_heads``)."""
        data = dict(data)
        if "num_kv_heads" in data:
            data.setdefault("preset_kv_heads", data.pop("num_kv_heads"))
        # Every other key is checked, not dropped: an unknown one is not kvbench's model (typed() names it)
        return typed(cls, data, "model.")

    @classmethod
    def from_hf_config(cls, cfg: Dict[str, Any], where: str = "config.json",
                       max_seq_len: Optional[int] = None, **fields: Any) -> "ModelConfig":
        """The decoder shape a transformers ``config.json`` (as a dict) describes; ``where`` names the file
        in errors (every error names it: the file is the user's input), and a bad value by the key the file
        holds it under (:func:`kvbench.core.hf_keys.in_file_keys`; a value given here, ``max_seq_len`` or
        ``fields``, by kvbench's). Refuses what the decoder does not model (:func:`~kvbench.config.hf.model_fields`)."""
        if not isinstance(cfg, Mapping):
            raise ConfigError(f"{where}: not a JSON object")
        sources: Dict[str, Source] = {}
        try:
            shape, sources = hf_config.model_fields(cfg, where, max_seq_len)
            sources = {k: s for k, s in sources.items() if k not in fields}
            # Typed like a Hydra config: a string or a list where a number belongs names its key. Once per
            # distinct content, but a path, which the config reads again itself (its checkpoint may change)
            values = {**shape, **fields}
            return typed(cls, values) if "path" in values else typed_once(cls, values)
        except ConfigError as exc:
            raise ConfigError(exc if where in str(exc) else f"{where}: {in_file_keys(str(exc), sources)}") from None
        except (TypeError, AttributeError, ValueError, ZeroDivisionError) as exc:
            raise ConfigError(f"{where}: malformed ({type(exc).__name__}: {exc})") from None

    def _shape_from_checkpoint(self) -> None:
        path = Path(self.path) / hf_config.CONFIG_FILE
        if (why := path_problem(self.path, "directory")) is not None:  # not "cannot read PATH/config.json"
            raise ConfigError(f"model.path={self.path!r}: {why} (a checkpoint directory with config.json)")
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
    """Attention variant. For mha/gqa/mqa the variant *is* the KV-head count; ``type`` is a name that
    must agree with it (mha: num_kv_heads == num_heads, mqa: 1, gqa: strictly between). ``type=model``
    (the default) is the model's own layout (``model.preset_kv_heads``, or its ``preset_mla``): a run
    that names a model measures that model unless it asks for another.

    ``mla`` (multi-head latent attention, DeepSeek-V2/V3): keys and values are up-projected from one
    latent of ``kv_lora_rank`` per token plus one shared rotary key of ``qk_rope_head_dim``; the cache
    holds those (num_kv_heads resolves to 1: the absorbed decode is MQA over one latent head of
    kv_lora_rank + qk_rope_head_dim). Its fields, DeepSeek's names, are null for the other types; null
    with mla: the model's own (model.preset_mla), else DeepSeek-V3's ratios to model.head_dim
    (kv_lora_rank 4x, qk_nope 1x, qk_rope 1/2, v 1x, no q_lora)."""

    type: str = MODEL_ATTENTION
    # null: model -> the model's own, mha -> num_heads, mqa -> 1, gqa -> the model's own if it is
    # GQA, else the divisor of num_heads closest to num_heads / 4
    num_kv_heads: Optional[int] = None
    # Sliding window: a local layer's query at position p attends positions p - W + 1 .. p (W keys,
    # itself included; transformers' rule) and its cache stops at W positions. null: the model's
    # own (model.preset_window, usually none); 0: no window, every layer global.
    window: Optional[int] = None
    # Which layers are local (null: the model's own pattern, else every layer): global_every k
    # makes layers k-1, 2k-1, ... global (Gemma 3: 6, five local to one global; GPT-OSS: 2), 0
    # none; layer_types lists each layer as transformers does (sliding_attention | full_attention).
    global_every: Optional[int] = None
    layer_types: Optional[List[str]] = None
    # Gated DeltaNet layers (linear attention: a constant state per sequence, no K/V): every k-th
    # layer full attention, the others linear (Qwen3.5, Qwen3-Next: 4); 0: none; null: the model's own
    # (model.preset_layer_types). layer_types may list linear_attention layers instead.
    full_attention_interval: Optional[int] = None
    # the recurrent layer type full_attention_interval's other layers are (null: linear_attention; another
    # registered recurrent kind's layer type, as compare's letters for the recurrent kinds ask)
    interval_type: Optional[str] = None
    # Learned attention sinks (GPT-OSS): one logit per query head joins every softmax, taking
    # weight from the keys at no cache cost. null: the model's own (model.preset_sinks).
    sinks: Optional[bool] = None
    q_lora_rank: Optional[int] = None  # 0: queries by one full-rank projection
    kv_lora_rank: Optional[int] = None  # R: the latent each token's keys and values come from
    qk_nope_head_dim: Optional[int] = None  # per-head key/query width without rotary
    qk_rope_head_dim: Optional[int] = None  # the rotary key shared by all heads, and each query's
    v_head_dim: Optional[int] = None
    # how a decode step reads the latents: absorbed (W_UK folded into the query, W_UV into the output: MQA over
    # the latents, as vLLM runs it) | expanded (K/V up-projected per head: the reference); prefill: expanded
    mla_decode: str = "absorbed"
    index_n_heads: Optional[int] = None  # DSA's (DeepSeek-V3.2, with mla) indexer heads; null: the model's own
    index_head_dim: Optional[int] = None  # the width of its key, cached per token beside the latent
    index_topk: Optional[int] = None  # DSA: each query attends its top index_topk tokens; 0: no indexer
    # Gemma 3n: the last N layers read an earlier layer's K/V, storing none (null: the model's own; 0: none)
    kv_shared_layers: Optional[int] = None
    # Gemma 4: 1, a global layer's one projection serves as its keys and its values, so a position caches one
    # tensor, not two (kvbench.layouts.global_heads); 0: K and V; null: the model's own (model.preset_k_eq_v)
    k_eq_v: Optional[int] = None
    # Llama 4: the local layers attend within chunks of C positions, the mask reset at each multiple of C
    # (kvbench.layouts.chunked; the window of those layers is C). null: the model's own; 0: none
    chunk: Optional[int] = None

    def __post_init__(self) -> None:
        check_numbers("attention", self)
        check_choice("attention.type", self.type, (MODEL_ATTENTION, *ATTENTION_TYPES))
        check_choice("attention.mla_decode", self.mla_decode, MLA_DECODE_FORMS)
        if self.num_kv_heads is not None:
            check(self.num_kv_heads >= 1, "attention.num_kv_heads", self.num_kv_heads, "must be >= 1")
        check_window_pattern("attention.", self.window, self.global_every, self.layer_types)
        check(self.k_eq_v in (None, 0, 1), "attention.k_eq_v", self.k_eq_v, "must be 1 (keys are values), 0 or null")
        check(self.full_attention_interval is None or self.full_attention_interval >= 0,
              "attention.full_attention_interval", self.full_attention_interval,
              "must be >= 0 (0: no linear layer; k: every k-th layer full attention, the others linear) or null")
        recurrent = recurrent_layer_types()
        check(self.interval_type is None or self.interval_type in recurrent, "attention.interval_type",
              self.interval_type, f"must be a recurrent kind's layer type ({', '.join(recurrent)}) or null")
        check(self.interval_type is None or self.full_attention_interval is not None, "attention.interval_type",
              self.interval_type, "says which layers attention.full_attention_interval makes, and it is null")
        for kind in registered():  # a kind's own fields are null unless its type is asked
            for name in kind.shape_keys if self.type not in kind.attention_types else ():
                check(getattr(self, name) is None, f"attention.{name}", getattr(self, name),
                      f"is a {kind.title} rank; attention.type={self.type} has none "
                      f"(use attention={kind.attention_types[0]})")

    def layer_windows(self, num_layers: int) -> List[Optional[int]]:
        """Each layer's window (None: global) for a resolved config (:meth:`resolved`)."""
        if not self.window:
            return [None] * num_layers
        if self.layer_types is not None:
            return [self.window if t == "sliding_attention" else None for t in self.layer_types]
        k = self.global_every or 0
        return [None if k and (i + 1) % k == 0 else self.window for i in range(num_layers)]

    def layer_kinds(self, num_layers: int) -> List[str]:
        """Each layer's transformers name for a resolved config (:meth:`resolved`): a recurrent kind's
        (:mod:`kvbench.layouts.kinds`) or an attention layer (sliding_attention where a window applies)."""
        return list(self.layer_types) if self.layer_types is not None else ["full_attention"] * num_layers

    def without_pattern(self) -> "AttentionConfig":
        """This layout (its KV heads or latent, sinks) with every layer full attention whatever the model's own
        pattern: no window or chunk, no recurrent or compressed layer (this one's instead), no K/V shared."""
        return replace(self, window=0, global_every=None, layer_types=None, full_attention_interval=0,
                       interval_type=None, kv_shared_layers=0, chunk=0)

    def as_asked(self) -> "AttentionConfig":
        """A new, unresolved config of the fields this one asks for its type (a kind's own shape only
        with its type): task=eval resolves it against the checkpoint's shape, whose own
        layout fills every null, not against the model the config names."""
        return replace(self, **{name: None for kind in registered() if self.type not in kind.attention_types
                                for name in kind.shape_keys})

    @property
    def latent(self) -> bool:
        """True when the cache holds one latent per token and layer (MLA), not K and V heads."""
        return self.type == "mla"

    @classmethod
    def for_heads(cls, num_heads: int, num_kv_heads: int) -> "AttentionConfig":
        """The config whose type is what ``num_kv_heads`` of ``num_heads`` is."""
        return cls(type=attention_type(num_heads, num_kv_heads), num_kv_heads=num_kv_heads)

    def resolved(self, model: ModelConfig) -> "AttentionConfig":
        """This config with ``num_kv_heads`` filled in for ``model`` and checked against it;
        ``type=model`` becomes the name of the layout it resolves to (mla for a latent model)."""
        if self.latent or (self.type == MODEL_ATTENTION and model.preset_mla is not None
                           and self.num_kv_heads is None):
            return self._resolved_mla(model)
        if model.preset_mla is not None and model.rope_type != "none":  # K/V heads as wide as a latent model's
            model.check_rotary()  # (qk_nope + qk_rope), rotated whole; unrotated where its latent is (Kimi's)
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
        # the layer options' values are checked against the layers by build_layouts (a count of shared layers)
        return AttentionConfig(type=expected, num_kv_heads=kv, mla_decode=self.mla_decode,
                               **resolve_options(self, model, kv_heads=True),
                               **resolve_layer_pattern(self, model))._with_options_checked()

    def _resolved_mla(self, model: ModelConfig) -> "AttentionConfig":
        check(self.num_kv_heads in (None, 1), "attention.num_kv_heads", self.num_kv_heads,
               "attention=mla caches one latent head per token (null or 1)")
        scale = model.multipliers.attention_multiplier if model.multipliers else None
        check(scale is None, "model.multipliers.attention_multiplier", scale, "scales the logits of K/V-head "
              "attention (Granite's); a latent layer scales its own (the softmax of its yarn rope): use attention "
              "with K/V heads, or leave it null")
        D = model.head_dim
        own = model.preset_mla or MLAShape(q_lora_rank=0, kv_lora_rank=4 * D, qk_nope_head_dim=D,
                                           qk_rope_head_dim=max(2, D // 2 - D // 2 % 2), v_head_dim=D)
        dims = {name: getattr(own, name) if getattr(self, name) is None else getattr(self, name)
                for name in MLA_FIELDS}
        if self.index_topk != own.index_topk:  # asked of the run (a checkpoint's own is what it is)
            check_within_context("attention.index_topk", self.index_topk, model,
                                 "a top-k that large attends every visible token; 0: no indexer")
        dims.update(indexer_defaults(own, self, model.num_heads))
        options = resolve_options(self, model, kv_heads=False)  # refuses those of K/V-head attention only (sinks)
        for key in ("attn_output_gate", "partial_rotary_factor"):  # what only K/V-head layers have
            check(getattr(model, key) == getattr(ModelConfig, key), f"model.{key}", getattr(model, key),
                  "is a property of K/V-head attention; attention=mla has none")
        # a window as for K/V heads: a local layer's cache is a ring of W latents
        pattern = resolve_layer_pattern(self, model)
        recurrent = " and ".join(f"{t} ({by_layer_type(t).title})" for t in recurrent_layer_types()
                                 if t in (pattern.get("layer_types") or ()) and not by_layer_type(t).beside_latent)
        check(not recurrent, "attention.type", self.type,
              f"mla beside {recurrent} layers is not built; use a K/V-head type")
        out = AttentionConfig(type="mla", num_kv_heads=1, mla_decode=self.mla_decode, **dims, **options, **pattern)
        check_mla_dims("attention", out)
        check_indexer("attention", out)
        return out._with_options_checked()

    def _with_options_checked(self) -> "AttentionConfig":
        """This resolved config, its layer options checked against its window (``every_position``)."""
        for option in LAYER_OPTIONS:
            value = getattr(self, option.key)
            check(not (option.every_position and value and self.window), f"attention.{option.key}", value,
                  f"{option.every_position}; with a window ({self.window}) it is not built (use attention.window=0)")
        return self


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
