"""Mamba-2 layers: a selective state space (SSD) per head, as the ``M`` layers of Nemotron-H
(transformers' NemotronHMamba2Mixer) and the mamba layers of Granite 4 (GraniteMoeHybridMambaLayer).

A token's x (H heads of P), B and C (G groups of N) pass a causal depthwise convolution of
``conv_kernel`` taps; each head then keeps a P x N state, decayed by exp(A dt) and written with
dt x B^T; the output reads the state at C, plus D x, gated and normalised. Head h uses group
h // (H / G). Nothing is stored per position: a sequence holds one :class:`~kvbench.layouts.base.State` per layer
whatever its length, the SSM state in its own dtype (float32 by default, config.json's
``mamba_ssm_cache_dtype``) and the convolution's last K - 1 inputs in the compute dtype.

Notation: H heads, P their width (head_dim), N the state size, G groups of B and C, K taps,
I = H P the inner width, conv channels I + 2 G N.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from kvbench.core.dtypes import DTYPE_BYTES
from kvbench.core.errors import ConfigError
from kvbench.layouts.base import LayerLayout, State
from kvbench.layouts.kv_heads import KVHeads
from kvbench.layouts.mamba2_shard import Mamba2Sharding
from kvbench.layouts.recurrent import Recurrent
from kvbench.layouts.registry import LayerKind, register

INF = float("inf")


@dataclass(frozen=True)
class Mamba2(Mamba2Sharding, Recurrent):
    """A Mamba-2 layer, fields as Nemotron-H's config.json names them (defaults: NemotronHConfig's);
    ``time_step_limit`` the bounds dt is clamped to in the chunked scan, ``conv_bias`` and
    ``proj_bias`` the biases of the convolution and of in_proj / out_proj; ``num_heads`` and
    ``head_dim``: the model's attention heads, for :meth:`as_mha`."""

    mamba_num_heads: int = 128
    mamba_head_dim: int = 64
    ssm_state_size: int = 128
    n_groups: int = 8
    conv_kernel: int = 4
    chunk_size: int = 128
    time_step_limit: Tuple[float, float] = (0.0, INF)
    conv_bias: bool = True
    proj_bias: bool = False
    state_dtype: str = "float32"
    num_heads: int = 32
    head_dim: int = 128
    group_ranks: int = 1  # tensor parallel: ranks each group is replicated on (its norm sums over them)

    kind = "mamba2"
    title = "Mamba-2"

    def __post_init__(self):
        # a layout built by hand (a test, a preset) is held to what a config.json is (mamba2_from_hf)
        for key in ("mamba_num_heads", "mamba_head_dim", "ssm_state_size", "n_groups", "conv_kernel", "chunk_size"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{key}={value!r}: must be a positive integer")
        if self.mamba_num_heads % self.n_groups:
            raise ConfigError(f"n_groups={self.n_groups!r}: must divide mamba_num_heads={self.mamba_num_heads} "
                              "(each group's B and C serve a whole number of heads)")
        if self.state_dtype not in DTYPE_BYTES:
            raise ConfigError(f"mamba_ssm_cache_dtype={self.state_dtype!r}: must be one of {', '.join(DTYPE_BYTES)}")
        low, high = self.time_step_limit
        if not (0 <= low < high):
            raise ConfigError(f"time_step_limit={list(self.time_step_limit)!r}: must be [low, high] with "
                              "0 <= low < high")

    @property
    def inner_dim(self) -> int:
        """I = H P: the width of x, of the gate z and of the scan's output."""
        return self.mamba_num_heads * self.mamba_head_dim

    @property
    def conv_channels(self) -> int:
        """What the convolution runs over: x, then B and C of every group."""
        return self.inner_dim + 2 * self.n_groups * self.ssm_state_size

    def mixer_params(self, d_model: int) -> int:
        """Parameters of the layer's mixer: in_proj (z, xBC, dt), the depthwise convolution, dt_bias,
        A_log and D per head, the gated norm's weight and out_proj (biases where the layout has them)."""
        projected = 2 * self.inner_dim + 2 * self.n_groups * self.ssm_state_size + self.mamba_num_heads
        return ((d_model + self.proj_bias) * projected + (self.conv_kernel + self.conv_bias) * self.conv_channels
                + 3 * self.mamba_num_heads + self.inner_dim + (self.inner_dim + self.proj_bias) * d_model)

    prefill_piece = property(lambda self: self.chunk_size)  # its scan's chunk

    @property
    def state(self) -> State:
        # the causal convolution needs the last kernel - 1 inputs (transformers keeps kernel: one
        # column that no later step reads)
        return State(self.conv_channels, self.conv_kernel - 1,
                        (self.mamba_num_heads, self.mamba_head_dim, self.ssm_state_size), self.state_dtype)

    def step_flops(self, context: float) -> float:
        # per head, whatever the context: decay the P x N state (a multiply per element), add the
        # outer product (dt x) B^T and read it at C (a multiply-add per element each); the
        # convolution, like the projections, is the model's
        return 5.0 * self.mamba_num_heads * self.mamba_head_dim * self.ssm_state_size

    def as_mha(self) -> LayerLayout:
        return KVHeads(None, self.num_heads, self.num_heads, self.head_dim)

    def fields(self) -> Dict[str, Any]:
        return {"mamba_num_heads": self.mamba_num_heads, "mamba_head_dim": self.mamba_head_dim,
                "ssm_state_size": self.ssm_state_size, "n_groups": self.n_groups, "conv_kernel": self.conv_kernel,
                **({} if self.state_dtype == "float32" else {"mamba_ssm_cache_dtype": self.state_dtype})}

    # ---- how inspect describes it ----

    note = "a Mamba-2 layer holds a state per sequence"

    def in_words(self) -> str:
        """The layer's shape in config.json's words."""
        return (f"Mamba-2 ({self.mamba_num_heads} heads of {self.mamba_head_dim}, state {self.ssm_state_size}, "
                f"{self.n_groups} groups, conv kernel {self.conv_kernel})")

    def describe_layers(self, layers, attention, seq_len: int, batch_size: int) -> List[str]:
        # no layer attends: the K/V-head line of the attention asked for, over none of them
        heads = KVHeads(None, self.num_heads, attention.num_kv_heads, self.head_dim)
        return heads.describe_layers(layers, attention, seq_len, batch_size)

    def memory_lines(self, layers, dtype: str, element: int) -> List[str]:
        return [f"a Mamba-2 layer stores nothing per token: per sequence it holds its SSM state (heads x head_dim x "
                f"state size, {self.state_dtype}) and its convolution's last kernel - 1 inputs of "
                "heads x head_dim + 2 x groups x state size channels (compute dtype), whatever the length; per "
                "token counts the attention layers only"]


# ---- config.json ---------------------------------------------------------------------------

# transformers' classes whose mamba layers this kind runs, and where their layers keep the mixer
HF_MODULES = {"NemotronHForCausalLM": "mixer", "GraniteMoeHybridForCausalLM": "mamba"}
# Nemotron-H's pattern letters (hybrid_override_pattern): M Mamba-2, * attention, - MLP, E experts
PATTERN = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
# layer_types as config.json writes them (older Granite files: mamba / attention), by kind
LAYER_TYPES = {"mamba": "mamba", "linear_attention": "mamba", "attention": "attention",
               "full_attention": "attention", "mlp": "mlp", "moe": "moe"}

# JSON types of the values read (a bool is not a number, as JSON says)
_KINDS = {"int": ((int,), "an integer"), "count": ((int,), "a positive integer"), "number": ((int, float), "a number"),
          "bool": ((bool,), "true or false"), "str": ((str,), "a string"), "list": ((list,), "a list"),
          "int or auto": ((int, str), 'an integer or "auto"')}


def _read(cfg: Mapping[str, Any], keys: Tuple[str, ...], kind: str, default: Any) -> Tuple[str, Any]:
    """``(key, value)`` of the first of ``keys`` set in ``cfg`` (Nemotron-H's older mamba_* names
    first: transformers' NemotronHConfig lets them win), checked to be ``kind`` (:data:`_KINDS`); ``default`` when
    none is set (or null)."""
    types, what = _KINDS[kind]
    for key in keys:
        value = cfg.get(key)
        if value is None:
            continue
        if not isinstance(value, types) or (kind != "bool" and isinstance(value, bool)) or \
                (kind == "int or auto" and isinstance(value, str) and value != "auto") or \
                (kind == "count" and value < 1):
            raise ConfigError(f"{key}={value!r}: must be {what}")
        return key, value
    return keys[0], default


def mamba2_from_hf(cfg: Mapping[str, Any], num_heads: int = 32, head_dim: int = 128) -> Mamba2:
    """The Mamba-2 layout of a NemotronH or GraniteMoeHybrid config.json, with these classes'
    defaults for absent keys; a value they cannot run refused in one line naming its key."""
    arch = next((a for a in cfg.get("architectures") or () if a in HF_MODULES), None)
    if arch is None:
        raise ConfigError(f"architectures={cfg.get('architectures')!r}: a Mamba-2 layer is read from one of "
                          f"{sorted(HF_MODULES)}")
    nemotron = arch == "NemotronHForCausalLM"
    if nemotron:
        act_key, act = _read(cfg, ("mamba_hidden_act",), "str", "silu")
        heads_key, H = _read(cfg, ("mamba_num_heads",), "count", 128)
        _, P = _read(cfg, ("mamba_head_dim",), "count", 64)
        _, N = _read(cfg, ("ssm_state_size",), "count", 128)
        groups_key, G = _read(cfg, ("mamba_n_groups", "n_groups"), "count", 8)
        _, K = _read(cfg, ("mamba_d_conv", "conv_kernel"), "count", 4)
        _, chunk = _read(cfg, ("mamba_chunk_size", "chunk_size"), "count", 128)
        _, conv_bias = _read(cfg, ("mamba_conv_bias", "use_conv_bias"), "bool", True)
        _, proj_bias = _read(cfg, ("use_bias",), "bool", False)  # NemotronHMamba2Mixer's in_proj and out_proj
        # the mixer clamps dt to [time_step_min, inf) and ignores time_step_limit
        limit_key, low = _read(cfg, ("mamba_dt_min", "time_step_min"), "number", 0.001)
        limit = (float(low), INF)
        dtype_key, dtype = _read(cfg, ("mamba_ssm_cache_dtype",), "str", "float32")
    else:
        act_key, act = _read(cfg, ("hidden_act",), "str", "silu")
        heads_key, H = _read(cfg, ("mamba_n_heads",), "count", 128)
        _, expand = _read(cfg, ("mamba_expand",), "count", 2)
        _, hidden = _read(cfg, ("hidden_size",), "count", 4096)
        key, P = _read(cfg, ("mamba_d_head",), "int or auto", "auto")
        if P == "auto":  # transformers' reading: the inner width over the heads
            P = expand * hidden // H
        if P < 1 or P * H != expand * hidden:
            raise ConfigError(f"{key}={P!r}: mamba_d_head x mamba_n_heads must be mamba_expand x hidden_size "
                              f"= {expand * hidden}")
        _, N = _read(cfg, ("mamba_d_state",), "count", 256)
        groups_key, G = _read(cfg, ("mamba_n_groups",), "count", 1)
        _, K = _read(cfg, ("mamba_d_conv",), "count", 4)
        _, chunk = _read(cfg, ("mamba_chunk_size",), "count", 256)
        _, conv_bias = _read(cfg, ("mamba_conv_bias",), "bool", True)
        _, proj_bias = _read(cfg, ("mamba_proj_bias",), "bool", False)
        limit_key, limit = _read(cfg, ("time_step_limit",), "list", [0.0, INF])
        # transformers writes an infinite float as {"__float__": "Infinity"} (JSON has none)
        limit = [float(v["__float__"]) if isinstance(v, Mapping) and v.get("__float__") == "Infinity" else v
                 for v in limit]
        if len(limit) != 2 or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in limit):
            raise ConfigError(f"{limit_key}={limit!r}: must be [low, high], two numbers")
        limit = (float(limit[0]), float(limit[1]))
        dtype_key, dtype = "mamba_ssm_cache_dtype", "float32"  # GraniteMoeHybrid keeps the state as its scan returns it
    if act not in ("silu", "swish"):
        raise ConfigError(f"{act_key}={act!r}: not supported in a Mamba-2 layer (silu only)")
    if H % G:
        raise ConfigError(f"{groups_key}={G!r}: must divide {heads_key}={H} (each group's B and C serve a whole "
                          "number of heads)")
    if not 0 <= limit[0] < limit[1]:
        raise ConfigError(f"{limit_key}={cfg.get(limit_key)!r}: the time step's bounds must be 0 <= low < high")
    if dtype not in DTYPE_BYTES:
        raise ConfigError(f"{dtype_key}={dtype!r}: must be one of {', '.join(DTYPE_BYTES)}")
    return Mamba2(None, mamba_num_heads=H, mamba_head_dim=P, ssm_state_size=N, n_groups=G, conv_kernel=K,
                  chunk_size=chunk, time_step_limit=limit, conv_bias=conv_bias, proj_bias=proj_bias,
                  state_dtype=dtype, num_heads=num_heads, head_dim=head_dim)

def hf_layer_kinds(cfg: Mapping[str, Any]) -> List[str]:
    """Each layer's kind in a NemotronH or GraniteMoeHybrid config.json: mamba | attention | mlp | moe
    (Nemotron-H gives a layer its mixer only; Granite's layers are mamba or attention, each with its MLP).
    transformers 5 names a mamba layer ``linear_attention``, as it does a Gated DeltaNet one: the
    architecture, not the layer type, says which."""
    pattern = cfg.get("hybrid_override_pattern")
    if pattern is not None:
        if not isinstance(pattern, str) or not pattern or set(pattern) - set(PATTERN):
            raise ConfigError(f"hybrid_override_pattern={pattern!r}: must be letters of {''.join(PATTERN)} "
                              "(M Mamba-2, * attention, - MLP, E experts)")
        return [PATTERN[c] for c in pattern]
    key, types = _read(cfg, ("layers_block_type", "layer_types"), "list", None)
    if types is None:  # GraniteMoeHybridConfig's default: every layer mamba
        _, n = _read(cfg, ("num_hidden_layers",), "int", 32)
        return ["mamba"] * n
    bad = next((t for t in types if t not in LAYER_TYPES), None)
    if bad is not None or not types:
        raise ConfigError(f"{key}={types!r}: each must be one of {sorted(LAYER_TYPES)}")
    return [LAYER_TYPES[t] for t in types]


# ---- the decoder: its layers' layout, a Nemotron-H checkpoint as kvbench's blocks -------------

SHAPE_KEY = "mamba2"  # model.layer_shapes' key: this kind's fields as Mamba2 names them


def build(model, attention=None, window=None) -> Mamba2:
    """The Mamba-2 layout of ``model``'s mamba layers (a ModelConfig; ``attention`` and the layer's window
    shape none of it): ``model.layer_shapes.mamba2`` (a checkpoint's, :func:`hf_model_fields`), each field
    it leaves out in proportion to the model (its heads, Granite's expand 2 over them, a state of head_dim
    in one group) or Mamba2's default; refused in one line naming ``model.layer_shapes.mamba2.<key>``."""
    prefix = f"model.layer_shapes.{SHAPE_KEY}."
    given = (model.layer_shapes or {}).get(SHAPE_KEY) or {}
    if not isinstance(given, Mapping):
        raise ConfigError(f"{prefix[:-1]}={given!r}: must be a mapping of Mamba-2 fields")
    known = [f for f in Mamba2.__dataclass_fields__ if f not in ("window", "num_heads", "head_dim", "group_ranks")]
    unknown = next((key for key in given if key not in known), None)
    if unknown is not None:
        raise ConfigError(f"{prefix}{unknown}={given[unknown]!r}: not a Mamba-2 field (one of {', '.join(known)})")
    shape = {"mamba_num_heads": model.num_heads, "mamba_head_dim": max(1, 2 * model.d_model // model.num_heads),
             "ssm_state_size": model.head_dim, "n_groups": 1, **given}
    if "time_step_limit" in given:  # [low, high], high null for no bound (a record holds no infinity)
        limit = given["time_step_limit"]
        if not isinstance(limit, (list, tuple)) or len(limit) != 2:
            raise ConfigError(f"{prefix}time_step_limit={limit!r}: must be [low, high] (high null: no bound)")
        shape["time_step_limit"] = (limit[0], INF if limit[1] is None else limit[1])
    try:
        return Mamba2(None, **shape, num_heads=model.num_heads, head_dim=model.head_dim)
    except ConfigError as exc:
        raise ConfigError(f"{prefix}{exc}") from None
    except TypeError as exc:  # a value of the wrong type in the arithmetic of a check
        raise ConfigError(f"{prefix[:-1]}={dict(given)!r}: malformed ({exc})") from None


def _blocks(cfg: Mapping[str, Any]) -> List[Tuple[int, Optional[int]]]:
    """Nemotron-H's layers (one mixer each, :func:`hf_layer_kinds`) as kvbench's blocks: (the layer of
    its mixer, the layer of the MLP that follows it or None). A block's pre-norm residual mixer then
    MLP is two Nemotron-H layers in a row, exactly."""
    kinds, blocks = hf_layer_kinds(cfg), []
    for j, kind in enumerate(kinds):
        if kind in ("mamba", "attention"):
            blocks.append((j, None))
            continue
        if not blocks or blocks[-1][1] is not None:
            letter = "E" if kind == "moe" else "-"
            raise ConfigError(f"hybrid_override_pattern={_pattern(kinds)!r}: layer {j} is an MLP ({letter}) that "
                              "follows no mixer layer (M or *); a block of an MLP alone is not built")
        blocks[-1] = (blocks[-1][0], j)
    return blocks


def _pattern(kinds: List[str]) -> str:
    letters = {kind: letter for letter, kind in PATTERN.items()}
    return "".join(letters[k] for k in kinds)


def _shape(layout: Mamba2) -> Dict[str, Any]:
    """``model.layer_shapes.mamba2`` of ``layout`` (what :func:`build` reads back)."""
    limit = layout.time_step_limit
    shape = {**layout.fields(), "chunk_size": layout.chunk_size, "conv_bias": layout.conv_bias,
             "proj_bias": layout.proj_bias, "time_step_limit": [limit[0], None if limit[1] == INF else limit[1]]}
    shape["state_dtype"] = shape.pop("mamba_ssm_cache_dtype", "float32")
    return shape


def hf_model_fields(cfg: Mapping[str, Any], arch: str) -> Dict[str, Any]:
    """Every ModelConfig field of a Nemotron-H or Granite 4 config.json (:func:`_granite_fields`), with
    its class's defaults for absent keys: Nemotron-H's mixers as blocks (:func:`_blocks`), the mamba
    layers' shape in ``layer_shapes``, its attention without rotary embeddings nor biases
    (NemotronHAttention has neither) and its ungated relu2 MLP. A value it cannot run refused in one
    line naming its key."""
    if arch == "GraniteMoeHybridForCausalLM":
        return _granite_fields(cfg)

    def get(keys: Tuple[str, ...], kind: str, default: Any) -> Any:
        return _read(cfg, keys, kind, default)[1]

    act = get(("mlp_hidden_act",), "str", "relu2")
    if act != "relu2":
        raise ConfigError(f"mlp_hidden_act={act!r}: not supported in a Nemotron-H MLP (relu2 only)")
    if get(("sliding_window",), "int", None) is not None:
        raise ConfigError(f"sliding_window={cfg['sliding_window']!r}: a window on Nemotron-H's attention is not read")
    blocks, kinds = _blocks(cfg), hf_layer_kinds(cfg)
    heads = get(("num_attention_heads",), "count", 32)
    shape = _shape(mamba2_from_hf(cfg, heads))
    return {"moe": _experts(cfg, blocks, kinds), "num_layers": len(blocks), "num_heads": heads,
            "d_model": get(("hidden_size",), "count", 4096),
            "preset_kv_heads": get(("num_key_value_heads",), "count", heads),
            "head_dim": get(("head_dim",), "count", 128), "ffn_dim": get(("intermediate_size",), "count", 21504),
            "vocab_size": get(("vocab_size",), "count", 131072),
            "max_seq_len": get(("max_position_embeddings",), "count", 4096),
            "norm_eps": get(("layer_norm_epsilon",), "number", 1e-5), "rope_type": "none", "mlp_act": "relu2",
            "mlp_bias": get(("mlp_bias",), "bool", False),
            "no_mlp_layers": [i for i, (_, mlp) in enumerate(blocks) if mlp is None] or None,
            "preset_layer_types": ["mamba" if kinds[mixer] == "mamba" else "full_attention" for mixer, _ in blocks],
            "layer_shapes": {SHAPE_KEY: shape}}


def _experts(cfg: Mapping[str, Any], blocks: List[Tuple[int, Optional[int]]], kinds: List[str]) -> Optional[Dict]:
    """``model.moe`` of Nemotron-H's E layers (NemotronHMoE: relu2 experts, the sigmoid router with its
    correction bias and groups, one relu2 shared expert): the blocks whose MLP is a - layer are its
    dense layers; None without an E layer."""
    if "moe" not in kinds:
        return None
    latent = cfg.get("moe_latent_size")
    if latent is not None:
        raise ConfigError(f"moe_latent_size={latent!r}: experts in a latent space (LatentMoE) are not built")

    def get(key: str, kind: str, default: Any) -> Any:
        return _read(cfg, (key,), kind, default)[1]

    return {"num_experts": get("n_routed_experts", "count", 8), "top_k": get("num_experts_per_tok", "count", 2),
            "expert_ffn_dim": get("moe_intermediate_size", "count", 7688), "router": "sigmoid",
            "norm_topk_prob": get("norm_topk_prob", "bool", True),
            "routed_scaling_factor": get("routed_scaling_factor", "number", 1.0),
            "n_group": get("n_group", "count", 1), "topk_group": get("topk_group", "count", 1),
            "shared_ffn_dim": get("moe_shared_expert_intermediate_size", "count", 7688),
            "dense_layers": [i for i, (_, mlp) in enumerate(blocks) if mlp is not None and kinds[mlp] == "mlp"]}


def _granite_fields(cfg: Mapping[str, Any]) -> Dict[str, Any]:
    """A dense Granite 4 (GraniteMoeHybrid, no routed experts): each layer a mamba or attention mixer
    and the shared MLP (gated SiLU, ``shared_intermediate_size`` wide), rotary embeddings only with
    ``position_embedding_type`` rope, and its multipliers (:class:`~kvbench.config.multipliers.Multipliers`)."""
    def get(keys: Tuple[str, ...], kind: str, default: Any) -> Any:
        return _read(cfg, keys, kind, default)[1]

    experts = get(("num_local_experts",), "int", 8)
    if experts:
        raise ConfigError(f"num_local_experts={experts!r}: Granite 4's routed experts are not built (a dense "
                          "Granite 4 has 0)")
    act = get(("hidden_act",), "str", "silu")
    if act != "silu":
        raise ConfigError(f"hidden_act={act!r}: not supported (silu only)")
    position = cfg.get("position_embedding_type")
    if position not in (None, "nope", "rope"):
        raise ConfigError(f"position_embedding_type={position!r}: must be rope, nope or null")
    rope = cfg.get("rope_parameters") or {}
    if position == "rope" and (not isinstance(rope, Mapping) or rope.get("rope_type", "default") != "default"):
        raise ConfigError(f"rope_parameters={rope!r}: only the default rope type is read for Granite 4")
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0)) if position == "rope" else 10000.0
    kinds = hf_layer_kinds(cfg)
    heads, hidden = get(("num_attention_heads",), "count", 32), get(("hidden_size",), "count", 4096)
    bias = get(("attention_bias",), "bool", False)
    scales = {key: get((key,), "number", 1.0) for key in ("embedding_multiplier", "residual_multiplier",
                                                            "attention_multiplier", "logits_scaling")}
    return {"num_layers": len(kinds), "d_model": hidden, "num_heads": heads,
            "preset_kv_heads": get(("num_key_value_heads",), "count", heads), "head_dim": hidden // heads,
            "ffn_dim": get(("shared_intermediate_size",), "count", 1024),
            "vocab_size": get(("vocab_size",), "count", 32000),
            "max_seq_len": get(("max_position_embeddings",), "count", 2048),
            "norm_eps": get(("rms_norm_eps",), "number", 1e-6), "qkv_bias": bias, "o_bias": bias,
            "rope_type": "default" if position == "rope" else "none", "rope_theta": theta, "multipliers": scales,
            "preset_layer_types": ["mamba" if k == "mamba" else "full_attention" for k in kinds],
            "layer_shapes": {SHAPE_KEY: _shape(mamba2_from_hf(cfg, heads, hidden // heads))}}


# Granite 4's names where they are not Llama's: its mamba module, its shared MLP's fused gate and up
GRANITE_NAMES = {"mamba.": "mixer.", "shared_mlp.input_linear.": "mlp.gate_up_proj.",
                 "shared_mlp.output_linear.": "mlp.down_proj."}


def hf_names(cfg: Mapping[str, Any]) -> Callable[[str], Optional[str]]:
    """A Nemotron-H checkpoint's tensor names (``backbone.`` or ``model.``) in Llama's form, by kvbench's
    blocks (:func:`_blocks`):
    a mixer's norm is its block's input_layernorm and its mixer the attention's ``self_attn`` or the
    mamba module's ``mixer``; the MLP after it, post_attention_layernorm and ``mlp``."""
    if "GraniteMoeHybridForCausalLM" in (cfg.get("architectures") or ()):
        return _granite_names
    kinds, where = hf_layer_kinds(cfg), {}
    for i, (mixer, mlp) in enumerate(_blocks(cfg)):
        where[mixer] = (i, "input_layernorm", "self_attn" if kinds[mixer] == "attention" else "mixer")
        if mlp is not None:
            where[mlp] = (i, "post_attention_layernorm", "mlp")
    top = {"embeddings.weight": "model.embed_tokens.weight", "norm_f.weight": "model.norm.weight"}

    def renamed(name: str) -> Optional[str]:
        # save_pretrained writes NVIDIA's names (backbone.*), transformers' modules are model.*
        name = "model." + name[len("backbone."):] if name.startswith("backbone.") else name
        parts = name.split(".", 4)  # model, layers, j, norm | mixer, rest
        if len(parts) < 4 or parts[:2] != ["model", "layers"] or not parts[2].isdigit() or int(parts[2]) not in where:
            return top.get(name[len("model."):], name) if name.startswith("model.") else name
        i, norm, module = where[int(parts[2])]
        if parts[3] == "norm":
            return f"model.layers.{i}.{norm}.{'.'.join(parts[4:])}"
        if parts[3] == "mixer":
            return f"model.layers.{i}.{module}.{'.'.join(parts[4:])}"
        return name
    return renamed


def _granite_names(name: str) -> str:
    """A Granite 4 tensor name in Llama's form (:data:`GRANITE_NAMES` below a layer)."""
    parts = name.split(".", 3)  # model, layers, i, rest
    if len(parts) == 4 and parts[:2] == ["model", "layers"]:
        for old, new in GRANITE_NAMES.items():
            if parts[3].startswith(old):
                return f"model.layers.{parts[2]}.{new}{parts[3][len(old):]}"
    return name


KIND = register(LayerKind(
    "mamba2", Mamba2, module="kvbench.layouts.mamba2_mixer:Mamba2Mixer", layer_types=("mamba",), recurrent=True,
    label="mamba2", title="Mamba-2", letters={"m": "full_attention_interval"}, build=build,
    hf_architectures=tuple(HF_MODULES), hf_model_fields=hf_model_fields, hf_names=hf_names,
    examples={"mamba2": ("model=tiny", "attention.layer_types=[mamba,full_attention]")}))
