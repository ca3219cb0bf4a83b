"""What a record keeps of a job's model and attention: the fields a job uses, each as a record
written before the field existed reads it (absent means off)."""

from __future__ import annotations

from typing import Any, Dict

from kvbench.config.layer_options import LAYER_OPTIONS, PRESET_OPTIONS
from kvbench.config.layer_pattern import unused_pattern_keys
from kvbench.layouts.kinds import registered

# model keys left out of a record at these values, so it reads as one written before the key existed
MODEL_ABSENT_AS_BEFORE = {"norm_zero_centered": False, "attn_output_gate": False, "partial_rotary_factor": 1.0,
                          **{option.preset: option.off for option in PRESET_OPTIONS}, "moe": None, "o_bias": False,
                          "mlp_bias": False, "rope_truncate": True, "weights_stored": None, "v_norm": False,
                          "residual": None, "left_out": None,
                          **{f"linear_{k}": None for k in ("num_key_heads", "num_value_heads", "key_head_dim",
                                                           "value_head_dim", "conv_kernel_dim")}}


# cache keys likewise: a recurrent state held in float32 is what every record before cache.state_dtype held
CACHE_ABSENT_AS_BEFORE = {"state_dtype": "float32"}


def cache_record(cache: Dict[str, Any]) -> Dict[str, Any]:
    """The cache as a record keeps it (:data:`CACHE_ABSENT_AS_BEFORE` left out)."""
    return {k: v for k, v in cache.items() if k not in CACHE_ABSENT_AS_BEFORE or v != CACHE_ABSENT_AS_BEFORE[k]}


def model_record(model: Dict[str, Any]) -> Dict[str, Any]:
    """The model as a record keeps it (:data:`MODEL_ABSENT_AS_BEFORE` left out)."""
    return {k: v for k, v in model.items() if k not in MODEL_ABSENT_AS_BEFORE or v != MODEL_ABSENT_AS_BEFORE[k]}


def attention_record(attention: Dict[str, Any]) -> Dict[str, Any]:
    """The attention as a record keeps it: a kind's keys only when its type is the run's
    (``LayerKind.record_keys``), each layer option and the keys that come with it only when on, the
    layer pattern only where it says something (:func:`unused_pattern_keys`)."""
    unused = set()
    for kind in registered():
        if attention.get("type") not in kind.attention_types:
            unused.update(kind.record_keys)
    for option in LAYER_OPTIONS:  # an option off, or a recurrent layer's interval unused: as before they existed
        if not attention.get(option.key):
            unused.update((option.key, *option.with_keys))
    if attention.get("full_attention_interval") is None:
        unused.add("full_attention_interval")
    if attention.get("interval_type") is None:  # Gated DeltaNet's, as every record before the key
        unused.add("interval_type")
    unused.update(unused_pattern_keys(attention))
    return {k: v for k, v in attention.items() if k not in unused}
