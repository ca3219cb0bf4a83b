"""Gated DeltaNet layers: linear attention by the gated delta rule (Qwen3.5, Qwen3-Next's
``linear_attention`` layers), as transformers' Qwen3_5GatedDeltaNet.

A token's q and k (H_k heads of d_k) and v (H_v heads of d_v) pass a causal depthwise convolution
of ``linear_conv_kernel_dim`` taps; each value head then keeps a d_k x d_v state S, decayed by
exp(g_t) and corrected towards v_t at k_t with strength beta_t (the delta rule); the output reads
S at q_t. Value head j uses key head j // (H_v / H_k). Nothing is stored per position: a sequence
holds one :class:`~kvbench.layouts.base.State` per layer whatever its length (the state in
``cache.state_dtype``), so a decode step costs the same at any context.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Mapping, Optional

from kvbench.core.errors import check
from kvbench.core.hf_read import get
from kvbench.layouts.base import LayerLayout, State
from kvbench.layouts.kv_heads import KVHeads
from kvbench.layouts.recurrent import Recurrent
from kvbench.layouts.registry import LayerKind, register

CHUNK = 64  # a prompt's chunk of the delta rule: transformers' and flash-linear-attention's


@dataclass(frozen=True)
class GatedDeltaNet(Recurrent):
    """A Gated DeltaNet layer, fields as config.json names them (defaults: Qwen3_5TextConfig's);
    ``num_heads`` and ``head_dim``: the model's attention heads, for :meth:`as_mha`."""

    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    num_heads: int = 16
    head_dim: int = 256
    state_dtype: str = field(default="float32", kw_only=True)  # cache.state_dtype: the state's dtype

    kind = "gated_deltanet"
    title = "Gated DeltaNet"
    prefill_piece = CHUNK

    @property
    def key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def state(self) -> State:
        # the convolution runs over q, k and v before they split; it needs the last kernel - 1 inputs
        # (transformers keeps kernel: one column that no later step reads)
        return State(2 * self.key_dim + self.value_dim, self.linear_conv_kernel_dim - 1,
                     (self.linear_num_value_heads, self.linear_key_head_dim, self.linear_value_head_dim),
                     self.state_dtype)

    def step_flops(self, context: float) -> float:
        # per value head, whatever the context: decay S (d_k d_v), read k^T S, write the rank-1
        # correction k delta^T and read q^T S (a multiply-add per element each)
        return 7.0 * self.linear_num_value_heads * self.linear_key_head_dim * self.linear_value_head_dim

    def as_mha(self) -> LayerLayout:
        return KVHeads(None, self.num_heads, self.num_heads, self.head_dim)

    def shard(self, ranks: int) -> "GatedDeltaNet":
        # 1 / ranks of the value heads and of the key heads they read (value head h reads key head h // G)
        return replace(self, linear_num_key_heads=self.linear_num_key_heads // ranks,
                       linear_num_value_heads=self.linear_num_value_heads // ranks)

    def tensor_refusal(self, ranks: int) -> Optional[str]:
        heads = self.linear_num_key_heads
        return (f"its {heads} key heads split over ranks in whole heads only (each rank's value heads read its own); "
                f"use a divisor of {heads}") if heads % ranks else super().tensor_refusal(ranks)

    def fields(self) -> Dict[str, Any]:
        return {"linear_num_key_heads": self.linear_num_key_heads,
                "linear_num_value_heads": self.linear_num_value_heads,
                "linear_key_head_dim": self.linear_key_head_dim, "linear_value_head_dim": self.linear_value_head_dim,
                "linear_conv_kernel_dim": self.linear_conv_kernel_dim}


    # ---- how inspect describes it ----

    note = "a Gated DeltaNet layer holds a state per sequence"

    def in_words(self) -> str:
        """The layer's shape in config.json's words."""
        return (f"Gated DeltaNet ({self.linear_num_key_heads} key heads of {self.linear_key_head_dim}, "
                f"{self.linear_num_value_heads} value heads of {self.linear_value_head_dim}, conv kernel "
                f"{self.linear_conv_kernel_dim})")

    def describe_layers(self, layers, attention, seq_len: int, batch_size: int) -> List[str]:
        # no layer attends: the K/V-head line of the attention asked for, over none of them
        heads = KVHeads(None, self.num_heads, attention.num_kv_heads, self.head_dim)
        return heads.describe_layers(layers, attention, seq_len, batch_size)

    def memory_lines(self, layers, dtype: str, element: int) -> List[str]:
        return ["a Gated DeltaNet layer stores nothing per token: per sequence it holds its recurrent state "
                f"(value heads x d_k x d_v, {self.state_dtype}) and its convolution's last kernel - 1 inputs "
                "(compute dtype), whatever the length; per token counts the attention layers only"]


# ---- config.json ---------------------------------------------------------------------------

# Qwen3.5 and Qwen3.5-MoE (their text models, also as the language models of their multimodal
# checkpoints) and Qwen3-Next: Gated DeltaNet layers beside full attention whose output is gated and
# whose norms are zero-centred (transformers' Qwen3_5Attention, Qwen3_5RMSNorm, Qwen3NextAttention);
# their rope, defaults and experts: kvbench.config.hf
ARCHITECTURES = dict.fromkeys(("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration", "Qwen3NextForCausalLM",
                               "Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"),
                              {"qkv_bias": False, "qk_norm": True, "attn_output_gate": True,
                               "norm_zero_centered": True})
# Their config classes' defaults for the layers' keys a config.json may leave out (Qwen3_5TextConfig,
# Qwen3NextConfig), which are GatedDeltaNet's own defaults
HF_DEFAULTS = {"linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
               "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4}


def hf_fields(cfg: Mapping[str, Any], arch: str, keys: Dict[str, Any]) -> Dict[str, Any]:
    """The Gated DeltaNet layers' shape (ModelConfig's linear_* fields) from a Qwen3.5 / Qwen3-Next
    config.json, its class's defaults for keys it leaves out; each field's key is its own name."""
    shape = {key: get(cfg, key, "int", default) for key, default in HF_DEFAULTS.items()}
    keys.update({key: key for key in shape})
    return shape


# ---- the model's fields (model.linear_*) ----------------------------------------------------

def model_shape(model) -> Dict[str, int]:
    """The layers' linear_* fields of ``model`` (a ModelConfig), each null one derived: the ratios of
    Qwen3.5, whose heads of 256 have 16 key heads of 128 beside 16 query heads."""
    derived = {"linear_num_key_heads": model.num_heads, "linear_num_value_heads": 2 * model.num_heads,
               "linear_key_head_dim": model.head_dim // 2, "linear_value_head_dim": model.head_dim // 2,
               "linear_conv_kernel_dim": 4}
    return {k: d if getattr(model, k) is None else getattr(model, k) for k, d in derived.items()}


def check_model(model) -> None:
    """The linear_* fields of ``model`` as its layers would be built: counts, each key head serving a
    whole number of value heads; a refusal names the model.* key."""
    shape = model_shape(model)
    for key, value in shape.items():
        check(value >= 1, f"model.{key}", value, "must be >= 1")
    heads, value_heads = shape["linear_num_key_heads"], shape["linear_num_value_heads"]
    check(value_heads % heads == 0, "model.linear_num_value_heads", value_heads,
          f"must be a multiple of model.linear_num_key_heads={heads} (each key head serves the same number of "
          "value heads)")


def build(model, attention, window: Optional[int]) -> GatedDeltaNet:
    """A layer of ``model`` (a ModelConfig): its shape is the model's ``linear_*`` fields (no window)."""
    return GatedDeltaNet(None, **model_shape(model), num_heads=model.num_heads, head_dim=model.head_dim)


KIND = register(LayerKind(
    "gated_deltanet", GatedDeltaNet, module="kvbench.layouts.gated_deltanet_attention:GatedDeltaNetAttention",
    layer_types=("linear_attention",), recurrent=True, label="gdn", title="Gated DeltaNet",
    letters={"d": "full_attention_interval"}, build=build, check_model=check_model,
    unfuse="kvbench.layouts.gated_deltanet_attention:unfuse", architectures=ARCHITECTURES, hf_fields=hf_fields,
    examples={"gdn": ("model=tiny", "attention.layer_types=[linear_attention,full_attention]")}))
