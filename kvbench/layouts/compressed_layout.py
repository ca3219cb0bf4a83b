"""The layout of a compressed layer: DeepSeek-V4's attention, as transformers' DeepseekV4Attention
(its three ``layer_types``), as data: what a sequence holds and a decode step reads (the kind's
home, with its config.json reading and registration: :mod:`kvbench.layouts.compressed`).

Every layer attends a K=V sliding ring of the last W = ``sliding_window`` positions (one KV head of
``head_dim`` D, read as key and value). A ``compressed_sparse_attention`` (CSA) layer also folds
each m = ``compress_rates["compressed_sparse_attention"]`` tokens into one pooled entry (gated
softmax over an overlapping window of 2m: the previous window's first half and this one's second)
and its lightning indexer keeps one key of ``index_head_dim`` D_i per entry; a query attends the
ring plus the indexer's top ``index_topk`` entries. A ``heavily_compressed_attention`` (HCA) layer
folds each m' tokens (no overlap, no indexer) and attends the ring plus every entry. A
``sliding_attention`` layer is the ring alone.

Per sequence, at S tokens, a layer holds (e: bytes of the compute dtype; float32 where transformers
keeps float32):

    ring      min(S, W) · D · e
    pool      floor(S / m) · (D + D_i) · e          (HCA: D only; sliding: none)
    buffers   (m - 1) · 2 · (C + C_i) · e           the projected kv and gate of the < m tokens not yet
                                                    folded (C = 2D for CSA, D for HCA; C_i = 2 D_i)
    overlap   m · (D + D_i) · (e + 4)               CSA only: the last window's first-half kv (e) and
                                                    its gate plus position bias (float32)

The buffers and the overlap are held at their capacity whatever S (a static cache's allocation);
:meth:`Compressed.token_bytes` is what one more token adds, exactly, as a ``Fraction`` (D · e for
the ring while it fills, plus (D + D_i) · e / m for the pool). A decode step at S reads the ring,
then every index key and min(k, floor(S / m)) entries (CSA) or every entry (HCA); the compressor's
buffer is read once per m steps (when a window closes) and is left out of the step's bytes.

Notation: S tokens, W window, D head_dim, D_i index_head_dim, H heads, H_i index heads, m the rate,
k index_topk.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Any, ClassVar, Dict, List, Optional, Tuple

from kvbench.core.errors import ConfigError
from kvbench.layouts.base import LayerLayout, Limit
from kvbench.layouts.kv_heads import KVHeads
from kvbench.layouts.pages import CompressedPool

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
# legacy config.json: one compress ratio per layer (transformers' _COMPRESS_RATIO_TO_LAYER_TYPE)
RATIO_TYPES = {0: SLIDING, 4: CSA, 128: HCA}
MLP_LAYER_TYPES = ("hash_moe", "moe")
GATE_BYTES = 4  # the overlap's gate has the float32 position bias added (transformers keeps it float32)
ROPE_TYPES = ("default", "yarn")


@dataclass(frozen=True)
class Rope:
    """One of V4's two rotary bases (``main``: sliding layers; ``compress``: CSA / HCA layers, their
    compressors and indexer): ``theta``, and YaRN's ``factor``, ``original_max`` (pretraining
    context), ``beta_fast``, ``beta_slow`` and ``attention_factor`` (V4 forces 1.0) when ``type`` is yarn."""

    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0
    original_max: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0


@dataclass(frozen=True)
class Compressed(LayerLayout):
    """One DeepSeek-V4 layer of ``layer_type`` (config.json's names; ``window`` is sliding_window,
    ``compress_rate`` m of its type, 0 for a sliding layer). ``rope_dim`` is qk_rope_head_dim =
    head_dim x partial_rotary_factor, rotated at the end of each head, in interleaved pairs."""

    # its cache (kvbench.cache.layer_cache builds it for cache.impl=static, by name: the torch layer is above)
    CACHE: ClassVar[str] = "kvbench.layouts.compressed_attention:CompressedCache"
    # its layer of a serving store's forward, over the pages of its CompressedPool (the store's manager builds it)
    PAGED: ClassVar[str] = "kvbench.layouts.compressed_pages:CompressedPages"
    layer_type: str = CSA
    num_heads: int = 64
    head_dim: int = 512
    rope_dim: int = 64
    q_lora_rank: int = 1024
    o_groups: int = 8
    o_lora_rank: int = 1024
    compress_rate: int = 4
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    rope: Rope = Rope()
    compress_rope: Rope = Rope(160000.0)

    kind = "compressed"

    def __post_init__(self):
        # a layout built by hand (a test, a preset) is held to what a config.json is (compressed_from_hf)
        if self.layer_type not in LAYER_TYPES:
            raise ConfigError(f"layer_types={self.layer_type!r}: each must be one of {', '.join(LAYER_TYPES)}")
        for key in ("window", "num_heads", "head_dim", "q_lora_rank", "o_groups", "o_lora_rank", "index_n_heads",
                    "index_head_dim", "index_topk"):
            _count(key if key != "window" else "sliding_window", getattr(self, key))
        if self.layer_type == SLIDING:
            if self.compress_rate != 0:
                raise ConfigError(f"compress_rate={self.compress_rate!r}: a sliding_attention layer compresses "
                                  "nothing (0)")
        else:
            _count(f"compress_rates.{self.layer_type}", self.compress_rate)
        if isinstance(self.rope_dim, bool) or not isinstance(self.rope_dim, int) or self.rope_dim < 2 or \
                self.rope_dim % 2 or self.rope_dim > self.head_dim:
            raise ConfigError(f"qk_rope_head_dim={self.rope_dim!r}: must be even, at least 2 and at most "
                              f"head_dim={self.head_dim} (head_dim x partial_rotary_factor)")
        if self.layer_type == CSA and self.rope_dim > self.index_head_dim:
            raise ConfigError(f"index_head_dim={self.index_head_dim!r}: the indexer rotates the last "
                              f"qk_rope_head_dim={self.rope_dim} of each of its heads, so it must be at least that")
        if self.num_heads % self.o_groups:
            raise ConfigError(f"o_groups={self.o_groups!r}: must divide num_attention_heads={self.num_heads} "
                              "(the grouped output projection takes whole heads)")

    # ---- what a sequence holds ----

    @property
    def compresses(self) -> bool:
        return self.layer_type != SLIDING

    @property
    def indexed(self) -> bool:
        """Whether the layer has a lightning indexer (and an overlapping compressor): CSA."""
        return self.layer_type == CSA

    @property
    def entry_width(self) -> int:
        """Elements of one pooled entry: its KV (D) and, with an indexer, its index key (D_i)."""
        return self.head_dim + (self.index_head_dim if self.indexed else 0) if self.compresses else 0

    def entries(self, seq_len: float) -> int:
        """Pooled entries at ``seq_len`` tokens: one per whole window of m."""
        return int(seq_len // self.compress_rate) if self.compresses else 0

    def attended_entries(self, seq_len: float) -> int:
        """Entries a decode step at ``seq_len`` attends: the top k (CSA) or all (HCA)."""
        n = self.entries(seq_len)
        return min(n, self.index_topk) if self.indexed else n

    def attention_params(self, d_model: int) -> int:
        """Parameters of the layer's attention (for the footprint's count once the kind is registered):
        the query LoRA and its norm, the K=V projection and norm, the grouped output LoRA, the sinks,
        and a compressor's kv and gate projections (two series for CSA), position bias and norm, with
        CSA's indexer (its own such compressor at D_i, query projection and head weights)."""
        C, H, D, q = d_model, self.num_heads, self.head_dim, self.q_lora_rank
        params = C * q + q + q * H * D + C * D + D + H * D * self.o_lora_rank + \
            self.o_groups * self.o_lora_rank * C + H
        series = 2 if self.indexed else 1
        if self.compresses:
            params += (2 * C + self.compress_rate) * series * D + D
        if self.indexed:
            Di, Hi = self.index_head_dim, self.index_n_heads
            params += (2 * C + self.compress_rate) * 2 * Di + Di + q * Hi * Di + C * Hi
        return params

    @property
    def stored(self) -> Tuple[int, Tuple[int, ...]]:
        return 1, (self.head_dim,)  # the ring: one K=V head per position

    def shard(self, ranks: int) -> "Compressed":
        # 1 / ranks of the query heads (their LoRA's up projection, sinks) and of the output groups, or of one
        # group's heads (each rank's o_a_proj columns for its heads; o_b_proj is linear after it, so the ranks'
        # sum is the whole); the one K=V head, its compressors and the indexer are every head's: whole on each
        # rank, as the ring and pool are
        return replace(self, num_heads=self.num_heads // ranks, o_groups=max(1, self.o_groups // ranks))

    def tensor_refusal(self, ranks: int) -> Optional[str]:
        G = self.o_groups
        return (f"its {G} output groups (o_groups) split over ranks in whole groups only (or one group by its "
                f"heads); use a divisor of {G}" if G % ranks and G > 1 else super().tensor_refusal(ranks))

    @property
    def rotary_dim(self) -> int:
        return self.rope_dim

    def buffer_bytes(self, element: int) -> int:
        """What a sequence holds for the compressors whatever its length: the kv and gate of up to
        m - 1 tokens not yet folded (the main compressor's, and the indexer's), and for CSA the
        last window's first halves (kv in the compute dtype, gate in float32)."""
        if not self.compresses:
            return 0
        width = (2 * self.head_dim + 2 * self.index_head_dim) if self.indexed else self.head_dim
        buffers = (self.compress_rate - 1) * 2 * width * element
        overlap = self.compress_rate * (self.head_dim + self.index_head_dim) * (element + GATE_BYTES) \
            if self.indexed else 0
        return buffers + overlap

    def state_bytes(self, element: int, cache_dtype: str = "auto") -> int:
        return self.buffer_bytes(element)

    def positions_held(self, seq_len: float) -> float:
        return min(seq_len, self.window)

    def ring_bytes(self, seq_len: float, element: int) -> int:
        return int(self.positions_held(seq_len)) * self.head_dim * element

    def pool_bytes(self, seq_len: float, element: int) -> int:
        return self.entries(seq_len) * self.entry_width * element

    def sequence_bytes(self, seq_len: float, element: int, cache_dtype: str = "auto") -> float:
        return self.positions_held(seq_len) * self.head_dim * element + self.pool_bytes(seq_len, element) + \
            self.buffer_bytes(element)

    def token_bytes(self, element: int, window_full: bool = False) -> Fraction:
        """Bytes one more token adds, exactly, averaged over a window of m tokens (the pool grows by
        one entry every m): the ring's D · e while it fills (none once ``window_full``), plus
        (D + D_i) · e / m (CSA) or D · e / m' (HCA)."""
        ring = 0 if window_full else self.head_dim * element
        return ring + (Fraction(self.entry_width * element, self.compress_rate) if self.compresses else 0)

    def page_spec(self, element: int, cache_dtype: str = "auto") -> CompressedPool:
        """The ring of W positions (one K=V head of D), and with a compressor its pool of one entry per
        m tokens and its buffers: what :meth:`sequence_bytes` counts, as a serving store pages it (a
        sliding layer too: the ring alone, m = 0, kept as this kind's cache is kept)."""
        return CompressedPool(self.head_dim * element, self.window, self.entry_width * element, self.compress_rate,
                              self.buffer_bytes(element))

    def read_bytes(self, context: float, element: int, cache_dtype: str = "auto") -> float:
        index_keys = self.entries(context) * self.index_head_dim if self.indexed else 0
        return (self.positions_held(context) + self.attended_entries(context)) * self.head_dim * element + \
            index_keys * element

    def step_flops(self, context: float) -> float:
        # each head: q·k and p·v over D for every ring position and attended entry (K = V, one head);
        # the indexer: each of its heads' q·k over D_i for every entry, and the weighted sum over heads
        keys = self.positions_held(context) + self.attended_entries(context)
        index = 2.0 * self.index_n_heads * (self.index_head_dim + 1) * self.entries(context) if self.indexed else 0
        return 4.0 * self.num_heads * self.head_dim * keys + index

    def as_mha(self) -> LayerLayout:
        return KVHeads(None, self.num_heads, self.num_heads, self.head_dim)

    def fields(self) -> Dict[str, Any]:
        return {"layer_type": self.layer_type, "sliding_window": self.window,
                **({"compress_rate": self.compress_rate} if self.compresses else {}),
                **({"index_topk": self.index_topk} if self.indexed else {})}

    def limits(self, index: Optional[int] = None) -> Tuple[Limit, ...]:
        # not the window's own limits: the ring here is this kind's, with its pool beside it
        return (
            Limit("cache.impl", ("static", "none"), "a DeepSeek-V4 layer keeps a ring of W positions, a pool and its "
                  "compressors' buffers, allocated once (a concatenating cache is not built for it); use "
                  "cache.impl=static or none"),
            Limit("cache.shared", (False, None), "a shared prefix holds K/V once for many sequences; a DeepSeek-V4 "
                  "layer's compressor buffers are each sequence's own (not built); use cache.shared=false"),
            Limit("cache.dtype", ("auto",), "int8 / float8 codes are for K/V heads; a DeepSeek-V4 layer keeps its "
                  "ring, pool and compressor buffers in the compute dtype; use cache.dtype=auto"),
            Limit("runtime.compile", ("false", "default"), "the fixed-shape step reads a context bucket of K/V; a "
                  "DeepSeek-V4 layer's ring and pool have no such view (not built); use false or default"),
            # a model's K/V heads repeated or mean-pooled (checkpoint.convert_kv_heads) make no compressed layer
            Limit("kv_conversion", ("none",), "converts K/V heads by mean-pooling them; a DeepSeek-V4 layer keeps one "
                  "K=V head, a pool and its compressors' buffers, which pooling does not make (not built)"))

    # ---- how inspect describes it ----

    note = ("a DeepSeek-V4 layer holds a ring of W positions, one pooled entry per m tokens (CSA: and an index "
            "key) and its compressors' buffers")

    def table_name(self) -> str:
        rate = f" m={self.compress_rate}" if self.compresses else ""
        return f"{ {SLIDING: 'sliding', CSA: 'CSA', HCA: 'HCA'}[self.layer_type]} W={self.window}{rate}".strip()

    def in_words(self) -> str:
        what = {SLIDING: "the ring only", CSA: f"one entry per {self.compress_rate} tokens, top {self.index_topk}",
                HCA: f"one entry per {self.compress_rate} tokens, all"}[self.layer_type]
        return f"DeepSeek-V4 {self.layer_type} (K=V ring of {self.window} x {self.head_dim}; {what})"

    def describe_layers(self, layers, attention, seq_len: int, batch_size: int) -> List[str]:
        counts = {t: sum(getattr(layer, "layer_type", None) == t for layer in layers) for t in LAYER_TYPES}
        return [f"DeepSeek-V4 attention: {self.num_heads} query heads over one K=V head of {self.head_dim}; "
                + ", ".join(f"{n} {t}" for t, n in counts.items() if n),
                "per sequence = ring min(S, W)·D + pool floor(S/m)·(D + D_i) + the compressors' buffers, "
                "times bytes per element (docs: layout)"]

    def memory_lines(self, layers, dtype: str, element: int) -> List[str]:
        # said once for the kind (inspect asks one layer of each kind): a line per layer type present
        return [f"a DeepSeek-V4 {lay.layer_type} layer adds {lay.token_bytes(element)} B per token in {dtype} "
                f"while its ring fills, then {lay.token_bytes(element, window_full=True)} B (exact: a pooled entry "
                "per m tokens, averaged over them)" for lay in _types(layers)]

    def closing_lines(self, layers, seq_len: int, dtype: str, element: int) -> List[str]:
        # what a sequence holds is not what a step reads: both per layer type, at seq_len
        return [f"DeepSeek-V4 {lay.layer_type} x {n} at {seq_len} tokens ({dtype}), per layer: held per sequence "
                f"{lay.sequence_bytes(seq_len, element):,} B (ring {lay.ring_bytes(seq_len, element):,} + pool "
                f"{lay.pool_bytes(seq_len, element):,} + buffers {lay.buffer_bytes(element):,}), per token "
                f"{float(lay.token_bytes(element, window_full=seq_len >= lay.window)):g} B, read per step "
                f"{lay.read_bytes(seq_len, element):,} B" for lay, n in _types(layers, counted=True)]


def _count(key: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{key}={value!r}: must be a positive integer")


def _types(layers, counted: bool = False):
    """Each DeepSeek-V4 layout of ``layers`` once, in order (with its number of layers)."""
    found = [(lay, n) for _, lay, n in layers.distinct if isinstance(lay, Compressed)]
    return found if counted else [lay for lay, _ in found]
