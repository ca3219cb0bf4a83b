"""A transformers checkpoint's ``config.json``: the one reader of that file, and what it says
about the decoder's shape.

:func:`read_config_json` reads the file (bounded, regular files only); :func:`model_fields`
turns its contents into :class:`kvbench.model_config.ModelConfig` fields, refusing what the decoder
does not model (another architecture, MoE, multimodal, a short sliding window, other rope types)
with one line naming the key. ``ModelConfig.from_hf_config`` types those fields.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Mapping, Optional

from kvbench.config_errors import ConfigError
from kvbench.jsonio import read_json

CONFIG_FILE = "config.json"
# A config.json is a few kilobytes; anything far larger is not one.
MAX_CONFIG_BYTES = 16 * 2**20

# The transformers architectures whose config.json and tensor names the decoder reads, each with
# the switches its attention needs (ModelConfig fields). The one list: the loader, the refusals
# and the README's table of accepted architectures follow it. Every architecture also takes the
# rope types in ROPE_TYPES; everything else (MoE, multimodal, a sliding window shorter than the
# run, biases beyond q/k/v, other rope types) is refused naming its config.json key.
HF_ARCHITECTURES: Dict[str, Dict[str, bool]] = {
    "LlamaForCausalLM": {"qkv_bias": False, "qk_norm": False},   # Llama 2, 3, 3.1, 3.2, 3.3
    "MistralForCausalLM": {"qkv_bias": False, "qk_norm": False},
    "Qwen2ForCausalLM": {"qkv_bias": True, "qk_norm": False},    # Qwen2, Qwen2.5: biases on q, k, v
    "Qwen3ForCausalLM": {"qkv_bias": False, "qk_norm": True},    # Qwen3 (dense): RMSNorm on q, k per head
}
# model.rope_type: rotary frequencies as transformers' rope types of the same names compute them.
ROPE_TYPES = ("default", "linear", "llama3")


def read_config_json(directory: Path | str) -> Any:
    """The parsed ``config.json`` of the checkpoint ``directory`` (the one place it is read);
    OSError (missing, not a regular file) and ValueError (not JSON) pass through."""
    return read_json(Path(directory) / CONFIG_FILE, MAX_CONFIG_BYTES)


def tied_embeddings(cfg: Mapping[str, Any]) -> bool:
    """Whether the checkpoint's output head reuses its input embedding."""
    return bool(cfg.get("tie_word_embeddings"))


def model_fields(cfg: Mapping[str, Any], where: str = CONFIG_FILE, max_seq_len: Optional[int] = None) -> Dict[str, Any]:
    """The ModelConfig fields (untyped) that the config.json contents ``cfg`` describe; ``where``
    names the file. Raises :class:`ConfigError` for what the decoder does not model; a missing
    key is one too, naming it."""
    archs = cfg.get("architectures") or [cfg.get("model_type", "unknown")]
    arch = next((a for a in archs if a in HF_ARCHITECTURES), None)
    if arch is None:
        raise ConfigError(f"{where}: architectures={archs!r}: not supported "
                          f"(accepted: {', '.join(HF_ARCHITECTURES)})")
    switches = HF_ARCHITECTURES[arch]
    refused = {  # key: why, for a value that is set and not the default
        "attention_bias": None if switches["qkv_bias"] else "biases on q, k, v and o (only Qwen2's "
                                                             "q/k/v biases are modelled)",
        "mlp_bias": "the decoder's MLP has no biases",
        "text_config": "multimodal checkpoints are not supported",
        "vision_config": "multimodal checkpoints are not supported",
        "num_experts": "mixture-of-experts is not supported",
        "num_local_experts": "mixture-of-experts is not supported",
    }
    for key, why in refused.items():
        if why and cfg.get(key):
            raise ConfigError(f"{where}: {key}={cfg[key]!r}: {why}")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{where}: hidden_act={cfg['hidden_act']!r}: not supported (silu only)")
    positions = cfg.get("max_position_embeddings", 2048)
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
    layer_types = cfg.get("layer_types")  # transformers >= 5 lists each layer's kind
    if layer_types is not None and "sliding_attention" not in layer_types:
        window = None
    if window and window < (max_seq_len or positions):
        raise ConfigError(f"{where}: sliding_window={window}: not supported (the decoder attends to "
                          f"every earlier token); pass max_seq_len <= {window}")
    try:
        heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
        shape = dict(
            num_layers=cfg["num_hidden_layers"], d_model=hidden, num_heads=heads,
            preset_kv_heads=cfg.get("num_key_value_heads") or heads,
            # transformers' default; left to ModelConfig's checks when the values are not counts
            head_dim=cfg.get("head_dim") or (hidden // heads if _counts(hidden, heads) else None),
            ffn_dim=cfg["intermediate_size"], vocab_size=cfg["vocab_size"],
            max_seq_len=max_seq_len or positions,
            norm_eps=cfg.get("rms_norm_eps", 1e-6), **switches, **_hf_rope(cfg, positions))
    except KeyError as e:
        raise ConfigError(f"{where}: missing key {e.args[0]!r}") from None
    return {"name": cfg.get("_name_or_path") or Path(where).parent.name, **shape}


def _hf_rope(cfg: Mapping[str, Any], positions: Any) -> Dict[str, Any]:
    """ModelConfig's rope fields from a config.json: transformers >= 5 writes ``rope_parameters``
    (theta included), older versions ``rope_theta`` and ``rope_scaling`` (``type`` before 4.45).
    A rope type the decoder does not compute is refused naming the key."""
    key = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"
    rope = cfg.get(key) or {}
    if not isinstance(rope, Mapping):
        raise ConfigError(f"{key}={rope!r}: malformed (expected a JSON object)")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ConfigError(f"{key}.rope_type={rope_type!r}: not supported (accepted: {', '.join(ROPE_TYPES)})")
    for where, found in ((f"{key}.", rope), ("", cfg)):
        if found.get("partial_rotary_factor", 1.0) != 1.0:
            raise ConfigError(f"{where}partial_rotary_factor={found['partial_rotary_factor']!r}: not supported "
                              "(the decoder rotates every dimension)")
    out = {"rope_type": rope_type, "rope_theta": rope.get("rope_theta", cfg.get("rope_theta", 10000.0))}
    needed = {"linear": {"rope_factor": "factor"},
              "llama3": {"rope_factor": "factor", "rope_low_freq_factor": "low_freq_factor",
                         "rope_high_freq_factor": "high_freq_factor"}}.get(rope_type, {})
    for name, hf_name in needed.items():
        if hf_name not in rope:
            raise ConfigError(f"{key}.{hf_name}: missing (rope_type {rope_type!r} needs it)")
        out[name] = rope[hf_name]
    if rope_type == "llama3":  # transformers falls back to max_position_embeddings too
        out["rope_original_max_seq_len"] = rope.get("original_max_position_embeddings", positions)
    return out


def _counts(*values: Any) -> bool:
    return all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values)
