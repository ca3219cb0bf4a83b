"""Kimi Delta Attention (KDA) layers: the gated delta rule with a decay per key channel, as the
``kda_layers`` of Kimi Linear (transformers' KimiLinearDeltaAttention).

A token's q, k and v (H heads of d each) pass a causal depthwise convolution of
``linear_conv_kernel_dim`` taps and SiLU; each head then keeps a d x d state S whose rows (key
channels) decay each by its own gate exp(g_t[c]), corrected towards v_t at k_t with strength beta_t
(the delta rule, as Gated DeltaNet's, whose decay is one scalar per head); the output reads S at
q_t, is RMS-normalised per head and gated. Nothing is stored per position: a sequence holds one
:class:`~kvbench.layouts.base.State` per layer whatever its length, the recurrent state in its own dtype (float32 by
default, as transformers keeps it) and the convolution's last K - 1 inputs in the compute dtype.

Kimi Linear's other layers (``full_attn_layers``) are multi-head latent attention without rotary
embeddings (:class:`~kvbench.layouts.latent.Latent`, which rotates nothing in a model whose
``rope_type`` is none). This home reads a Kimi Linear config.json whole (:func:`hf_model_fields`: the
KDA layers' shape, the latent layers', the DeepSeek-V3-like mixture of experts) and names its tensors
in Llama's form (:func:`hf_names`); ``attention.layer_types`` calls a KDA layer ``kda``
(transformers' ``linear_attention`` is Gated DeltaNet's here).

Notation: H heads of d (linear_num_heads, linear_head_dim), K taps, conv channels 3 H d.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from dataclasses import fields as dataclass_fields
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from kvbench.core.dtypes import DTYPE_BYTES
from kvbench.core.errors import ConfigError
from kvbench.core.hf_read import get
from kvbench.core.moe import check_moe
from kvbench.layouts.base import LayerLayout, State
from kvbench.layouts.kv_heads import KVHeads
from kvbench.layouts.recurrent import Recurrent
from kvbench.layouts.registry import LayerKind, register


@dataclass(frozen=True)
class KDA(Recurrent):
    """A KDA layer, fields as KimiLinearConfig names them (defaults: its own); ``chunk_size`` the
    chunk of a prompt's chunked delta rule (transformers' and flash-linear-attention's 64);
    ``gate_lower_bound`` the decay gate's lower bound where a model has one (flash-linear-attention's
    ``lower_bound``, Glm5Next's safe gate: g = bound x sigmoid(exp(A) x), so g > bound), None for
    Kimi Linear (g = -exp(A) softplus(x), unbounded below); ``num_heads``, ``head_dim`` and
    ``v_head_dim``: the model's attention heads, for :meth:`as_mha`."""

    linear_num_heads: int = 32
    linear_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    chunk_size: int = 64
    gate_lower_bound: Optional[float] = None
    state_dtype: str = "float32"
    num_heads: int = 32
    head_dim: int = 192
    v_head_dim: Optional[int] = 128

    kind = "kda"
    title = "KDA"

    def __post_init__(self):
        # a layout built by hand (a test, a preset) is held to what a config.json is (kda_from_hf)
        for key in ("linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim", "chunk_size"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{key}={value!r}: must be a positive integer")
        bound = self.gate_lower_bound
        if bound is not None and (isinstance(bound, bool) or not isinstance(bound, (int, float)) or
                                  not -math.inf < bound < 0):
            raise ConfigError(f"gate_lower_bound={bound!r}: must be a negative number (the least log decay per "
                              "step) or null")
        if self.state_dtype not in DTYPE_BYTES:
            raise ConfigError(f"state_dtype={self.state_dtype!r}: must be one of {', '.join(DTYPE_BYTES)}")

    @property
    def inner_dim(self) -> int:
        """H d: the width of q, k, v, of the decay gate and of the output gate."""
        return self.linear_num_heads * self.linear_head_dim

    @property
    def conv_channels(self) -> int:
        """What the convolution runs over: q, k and v."""
        return 3 * self.inner_dim

    def mixer_params(self, d_model: int) -> int:
        """Parameters of the layer's KDA module: q, k, v projections, the depthwise convolution, the
        decay gate (two low-rank projections through d, a bias per channel, A_log per head), beta's
        projection, the output gate (two low-rank projections through d), the norm's weight, o_proj."""
        inner, d, H = self.inner_dim, self.linear_head_dim, self.linear_num_heads
        return (3 * d_model * inner + self.linear_conv_kernel_dim * self.conv_channels
                + 2 * (d_model * d + d * inner) + inner + H + d_model * H + d + inner * d_model)

    prefill_piece = property(lambda self: self.chunk_size)  # its scan's chunk

    @property
    def state(self) -> State:
        # the causal convolution needs the last kernel - 1 inputs (transformers keeps kernel: one
        # column that no later step reads)
        d = self.linear_head_dim
        return State(self.conv_channels, self.linear_conv_kernel_dim - 1, (self.linear_num_heads, d, d),
                        self.state_dtype)

    def step_flops(self, context: float) -> float:
        # per head, whatever the context: decay S row by row (d x d multiplies), read k^T S, write the
        # rank-1 correction k delta^T and read q^T S (a multiply-add per element each); the
        # convolution, like the projections and gates, is the model's
        return 7.0 * self.linear_num_heads * self.linear_head_dim * self.linear_head_dim

    def as_mha(self) -> LayerLayout:
        return KVHeads(None, self.num_heads, self.num_heads, self.head_dim, v_head_dim=self.v_head_dim)

    def shard(self, ranks: int) -> "KDA":
        # 1 / ranks of the heads: q, k, v, their convolutions, both gates' up projections and the state
        # (the gates' down projections through d are every head's, whole on each rank)
        return replace(self, linear_num_heads=self.linear_num_heads // ranks)

    def fields(self) -> Dict[str, Any]:
        return {"linear_num_heads": self.linear_num_heads, "linear_head_dim": self.linear_head_dim,
                "linear_conv_kernel_dim": self.linear_conv_kernel_dim,
                **({} if self.gate_lower_bound is None else {"gate_lower_bound": self.gate_lower_bound}),
                **({} if self.state_dtype == "float32" else {"state_dtype": self.state_dtype})}


    # ---- how inspect describes it ----

    note = "a KDA layer holds a state per sequence"

    def in_words(self) -> str:
        """The layer's shape in config.json's words."""
        return (f"Kimi Delta Attention ({self.linear_num_heads} heads of {self.linear_head_dim}, conv kernel "
                f"{self.linear_conv_kernel_dim})")

    def describe_layers(self, layers, attention, seq_len: int, batch_size: int) -> List[str]:
        # no layer attends: the K/V-head line of the attention asked for, over none of them
        heads = KVHeads(None, self.num_heads, attention.num_kv_heads, self.head_dim, v_head_dim=self.v_head_dim)
        return heads.describe_layers(layers, attention, seq_len, batch_size)

    def memory_lines(self, layers, dtype: str, element: int) -> List[str]:
        return [f"a KDA layer stores nothing per token: per sequence it holds its recurrent state (heads x d x d, "
                f"{self.state_dtype}) and its convolution's last kernel - 1 inputs of q, k and v (3 x heads x d "
                "channels, compute dtype), whatever the length; per token counts the attention layers only"]


# ---- config.json ---------------------------------------------------------------------------

ARCHITECTURE = "KimiLinearForCausalLM"
# layer_types as KimiLinearConfig writes them, by kind (the full layers: MLA without rotary embeddings)
LAYER_TYPES = {"linear_attention": "kda", "full_attention": "attention"}
# linear_attn_config's names (a hub config.json's) of the fields KimiLinearConfig also reads from
# its own keys: the sub-dict wins where it has them
SUB_KEYS = {"head_dim": "linear_head_dim", "num_heads": "linear_num_heads",
            "short_conv_kernel_size": "linear_conv_kernel_dim"}


def _count(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{key}={value!r}: must be a positive integer")
    return value


def _linear_attn_config(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    sub = cfg.get("linear_attn_config")
    if sub is None:
        return {}
    if not isinstance(sub, Mapping):
        raise ConfigError(f"linear_attn_config={sub!r}: must be a mapping (head_dim, num_heads, "
                          "short_conv_kernel_size, kda_layers, full_attn_layers)")
    return sub


def _field(cfg: Mapping[str, Any], name: str, default: int) -> int:
    """KimiLinearConfig's reading of one size: linear_attn_config's ``name``, else its own key, else ``default``."""
    sub = _linear_attn_config(cfg)
    if sub.get(name) is not None:
        return _count(f"linear_attn_config.{name}", sub[name])
    key = SUB_KEYS[name]
    return default if cfg.get(key) is None else _count(key, cfg[key])


def kda_from_hf(cfg: Mapping[str, Any], state_dtype: str = "float32") -> KDA:
    """The KDA layout of a KimiLinearForCausalLM config.json, with KimiLinearConfig's defaults for
    absent keys (its linear_attn_config sub-dict, as a hub file writes it, before its own keys); a
    value it cannot run refused in one line naming its key. ``state_dtype``: the recurrent state's
    (config.json has no key for it; transformers keeps float32)."""
    if ARCHITECTURE not in (cfg.get("architectures") or ()):
        raise ConfigError(f"architectures={cfg.get('architectures')!r}: a KDA layer is read from {ARCHITECTURE}")
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):  # transformers runs the short convolution through hidden_act
        raise ConfigError(f"hidden_act={act!r}: not supported in a KDA layer (silu only)")
    # the full layers' heads (an MLA head: qk_nope_head_dim + qk_rope_head_dim, values v_head_dim), for as_mha
    nope, rope, v = (_count(key, default if cfg.get(key) is None else cfg[key])
                     for key, default in (("qk_nope_head_dim", 128), ("qk_rope_head_dim", 64), ("v_head_dim", 128)))
    return KDA(None, linear_num_heads=_field(cfg, "num_heads", 32), linear_head_dim=_field(cfg, "head_dim", 128),
               linear_conv_kernel_dim=_field(cfg, "short_conv_kernel_size", 4), state_dtype=state_dtype,
               num_heads=_count("num_attention_heads", cfg.get("num_attention_heads", 32)),
               head_dim=nope + rope, v_head_dim=v)


def hf_layer_kinds(cfg: Mapping[str, Any]) -> List[str]:
    """Each layer's kind in a KimiLinearForCausalLM config.json: kda | attention (MLA without rotary
    embeddings), read as KimiLinearConfig reads it: ``layer_types`` where given, else
    linear_attn_config's 1-indexed ``kda_layers`` and ``full_attn_layers``, else every fourth layer
    after the first full (0-indexed 4, 8, ...). Lists that number a layer twice, skip one or pass
    ``num_hidden_layers`` are refused naming the list (transformers would leave a layer untyped, or
    index from the end for a 0)."""
    n = _count("num_hidden_layers", cfg.get("num_hidden_layers", 27))
    types = cfg.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != n or any(t not in LAYER_TYPES for t in types):
            raise ConfigError(f"layer_types={types!r}: must be {n} (num_hidden_layers) of "
                              f"{' / '.join(LAYER_TYPES)}")
        return [LAYER_TYPES[t] for t in types]
    sub = _linear_attn_config(cfg)
    lists = {name: sub.get(name) for name in ("kda_layers", "full_attn_layers")}
    given = [name for name, value in lists.items() if value is not None]
    if not given:
        return ["attention" if i and i % 4 == 0 else "kda" for i in range(n)]
    if len(given) == 1:  # transformers would ignore the one list and type layers by its default pattern
        other = ({"kda_layers", "full_attn_layers"} - set(given)).pop()
        raise ConfigError(f"linear_attn_config.{given[0]}={lists[given[0]]!r}: given without {other} (name both, "
                          "1-indexed, or neither)")
    kinds: List[Optional[str]] = [None] * n
    for name in ("full_attn_layers", "kda_layers"):
        key, layers = f"linear_attn_config.{name}", lists[name]
        if not isinstance(layers, list):
            raise ConfigError(f"{key}={layers!r}: must be a list of layer numbers (1-indexed)")
        for layer in layers:
            if isinstance(layer, bool) or not isinstance(layer, int) or not 1 <= layer <= n:
                raise ConfigError(f"{key}={layers!r}: {layer!r} is not a layer number 1..{n} (num_hidden_layers; "
                                  "1-indexed)")
            if kinds[layer - 1] is not None:
                raise ConfigError(f"{key}={layers!r}: layer {layer} is " + (
                    "listed twice" if kinds[layer - 1] == name else f"also in {kinds[layer - 1]}"))
            kinds[layer - 1] = name
    missing = [i + 1 for i, kind in enumerate(kinds) if kind is None]
    if missing:
        raise ConfigError(f"linear_attn_config.kda_layers={lists['kda_layers']!r}: layers {missing} are in neither "
                          f"kda_layers nor full_attn_layers (each of the {n} layers, 1-indexed, in one)")
    return ["attention" if kind == "full_attn_layers" else "kda" for kind in kinds]


# ---- the decoder: a KDA layer's layout, a Kimi Linear config.json and checkpoint as kvbench's ----

LAYER_TYPE = "kda"  # attention.layer_types' name of a KDA layer
SHAPE_KEY = "kda"  # model.layer_shapes' key: the KDA fields a model's layers have
_OWN = ("window", "kv_source", "num_heads", "head_dim", "v_head_dim", "state_dtype")  # the model's, cache.state_dtype


def build(model, attention=None, window=None) -> KDA:
    """The KDA layout of ``model``'s KDA layers (a ModelConfig; ``attention`` and the layer's window
    shape none of it): ``model.layer_shapes.kda`` (a checkpoint's, :func:`hf_model_fields`), each
    field it leaves out as the model's heads (``linear_num_heads`` its num_heads, ``linear_head_dim``
    its head_dim) or KDA's default; the state in float32 (``cache.state_dtype`` sets another). Refused
    in one line naming ``model.layer_shapes.kda.<key>``."""
    prefix = f"model.layer_shapes.{SHAPE_KEY}."
    given = (model.layer_shapes or {}).get(SHAPE_KEY) or {}
    if not isinstance(given, Mapping):
        raise ConfigError(f"{prefix[:-1]}={given!r}: must be a mapping of KDA fields")
    known = [f.name for f in dataclass_fields(KDA) if f.name not in _OWN]  # fields(): not the class's ClassVars
    unknown = next((key for key in given if key not in known), None)
    if unknown is not None:
        raise ConfigError(f"{prefix}{unknown}={given[unknown]!r}: not a KDA field (one of {', '.join(known)})")
    # the full layers' heads, for as_mha: a latent's values have their own width, K/V heads over its shape do not
    mla = model.preset_mla if getattr(attention, "latent", True) else None
    shape = {"linear_num_heads": model.num_heads, "linear_head_dim": model.head_dim, **given}
    try:
        return KDA(None, **shape, num_heads=model.num_heads, head_dim=model.head_dim,
                   v_head_dim=mla.v_head_dim if mla is not None else None)
    except ConfigError as exc:
        raise ConfigError(f"{prefix}{exc}") from None
    except TypeError as exc:  # a value of the wrong type in the arithmetic of a check
        raise ConfigError(f"{prefix[:-1]}={dict(given)!r}: malformed ({exc})") from None


def _read(cfg: Mapping[str, Any], keys: Tuple[str, ...], kind: str, default: Any) -> Tuple[str, Any]:
    """``(key, value)`` of the first of ``keys`` set in ``cfg`` (Kimi's hub name first, then the
    attribute KimiLinearConfig maps it to), typed as :func:`~kvbench.core.hf_read.get` types it;
    ``default`` (under the first key) when none is set."""
    for key in keys:
        if cfg.get(key) is not None:
            return key, get(cfg, key, kind)
    return keys[0], default


def latent_fields(cfg: Mapping[str, Any]) -> Dict[str, int]:
    """The latent fields (``model.preset_mla``) of Kimi Linear's full layers, KimiLinearConfig's
    defaults for absent keys; what kvbench's latent attention cannot run refused naming its key."""
    if cfg.get("attention_bias"):  # KimiLinearAttention's kv_a_proj_with_mqa and o_proj would have biases
        raise ConfigError(f"attention_bias={cfg['attention_bias']!r}: a latent layer has no projection biases "
                          "(use false)")
    heads = _count("num_attention_heads", cfg.get("num_attention_heads", 32))
    kv_heads = cfg.get("num_key_value_heads")
    if kv_heads is not None and kv_heads != heads:
        # every head expands its own key from the latent: transformers' module fails on fewer K/V heads
        raise ConfigError(f"num_key_value_heads={kv_heads!r}: must equal num_attention_heads={heads} in a latent "
                          "layer (each head's key comes from the latent)")
    shape = {"q_lora_rank": 0 if cfg.get("q_lora_rank") is None else _count("q_lora_rank", cfg["q_lora_rank"])}
    for key, default in (("kv_lora_rank", 512), ("qk_nope_head_dim", 128), ("qk_rope_head_dim", 64),
                         ("v_head_dim", 128)):
        shape[key] = _count(key, default if cfg.get(key) is None else cfg[key])
    return shape


def _experts(cfg: Mapping[str, Any], n: int) -> Optional[Dict[str, Any]]:
    """``model.moe`` of Kimi Linear's sparse layers (KimiLinearMoE: DeepSeek-V3's sigmoid router with
    its correction bias and groups, ``num_shared_experts`` shared experts as one SwiGLU), the others
    dense, as KimiLinearConfig reads them: ``mlp_layer_types`` (dense | sparse), else the first
    ``first_k_dense_replace`` (1) layers dense; None when every layer is."""
    key, kinds = _read(cfg, ("mlp_layer_types",), "list", None)
    if kinds is None:
        _, first = _read(cfg, ("first_k_dense_replace",), "int", 1)
        kinds = ["dense" if i < first else "sparse" for i in range(n)]
    elif len(kinds) != n or any(k not in ("dense", "sparse") for k in kinds):
        raise ConfigError(f"{key}={kinds!r}: must name each of num_hidden_layers={n} layers dense or sparse")
    if "sparse" not in kinds:
        return None
    fields = {  # kvbench's field: (config.json's keys, hub name first; type; KimiLinearConfig's default)
        "num_experts": (("num_experts", "num_local_experts"), "int", 256),
        "top_k": (("num_experts_per_token", "num_experts_per_tok"), "int", 8),
        "expert_ffn_dim": (("moe_intermediate_size",), "int", 1024),
        "norm_topk_prob": (("moe_renormalize", "norm_topk_prob"), "bool", True),
        "routed_scaling_factor": (("routed_scaling_factor",), "number", 2.446),
        "n_group": (("num_expert_group", "n_group"), "int", 1), "topk_group": (("topk_group",), "int", 1),
        "shared": (("num_shared_experts", "n_shared_experts"), "int", 1)}
    read = {name: _read(cfg, keys, kind, default) for name, (keys, kind, default) in fields.items()}
    moe = {name: value for name, (_, value) in read.items()}
    keys = {name: key for name, (key, _) in read.items()}
    shared, shared_key = moe.pop("shared"), keys.pop("shared")
    if shared < 0:
        raise ConfigError(f"{shared_key}={shared!r}: must be >= 0")
    moe.update(router="sigmoid", shared_ffn_dim=moe["expert_ffn_dim"] * shared, shared_gate=False, swiglu_limit=None,
               dense_layers=[i for i, k in enumerate(kinds) if k == "dense"])
    # transformers' router is the sigmoid whatever the file says (moe_router_activation_func is not read)
    check_moe(moe, {**keys, "router": "moe_router_activation_func", "shared_ffn_dim": shared_key,
                    "shared_gate": shared_key, "swiglu_limit": "swiglu_limit", "dense_layers": key})
    return moe


def hf_model_fields(cfg: Mapping[str, Any], arch: str) -> Dict[str, Any]:
    """Every ModelConfig field of a Kimi Linear config.json (KimiLinearConfig's defaults for absent
    keys, its hub names first: ``model_max_length``, ``num_experts_per_token`` …): KDA layers
    (``layer_shapes.kda``) beside latent layers without rotary embeddings (``preset_mla``,
    ``rope_type`` none: positions enter through the KDA layers only), each typed by
    :func:`hf_layer_kinds`, and the mixture of experts (:func:`_experts`). A value it cannot run
    refused in one line naming its key."""
    kda = kda_from_hf(cfg)
    kinds, mla = hf_layer_kinds(cfg), latent_fields(cfg)
    _, hidden = _read(cfg, ("hidden_size",), "int", 2304)
    shape = {"linear_num_heads": kda.linear_num_heads, "linear_head_dim": kda.linear_head_dim,
             "linear_conv_kernel_dim": kda.linear_conv_kernel_dim}
    return {"num_layers": len(kinds), "d_model": hidden, "num_heads": kda.num_heads, "preset_kv_heads": kda.num_heads,
            "head_dim": mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"],
            "ffn_dim": _read(cfg, ("intermediate_size",), "int", 9216)[1],
            "vocab_size": _read(cfg, ("vocab_size",), "int", 163840)[1],
            "max_seq_len": _read(cfg, ("model_max_length", "max_position_embeddings"), "int", 1048576)[1],
            "norm_eps": _read(cfg, ("rms_norm_eps",), "number", 1e-5)[1], "rope_type": "none", "preset_mla": mla,
            "preset_layer_types": [LAYER_TYPE if k == "kda" else "full_attention" for k in kinds],
            "layer_shapes": {SHAPE_KEY: shape}, "moe": _experts(cfg, len(kinds))}


# Kimi's names where they are not Llama's: the MLP of every layer (dense or not) under block_sparse_moe,
# an expert's gate, down and up as w1, w2, w3
_EXPERT = re.compile(r"(model\.layers\.\d+\.)block_sparse_moe\.(?:(experts\.\d+\.)(w[123])(\..*)|(.*))")
_EXPERT_NAMES = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}


def hf_names(cfg: Mapping[str, Any]) -> Callable[[str], Optional[str]]:
    """A Kimi Linear checkpoint's tensor names in Llama's form: ``block_sparse_moe.`` as ``mlp.``, an
    expert's w1 / w2 / w3 as its gate_proj / down_proj / up_proj (the KDA module's own names: its
    ``HF_NAMES``)."""
    def renamed(name: str) -> str:
        match = _EXPERT.fullmatch(name)
        if match is None:
            return name
        layer, expert, w, rest, other = match.groups()
        return f"{layer}mlp.{expert}{_EXPERT_NAMES[w]}{rest}" if expert else f"{layer}mlp.{other}"
    return renamed


KIND = register(LayerKind(
    "kda", KDA, module="kvbench.layouts.kda_mixer:KDAAttention", layer_types=(LAYER_TYPE,), recurrent=True,
    label="kda", title="KDA", letters={"a": "full_attention_interval"}, build=build,
    unfuse="kvbench.layouts.kda_mixer:unfuse", hf_architectures=(ARCHITECTURE,), hf_model_fields=hf_model_fields,
    hf_names=hf_names, beside_latent=True,
    # Kimi Linear's form: KDA beside latent layers (beside K/V heads: tests/workloads/test_kda_tasks.py)
    examples={"kimi": ("model=tiny", "attention=mla", "attention.layer_types=[kda,full_attention]")}))
