"""The one decoder kvbench measures: Llama-style (RMSNorm, rotary embeddings, SwiGLU); Qwen2's
q/k/v biases, Qwen3's q/k norms and Qwen3.5's zero-centred norms are config fields, and an MLP is
dense or a mixture of experts (:mod:`kvbench.mlp`). Each block's attention is its layer's layout
(:mod:`kvbench.layouts`), built once; the decoder never branches on it.

Notation: B batch, T new tokens, V vocab.
"""

from __future__ import annotations

from typing import List, Optional

import torch
from torch import nn

from kvbench.blocks.hyper_block import HyperBlock
from kvbench.blocks.hyper_connection import HyperHead, expand
from kvbench.blocks.residual import PerLayerBranch, PerLayerInputs
from kvbench.cache import Positions, uncached_layers
from kvbench.config.model import AttentionConfig, ModelConfig
from kvbench.core.dtypes import DTYPE_BYTES
from kvbench.layouts.attention import attention_module
from kvbench.layouts.base import LayerLayout
from kvbench.layouts.build import build_layouts
from kvbench.layouts.kv_heads import kv_group_map
from kvbench.mlp.beside import mlp_module
from kvbench.mlp.dense import MLP
from kvbench.norm import Float32RMSNorm, RMSNorm
from kvbench.rope import rope_tables


def torch_dtype(name: str) -> torch.dtype:
    """``runtime.dtype`` (float32 | float16 | bfloat16) as a torch dtype."""
    if name not in DTYPE_BYTES:
        raise ValueError(f"dtype={name!r}: must be one of {', '.join(DTYPE_BYTES)}")
    return getattr(torch, name)


class Block(nn.Module):
    """Pre-norm residual block: the layer's attention, then its MLP (none in ``model.no_mlp_layers``:
    a checkpoint whose layers are one mixer each, as Nemotron-H's, runs a mixer directly followed by
    another as a block without one). ``model.residual`` (Gemma 4): each branch's output normed before
    it joins, a per-layer input's branch after the MLP's, the output times the layer's scalar."""

    def __init__(self, cfg: ModelConfig, layout: LayerLayout, index: int):
        super().__init__()
        self.residual = cfg.multipliers.residual_multiplier if cfg.multipliers else 1.0  # Granite's: each branch
        form = cfg.residual
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.norm_zero_centered)
        self.attn = attention_module(cfg, layout)
        self.attn_post_norm = self.mlp_post_norm = self.mlp_norm = self.mlp = self.per_layer = None
        if form is not None and form.post_norms:
            self.attn_post_norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.norm_zero_centered)
        if index not in (cfg.no_mlp_layers or ()):
            self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.norm_zero_centered)
            self.mlp = mlp_module(cfg, index)  # dense, or a mixture of experts (kvbench.mlp)
            if form is not None and form.shared_mlp_factor > 1 and layout.kv_source is not None:
                self.mlp = MLP(cfg, cfg.ffn_dim * form.shared_mlp_factor)  # Gemma 4 E2B: its dense MLP, no bias
            if form is not None and form.post_norms:
                self.mlp_post_norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.norm_zero_centered)
        if form is not None and form.per_layer_input_dim:
            self.per_layer = PerLayerBranch(cfg)
        self.register_buffer("layer_scalar", torch.ones(1) if form is not None and form.layer_scalar else None)

    def forward(self, x, cos, sin, cache, pos, per_layer_input=None, tokens=None):
        x = x + self._scaled(self._normed(self.attn_post_norm, self.attn(self.attn_norm(x), cos, sin, cache, pos)))
        if self.mlp is not None:
            # Gemma 4's experts beside its dense MLP read the residual stream too (kvbench.mlp.beside)
            branch = self.mlp(self.mlp_norm(x), x) if getattr(self.mlp, "reads_stream", False) else \
                self.mlp(self.mlp_norm(x))
            x = x + self._scaled(self._normed(self.mlp_post_norm, branch))
        if self.per_layer is not None:
            x = x + self.per_layer(x, per_layer_input)
        return x if self.layer_scalar is None else x * self.layer_scalar

    @staticmethod
    def _normed(norm, branch):
        return branch if norm is None else norm(branch)

    def _scaled(self, branch):
        return branch if self.residual == 1.0 else branch * self.residual


class Decoder(nn.Module):
    """Token embedding, ``num_layers`` blocks, final RMSNorm and LM head."""

    def __init__(self, model: ModelConfig, attention: Optional[AttentionConfig] = None,
                 state_dtype: str = "float32"):
        super().__init__()
        attention = (attention or AttentionConfig(type="mha")).resolved(model)
        self.config, self.attention, self.state_dtype = model, attention, state_dtype
        self.layouts = build_layouts(model, attention, state_dtype)
        # On the meta device (parameter counts, footprints, checkpoint loads) nothing is initialised:
        # normal_ or arange on meta loads torch._dynamo (~1.3 s of CPU).
        meta = torch.empty(0).is_meta
        self.embed = nn.Embedding(model.vocab_size, model.d_model,
                                  _weight=torch.empty(model.vocab_size, model.d_model) if meta else None)
        hc = model.hyper_connections  # DeepSeek-V4's residual streams: its block, and a head collapsing them
        self.blocks = nn.ModuleList((HyperBlock if hc else Block)(model, layout, i)
                                    for i, layout in enumerate(self.layouts))
        self.hc_head = HyperHead(model.d_model, hc.streams, hc.eps, model.norm_eps) if hc else None
        form = model.residual
        self.per_layer = PerLayerInputs(model) if form is not None and form.per_layer_input_dim else None
        # with the streams, transformers' DeepseekV4's final norm: a float32 weight (RMSNorm's in float32)
        self.norm = Float32RMSNorm(model.d_model, model.norm_eps) if hc else \
            RMSNorm(model.d_model, model.norm_eps, model.norm_zero_centered)
        self.lm_head = nn.Linear(model.d_model, model.vocab_size, bias=False)
        self.rope_dim = self.layouts.rotary_dim()
        if meta:  # rope_tables' shapes and dtype, no values
            cos, sin = (torch.empty(model.max_seq_len, self.rope_dim, dtype=torch.float32) for _ in range(2))
        else:
            cos, sin = rope_tables(model, self.rope_dim)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @property
    def num_kv_heads(self) -> int:
        return self.attention.num_kv_heads

    def kv_groups(self) -> List[int]:
        return kv_group_map(self.config.num_heads, self.num_kv_heads)

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def hold_states_in(self, state_dtype: str) -> "Decoder":
        """Hold the recurrent layers' states in ``state_dtype`` (``cache.state_dtype``) from now on: a
        checkpoint's decoder is built before the run's cache config reaches it. No weight changes."""
        self.state_dtype, self.layouts = state_dtype, build_layouts(self.config, self.attention, state_dtype)
        return self

    def num_params(self) -> int:
        """Parameters, a tied tensor counted once."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, tokens: torch.Tensor, cache=None, start_pos: int | Positions = 0,
                mask: Optional[torch.Tensor] = None, last_only: bool = False) -> torch.Tensor:
        """tokens (B, T) -> logits (B, T, V), or (B, 1, V) with ``last_only`` (a prefill needs only
        the last; all T would cost B*T*V floats).

        ``start_pos``: the first new token's position, or :class:`~kvbench.cache.Positions` for all.
        Without a cache the tokens attend only to each other; ``mask`` (T, S) then replaces the
        causal rule (an ablation).
        """
        B, T = tokens.shape
        pos = start_pos if isinstance(start_pos, Positions) else Positions(start_pos, T, tokens.device)
        if pos.start is not None and pos.end > self.config.max_seq_len:
            raise ValueError(f"sequence of {pos.end} positions exceeds model.max_seq_len={self.config.max_seq_len}")
        if cache is None:
            layer_caches = uncached_layers(self.layouts, mask)
        else:
            layer_caches = cache.begin(pos, B)
        x = self.embed(tokens)
        scales, form = self.config.multipliers, self.config.residual
        if scales is not None and scales.embedding_multiplier != 1.0:  # Granite's
            x = x * scales.embedding_multiplier
        if form is not None and form.embed_scale is not None:  # Gemma's: the factor in the compute dtype
            x = x * torch.tensor(form.embed_scale, dtype=x.dtype)
        per_layer = None if self.per_layer is None else self.per_layer(tokens, x)  # (B, T, L, P)
        cos, sin = self.rope_cos[pos.rows].to(x.dtype), self.rope_sin[pos.rows].to(x.dtype)
        if self.hc_head is not None:
            x = expand(x, self.config.hyper_connections.streams)  # (B, T, N, C)
        for i, (block, layer_cache) in enumerate(zip(self.blocks, layer_caches)):
            x = block(x, cos, sin, layer_cache, pos, None if per_layer is None else per_layer[:, :, i], tokens=tokens)
        if cache is not None:
            cache.commit(pos)
        if last_only:
            x = x[:, -1:]
        if self.hc_head is not None:
            x = self.hc_head(x)
        logits = self.lm_head(self.norm(x))
        if form is not None and form.logit_softcap is not None:
            logits = torch.tanh(logits / form.logit_softcap) * form.logit_softcap
        return logits if scales is None or scales.logits_scaling == 1.0 else logits / scales.logits_scaling

