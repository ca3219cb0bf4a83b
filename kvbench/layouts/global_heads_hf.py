"""Gemma 4's config.json (transformers' ``Gemma4ForCausalLM`` and ``Gemma4TextConfig``), read whole by
the global-heads kind (:mod:`kvbench.layouts.global_heads`): every ModelConfig field, with the config
class's defaults for absent keys, and its tensor names in Llama's form. Google publishes Gemma 4 multimodal
(``Gemma4ForConditionalGeneration``): its language model is read alike, from ``text_config`` and the
tensors under ``model.language_model.`` (the head at the top, tied by default); the vision and audio
towers' tensors and their embedders' are not read.

What it reads: sliding layers (``layer_types``; absent, every sixth layer global and the last one always,
as the class forces it) of ``head_dim`` and ``num_key_value_heads`` with default rotary embeddings of
their base; global layers of their own shape (``per_layer_config`` as save_pretrained writes it, else
``global_head_dim`` and, where keys are values, ``num_global_key_value_heads``) with their
rope_parameters (``proportional``: a fraction of the frequencies over the whole head); K=V
(``attention_k_eq_v``), KV sharing over the last ``num_kv_shared_layers`` layers, per-layer inputs
(``hidden_size_per_layer_input``), sandwich norms, layer scalars, the embedding times sqrt(hidden),
q/k/v norms, attention logits unscaled, GeGLU and the final logit soft-capping, and the mixture of
experts beside the dense MLP (``enable_moe_block``, 26B-A4B: :mod:`kvbench.mlp.beside`), the shared
layers' MLPs twice as wide (``use_double_wide_mlp``, E2B). Refused in one line naming the key: the two
together, bidirectional attention, per-layer overrides other than the global layers' heads, other rope
types.
"""

from __future__ import annotations

from dataclasses import MISSING, fields
from typing import Any, Callable, Dict, List, Mapping, Optional

from kvbench.core.errors import ConfigError
from kvbench.core.hf_keys import text_model_fields, text_model_names
from kvbench.core.hf_read import get
from kvbench.core.moe import MoEShape, check_moe

MULTIMODAL = "Gemma4ForConditionalGeneration"  # Gemma4TextModel as its language_model, beside vision and audio
ARCHITECTURES = ("Gemma4ForCausalLM", MULTIMODAL)
# the multimodal checkpoint's language model's tensors: Gemma4TextModel's under model.language_model.
TEXT_MODEL = {"model.language_model.": "model.", "lm_head.": "lm_head."}
SLIDING, FULL = "sliding_attention", "full_attention"
# Gemma4TextConfig's defaults for keys a config.json may leave out
DEFAULT_ROPE = {SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
                FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}}


def _count(cfg: Mapping[str, Any], key: str, default: Any) -> Any:
    value = get(cfg, key, "int", default)
    if value is not None and value < 1:
        raise ConfigError(f"{key}={value!r}: must be an integer >= 1")
    return value


def _layer_types(cfg: Mapping[str, Any], L: int) -> List[str]:
    """``layer_types`` as Gemma4TextConfig makes it: absent, five sliding layers to one full; the last
    layer full whatever it says (the class forces it, with a warning)."""
    types = get(cfg, "layer_types", "list", None)
    if types is None:
        types = [SLIDING if (i + 1) % 6 else FULL for i in range(L)]
    if len(types) != L or any(t not in (SLIDING, FULL) for t in types):
        raise ConfigError(f"layer_types={types!r}: must list {L} layers (num_hidden_layers), each {SLIDING} or {FULL}")
    return [*types[:-1], FULL]


def _rope(cfg: Mapping[str, Any]) -> Dict[str, Dict[str, Any]]:
    given = get(cfg, "rope_parameters", "object", None)
    rope = {t: dict(DEFAULT_ROPE[t] if given is None else given.get(t) or DEFAULT_ROPE[t]) for t in (SLIDING, FULL)}
    for t, params in rope.items():
        key = f"rope_parameters.{t}"
        kind = params.get("rope_type", "default")
        if kind not in ("default", "proportional") or (t == SLIDING and kind != "default"):
            raise ConfigError(f"{key}.rope_type={kind!r}: not supported (sliding layers: default; full: default or "
                              "proportional)")
        if params.get("factor", 1.0) != 1.0:
            raise ConfigError(f"{key}.factor={params['factor']!r}: a scaled proportional rope is not read (1.0 only)")
        params["rope_theta"] = get(params, "rope_theta", "number", DEFAULT_ROPE[t]["rope_theta"], f"{key}.")
        get(params, "partial_rotary_factor", "number", 1.0, f"{key}.")
    return rope


def _global_shape(cfg: Mapping[str, Any], types: List[str], k_eq_v: bool, rope: Mapping[str, Any]) -> Dict[str, Any]:
    """``model.layer_shapes.global_heads``: per_layer_config's (as save_pretrained writes it: the same
    head_dim and KV heads for every full layer, nothing for a sliding one), else the class's rule."""
    given = get(cfg, "per_layer_config", "object", None)
    if given is not None:
        shapes = []
        for index, overrides in given.items():
            key = f"per_layer_config.{index}"
            if not str(index).isdigit() or int(index) >= len(types) or types[int(index)] != FULL:
                raise ConfigError(f"{key}: only the full-attention layers' heads are read (layer {index} is not one)")
            extra = set(overrides or {}) - {"head_dim", "num_key_value_heads"}
            if extra:
                raise ConfigError(f"{key}.{sorted(extra)[0]}: not read (a global layer's head_dim and "
                                  "num_key_value_heads only)")
            shapes.append((overrides.get("head_dim"), overrides.get("num_key_value_heads")))
        if len(set(shapes)) > 1:
            raise ConfigError(f"per_layer_config: the full-attention layers' shapes differ ({sorted(set(shapes))}); "
                              "kvbench reads one global shape")
        head_dim, kv = shapes[0] if shapes else (None, None)
    else:
        head_dim = _count(cfg, "global_head_dim", 512)
        kv = _count(cfg, "num_global_key_value_heads", None) if k_eq_v else None
    full = rope[FULL]
    proportional = full.get("rope_type") == "proportional"
    return {"layers": [i for i, t in enumerate(types) if t == FULL], "head_dim": head_dim, "num_kv_heads": kv,
            "rope_theta": float(full["rope_theta"]),
            "partial_rotary_factor": float(full.get("partial_rotary_factor", 1.0)) if proportional else 1.0,
            "rope_type": "proportional" if proportional else "default"}


def hf_model_fields(cfg: Mapping[str, Any], arch: str) -> Dict[str, Any]:
    """Every ModelConfig field of a Gemma 4 text config.json (a multimodal one's ``text_config``); what
    the decoder does not run refused in one line naming its key as the file holds it."""
    if arch == MULTIMODAL:
        return text_model_fields(_text_model_fields, cfg, arch)
    return _text_model_fields(cfg, arch)


def _text_model_fields(cfg: Mapping[str, Any], arch: str) -> Dict[str, Any]:
    if cfg.get("use_bidirectional_attention") is not None:
        raise ConfigError(f"use_bidirectional_attention={cfg['use_bidirectional_attention']!r}: not supported "
                          "(Gemma 4's bidirectional attention is not read)")
    act = get(cfg, "hidden_activation", "str", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        raise ConfigError(f"hidden_activation={act!r}: not supported (gelu_pytorch_tanh only)")
    L, d = _count(cfg, "num_hidden_layers", 30), _count(cfg, "hidden_size", 2304)
    shared = get(cfg, "num_kv_shared_layers", "int", 0)
    wide = get(cfg, "use_double_wide_mlp", "bool", False) and bool(shared)  # the shared layers' MLP 2x wide (E2B)
    if wide and get(cfg, "enable_moe_block", "bool", False):
        raise ConfigError("use_double_wide_mlp=True: beside enable_moe_block=True not read (a shared layer's "
                          "experts beside a double-wide MLP)")
    types, rope = _layer_types(cfg, L), _rope(cfg)
    k_eq_v = get(cfg, "attention_k_eq_v", "bool", False)
    bias = get(cfg, "attention_bias", "bool", False)
    per_layer = get(cfg, "hidden_size_per_layer_input", "int", 256) or 0
    window = _count(cfg, "sliding_window", 512)
    return {**_moe(cfg), "num_layers": L, "d_model": d, "num_heads": _count(cfg, "num_attention_heads", 8),
            "preset_kv_heads": _count(cfg, "num_key_value_heads", 4), "head_dim": _count(cfg, "head_dim", 256),
            "ffn_dim": _count(cfg, "intermediate_size", 9216), "vocab_size": _count(cfg, "vocab_size", 262_144),
            "max_seq_len": _count(cfg, "max_position_embeddings", 131_072),
            "rope_theta": float(rope[SLIDING]["rope_theta"]), "norm_eps": get(cfg, "rms_norm_eps", "number", 1e-6),
            "qkv_bias": bias, "o_bias": bias, "qk_norm": True, "v_norm": True, "mlp_act": "gelu_tanh",
            "multipliers": {"attention_multiplier": 1.0},  # Gemma4TextAttention's scaling: 1.0
            "preset_window": window if SLIDING in types else None, "preset_layer_types": types,
            "preset_kv_shared_layers": shared, "preset_k_eq_v": int(k_eq_v),
            "layer_shapes": {"global_heads": _global_shape(cfg, types, k_eq_v, rope)},
            "residual": {"embed_scale": d ** 0.5, "post_norms": True, "layer_scalar": True,
                         "per_layer_input_dim": per_layer, "per_layer_vocab_size":
                             _count(cfg, "vocab_size_per_layer_input", 262_144) if per_layer else None,
                         "logit_softcap": get(cfg, "final_logit_softcapping", "number", None),
                         "shared_mlp_factor": 2 if wide else 1}}


def _moe(cfg: Mapping[str, Any]) -> Dict[str, Any]:
    """``model.moe`` of ``enable_moe_block`` (26B-A4B): on every layer, ``num_experts`` GeGLU experts of
    ``moe_intermediate_size`` beside the dense MLP, the top ``top_k_experts`` of a softmax renormalised
    (Gemma4TextRouter); {} without it."""
    if not get(cfg, "enable_moe_block", "bool", False):
        return {}
    keys = {"num_experts": "num_experts", "top_k": "top_k_experts", "expert_ffn_dim": "moe_intermediate_size"}
    moe = {field: _count(cfg, key, None) for field, key in keys.items()}
    for field, key in keys.items():
        if moe[field] is None:  # Gemma4TextConfig's default None builds no model
            raise ConfigError(f"{key}=None: enable_moe_block=True needs it (an integer >= 1)")
    moe.update(router="softmax", norm_topk_prob=True, beside_dense=True)
    check_moe({**{f.name: f.default for f in fields(MoEShape) if f.default is not MISSING}, **moe},
              {**{f.name: f.name for f in fields(MoEShape)}, **keys})
    return {"moe": moe}


# a layer's tensors where Gemma 4 names them otherwise than Llama (its post_attention_layernorm is a post-norm)
LAYER_NAMES = {"post_attention_layernorm.": "attn_post_norm.",
               "pre_feedforward_layernorm.": "post_attention_layernorm.",
               "post_feedforward_layernorm.": "mlp_post_norm.",
               "per_layer_input_gate.": "per_layer.gate.", "per_layer_projection.": "per_layer.project.",
               "post_per_layer_input_norm.": "per_layer.norm.",
               # enable_moe_block (kvbench.mlp.beside): the experts stacked as the decoder stacks them
               "post_feedforward_layernorm_1.": "mlp.dense_post_norm.", "pre_feedforward_layernorm_2.":
                   "mlp.experts_norm.", "post_feedforward_layernorm_2.": "mlp.experts_post_norm.",
               "router.proj.": "mlp.router.", "router.scale": "mlp.router_scale",
               "router.per_expert_scale": "mlp.per_expert_scale", "experts.gate_up_proj": "mlp.experts.w_gate_up",
               "experts.down_proj": "mlp.experts.w_down"}
MODEL_NAMES = {"model.embed_tokens_per_layer.": "per_layer.embed.", "model.per_layer_model_projection.":
               "per_layer.project.", "model.per_layer_projection_norm.": "per_layer.norm."}


def hf_names(cfg: Mapping[str, Any]) -> Callable[[str], Optional[str]]:
    """A Gemma 4 checkpoint's tensor names in Llama's form (:data:`LAYER_NAMES`, :data:`MODEL_NAMES`); a
    multimodal checkpoint's language model's alike, its other tensors None (not read)."""
    text = text_model_names(TEXT_MODEL) if MULTIMODAL in (get(cfg, "architectures", "list", None) or ()) else None

    def renamed(name: str) -> Optional[str]:
        if text is not None and (name := text(name)) is None:
            return None
        parts = name.split(".", 3)  # model, layers, i, rest
        names, head, rest = (LAYER_NAMES, ".".join(parts[:3]) + ".", parts[3]) \
            if len(parts) == 4 and parts[:2] == ["model", "layers"] else (MODEL_NAMES, "", name)
        for old, new in names.items():
            if rest.startswith(old):
                return head + new + rest[len(old):]
        return name
    return renamed
