"""Keys of a transformers ``config.json`` that say the same thing twice, and must agree.

A file may state a layer pattern in several keys: ``layer_types`` beside ``sliding_window``,
``use_sliding_window`` (Qwen2, Qwen3) or ``full_attention_interval`` (Qwen3.5, Qwen3-Next), a rope's
base both at the top and in ``rope_parameters``, a latent attention's ``head_dim`` beside its
``qk_rope_head_dim`` (DeepSeek). transformers reads one of each pair and ignores
the other, silently: a GPT-OSS file with ``sliding_window: 0`` beside a ``layer_types`` listing
sliding layers ran as all full attention. transformers derives one key of these pairs from the
other, so a file it wrote agrees with itself; a disagreement is an edited or hand-written file,
refused in one line naming both keys and their values (:func:`check_agreement`). Only keys the
file states are compared (one left out takes its class's default, which says nothing), and
``max_window_layers`` is not: transformers writes its class default (28) beside any
``layer_types`` it is given, and reads layer_types.
Imports nothing of kvbench's but its errors.
"""

from __future__ import annotations

from typing import Any, Collection, List, Mapping

from kvbench.core.errors import ConfigError

SLIDING, FULL, LINEAR = "sliding_attention", "full_attention", "linear_attention"  # transformers' names


def check_agreement(given: Mapping[str, Any], cfg: Mapping[str, Any], read: Collection[str], hybrid: bool) -> None:
    """Refuse two keys of the config.json contents ``given`` that disagree, as the architecture
    reads them: ``cfg`` is ``given`` with its class's defaults, ``read`` the window keys the
    architecture reads (:data:`kvbench.config.hf.WINDOW_KEYS_READ`), ``hybrid`` whether its
    ``layer_types`` names Gated DeltaNet layers (and ``full_attention_interval`` is read)."""
    types = given.get("layer_types") if "layer_types" in read or hybrid else None
    layers = given.get("num_hidden_layers")
    # a layer_types that is wrong on its own (an unknown kind, another length) is refused as such, by its reader
    if isinstance(types, list) and all(t in (SLIDING, FULL, LINEAR) for t in types) and (
            not _count(layers) or len(types) == layers):
        _check_window_keys(given, cfg, read, types)
        interval = given.get("full_attention_interval")
        if hybrid and _count(interval) and types != _interval_types(interval, len(types)):
            _refuse(f"full_attention_interval={interval}", types, f"it makes every {interval}th layer full_attention, "
                    "the others linear_attention (transformers reads layer_types and ignores it)")
    _check_rope_theta(given)
    rope, head = given.get("qk_rope_head_dim"), given.get("head_dim")
    if "kv_lora_rank" in given and _count(rope) and _count(head) and rope != head:
        # DeepSeek's latent attention: transformers sets head_dim to qk_rope_head_dim, whatever the file says
        raise ConfigError(f"head_dim={head} and qk_rope_head_dim={rope} disagree: a latent attention's head_dim is "
                          "its rotary width (transformers reads qk_rope_head_dim); give head_dim once, or alike")


def _check_window_keys(given: Mapping[str, Any], cfg: Mapping[str, Any], read: Collection[str],
                       types: List[str]) -> None:
    """layer_types against the keys that turn its sliding layers' window on or off."""
    sliding = [i for i, t in enumerate(types) if t == SLIDING]
    on = cfg.get("use_sliding_window", True) if "use_sliding_window" in read else True
    if sliding and on is False:
        stated = "" if "use_sliding_window" in given else " (its default)"
        _refuse(f"use_sliding_window=False{stated}", types, "with it transformers gives no layer a window (every "
                "layer full attention), while layer_types lists sliding_attention layers")
    window = cfg.get("sliding_window")
    if sliding and "sliding_window" in read and not window and "sliding_window" in given:
        _refuse(f"sliding_window={window!r}", types, "it gives the sliding_attention layers of layer_types no "
                "window (transformers then runs every layer as full attention)")


def _check_rope_theta(given: Mapping[str, Any]) -> None:
    """The rope's base at the top beside the one in ``rope_parameters`` (transformers >= 5 keeps the latter)."""
    for nested in ("rope_parameters", "rope_scaling"):
        rope = given.get(nested)
        for key in ("rope_theta", "partial_rotary_factor"):
            top, own = given.get(key), rope.get(key) if isinstance(rope, Mapping) else None
            if _number(top) and _number(own) and top != own:
                raise ConfigError(f"{key}={top!r} and {nested}.{key}={own!r} disagree: one model has one "
                                  f"{key} (transformers reads {nested}'s, silently); give it once")


def _refuse(key_value: str, types: List[str], why: str) -> None:
    raise ConfigError(f"{key_value} and layer_types={_summary(types)} disagree: {why}; give the layer pattern "
                      "once, or both alike")


def _summary(types: List[str]) -> str:
    """layer_types as one short value: the list when short, else its head and what it holds."""
    if len(types) <= 6:
        return repr(types)
    counts = ", ".join(f"{sum(t == k for t in types)} {k}" for k in (SLIDING, FULL, LINEAR) if k in types)
    return f"[{types[0]!r}, {types[1]!r}, ... {len(types)} layers: {counts}]"


def _interval_types(k: int, num_layers: int) -> List[str]:
    return [LINEAR if (i + 1) % k else FULL for i in range(num_layers)]


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
