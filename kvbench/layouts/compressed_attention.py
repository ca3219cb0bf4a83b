"""The attention of a DeepSeek-V4 layer (:class:`kvbench.layouts.compressed.Compressed`), as
transformers' DeepseekV4Attention, and its cache (:class:`CompressedCache`: a ring, a pool and the
compressors' buffers).

Per token: the query through a LoRA (``q_a_proj``, a weighted RMSNorm, ``q_b_proj``, then an
unweighted RMSNorm per head); one K=V head ``kv_norm(kv_proj(x))``; both rotated on their last
``rope_dim`` channels in interleaved pairs (the ``main`` base in sliding layers, ``compress`` in
CSA / HCA ones). A query attends the ring of the last W positions plus, in a compressing layer,
pooled entries: each closed window of m tokens is one entry, sum_j softmax_j(gate_j + bias_j) kv_j
over the window, RMS-normed and rotated at the window's first position (compress base). CSA's
compressor projects two series per token (Ca: the first D channels, Cb: the rest) and pools window
w from window w - 1's Ca and window w's Cb (2m slots); its indexer pools its own keys the same way
at D_i, scores them ``sum_h w_h ReLU(q_h . k) / sqrt(D_i)`` and each query attends its top
``index_topk`` of the entries it may see (entry w once its window has closed: (w + 1) m <= t + 1).
Each head's softmax has a learned sink column (no value). The output is rotated back by the
query's position (K = V carried rope into the values), then projected per group of heads
(``o_a_proj``, block-diagonal) and mixed (``o_b_proj``).

Parameter names are transformers' own (``compressor.indexer.scorer.weights_proj`` included), so a
checkpoint's tensors under a layer's ``self_attn.`` load unchanged. Where kvbench differs in form,
not in result: a decode step gathers the k selected entries instead of masking all of them; the
ring is a static ring of W slots (transformers concatenates and keeps W - 1); ties in the
indexer's scores go to the earlier entry (a stable sort; transformers' topk breaks them in an
order that depends on the call's shape).

Notation: B batch, T new tokens, H heads of D, W window, m rate, N entries, H_i / D_i the indexer's
heads and width, R rope_dim, G o_groups.
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from kvbench.cache import Positions
from kvbench.layouts.compressed_layout import Compressed, Rope
from kvbench.norm import Float32Params, Float32RMSNorm

V4RMSNorm = Float32RMSNorm  # transformers' DeepseekV4RMSNorm: q_a_norm, kv_norm, the compressors' kv_norm


def unweighted_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Each head's query RMS-normed without a weight (transformers' DeepseekV4UnweightedRMSNorm)."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def rope_inv_freq(rope: Rope, dim: int) -> torch.Tensor:
    """(dim / 2,) float32 inverse frequencies as transformers computes them (its default and yarn
    paths, float32 throughout; yarn's ramp between whole correction dimensions)."""
    # on the CPU whatever the default device: a decoder built on the meta device keeps these values
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float, device="cpu") / dim)
    if rope.type == "default":
        return 1.0 / pos_freqs

    def correction_dim(turns: float) -> float:  # the dimension whose wavelength fits `turns` times
        return dim * math.log(rope.original_max / (turns * 2 * math.pi)) / (2 * math.log(rope.theta))

    low = max(math.floor(correction_dim(rope.beta_fast)), 0)
    high = min(math.ceil(correction_dim(rope.beta_slow)), dim - 1)
    high = high + 0.001 if low == high else high
    keep = 1 - ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    return 1.0 / (rope.factor * pos_freqs) * (1 - keep) + 1.0 / pos_freqs * keep


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, heads, T, D) with its last R channels rotated in interleaved pairs by cos / sin
    (B or 1, T, R / 2), in float32, the first D - R passed (transformers' apply_rotary_pos_emb)."""
    cos, sin = cos.repeat_interleave(2, -1)[:, None], sin.repeat_interleave(2, -1)[:, None]
    R = cos.shape[-1]
    nope, rope = x[..., :-R], x[..., -R:]
    pairs = rope.unflatten(-1, (-1, 2))
    half = torch.stack((-pairs[..., 1], pairs[..., 0]), -1).flatten(-2)  # (x0, x1) -> (-x1, x0)
    return torch.cat([nope, (rope.float() * cos + half.float() * sin).to(x.dtype)], -1)


class Pool:
    """What one compressor holds per sequence (B rows): its ``entries`` (B, N_max, width), the
    projected kv and gate of the < m tokens not yet folded (B, m - 1, C) and, overlapping, the last
    window's first halves (B, m, width): kv in the compute dtype, gate plus bias in float32."""

    def __init__(self, B: int, entries: int, width: int, rate: int, overlap: bool, dtype, device):
        C = 2 * width if overlap else width
        self.entries = torch.zeros(B, entries, width, dtype=dtype, device=device)
        self.buffer_kv = torch.zeros(B, rate - 1, C, dtype=dtype, device=device)
        self.buffer_gate = torch.zeros(B, rate - 1, C, dtype=dtype, device=device)
        self.overlap = (torch.zeros(B, rate, width, dtype=dtype, device=device),
                        torch.zeros(B, rate, width, dtype=torch.float32, device=device)) if overlap else None

    def tensors(self):
        return [self.entries, self.buffer_kv, self.buffer_gate, *(self.overlap or ())]


class CompressedCache:
    """One DeepSeek-V4 layer's cache for ``batch_size`` sequences of up to ``max_seq_len`` tokens:
    a ring of W positions (B, W, D), slot p % W; for CSA / HCA a :class:`Pool` of floor(max_seq_len
    / m) entries (CSA: and its indexer's, of D_i). Allocated once, written in place; all rows share
    one length (kvbench's eager steps). A write at position 0 starts afresh; another position than
    the length held is refused (a pool cannot roll back). ``nbytes`` = B x the layout's
    ``sequence_bytes(max_seq_len)``."""

    def __init__(self, layout: Compressed, batch_size: int, max_seq_len: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        self.layout, self.max_seq_len, self.length = layout, max_seq_len, 0
        B, m = batch_size, layout.compress_rate
        # slot p % W: a cache shorter than the ring holds p < max_seq_len at p (as a K/V ring's does)
        self.ring = torch.zeros(B, min(layout.window, max_seq_len), layout.head_dim, dtype=dtype, device=device)
        self.pools: Dict[str, Pool] = {}
        if layout.compresses:
            self.pools["compressor"] = Pool(B, max_seq_len // m, layout.head_dim, m, layout.indexed, dtype, device)
        if layout.indexed:
            self.pools["indexer"] = Pool(B, max_seq_len // m, layout.index_head_dim, m, True, dtype, device)

    def begin(self, start: int, T: int) -> None:
        """Check that ``T`` tokens at ``start`` continue what is held (0: a new sequence)."""
        if start != 0 and start != self.length:
            raise ValueError(f"position {start}: this cache holds {self.length} tokens; a DeepSeek-V4 layer's pool "
                             "and buffers continue only from there (or restart at 0)")
        if start + T > self.max_seq_len:
            raise ValueError(f"position {start + T}: past this cache's max_seq_len={self.max_seq_len}")

    def ring_keys(self, start: int, kv: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """The held positions still in the window, in order, then the new ``kv`` (B, T, D), and their
        positions; the new tokens' last W written to the ring."""
        B, T, _ = kv.shape
        W = self.layout.window
        held = torch.arange(max(0, start - W + 1), start, device=kv.device)  # what the new tokens may see
        keys = torch.cat([self.ring[:B, held % W], kv], 1)
        new = torch.arange(max(start, start + T - W), start + T, device=kv.device)
        self.ring[:B, new % W] = kv[:, new - start]
        self.length = start + T
        return keys, torch.cat([held, torch.arange(start, start + T, device=kv.device)])

    def tensors(self):
        return [self.ring] + [t for pool in self.pools.values() for t in pool.tensors()]

    def refusal(self, length: int, held: int) -> Optional[str]:
        """A compressing layer only to 0 or ``held`` (a decoder's cache protocol): a pooled entry folds
        m positions and the buffers a window's worth, so it cannot roll back to a length between. A
        sliding layer (the ring alone) as a K/V ring: where no later position overwrote one the next
        query sees."""
        W = self.layout.window
        if not self.layout.compresses:
            first = max(0, length - W + 1)
            return (f"cannot truncate to {length}: a ring of {W} positions already overwrote position {first} "
                    f"({held} written); only 0 or a roll back within the ring works") if length and first + W < held \
                else None
        if length not in (0, held):
            return (f"cannot truncate to {length}: a DeepSeek-V4 layer's pool folds each window of "
                    f"{self.layout.compress_rate} tokens and cannot roll back; only 0 or {held} works")
        return None

    def rewind(self, length: int) -> None:
        """Held ``length`` to repeat steps whose cost alone is timed (``Cache.rewind``): every entry below
        it was written, so a step reads as many as it would there; its output is not the sequence's."""
        self.length = length

    def truncate(self, length: int, held: int) -> None:
        why = self.refusal(length, held)
        if why:
            raise ValueError(why)
        self.length = length

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors())

    def fixed_view(self, length: int):
        raise ValueError("a DeepSeek-V4 layer's ring and pool have no fixed-shape view (the step reads a context "
                         "bucket of K/V); use runtime.compile=false|default")


class Compressor(Float32Params):  # its position_bias float32, as transformers keeps it
    """Folds each m tokens into one entry of ``width`` (transformers' DeepseekV4HCACompressor, or
    with ``overlap`` the CSA one and its indexer's: two series per token, window w from w - 1's
    first half and its own second half)."""

    def __init__(self, d_model: int, width: int, rate: int, overlap: bool, eps: float):
        super().__init__()
        C = 2 * width if overlap else width
        self.width, self.rate, self.overlap = width, rate, overlap
        self.kv_proj = nn.Linear(d_model, C, bias=False)
        self.gate_proj = nn.Linear(d_model, C, bias=False)
        self.position_bias = nn.Parameter(torch.zeros(rate, C))
        self.kv_norm = V4RMSNorm(width, eps)

    def forward(self, x: torch.Tensor, pool: Optional[Pool], start: int, rope) -> torch.Tensor:
        """The entries (B, N, width) the new tokens x (B, T, C) may see: with a ``pool``, every entry
        so far (the new ones written, the remainder of < m tokens buffered); without, the windows
        closed within x (the remainder dropped, as transformers' forward without a cache)."""
        B, m, D = x.shape[0], self.rate, self.width
        kv, gate = self.kv_proj(x), self.gate_proj(x)  # (B, T, C)
        done = start // m  # entries before x
        if pool is not None:
            buffered = start % m
            kv = torch.cat([pool.buffer_kv[:B, :buffered], kv], 1)
            gate = torch.cat([pool.buffer_gate[:B, :buffered], gate], 1)
        n = kv.shape[1] // m
        if pool is not None:
            rest = kv.shape[1] - n * m
            pool.buffer_kv[:B, :rest], pool.buffer_gate[:B, :rest] = kv[:, n * m:], gate[:, n * m:]
        if n:
            chunk_kv = kv[:, :n * m].view(B, n, m, -1)
            chunk_gate = gate[:, :n * m].view(B, n, m, -1) + self.position_bias  # float32 with the bias
            if self.overlap:
                new_kv = chunk_kv.new_zeros(B, n, 2 * m, D)
                new_gate = chunk_gate.new_full((B, n, 2 * m, D), float("-inf"))  # weight 0 where no window precedes
                new_kv[:, :, m:], new_gate[:, :, m:] = chunk_kv[..., D:], chunk_gate[..., D:]
                new_kv[:, 1:, :m], new_gate[:, 1:, :m] = chunk_kv[:, :-1, :, :D], chunk_gate[:, :-1, :, :D]
                if pool is not None:
                    prior_kv, prior_gate = pool.overlap
                    if done:  # the last window closed before x
                        new_kv[:, 0, :m], new_gate[:, 0, :m] = prior_kv[:B], prior_gate[:B].to(new_gate.dtype)
                    prior_kv[:B], prior_gate[:B] = chunk_kv[:, -1, :, :D], chunk_gate[:, -1, :, :D]
                chunk_kv, chunk_gate = new_kv, new_gate
            # the gate's softmax in float32 over each window's slots (transformers: low precision can tie them)
            pooled = (chunk_kv * chunk_gate.softmax(dim=2, dtype=torch.float32).to(chunk_kv.dtype)).sum(2)
            positions = torch.arange(n, device=x.device) * m + done * m  # each window's first token
            cos, sin = rope(positions, pooled.dtype)
            new = rotate(self.kv_norm(pooled)[:, None], cos, sin)[:, 0]  # (B, n, width)
        else:
            new = kv.new_zeros(B, 0, D)
        if pool is None:
            return new
        pool.entries[:B, done:done + n] = new
        return pool.entries[:B, :done + n]


class IndexerScorer(nn.Module):
    """Holds the indexer's per-head weights projection (transformers' DeepseekV4IndexerScorer)."""

    def __init__(self, d_model: int, heads: int):
        super().__init__()
        self.weights_proj = nn.Linear(d_model, heads, bias=False)


class Indexer(Compressor):
    """CSA's lightning indexer (transformers' DeepseekV4Indexer): an overlapping compressor of its
    own at D_i (called, it pools the index keys) and the query heads that score them (:meth:`top`)."""

    def __init__(self, d_model: int, a: Compressed, eps: float):
        super().__init__(d_model, a.index_head_dim, a.compress_rate, True, eps)
        self.heads, self.head_dim, self.topk = a.index_n_heads, a.index_head_dim, a.index_topk
        self.q_b_proj = nn.Linear(a.q_lora_rank, self.heads * self.head_dim, bias=False)
        self.scorer = IndexerScorer(d_model, self.heads)

    def top(self, x, q_residual, keys, qpos, cos, sin) -> Tuple[torch.Tensor, torch.Tensor]:
        """(B, T, k) indices of the entries each query scores highest among those whose window has
        closed by its position, and whether each is such an entry (k = min(index_topk, N))."""
        B, T, _ = x.shape
        q = self.q_b_proj(q_residual).view(B, T, self.heads, self.head_dim).transpose(1, 2)
        q = rotate(q, cos, sin).transpose(1, 2).float()  # (B, T, H_i, D_i)
        scores = F.relu(q @ keys.float().transpose(-1, -2)[:, None]) * self.head_dim ** -0.5  # (B, T, H_i, N)
        w = self.scorer.weights_proj(x).float() * self.heads ** -0.5  # (B, T, H_i)
        index = (scores * w[..., None]).sum(2)  # (B, T, N)
        closed = (qpos + 1) // self.rate  # entries each query may see
        index = index.masked_fill(torch.arange(keys.shape[1], device=x.device) >= closed[:, None], float("-inf"))
        top = index.sort(dim=-1, descending=True, stable=True).indices[..., :min(self.topk, keys.shape[1])]
        return top, top < closed[:, None]


class CSACompressor(Compressor):
    """CSA's compressor with its indexer beneath it, as transformers nests them (weight names)."""

    def __init__(self, d_model: int, a: Compressed, eps: float):
        super().__init__(d_model, a.head_dim, a.compress_rate, True, eps)
        self.indexer = Indexer(d_model, a, eps)


class CompressedAttention(Float32Params):  # its sinks float32, as transformers keeps them
    """The attention of a :class:`Compressed` layer (its cache: :class:`CompressedCache`, or None:
    each forward a whole sequence from position 0, nothing kept). Takes the decoder's attention
    arguments; ``cos`` and ``sin`` are unused: V4 rotates interleaved pairs at its own two bases."""

    HF_MODULE = "self_attn"
    HF_NAMES: Dict[str, str] = {}  # transformers' own names below self_attn
    HF_FUSED: Dict[str, Tuple[str, ...]] = {}

    def __init__(self, cfg, a: Compressed):
        super().__init__()
        C, H, D, eps = cfg.d_model, a.num_heads, a.head_dim, cfg.norm_eps
        self.layout, self.eps, self.H, self.D = a, eps, H, D
        self.q_a_proj = nn.Linear(C, a.q_lora_rank, bias=False)
        self.q_a_norm = V4RMSNorm(a.q_lora_rank, eps)
        self.q_b_proj = nn.Linear(a.q_lora_rank, H * D, bias=False)
        self.kv_proj = nn.Linear(C, D, bias=False)
        self.kv_norm = V4RMSNorm(D, eps)
        # grouped output projection: each of G groups of heads to o_lora_rank, then mixed
        self.o_a_proj = nn.Linear(H * D // a.o_groups, a.o_groups * a.o_lora_rank, bias=False)
        self.o_b_proj = nn.Linear(a.o_groups * a.o_lora_rank, C, bias=False)
        self.sinks = nn.Parameter(torch.zeros(H))
        self.compressor = None
        if a.compresses:
            self.compressor = CSACompressor(C, a, eps) if a.indexed else Compressor(C, D, a.compress_rate, False, eps)
        # sliding layers rotate at the main base; compressing layers, their entries and indexer at compress
        self.register_buffer("inv_freq", rope_inv_freq(a.compress_rope if a.compresses else a.rope, a.rope_dim),
                             persistent=False)
        self.register_buffer("compress_inv_freq", rope_inv_freq(a.compress_rope, a.rope_dim), persistent=False)
        self.scaling = D ** -0.5

    def _rope(self, inv_freq: torch.Tensor, factor: float):
        def tables(positions: torch.Tensor, dtype: torch.dtype):
            freqs = positions[None, :, None].float() * inv_freq.to(positions.device)  # (1, T, R / 2)
            return (freqs.cos() * factor).to(dtype), (freqs.sin() * factor).to(dtype)
        return tables

    def forward(self, x, cos, sin, cache: Optional[CompressedCache], pos):
        B, T, _ = x.shape
        if hasattr(cache, "keep"):  # a serving store's pages: each sequence at its own position, in a cache of its own
            out = []
            for b, start in enumerate(cache.starts):
                one = cache.row(b)
                out.append(self.forward(x[b:b + 1], cos, sin, one, Positions(start, T, x.device)))
                cache.keep(b, one)
            return torch.cat(out)
        a, H, D = self.layout, self.H, self.D
        cache = cache if isinstance(cache, CompressedCache) else None  # the decoder's Uncached: nothing kept
        start = 0 if cache is None else pos.start
        qpos = torch.arange(start, start + T, device=x.device)
        main = a.compress_rope if a.compresses else a.rope
        cos, sin = self._rope(self.inv_freq, main.attention_factor)(qpos, x.dtype)

        q_residual = self.q_a_norm(self.q_a_proj(x))  # (B, T, q_lora_rank): the indexer reads it too
        q = unweighted_rms(self.q_b_proj(q_residual).view(B, T, H, D).transpose(1, 2), self.eps)
        q = rotate(q, cos, sin)  # (B, H, T, D)
        kv = rotate(self.kv_norm(self.kv_proj(x))[:, None], cos, sin)[:, 0]  # (B, T, D): key and value
        if cache is None:
            keys, kpos = kv, qpos
        else:
            cache.begin(start, T)
            keys, kpos = cache.ring_keys(start, kv)  # (B, S, D): held positions in the window, then the new
        # the ring: k <= t and k > t - W (transformers' sliding-window mask)
        visible = (kpos[None] <= qpos[:, None]) & (kpos[None] > qpos[:, None] - a.window)  # (T, S)
        visible = visible.expand(B, T, -1)
        if self.compressor is not None:
            entries, seen = self._pooled(x, q_residual, qpos, start, {} if cache is None else cache.pools)
            keys, visible = torch.cat([keys, entries], 1), torch.cat([visible, seen], -1)
        out = self._attend(q, keys, visible)  # (B, H, T, D)
        out = rotate(out, cos, -sin)  # K = V carried rope into the values: undone at the query's position
        G = a.o_groups
        grouped = out.transpose(1, 2).reshape(B, T, G, -1)  # (B, T, G, H D / G)
        w = self.o_a_proj.weight.view(G, a.o_lora_rank, -1)
        return self.o_b_proj(torch.einsum("btgi,goi->btgo", grouped, w).flatten(2))

    def _pooled(self, x, q_residual, qpos, start: int, pools: Dict[str, Pool]):
        """The pooled entries the new tokens attend (B, N', D) and which of them each query sees
        (B, T, N'): HCA every entry whose window has closed by the query; CSA the indexer's top k of
        those (a decode step gathers just them, N' = k; a prompt masks all N)."""
        a, (B, T, _) = self.layout, x.shape
        rope = self._rope(self.compress_inv_freq, a.compress_rope.attention_factor)
        entries = self.compressor(x, pools.get("compressor"), start, rope)  # (B, N, D)
        N = entries.shape[1]
        if not a.indexed:
            closed = (qpos + 1) // a.compress_rate  # entry w's window ends at (w + 1) m - 1
            return entries, (torch.arange(N, device=x.device) < closed[:, None]).expand(B, T, N)
        indexer = self.compressor.indexer
        index_keys = indexer(x, pools.get("indexer"), start, rope)  # (B, N, D_i); its buffer kept even while N = 0
        if not N:
            return entries, torch.zeros(B, T, 0, dtype=torch.bool, device=x.device)
        top, valid = indexer.top(x, q_residual, index_keys, qpos, *rope(qpos, x.dtype))  # (B, T, k)
        if T == 1:
            return entries.gather(1, top[:, 0, :, None].expand(-1, -1, entries.shape[-1])), valid
        seen = torch.zeros(B, T, N + 1, dtype=torch.bool, device=x.device)  # column N: the invalid picks
        return entries, seen.scatter_(-1, torch.where(valid, top, N), True)[..., :N]

    def _attend(self, q, kv, visible):
        """softmax over each head's scores and its sink (the sink's column dropped) times K = V.
        q (B, H, T, D); kv (B, S, D); visible (B, T, S)."""
        B, H, T, _ = q.shape
        scores = (q @ kv[:, None].transpose(-1, -2)) * self.scaling  # (B, H, T, S)
        scores = scores.masked_fill(~visible[:, None], float("-inf"))
        logits = torch.cat([scores, self.sinks.view(1, H, 1, 1).expand(B, H, T, 1).to(torch.promote_types(
            scores.dtype, self.sinks.dtype))], -1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = logits.softmax(-1)[..., :-1].to(kv.dtype)
        return probs @ kv[:, None]
