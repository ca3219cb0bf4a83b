"""Compressed layers: DeepSeek-V4's attention, as transformers' DeepseekV4Attention (its three
``layer_types``), as data: what a sequence holds and a decode step reads.

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

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Dict, List, Mapping, Optional, Tuple

from kvbench.core.errors import ConfigError
from kvbench.layouts.base import LayerLayout, Limit
from kvbench.layouts.kv_heads import KVHeads
from kvbench.layouts.pages import CompressedPool, Ring

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

    def page_spec(self, element: int, cache_dtype: str = "auto") -> Ring:
        """The ring of W positions (one K=V head of D), and with a compressor its pool of one entry per
        m tokens and its buffers: what :meth:`sequence_bytes` counts, as a serving store would page it."""
        ring = self.head_dim * element
        if not self.compresses:
            return Ring(ring, self.window)
        return CompressedPool(ring, self.window, self.entry_width * element, self.compress_rate,
                              self.buffer_bytes(element))

    def bytes_per_position(self, element: int, cache_dtype: str = "auto") -> float:
        # Layouts.bytes_per_token's figure (while no window is full), as a float; exact as token_bytes
        return float(self.token_bytes(element))

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
            Limit("workload.store", (), "a serving store pages a DeepSeek-V4 layer's ring and pool by their spec "
                  "(kvbench.layouts.pages.CompressedPool), but no store manager serves it yet; use workload=decode"),
            Limit("cache.dtype", ("auto",), "int8 / float8 codes are for K/V heads; a DeepSeek-V4 layer keeps its "
                  "ring, pool and compressor buffers in the compute dtype; use cache.dtype=auto"),
            Limit("runtime.compile", ("false", "default"), "the fixed-shape step reads a context bucket of K/V; a "
                  "DeepSeek-V4 layer's ring and pool have no such view (not built); use false or default"))

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
                "per m tokens, averaged over them)" for lay in layers.unique() if isinstance(lay, Compressed)]


def _count(key: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{key}={value!r}: must be a positive integer")


# ---- config.json ---------------------------------------------------------------------------

ARCHITECTURE = "DeepseekV4ForCausalLM"
# DeepseekV4Config's defaults for what a config.json may leave out
DEFAULTS = {"num_hidden_layers": 43, "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512,
            "q_lora_rank": 1024, "o_groups": 8, "o_lora_rank": 1024, "sliding_window": 128, "index_n_heads": 64,
            "index_head_dim": 128, "index_topk": 512, "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
            "max_position_embeddings": 1048576}
DEFAULT_RATES = {CSA: 4, HCA: 128}
DEFAULT_HASH_LAYERS = 3


def _value(cfg: Mapping[str, Any], key: str, number: bool = False) -> Any:
    """``cfg[key]`` (its default when absent or null), a positive integer (a positive number if ``number``)."""
    value = cfg.get(key)
    value = DEFAULTS[key] if value is None else value
    kinds = (int, float) if number else (int,)
    if isinstance(value, bool) or not isinstance(value, kinds) or value <= 0 or \
            (number and not math.isfinite(value)):
        raise ConfigError(f"{key}={value!r}: must be a positive {'number' if number else 'integer'}")
    return value


def v4_layer_types(cfg: Mapping[str, Any]) -> List[str]:
    """Each layer's type in a DeepseekV4 config.json, as DeepseekV4Config reads it: ``layer_types``,
    else the legacy ``compress_ratios`` (0 / 4 / 128 per layer), else two HCA layers then CSA and
    HCA interleaved; cut to num_hidden_layers."""
    n = _value(cfg, "num_hidden_layers")
    types, ratios = cfg.get("layer_types"), cfg.get("compress_ratios")
    if types is None and ratios is not None:
        if not isinstance(ratios, list) or any(isinstance(r, bool) or r not in RATIO_TYPES for r in ratios):
            raise ConfigError(f"compress_ratios={ratios!r}: must be a list of {', '.join(map(str, RATIO_TYPES))} "
                              "per layer")
        types = [RATIO_TYPES[r] for r in ratios]
    elif types is None:
        types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
    elif not isinstance(types, list) or any(t not in LAYER_TYPES for t in types):
        raise ConfigError(f"layer_types={types!r}: each must be one of {', '.join(LAYER_TYPES)}")
    if len(types) < n:  # transformers cuts a longer list and refuses a shorter one
        raise ConfigError(f"layer_types={types!r}: {len(types)} entries for num_hidden_layers={n}")
    return list(types[:n])


def v4_mlp_layer_types(cfg: Mapping[str, Any]) -> List[str]:
    """Each layer's MLP in a DeepseekV4 config.json: ``hash_moe`` (experts chosen by a token-id
    table) or ``moe`` (learned routing); default the first ``num_hash_layers`` (3) hash-routed."""
    n = _value(cfg, "num_hidden_layers")
    types = cfg.get("mlp_layer_types")
    if types is None:
        hashed = cfg.get("num_hash_layers")
        hashed = DEFAULT_HASH_LAYERS if hashed is None else hashed
        if isinstance(hashed, bool) or not isinstance(hashed, int) or hashed < 0:
            raise ConfigError(f"num_hash_layers={hashed!r}: must be a non-negative integer")
        return ["hash_moe"] * min(n, hashed) + ["moe"] * max(0, n - hashed)
    if not isinstance(types, list) or len(types) < n or any(t not in MLP_LAYER_TYPES for t in types):
        raise ConfigError(f"mlp_layer_types={types!r}: {n} entries (num_hidden_layers), each one of "
                          f"{', '.join(MLP_LAYER_TYPES)}")
    return list(types[:n])


def compress_rates(cfg: Mapping[str, Any]) -> Dict[str, int]:
    """m per compressing layer type: ``compress_rates`` (default 4 and 128), the legacy
    ``compress_rate_csa`` / ``compress_rate_hca`` winning over it as in DeepseekV4Config. A
    ``compress_rates`` that leaves out a type some layer has is refused, as transformers fails to
    build that layer (it does not fill the missing type with its default)."""
    given = cfg.get("compress_rates")
    if given is not None and (not isinstance(given, dict) or set(given) - {CSA, HCA}):
        raise ConfigError(f"compress_rates={given!r}: must map {CSA} and {HCA} to a positive integer each")
    rates = dict(DEFAULT_RATES if given is None else given)
    for key, layer_type in (("compress_rate_csa", CSA), ("compress_rate_hca", HCA)):
        if cfg.get(key) is not None:
            _count(key, cfg[key])
            rates[layer_type] = cfg[key]
    for layer_type, rate in rates.items():
        _count(f"compress_rates.{layer_type}", rate)
    missing = [t for t in (CSA, HCA) if t in v4_layer_types(cfg) and t not in rates]
    if missing:
        raise ConfigError(f"compress_rates={given!r}: no rate for {missing[0]}, which layers "
                          f"{[i for i, t in enumerate(v4_layer_types(cfg)) if t == missing[0]]} are")
    return rates


def _ropes(cfg: Mapping[str, Any]) -> Tuple[Rope, Rope, float]:
    """The ``main`` and ``compress`` rotary bases and partial_rotary_factor, nested in
    ``rope_parameters`` (``main`` / ``compress``) or flat (rope_theta, compress_rope_theta, and a
    YaRN ``rope_parameters`` / ``rope_scaling`` for the compressed branch only)."""
    params = cfg.get("rope_parameters")
    params = cfg.get("rope_scaling") if params is None else params
    params = {} if params is None else params
    if not isinstance(params, dict):
        raise ConfigError(f"rope_parameters={params!r}: must be a mapping")
    nested = isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict)
    main = params["main"] if nested else {"rope_theta": _value(cfg, "rope_theta", number=True)}
    compress = params["compress"] if nested else {
        **{k: v for k, v in params.items() if k not in ("main", "compress")},
        "rope_theta": _value(cfg, "compress_rope_theta", number=True)}
    ropes = []
    for label, p in (("main", main), ("compress", compress)):
        kind = p.get("rope_type", p.get("type", "default"))
        if kind not in ROPE_TYPES:
            raise ConfigError(f"rope_parameters.{label}.rope_type={kind!r}: must be one of {', '.join(ROPE_TYPES)}")
        theta = p.get("rope_theta")
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not 0 < theta < math.inf:
            raise ConfigError(f"rope_parameters.{label}.rope_theta={theta!r}: must be a positive number")
        if kind == "default":
            ropes.append(Rope(float(theta)))
            continue
        factor = p.get("factor")
        original = p.get("original_max_position_embeddings")
        for key, value in (("factor", factor), ("original_max_position_embeddings", original)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"rope_parameters.{label}.{key}={value!r}: yarn needs a positive number")
        ropes.append(Rope(float(theta), "yarn", float(factor), int(original), float(p.get("beta_fast") or 32),
                          float(p.get("beta_slow") or 1), float(p.get("attention_factor", 1.0))))
    key, factor = "partial_rotary_factor", cfg.get("partial_rotary_factor", main.get("partial_rotary_factor"))
    D = _value(cfg, "head_dim")
    if factor is None:  # legacy qk_rope_head_dim, else V4's 64 / 512
        key, rope_dim = "qk_rope_head_dim", cfg.get("qk_rope_head_dim")
        factor = 64 / 512 if rope_dim is None else rope_dim / D if isinstance(rope_dim, int) else rope_dim
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
        raise ConfigError(f"{key}={cfg.get(key)!r}: must be a number in (0, 1] (of head_dim) "
                          if key == "partial_rotary_factor" else
                          f"{key}={cfg.get(key)!r}: must be a positive integer at most head_dim={D}")
    # transformers rotates int(head_dim x factor) channels in pairs: a width it would cut or pair
    # unevenly is refused under the key the file wrote
    if D * factor != int(D * factor) or int(D * factor) % 2:
        raise ConfigError(f"{key}={cfg.get(key)!r}: head_dim={D} x partial_rotary_factor = {D * factor:g} rotated "
                          "channels, which must be a whole even number")
    return ropes[0], ropes[1], factor


def compressed_from_hf(cfg: Mapping[str, Any]) -> List[Compressed]:
    """Each layer's layout in a DeepseekV4ForCausalLM config.json (DeepseekV4Config's defaults for
    absent keys; layers of one type share one layout); a value it cannot run refused in one line
    naming its key."""
    arch = cfg.get("architectures")
    if arch is not None and (not isinstance(arch, list) or ARCHITECTURE not in arch):
        raise ConfigError(f"architectures={arch!r}: a DeepSeek-V4 layer is read from {ARCHITECTURE}")
    kv_heads = cfg.get("num_key_value_heads")
    if kv_heads is not None and (isinstance(kv_heads, bool) or kv_heads != 1):
        raise ConfigError(f"num_key_value_heads={kv_heads!r}: DeepSeek-V4 attends one K=V head (1)")
    types, rates = v4_layer_types(cfg), compress_rates(cfg)
    main, compress, factor = _ropes(cfg)
    D = _value(cfg, "head_dim")
    shape = dict(window=_value(cfg, "sliding_window"), num_heads=_value(cfg, "num_attention_heads"), head_dim=D,
                 rope_dim=int(D * factor), q_lora_rank=_value(cfg, "q_lora_rank"), o_groups=_value(cfg, "o_groups"),
                 o_lora_rank=_value(cfg, "o_lora_rank"), index_n_heads=_value(cfg, "index_n_heads"),
                 index_head_dim=_value(cfg, "index_head_dim"), index_topk=_value(cfg, "index_topk"),
                 rope=main, compress_rope=compress)
    v4_mlp_layer_types(cfg)  # refused here too: a schedule transformers would not build
    kinds = {t: Compressed(layer_type=t, compress_rate=rates.get(t, 0), **shape) for t in dict.fromkeys(types)}
    return [kinds[t] for t in types]
