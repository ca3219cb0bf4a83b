"""Compressed layers (DeepSeek-V4): the kind's home. Its layout is
:class:`~kvbench.layouts.compressed_layout.Compressed` (bytes held, per token and read, FLOPs,
limits, inspect text); here are its config.json reading (:func:`compressed_from_hf`, and the whole
file of a ``DeepseekV4ForCausalLM``: :func:`hf_model_fields`), its layers built for a model
(:func:`build`, ``model.layer_shapes.compressed``) and its registration.

A V4 layer is chosen by its layer type (``compressed_sparse_attention``,
``heavily_compressed_attention``) whatever ``attention.type``; a ``sliding_attention`` layer of a
pattern that names one of them is a V4 layer of the ring alone (transformers builds every layer
of a DeepseekV4 model as one DeepseekV4Attention), elsewhere a K/V-head layer with a window.
"""

from __future__ import annotations

import math
import re
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from kvbench.core.errors import ConfigError
from kvbench.layouts.compressed_layout import (  # noqa: F401  (the kind's names, as its tests and docs use them)
    CSA,
    GATE_BYTES,
    HCA,
    LAYER_TYPES,
    MLP_LAYER_TYPES,
    RATIO_TYPES,
    ROPE_TYPES,
    SLIDING,
    Compressed,
    Rope,
    _count,
)
from kvbench.layouts.registry import LayerKind, register

# ---- config.json ---------------------------------------------------------------------------

ARCHITECTURE = "DeepseekV4ForCausalLM"
# DeepseekV4Config's defaults for what a config.json may leave out
DEFAULTS = {"num_hidden_layers": 43, "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512,
            "q_lora_rank": 1024, "o_groups": 8, "o_lora_rank": 1024, "sliding_window": 128, "index_n_heads": 64,
            "index_head_dim": 128, "index_topk": 512, "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
            "max_position_embeddings": 1048576}
DEFAULT_RATES = {CSA: 4, HCA: 128}
DEFAULT_HASH_LAYERS = 3


def _value(cfg: Mapping[str, Any], key: str, number: bool = False) -> Any:
    """``cfg[key]`` (its default when absent or null), a positive integer (a positive number if ``number``)."""
    value = cfg.get(key)
    value = DEFAULTS[key] if value is None else value
    kinds = (int, float) if number else (int,)
    if isinstance(value, bool) or not isinstance(value, kinds) or value <= 0 or \
            (number and not math.isfinite(value)):
        raise ConfigError(f"{key}={value!r}: must be a positive {'number' if number else 'integer'}")
    return value


def v4_layer_types(cfg: Mapping[str, Any]) -> List[str]:
    """Each layer's type in a DeepseekV4 config.json, as DeepseekV4Config reads it: ``layer_types``,
    else the legacy ``compress_ratios`` (0 / 4 / 128 per layer), else two HCA layers then CSA and
    HCA interleaved; cut to num_hidden_layers."""
    n = _value(cfg, "num_hidden_layers")
    types, ratios = cfg.get("layer_types"), cfg.get("compress_ratios")
    if types is None and ratios is not None:
        if not isinstance(ratios, list) or any(isinstance(r, bool) or r not in RATIO_TYPES for r in ratios):
            raise ConfigError(f"compress_ratios={ratios!r}: must be a list of {', '.join(map(str, RATIO_TYPES))} "
                              "per layer")
        types = [RATIO_TYPES[r] for r in ratios]
    elif types is None:
        types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
    elif not isinstance(types, list) or any(t not in LAYER_TYPES for t in types):
        raise ConfigError(f"layer_types={types!r}: each must be one of {', '.join(LAYER_TYPES)}")
    if len(types) < n:  # transformers cuts a longer list and refuses a shorter one
        raise ConfigError(f"layer_types={types!r}: {len(types)} entries for num_hidden_layers={n}")
    return list(types[:n])


def v4_mlp_layer_types(cfg: Mapping[str, Any]) -> List[str]:
    """Each layer's MLP in a DeepseekV4 config.json: ``hash_moe`` (experts chosen by a token-id
    table) or ``moe`` (learned routing); default the first ``num_hash_layers`` (3) hash-routed."""
    n = _value(cfg, "num_hidden_layers")
    types = cfg.get("mlp_layer_types")
    if types is None:
        hashed = cfg.get("num_hash_layers")
        hashed = DEFAULT_HASH_LAYERS if hashed is None else hashed
        if isinstance(hashed, bool) or not isinstance(hashed, int) or hashed < 0:
            raise ConfigError(f"num_hash_layers={hashed!r}: must be a non-negative integer")
        return ["hash_moe"] * min(n, hashed) + ["moe"] * max(0, n - hashed)
    if not isinstance(types, list) or len(types) < n or any(t not in MLP_LAYER_TYPES for t in types):
        raise ConfigError(f"mlp_layer_types={types!r}: {n} entries (num_hidden_layers), each one of "
                          f"{', '.join(MLP_LAYER_TYPES)}")
    return list(types[:n])


def compress_rates(cfg: Mapping[str, Any]) -> Dict[str, int]:
    """m per compressing layer type: ``compress_rates`` (default 4 and 128), the legacy
    ``compress_rate_csa`` / ``compress_rate_hca`` winning over it as in DeepseekV4Config. A
    ``compress_rates`` that leaves out a type some layer has is refused, as transformers fails to
    build that layer (it does not fill the missing type with its default)."""
    given = cfg.get("compress_rates")
    if given is not None and (not isinstance(given, dict) or set(given) - {CSA, HCA}):
        raise ConfigError(f"compress_rates={given!r}: must map {CSA} and {HCA} to a positive integer each")
    rates = dict(DEFAULT_RATES if given is None else given)
    for key, layer_type in (("compress_rate_csa", CSA), ("compress_rate_hca", HCA)):
        if cfg.get(key) is not None:
            _count(key, cfg[key])
            rates[layer_type] = cfg[key]
    for layer_type, rate in rates.items():
        _count(f"compress_rates.{layer_type}", rate)
    missing = [t for t in (CSA, HCA) if t in v4_layer_types(cfg) and t not in rates]
    if missing:
        raise ConfigError(f"compress_rates={given!r}: no rate for {missing[0]}, which layers "
                          f"{[i for i, t in enumerate(v4_layer_types(cfg)) if t == missing[0]]} are")
    return rates


def _ropes(cfg: Mapping[str, Any]) -> Tuple[Rope, Rope, float]:
    """The ``main`` and ``compress`` rotary bases and partial_rotary_factor, nested in
    ``rope_parameters`` (``main`` / ``compress``) or flat (rope_theta, compress_rope_theta, and a
    YaRN ``rope_parameters`` / ``rope_scaling`` for the compressed branch only)."""
    params = cfg.get("rope_parameters")
    params = cfg.get("rope_scaling") if params is None else params
    params = {} if params is None else params
    if not isinstance(params, dict):
        raise ConfigError(f"rope_parameters={params!r}: must be a mapping")
    nested = isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict)
    main = params["main"] if nested else {"rope_theta": _value(cfg, "rope_theta", number=True)}
    compress = params["compress"] if nested else {
        **{k: v for k, v in params.items() if k not in ("main", "compress")},
        "rope_theta": _value(cfg, "compress_rope_theta", number=True)}
    ropes = []
    for label, p in (("main", main), ("compress", compress)):
        kind = p.get("rope_type", p.get("type", "default"))
        if kind not in ROPE_TYPES:
            raise ConfigError(f"rope_parameters.{label}.rope_type={kind!r}: must be one of {', '.join(ROPE_TYPES)}")
        theta = p.get("rope_theta")
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not 0 < theta < math.inf:
            raise ConfigError(f"rope_parameters.{label}.rope_theta={theta!r}: must be a positive number")
        if kind == "default":
            ropes.append(Rope(float(theta)))
            continue
        factor = p.get("factor")
        original = p.get("original_max_position_embeddings")
        for key, value in (("factor", factor), ("original_max_position_embeddings", original)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"rope_parameters.{label}.{key}={value!r}: yarn needs a positive number")
        ropes.append(Rope(float(theta), "yarn", float(factor), int(original), float(p.get("beta_fast") or 32),
                          float(p.get("beta_slow") or 1), float(p.get("attention_factor", 1.0))))
    key, factor = "partial_rotary_factor", cfg.get("partial_rotary_factor", main.get("partial_rotary_factor"))
    D = _value(cfg, "head_dim")
    if factor is None:  # legacy qk_rope_head_dim, else V4's 64 / 512
        key, rope_dim = "qk_rope_head_dim", cfg.get("qk_rope_head_dim")
        factor = 64 / 512 if rope_dim is None else rope_dim / D if isinstance(rope_dim, int) else rope_dim
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
        raise ConfigError(f"{key}={cfg.get(key)!r}: must be a number in (0, 1] (of head_dim) "
                          if key == "partial_rotary_factor" else
                          f"{key}={cfg.get(key)!r}: must be a positive integer at most head_dim={D}")
    # transformers rotates int(head_dim x factor) channels in pairs: a width it would cut or pair
    # unevenly is refused under the key the file wrote
    if D * factor != int(D * factor) or int(D * factor) % 2:
        raise ConfigError(f"{key}={cfg.get(key)!r}: head_dim={D} x partial_rotary_factor = {D * factor:g} rotated "
                          "channels, which must be a whole even number")
    return ropes[0], ropes[1], factor


def compressed_from_hf(cfg: Mapping[str, Any]) -> List[Compressed]:
    """Each layer's layout in a DeepseekV4ForCausalLM config.json (DeepseekV4Config's defaults for
    absent keys; layers of one type share one layout); a value it cannot run refused in one line
    naming its key."""
    arch = cfg.get("architectures")
    if arch is not None and (not isinstance(arch, list) or ARCHITECTURE not in arch):
        raise ConfigError(f"architectures={arch!r}: a DeepSeek-V4 layer is read from {ARCHITECTURE}")
    kv_heads = cfg.get("num_key_value_heads")
    if kv_heads is not None and (isinstance(kv_heads, bool) or kv_heads != 1):
        raise ConfigError(f"num_key_value_heads={kv_heads!r}: DeepSeek-V4 attends one K=V head (1)")
    types, rates = v4_layer_types(cfg), compress_rates(cfg)
    main, compress, factor = _ropes(cfg)
    D = _value(cfg, "head_dim")
    shape = dict(window=_value(cfg, "sliding_window"), num_heads=_value(cfg, "num_attention_heads"), head_dim=D,
                 rope_dim=int(D * factor), q_lora_rank=_value(cfg, "q_lora_rank"), o_groups=_value(cfg, "o_groups"),
                 o_lora_rank=_value(cfg, "o_lora_rank"), index_n_heads=_value(cfg, "index_n_heads"),
                 index_head_dim=_value(cfg, "index_head_dim"), index_topk=_value(cfg, "index_topk"),
                 rope=main, compress_rope=compress)
    v4_mlp_layer_types(cfg)  # refused here too: a schedule transformers would not build
    kinds = {t: Compressed(layer_type=t, compress_rate=rates.get(t, 0), **shape) for t in dict.fromkeys(types)}
    return [kinds[t] for t in types]


# ---- the decoder: its layers' layout ------------------------------------------------------

SHAPE_KEY = "compressed"  # model.layer_shapes' key: the V4 layers' fields as Compressed names them
# model.layer_shapes.compressed's keys beyond Compressed's fields: the ring and the rates by type
SHAPE_FIELDS = ("sliding_window", "compress_rates", "num_heads", "head_dim", "rope_dim", "q_lora_rank", "o_groups",
                "o_lora_rank", "index_n_heads", "index_head_dim", "index_topk", "rope", "compress_rope")


def model_shape(model) -> Dict[str, Any]:
    """The V4 layers' shape of ``model`` (a ModelConfig): ``model.layer_shapes.compressed`` (a
    checkpoint's, :func:`hf_model_fields`), each field it leaves out in V4-Flash's proportions to the
    model (its heads and head_dim; rope on an eighth of a head, query LoRA d_model / 4, output LoRA in
    groups of 8 heads of rank 2 x head_dim, as many indexer heads of head_dim / 4, a ring of 128, top
    512, m = 4 and m' = 128); a key it does not know refused naming ``model.layer_shapes.compressed.<key>``."""
    prefix = f"model.layer_shapes.{SHAPE_KEY}"
    given = (model.layer_shapes or {}).get(SHAPE_KEY) or {}
    if not isinstance(given, Mapping):
        raise ConfigError(f"{prefix}={given!r}: must be a mapping of DeepSeek-V4 layer fields")
    unknown = next((key for key in given if key not in SHAPE_FIELDS), None)
    if unknown is not None:
        raise ConfigError(f"{prefix}.{unknown}={given[unknown]!r}: not a DeepSeek-V4 layer field (one of "
                          f"{', '.join(SHAPE_FIELDS)})")
    D, H = model.head_dim, model.num_heads
    rope_dim = max(2, D // 8 - D // 8 % 2)
    shape = {"sliding_window": 128, "compress_rates": dict(DEFAULT_RATES), "num_heads": H, "head_dim": D,
             "rope_dim": rope_dim, "q_lora_rank": max(1, model.d_model // 4), "o_groups": max(1, H // 8),
             "o_lora_rank": 2 * D, "index_n_heads": H, "index_head_dim": max(rope_dim, D // 4),
             "index_topk": 512, **given}
    rates = shape["compress_rates"]
    if not isinstance(rates, Mapping) or set(rates) - {CSA, HCA}:
        raise ConfigError(f"{prefix}.compress_rates={rates!r}: must map {CSA} and {HCA} to a positive integer each")
    for key in ("rope", "compress_rope"):
        value = shape.get(key)
        if value is not None and not isinstance(value, Mapping):
            raise ConfigError(f"{prefix}.{key}={value!r}: must be a mapping of Rope's fields (theta, type, ...)")
    return shape


def build(model, attention, window: Optional[int] = None, layer_type: str = CSA) -> Compressed:
    """One V4 layer of ``layer_type`` of ``model`` (a ModelConfig) under ``attention`` (:func:`model_shape`):
    its ring is ``attention.window`` where the run asks one (every V4 layer's), else the shape's
    ``sliding_window``. Refused in one line naming ``model.layer_shapes.compressed.<key>``."""
    shape = model_shape(model)
    window = getattr(attention, "window", None) or shape["sliding_window"]
    rates = dict(shape["compress_rates"])
    fields = {k: v for k, v in shape.items() if k not in ("sliding_window", "compress_rates", "rope", "compress_rope")}
    ropes = {key: Rope(**shape[key]) for key in ("rope", "compress_rope") if shape.get(key) is not None}
    try:
        return Compressed(window, layer_type=layer_type, compress_rate=rates.get(layer_type, 0), **fields, **ropes)
    except ConfigError as exc:
        raise ConfigError(f"model.layer_shapes.{SHAPE_KEY}.{exc}") from None
    except TypeError as exc:  # a value of the wrong type in a check's arithmetic, or a Rope field unknown
        raise ConfigError(f"model.layer_shapes.{SHAPE_KEY}={dict(shape)!r}: malformed ({exc})") from None


def param_count(layout: Compressed, model) -> int:
    """A V4 layer's attention parameters (:meth:`Compressed.attention_params`)."""
    return layout.attention_params(model.d_model)


# ---- a whole DeepseekV4ForCausalLM config.json -------------------------------------------

def _number(cfg: Mapping[str, Any], key: str, default: Any, kind: str = "count") -> Any:
    """``cfg[key]`` (``default`` when absent or null): a positive integer (``count``), a positive
    number (``number``) or true / false (``bool``), else refused naming the key."""
    value = cfg.get(key)
    value = default if value is None else value
    if kind == "bool":
        ok = isinstance(value, bool)
    else:
        ok = not isinstance(value, bool) and isinstance(value, int if kind == "count" else (int, float)) and \
            0 < value < math.inf
    if not ok:
        raise ConfigError(f"{key}={value!r}: must be {'true or false' if kind == 'bool' else f'a positive {kind}'}")
    return value


def hf_model_fields(cfg: Mapping[str, Any], arch: str = ARCHITECTURE) -> Dict[str, Any]:
    """Every ModelConfig field of a DeepseekV4ForCausalLM config.json (DeepseekV4Config's defaults for
    absent keys): its V4 layers (``layer_shapes.compressed``: :func:`compressed_from_hf`'s shape, the
    ring as the window of its sliding layers), the residual streams (``hyper_connections``) and the
    mixture of experts of every layer (DeepseekV4SparseMoeBlock: the sqrt(softplus) router, its
    weights always renormalised, hash-routed layers by ``mlp_layer_types``, SwiGLU clamped at
    ``swiglu_limit`` in the routed and the shared expert, one shared expert as wide as a routed one).
    What kvbench cannot run refused in one line naming its key."""
    layers = compressed_from_hf(cfg)
    lay, types, mlp = layers[0], [lay.layer_type for lay in layers], v4_mlp_layer_types(cfg)
    for key, want in (("hidden_act", "silu"), ("scoring_func", "sqrtsoftplus")):
        if cfg.get(key, want) != want:
            raise ConfigError(f"{key}={cfg[key]!r}: DeepSeek-V4 is read with {key}={want} only")
    for key in ("attention_bias", "mlp_bias"):
        if _number(cfg, key, False, "bool"):
            raise ConfigError(f"{key}=True: DeepSeek-V4's projections have no biases (use false)")
    if _number(cfg, "n_shared_experts", 1) != 1:  # transformers builds one shared expert whatever the count
        raise ConfigError(f"n_shared_experts={cfg['n_shared_experts']!r}: DeepseekV4SparseMoeBlock has one "
                          "shared expert (1)")
    experts, width = _number(cfg, "n_routed_experts", 256), _number(cfg, "moe_intermediate_size", 2048)
    shape = {key: getattr(lay, key) for key in SHAPE_FIELDS if hasattr(lay, key)}
    shape.update(sliding_window=lay.window, compress_rates=compress_rates(cfg),
                 rope=dict(vars(lay.rope)), compress_rope=dict(vars(lay.compress_rope)))
    sliding = SLIDING in types
    return {"num_layers": len(layers), "d_model": _number(cfg, "hidden_size", 4096), "num_heads": lay.num_heads,
            "head_dim": lay.head_dim, "preset_kv_heads": 1, "ffn_dim": width,
            "vocab_size": _number(cfg, "vocab_size", 129280), "max_seq_len": _value(cfg, "max_position_embeddings"),
            "norm_eps": _number(cfg, "rms_norm_eps", 1e-6, "number"), "rope_type": "default",
            "rope_theta": lay.rope.theta, "preset_window": lay.window if sliding else None,
            "preset_layer_types": types, "layer_shapes": {SHAPE_KEY: shape},
            "hyper_connections": {"streams": _number(cfg, "hc_mult", 4),
                                  "sinkhorn_iters": _number(cfg, "hc_sinkhorn_iters", 20),
                                  "eps": _number(cfg, "hc_eps", 1e-6, "number")},
            "moe": {"num_experts": experts, "top_k": _number(cfg, "num_experts_per_tok", 6),
                    "expert_ffn_dim": width, "router": "sqrtsoftplus", "norm_topk_prob": True,
                    "routed_scaling_factor": _number(cfg, "routed_scaling_factor", 1.5, "number"),
                    "shared_ffn_dim": width, "swiglu_limit": _number(cfg, "swiglu_limit", 10.0, "number"),
                    "swiglu_alpha": 1.0, "swiglu_up_shift": 0.0,
                    "hash_layers": [i for i, t in enumerate(mlp) if t == "hash_moe"]}}


# DeepSeek's own names of a layer's tensors -> transformers', in order (transformers' conversion_mapping for
# deepseek_v4, which save_pretrained writes back): a checkpoint may hold either
ORIGINAL_NAMES = [
    (r"\.attn\.", ".self_attn."), (r"\.ffn\.", ".mlp."), (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"\.attn_norm\.", ".input_layernorm."), (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_(attn|ffn)_(fn|base|scale)$", r".\1_hc.\2"), (r"\.attn_sink$", ".sinks"),
    (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
    (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."), (r"\.norm\.", ".kv_norm."), (r"\.ape$", ".position_bias"),
    (r"\.wq_a\.", ".q_a_proj."), (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."), (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."), (r"\.wo_a\.", ".o_a_proj."), (r"\.wo_b\.", ".o_b_proj."),
    (r"\.q_norm\.", ".q_a_norm."),
    (r"\.gate\.bias$", ".gate.e_score_correction_bias"), (r"\.(shared_experts|experts\.\d+)\.w1\.", r".\1.gate_proj."),
    (r"\.(shared_experts|experts\.\d+)\.w2\.", r".\1.down_proj."),
    (r"\.(shared_experts|experts\.\d+)\.w3\.", r".\1.up_proj.")]
# outside the layers, either spelling -> the decoder's reading (Llama's form, or the decoder's own hc_head)
TOP_NAMES = {"embed.weight": "model.embed_tokens.weight", "embed_tokens.weight": "model.embed_tokens.weight",
             "head.weight": "lm_head.weight", "norm.weight": "model.norm.weight",
             **{f"hc_head{sep}{part}": f"hc_head.hc_{part}" for sep in ("_", ".hc_")
                for part in ("fn", "base", "scale")}}
# transformers' names of a layer's tensors that are not Llama's form (nor the decoder's, which pass as they are)
V4_NAMES = {"mlp.gate.tid2eid": "mlp.tid2eid", "mlp.experts.gate_up_proj": "mlp.experts.w_gate_up",
            "mlp.experts.down_proj": "mlp.experts.w_down"}


def hf_names(cfg: Mapping[str, Any]) -> Callable[[str], Optional[str]]:
    """A DeepseekV4ForCausalLM checkpoint's tensor names (DeepSeek's own, :data:`ORIGINAL_NAMES`, or
    transformers', with or without ``model.``) as the decoder reads them: its layers' in Llama's form
    (the attention under ``self_attn`` by transformers' names, the hyper-connections as they are),
    the hash table and stacked experts by :data:`V4_NAMES`, per-expert w1 / w3 / w2 as gate / up /
    down, the head's streams collapse as the decoder's ``hc_head``."""
    def renamed(name: str) -> Optional[str]:
        bare = name[len("model."):] if name.startswith("model.") else name
        if bare in TOP_NAMES or name == "lm_head.weight":
            return TOP_NAMES.get(bare, name)
        if not bare.startswith("layers."):
            return name
        for pattern, to in ORIGINAL_NAMES:
            bare = re.sub(pattern, to, bare)
        _, layer, rest = bare.split(".", 2)
        return f"model.layers.{layer}.{V4_NAMES.get(rest, rest)}"
    return renamed


def pattern(sliding: int, num_layers: int) -> List[str]:
    """compare's V4 layer pattern (``:p<n>``): the first ``sliding`` layers the ring alone, then CSA and HCA
    alternating, as DeepSeek-V4-Flash's published compress_ratios (0, 0, then 4 and 128: ``:p2``); as many
    sliding layers as the model has (no V4 layer left: its sliding layers would be K/V heads') refused."""
    if sliding >= num_layers:
        raise ConfigError(f":p{sliding}: {sliding} sliding layers leave no compressed layer of the model's "
                          f"{num_layers} (at most {num_layers - 1})")
    return [SLIDING] * min(sliding, num_layers) + [(CSA, HCA)[i % 2] for i in range(max(0, num_layers - sliding))]


# A small decoder of V4 layers, one of each type (tests/test_deepseek_v4_model.py runs it: windows of 4 and 8)
EXAMPLE = ("model=tiny", "model.num_layers=3", "attention.window=6", f"attention.layer_types=[{SLIDING},{CSA},{HCA}]",
           f"+model.layer_shapes={{{SHAPE_KEY}:{{index_topk:2,compress_rates:{{{CSA}:4,{HCA}:8}}}}}}")
# the conformance suite's (tests/test_layer_kinds.py): rates of 2 and 4, so that the suite's shared prefix
# (6 tokens, blocks of 4) is continued at 4, a multiple of both; 8 entries past a top-k of 2
SUITE_EXAMPLE = EXAMPLE[:-1] + (
    f"+model.layer_shapes={{{SHAPE_KEY}:{{index_topk:2,compress_rates:{{{CSA}:2,{HCA}:4}}}}}}",)

KIND = register(LayerKind(
    "compressed", Compressed, module="kvbench.layouts.compressed_attention:CompressedAttention",
    layer_types=(CSA, HCA), named=True, claims=(SLIDING,),
    label="v4", title="DeepSeek-V4 compressed attention", build=build, param_count=param_count,
    hf_architectures=(ARCHITECTURE,), hf_model_fields=hf_model_fields, hf_names=hf_names,
    letters={"p": "layer_types"}, pattern=pattern, examples={"sliding_csa_hca": SUITE_EXAMPLE}))
