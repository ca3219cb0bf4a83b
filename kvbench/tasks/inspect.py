"""``task=inspect``: the arithmetic of a model and attention choice, without running a model.

The attention as each layer's layout (kvbench.layouts) describes it (its head→group map, its
cache formula) and a KV-memory table (per token, per sequence, per batch, for each dtype) that can
be checked by hand against published model shapes; a mixture of experts' total and active
parameters.
"""

from __future__ import annotations

import math
import textwrap
from typing import List, Optional

import torch

from kvbench.config.bench import BenchConfig
from kvbench.config.conversion import kv_layout_change
from kvbench.config.layer_pattern import job_variant_label
from kvbench.core.dtypes import DTYPE_BYTES, QUANTIZED_DTYPES
from kvbench.footprint import ParameterCounts, parameter_counts
from kvbench.layouts.base import Layouts, bytes_cell
from kvbench.layouts.build import build_layouts
from kvbench.model import Decoder
from kvbench.parallel.per_gpu import split_lines
from kvbench.parallel.plan import Split
from kvbench.quant_weights import describe_stored, module_stored_bytes
from kvbench.units import human_bytes


def kv_memory_table(layers: Layouts, seq_len: int, batch_size: int, vs_mha: bool = True,
                    element: int = 4) -> List[dict]:
    """KV bytes per token, per sequence of ``seq_len`` and per batch, for each dtype a cache can hold,
    by the layouts' own formulas; ``vs_mha``: the fraction of a full MHA cache. Per token is the
    growing part per sequence / ``seq_len``, task=capacity's definition (it falls as ``seq_len``
    grows where a layer's cache stops growing). A quantized row's state (a recurrent layer's, not
    quantized) is in the compute dtype of ``element`` bytes."""
    rows = []
    stored = [(dtype, size, "auto") for dtype, size in DTYPE_BYTES.items()]
    # the compute size is the state's alone; a dtype a layer refuses (its blocks do not fit a head) is no row
    stored += [(dtype, element, dtype) for dtype in QUANTIZED_DTYPES if layers.accepts({"cache.dtype": dtype})]
    for dtype, size, cache_dtype in stored:
        per_sequence = layers.cache_bytes(seq_len, 1, size, cache_dtype)
        state = layers.state_bytes(size, cache_dtype)  # held whatever the length: not per token
        grows = per_sequence - state
        row = {"dtype": dtype, "per_sequence": per_sequence, "state": state,
               "per_batch": layers.cache_bytes(seq_len, batch_size, size, cache_dtype),
               "per_token": grows // seq_len if grows % seq_len == 0 else grows / seq_len}
        if vs_mha:
            row["vs_mha"] = per_sequence / layers.as_mha().cache_bytes(seq_len, 1, size, cache_dtype)
        rows.append(row)
    return rows


def layer_kind_table(layers: Layouts, seq_len: int, batch_size: int, bytes_per_element: int) -> List[dict]:
    """Per kind of layer (a layer reading an earlier layer's K/V is a kind of its own): how many, the
    positions each holds at ``seq_len`` and their bytes."""
    def key(layer):
        return (layer.table_name(), layer.kv_source is not None)

    def order(item):  # the attending layers first: those keeping every position, then rings, smallest first
        (name, shared), layer = item
        held = layer.positions_held(math.inf)
        return layer.state is not None, held < math.inf, held, shared, name

    firsts = {}
    for layer in layers:
        firsts.setdefault(key(layer), layer)
    rows = []
    for (name, shared), _ in sorted(firsts.items(), key=order):
        group = Layouts(layer for layer in layers if key(layer) == (name, shared))
        if shared:
            name += f", reads layer {', '.join(map(str, sorted({layer.kv_source for layer in group})))}"
        rows.append({"kind": name, "layers": len(group), "positions": 0 if shared else group[0].positions_held(seq_len),
                     "per_token": group.bytes_per_token(bytes_per_element),
                     "state": group.state_bytes(bytes_per_element),
                     "per_sequence": group.cache_bytes(seq_len, 1, bytes_per_element),
                     "per_batch": group.cache_bytes(seq_len, batch_size, bytes_per_element)})
    return rows


def parameter_count(cfg: BenchConfig) -> int:
    """Exact parameter count, from one- and two-layer models on the meta device (a model of a million
    layers is counted as fast as one of two)."""
    return parameter_counts(cfg.model, cfg.attention).total


def describe(cfg: BenchConfig, width: Optional[int] = None) -> str:
    """What task=inspect prints; with ``width``, laid out to fit it: a sentence wraps between words
    and a table wider than it is printed as several, each led by its first column."""
    m, a, w = cfg.model, cfg.attention, cfg.workload
    seq_len = w.total_len
    layers = build_layouts(m, a, cfg.cache.state_dtype)
    counts = parameter_counts(m, a)
    params = counts.total
    layout = layers.describe(a, seq_len, w.batch_size)
    lines = [
        f"model {m.name}: {m.num_layers} layers, d_model {m.d_model}, {m.num_heads} query heads x "
        f"head_dim {m.head_dim}, ffn {m.ffn_dim}, vocab {m.vocab_size}, max_seq_len {m.max_seq_len}",
        layout[0],
        f"variant: {job_variant_label(cfg)} (its name in progress lines and tables)",
        _layout_line(cfg, layers),
        f"parameters: {params:,} ({', '.join(f'{d} {human_bytes(params * s)}' for d, s in DTYPE_BYTES.items())})",
        *([f"left out of this preset: {m.left_out}"] if m.left_out else []),
        *_moe_lines(cfg, counts),
        *_stored_lines(cfg),
        *layout[1:],
    ]
    rt = cfg.runtime
    if rt.tensor_parallel > 1 or rt.expert_parallel > 1:  # the split's figures, by formula (kvbench.parallel)
        lines += split_lines(m, a, layers, Split(rt.tensor_parallel, 1, rt.expert_parallel), rt.dtype,
                             cfg.cache.dtype, seq_len)
    lines = _wrapped(lines, width)
    size = DTYPE_BYTES[cfg.runtime.dtype]
    state = layers.state_bytes(DTYPE_BYTES[cfg.runtime.dtype]) > 0
    capped = layers.caps_positions()  # per token then depends on seq_len
    header = ["KV dtype", f"per token (at {seq_len})" if capped else "per token",
              *(["state per sequence"] if state else []), f"per sequence ({seq_len})",
              f"per batch (x{w.batch_size})", "vs full MHA" if capped or state else "vs MHA"]
    rows = [[r["dtype"], bytes_cell(r["per_token"]), *([bytes_cell(r["state"])] if state else []),
             bytes_cell(r["per_sequence"]), bytes_cell(r["per_batch"]), f"{r['vs_mha']:.3f}"]
            for r in kv_memory_table(layers, seq_len, w.batch_size, element=size)]
    lines += _aligned(header, rows, width)
    lines += _wrapped(layers.memory_lines(seq_len, cfg.runtime.dtype, size), width)
    if cfg.cache.dtype != "auto":
        lines += _wrapped([layers.precision_text(cfg.cache.dtype, cfg.runtime.dtype)], width)
    notes = layers.kind_notes()
    if notes:
        lines += _wrapped(["", "; ".join(notes) + f"; KV by kind of layer in {cfg.runtime.dtype}: per sequence = "
                           "positions held · bytes per position + state:"], width)
        lines += _kind_lines(layers, seq_len, w.batch_size, size, width)
    lines += _wrapped(layers.closing_lines(seq_len, cfg.runtime.dtype, size), width)
    return "\n".join(lines)


def _wrapped(lines: List[str], width: Optional[int]) -> List[str]:
    """``lines`` with each longer than ``width`` broken between words, its rest indented."""
    if width is None:
        return list(lines)
    return [part for text in lines for line in text.split("\n")
            for part in (textwrap.wrap(line, width, subsequent_indent="  ", break_long_words=False,
                                       break_on_hyphens=False) if len(line) > width else [line])]


def _moe_lines(cfg: BenchConfig, counts: ParameterCounts) -> List[str]:
    """A mixture of experts' MLPs and the parameters one token uses (none for a dense model)."""
    m = cfg.model
    if m.moe is None:
        return []
    dense = sorted(m.moe.dense_layers)
    sparse = m.num_layers - len(dense)
    where = f"{sparse} of {m.num_layers} layers" + (f" (dense MLP of {m.ffn_dim} in layers "
                                                   f"{', '.join(map(str, dense))})" if dense else "")
    active = counts.active
    sizes = ", ".join(f"{d} {human_bytes(active * size)}" for d, size in DTYPE_BYTES.items())
    return [f"mixture of experts in {where}: {m.moe.describe()}",
            f"active parameters per token: {active:,} without the embedding table (a token reads one row of it), "
            f"{active + counts.embedding:,} with it ({sizes} without); a decode step reads the experts its batch "
            f"routes to: at most min({m.moe.num_experts}, batch x {m.moe.top_k}) per layer"]


def _stored_lines(cfg: BenchConfig) -> List[str]:
    """What a quantized checkpoint's files weigh (model.weights_stored), its other tensors in bfloat16 as
    published; none for a model stored in the compute dtype."""
    m = cfg.model
    if m.weights_stored is None:
        return []
    with torch.device("meta"):  # shapes only: nothing allocated
        decoder = Decoder(m, cfg.attention)
    stored, bf16 = module_stored_bytes(decoder, m.weights_stored, 2), module_stored_bytes(decoder, None, 2)
    return [f"weights as published (model.weights_stored={m.weights_stored}): {human_bytes(stored)} "
            f"({describe_stored(m.weights_stored)}; the rest in bfloat16), against {human_bytes(bf16)} in bfloat16; "
            f"kvbench dequantizes them on load to runtime.dtype={cfg.runtime.dtype}"]


def _kind_lines(layers: Layouts, seq_len: int, batch_size: int, size: int, width: Optional[int] = None) -> List[str]:
    kinds = layer_kind_table(layers, seq_len, batch_size, size)
    state = any(k["state"] for k in kinds)
    return _aligned(["layers", "count", "positions held", "per token", *(["state per sequence"] if state else []),
                     f"per sequence ({seq_len})", f"per batch (x{batch_size})"],
                    [[k["kind"], str(k["layers"]), f"{k['positions']:,}", bytes_cell(k["per_token"]),
                      *([bytes_cell(k["state"])] if state else []), bytes_cell(k["per_sequence"]),
                      bytes_cell(k["per_batch"])]
                     for k in kinds], width)


def _aligned(header: List[str], rows: List[List[str]], width: Optional[int] = None) -> List[str]:
    """A table as aligned text; where it is wider than ``width``, as several tables of its first
    column and as many of the others as fit, a blank line between them."""
    widths = [max(len(row[i]) for row in [header] + rows) for i in range(len(header))]
    groups: List[List[int]] = [[]]
    for i in range(1, len(header)):
        if groups[-1] and width is not None and widths[0] + sum(2 + widths[j] for j in groups[-1] + [i]) > width:
            groups.append([])
        groups[-1].append(i)
    out: List[str] = []
    for n, group in enumerate(groups):
        out += [""] if n else []
        out += [row[0].ljust(widths[0]) + "".join("  " + row[i].rjust(widths[i]) for i in group)
                for row in [header] + rows]
    return out


def _layout_line(cfg: BenchConfig, layers: Layouts) -> str:
    """Whether the layout above is the named model's own, in words (a checkpoint's weights would
    be repeated or mean-pooled to it)."""
    m, a = cfg.model, cfg.attention
    pooled = m.path and layers.converts_kv_heads()
    method = ("repeat" if a.num_kv_heads > m.preset_kv_heads else "mean-pool") if pooled else "shape"
    change = kv_layout_change(m, a, method)
    if change:
        return change["text"]
    # no change: the layout asked is the model's own (no layer attends: its KV-head count)
    return f"the model's own layout ({layers.in_words() or f'{m.preset_kv_heads} KV heads'}): no conversion"
