"""A transformers checkpoint's ``config.json``: the one reader of that file, and what it says about the
decoder's shape.

:func:`read_config_json` reads the file (bounded, regular files only); :func:`model_fields` turns its
contents into :class:`kvbench.config.model.ModelConfig` fields, refusing what the decoder does not model
(another architecture, multimodal, other rope types) in one line naming the key; a mixture of experts
becomes ``model.moe`` (:func:`_hf_moe`), a sliding window the model's own window pattern
(``preset_window``, ``preset_layer_types``); a layer kind's home reads its own keys in its
architectures' files (``LayerKind.hf_fields``), or the whole file of a model that is not Llama-form
(``hf_model_fields``). Each value is checked against its JSON type where it is read (:func:`_get`):
OmegaConf, which types the fields afterwards, would convert ``"32"`` silently and name only its own key.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Tuple

from kvbench.config.hf_agree import LINEAR, check_agreement
from kvbench.config.quant import weights_stored
from kvbench.core.errors import ConfigError
from kvbench.core.hf_keys import DEFAULT, TEXT_CONFIG, Source, file_sources, is_set, nested_keys
from kvbench.core.hf_read import REQUIRED as _REQUIRED
from kvbench.core.hf_read import get as _get
from kvbench.core.moe import EXPERTS_KEY, check_moe
from kvbench.jsonio import read_json
from kvbench.layouts.kinds import by_architecture, by_layer_type, registered
from kvbench.layouts.latent import rope_interleaved  # noqa: F401  (the loader's, read through this module)

CONFIG_FILE = "config.json"
# A config.json is a few kilobytes; anything far larger is not one.
MAX_CONFIG_BYTES = 16 * 2**20

# The transformers architectures whose config.json and tensor names the decoder reads, each with the switches
# its attention needs (ModelConfig fields). The one list: the loader, the refusals and the README's table of
# accepted architectures follow it. Every architecture also takes the rope types in ROPE_TYPES and sliding
# windows (as WINDOW_KEYS_READ says); everything else (other MoE such as Mixtral, multimodal, biases beyond
# q/k/v, other rope types) is refused naming its config.json key.
HF_ARCHITECTURES: Dict[str, Dict[str, Any]] = {
    "LlamaForCausalLM": {"qkv_bias": False, "qk_norm": False},   # Llama 2, 3, 3.1, 3.2, 3.3
    "MistralForCausalLM": {"qkv_bias": False, "qk_norm": False},
    "Qwen2ForCausalLM": {"qkv_bias": True, "qk_norm": False},    # Qwen2, Qwen2.5: biases on q, k, v
    "Qwen3ForCausalLM": {"qkv_bias": False, "qk_norm": True},    # Qwen3 (dense): RMSNorm on q, k per head
}
# Each layer kind's own architectures (LayerKind.architectures, with the switches their attention
# needs), whose layers of that kind its hf_fields reads: DeepSeek-V2/V3/V3.2's latent attention, the
# Qwen3.5 / Qwen3-Next hybrids' recurrent layers; their mixtures of experts: MOE_FAMILIES.
HF_ARCHITECTURES.update({arch: dict(switches) for kind in registered()
                         for arch, switches in kind.architectures.items()})
# The Qwen3.5 family (also as the language models of their multimodal checkpoints): the architectures
# whose layer_types names linear_attention layers, beside attention whose rotary embeddings turn part of a head.
HYBRID_ARCHITECTURES = tuple(by_layer_type(LINEAR).architectures)
# Their config classes' defaults for keys a config.json may leave out (Qwen3_5TextConfig, Qwen3NextConfig;
# their recurrent layers' own: the kind's hf_fields).
HYBRID_DEFAULTS = {"head_dim": 256, "partial_rotary_factor": 0.25, "full_attention_interval": 4}
ATTENTION_BIAS = ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "GptOssForCausalLM",
                  *HYBRID_ARCHITECTURES)  # their attention_bias: a bias on each of q, k, v and o
# A multimodal checkpoint's language model: its keys in text_config, its tensors under this prefix.
TEXT_MODEL_PREFIX = dict.fromkeys(("Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration"),
                                  "model.language_model.")
# Tensors transformers' causal LM leaves unread: a multi-token-prediction head, a vision tower.
UNREAD_TENSORS = {arch: ("mtp.", "model.visual.") for arch in HYBRID_ARCHITECTURES}
# Mixture-of-experts architectures (whose MLPs _hf_moe reads) and their routing; GPT-OSS also has
# biases on q, k, v and o (attention_bias) and learned sinks in every layer.
HF_ARCHITECTURES.update({"Qwen3MoeForCausalLM": {"qkv_bias": False, "qk_norm": True},
                         "GptOssForCausalLM": {"qkv_bias": True, "qk_norm": False}})
MOE_FAMILIES = {"Qwen3MoeForCausalLM": "qwen", "Qwen3NextForCausalLM": "qwen_shared",
                "Qwen3_5MoeForCausalLM": "qwen3_5", "Qwen3_5MoeForConditionalGeneration": "qwen3_5",
                "DeepseekV2ForCausalLM": "deepseek_v2",
                "DeepseekV3ForCausalLM": "deepseek_v3", "DeepseekV32ForCausalLM": "deepseek_v3",
                "GptOssForCausalLM": "gpt_oss"}
# model.rope_type: rotary frequencies as transformers' rope types of the same names compute them.
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# Their config classes' defaults for keys a config.json may leave out, where they are not kvbench's own:
# absent, transformers reads these. rope_parameters: when neither it nor rope_scaling is set.
_QWEN_WINDOW = {"use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28}
CLASS_DEFAULTS: Dict[str, Dict[str, Any]] = {
    "MistralForCausalLM": {"sliding_window": 4096},
    "Qwen2ForCausalLM": _QWEN_WINDOW, "Qwen3ForCausalLM": {**_QWEN_WINDOW, "head_dim": 128},
    "Qwen3MoeForCausalLM": {"use_sliding_window": False, "sliding_window": 4096},
    "GptOssForCausalLM": {"head_dim": 64, "sliding_window": 128, "rms_norm_eps": 1e-5, "rope_theta": 150000.0,
                          "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                              "truncate": False, "original_max_position_embeddings": 4096}},
}
# The window keys each architecture's transformers class reads; it ignores the others, so kvbench
# does too (Llama: none; Mistral: sliding_window on every layer, or on layer_types' sliding layers,
# as transformers' AutoConfig reads such a file: as Ministral's; Qwen3-MoE: on every layer when
# use_sliding_window; GPT-OSS: on layer_types' sliding layers, which alternate when it is absent).
WINDOW_KEYS = ("sliding_window", "use_sliding_window", "layer_types", "max_window_layers")
WINDOW_KEYS_READ = {"LlamaForCausalLM": (), "MistralForCausalLM": ("sliding_window", "layer_types"),
                    "Qwen2ForCausalLM": WINDOW_KEYS, "Qwen3ForCausalLM": WINDOW_KEYS,
                    "Qwen3MoeForCausalLM": ("sliding_window", "use_sliding_window"),
                    "GptOssForCausalLM": ("sliding_window", "layer_types"),
                    # DeepSeek's configs have no window; the Gated DeltaNet hybrids' layer_types names linear layers
                    **dict.fromkeys(("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM"), ()),
                    **{arch: ("layer_types",) for arch in HYBRID_ARCHITECTURES}}


def checkpoint_architecture(cfg: Mapping[str, Any]) -> Optional[str]:
    """The class of :data:`HF_ARCHITECTURES` a config.json names (None: none of them)."""
    return next((a for a in _get(cfg, "architectures", "list", []) if a in HF_ARCHITECTURES), None)


def architecture(cfg: Mapping[str, Any]) -> str:
    """The class of :data:`HF_ARCHITECTURES` a config.json names, with its ``model_type``
    (``DeepseekV3ForCausalLM (model_type deepseek_v3)``): what an error about its tensors names."""
    archs = _get(cfg, "architectures", "list", [])
    arch = next((a for a in archs if a in HF_ARCHITECTURES), archs[0] if archs else "unknown architecture")
    model_type = cfg.get("model_type")
    return f"{arch} (model_type {model_type})" if isinstance(model_type, str) else str(arch)


def read_config_json(directory: Path | str) -> Any:
    """The parsed ``config.json`` of the checkpoint ``directory`` (the one place it is read);
    OSError (missing, not a regular file) and ValueError (not JSON) pass through."""
    return read_json(Path(directory) / CONFIG_FILE, MAX_CONFIG_BYTES)


def tied_embeddings(cfg: Mapping[str, Any]) -> bool:
    """Whether the checkpoint's output head reuses its input embedding (a file without the key: its
    class's default as transformers reads it, false but where a whole-file reader's kind says tied)."""
    archs = cfg.get("architectures")
    kind = next((k for a in archs if (k := by_architecture(a))), None) if isinstance(archs, list) else None
    return _get(cfg, "tie_word_embeddings", "bool", bool(kind and kind.hf_tied))


def model_fields(cfg: Mapping[str, Any], where: str = CONFIG_FILE,
                 max_seq_len: Optional[int] = None) -> Tuple[Dict[str, Any], Dict[str, Source]]:
    """The ModelConfig fields (untyped) that the config.json contents ``cfg`` describe, and the key
    each came from (:class:`~kvbench.core.hf_keys.Source`; none for a ``max_seq_len`` given: the
    caller's); ``where`` names the file. What the decoder does not model, or a missing key: ConfigError."""
    archs = _get(cfg, "architectures", "list") or [_get(cfg, "model_type", "str", "unknown")]
    arch = next((a for a in archs if a in HF_ARCHITECTURES or by_architecture(a)), None)
    if arch is None:
        accepted = [*HF_ARCHITECTURES, *(a for kind in registered() for a in kind.hf_architectures)]
        raise ConfigError(f"{where}: architectures={archs!r}: not supported (accepted: {', '.join(accepted)})")
    if arch not in HF_ARCHITECTURES:  # a layer kind's home reads the whole file (LayerKind.hf_model_fields)
        capped = {"max_seq_len": max_seq_len} if max_seq_len else {}  # the rotary table's rows, as below
        fields = {**by_architecture(arch).hf_model_fields(cfg, arch), **capped, "weights_stored": weights_stored(cfg)}
        return fields, _whole_file_sources(cfg, {k: v for k, v in fields.items() if k not in capped})
    if arch not in TEXT_MODEL_PREFIX:
        return _text_fields(cfg, arch, where, max_seq_len, "")
    # a multimodal checkpoint's language model, its keys named where they are; its tying and weights' format the top's
    top = {"architectures": archs, **{k: cfg.get(k) for k in ("tie_word_embeddings", "quantization_config")}}
    try:
        return _text_fields({**_get(cfg, "text_config", "object", _REQUIRED), **top}, arch, where, max_seq_len,
                            "text_config.")
    except ConfigError as exc:
        head = f"{where}: " * str(exc).startswith(f"{where}: ")
        raise ConfigError(head + nested_keys(str(exc)[len(head):], "text_config.", top)) from None


# The keys a whole-file reader's ModelConfig fields may come from, the most specific first (Llama 4's dense
# MLP, Granite's shared one; Nemotron-H's norm; a rope base in rope_parameters, Gemma 4's sliding layers').
WHOLE_FILE_KEYS = {
    "num_layers": ("num_hidden_layers",), "d_model": ("hidden_size",), "num_heads": ("num_attention_heads",),
    "preset_kv_heads": ("num_key_value_heads",), "head_dim": ("head_dim",),
    "ffn_dim": ("intermediate_size_mlp", "shared_intermediate_size", "intermediate_size"),
    "vocab_size": ("vocab_size",), "max_seq_len": ("max_position_embeddings",),
    "norm_eps": ("rms_norm_eps", "layer_norm_epsilon"),
    "rope_theta": ("rope_parameters.rope_theta", "rope_parameters.sliding_attention.rope_theta", "rope_theta")}


def _whole_file_sources(cfg: Mapping[str, Any], fields: Mapping[str, Any]) -> Dict[str, Source]:
    """Where a whole-file reader's ``fields`` are in the config.json contents ``cfg`` (a multimodal one's
    ``text_config``): each field by the first of its :data:`WHOLE_FILE_KEYS` that holds its very value, so a
    refusal of the decoder's checks names the file's key; a field no key holds (a default, a value derived)
    keeps kvbench's."""
    text = cfg.get("text_config")
    given, nested = (text, TEXT_CONFIG) if isinstance(text, Mapping) else (cfg, "")
    out = {}
    for name, keys in WHOLE_FILE_KEYS.items():
        key = next((k for k in keys if is_set(given, k) and _at(given, k) == fields.get(name)), None)
        if key is not None and name in fields:
            out[name] = Source(nested + key)
    return out


def _at(cfg: Mapping[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        cfg = cfg[part]
    return cfg


def _text_fields(cfg: Mapping[str, Any], arch: str, where: str, max_seq_len: Any, nested: str) -> Tuple[Dict, Dict]:
    """:func:`model_fields` of a language model's keys ``cfg``, found at ``nested`` in the file."""
    switches, hybrid = HF_ARCHITECTURES[arch], arch in HYBRID_ARCHITECTURES
    given, cfg = cfg, _with_class_defaults(cfg, arch)
    check_agreement(given, cfg, WINDOW_KEYS_READ.get(arch, WINDOW_KEYS), hybrid)  # keys that say one thing twice
    refused = {  # key: why, for a value that is set and not the default (Mistral's and Qwen2's classes ignore it)
        "attention_bias": "biases on the latent attention's projections are not modelled" if "Deep" in arch else None,
        **dict.fromkeys(("text_config", "vision_config"), "multimodal checkpoints are not supported"),
        **dict.fromkeys(("num_experts", "num_local_experts"),
                        None if arch in MOE_FAMILIES else f"mixture-of-experts is not supported for {arch}"),
    }
    if arch in ATTENTION_BIAS:  # on q, k, v and o alike (GPT-OSS: unless set false); GPT-OSS: sinks in every layer
        bias = _get(cfg, "attention_bias", "bool", arch == "GptOssForCausalLM")
        switches = {**switches, "qkv_bias": bias, "o_bias": bias, "preset_sinks": arch == "GptOssForCausalLM"}
    if arch == "LlamaForCausalLM":  # mlp_bias: biases on its MLP's gate, up and down (other classes ignore the key)
        switches = {**switches, "mlp_bias": _get(cfg, "mlp_bias", "bool", False)}
    for key, why in refused.items():
        if why and cfg.get(key):
            raise ConfigError(f"{where}: {key}={cfg[key]!r}: {why}")
    if _get(cfg, "hidden_act", "str", "silu") != "silu":
        raise ConfigError(f"{where}: hidden_act={cfg['hidden_act']!r}: not supported (silu only)")
    positions = _get(cfg, "max_position_embeddings", "int", 2048)
    tied_embeddings(cfg)  # read by the loader: checked here, where the file is named
    own_keys: Dict[str, Any] = {}  # each kind's own fields of the architectures it reads (LayerKind.hf_fields)
    own = {k: v for kind in registered() if arch in kind.architectures and kind.hf_fields
           for k, v in kind.hf_fields(cfg, arch, own_keys).items()}
    heads, hidden = _get(cfg, "num_attention_heads", "int", _REQUIRED), _get(cfg, "hidden_size", "int", _REQUIRED)
    layers = _get(cfg, "num_hidden_layers", "int", _REQUIRED)
    kv_heads, head_dim = _get(cfg, "num_key_value_heads", "int"), _get(cfg, "head_dim", "int")
    # Qwen3.5-MoE has no dense MLP (nor intermediate_size): ffn_dim, unused, is the experts' width
    ffn = "moe_intermediate_size" if MOE_FAMILIES.get(arch) == "qwen3_5" else "intermediate_size"
    keys: Dict[str, Any] = dict(  # field -> the key its value was read from, or a Source saying how it was found
        num_layers="num_hidden_layers", d_model="hidden_size", num_heads="num_attention_heads", ffn_dim=ffn,
        preset_kv_heads="num_key_value_heads" if kv_heads else "num_attention_heads", vocab_size="vocab_size",
        norm_eps="rms_norm_eps", **({} if max_seq_len else {"max_seq_len": "max_position_embeddings"}),
        head_dim="head_dim" if head_dim else Source("head_dim", DEFAULT if hybrid else
                                                    "hidden_size / num_attention_heads"))
    shape = dict(
        num_layers=layers, d_model=hidden, num_heads=heads, preset_kv_heads=kv_heads or heads,
        # transformers' default; left to ModelConfig's checks when the values are not counts
        head_dim=head_dim or (HYBRID_DEFAULTS["head_dim"] if hybrid else hidden // heads if _counts(hidden, heads)
                              else None),
        ffn_dim=_get(cfg, ffn, "int", _REQUIRED), vocab_size=_get(cfg, "vocab_size", "int", _REQUIRED),
        max_seq_len=max_seq_len or positions, norm_eps=_get(cfg, "rms_norm_eps", "number", 1e-6), **switches,
        **_hf_rope(cfg, positions, hybrid, keys), **_hf_window(cfg, hybrid, arch, keys))
    shape.update(own, weights_stored=weights_stored(cfg))  # FP8 blocks, MXFP4, NVFP4: dequantized on load
    keys.update(own_keys)
    shape.update(_hf_moe(cfg, arch, layers))
    name = _get(cfg, "_name_or_path", "str") or Path(where).parent.name
    return {"name": name, **shape}, file_sources(keys, given, nested)


def _with_class_defaults(cfg: Mapping[str, Any], arch: str) -> Mapping[str, Any]:
    """``cfg`` with ``arch``'s :data:`CLASS_DEFAULTS` for the keys it leaves out."""
    defaults = dict(CLASS_DEFAULTS.get(arch, {}))
    if "rope_parameters" in defaults and (cfg.get("rope_parameters") or cfg.get("rope_scaling")):
        del defaults["rope_parameters"]
    # a null reads as absent (as _get reads it), but a null sliding_window is transformers' "no window"
    given = {k: v for k, v in cfg.items() if v is not None or k not in defaults or k == "sliding_window"}
    return {**defaults, **given}


def _hf_rope(cfg: Mapping[str, Any], positions: Any, partial: bool, keys: Dict[str, Any]) -> Dict[str, Any]:
    """ModelConfig's rope fields from a config.json: transformers >= 5 writes ``rope_parameters``
    (theta included), older versions ``rope_theta`` and ``rope_scaling`` (``type`` before 4.45);
    given both, transformers (4 and 5) reads ``rope_scaling``. A top-level
    ``original_max_position_embeddings`` overrides the rope's (transformers' rule, for Phi-3).
    A rope type the decoder does not compute is refused naming the key; ``partial_rotary_factor``
    too, unless ``partial`` (an architecture whose attention rotates part of a head). ``keys``: where
    each field was read (as :func:`model_fields` keeps them)."""
    key = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
    rope = _get(cfg, key, "object", {})
    prefix = f"{key}."
    rope_type = _get(rope, "rope_type", "str", None, prefix)
    keys["rope_type"] = prefix + ("rope_type" if rope_type or rope.get("type") is None else "type")
    rope_type = rope_type or _get(rope, "type", "str", "default", prefix)
    if rope_type not in ROPE_TYPES:
        raise ConfigError(f"{key}.rope_type={rope_type!r}: not supported (accepted: {', '.join(ROPE_TYPES)})")
    out = {}
    if partial:  # transformers' order: rope_parameters', the top level's, the config class's default
        factor = _get(rope, "partial_rotary_factor", "number", None, prefix)
        out["partial_rotary_factor"] = factor if factor is not None else _get(
            cfg, "partial_rotary_factor", "number", HYBRID_DEFAULTS["partial_rotary_factor"])
        keys["partial_rotary_factor"] = ("" if factor is None else prefix) + "partial_rotary_factor"
    for where, found in ((prefix, rope), ("", cfg)) if not partial else ():
        if _get(found, "partial_rotary_factor", "number", 1.0, where) != 1.0:
            raise ConfigError(f"{where}partial_rotary_factor={found['partial_rotary_factor']!r}: not supported "
                              "(the decoder rotates every dimension of this architecture's heads)")
    theta = _get(rope, "rope_theta", "number", None, prefix)
    out.update(rope_type=rope_type, rope_theta=_get(cfg, "rope_theta", "number", 10000.0) if theta is None else theta)
    keys["rope_theta"] = ("" if theta is None else prefix) + "rope_theta"
    needed = {"linear": {"rope_factor": "factor"},
              "llama3": {"rope_factor": "factor", "rope_low_freq_factor": "low_freq_factor",
                         "rope_high_freq_factor": "high_freq_factor"},
              "yarn": {"rope_factor": "factor"}}.get(rope_type, {})
    for name, hf_name in needed.items():
        if rope.get(hf_name) is None:
            raise ConfigError(f"{key}.{hf_name}: missing (rope_type {rope_type!r} needs it)")
        out[name], keys[name] = _get(rope, hf_name, "number", None, prefix), prefix + hf_name
    if rope_type in ("llama3", "yarn"):  # transformers falls back to max_position_embeddings too
        top, own = (_get(c, "original_max_position_embeddings", "int", None, p) for c, p in ((cfg, ""), (rope, prefix)))
        out["rope_original_max_seq_len"] = top or (positions if own is None else own)
        keys["rope_original_max_seq_len"] = "original_max_position_embeddings" if top else \
            "max_position_embeddings" if own is None else prefix + "original_max_position_embeddings"
    if rope_type == "yarn":
        out["rope_truncate"] = _get(rope, "truncate", "bool", True, prefix)
        for name, hf_name in (("rope_beta_fast", "beta_fast"), ("rope_beta_slow", "beta_slow"),
                              ("rope_mscale", "mscale"), ("rope_mscale_all_dim", "mscale_all_dim"),
                              ("rope_attention_factor", "attention_factor")):
            read = bool(_get(rope, hf_name, "number", None, prefix))  # transformers reads each with `or` its default
            keys[name] = prefix + hf_name if read else Source(prefix + hf_name, DEFAULT)
            if read:
                out[name] = rope[hf_name]
    elif _get(rope, "mscale_all_dim", "number", None, prefix):  # DeepSeek's softmax scale: any rope type but default
        out["rope_mscale_all_dim"], keys["rope_mscale_all_dim"] = rope["mscale_all_dim"], prefix + "mscale_all_dim"
    return out


def _hf_window(cfg: Mapping[str, Any], hybrid: bool, arch: str, keys: Dict[str, Any]) -> Dict[str, Any]:
    """ModelConfig's window fields from a config.json, as transformers reads them: ``arch``'s
    :data:`WINDOW_KEYS_READ` only; ``sliding_window`` applies to every layer unless
    ``use_sliding_window`` is false; Qwen2/Qwen3 to the layers from ``max_window_layers`` on, unless
    ``layer_types`` (transformers >= 5 writes it) lists each layer's kind. A ``hybrid``
    architecture's layer_types names its Gated DeltaNet layers (linear_attention; without the key,
    every ``full_attention_interval``-th layer is full attention and the others linear). ``keys``:
    where each field was read (as :func:`model_fields` keeps them)."""
    # transformers' names: an attention layer's, and a recurrent or named kind's (DeepSeek-V4's compressed
    # layers) where the architecture is one whose keys of that kind this reader reads; a kind whose home
    # reads its architecture's whole config.json never comes here
    kinds = tuple(t for kind in registered() if not (kind.recurrent or kind.named) or arch in kind.architectures
                  for t in kind.layer_types)
    layer_types = cfg.get("layer_types")
    if isinstance(layer_types, list) and set(layer_types) == {"indexed_attention"}:  # DeepSeek-V3.2: every layer DSA
        layer_types = None
    if layer_types is not None and (not isinstance(layer_types, list) or any(t not in kinds for t in layer_types)):
        # a kind of layer the decoder does not model, whether or not the architecture reads the key
        raise ConfigError(f"layer_types={layer_types!r}: not supported (each entry {' or '.join(kinds)})")
    read = WINDOW_KEYS_READ.get(arch, WINDOW_KEYS)
    cfg = {k: v for k, v in cfg.items() if k not in WINDOW_KEYS or k in read}
    layer_types = layer_types if "layer_types" in read else None
    keys.update(preset_window="sliding_window", preset_layer_types="layer_types")
    if arch == "GptOssForCausalLM" and layer_types is None:  # GptOssConfig's: sliding, full, sliding ...
        layer_types = ["full_attention" if i % 2 else "sliding_attention"
                       for i in range(_get(cfg, "num_hidden_layers", "int", _REQUIRED))]
        keys["preset_layer_types"] = Source("layer_types", DEFAULT)
    window = _get(cfg, "sliding_window", "int") if _get(cfg, "use_sliding_window", "bool", True) else None
    if layer_types is None and hybrid:
        k = _get(cfg, "full_attention_interval", "int", HYBRID_DEFAULTS["full_attention_interval"])
        if k < 1:
            raise ConfigError(f"full_attention_interval={k!r}: must be >= 1 (every k-th layer full attention)")
        layer_types = [LINEAR if (i + 1) % k else "full_attention"
                       for i in range(_get(cfg, "num_hidden_layers", "int", _REQUIRED))]
        keys["preset_layer_types"] = Source("layer_types", f"from full_attention_interval={k}")
    if layer_types is None and window and "max_window_layers" in cfg:  # Qwen2/Qwen3 before layer_types
        first = _get(cfg, "max_window_layers", "int")
        layer_types = ["sliding_attention" if i >= first else "full_attention"
                       for i in range(_get(cfg, "num_hidden_layers", "int", _REQUIRED))]
        keys["preset_layer_types"] = Source("layer_types", f"from max_window_layers={first}")
    if layer_types is not None:
        if LINEAR in layer_types and "sliding_attention" not in layer_types:
            return {"preset_layer_types": layer_types}
        if "sliding_attention" not in layer_types:
            window = layer_types = None
    if not window:
        return {}
    return {"preset_window": window, "preset_layer_types": layer_types}


def _counts(*values: Any) -> bool:
    return all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values)


# ---- mixture-of-experts MLPs --------------------------------------------------------------------

def _hf_moe(cfg: Mapping[str, Any], arch: str, num_layers: Any) -> Dict[str, Any]:
    """``model.moe`` from the config.json of a :data:`MOE_FAMILIES`
    architecture, as transformers builds each family's layers: Qwen3-MoE's and Qwen3-Next's sparse
    layers are those not in ``mlp_only_layers`` whose index + 1 is a multiple of
    ``decoder_sparse_step`` (Qwen3.5-MoE's: all); DeepSeek's
    those from ``first_k_dense_replace`` on, or the ``sparse`` ones of ``mlp_layer_types`` (V3.2);
    GPT-OSS's all. Each value is checked where it is read
    (:func:`kvbench.core.moe.check_moe`), naming the config.json key. No sparse layer: {}."""
    family = MOE_FAMILIES.get(arch)
    if family is None or not _counts(num_layers):
        return {}
    counts = {key: _get(cfg, key, "int") for key in ("num_experts", "num_local_experts", "n_routed_experts")}
    given = {key: n for key, n in counts.items() if n is not None}
    if len(set(given.values())) > 1:  # transformers maps these names onto one another: two counts contradict
        raise ConfigError(", ".join(f"{key}={n}" for key, n in given.items()) + ": inconsistent expert counts "
                          "(one model has one number of routed experts)")
    experts_key = next(iter(given), EXPERTS_KEY.get(family, "num_experts"))  # without one: the family's own key
    keys = {"num_experts": experts_key, "top_k": "num_experts_per_tok", "expert_ffn_dim": "moe_intermediate_size",
            "router": "scoring_func", "n_group": "n_group", "topk_group": "topk_group",
            "routed_scaling_factor": "routed_scaling_factor", "shared_ffn_dim": "shared_expert_intermediate_size",
            "shared_gate": "shared_expert_intermediate_size", "swiglu_limit": "swiglu_limit",
            "dense_layers": "mlp_only_layers"}
    moe: Dict[str, Any] = {"num_experts": given.get(experts_key), "top_k": _get(cfg, "num_experts_per_tok", "int"),
                           "router": "softmax", "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0,
                           "shared_ffn_dim": 0, "shared_gate": False, "swiglu_limit": None}
    if family == "gpt_oss":
        moe.update(expert_ffn_dim=_get(cfg, "intermediate_size", "int", _REQUIRED), router="softmax_topk",
                   router_bias=True, expert_bias=True, swiglu_limit=_get(cfg, "swiglu_limit", "number", 7.0),
                   swiglu_alpha=_get(cfg, "swiglu_alpha", "number", 1.702))
        keys["expert_ffn_dim"], dense = "intermediate_size", []
    elif family.startswith("deepseek"):
        v3 = family == "deepseek_v3"
        first = _get(cfg, "first_k_dense_replace", "int", 3 if v3 else 0)  # the config classes' defaults
        dense, keys["dense_layers"] = list(range(min(first, num_layers))), "first_k_dense_replace"
        kinds = _get(cfg, "mlp_layer_types", "list")  # DeepSeek-V3.2 names each layer's MLP (dense | sparse)
        if kinds is not None:
            if len(kinds) != num_layers or any(k not in ("dense", "sparse") for k in kinds):
                raise ConfigError(f"mlp_layer_types={kinds!r}: must name each of num_hidden_layers={num_layers} "
                                  "layers dense or sparse")
            dense, keys["dense_layers"] = [i for i, k in enumerate(kinds) if k == "dense"], "mlp_layer_types"
        if len(dense) == num_layers:
            return {}
        grouped = v3 or _get(cfg, "topk_method", "str", "greedy") == "group_limited_greedy"
        width = _get(cfg, "moe_intermediate_size", "int", _REQUIRED)
        shared = _get(cfg, "n_shared_experts", "int", 1 if v3 else 2)
        moe.update(expert_ffn_dim=width, router="sigmoid" if v3 else "softmax",
                   norm_topk_prob=v3 and _get(cfg, "norm_topk_prob", "bool", True),
                   routed_scaling_factor=_get(cfg, "routed_scaling_factor", "number", 2.5 if v3 else 1.0),
                   n_group=_get(cfg, "n_group", "int", 8 if v3 else 1) if grouped else 1,
                   topk_group=_get(cfg, "topk_group", "int", 4 if v3 else 1) if grouped else 1,
                   shared_ffn_dim=width * shared if _counts(width, shared) else shared)
        keys.update(shared_ffn_dim="n_shared_experts", router="topk_method")
    else:
        step, only = _get(cfg, "decoder_sparse_step", "int", 1), _get(cfg, "mlp_only_layers", "list", [])
        if not _counts(step):
            raise ConfigError(f"decoder_sparse_step={step!r}: must be >= 1")
        # Qwen3.5-MoE: every layer sparse, its k weights always renormalised
        dense = [] if family == "qwen3_5" else [i for i in range(num_layers) if i in only or (i + 1) % step]
        if len(dense) == num_layers or moe["num_experts"] == 0:  # every layer dense: no expert key is read
            return {}
        # a shared expert transformers builds 512 wide when the key is left out: required, not guessed
        shared = _get(cfg, "shared_expert_intermediate_size", "int", _REQUIRED) if family != "qwen" else 0
        norm = family == "qwen3_5" or _get(cfg, "norm_topk_prob", "bool", family != "qwen")
        moe.update(expert_ffn_dim=_get(cfg, "moe_intermediate_size", "int", _REQUIRED), shared_ffn_dim=shared,
                   shared_gate=bool(shared), norm_topk_prob=norm)
    if len(dense) == num_layers:
        return {}
    for name in ("num_experts", "top_k"):
        if moe[name] is None:
            raise ConfigError(f"missing key {keys[name]!r} (a mixture-of-experts {arch} needs it)")
    moe["dense_layers"] = dense
    check_moe(moe, keys)
    return {"moe": moe}
