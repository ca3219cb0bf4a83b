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
embeddings (:class:`~kvbench.layouts.latent.Latent` with ``rotary`` false).

Notation: H heads of d (linear_num_heads, linear_head_dim), K taps, conv channels 3 H d.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional

from kvbench.core.dtypes import DTYPE_BYTES
from kvbench.core.errors import ConfigError
from kvbench.layouts.base import LayerLayout, State
from kvbench.layouts.kv_heads import KVHeads
from kvbench.layouts.recurrent import Recurrent


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
