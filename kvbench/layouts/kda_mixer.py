"""The attention of a KDA layer (:class:`kvbench.layouts.kda.KDA`), as transformers'
KimiLinearDeltaAttention (its torch path: chunk_kimi_delta_attention, recurrent_kimi_delta_attention),
in plain torch.

Per token: ``wq``, ``wk``, ``wv`` x pass causal depthwise convolutions of K taps (``q_conv`` …) and SiLU and
split into H heads of d; q and k are L2-normalised per head and q scaled by d^-0.5. The decay
gate is per key channel: f = ``gate_up``(``gate_down`` x) + ``decay_bias`` (H d), and
g = -exp(``log_decay_rate``) softplus(f) per head, or with a lower bound L, g = L sigmoid(exp(A) f).
beta = sigmoid(``w_beta`` x) is each head's write strength. With S the head's d x d state (rows:
key channels), the gated delta rule is

    S <- diag(exp(g_t)) S;   S <- S + k_t (beta_t (v_t - S^T k_t))^T;   o_t = S^T q_t

A prompt runs its chunked form (:func:`chunked_kda`: a chunk at a time, the state carried from
chunk to chunk, so its working memory is O(chunk) whatever the prompt's length), a decode step
its recurrent form (:func:`recurrent_kda`). o is RMS-normalised per head, gated by
sigmoid(``out_gate_up``(``out_gate_down`` x)) and projected by ``wo``. :data:`HF_NAMES` maps
transformers' parameter names.

Notation: B batch, T new tokens, H heads of d (key and value widths alike), L tokens of a chunk.
"""

from __future__ import annotations

from typing import Dict, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from kvbench.layouts.kda import KDA

# transformers' names under a layer's ``self_attn``, as its modules hold them (the forget gate a
# submodule) and as Kimi's files and save_pretrained write them (the gate's tensors at the top, a
# convolution per q, k, v): a key ending in "." renames a submodule
HF_NAMES = {"q_proj.": "wq.", "k_proj.": "wk.", "v_proj.": "wv.", "q_conv1d.": "q_conv.", "k_conv1d.": "k_conv.",
            "v_conv1d.": "v_conv.", "b_proj.": "w_beta.", "g_a_proj.": "out_gate_down.", "g_b_proj.": "out_gate_up.",
            "o_norm.": "norm.", "o_proj.": "wo.",
            **{f"{where}{old}": new for where in ("forget_gate.", "")
               for old, new in (("f_a_proj.", "gate_down."), ("f_b_proj.", "gate_up."), ("dt_bias", "decay_bias"),
                                ("A_log", "log_decay_rate"))}}


class KDAAttention(nn.Module):
    """The attention of a :class:`KDA` layer (its cache: :class:`~kvbench.state_cache.StateLayer`); takes the
    decoder's attention arguments (rotary tables unused) so that a block calls it like any layer's."""

    HF_MODULE = "self_attn"
    HF_NAMES = HF_NAMES
    # transformers' modules hold one depthwise convolution over q, k and v (its state dict's name)
    HF_FUSED = {"conv1d.weight": ("q_conv.weight", "k_conv.weight", "v_conv.weight")}

    def __init__(self, cfg, layout: KDA):
        super().__init__()
        C, K = cfg.d_model, layout.linear_conv_kernel_dim
        self.H, self.d, inner = layout.linear_num_heads, layout.linear_head_dim, layout.inner_dim
        self.chunk, self.lower_bound = layout.chunk_size, layout.gate_lower_bound
        self.wq, self.wk, self.wv = (nn.Linear(C, inner, bias=False) for _ in range(3))
        # depthwise and causal, one per q, k and v as Kimi's files hold them: the cache hands the last
        # K - 1 inputs before the new ones, so no padding
        self.q_conv, self.k_conv, self.v_conv = (nn.Conv1d(inner, inner, K, groups=inner, bias=False)
                                                 for _ in range(3))
        # the decay gate, low rank through d (f_a_proj, f_b_proj), a bias per channel, a rate per head
        self.gate_down, self.gate_up = nn.Linear(C, self.d, bias=False), nn.Linear(self.d, inner, bias=False)
        self.decay_bias = nn.Parameter(torch.zeros(inner))  # dt_bias
        self.log_decay_rate = nn.Parameter(torch.zeros(1, 1, self.H, 1))  # A_log, one per head (Kimi's shape)
        self.w_beta = nn.Linear(C, self.H, bias=False)  # b_proj
        self.out_gate_down, self.out_gate_up = nn.Linear(C, self.d, bias=False), nn.Linear(self.d, inner, bias=False)
        self.norm = SigmoidGatedRMSNorm(self.d, cfg.norm_eps)
        self.wo = nn.Linear(inner, C, bias=False)

    def decay(self, x: torch.Tensor) -> torch.Tensor:
        """g (B, T, H, d), float32: each key channel's log decay at each token."""
        f = self.gate_up(self.gate_down(x)).float() + self.decay_bias.float()
        f = f.unflatten(-1, (self.H, self.d))
        rate = self.log_decay_rate.float().exp().view(self.H, 1)  # in float32: exp(A_log) can overflow in half
        if self.lower_bound is not None:  # flash-linear-attention's safe gate: g in (bound, 0)
            return self.lower_bound * torch.sigmoid(rate * f)
        # transformers' softplus, log(1 + exp(f)) below 20 (not log1p: the same roundings)
        return -rate * torch.where(f > 20.0, f, torch.log(1.0 + torch.exp(f)))

    def forward(self, x, cos, sin, cache, pos):
        B, T, _ = x.shape
        tail = self.q_conv.kernel_size[0] - 1
        # A prompt goes a chunk of tokens at a time through the whole layer, the conv tail and the
        # state carried between chunks, so its working memory is a chunk's whatever its length (its
        # projections included: all at once they grew 8x from 512 to 4,096 tokens). The last piece
        # holds at least the conv tail: the cache is handed that piece's inputs only, and writes its
        # tail from them (the held tail before the prompt comes back first), as Gated DeltaNet's.
        bounds = list(range(0, T, self.chunk)) + [T]
        if len(bounds) > 2 and T - bounds[-2] < tail:
            del bounds[-2]  # a last piece shorter than the tail joins the one before
        last = self._qkv(x[:, bounds[-2]:])  # (B, 3 H d, T - start of the last piece)
        carry = cache.update(last, pos)  # conv inputs (B, 3 H d, K - 1 + that)
        if len(bounds) == 2:
            # one new token after a held state is a decode step; a first token is a prompt, as transformers takes it
            rule = recurrent_kda if T == 1 and pos.start != 0 else chunked_kda
            return self._output(x, rule(*self._rule_inputs(x, carry.inputs), carry.state))
        out = x.new_empty(B, T, self.wo.out_features)
        inputs = carry.inputs[..., :tail]
        # the state carried from piece to piece keeps its graph (a training step backpropagates
        # through it); a copy, as chunked_kda's, and written back to the cache at the end
        S = carry.state.to(torch.float32, copy=True)
        for start, end in zip(bounds, bounds[1:]):
            new = last if end == T else self._qkv(x[:, start:end])
            inputs = torch.cat([inputs[..., inputs.shape[-1] - tail:], new], -1)  # (B, 3 H d, K - 1 + L)
            piece, S = kda_chunks(*self._rule_inputs(x[:, start:end], inputs), S, self.chunk)
            out[:, start:end] = self._output(x[:, start:end], piece)
        carry.state.copy_(S.detach())  # a cache carries the state on, never gradients through it
        return out

    def _qkv(self, x: torch.Tensor) -> torch.Tensor:
        """The convolution's inputs of tokens x (B, L, C): (B, 3 H d, L)."""
        return torch.cat([self.wq(x), self.wk(x), self.wv(x)], -1).transpose(1, 2)

    def _rule_inputs(self, x: torch.Tensor, inputs: torch.Tensor):
        """q, k, v, g (B, H, L, d) float32 (q normalised and scaled, k normalised), beta (B, H, L) of
        tokens x (B, L, C) from their conv inputs (B, 3 H d, K - 1 + L)."""
        weight = torch.cat([self.q_conv.weight, self.k_conv.weight, self.v_conv.weight])  # (3 H d, 1, K)
        qkv = F.silu(F.conv1d(inputs, weight, groups=weight.shape[0])).transpose(1, 2)  # (B, L, 3 H d)
        q, k, v = (t.unflatten(-1, (self.H, self.d)).transpose(1, 2).float() for t in qkv.chunk(3, -1))
        q, k = _unit(q) * self.d ** -0.5, _unit(k)  # (B, H, L, d), in float32 as flash-linear-attention
        g = self.decay(x).transpose(1, 2)  # (B, H, L, d)
        beta = self.w_beta(x).sigmoid().float().transpose(1, 2)  # (B, H, L)
        return q, k, v, g, beta

    def _output(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The layer's output (B, L, C) from the rule's (B, H, L, d) for tokens x (B, L, C)."""
        B, T, _ = x.shape
        out = out.transpose(1, 2).to(x.dtype)  # (B, L, H, d): transformers rounds to the compute dtype here
        gate = self.out_gate_up(self.out_gate_down(x)).view(B, T, self.H, self.d)
        return self.wo(self.norm(out, gate).reshape(B, T, -1))


class SigmoidGatedRMSNorm(nn.Module):
    """RMSNorm over a head's d channels in float32, weight included, then times sigmoid(gate)
    (transformers' KimiLinearRMSNormGated; Gated DeltaNet's gates by silu)."""

    def __init__(self, width: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = self.weight.float() * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps))
        return (h * torch.sigmoid(gate.float())).to(x.dtype)


def _unit(x: torch.Tensor) -> torch.Tensor:
    """Each vector over the last dim of unit length: x / sqrt(|x|^2 + 1e-6), flash-linear-attention's
    (and transformers' l2norm: a division, not a multiply by rsqrt)."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def recurrent_kda(q, k, v, g, beta, state: torch.Tensor) -> torch.Tensor:
    """The rule one token at a time. q, k, v, g (B, H, T, d) float32 (q normalised and scaled, k
    normalised), beta (B, H, T); ``state`` (B, H, d, d) advanced in place, in its own dtype (the
    arithmetic in float32). Returns the outputs (B, H, T, d) in float32."""
    S = state.float()
    out = v.new_empty(v.shape)
    for t in range(q.shape[2]):
        S = S * g[:, :, t, :, None].exp()  # each key channel (a row of S) by its own gate
        delta = (v[:, :, t] - (k[:, :, t, :, None] * S).sum(-2)) * beta[:, :, t, None]  # (B, H, d)
        S = S + k[:, :, t, :, None] * delta[:, :, None]
        out[:, :, t] = (q[:, :, t, :, None] * S).sum(-2)
    state.copy_(S.detach())
    return out


SUB = 16  # flash-linear-attention's sub-chunk: a chunk's decayed scores are formed a block of rows at a time


def decayed_scores(a: torch.Tensor, b: torch.Tensor, G: torch.Tensor, sub: int = SUB) -> torch.Tensor:
    """[i, j] = sum_c a_i[c] b_j[c] exp(G_i[c] - G_j[c]) for j <= i, 0 above: a, b, G (..., L, d), G
    a chunk's cumulative log decays (non-increasing: every gate is <= 0). Rows go a block of ``sub``
    at a time: against earlier columns the weight factors at the block's first position r as
    exp(G_i - G_r) exp(G_r - G_j), both <= 1 (no overflow, however fast the decay: a factored
    exp(G_i) exp(-G_j) over a whole chunk overflows), so those are one matmul; the block's own
    triangle is formed channel by channel, (sub, sub, d). Working memory O(L (d + sub d)), not the
    (L, L, d) of transformers' form."""
    L = a.shape[-2]
    out = a.new_zeros(*a.shape[:-2], L, L)
    for s in range(0, L, sub):
        e = min(s + sub, L)
        if s:
            ref = G[..., s:s + 1, :]  # between every earlier column and every row of the block
            out[..., s:e, :s] = (a[..., s:e, :] * (G[..., s:e, :] - ref).exp()) @ \
                (b[..., :s, :] * (ref - G[..., :s, :]).exp()).transpose(-1, -2)
        kept = torch.ones(e - s, e - s, dtype=torch.bool, device=a.device).tril()  # j <= i
        pair = (G[..., s:e, None, :] - G[..., None, s:e, :]).masked_fill(~kept[..., None], -torch.inf).exp()
        out[..., s:e, s:e] = (a[..., s:e, None, :] * b[..., None, s:e, :] * pair).sum(-1)
    return out


def chunked_kda(q, k, v, g, beta, state: torch.Tensor, chunk: int = 64) -> torch.Tensor:
    """The rule over chunks of ``chunk`` tokens, as transformers' chunk_kimi_delta_attention but a
    chunk at a time (arguments as :func:`recurrent_kda`). Returns (B, H, T, d) in float32;
    ``state`` is advanced in place.

    Within a chunk the corrections u_i = beta_i (v_i - sum_{j<i} (k_i . k_j)_{decayed} u_j) form a unit
    lower-triangular system (the WY form) whose entries weigh each key channel c by its own decay
    exp(G_i[c] - G_j[c]), G the gates' cumulative sum from the chunk's start (:func:`decayed_scores`):
    one triangular solve gives them all; the chunk's outputs are its queries against the state it
    started from plus a causal attention over its own corrections, and the state passes on, each
    row decayed over the chunk. Only the state crosses chunks, so the working memory is a chunk's
    whatever the prompt's length; a last chunk shorter than ``chunk`` is not padded. transformers
    keeps every chunk's (L, L, d) weights at once."""
    # a copy: the backward of a training step reads the state each chunk started from, so the
    # cache's tensor, written at the end, must not be that state
    out, S = kda_chunks(q, k, v, g, beta, state.to(torch.float32, copy=True), chunk)
    state.copy_(S.detach())  # a cache carries the state on, never gradients through it
    return out


def kda_chunks(q, k, v, g, beta, S: torch.Tensor, chunk: int = 64):
    """:func:`chunked_kda`'s chunks from the float32 state ``S`` (B, H, d, d): (outputs (B, H, T, d)
    in float32, the state after them), its graph kept (a layer's prefill carries it piece to piece)."""
    B, H, T, d = k.shape
    out = v.new_empty(B, H, T, v.shape[-1])
    for start in range(0, T, chunk):
        end = min(start + chunk, T)
        qc, kc, vc = (t[:, :, start:end] for t in (q, k, v))  # (B, H, L, d)
        G = g[:, :, start:end].cumsum(-2)  # (B, H, L, d): log decay from the chunk's start through each token
        k_beta = kc * beta[:, :, start:end, None]
        system = decayed_scores(k_beta, kc, G)  # its strict lower triangle read; the diagonal reads as 1
        corrections = torch.linalg.solve_triangular(system, vc * beta[:, :, start:end, None], upper=False,
                                                    unitriangular=True)
        k_decayed = torch.linalg.solve_triangular(system, k_beta * G.exp(), upper=False, unitriangular=True)
        u = corrections - k_decayed @ S  # what each token writes, the old state's part taken out
        out[:, :, start:end] = (qc * G.exp()) @ S + decayed_scores(qc, kc, G) @ u
        S = S * G[..., -1, :, None].exp() + (kc * (G[..., -1:, :] - G).exp()).transpose(-1, -2) @ u
    return out, S


def unfuse(layout: KDA, name: str, w: torch.Tensor) -> Dict[str, torch.Tensor]:
    """transformers' fused tensor ``name`` (:data:`KDAAttention.HF_FUSED`: its one convolution over
    q, k and v, channels in that order) as this module's three."""
    return dict(zip(KDAAttention.HF_FUSED[name], w.chunk(3)))


def hf_kda_weights(tensors: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """transformers' tensors of one KimiLinearDeltaAttention (names relative to it: ``q_proj.weight``,
    ``forget_gate.A_log`` …, or as Kimi's files write them) as :class:`KDAAttention`'s state dict;
    a name it does not know refused in one line naming it."""
    out = {}
    for name, t in tensors.items():
        if name in KDAAttention.HF_FUSED:
            out.update(unfuse(None, name, t))
            continue
        new = next((new + name[len(old):] for old, new in HF_NAMES.items()
                    if name == old or (old.endswith(".") and name.startswith(old))), None)
        if new is None:
            known = ", ".join([*HF_NAMES, *KDAAttention.HF_FUSED])
            raise ValueError(f"{name}: not a KDA tensor (expected one of {known})")
        out[new] = t
    return out
