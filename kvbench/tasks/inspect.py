"""``task=inspect``: the arithmetic of a model and attention choice, without running a model.

The head→group map and a KV-memory table (per token, per sequence, per batch, for each dtype)
that can be checked by hand against published model shapes.
"""

from __future__ import annotations

from typing import List, Optional

import torch

from kvbench.cache import SCALE_BYTES, kv_cache_bytes
from kvbench.config import CACHE_DTYPE_BYTES, DTYPE_BYTES, BenchConfig
from kvbench.model import Decoder, kv_group_map
from kvbench.model_config import kv_layout_change
from kvbench.units import human_bytes


def describe_kv_groups(num_heads: int, num_kv_heads: int) -> str:
    """The head→group map as text, one line per KV head: ``query heads 0-3 → KV head 0``."""
    mapping = kv_group_map(num_heads, num_kv_heads)
    lines = []
    for kv in range(num_kv_heads):
        heads = [h for h, g in enumerate(mapping) if g == kv]
        span = f"heads {heads[0]}-{heads[-1]}" if len(heads) > 1 else f"head {heads[0]}"
        lines.append(f"query {span} → KV head {kv}")
    return "\n".join(lines)


def kv_memory_table(num_layers: int, num_kv_heads: int, head_dim: int, seq_len: int,
                    batch_size: int, num_heads: Optional[int] = None) -> List[dict]:
    """KV bytes per token (all layers), per sequence of ``seq_len`` and per batch, for each
    dtype a cache can hold (the compute dtypes, then the quantized ``cache.dtype`` values with
    their scales); with ``num_heads``, also the fraction of an MHA cache of the same model."""
    rows = []
    stored = [(dtype, size, "auto") for dtype, size in DTYPE_BYTES.items()]
    stored += [(dtype, 4, dtype) for dtype in CACHE_DTYPE_BYTES]  # the compute size is not used
    for dtype, size, cache_dtype in stored:
        row = {"dtype": dtype,
               "per_token": kv_cache_bytes(num_layers, num_kv_heads, head_dim, 1, 1, size, cache_dtype),
               "per_sequence": kv_cache_bytes(num_layers, num_kv_heads, head_dim, seq_len, 1, size, cache_dtype),
               "per_batch": kv_cache_bytes(num_layers, num_kv_heads, head_dim, seq_len, batch_size, size,
                                           cache_dtype)}
        if num_heads:
            row["vs_mha"] = num_kv_heads / num_heads
        rows.append(row)
    return rows


def parameter_count(cfg: BenchConfig) -> int:
    """Exact parameter count, from a model built on the meta device (no memory is allocated)."""
    with torch.device("meta"):
        return Decoder(cfg.model, cfg.attention).num_params()


def describe(cfg: BenchConfig) -> str:
    m, a, w = cfg.model, cfg.attention, cfg.workload
    seq_len = w.total_len
    group = m.num_heads // a.num_kv_heads
    params = parameter_count(cfg)
    lines = [
        f"model {m.name}: {m.num_layers} layers, d_model {m.d_model}, {m.num_heads} query heads x "
        f"head_dim {m.head_dim}, ffn {m.ffn_dim}, vocab {m.vocab_size}, max_seq_len {m.max_seq_len}",
        f"attention {a.type}: {a.num_kv_heads} KV heads, G = {group} query heads per KV head",
        _layout_line(cfg),
        f"parameters: {params:,} ({', '.join(f'{d} {human_bytes(params * s)}' for d, s in DTYPE_BYTES.items())})",
        "",
        "head → KV group map:",
        describe_kv_groups(m.num_heads, a.num_kv_heads),
        "",
        f"KV cache = 2 · layers · kv_heads · head_dim · seq_len · batch · bytes "
        f"= 2 · {m.num_layers} · {a.num_kv_heads} · {m.head_dim} · seq_len · batch · bytes",
        _elements_line(2 * a.num_kv_heads * m.head_dim, seq_len, w.batch_size),
        f"cache.dtype {' / '.join(CACHE_DTYPE_BYTES)}: bytes = 1 per element + a {SCALE_BYTES}-byte scale per "
        f"(sequence, KV head, position), K and V each",
    ]
    header = ["KV dtype", "per token", f"per sequence ({seq_len})", f"per batch (x{w.batch_size})", "vs MHA"]
    rows = [[r["dtype"], _cell(r["per_token"]), _cell(r["per_sequence"]), _cell(r["per_batch"]),
             f"{r['vs_mha']:.3f}"]
            for r in kv_memory_table(m.num_layers, a.num_kv_heads, m.head_dim, seq_len, w.batch_size,
                                     m.num_heads)]
    widths = [max(len(row[i]) for row in [header] + rows) for i in range(len(header))]
    for row in [header] + rows:
        lines.append(row[0].ljust(widths[0]) + "".join("  " + c.rjust(n) for c, n in zip(row[1:], widths[1:])))
    return "\n".join(lines)


def _layout_line(cfg: BenchConfig) -> str:
    """Whether the layout above is the named model's own, in words (a checkpoint's weights would
    be repeated or mean-pooled to it)."""
    m, a = cfg.model, cfg.attention
    method = ("repeat" if a.num_kv_heads > m.preset_kv_heads else "mean-pool") if m.path else "shape"
    change = kv_layout_change(m, a, method)
    return change["text"] if change else f"the model's own layout ({m.preset_kv_heads} KV heads): no conversion"


def _elements_line(per_token: int, seq_len: int, batch_size: int) -> str:
    """K and V elements of one layer's cache: per token, per sequence, per batch (the arithmetic
    of a KV-cache budget, before the bytes of a dtype)."""
    per_sequence = per_token * seq_len
    return (f"elements per layer (K+V): per token {per_token:,} · per sequence ({seq_len}) {per_sequence:,} "
            f"≈ {_si(per_sequence)} · per batch (x{batch_size}) {per_sequence * batch_size:,} "
            f"≈ {_si(per_sequence * batch_size)}")


def _si(n: float) -> str:
    """``33554432`` -> ``33.6 M``: a count in decimal units, three significant digits."""
    for unit, size in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:g}"


def _cell(n: int) -> str:
    return f"{n:,} B" if n < 1024 else f"{human_bytes(n)} ({n:,})"
