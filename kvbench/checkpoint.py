"""Weights in and out of the shared :class:`~kvbench.model.Decoder`.

- kvbench's own checkpoints: one ``torch.save`` of the two configs as dicts, the state dict and
  any extra (train metrics, the loss curve).
- Llama-format directories (``config.json`` + ``*.safetensors`` with transformers' names), MHA or
  GQA. The decoder's rotary embedding uses the same rotate-half layout as transformers' Llama, so
  q/k weights load unpermuted (tests/test_checkpoint.py compares logits against transformers).
- A new KV-head count: mean-pooling K/V heads within each group (MHA → GQA/MQA, Ainslie et al.
  2023), or repeating them, exactly, to more heads (GQA → MHA).

Notation: H query heads, H_kv KV heads, D head_dim, C d_model.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Dict, Optional, Tuple

import torch

from kvbench.config import AttentionConfig, ConfigError, ModelConfig
from kvbench.model import Decoder, rope_tables, torch_dtype

FORMAT_KEY = "kvbench_checkpoint"
FORMAT_VERSION = 1
_RESERVED = {FORMAT_KEY, "model", "attention", "state_dict"}


class CheckpointError(ConfigError):
    """A checkpoint cannot be read into the decoder: the user's input is at fault (a run
    records ``invalid``). The message names the file or tensor."""


def build_decoder(model: ModelConfig, attention: AttentionConfig, state_dict: Dict[str, torch.Tensor],
                  dtype: Optional[torch.dtype] = None, device: torch.device | str = "cpu") -> Decoder:
    """A Decoder holding ``state_dict``, built without a throw-away random initialisation.

    Modules are created on the meta device and the tensors assigned; only the rotary tables
    (non-persistent buffers) are recomputed. Names and shapes must already match.
    """
    with torch.device("meta"):
        decoder = Decoder(model, attention)
    params = {k: v.to(device=device, dtype=dtype or v.dtype) for k, v in state_dict.items()}
    decoder.load_state_dict(params, strict=True, assign=True)
    cos, sin = rope_tables(model.max_seq_len, model.head_dim, model.rope_theta)
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
    tmp = path.with_name(path.name + ".tmp")
    torch.save(payload, tmp)
    tmp.replace(path)  # atomic: a crash never leaves half a checkpoint under the real name
    return path


def read_checkpoint(path: str | Path, map_location: torch.device | str = "cpu") -> dict:
    """The raw payload of a kvbench checkpoint (configs as dicts, state dict, extras)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path}: no such file")
    payload = torch.load(path, map_location=map_location, weights_only=True)
    if not isinstance(payload, dict) or FORMAT_KEY not in payload:
        raise CheckpointError(f"checkpoint {path}: not a kvbench checkpoint (no {FORMAT_KEY!r} key); "
                              "for a Llama-format directory pass the directory")
    return payload


def load_checkpoint(path: str | Path, map_location: torch.device | str = "cpu") -> Decoder:
    """The Decoder saved by :func:`save_checkpoint`, in its saved dtype, on ``map_location``."""
    payload = read_checkpoint(path, map_location)
    model = ModelConfig.from_dict(payload["model"])
    return build_decoder(model, AttentionConfig(**payload["attention"]), payload["state_dict"],
                         device=map_location)


# ---- Llama-format directories ---------------------------------------------------------------

def _llama_name(name: str) -> str:
    """transformers' parameter name → the decoder's (unknown names pass through unchanged)."""
    replacements = [("model.embed_tokens.", "embed."), ("model.layers.", "blocks."),
                    ("model.norm.", "norm."), (".self_attn.q_proj.", ".attn.wq."),
                    (".self_attn.k_proj.", ".attn.wk."), (".self_attn.v_proj.", ".attn.wv."),
                    (".self_attn.o_proj.", ".attn.wo."), (".mlp.gate_proj.", ".mlp.w_gate."),
                    (".mlp.up_proj.", ".mlp.w_up."), (".mlp.down_proj.", ".mlp.w_down."),
                    (".input_layernorm.", ".attn_norm."), (".post_attention_layernorm.", ".mlp_norm.")]
    for old, new in replacements:
        name = name.replace(old, new)
    return name


def read_llama_config(directory: str | Path, max_seq_len: Optional[int] = None) -> ModelConfig:
    """The decoder shape a Llama-format directory's config.json describes."""
    directory = Path(directory)
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{directory}: no config.json (expected a Llama-format checkpoint directory)")
    try:
        return ModelConfig.from_hf_config(json.loads(config_path.read_text()), str(config_path), max_seq_len)
    except ValueError as exc:  # ConfigError, or JSON that does not parse
        raise CheckpointError(f"{config_path}: {exc}" if str(config_path) not in str(exc) else str(exc)) from None


def load_llama_dir(directory: str | Path, dtype: torch.dtype | str = torch.float32,
                   device: torch.device | str = "cpu", max_seq_len: Optional[int] = None
                   ) -> Tuple[Decoder, Optional["tokenizers.Tokenizer"]]:  # noqa: F821
    """A Llama/Mistral-format checkpoint directory as a Decoder, plus its tokenizer if it has one.

    ``max_seq_len`` caps the rotary table (default: the config's max_position_embeddings).
    """
    from safetensors.torch import load_file

    directory = Path(directory)
    if isinstance(dtype, str):
        dtype = torch_dtype(dtype)
    model_cfg = read_llama_config(directory, max_seq_len)
    hf_config = json.loads((directory / "config.json").read_text())
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{directory}: no *.safetensors files (only safetensors weights are read)")
    tensors: Dict[str, torch.Tensor] = {}
    for f in files:
        for name, t in load_file(str(f)).items():
            tensors[_llama_name(name)] = t
    if hf_config.get("tie_word_embeddings") and "lm_head.weight" not in tensors and "embed.weight" in tensors:
        tensors["lm_head.weight"] = tensors["embed.weight"]  # tied: the head reuses the embedding

    attention = AttentionConfig.for_heads(model_cfg.num_heads, model_cfg.preset_kv_heads)
    with torch.device("meta"):
        expected = {k: v.shape for k, v in Decoder(model_cfg, attention).state_dict().items()}
    missing = sorted(expected.keys() - tensors.keys())
    unexpected = sorted(tensors.keys() - expected.keys())
    # Rotary inverse frequencies some exporters store are recomputed, not loaded.
    unexpected = [k for k in unexpected if not k.endswith("rotary_emb.inv_freq")]
    if missing or unexpected:
        raise CheckpointError(f"{directory}: tensor names do not match a Llama decoder: "
                              f"missing {missing[:5]}{' …' if len(missing) > 5 else ''}, "
                              f"unexpected {unexpected[:5]}{' …' if len(unexpected) > 5 else ''}")
    for name, shape in expected.items():
        if tensors[name].shape != shape:
            raise CheckpointError(f"{directory}: tensor {name} has shape {tuple(tensors[name].shape)}, "
                                  f"config.json implies {tuple(shape)}")
    decoder = build_decoder(model_cfg, attention, {k: tensors[k] for k in expected}, dtype, device)

    tokenizer = None
    if (directory / "tokenizer.json").is_file():
        from tokenizers import Tokenizer
        tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    return decoder, tokenizer


# ---- changing the KV-head count ------------------------------------------------------------

def kv_conversion(old: int, new: int) -> str:
    """How :func:`convert_kv_heads` takes ``old`` KV heads to ``new``: ``none``, ``repeat``
    (exact: every query head reads the same K/V as before) or ``mean-pool`` (an approximation,
    Ainslie et al. 2023). Raises :class:`CheckpointError` naming ``attention.num_kv_heads``
    when neither applies."""
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

    Query head h reads KV head h // G with contiguous groups. Fewer heads: new KV head j is the
    mean of old heads j*r .. (j+1)*r - 1, r = old / new (MHA → GQA/MQA, Ainslie et al. 2023).
    More heads: new head j is a copy of old head j // r, r = new / old, so every query head
    reads exactly the K/V it read before and the model computes the same function (GQA → MHA).
    """
    old = model.num_kv_heads
    how = kv_conversion(old, num_kv_heads)
    D = model.config.head_dim
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for name in list(state):
        if how != "none" and name.endswith((".attn.wk.weight", ".attn.wv.weight")):
            w = state[name]  # (old H_kv * D, C)
            if how == "mean-pool":
                heads = w.float().view(num_kv_heads, old // num_kv_heads, D, -1).mean(dim=1).to(w.dtype)
            else:
                heads = w.view(old, D, -1).repeat_interleave(num_kv_heads // old, dim=0)
            state[name] = heads.reshape(num_kv_heads * D, -1)  # (H_kv, D, C) -> (H_kv * D, C)
    attention = AttentionConfig.for_heads(model.config.num_heads, num_kv_heads)
    return build_decoder(model.config, attention, state, device=model.device)
