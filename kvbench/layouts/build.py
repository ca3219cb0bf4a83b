"""The decoder's layer layouts from its config: the one place a config becomes layouts."""

from __future__ import annotations

from kvbench.layouts.base import Layouts
from kvbench.layouts.kv_heads import KVHeads
from kvbench.layouts.kv_sharing import share_kv
from kvbench.layouts.latent import Latent


def build_layouts(model, attention) -> Layouts:
    """One layout per layer of ``model`` (a ModelConfig) under ``attention`` (an
    AttentionConfig resolved against it)."""
    windows = attention.layer_windows(model.num_layers)
    if attention.latent:
        layers = [Latent(i, w, model.num_heads, attention.q_lora_rank, attention.kv_lora_rank,
                         attention.qk_nope_head_dim, attention.qk_rope_head_dim, attention.v_head_dim,
                         attention.mla_decode == "absorbed", attention.index_n_heads or 0,
                         attention.index_head_dim or 0, attention.index_topk or 0) for i, w in enumerate(windows)]
    else:
        layers = [KVHeads(i, w, model.num_heads, attention.num_kv_heads, model.head_dim, bool(attention.sinks))
                  for i, w in enumerate(windows)]
    return Layouts(share_kv(layers, attention.kv_shared_layers))
