"""The mixer of a Mamba-2 layer (:class:`kvbench.layouts.mamba2.Mamba2`), as transformers'
NemotronHMamba2Mixer and GraniteMoeHybridMambaLayer (their torch paths), in plain torch.

Per token: ``w_in`` x splits into the gate z (I), xBC (I + 2 G N) and dt (H); xBC passes a causal
depthwise convolution of K taps (with bias) and SiLU, then splits into x (H heads of P), B and C
(G groups of N). dt = softplus(dt + ``step_bias``), A = -exp(``log_decay_rate``). With S the
head's P x N state, the SSD recurrence is

    S <- exp(A dt_t) S + dt_t x_t B_t^T;   y_t = S C_t + D x_t

A prompt runs its chunked form (:func:`chunked_scan`: a chunk at a time, the state carried from
chunk to chunk, so its working memory is O(chunk) whatever the prompt's length), a decode step
its recurrent form (:func:`recurrent_step`). dt is clamped to ``time_step_limit`` in the chunked
form only, as transformers and mamba_ssm do. y is gated by silu(z), RMS-normalised per group of
I / G channels (:class:`GatedRMSNorm`) and projected by ``wo``. :data:`HF_NAMES` maps
transformers' parameter names.

Notation: B batch, T new tokens, H heads of P, G groups (R = H / G heads each) of state size N,
L tokens of a chunk, I = H P.
"""

from __future__ import annotations

import math
from typing import Dict, Mapping, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from kvbench.layouts.mamba2 import Mamba2

# transformers' names under a layer's mixer (Nemotron-H: ``mixer``, Granite: ``mamba``): a key
# ending in "." renames a submodule (its weight and bias)
HF_NAMES = {"in_proj.": "w_in.", "conv1d.": "conv.", "dt_bias": "step_bias", "A_log": "log_decay_rate", "D": "skip",
            "norm.": "norm.", "out_proj.": "wo."}


class GatedRMSNorm(nn.Module):
    """RMSNorm of y * silu(z) over groups of ``group`` channels, in float32 (transformers'
    NemotronHRMSNormGated: the gate before the norm, one variance per group). Under tensor parallelism a
    group's channels may be cut over ``ranks`` ranks (:mod:`~kvbench.layouts.mamba2_shard`): each then
    holds ``group`` of them and the squares are summed across those ranks through ``tp_group`` (the
    rank group kvbench.parallel hands each module that has one)."""

    tp_group = None

    def __init__(self, width: int, group: int, eps: float, ranks: int = 1):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.group, self.eps, self.ranks = group, eps, ranks

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        h = y.float() * F.silu(z.float())
        h = h.unflatten(-1, (-1, self.group))  # (..., G, I / G)
        if self.ranks == 1 or self.tp_group is None:
            mean = h.pow(2).mean(-1, keepdim=True)
        else:  # one group here, the rest of it on the ranks beside: a slot per group, summed over all ranks
            rank, ranks = self.tp_group.rank, self.tp_group.ranks
            slots = h.new_zeros(*h.shape[:-2], ranks // self.ranks, 1)  # (..., G of the whole layer, 1)
            slots[..., rank // self.ranks, :] = h.pow(2).sum(-1)
            mean = self.tp_group.all_reduce(slots)[..., rank // self.ranks, None, :] / (self.group * self.ranks)
        h = h * torch.rsqrt(mean + self.eps)
        return self.weight * h.flatten(-2).to(y.dtype)


class Mamba2Mixer(nn.Module):
    """The mixer of a :class:`Mamba2` layer (its cache: :class:`~kvbench.state_cache.StateLayer`); takes the
    decoder's attention arguments (rotary tables unused) so that a block calls it like any layer's."""

    HF_MODULE = "mixer"  # NemotronHBlock's (Granite's ``mamba`` is renamed to it by its home's hf_names)
    HF_NAMES = HF_NAMES

    def __init__(self, cfg, layout: Mamba2):
        super().__init__()
        C, inner, K = cfg.d_model, layout.inner_dim, layout.conv_kernel
        self.H, self.P, self.N, self.G = (layout.mamba_num_heads, layout.mamba_head_dim, layout.ssm_state_size,
                                          layout.n_groups)
        self.chunk, self.time_step_limit = layout.chunk_size, layout.time_step_limit
        channels = layout.conv_channels
        self.split = [inner, channels, self.H]  # z, xBC, dt
        self.w_in = nn.Linear(C, sum(self.split), bias=layout.proj_bias)
        # depthwise and causal: the cache hands the last K - 1 inputs before the new ones, so no padding
        self.conv = nn.Conv1d(channels, channels, K, groups=channels, bias=layout.conv_bias)
        self.step_bias = nn.Parameter(torch.ones(self.H))  # dt_bias
        # A_log, log 1 .. log H: from a list, as arange on the meta device (a rank's part is built there, a
        # footprint's model too) loads torch._dynamo, seconds of CPU
        self.log_decay_rate = nn.Parameter(torch.tensor([math.log(h) for h in range(1, self.H + 1)]))
        self.skip = nn.Parameter(torch.ones(self.H))  # D
        self.norm = GatedRMSNorm(inner, inner // self.G, cfg.norm_eps, layout.group_ranks)
        self.wo = nn.Linear(inner, C, bias=layout.proj_bias)

    def tp_sections(self):
        """How kvbench.parallel cuts the channels in_proj stacks (z | x | B | C | dt) and the convolution's
        (x | B | C): each alike, so a rank's heads keep their x and its groups their B and C."""
        I, GN = self.H * self.P, self.G * self.N  # noqa: E741
        projected, conv = (0, (I, I, GN, GN, self.H)), (0, (I, GN, GN))
        return {"w_in.weight": projected, "w_in.bias": projected, "conv.weight": conv, "conv.bias": conv}

    def forward(self, x, cos, sin, cache, pos):
        B, T, _ = x.shape
        tail = self.conv.kernel_size[0] - 1
        A = -self.log_decay_rate.float().exp()  # in float32: in half precision exp(A_log) can overflow
        # A prompt goes a chunk of tokens at a time through the whole mixer, the conv tail and the
        # state carried between chunks, so its working memory is a chunk's whatever its length (its
        # projections included: all at once they grew 4.7x from 512 to 4,096 tokens). The last piece
        # holds at least the conv tail: the cache is handed that piece's inputs only, and writes its
        # tail from them (the held tail before the prompt comes back first), as Gated DeltaNet's.
        bounds = list(range(0, T, self.chunk)) + [T]
        if len(bounds) > 2 and T - bounds[-2] < tail:
            del bounds[-2]  # a last piece shorter than the tail joins the one before
        z, xBC, dt = self.w_in(x[:, bounds[-2]:]).split(self.split, dim=-1)
        carry = cache.update(xBC.transpose(1, 2), pos)  # conv inputs (B, channels, K - 1 + the last piece)
        if len(bounds) == 2:
            xs, Bs, Cs = self._scan_inputs(carry.inputs)
            # one new token after a held state is a decode step; a first token is a prompt, as transformers takes it
            if T == 1 and pos.start != 0:
                y = recurrent_step(xs, dt, A, Bs, Cs, self.skip, self.step_bias, carry.state)
            else:
                y = chunked_scan(xs, dt, A, Bs, Cs, self.skip, self.step_bias, carry.state, self.chunk,
                                 self.time_step_limit)
            return self._output(y, z, x.dtype)
        out = x.new_empty(B, T, self.wo.out_features)
        last, inputs = (z, dt, carry.inputs[..., tail:]), carry.inputs[..., :tail]
        # the state carried from piece to piece keeps its graph (a training step backpropagates
        # through it); a copy, as chunked_scan's, and written back to the cache at the end
        S = carry.state.to(torch.float32, copy=True)
        for start, end in zip(bounds, bounds[1:]):
            if end == T:
                z, dt, new = last
            else:
                z, new, dt = self.w_in(x[:, start:end]).split(self.split, dim=-1)
                new = new.transpose(1, 2)
            inputs = torch.cat([inputs[..., inputs.shape[-1] - tail:], new], -1)  # (B, channels, K - 1 + L)
            y, S = scan_chunks(*self._scan_inputs(inputs), dt, A, self.skip, self.step_bias, S, self.chunk,
                               self.time_step_limit)
            out[:, start:end] = self._output(y, z, x.dtype)
        carry.state.copy_(S.detach())  # a cache carries the state on, never gradients through it
        return out

    def _scan_inputs(self, inputs: torch.Tensor):
        """x (B, L, H, P), B and C (B, L, G, N) of L tokens from their conv inputs (B, channels, K - 1 + L)."""
        xBC = F.silu(self.conv(inputs)).transpose(1, 2)  # (B, L, channels)
        Bsz, L, _ = xBC.shape
        xs, Bs, Cs = xBC.split([self.H * self.P, self.G * self.N, self.G * self.N], dim=-1)
        groups = (Bsz, L, self.G, self.N)
        return xs.reshape(Bsz, L, self.H, self.P), Bs.reshape(groups), Cs.reshape(groups)

    def _output(self, y: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The mixer's output (B, L, C) from the scan's y (B, L, H, P) and the gate z (B, L, inner)."""
        y = self.norm(y.reshape(*y.shape[:2], -1), z)  # float32, as transformers' scan output
        return self.wo(y.to(dtype))


def _heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, ..., G, N) -> (B, ..., H, N) in float32: group g read by heads g*R .. g*R + R - 1."""
    return t.float().repeat_interleave(heads // t.shape[-2], dim=-2)


def recurrent_step(x, dt, A, B, C, D, dt_bias, state: torch.Tensor) -> torch.Tensor:
    """One token of the SSD recurrence, as transformers' selective_state_update. x (B, 1, H, P),
    dt (B, 1, H) before its softplus (no clamp: mamba_ssm's step has none), A (H,) float32, B, C
    (B, 1, G, N); ``state`` (B, H, P, N) advanced in place, in its own dtype. Returns y (B, 1, H, P)
    in float32. In float32 throughout, as mamba_ssm's kernel and the chunked scan: transformers' torch
    step rounds dt B x and the state to a half-precision compute dtype first (a rounding or two apart)."""
    H = x.shape[2]
    dt = F.softplus(dt + dt_bias.to(dt.dtype))[:, 0].float()  # (B, H), in x's dtype first as transformers
    Bh, Ch = _heads(B[:, 0], H), _heads(C[:, 0], H)  # (B, H, N)
    x = x[:, 0].float()  # (B, H, P)
    S = state.float() * (dt * A).exp()[..., None, None] + (dt[..., None] * Bh)[:, :, None, :] * x[..., None]
    state.copy_(S.detach())
    y = (S @ Ch[..., None]).squeeze(-1) + x * D.float()[:, None]  # (B, H, P)
    return y[:, None]


def _segment_sum(a: torch.Tensor) -> torch.Tensor:
    """(..., L) -> (..., L, L): [i, j] = a[j+1] + ... + a[i] for j <= i, -inf above; summed, not
    differenced, as transformers' segment_sum (a difference of two long cumulative sums loses digits)."""
    L = a.shape[-1]
    a = a[..., None].expand(*a.shape, L)  # [i, j] = a[i]
    kept = torch.ones(L, L, dtype=torch.bool, device=a.device).tril()  # j <= i
    return a.masked_fill(~kept.tril(-1), 0).cumsum(-2).masked_fill(~kept, -torch.inf)


def chunked_scan(x, dt, A, B, C, D, dt_bias, state: torch.Tensor, chunk: int,
                 dt_limit: Tuple[float, float] = (0.0, float("inf"))) -> torch.Tensor:
    """The SSD recurrence over chunks of ``chunk`` tokens, as transformers' mamba2_chunk_scan,
    but a chunk at a time (arguments as :func:`recurrent_step`, T tokens; dt clamped to ``dt_limit``
    after its softplus). Returns y (B, T, H, P) in float32; ``state`` is advanced in place.

    Within a chunk, y is a causal attention of C over B weighted by the decay between the two
    positions (exp of a segment sum of A dt), applied to dt x, plus the chunk's start state read at
    C and decayed to each position; the state then passes to the next chunk, decayed over the chunk
    and added the chunk's own writes. Only the state crosses chunks: a chunk's L x L weights and
    its slices of x, B, C and dt in float32 are all the memory it works in (a last chunk shorter
    than ``chunk`` is not padded). transformers keeps every chunk's weights and states at once."""
    # a copy: the backward of a training step reads the state each chunk started from, so the
    # cache's tensor, written at the end, must not be that state
    y, S = scan_chunks(x, B, C, dt, A, D, dt_bias, state.to(torch.float32, copy=True), chunk, dt_limit)
    state.copy_(S.detach())  # a cache carries the state on, never gradients through it
    return y


def scan_chunks(x, B, C, dt, A, D, dt_bias, S: torch.Tensor, chunk: int,
                dt_limit: Tuple[float, float] = (0.0, float("inf"))):
    """:func:`chunked_scan`'s chunks from the float32 state ``S`` (B, H, P, N): (y (B, T, H, P) in
    float32, the state after them), its graph kept (a mixer's prefill carries it piece to piece)."""
    Bsz, T, H, P = x.shape
    G, N = B.shape[2:]
    R = H // G
    out = x.new_empty(Bsz, T, H, P, dtype=torch.float32)
    low, high = dt_limit
    for start in range(0, T, chunk):
        end = min(start + chunk, T)
        L = end - start
        xc = x[:, start:end].float()  # (B, L, H, P)
        step = F.softplus(dt[:, start:end] + dt_bias.to(dt.dtype)).clamp(low, high).float()  # (B, L, H)
        Bc, Cc = (t[:, start:end].float().transpose(1, 2) for t in (B, C))  # (B, G, L, N)
        a = (A * step).transpose(1, 2)  # (B, H, L): the log decay of each step
        decay = a.cumsum(-1)  # from the chunk's start through each position
        weights = _segment_sum(a).exp().view(Bsz, G, R, L, L) * (Cc @ Bc.transpose(-1, -2))[:, :, None]
        xdt = (xc * step[..., None]).transpose(1, 2).reshape(Bsz, G, R, L, P)
        y = weights @ xdt  # (B, G, R, L, P): the chunk's own tokens
        y = y + (Cc[:, :, None] @ S.view(Bsz, G, R, P, N).transpose(-1, -2)) * \
            decay.exp().view(Bsz, G, R, L, 1)  # the state it started from
        to_end = (decay[..., -1:] - decay).exp().view(Bsz, G, R, L, 1)  # each position's decay to the chunk's end
        S = S * decay[..., -1].exp()[..., None, None] + \
            ((xdt * to_end).transpose(-1, -2) @ Bc[:, :, None]).view(Bsz, H, P, N)
        out[:, start:end] = y.view(Bsz, H, L, P).transpose(1, 2) + xc * D.float()[:, None]
    return out, S


def hf_mixer_weights(tensors: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """transformers' tensors of one mixer (names relative to it: ``in_proj.weight``, ``A_log`` …) as
    :class:`Mamba2Mixer`'s state dict; a name it does not know refused in one line naming it."""
    out = {}
    for name, t in tensors.items():
        new = next((new + name[len(old):] for old, new in HF_NAMES.items()
                    if name == old or (old.endswith(".") and name.startswith(old))), None)
        if new is None:
            raise ValueError(f"{name}: not a Mamba-2 mixer tensor (expected one of {', '.join(HF_NAMES)})")
        out[new] = t
    return out
