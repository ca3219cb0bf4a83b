"""Llama 4's language model (transformers' ``Llama4ForCausalLM``, ``Llama4TextConfig``) read whole from its
config.json: K/V-head layers whose local ones attend in chunks (``attention_chunk_size``: the layers
``layer_types`` calls chunked_attention, by default those with rotary embeddings), global layers without
rotary embeddings every ``no_rope_layer_interval`` (``no_rope_layers``' 0s) with their query temperature,
an L2 norm of the other layers' queries and keys (``use_qk_norm``: ``model.nope``,
:mod:`kvbench.config.nope`) and mixture-of-experts MLPs every ``interleave_moe_layer_step`` layers
(``moe_layers``): a shared expert beside routed experts chosen by a sigmoid of the top-k logits
(Llama4TextMoe), the token scaled by its weight going in. The other layers' MLP is a dense SwiGLU of
``intermediate_size_mlp``. Meta's published checkpoints are multimodal (``Llama4ForConditionalGeneration``):
their language model is read alike, from ``text_config`` and the tensors under ``language_model.``; the vision
model's and its projector's tensors are not read. Torch-free; registered with the K/V-heads kind, whose layers
these are.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Mapping, Optional

from kvbench.core.errors import ConfigError
from kvbench.core.hf_keys import text_model_fields, text_model_names
from kvbench.core.hf_read import REQUIRED, get

MULTIMODAL = "Llama4ForConditionalGeneration"  # Llama4ForCausalLM as its language_model, beside a vision model
ARCHITECTURES = ("Llama4ForCausalLM", MULTIMODAL)
# the multimodal checkpoint's language model's tensors (Llama4ForCausalLM's names under language_model.)
TEXT_MODEL = {"language_model.model.": "model.", "language_model.lm_head.": "lm_head."}
# Llama4TextConfig's defaults (Llama 4 Scout's shape) for the keys a config.json may leave out
DEFAULTS = {"vocab_size": 202048, "hidden_size": 5120, "intermediate_size": 8192, "intermediate_size_mlp": 16384,
            "num_hidden_layers": 48, "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128,
            "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "num_experts_per_tok": 1,
            "num_local_experts": 16, "interleave_moe_layer_step": 1, "no_rope_layer_interval": 4,
            "attention_chunk_size": 8192, "floor_scale": 8192, "attn_scale": 0.1}
ROPE_TYPES = ("default", "llama3")  # what the decoder computes of Llama 4's rope_parameters


def _count(cfg: Mapping[str, Any], key: str) -> int:
    value = get(cfg, key, "int", DEFAULTS[key])
    if value < 1:
        raise ConfigError(f"{key}={value!r}: must be >= 1")
    return value


def _layers(cfg: Mapping[str, Any], key: str, layers: int, default: List[int]) -> List[int]:
    """A list of 0/1 per layer (``no_rope_layers``) or of layer indices (``moe_layers``), checked."""
    value = get(cfg, key, "list", None)
    if value is None or (key == "no_rope_layers" and not value):  # transformers: an empty list is the default
        return default
    if key == "no_rope_layers":
        ok = len(value) >= layers and all(v in (0, 1) and not isinstance(v, bool) for v in value)
        why = f"must hold a 0 (no rotary) or 1 for each of the num_hidden_layers={layers} layers"
    else:
        ok = all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < layers for v in value)
        why = f"must list layer indices below num_hidden_layers={layers}"
    if not ok:
        raise ConfigError(f"{key}={value!r}: {why}")
    return list(value[:layers]) if key == "no_rope_layers" else sorted(set(value))


def _truth(cfg: Mapping[str, Any], key: str) -> bool:
    """A switch transformers reads by its truth: Llama 4 Scout's published config.json holds
    ``attn_temperature_tuning: 4``."""
    value = get(cfg, key, "number", True) if not isinstance(cfg.get(key), bool) else cfg[key]
    return bool(value)


def _rope(cfg: Mapping[str, Any], positions: int) -> Dict[str, Any]:
    """The decoder's rope fields of ``rope_parameters`` (transformers 5) or ``rope_scaling`` and ``rope_theta``."""
    key = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
    rope = get(cfg, key, "object", {})
    rope_type = get(rope, "rope_type", "str", None, f"{key}.") or get(rope, "type", "str", "default", f"{key}.")
    if rope_type not in ROPE_TYPES:
        raise ConfigError(f"{key}.rope_type={rope_type!r}: not supported for Llama 4 (accepted: "
                          f"{', '.join(ROPE_TYPES)})")
    theta = get(rope, "rope_theta", "number", None, f"{key}.") or get(cfg, "rope_theta", "number", 500000.0)
    out = {"rope_type": rope_type, "rope_theta": theta}
    if rope_type == "llama3":
        for field, name in (("rope_factor", "factor"), ("rope_low_freq_factor", "low_freq_factor"),
                            ("rope_high_freq_factor", "high_freq_factor")):
            out[field] = get(rope, name, "number", REQUIRED, f"{key}.")
        out["rope_original_max_seq_len"] = get(rope, "original_max_position_embeddings", "int", positions, f"{key}.")
    return out


def _experts(cfg: Mapping[str, Any], layers: int, moe_layers: List[int]) -> Optional[Dict[str, Any]]:
    """``model.moe`` of Llama4TextMoe on ``moe_layers`` (None without one): routed experts and a shared
    expert, each a SwiGLU of ``intermediate_size``."""
    if not moe_layers:
        return None
    width = _count(cfg, "intermediate_size")
    return {"num_experts": _count(cfg, "num_local_experts"), "top_k": _count(cfg, "num_experts_per_tok"),
            "expert_ffn_dim": width, "router": "sigmoid_topk", "weigh_inputs": True, "shared_ffn_dim": width,
            "dense_layers": [i for i in range(layers) if i not in moe_layers]}


def hf_model_fields(cfg: Mapping[str, Any], arch: str) -> Dict[str, Any]:
    """Every ModelConfig field of a Llama4ForCausalLM config.json (a multimodal one's ``text_config``), with
    Llama4TextConfig's defaults for absent keys; a value the decoder does not run refused in one line
    naming its key as the file holds it."""
    if arch == MULTIMODAL:
        return text_model_fields(_text_model_fields, cfg, arch)
    return _text_model_fields(cfg, arch)


def _text_model_fields(cfg: Mapping[str, Any], arch: str) -> Dict[str, Any]:
    act = get(cfg, "hidden_act", "str", "silu")
    if act != "silu":
        raise ConfigError(f"hidden_act={act!r}: not supported (silu only)")
    layers, heads = _count(cfg, "num_hidden_layers"), _count(cfg, "num_attention_heads")
    interval = _count(cfg, "no_rope_layer_interval")
    rope_layers = _layers(cfg, "no_rope_layers", layers, [int((i + 1) % interval != 0) for i in range(layers)])
    step = _count(cfg, "interleave_moe_layer_step")
    moe_layers = _layers(cfg, "moe_layers", layers, list(range(step - 1, layers, step)))
    chunk = get(cfg, "attention_chunk_size", "int", None)
    if chunk is not None and chunk < 1:
        raise ConfigError(f"attention_chunk_size={chunk!r}: must be >= 1 or null (no chunked layer)")
    types = get(cfg, "layer_types", "list", None)
    if types is None:  # Llama4TextConfig's: a layer with rotary embeddings is chunked when there is a chunk
        types = ["chunked_attention" if r and chunk is not None else "full_attention" for r in rope_layers]
    if len(types) != layers or not set(types) <= {"chunked_attention", "full_attention"} or \
            ("chunked_attention" in types and chunk is None):
        raise ConfigError(f"layer_types={types!r}: must name each of the num_hidden_layers={layers} layers "
                          "chunked_attention (with an attention_chunk_size) or full_attention")
    chunked = "chunked_attention" in types
    positions = _count(cfg, "max_position_embeddings")
    kv = get(cfg, "num_key_value_heads", "int", None) or heads
    if kv < 1 or heads % kv:
        raise ConfigError(f"num_key_value_heads={kv}: must divide num_attention_heads={heads}")
    bias = get(cfg, "attention_bias", "bool", False)
    nope = {"layers": [i for i, r in enumerate(rope_layers) if not r],
            "temperature_tuning": _truth(cfg, "attn_temperature_tuning"),
            "floor_scale": get(cfg, "floor_scale", "number", DEFAULTS["floor_scale"]),
            "attn_scale": get(cfg, "attn_scale", "number", DEFAULTS["attn_scale"]),
            "qk_l2_norm": get(cfg, "use_qk_norm", "bool", True)}
    return {"num_layers": layers, "d_model": _count(cfg, "hidden_size"), "num_heads": heads,
            "preset_kv_heads": kv,
            "head_dim": get(cfg, "head_dim", "int", None) or _count(cfg, "hidden_size") // heads,
            "ffn_dim": _count(cfg, "intermediate_size_mlp"), "vocab_size": _count(cfg, "vocab_size"),
            "max_seq_len": positions, "norm_eps": get(cfg, "rms_norm_eps", "number", DEFAULTS["rms_norm_eps"]),
            "qkv_bias": bias, "o_bias": bias, **_rope(cfg, positions),
            "preset_chunk": chunk if chunked else 0,
            # the chunked layers are the local ones of the run's pattern (kvbench.layouts.chunked)
            "preset_layer_types": ["sliding_attention" if t == "chunked_attention" else t for t in types]
            if chunked else None,
            "nope": nope if nope["layers"] or nope["qk_l2_norm"] else None,
            "moe": _experts(cfg, layers, moe_layers)}


def hf_names(cfg: Mapping[str, Any]) -> Callable[[str], Optional[str]]:
    """A Llama 4 checkpoint's tensor names in Llama's form: a layer's ``feed_forward`` is its ``mlp`` (the
    router's weight, the stacked experts and the shared expert below it keep their names); a multimodal
    checkpoint's language model's alike, its other tensors None (not read)."""
    text = text_model_names(TEXT_MODEL) if MULTIMODAL in (get(cfg, "architectures", "list", None) or ()) else None

    def renamed(name: str) -> Optional[str]:
        if text is not None and (name := text(name)) is None:
            return None
        parts = name.split(".", 4)  # model, layers, i, feed_forward, rest
        if len(parts) == 5 and parts[:2] == ["model", "layers"] and parts[3] == "feed_forward":
            return f"model.layers.{parts[2]}.mlp.{parts[4]}"
        return name
    return renamed
