"""How attention reads its keys: the SDPA calls behind every layout, chosen by shape, never by
a variant name (:mod:`kvbench.model` holds the modules that call them).

- :func:`grouped_attention`: MHA/GQA/MQA; a decode step folds the G query heads of a group into
  the query rows (each KV head read once); prefill takes SDPA's causal path with ``enable_gqa``.
- :func:`prefix_attention`: one softmax over a batch-1 shared prefix and each sequence's keys.
- :func:`causal_mask`, :func:`window_mask`: bottom-right causal masks, with a sliding window.
- :func:`latent_attention`: MLA's keys and values of their own widths, with a shared prefix.

Notation: B batch, T new tokens, S keys attended (cached + new), H query heads, H_kv KV heads,
G = H / H_kv, D head_dim, P a shared prefix's positions, W a window.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def causal_mask(T: int, S: int, device, window: Optional[int] = None, key_start: Optional[int] = None,
                query_start: Optional[int] = None) -> torch.Tensor:
    """(T, S) bool, True = attend: bottom-right causal (new token i, at key index S - T + i, sees
    the S - T keys before the new ones and the new ones up to itself). With ``window`` W a query
    at position p also sees only keys at positions > p - W (W keys, itself included: the rule of
    transformers' ``sliding_window_overlay``); key j sits at position ``key_start + j`` and query
    i at ``query_start + i`` (default: keys 0..S-1, queries the last T of them)."""
    key_start = 0 if key_start is None else key_start
    query_start = key_start + S - T if query_start is None else query_start
    q_pos = torch.arange(query_start, query_start + T, device=device)[:, None]  # (T, 1)
    k_pos = torch.arange(key_start, key_start + S, device=device)[None]  # (1, S)
    mask = k_pos <= q_pos
    return mask if window is None else mask & (k_pos > q_pos - window)


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      mask: Optional[torch.Tensor] = None,
                      prefix: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
    """Attention where query head h reads KV head h // G, without copying K/V per query head.

    q (B, H, T, D); k, v (B, H_kv, S, D); mask bool (T, S) or (B, T, S), True = attend, or None
    for causal (:func:`causal_mask`; a decode step's one query sees every key). ``prefix``: K/V
    (1, H_kv, P, D) that all B sequences attend before their own S keys (a shared system
    prompt); the mask then covers P + S keys. Returns (B, H, T, D).

    Three paths, chosen by shape, never by a variant name:
    - decode (T = 1): the G query heads of a group are folded into the query rows, (B, H_kv, G, D),
      so one SDPA call reads each KV head once; a (1, S) mask broadcasts over the rows.
    - causal prefill (no mask, S = T): SDPA's causal path (``is_causal``, which skips the masked
      half) with ``enable_gqa``, for every KV-head count alike.
    - anything else (a prompt after cached keys, a window, a given mask): SDPA with the (T, S)
      mask broadcast over heads, not repeated per query head, and ``enable_gqa``.
    Folding a T > 1 prompt instead (G*T rows with a G-times repeated mask) lost the causal path and
    made prefill slower the fewer KV heads there were (issue 28): MQA 2x MHA at T = 2048.
    """
    B, H, T, D = q.shape
    H_kv, S = k.shape[1], k.shape[2]
    G = H // H_kv
    if prefix is not None:
        if mask is None and T > 1:
            mask = causal_mask(T, prefix[0].shape[2] + S, q.device)
        out = prefix_attention(q.reshape(B, H_kv, G * T, D), k, v, mask, *prefix)  # (B, H_kv, G*T, D)
    elif T == 1:
        if mask is not None and mask.dim() == 3:
            mask = mask[:, None]  # (B, 1, 1, S): the same keys for all heads and rows
        out = F.scaled_dot_product_attention(q.reshape(B, H_kv, G, D), k, v, attn_mask=mask)  # (B, H_kv, G, D)
    elif mask is None and S == T:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=G > 1)  # (B, H, T, D)
    else:
        if mask is None:
            mask = causal_mask(T, S, q.device)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None] if mask.dim() == 3 else mask,
                                             enable_gqa=G > 1)
    # reshape, not view: CUDA's fused SDPA kernels return (B, H_kv, M, D) laid out as
    # (B, M, H_kv, D) in memory, where H_kv and G cannot merge without a copy.
    return out.reshape(B, H, T, D)


def prefix_attention(q, k, v, mask, k_prefix, v_prefix) -> torch.Tensor:
    """One softmax over a batch-1 prefix's keys and each sequence's own keys.

    q (B, H_kv, M, D) with M = G*T folded rows (row g*T + t: query head kv*G + g at token t);
    k, v (B, H_kv, S, D); k_prefix, v_prefix (1, H_kv, P, D); mask None, (T, P + S) or
    (B, T, P + S), broadcast over the G heads of a row block (never repeated G times). The B
    sequences are folded into the query rows for the prefix, as the G heads are, so the prefix
    is read once and never expanded to B copies. Returns (B, H_kv, M, D).
    """
    B, H_kv, M, D = q.shape
    P = k_prefix.shape[2]
    rows = q.transpose(0, 1).reshape(1, H_kv, B * M, D)  # row b*M + m is sequence b's row m
    s_prefix = (rows @ k_prefix.transpose(-1, -2)).view(H_kv, B, M, P).transpose(0, 1)  # (B, H_kv, M, P)
    scores = torch.cat([s_prefix, q @ k.transpose(-1, -2)], dim=-1) * D ** -0.5  # (B, H_kv, M, P + S)
    if mask is not None:
        T = mask.shape[-2]
        blocks = scores.view(B, H_kv, M // T, T, P + k.shape[2])  # (B, H_kv, G, T, P + S)
        blocks.masked_fill_(~(mask if mask.dim() == 2 else mask[:, None, None]), float("-inf"))
    # Softmax in float32 as SDPA's math path does, so half precision matches the plain path.
    probs = scores.float().softmax(-1).to(q.dtype)
    p_prefix = probs[..., :P].transpose(0, 1).reshape(1, H_kv, B * M, P)
    out_prefix = (p_prefix @ v_prefix).view(H_kv, B, M, D).transpose(0, 1)  # (B, H_kv, M, D)
    return (probs[..., P:] @ v).add_(out_prefix)  # in place: keeps the contiguous layout view() needs


def window_mask(window: int, start_pos: int, T: int, S: int, device, prefix_len: int = 0,
                prefix_end: int = 0) -> Optional[torch.Tensor]:
    """The mask of a local layer whose T queries start at ``start_pos`` over S own keys that end
    at position start_pos + T - 1 in order (what caches return to a prompt), or, for a decode
    step (T = 1) over at most W keys, in any order (a ring's; all in the window). With a shared
    prefix, its ``prefix_len`` keys (positions prefix_end - prefix_len .. prefix_end - 1) come
    first. None where every key is in the window."""
    if T == 1 and S <= window:
        if not prefix_len:
            return None
        own = torch.ones(1, S, dtype=torch.bool, device=device)
    else:
        end = start_pos + T
        own = causal_mask(T, S, device, window, key_start=end - S, query_start=start_pos)  # (T, S)
    if not prefix_len:
        return own
    prefix = causal_mask(T, prefix_len, device, window, key_start=prefix_end - prefix_len, query_start=start_pos)
    return torch.cat([prefix, own], dim=-1)  # (T, prefix_len + S)


def latent_attention(q, k, v, mask, scale: float, prefix=None, causal: bool = False) -> torch.Tensor:
    """Softmax(q k^T * scale) v with K and V of their own widths, and a batch-1 ``prefix``
    (k_p, v_p) every sequence attends before its own keys (read once, B folded into its rows).

    q (B, H_k, M, Dk); k (B, H_k, S, Dk); v (B, H_k, S, Dv); prefix (1, H_k, P, Dk), (1, H_k, P, Dv);
    mask None or bool broadcasting to (B, H_k, M, P + S); ``causal`` (no prefix, M = S, no mask):
    SDPA's causal path. Returns (B, H_k, M, Dv)."""
    if prefix is None:
        Dk, Dv = q.shape[-1], v.shape[-1]
        if q.shape[-2] > 1 and Dk != Dv:
            # SDPA's fused kernels (flash on CPU and CUDA) need one head width for q, k and v; with
            # two it takes the math path, which holds the (M, S) scores of every head: at 256 tokens
            # 4x the memory of a prefill, so MLA's capacity would be ours, not the layout's. Zero
            # columns change no dot product and no output column (what vLLM does for MLA's prefill).
            D = max(Dk, Dv)
            q, k, v = (F.pad(t, (0, D - t.shape[-1])) for t in (q, k, v))
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, is_causal=causal)[..., :Dv]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, is_causal=causal)
    (k_p, v_p), (B, H_k, M, Dk), P = prefix, q.shape, prefix[0].shape[2]
    rows = q.transpose(0, 1).reshape(1, H_k, B * M, Dk)  # row b*M + m is sequence b's row m
    s_prefix = (rows @ k_p.transpose(-1, -2)).view(H_k, B, M, P).transpose(0, 1)  # (B, H_k, M, P)
    scores = torch.cat([s_prefix, q @ k.transpose(-1, -2)], dim=-1) * scale  # (B, H_k, M, P + S)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = scores.float().softmax(-1).to(q.dtype)
    p_prefix = probs[..., :P].transpose(0, 1).reshape(1, H_k, B * M, P)
    out_prefix = (p_prefix @ v_p).view(H_k, B, M, -1).transpose(0, 1)  # (B, H_k, M, Dv)
    return probs[..., P:] @ v + out_prefix
