"""``task=inspect``: the arithmetic of a model and attention choice, without running a model.

The head→group map and a KV-memory table (per token, per sequence, per batch, for each dtype)
that can be checked by hand against published model shapes: K/V heads (MHA, GQA, MQA, with
sliding-window layers and layers that read an earlier layer's K/V) or MLA's one latent per token
and layer (with DSA, also its indexer's key); a mixture of experts' total and active parameters.
"""

from __future__ import annotations

from typing import List

from kvbench.config.bench import BenchConfig
from kvbench.config.dtypes import CACHE_DTYPE_BYTES, DTYPE_BYTES, SCALE_BYTES
from kvbench.config.errors import ConfigError
from kvbench.config.model import kv_layout_change
from kvbench.footprint import ParameterCounts, parameter_counts
from kvbench.layouts.base import Layouts
from kvbench.layouts.build import build_layouts
from kvbench.layouts.kv_heads import kv_group_map
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


def kv_memory_table(layers: Layouts, seq_len: int, batch_size: int, vs_mha: bool = True) -> List[dict]:
    """KV bytes per token, per sequence of ``seq_len`` and per batch, for each dtype a cache can
    hold (the compute dtypes, then the quantized ``cache.dtype`` values with their scales), by the
    layouts' own formulas; with ``vs_mha``, also the fraction of a full MHA cache of the same model
    at ``seq_len`` (one K and V per query head in every layer, no window). Per token is per
    sequence / ``seq_len`` (all layers): any one position's bytes without a window; with one, a
    local layer holds at most W of the positions, so it is that of this ``seq_len`` and falls as it
    grows (task=capacity's ``kv_bytes_per_token``, the same definition)."""
    rows = []
    stored = [(dtype, size, "auto") for dtype, size in DTYPE_BYTES.items()]
    # the compute size is not used; a dtype a layer refuses (a recurrent state's) is no row
    stored += [(dtype, 4, dtype) for dtype in CACHE_DTYPE_BYTES if _accepted(layers, dtype)]
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


def _accepted(layers: Layouts, cache_dtype: str) -> bool:
    try:
        layers.check({"cache.dtype": cache_dtype})
    except ConfigError:
        return False
    return True


def layer_kind_table(layers: Layouts, seq_len: int, batch_size: int, bytes_per_element: int) -> List[dict]:
    """Per kind of layer (global, local of window W, each split into layers with a cache of their
    own and layers reading an earlier layer's; Gated DeltaNet): how many layers, the positions each
    holds at ``seq_len``, their bytes per token (a position of every layer of the kind) and per
    sequence whatever its length (a recurrent state), and per sequence and per batch at ``seq_len``
    (the same formula, layer by layer)."""
    def key(layer):
        return (layer.kind, layer.window, layer.kv_source is not None)

    rows = []
    for kind, w, shared in sorted({key(layer) for layer in layers},
                                  key=lambda k: (k[0] != "kv_heads", k[1] is not None, k[1] or 0, k[2], k[0])):
        group = Layouts(layer for layer in layers if key(layer) == (kind, w, shared))
        name = ("global" if w is None else f"local W={w}") if kind in ("kv_heads", "latent") else kind
        if shared:
            name += f", reads layer {', '.join(map(str, sorted({layer.kv_source for layer in group})))}"
        rows.append({"kind": name, "layers": len(group), "positions": 0 if shared else group[0].positions_held(seq_len),
                     "per_token": group.bytes_per_token(bytes_per_element),
                     "state": group.state_bytes(bytes_per_element),
                     "per_sequence": group.cache_bytes(seq_len, 1, bytes_per_element),
                     "per_batch": group.cache_bytes(seq_len, batch_size, bytes_per_element)})
    return rows


def parameter_count(cfg: BenchConfig) -> int:
    """Exact parameter count, from one- and two-layer models on the meta device (no memory is
    allocated, and a model of a million layers is counted as fast as one of two)."""
    return parameter_counts(cfg.model, cfg.attention).total


def describe(cfg: BenchConfig) -> str:
    m, a, w = cfg.model, cfg.attention, cfg.workload
    seq_len = w.total_len
    layers = build_layouts(m, a)
    counts = parameter_counts(m, a)
    params = counts.total
    layout = _latent_lines(cfg) if a.latent else _kv_head_lines(cfg)
    lines = [
        f"model {m.name}: {m.num_layers} layers, d_model {m.d_model}, {m.num_heads} query heads x "
        f"head_dim {m.head_dim}, ffn {m.ffn_dim}, vocab {m.vocab_size}, max_seq_len {m.max_seq_len}",
        layout[0],
        _layout_line(cfg),
        f"parameters: {params:,} ({', '.join(f'{d} {human_bytes(params * s)}' for d, s in DTYPE_BYTES.items())})",
        *_moe_lines(cfg, counts),
        *layout[1:],
    ]
    state = layers.state_bytes(DTYPE_BYTES[cfg.runtime.dtype]) > 0
    header = ["KV dtype", f"per token (at {seq_len})" if a.window else "per token",
              *(["state per sequence"] if state else []), f"per sequence ({seq_len})",
              f"per batch (x{w.batch_size})", "vs full MHA" if a.window or state else "vs MHA"]
    rows = [[r["dtype"], _cell(r["per_token"]), *([_cell(r["state"])] if state else []), _cell(r["per_sequence"]),
             _cell(r["per_batch"]), f"{r['vs_mha']:.3f}"]
            for r in kv_memory_table(layers, seq_len, w.batch_size)]
    lines += _aligned(header, rows)
    if state:
        lines.append("a Gated DeltaNet layer stores nothing per token: per sequence it holds its recurrent state "
                     "(value heads x d_k x d_v, float32) and its convolution's last kernel - 1 inputs (compute dtype), "
                     "whatever the length; per token counts the attention layers only")
    if a.latent:  # the same model with K/V heads, for comparison (vs MHA above is the ratio)
        mha = layers.as_mha()
        widths = mha[0].stored[1]
        per_token = ", ".join(f"{d} {_cell(mha.bytes_per_token(size))}" for d, size in DTYPE_BYTES.items())
        lines.append(f"the same model as MHA ({m.num_heads} heads, K {widths[0]} + V {widths[1]} per head) holds per "
                     f"token: {per_token}")
    size = DTYPE_BYTES[cfg.runtime.dtype]
    if layers.smallest_window() is not None and not state:
        first = layers.bytes_per_token(size)
        lines.append(f"per token (at {seq_len}): per sequence / {seq_len}; a local layer holds at most W of the "
                     f"positions, so it falls as seq_len grows (a position before any window fills: "
                     f"{_cell(first)} in {cfg.runtime.dtype})")
    notes = ["sliding window: a local layer holds min(seq_len, W) positions (a ring of W)"] \
        if layers.smallest_window() is not None else []
    if a.kv_shared_layers:
        notes.append(f"cross-layer KV sharing: the last {a.kv_shared_layers} layers read the K/V of the last earlier "
                     "layer of their kind and hold none")
    if state:
        notes.append("a Gated DeltaNet layer holds a state per sequence")
    if notes:
        lines += ["", "; ".join(notes) + f"; KV by kind of layer in {cfg.runtime.dtype}: per sequence = positions "
                  "held · bytes per position + state:"]
        lines += _kind_lines(layers, seq_len, w.batch_size, size)
    if a.latent and a.index_topk:
        lines += ["", *_indexer_lines(cfg, layers, size)]
    return "\n".join(lines)


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


def _indexer_lines(cfg: BenchConfig, layers: Layouts, size: int) -> List[str]:
    """What DSA's top-k changes: a decode step reads every index key but at most index_topk latents."""
    a, seq_len, dtype = cfg.attention, cfg.workload.total_len, cfg.runtime.dtype
    return [f"DSA: a decode step at context S reads every index key and min(S, index_topk={a.index_topk}) latents "
            f"(layers · (S · {a.index_head_dim} + min(S, {a.index_topk}) · {a.kv_lora_rank + a.qk_rope_head_dim}) · "
            f"bytes); in {dtype} at S = {seq_len}: {_cell(layers.read_bytes(seq_len, 1, size))} read of "
            f"{_cell(layers.cache_bytes(seq_len, 1, size))} held per sequence"]


def _kind_lines(layers: Layouts, seq_len: int, batch_size: int, size: int) -> List[str]:
    kinds = layer_kind_table(layers, seq_len, batch_size, size)
    state = any(k["state"] for k in kinds)
    return _aligned(["layers", "count", "positions held", "per token", *(["state per sequence"] if state else []),
                     f"per sequence ({seq_len})", f"per batch (x{batch_size})"],
                    [[k["kind"], str(k["layers"]), f"{k['positions']:,}", _cell(k["per_token"]),
                      *([_cell(k["state"])] if state else []), _cell(k["per_sequence"]), _cell(k["per_batch"])]
                     for k in kinds])


def _kv_head_lines(cfg: BenchConfig) -> List[str]:
    m, a, w = cfg.model, cfg.attention, cfg.workload
    layers = build_layouts(m, a)
    attention_layers = sum(layer.state is None for layer in layers)  # the others hold a constant state instead
    kv_layers = attention_layers - (a.kv_shared_layers or 0)  # and these read another layer's K/V
    linear = "" if attention_layers == m.num_layers else (
        f"; {m.num_layers - attention_layers} of {m.num_layers} layers Gated DeltaNet {_linear_shape(layers)}")
    return [
        f"attention {a.type}: {a.num_kv_heads} KV heads, G = {m.num_heads // a.num_kv_heads} query heads per KV head"
        + (f"; window {a.window} in {sum(x is not None for x in layers.windows)} of "
           f"{m.num_layers} layers" if a.window else "") + linear,
        "",
        "head → KV group map:",
        describe_kv_groups(m.num_heads, a.num_kv_heads),
        "",
        f"KV cache = 2 · layers · kv_heads · head_dim · seq_len · batch · bytes "
        f"= 2 · {kv_layers} · {a.num_kv_heads} · {m.head_dim} · seq_len · batch · bytes"
        + (f" (the {a.kv_shared_layers} of {m.num_layers} layers that read an earlier layer's K/V hold none)"
           if a.kv_shared_layers else "")
        + (" before the windows fill (then a local layer holds W of the seq_len positions)" if a.window else "")
        + (" (the attention layers; the others hold a state per sequence)" if linear else ""),
        _elements_line(2 * a.num_kv_heads * m.head_dim, cfg.workload.total_len, w.batch_size),
        *([f"cache.dtype {' / '.join(CACHE_DTYPE_BYTES)}: bytes = 1 per element + a {SCALE_BYTES}-byte scale per "
           f"(sequence, KV head, position), K and V each"] if _accepted(layers, "int8") else []),
    ]


def _linear_shape(layers: Layouts) -> str:
    """A Gated DeltaNet layer's shape in config.json's words."""
    f = next(layer for layer in layers if layer.state is not None).fields()
    return (f"({f['linear_num_key_heads']} key heads of {f['linear_key_head_dim']}, {f['linear_num_value_heads']} "
            f"value heads of {f['linear_value_head_dim']}, conv kernel {f['linear_conv_kernel_dim']})")


def _latent_lines(cfg: BenchConfig) -> List[str]:
    m, a, w = cfg.model, cfg.attention, cfg.workload
    width = a.kv_lora_rank + a.qk_rope_head_dim
    q = f"q_lora_rank {a.q_lora_rank}" if a.q_lora_rank else "q by a full-rank projection"
    dsa = (f"; DSA: an indexer of {a.index_n_heads} heads x {a.index_head_dim} keeps a key of {a.index_head_dim} "
           f"per token and each query attends its top index_topk = {a.index_topk} tokens") if a.index_topk else ""
    index = " + index_head_dim" if a.index_topk else ""
    return [
        f"attention mla: multi-head latent attention, one latent per token and layer (kv_lora_rank "
        f"{a.kv_lora_rank} + qk_rope_head_dim {a.qk_rope_head_dim} = {width}) for all {m.num_heads} query heads "
        f"(qk_nope_head_dim {a.qk_nope_head_dim}, v_head_dim {a.v_head_dim}, {q}); decode {a.mla_decode}{dsa}",
        "",
        f"KV cache = layers · (kv_lora_rank + qk_rope_head_dim{index}) · seq_len · batch · bytes "
        f"= {m.num_layers} · {width + (a.index_head_dim if a.index_topk else 0)} · seq_len · batch · bytes",
        _elements_line(width + (a.index_head_dim if a.index_topk else 0), cfg.workload.total_len, w.batch_size,
                       "latent + index key" if a.index_topk else "latent"),
        f"cache.dtype {' / '.join(CACHE_DTYPE_BYTES)}: bytes = 1 per element + a {SCALE_BYTES}-byte scale per "
        "(sequence, position), one per latent" + (" and one per index key" if a.index_topk else ""),
    ]


def _aligned(header: List[str], rows: List[List[str]]) -> List[str]:
    widths = [max(len(row[i]) for row in [header] + rows) for i in range(len(header))]
    return [row[0].ljust(widths[0]) + "".join("  " + c.rjust(n) for c, n in zip(row[1:], widths[1:]))
            for row in [header] + rows]


def _layout_line(cfg: BenchConfig) -> str:
    """Whether the layout above is the named model's own, in words (a checkpoint's weights would
    be repeated or mean-pooled to it)."""
    m, a = cfg.model, cfg.attention
    method = ("repeat" if a.num_kv_heads > m.preset_kv_heads else "mean-pool") if m.path and not a.latent else "shape"
    change = kv_layout_change(m, a, method)
    own = "multi-head latent attention" if m.preset_mla is not None else f"{m.preset_kv_heads} KV heads"
    return change["text"] if change else f"the model's own layout ({own}): no conversion"


def _elements_line(per_token: int, seq_len: int, batch_size: int, what: str = "K+V") -> str:
    """K and V (or latent) elements of one layer's cache: per token, per sequence, per batch (the
    arithmetic of a KV-cache budget, before the bytes of a dtype)."""
    per_sequence = per_token * seq_len
    return (f"elements per layer ({what}): per token {per_token:,} · per sequence ({seq_len}) {per_sequence:,} "
            f"≈ {_si(per_sequence)} · per batch (x{batch_size}) {per_sequence * batch_size:,} "
            f"≈ {_si(per_sequence * batch_size)}")


def _si(n: float) -> str:
    """``33554432`` -> ``33.6 M``: a count in decimal units, three significant digits."""
    for unit, size in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:g}"


def _cell(n: float) -> str:
    exact = f"{n:,}" if isinstance(n, int) else f"{n:,.1f}"  # a windowed layout's per token is a mean
    return f"{exact} B" if n < 1024 else f"{human_bytes(n)} ({exact})"
