"""The attention of a Gated DeltaNet layer (:class:`kvbench.layouts.gated_deltanet.GatedDeltaNet`),
as transformers' Qwen3_5GatedDeltaNet, in plain torch (CPU and CUDA).

Per token: ``w_qkv`` x passes a causal depthwise convolution of K taps and SiLU, then splits into
q, k (H_k heads of d_k) and v (H_v heads of d_v); q and k are L2-normalised per head and q scaled
by d_k^-0.5; beta = sigmoid(``w_beta`` x) is each value head's write strength and
g = -exp(``log_decay_rate``) softplus(``w_decay`` x + ``decay_bias``) its log decay. With S the
head's d_k x d_v state (computed in float32, held in ``cache.state_dtype``), the gated delta rule is

    S <- exp(g_t) S;   S <- S + k_t (beta_t (v_t - S^T k_t))^T;   o_t = S^T q_t

A prompt runs its chunked form (:func:`chunked_delta_rule`) a chunk of tokens at a time, the
conv tail and the state carried from chunk to chunk, so its working memory is O(chunk) whatever
its length; a decode step runs the recurrent form (:func:`recurrent_delta_rule`). The output is
RMS-normalised per head, gated by silu(``w_gate`` x) and projected by ``wo``. :data:`HF_NAMES`
maps transformers' parameter names.

Notation: B batch, T new tokens, H_k key heads, H_v value heads (G = H_v / H_k share a key head),
d_k, d_v their widths, N chunks of C tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvbench.layouts.gated_deltanet import CHUNK, GatedDeltaNet
from kvbench.norm import RMSNorm

HF_NAMES = {"in_proj_qkv.weight": "w_qkv.weight", "in_proj_z.weight": "w_gate.weight",
            "in_proj_b.weight": "w_beta.weight", "in_proj_a.weight": "w_decay.weight", "conv1d.weight": "conv.weight",
            "A_log": "log_decay_rate", "dt_bias": "decay_bias", "norm.weight": "norm.weight",
            "out_proj.weight": "wo.weight"}


class GatedDeltaNetAttention(nn.Module):
    """The attention of a :class:`GatedDeltaNet` layer (its cache: state_cache.StateLayer); Qwen3-Next's
    fused projections (:data:`HF_FUSED`) are split by :func:`unfuse`."""

    HF_MODULE = "linear_attn"
    HF_NAMES = HF_NAMES
    HF_FUSED = {"in_proj_qkvz.weight": ("w_qkv.weight", "w_gate.weight"),
                "in_proj_ba.weight": ("w_beta.weight", "w_decay.weight")}

    def __init__(self, cfg, layout: GatedDeltaNet):
        super().__init__()
        C, K = cfg.d_model, layout.linear_conv_kernel_dim
        self.H_k, self.H_v = layout.linear_num_key_heads, layout.linear_num_value_heads
        self.d_k, self.d_v = layout.linear_key_head_dim, layout.linear_value_head_dim
        self.key_dim, self.value_dim = layout.key_dim, layout.value_dim
        channels = 2 * self.key_dim + self.value_dim
        self.w_qkv = nn.Linear(C, channels, bias=False)
        self.w_gate = nn.Linear(C, self.value_dim, bias=False)  # z: the output gate
        self.w_beta = nn.Linear(C, self.H_v, bias=False)  # b: the write strength, through a sigmoid
        self.w_decay = nn.Linear(C, self.H_v, bias=False)  # a: the decay's input
        # depthwise and causal: the cache hands the last K - 1 inputs before the new ones, so no padding
        self.conv = nn.Conv1d(channels, channels, K, groups=channels, bias=False)
        self.log_decay_rate = nn.Parameter(torch.zeros(self.H_v))  # A_log
        self.decay_bias = nn.Parameter(torch.ones(self.H_v))  # dt_bias
        self.norm = RMSNorm(self.d_v, cfg.norm_eps)  # weight around 1 (not zero-centred as Qwen3.5's block norms)
        self.wo = nn.Linear(self.value_dim, C, bias=False)

    def tp_sections(self):
        """How kvbench.parallel cuts the q | k | v channels (of the projection and the convolution): each alike."""
        qkv = (0, (self.key_dim, self.key_dim, self.value_dim))
        return {"w_qkv.weight": qkv, "conv.weight": qkv}

    def forward(self, x, cos, sin, cache, pos):
        B, T, _ = x.shape
        tail = self.conv.kernel_size[0] - 1
        # A prompt goes a chunk of tokens at a time, the conv tail and the state carried between
        # chunks, so its working memory is a chunk's whatever its length (its projections included).
        # The last piece holds at least the conv tail: the cache is handed that piece's inputs only,
        # and writes its tail from them (the held tail before the prompt comes back first).
        bounds = list(range(0, T, CHUNK)) + [T]
        if len(bounds) > 2 and T - bounds[-2] < tail:
            del bounds[-2]  # a last piece shorter than the tail joins the one before
        last = self.w_qkv(x[:, bounds[-2]:]).transpose(1, 2)  # (B, channels, T - start of the last piece)
        carry = cache.update(last, pos)  # conv inputs (B, channels, K - 1 + that)
        if len(bounds) == 2:
            q, k, v, g, beta = self._rule_inputs(x, carry.inputs)
            rule = recurrent_delta_rule if T == 1 else chunked_delta_rule
            return self._output(x, rule(q, k, v, g, beta, carry.state))
        out = x.new_empty(B, T, self.wo.out_features)
        inputs = carry.inputs[..., :tail]
        # the state carried from piece to piece keeps its graph (a training step backpropagates
        # through it); a copy, as chunked_delta_rule's, and written back to the cache at the end
        S = carry.state.to(torch.float32, copy=True)
        for start, end in zip(bounds, bounds[1:]):
            new = last if end == T else self.w_qkv(x[:, start:end]).transpose(1, 2)
            inputs = torch.cat([inputs[..., inputs.shape[-1] - tail:], new], -1)  # (B, channels, K - 1 + L)
            piece, S = delta_rule_chunks(*self._rule_inputs(x[:, start:end], inputs), S)
            out[:, start:end] = self._output(x[:, start:end], piece)
        carry.state.copy_(S.detach())  # a cache carries the state on, never gradients through it
        return out

    def _rule_inputs(self, x: torch.Tensor, inputs: torch.Tensor):
        """q, k (B, H_v, L, d_k), v (B, H_v, L, d_v), g, beta (B, H_v, L), all float32, of tokens x
        (B, L, C) from their conv inputs (B, channels, K - 1 + L)."""
        B, T, _ = x.shape
        qkv = F.silu(self.conv(inputs)).transpose(1, 2)  # (B, T, channels)
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        beta = self.w_beta(x).sigmoid()  # (B, T, H_v)
        # in float32: in half precision exp(A_log) can overflow
        g = -self.log_decay_rate.float().exp() * F.softplus(self.w_decay(x).float() + self.decay_bias)
        q, k = (_unit_heads(t.reshape(B, T, self.H_k, self.d_k), self.H_v) for t in (q, k))  # (B, H_v, T, d_k)
        v, g, beta = (t.float().transpose(1, 2) for t in (v.reshape(B, T, self.H_v, self.d_v), g, beta))
        return q * self.d_k ** -0.5, k, v, g, beta

    def _output(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The layer's output for tokens x (B, L, C) from the rule's (B, H_v, L, d_v)."""
        B, T, _ = x.shape
        out = out.transpose(1, 2).to(x.dtype)  # (B, T, H_v, d_v)
        gate = self.w_gate(x).view(B, T, self.H_v, self.d_v)
        out = (self.norm(out) * F.silu(gate.float())).to(x.dtype)  # transformers' RMSNormGated
        return self.wo(out.reshape(B, T, self.value_dim))


def _unit_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, T, H_k, d) -> (B, heads, T, d) in float32, each vector of unit length (eps 1e-6, as
    flash-linear-attention), key head h read by value heads h*G .. h*G + G - 1."""
    x = x.float()
    x = x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)
    if heads != x.shape[2]:
        x = x.repeat_interleave(heads // x.shape[2], dim=2)
    return x.transpose(1, 2)


def recurrent_delta_rule(q, k, v, g, beta, state: torch.Tensor) -> torch.Tensor:
    """The gated delta rule one token at a time. q, k (B, H, T, d_k), v (B, H, T, d_v), g, beta
    (B, H, T), all float32; ``state`` (B, H, d_k, d_v) advanced in place: a float32 state where it
    lies (no new state is allocated), one in half precision read up-cast and written back once, so the
    rule's arithmetic is float32 either way (as transformers and mamba_ssm). Returns the outputs (B, H, T, d_v)."""
    B, H, T, d_k = k.shape
    d_v = v.shape[-1]
    held = state if state.dtype == torch.float32 else state.float()
    S = held.view(B * H, d_k, d_v)
    decay = g.exp()
    out = v.new_empty(B, H, T, d_v)
    for t in range(T):
        k_t = k[:, :, t].reshape(B * H, 1, d_k)
        S.mul_(decay[:, :, t].reshape(B * H, 1, 1))
        delta = (v[:, :, t].reshape(B * H, 1, d_v) - torch.bmm(k_t, S)) * beta[:, :, t].reshape(B * H, 1, 1)
        S.baddbmm_(k_t.transpose(1, 2), delta)  # the rank-1 correction k_t delta^T
        out[:, :, t] = torch.bmm(q[:, :, t].reshape(B * H, 1, d_k), S).view(B, H, d_v)
    if held is not state:
        state.copy_(held)
    return out


def chunked_delta_rule(q, k, v, g, beta, state: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """The gated delta rule over chunks of ``chunk`` tokens, as transformers'
    torch_chunk_gated_delta_rule but a chunk at a time (arguments as :func:`recurrent_delta_rule`).

    Within a chunk the delta rule's corrections u_i = beta_i (v_i - sum_{j<i} decay(i, j) (k_i . k_j) u_j)
    form a unit lower-triangular system (the WY form): one triangular solve gives them all, and the
    chunk's outputs are its queries against the state it started from plus a causal, decayed
    attention over its own corrections; the state then passes to the next chunk. Only the state
    crosses chunks, so the working memory is a chunk's, O(B H chunk (chunk + d_k + d_v)), whatever
    the prompt's length; a last chunk shorter than ``chunk`` is not padded (transformers pads with
    zero keys and zero write strength, which change nothing, and keeps every chunk's matrices at once)."""
    # a copy: the backward of a training step reads the state each chunk started from, so the
    # cache's tensor, written at the end, must not be that state
    out, S = delta_rule_chunks(q, k, v, g, beta, state.to(torch.float32, copy=True), chunk)
    state.copy_(S.detach())  # a cache carries the state on, never gradients through it
    return out


def delta_rule_chunks(q, k, v, g, beta, S: torch.Tensor, chunk: int = CHUNK):
    """:func:`chunked_delta_rule` from the float32 state S, not written in place: the outputs
    (B, H, T, d_v) and the state after them (its graph kept), for a caller that carries it on."""
    B, H, T, _ = k.shape
    out = v.new_empty(B, H, T, v.shape[-1])
    for start in range(0, T, chunk):
        end = min(start + chunk, T)
        out[:, :, start:end], S = _one_chunk(*(t[:, :, start:end] for t in (q, k, v, g, beta)), S)
    return out, S


def _one_chunk(q, k, v, g, beta, S: torch.Tensor):
    """One chunk of :func:`chunked_delta_rule` (q, k (B, H, L, d_k), v (B, H, L, d_v), g, beta (B, H, L))
    from the state S it starts from: its outputs (B, H, L, d_v) and the state it ends with. A function
    of its own, so that its (L, L) matrices are freed before the next chunk builds its own."""
    L = k.shape[2]
    decay = g.cumsum(-1)  # (B, H, L): log of the decay from the chunk's start through each token
    later = torch.ones(L, L, dtype=torch.bool, device=q.device).triu(1)
    pair = (decay[..., :, None] - decay[..., None, :]).masked_fill(later, float("-inf")).exp()  # (B, H, L, L)
    k_beta = k * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * pair  # its strict lower triangle; the diagonal reads as 1
    corrections = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    k_decayed = torch.linalg.solve_triangular(system, k_beta * decay.exp()[..., None], upper=False,
                                              unitriangular=True)  # what each correction reads of the old state
    del system  # one (L, L) matrix fewer alive while the outputs' is formed
    u = corrections - k_decayed @ S  # what each token writes, the old state's part taken out
    # causal: the upper triangle of pair is exp(-inf) = 0
    out = (q * decay.exp()[..., None]) @ S + ((q @ k.transpose(-1, -2)) * pair) @ u
    return out, S * decay[..., -1:, None].exp() + (k * (decay[..., -1:] - decay).exp()[..., None]).transpose(-1, -2) @ u


def unfuse(layout: GatedDeltaNet, name: str, w: torch.Tensor) -> dict:
    """Qwen3-Next's fused projection ``name`` (:data:`GatedDeltaNetAttention.HF_FUSED`) as this
    module's two. Its rows are grouped per key head: in_proj_qkvz holds, for each, the head's q (d_k
    rows), k (d_k), then its G = H_v / H_k value heads' v (G d_v) and z (G d_v); in_proj_ba its G b
    rows, then its G a rows. w_qkv stacks all q, then all k, then all v (Qwen3.5's in_proj_qkv)."""
    H_k, G, d_k, d_v, C = (layout.linear_num_key_heads, layout.linear_num_value_heads // layout.linear_num_key_heads,
                           layout.linear_key_head_dim, layout.linear_value_head_dim, w.shape[1])
    first, second = GatedDeltaNetAttention.HF_FUSED[name]
    if name == "in_proj_ba.weight":
        b, a = w.view(H_k, 2 * G, C).split([G, G], 1)
        return {first: b.reshape(-1, C), second: a.reshape(-1, C)}
    q, k, v, z = w.view(H_k, -1, C).split([d_k, d_k, G * d_v, G * d_v], 1)
    return {first: torch.cat([q.reshape(-1, C), k.reshape(-1, C), v.reshape(-1, C)]), second: z.reshape(-1, C)}
