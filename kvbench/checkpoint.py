"""Weights in and out of the :class:`~kvbench.model.Decoder`.

- kvbench's own checkpoints: one ``torch.save`` of the two configs, the state dict and extras.
- transformers checkpoint directories of :data:`~kvbench.config.hf.HF_ARCHITECTURES` (and of a layer kind's own,
  named in Llama's form by its ``hf_names``): each attention module declares its transformers names (``HF_MODULE``,
  ``HF_NAMES``, ``HF_FUSED``), experts are :mod:`kvbench.mlp.weights`'. q/k load unpermuted (rotate-half rope).
- A new KV-head count: K/V heads mean-pooled within each group (MHA → GQA/MQA, Ainslie et al. 2023) or
  repeated, exactly (GQA → MHA).

Every file read here is the user's input: one that does not parse, is truncated or holds wrong or non-finite
tensors is a :class:`CheckpointError` naming the file, never a library's traceback.

Notation: H query heads, H_kv KV heads, D head_dim, C d_model.
"""

from __future__ import annotations

import re
from dataclasses import asdict, replace
from functools import partial
from pathlib import Path
from typing import Any, Dict, Iterable, Mapping, Optional, Sequence, Tuple

import torch

from kvbench.config import hf as hf_config
from kvbench.config.conversion import own_kind
from kvbench.config.layer_options import PRESET_OPTIONS
from kvbench.config.model import AttentionConfig, ModelConfig, attention_type
from kvbench.core.errors import ConfigError, typed
from kvbench.footprint import check_model_fits
from kvbench.hf_weights import CheckpointError, StoredTensor, check_tensors, load_finite_tensors
from kvbench.hf_weights import reading as _reading
from kvbench.jsonio import atomic_write, path_problem
from kvbench.layouts.attention import module_class
from kvbench.layouts.base import LayerLayout
from kvbench.layouts.build import build_layouts
from kvbench.layouts.kinds import (
    attention_kind,
    by_layer_type,
    hf_renaming,
    kind_of,
    recurrent_in,
    recurrent_layer_types,
    resolve,
)
from kvbench.mlp.dense import MLP
from kvbench.mlp.weights import MOE_NAMES, expert_file_name, expert_tensors, read_assembled
from kvbench.model import Decoder, torch_dtype
from kvbench.quant_weights import read_dequantized_headers
from kvbench.rope import deinterleave_rope, rope_tables

FORMAT_KEY = "kvbench_checkpoint"
FORMAT_VERSION = 1
_RESERVED = {FORMAT_KEY, "model", "attention", "state_dict"}


def _expected_tensors(model: ModelConfig, attention: AttentionConfig) -> Dict[str, torch.Size]:
    with torch.device("meta"):
        return {k: v.shape for k, v in Decoder(model, attention).state_dict().items()}


def build_decoder(model: ModelConfig, attention: AttentionConfig, state_dict: Dict[str, torch.Tensor],
                  dtype: Optional[torch.dtype] = None, device: torch.device | str = "cpu") -> Decoder:
    """A Decoder holding ``state_dict``, built on the meta device (no throw-away random initialisation)
    with the tensors assigned; only the rotary tables are recomputed."""
    with torch.device("meta"):
        decoder = Decoder(model, attention).to(dtype or torch.float32)
    kept = {k: p.dtype for k, p in decoder.state_dict().items()}  # a parameter its module keeps float32: float32
    params = {k: v.to(device, (dtype and kept.get(k, dtype) or v.dtype) if v.is_floating_point() else v.dtype)
              for k, v in state_dict.items()}
    decoder.load_state_dict(params, strict=True, assign=True)
    cos, sin = rope_tables(model, decoder.rope_dim)
    decoder.rope_cos, decoder.rope_sin = cos.to(device), sin.to(device)
    return decoder


# ---- kvbench's own format -------------------------------------------------------------------

def save_checkpoint(path: str | Path, model: Decoder, extra: Optional[dict] = None) -> Path:
    """Write ``model`` (configs + weights) and ``extra`` (plain values: metrics, curve) to ``path``."""
    extra = dict(extra or {})
    clash = _RESERVED & extra.keys()
    if clash:
        raise CheckpointError(f"extra keys {sorted(clash)} are reserved by the checkpoint format")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {FORMAT_KEY: FORMAT_VERSION, "model": asdict(model.config),
               "attention": asdict(model.attention),
               "state_dict": {k: v.detach().cpu() for k, v in model.state_dict().items()}, **extra}
    # atomic: a crash never leaves half a checkpoint under the real name
    return atomic_write(path, lambda f: torch.save(payload, f), binary=True)


def read_checkpoint(path: str | Path, map_location: torch.device | str = "cpu") -> dict:
    """The raw payload of a kvbench checkpoint (configs as dicts, state dict, extras)."""
    path = Path(path)
    why = path_problem(path)
    if why is not None:
        raise CheckpointError(f"checkpoint {path}: {why}")
    payload = _reading(path, "kvbench checkpoint (torch.save)",
                       partial(torch.load, path, map_location=map_location, weights_only=True))
    if not isinstance(payload, dict) or FORMAT_KEY not in payload:
        raise CheckpointError(f"checkpoint {path}: not a kvbench checkpoint (no {FORMAT_KEY!r} key); "
                              "for a transformers checkpoint directory pass the directory")
    for key in ("model", "attention", "state_dict"):
        if not isinstance(payload.get(key), dict):
            raise CheckpointError(f"checkpoint {path}: {key!r} is not a mapping")
    return payload


def load_checkpoint(path: str | Path, map_location: torch.device | str = "cpu") -> Decoder:
    """The Decoder saved by :func:`save_checkpoint`, in its saved dtype, on ``map_location``."""
    payload = read_checkpoint(path, map_location)
    try:
        model = ModelConfig.from_dict(payload["model"])
        attention = typed(AttentionConfig, payload["attention"], "attention.").resolved(model)
    except CheckpointError:
        raise
    except ConfigError as exc:
        raise CheckpointError(f"checkpoint {path}: {exc}") from None
    try:  # the saved config's size, as a config.json's: before the decoder is built, even on the meta device
        check_model_fits(model, map_location, f"checkpoint {path}", attention)
    except ConfigError as exc:
        raise CheckpointError(str(exc)) from None
    check_tensors(f"checkpoint {path}", _expected_tensors(model, attention), payload["state_dict"], "its saved config")
    return build_decoder(model, attention, payload["state_dict"], device=map_location)


# ---- Llama-format directories ---------------------------------------------------------------

# transformers' names outside a layer's attention module (which declares its own) -> the decoder's
_MODEL_NAMES = {"model.embed_tokens.": "embed.", "model.norm.": "norm."}
_BLOCK_NAMES = {"input_layernorm.": "attn_norm.", "post_attention_layernorm.": "mlp_norm.",
                "mlp.gate_proj.": "mlp.w_gate.", "mlp.up_proj.": "mlp.w_up.", "mlp.down_proj.": "mlp.w_down."}
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


def _renamed(name: str, names: Mapping[str, str]) -> str:
    """``name`` with the first key of ``names`` it is (a parameter) or starts with (a key ending in
    ".": a submodule) replaced by its value; unknown names pass through (and are then unexpected)."""
    for old, new in names.items():
        if name == old or (old.endswith(".") and name.startswith(old)):
            return new + name[len(old):]
    return name


def hf_to_decoder_name(name: str, layouts: Sequence[LayerLayout]) -> str:
    """transformers' parameter name -> the decoder's; a layer's attention names are its module's."""
    match = _LAYER.fullmatch(name)
    if match is None:
        return _renamed(name, _MODEL_NAMES)
    i, rest = int(match.group(1)), match.group(2)
    module = module_class(layouts[i]) if i < len(layouts) else None
    if module is not None and rest.startswith(module.HF_MODULE + "."):
        return f"blocks.{i}.attn." + _renamed(rest[len(module.HF_MODULE) + 1:], module.HF_NAMES)
    return f"blocks.{i}." + _renamed(rest, {**MOE_NAMES, **_BLOCK_NAMES})


def decoder_to_hf_name(name: str, layouts: Sequence[LayerLayout], stacked_experts: bool = False) -> str:
    """The decoder's parameter name -> transformers' (:func:`hf_to_decoder_name` backwards), to name a
    tensor the file lacks as the file would; an expert weight as its first per-expert tensor, or
    GPT-OSS's stacked one (``stacked_experts``)."""
    match = re.fullmatch(r"blocks\.(\d+)\.(.+)", name)
    if match is None:
        return _renamed(name, _inverse(_MODEL_NAMES))
    i, rest = int(match.group(1)), match.group(2)
    module = module_class(layouts[i]) if i < len(layouts) else None
    if module is not None and rest.startswith("attn."):
        return f"model.layers.{i}.{module.HF_MODULE}." + _renamed(rest[len("attn."):], _inverse(module.HF_NAMES))
    rest = expert_file_name(rest, stacked_experts) or _renamed(rest, _inverse({**MOE_NAMES, **_BLOCK_NAMES}))
    return f"model.layers.{i}.{rest}"


def _inverse(names: Mapping[str, str]) -> Dict[str, str]:
    # longest first: the decoder's "wq.0." (q_a_proj) before "wq." (q_proj)
    return dict(sorted(((new, old) for old, new in names.items()), key=lambda kv: -len(kv[0])))


def file_names(expected: Iterable[str], stored: Mapping[str, StoredTensor], layouts: Sequence[LayerLayout],
               prefix: Optional[str] = None) -> Dict[str, str]:
    """The decoder's name -> the checkpoint's, for every name a refusal may give: a stored tensor's own
    name (a fused or stacked one's for each of its parts); one the file lacks, spelled as the file
    spells that tensor in its other layers (``shared_experts`` or ``shared_expert``, GPT-OSS's
    ``mlp.router``, Qwen3-Next's fused ``in_proj_qkvz``), else as transformers names it."""
    def kind(key: str) -> Optional[tuple]:  # (the layer's kind, the name below it), or None
        m = re.match(r"blocks\.(\d+)\.", key)
        i = int(m.group(1)) if m else len(layouts)
        return (type(layouts[i]), key[m.end():], m.group(1)) if i < len(layouts) else None

    spelled: Dict[tuple, str] = {}  # (layer kind, the decoder's name below it) -> the file's, layer blanked
    for key, t in stored.items():
        if (k := kind(key)) and f".layers.{k[2]}." in t.name:
            spelled.setdefault(k[:2], t.name.replace(f".layers.{k[2]}.", ".layers.\0.", 1))  # not format: {} in a name
    stacked = any(re.search(r"\.experts\.(gate_up|down)_proj", t.name) for t in stored.values())
    plural = any(".mlp.shared_experts." in t.name for t in stored.values())  # DeepSeek's spelling, not Qwen's
    out = {}
    for key in expected:
        if (k := kind(key)) and k[:2] in spelled:
            out[key] = spelled[k[:2]].replace("\0", k[2])
            continue
        hf = decoder_to_hf_name(key, layouts, stacked)
        hf = hf.replace(".mlp.shared_expert.", ".mlp.shared_experts.") if plural else hf
        out[key] = prefix + hf[len("model."):] if prefix and hf.startswith("model.") else hf
    return {**out, **{k: t.name for k, t in stored.items()}}


def read_llama_config(directory: str | Path, max_seq_len: Optional[int] = None) -> ModelConfig:
    """The decoder shape a checkpoint directory's config.json describes."""
    return _llama_config(directory, max_seq_len)[0]


def _llama_config(directory: str | Path, max_seq_len: Optional[int]) -> Tuple[ModelConfig, Mapping[str, Any]]:
    directory = Path(directory)  # the shape and the parsed config.json it came from (read once)
    config_path = directory / hf_config.CONFIG_FILE
    if not config_path.is_file():
        raise CheckpointError(f"{directory}: no config.json (expected a transformers checkpoint directory)")
    try:
        hf = hf_config.read_config_json(directory)
        return ModelConfig.from_hf_config(hf, str(config_path), max_seq_len), hf
    except (OSError, ValueError) as exc:  # ConfigError, JSON that does not parse, not a regular file
        raise CheckpointError(f"{config_path}: {exc}" if str(config_path) not in str(exc) else str(exc)) from None


def load_llama_dir(directory: str | Path, dtype: torch.dtype | str = torch.float32,
                   device: torch.device | str = "cpu", max_seq_len: Optional[int] = None
                   ) -> Tuple[Decoder, Optional["tokenizers.Tokenizer"]]:  # noqa: F821
    """A transformers checkpoint directory as a Decoder, and its tokenizer if it has one;
    ``max_seq_len`` caps the rotary table (default: max_position_embeddings)."""
    directory = Path(directory)
    if isinstance(dtype, str):
        dtype = torch_dtype(dtype)
    model_cfg, hf = _llama_config(directory, max_seq_len)
    try:
        check_model_fits(model_cfg, device, f"{directory / 'config.json'}")  # before any tensor is made
    except ConfigError as exc:
        raise CheckpointError(str(exc)) from None
    own = own_kind(model_cfg)  # a model shape of its own kind (LayerKind.preset), else a K/V-head count
    attention = (AttentionConfig(type=own.attention_types[0]).resolved(model_cfg) if own is not None
                 else AttentionConfig.for_heads(model_cfg.num_heads, model_cfg.preset_kv_heads))
    layouts = build_layouts(model_cfg, attention.resolved(model_cfg))  # data only: what names mean per layer
    model_name = f"a {hf_config.architecture(hf)} as {directory / 'config.json'} describes it"
    # Headers first: names, shapes and dtypes against config.json before anything is built or read.
    stored, fused = _stored_tensors(directory, hf, layouts)
    if hf_config.tied_embeddings(hf) and "lm_head.weight" not in stored and "embed.weight" in stored:
        stored["lm_head.weight"] = stored["embed.weight"]  # tied: the head reuses the embedding
    _check_layers(directory, model_cfg, stored)
    stored = expert_tensors(directory, model_cfg, stored)  # per-expert or stacked: the decoder's stacked weights
    expected = _expected_tensors(model_cfg, attention)
    for keys in fused.values():  # a fused projection holds its parts' rows, each part stored with its shape
        tensor, want = stored[keys[0]], (sum(expected[k][0] for k in keys), *expected[keys[0]][1:])
        if tuple(tensor.shape) != want:
            raise CheckpointError(f"{directory}: tensor {tensor.name} has shape {tuple(tensor.shape)}, config.json "
                                  f"implies {want}")
        stored.update({k: replace(tensor, shape=tuple(expected[k])) for k in keys})
    prefix = hf_config.TEXT_MODEL_PREFIX.get(hf_config.checkpoint_architecture(hf))
    names = file_names(expected, stored, layouts, prefix)  # every refusal below names the file's tensor
    check_tensors(directory, expected, stored, model=model_name, names=names)
    tensors = read_assembled(partial(load_finite_tensors, directory), {k: stored[k] for k in expected})
    for (i, part, name), parts in fused.items():  # each part was read as the whole fused tensor; an MLP's: halves
        whole = tensors[parts[0]]
        split = resolve(kind_of(layouts[i]).unfuse)(layouts[i], name, whole) if part == "attn" \
            else dict(zip(MLP.HF_FUSED[name], whole.chunk(2)))
        tensors.update({f"blocks.{i}.{part}.{k}": t for k, t in split.items()})
    check_tensors(directory, expected, tensors, model=model_name, names=names)
    rotated = (model_cfg.preset_mla is not None and model_cfg.rope_type != "none") or model_cfg.nope is not None
    if rotated and hf_config.rope_interleaved(hf):  # (Kimi Linear's full layers rotate nothing)
        deinterleave_rope(tensors, model_cfg, attention)
    decoder = build_decoder(model_cfg, attention, tensors, dtype, device)

    tokenizer = None
    if (directory / "tokenizer.json").is_file():
        from tokenizers import Tokenizer
        path = directory / "tokenizer.json"
        tokenizer = _reading(path, "tokenizer.json (tokenizers)", partial(Tokenizer.from_file, str(path)))
    return decoder, tokenizer


def _stored_tensors(directory: Path, hf: Mapping[str, Any],
                    layouts: Sequence[LayerLayout]) -> Tuple[Dict[str, StoredTensor], Dict[tuple, list]]:
    """The checkpoint's headers by the decoder's names (a multimodal one's language model only), and
    its fused projections: (layer, attn | mlp, transformers' name) -> the decoder's names of their parts."""
    arch = hf_config.checkpoint_architecture(hf)
    prefix, unread = hf_config.TEXT_MODEL_PREFIX.get(arch), hf_config.UNREAD_TENSORS.get(arch, ())
    stored, fused = {}, {}  # Dict[str, StoredTensor], Dict[tuple, list]
    renamed = hf_renaming(hf)  # a kind's home's architecture: its names in Llama's form (None: not read)
    for name, tensor in read_dequantized_headers(directory, hf).items():  # a quantized weight: its dequantized header
        full = renamed("model." + name[len(prefix):] if prefix and name.startswith(prefix) else name)
        if full is None or full.startswith(unread):
            continue
        ours = hf_to_decoder_name(full, layouts)
        match = re.fullmatch(r"blocks\.(\d+)\.(attn|mlp)\.(.+)", ours)  # a layer's mixer or its dense MLP
        i, part = (int(match.group(1)), match.group(2)) if match else (len(layouts), "")
        parts = i < len(layouts) and getattr(module_class(layouts[i]) if part == "attn" else MLP, "HF_FUSED",
                                             {}).get(match.group(3))
        for key in [f"blocks.{i}.{part}.{p}" for p in parts] if parts else [ours]:
            if key in stored:  # two spellings of one weight
                raise CheckpointError(f"{directory}: tensors {stored[key].name} and {name} are the same "
                                      "weight of the decoder: which one is meant is not defined")
            stored[key] = tensor
        if parts:
            fused[(i, part, match.group(3))] = [f"blocks.{i}.{part}.{p}" for p in parts]
    return stored, fused


def _check_layers(directory: Path, model: ModelConfig, stored: Mapping[str, StoredTensor]) -> None:
    """The layers the files hold against ``num_hidden_layers``, from the names alone: 100,000 layers
    over 2 layers of tensors are refused here, not after building them."""
    layers = sorted({int(m.group(1)) for name in stored if (m := re.match(r"blocks\.(\d+)\.", name))})
    if layers == list(range(model.num_layers)):
        return
    held = (f"layers {', '.join(map(str, layers))}" if len(layers) <= 6
            else f"{len(layers)} layers ({layers[0]} to {layers[-1]})") if layers else "no layer"
    raise CheckpointError(f"{directory / hf_config.CONFIG_FILE}: num_hidden_layers={model.num_layers}, but the "
                          f"safetensors files hold tensors of {held}")


def to_layout(model: Decoder, attention: AttentionConfig) -> Tuple[Decoder, str]:
    """``model`` (a loaded checkpoint) as ``attention`` asks, and how (:func:`kv_conversion`), so the
    model run is the one the record names: K/V heads repeated or mean-pooled, any other kind of
    attention layer only as itself, either with ``attention``'s windows (over the same weights a
    window is only a mask)."""
    how = "none"
    own = attention_kind(model.attention.type)
    asked = attention_kind(attention.type) or own  # type=model (unresolved): the checkpoint's own kind
    if asked is not own:  # the weights are of one kind of attention layer; none becomes another
        held = f"is {own.title}" if own.preset else f"has {model.num_kv_heads} K/V heads"
        raise CheckpointError(f"attention.type={attention.type!r}: the checkpoint {held}; converting it to "
                              f"{asked.title} is not built (use attention={model.attention.type})")
    if model.layouts.converts_kv_heads():
        how = kv_conversion(model.num_kv_heads, attention.num_kv_heads)
        model = model if how == "none" else convert_kv_heads(model, attention.num_kv_heads)
    # what the weights are: a layout property asked other than the checkpoint's is refused, not dropped
    for name in (*asked.shape_keys, *(option.key for option in PRESET_OPTIONS)):
        asked_value, own_value = getattr(attention, name), getattr(model.attention, name)
        if (asked_value or 0) != (own_value or 0):  # null: none
            raise CheckpointError(f"attention.{name}={asked_value}: the checkpoint's is "
                                  f"{0 if own_value is None else own_value} (leave it null)")
    n = model.config.num_layers
    recurrent = recurrent_layer_types()
    layers, own_layers = attention.layer_kinds(n), model.attention.layer_kinds(n)
    if [t in recurrent and t for t in layers] != [t in recurrent and t for t in own_layers]:
        titles = " and ".join(by_layer_type(t).title for t in recurrent if t in own_layers) or "recurrent"
        raise CheckpointError(f"attention.layer_types={attention.layer_types}: the checkpoint's {titles} layers "
                              f"are {[i for i, t in enumerate(own_layers) if t in recurrent]} "
                              "(converting between recurrent and attention layers is not built; leave "
                              "attention.full_attention_interval and attention.layer_types null)")
    model = with_layer_pattern(model, attention)
    if model.layouts.decode_forms():  # layers whose decode step has two forms: the one asked
        for block, layout in zip(model.blocks, model.layouts):
            if layout.decode_forms:
                block.attn.form = attention.mla_decode
        model.attention = replace(model.attention, mla_decode=attention.mla_decode)
        model.layouts = build_layouts(model.config, model.attention, model.state_dtype)
    return model, how


def with_layer_pattern(model: Decoder, attention: AttentionConfig) -> Decoder:
    """``model``'s weights with ``attention``'s layer pattern: its windows (none, where it has none;
    a window is only a mask, so the same weights serve any). ``model`` itself when they are its own."""
    if attention.layer_windows(model.config.num_layers) == list(model.layouts.windows):
        return model
    pattern = replace(model.attention, **_pattern_fields(model.config, attention))
    return build_decoder(model.config, pattern, model.state_dict(), device=model.device).train(
        model.training).hold_states_in(model.state_dtype)


def _pattern_fields(config: ModelConfig, attention: AttentionConfig) -> Dict[str, Any]:
    """The pattern fields that make a model of ``config`` have ``attention``'s (resolved) window
    pattern: for none, window 0 where ``config`` has a window of its own (null would bring it back)."""
    if attention.window:
        return {"window": attention.window, "global_every": attention.global_every,
                "layer_types": attention.layer_types}
    # without a window, layer_types says only which layers are recurrent (if any is)
    recurrent = attention.layer_types if recurrent_in(attention.layer_types) else None
    return {"window": 0 if config.preset_window else None, "global_every": None, "layer_types": recurrent}


# ---- changing the KV-head count ------------------------------------------------------------

def kv_conversion(old: int, new: int) -> str:
    """How :func:`convert_kv_heads` takes ``old`` KV heads to ``new``: ``none``, ``repeat`` (exact) or
    ``mean-pool`` (an approximation, Ainslie et al. 2023)."""
    if new < 1:
        raise CheckpointError(f"attention.num_kv_heads={new}: must be >= 1")
    if new == old:
        return "none"
    if new < old and old % new == 0:
        return "mean-pool"
    if new > old and new % old == 0:
        return "repeat"
    raise CheckpointError(f"attention.num_kv_heads={new}: cannot convert the checkpoint's {old} KV heads "
                          f"(mean-pooling needs a divisor of {old}, repeating a multiple of {old})")


def convert_kv_heads(model: Decoder, num_kv_heads: int) -> Decoder:
    """A new Decoder with ``num_kv_heads`` KV heads; queries and outputs are kept.

    Fewer heads: new KV head j is the mean of old heads j*r .. (j+1)*r - 1, r = old / new. More
    heads: new head j copies old head j // r, r = new / old, so every query head reads exactly the
    K/V it read before and the model computes the same function (query head h reads KV head h // G).
    """
    old = model.num_kv_heads
    how = kv_conversion(old, num_kv_heads)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for name in list(state):
        if how != "none" and name.endswith((".attn.wk.weight", ".attn.wv.weight", ".attn.wk.bias", ".attn.wv.bias")):
            layout = model.layouts[int(name.split(".")[1])]  # blocks.<i>.attn...
            if layout.num_kv_heads != old:  # a layer of a shape of its own (Gemma 4's global heads) keeps it
                continue
            D, w = layout.head_dim, state[name]  # weight (old H_kv * D, C) or bias (old H_kv * D,): rows are heads
            if how == "mean-pool":
                heads = w.float().view(num_kv_heads, old // num_kv_heads, D, -1).mean(dim=1).to(w.dtype)
            else:
                heads = w.view(old, D, -1).repeat_interleave(num_kv_heads // old, dim=0)
            state[name] = heads.reshape(num_kv_heads * D, *w.shape[1:])  # (H_kv, D, C) -> (H_kv * D, C)
    attention = replace(model.attention, type=attention_type(model.config.num_heads, num_kv_heads),
                        num_kv_heads=num_kv_heads, **_pattern_fields(model.config, model.attention))  # the same windows
    return build_decoder(model.config, attention, state, device=model.device).hold_states_in(model.state_dtype)
