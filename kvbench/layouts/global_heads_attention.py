"""The attention of a :class:`~kvbench.layouts.global_heads.GlobalHeads` layer: heads of its own width
and count, rotary embeddings of its own base and frequencies, and with ``k_eq_v`` one cached tensor.

K=V (transformers' ``Gemma4TextAttention`` with ``attention_k_eq_v``): x = k_proj(h) per KV head; the
value is v_norm(x) (an RMS norm without a scale) with ``model.v_norm``, else x; the key
is rope(k_norm(x)). Only the value is cached; the key is derived from it where it is read:
k_norm(x) = v_norm(x) * w exactly (the same float32 normalisation times the key norm's weight), or
k_norm(value) without a value norm. The positions a global layer's cache returns are 0..S-1 in order
(a static, concat or paged cache; a recompute's are the new tokens'), so each key's rotation is its
index's; a shared prefix and the fixed-shape step are refused by the layout's limits.

Its rotary table is its own (``rope_theta``, proportional frequencies: transformers' ``proportional``
rope type, the first int(p D / 2) of D/2 frequencies and zeros), computed in float32 from the
positions as transformers computes it, and kept for the positions read so far.

A decode step's keys cost one pass over the cached values, not one per operation: the key norm's weight
w is folded into the held tables (x w cos and its partner's w sin, per position; :meth:`_key_tables`),
so key = x * (w cos) + partner(x) * (w' sin) is one multiply over the head and one multiply-add over
each turning half (a proportional rope's turning dims only), in the cache's dtype, no float32 copy. It
is the same float32 arithmetic as transformers' within rounding (the products associate otherwise),
which the parity tests hold to 1e-5. A prompt's keys (a recompute, or with autograd on) are derived as
transformers does. What remains is inherent to holding one tensor: that pass, writing the keys the
attention then reads (an engine fusing it into the attention's read of the cache would not write them).

Notation: B batch, T new tokens, S keys attended, H query heads, H_kv KV heads, D head_dim.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Tuple

import torch
from torch import nn

from kvbench.layouts.global_heads import GlobalHeads
from kvbench.layouts.kv_heads_attention import KVHeadsAttention, grouped_attention
from kvbench.norm import unscaled_rms_norm
from kvbench.rope import apply_rope, rope_attention_factor, rope_inv_freq


class GlobalHeadsAttention(KVHeadsAttention):
    """A :class:`KVHeadsAttention` whose layer is global, of its own heads, rotary table and (``k_eq_v``)
    one projection as keys and values: no ``wv`` then."""

    def __init__(self, cfg, layout: GlobalHeads):
        super().__init__(cfg, layout)
        self.k_eq_v = layout.k_eq_v
        if self.k_eq_v and not self.shared:
            del self.wv
        self.layout, self.cfg = layout, cfg
        self._inv_freq: torch.Tensor | None = None  # made where first asked: a decoder is built on the meta device
        self._table: Tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin of positions 0..n-1 read so far
        # the key tables of positions 0..n-1 (:meth:`_key_tables`), with what they were made for
        self._keys: Tuple[tuple, Tuple[torch.Tensor, ...]] | None = None

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        """The layer's rotary inverse frequencies (float32), on ``device``."""
        if self._inv_freq is None or self._inv_freq.device != device:
            layout, cfg, D = self.layout, self.cfg, self.layout.head_dim
            with torch.device("cpu"):
                if layout.proportional:  # the first rotary / 2 of D/2 frequencies over the whole head, the rest zero
                    half, theta = layout.rotary_dims // 2, layout.rope_theta or cfg.rope_theta
                    turning = 1.0 / theta ** (torch.arange(0, 2 * half, 2, dtype=torch.int64).float() / D)
                    inv_freq, self.rope_factor = torch.cat([turning, torch.zeros(D // 2 - half)]), 1.0
                else:  # kvbench's partial rotary: the first `rotary` dims, the model's scaling, its base or the layer's
                    rope = cfg if layout.rope_theta is None else replace(cfg, rope_theta=layout.rope_theta, path=None)
                    inv_freq = rope_inv_freq(rope, layout.rotary_dims).float()
                    self.rope_factor = rope_attention_factor(rope)
            self._inv_freq = inv_freq.to(device)
        return self._inv_freq

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (..., R) of ``positions`` as transformers computes them (float32 angles)."""
        angles = positions.float()[..., None] * self.inv_freq(positions.device)
        angles = torch.cat([angles, angles], dim=-1)
        return (angles.cos() * self.rope_factor).to(dtype), (angles.sin() * self.rope_factor).to(dtype)

    def _first(self, S: int, dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of positions 0..S-1, from a table grown by doubling (a decode step adds no trig)."""
        device = self.wq.weight.device
        if self._table is None or self._table[0].shape[0] < S or self._table[0].dtype != dtype \
                or self._table[0].device != device:
            held = max(S, 2 * (0 if self._table is None else self._table[0].shape[0]))
            self._table = self.rope(torch.arange(held, device=device), dtype)
        return self._table[0][:S], self._table[1][:S]

    def forward(self, x, cos, sin, cache, pos):
        B, T, _ = x.shape
        H, H_kv, D = self.num_heads, self.num_kv_heads, self.head_dim
        q = self.wq(x).view(B, T, H, -1)
        gate = None
        if self.gated:
            q, gate = q.chunk(2, dim=-1)
        q_cos, q_sin = self.rope(pos.ids, x.dtype)  # (T, R) or (B, T, R): its own table, not the decoder's
        q = apply_rope(self.q_norm(q).transpose(1, 2), q_cos, q_sin)  # (B, H, T, D)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        k = v = None
        if not self.shared:
            raw = self.wk(x).view(B, T, H_kv, D)
            if self.k_eq_v:  # one tensor cached: the value; the keys follow from it below
                k = (unscaled_rms_norm(raw, self.eps) if self.v_norm else raw).transpose(1, 2)
            else:
                v = self.wv(x).view(B, T, H_kv, D)
                v = (unscaled_rms_norm(v, self.eps) if self.v_norm else v).transpose(1, 2)
                k = apply_rope(self.k_norm(raw).transpose(1, 2), q_cos, q_sin)
        att = cache.update(k, v, pos)  # (B, H_kv, S, D) each; K=V: the values, v None
        keys, values = att.k, att.v
        if self.k_eq_v:
            S = keys.shape[2]
            # a recompute's keys are its new tokens' (S = T); every cache's are positions 0..S-1
            recompute = S == T and pos.start is not None
            if recompute or torch.is_grad_enabled():  # a prompt's, or trained: as transformers computes them
                k_cos, k_sin = (q_cos, q_sin) if recompute and q_cos.dim() == 2 else self._first(S, keys.dtype)
                values, keys = keys, apply_rope(self._key_norm(keys.transpose(1, 2)).transpose(1, 2), k_cos, k_sin)
            else:
                values, keys = keys, self._derived_keys(keys)
        out = grouped_attention(q, keys, values, att.mask, att.prefix, self.sinks).transpose(1, 2)  # (B, T, H, D)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.wo(out.reshape(B, T, -1))

    def _key_norm(self, values: torch.Tensor) -> torch.Tensor:
        """The keys (B, S, H_kv, D) before rotation from the cached values: k_norm(x) = v_norm(x) x its weight
        (exactly: the value is x's float32 normalisation), or k_norm(x) of x itself."""
        if not self.v_norm or isinstance(self.k_norm, nn.Identity):
            return self.k_norm(values)
        weight = self.k_norm.weight.float()
        scale = 1.0 + weight if self.k_norm.zero_centered else weight
        return (values.float() * scale).type_as(values)

    def _key_scale(self) -> torch.Tensor | None:
        """The weight the key norm multiplies a cached value by (D,), or None: the values are the
        pre-rotation keys as they are (no key norm) or only after a norm of their own (no value norm)."""
        if not self.v_norm or isinstance(self.k_norm, nn.Identity):
            return None
        weight = self.k_norm.weight
        return 1.0 + weight if self.k_norm.zero_centered else weight

    def _key_tables(self, S: int, dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
        """For positions 0..S-1: a (S, D) = w cos (1 past the rotary dims), b1 (S, t) = -w[h:h+t] sin and
        b2 (S, t) = w[:t] sin, h the rotate-half offset and t the turning pairs (a proportional rope's
        nonzero frequencies); kept grown by doubling, remade when the weight changes (its version)."""
        scale = self._key_scale()
        device = self.wq.weight.device
        made_for = (dtype, device, None if scale is None else _version(self.k_norm.weight))
        if self._keys is None or self._keys[0] != made_for or self._keys[1][0].shape[0] < S:
            held = max(S, 2 * (0 if self._keys is None or self._keys[0] != made_for else self._keys[1][0].shape[0]))
            angles = torch.arange(held, device=device).float()[:, None] * self.inv_freq(device)  # (S, R/2)
            h, D = angles.shape[1], self.head_dim
            t = int(torch.count_nonzero(self.inv_freq(device)))  # leading: a proportional rope's zeros trail
            cos = torch.cat([angles.cos(), angles.cos(), torch.ones(held, D - 2 * h, device=device)], -1)
            sin = angles[:, :t].sin()
            w = torch.ones(D, device=device) if scale is None else scale.detach().float()
            self._keys = made_for, (
                (cos * self.rope_factor * w).to(dtype), (-sin * self.rope_factor * w[h:h + t]).to(dtype),
                (sin * self.rope_factor * w[:t]).to(dtype), h, t)
        a, b1, b2, h, t = self._keys[1]
        return a[:S], b1[:S], b2[:S], h, t

    def _derived_keys(self, values: torch.Tensor) -> torch.Tensor:
        """The rotated keys (B, H_kv, S, D) of the cached values at positions 0..S-1 in one pass over them:
        x * (w cos) over the head, + partner(x) * (w sin) over each turning half (:meth:`_key_tables`)."""
        x = values if self._key_scale() is not None or isinstance(self.k_norm, nn.Identity) else \
            self._key_norm(values.transpose(1, 2)).transpose(1, 2)  # a key norm of its own: the norm first
        a, b1, b2, h, t = self._key_tables(x.shape[2], x.dtype)
        keys = torch.mul(x, a)
        if t:
            keys[..., :t].addcmul_(x[..., h:h + t], b1)
            keys[..., h:h + t].addcmul_(x[..., :t], b2)
        return keys


def _version(weight: torch.Tensor) -> tuple:
    """What says ``weight`` changed: its identity and version counter (a weight made under inference
    mode has none, and cannot change outside it)."""
    try:
        return id(weight), weight._version
    except RuntimeError:
        return id(weight), None
