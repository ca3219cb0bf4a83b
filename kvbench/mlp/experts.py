"""The mixture-of-experts MLP of a block (:class:`MoE`), and which MLP each layer has
(:func:`mlp_module`).

Plain torch on any device: the (token, slot) pairs are grouped by expert with one sort, and each
expert that got tokens runs one matmul over them (as transformers' eager experts do; no fused
grouped GEMM). The loop needs the routing on the host anyway, so :func:`record_routing` counts the
distinct experts each forward read: a decode step's weight bytes (:mod:`kvbench.measure.roofline`).

Notation: B batch, T tokens, N = B*T, C d_model, E experts, I an expert's width, k experts per token.
"""

from __future__ import annotations

import functools
import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from kvbench.mlp.dense import MLP
from kvbench.mlp.router import route
from kvbench.norm import Float32Params


def mlp_module(cfg, layer: int) -> nn.Module:
    """Layer ``layer``'s MLP in ``cfg`` (a ModelConfig): its mixture of experts, or the dense SwiGLU."""
    return MoE(cfg, layer in cfg.moe.hash_layers) if cfg.moe is not None and cfg.moe.sparse(layer) else MLP(cfg)


def _eager(method):
    """``torch.compiler.disable(method)``, made at the first call: at import it would load
    torch._dynamo (about 1.3 s of CPU) in every job, compiled or not."""
    disabled = None

    @functools.wraps(method)
    def call(*args, **kwargs):
        nonlocal disabled
        if disabled is None:
            disabled = torch.compiler.disable(method)
        return disabled(*args, **kwargs)
    return call


class Experts(nn.Module):
    """E SwiGLU experts as stacked weights: ``w_gate_up`` (E, 2I, C) (gate rows, then up rows),
    ``w_down`` (E, C, I); with ``expert_bias`` their biases (E, 2I) and (E, C). Not ``gated``
    (``model.mlp_act=relu2``, Nemotron-H's experts): ``w_up`` (E, I, C) and relu(up x)^2."""

    # kvbench.parallel: b_down is added once after the ranks' sum (tp_sections: how the rest is cut by width).
    # ``first``: the first expert held, where a rank holds some of them (expert parallel): pairs routed to
    # another rank's run nowhere here.
    TP_ONCE = ("b_down",)
    first: Optional[int] = None

    def __init__(self, d_model: int, moe, gated: bool = True):
        super().__init__()
        E, I, C = moe.num_experts, moe.expert_ffn_dim, d_model  # noqa: E741
        self.moe, self.gated = moe, gated
        w_in = nn.Parameter(torch.empty(E, (2 if gated else 1) * I, C))
        if gated:
            self.w_gate_up = w_in
        else:
            self.w_up = w_in
        self.w_down = nn.Parameter(torch.empty(E, C, I))
        self.b_gate_up = nn.Parameter(torch.zeros(E, 2 * I)) if moe.expert_bias else None
        self.b_down = nn.Parameter(torch.zeros(E, C)) if moe.expert_bias else None
        if not self.w_down.is_meta:  # nn.Linear's default: uniform within 1/sqrt(fan_in)
            nn.init.uniform_(w_in, -1 / math.sqrt(C), 1 / math.sqrt(C))
            nn.init.uniform_(self.w_down, -1 / math.sqrt(I), 1 / math.sqrt(I))

    def tp_sections(self):
        """How kvbench.parallel cuts each expert's width: dim 1 of the stacked matrix (and bias) holds the gate
        rows, then the up rows, each cut alike."""
        I = self.w_down.shape[-1]  # noqa: E741
        return {} if not self.gated else {"w_gate_up": (1, (I, I)), "b_gate_up": (1, (I, I))}

    @property
    def w_in(self) -> torch.Tensor:
        """The projection from C: gate and up rows, or up alone."""
        return self.w_gate_up if self.gated else self.w_up

    def bytes_per_expert(self) -> int:
        """Bytes one expert's weights (and biases) take: what a step reads per expert it routes to."""
        return sum(p[0].numel() * p.element_size() for p in self.parameters())

    def matrix_params_per_expert(self) -> int:
        """One expert's matrix entries: a routed token's multiply-adds in it."""
        return self.w_in[0].numel() + self.w_down[0].numel()

    def _swiglu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        limit = self.moe.swiglu_limit
        if limit is None:
            return F.silu(gate) * up
        # GPT-OSS (transformers' GptOssExperts): clamped, a sigmoid gain alpha, and (up + 1); DeepSeek-V4:
        # clamped only (alpha 1, shift 0)
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
        return (up + self.moe.swiglu_up_shift) * (gate * torch.sigmoid(gate * self.moe.swiglu_alpha))

    @_eager  # the loop follows the routing: torch.compile would recompile per routing
    def forward(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> Tuple[torch.Tensor, int]:
        """x (N, C), weights and chosen (N, k) -> (weighted sum (N, C), number of distinct experts run)."""
        k, E = chosen.shape[1], self.w_down.shape[0]
        flat = chosen.flatten()  # pair n*k + j: token n's j-th expert
        if self.first is not None:  # experts held here as 0..E-1; another rank's as E, sorted last and skipped
            flat = flat - self.first
            flat = torch.where((flat >= 0) & (flat < E), flat, E)
        order = flat.argsort(stable=True)  # the pairs grouped by expert
        counts = torch.bincount(flat, minlength=E).tolist()[:E]  # the one host sync
        out = torch.zeros_like(x)
        w = weights.flatten()
        start = 0
        for e, n in enumerate(counts):
            if not n:
                continue
            pairs = order[start:start + n]
            start += n
            tokens, weight = pairs // k, w[pairs, None]
            inputs = (x[tokens] * weight).to(x.dtype) if self.moe.weigh_inputs else x[tokens]  # Llama 4: scaled in
            h = F.linear(inputs, self.w_in[e], None if self.b_gate_up is None else self.b_gate_up[e])
            act = self._swiglu(*h.chunk(2, dim=-1)) if self.gated else F.relu(h).square()  # (n, I)
            y = F.linear(act, self.w_down[e], None if self.b_down is None else self.b_down[e])
            out.index_add_(0, tokens, (y if self.moe.weigh_inputs else y * weight).to(out.dtype))
        return out, sum(1 for n in counts if n)


class MoE(Float32Params):
    """A mixture-of-experts MLP: router, routed experts, and an optional shared expert every token
    also goes through (sigmoid-gated with ``shared_gate``). ``hashed`` (DeepSeek-V4's hash layers):
    a token's experts are row ``token id`` of ``tid2eid`` (vocab, k), a table the checkpoint gives."""

    # DeepSeek's e_score_correction_bias, float32 whatever the model's dtype, as transformers keeps it
    FLOAT32_BUFFERS = ("correction_bias",)

    def __init__(self, cfg, hashed: bool = False):
        super().__init__()
        moe, C = cfg.moe, cfg.d_model
        self.moe = moe
        self.router = nn.Linear(C, moe.num_experts, bias=moe.router_bias)
        # DeepSeek's e_score_correction_bias moves the choice, not the weights; a hashed layer's table makes it
        biased = moe.router in ("sigmoid", "sqrtsoftplus") and not hashed
        self.register_buffer("correction_bias", torch.zeros(moe.num_experts) if biased else None)
        self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, moe.top_k, dtype=torch.long) if hashed else None)
        self.experts = Experts(C, moe, getattr(cfg, "mlp_act", "silu") == "silu")
        self.shared = MLP(cfg, moe.shared_ffn_dim, moe.swiglu_limit) if moe.shared_ffn_dim else None
        self.shared_gate = nn.Linear(C, 1, bias=False) if moe.shared_gate else None
        self.log: Optional[List[int]] = None  # distinct experts per forward, while record_routing runs

    def forward(self, x: torch.Tensor, tokens: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x (B, T, C); ``tokens`` (B, T): their ids, which a hashed layer routes by."""
        B, T, C = x.shape
        flat = x.reshape(B * T, C)
        if self.moe.router == "sigmoid":  # DeepSeek computes its router in float32 whatever the model's dtype
            logits = F.linear(flat.float(), self.router.weight.float())
        else:
            logits = self.router(flat)  # (N, E)
        if self.tid2eid is None:
            weights, chosen = route(self.moe, logits, self.correction_bias)
        elif tokens is None:
            raise ValueError("a hash-routed mixture of experts (DeepSeek-V4's) chooses experts by token id: "
                             "the decoder must pass the tokens")
        else:
            weights, chosen = route(self.moe, logits, None, self.tid2eid[tokens.reshape(-1)])
        out, distinct = self.experts(flat, weights, chosen)
        if self.log is not None:
            self.log.append(distinct)
        if self.shared is not None:
            shared = self.shared(flat)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(flat)) * shared
            out = out + shared
        return out.view(B, T, C)


@dataclass
class Routing:
    """What :func:`record_routing` saw: per model forward, the distinct experts each MoE layer ran."""

    logs: List[List[int]]  # per MoE layer, one count per forward
    sizes: List[int]  # per MoE layer, the bytes of one expert

    def forwards(self) -> List[Tuple[int, ...]]:
        return list(zip(*self.logs))

    def bytes_per_forward(self) -> List[int]:
        """Bytes of routed-expert weights each forward read (distinct experts x bytes, over layers)."""
        return [sum(n * size for n, size in zip(counts, self.sizes)) for counts in self.forwards()]


@contextmanager
def record_routing(model: nn.Module) -> Iterator[Routing]:
    """Count the distinct experts each MoE layer of ``model`` runs per forward inside the block."""
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    routing = Routing([[] for _ in layers], [layer.experts.bytes_per_expert() for layer in layers])
    for layer, log in zip(layers, routing.logs):
        layer.log = log
    try:
        yield routing
    finally:
        for layer in layers:
            layer.log = None
