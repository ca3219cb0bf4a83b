"""What a job will hold in memory, computed from its config before anything is built.

A model of a million layers, a rotary table for 10^12 positions or a checkpoint whose
``config.json`` says 100,000 layers would otherwise be found out by building it: minutes of
work, then an out-of-memory (or the kernel's OOM killer) instead of one line. The figures here
are lower bounds (activations and the allocator's slack are left out), so a job refused by
:func:`check_fits` could not have run; one that passes may still run out of memory, which is
then recorded ``oom`` as before.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import psutil
import torch

from kvbench.config.bench import BenchConfig
from kvbench.config.layer_options import LAYER_OPTIONS
from kvbench.config.model import AttentionConfig, ModelConfig
from kvbench.config.serving import ServingWorkload
from kvbench.core.dtypes import DTYPE_BYTES
from kvbench.core.errors import ConfigError
from kvbench.layouts.attention import attention_module
from kvbench.layouts.build import build_layouts
from kvbench.layouts.kinds import kind_of, layer_kind, registered
from kvbench.model import Decoder
from kvbench.serving.allocator import budget_bytes, groups_of, slot_bytes
from kvbench.units import human_bytes

# The decoder is built in float32 and then cast (kvbench.runner.build_model): its weights peak at
# 4 bytes a parameter whatever runtime.dtype is.
BUILD_BYTES_PER_PARAM = 4
# rope_tables: float64 angles (S, D/2), their concatenation (S, D), cos and sin in float64, then
# float32 copies of both: about 3 float64 tables of (S, D) alive at once at the peak.
ROPE_PEAK_BYTES_PER_ELEMENT = 3 * 8


@dataclass(frozen=True)
class ParameterCounts:
    """A decoder's parameters: ``total``; ``active``, those one token's forward uses (each
    mixture-of-experts layer's k routed experts, not all E) with the input embedding table left
    out (a token reads one row of it; GPT-OSS's model card counts this way, Qwen's counts the
    table: ``active + embedding``); ``embedding``, that table."""

    total: int
    active: int
    embedding: int


# parameter_counts' answers by the configs' repr (every field; the configs hold lists, so no hash): a
# count builds small decoders (~0.1 s of CPU, more for a model of many experts) and a run asks it of the
# same configs again (the memory check of each load, inspect, the capacity tables)
_COUNTED: dict = {}


def parameter_counts(model: ModelConfig, attention: Optional[AttentionConfig] = None) -> ParameterCounts:
    """The decoder's exact parameter counts without building its layers: one- and two-layer
    decoders of each kind of layer on the meta device (no memory) give the fixed part and one
    layer's of that kind, and every layer of a kind has the same shape. A layer's kind is its mixer
    (its ``layer_types`` name: an attention layer, a recurrent one, or one reading another layer's
    K/V: no K/V weights) and its MLP (dense, the mixture of experts, or none); the experts a token is
    not routed to (left out of ``active``) from :class:`~kvbench.core.moe.MoEShape`'s formulas.
    ``attention``: as the job resolved it against ``model`` (None: MHA)."""
    key = repr((model, attention))
    if key not in _COUNTED:
        if len(_COUNTED) >= 512:  # a long sweep in one process: the oldest half goes
            for old in list(_COUNTED)[:256]:
                del _COUNTED[old]
        _COUNTED[key] = _count(model, attention)
    return _COUNTED[key]


def _count(model: ModelConfig, attention: Optional[AttentionConfig]) -> ParameterCounts:
    resolved = attention if attention is not None else AttentionConfig(type="mha").resolved(model)
    moe, kinds = model.moe, _layer_kinds(model, resolved)
    # A layer pattern decides masks and caches, not a layer's parameters: the one- and two-layer models
    # have none, and one kind of layer each (those not attending named in layer_types, which an interval
    # contradicts), as long as the positions a layer option asked of the run counts (a top-k), checked
    # again against their length
    counted = (getattr(attention, o.key, None) or 0 for o in LAYER_OPTIONS if o.positions)
    # a kind that remakes layers of another (Gemma 4's global heads, by index) is left out of them:
    # their layers are alike, and _other_shapes adds what each remade layer differs by
    remade = {kind.name for kind in registered() if kind.remake}
    shapes = {k: v for k, v in (model.layer_shapes or {}).items() if k not in remade} or None
    small = dataclasses.replace(model.without_pattern(), num_layers=1, moe=None, no_mlp_layers=None, nope=None,
                                max_seq_len=max(1, *counted), layer_shapes=shapes)  # NoPE: no weights of its own
    attention = dataclasses.replace((attention or AttentionConfig(type="mha")).without_pattern(),
                                    full_attention_interval=None)
    per_layer, fixed, embedding, counted_as = {}, 0, 0, {}
    for mixer, mlp in kinds:
        # a layer type another kind claims beside its own (DeepSeek-V4's sliding layers): the 2-layer model
        # is one of that kind's own layers, then this one
        owner = _claimed(resolved, mixer)

        def shaped(n: int, mixer=mixer, mlp=mlp, owner=owner):  # an n-layer model of this kind alone
            sparse = dataclasses.replace(moe, dense_layers=[]) if mlp == "sparse" else None
            types = [owner, mixer][:n] if owner else None if mixer in _ATTENDING else [mixer] * n
            return (dataclasses.replace(small, num_layers=n, moe=sparse,
                                        no_mlp_layers=list(range(n)) if mlp == "none" else None),
                    dataclasses.replace(attention, layer_types=types, kv_shared_layers=1 if mixer == "shared" and n == 2
                                        else 0, window=1 if owner and n == 2 else attention.window))
        with torch.device("meta"):
            one, built = Decoder(*shaped(1)), Decoder(*shaped(2))
        two = built.num_params()
        per_layer[mixer, mlp] = two - one.num_params()
        counted_as.setdefault(mixer, (built.layouts[-1], sum(p.numel() for p in built.blocks[-1].attn.parameters())))
        embedding = one.embed.weight.numel()
        if mixer != "shared" and not owner:  # its two-layer model holds a layer of another kind: not the fixed part
            fixed = 2 * one.num_params() - two
    total = fixed + sum(per_layer[k] * n for k, n in kinds.items()) + _other_shapes(model, resolved, counted_as)
    gated = model.mlp_act != "relu2"  # relu2 experts have no gate projection
    unused = 0 if moe is None else (moe.num_experts - moe.top_k) * moe.expert_params(model.d_model, gated)
    return ParameterCounts(total, total - unused * sum(n for (_, mlp), n in kinds.items() if mlp == "sparse")
                           - embedding, embedding)


_ATTENDING = ("full_attention", "sliding_attention", "shared")  # mixers of the same weights as full attention's


def _other_shapes(model: ModelConfig, attention: AttentionConfig, counted_as: dict) -> int:
    """The parameters that layers of another shape than their mixer's one in the small models add, where a
    kind remade one of them (``LayerKind.remake``: a model's global layers of heads of their own): each
    such layout's attention module, built on the meta device, against the small model's."""
    out = 0
    for _, layout, n in build_layouts(model, attention).distinct:
        base, base_params = counted_as.get("shared" if layout.kv_source is not None else "full_attention", (None, 0))
        if base is None or layout.state is not None or layout == base \
                or not (kind_of(layout).remake or kind_of(base).remake):
            continue
        with torch.device("meta"):
            params = sum(p.numel() for p in attention_module(model, layout).parameters())
        out += n * (params - base_params)
    return out


def _layer_kinds(model: ModelConfig, attention: AttentionConfig) -> Counter:
    """How many layers of each kind, (mixer, MLP), there are: from the positions of the layers that are
    not plain (a mixer other than attention, a dense or absent MLP), not a pass in Python over every
    layer (a hostile config may ask for 10^8)."""
    L, first_shared = model.num_layers, model.num_layers - (attention.kv_shared_layers or 0)
    types = attention.layer_kinds(L)
    attending = types.count("full_attention") + types.count("sliding_attention")
    mixers = {} if attending == len(types) else \
        {i: t for i, t in enumerate(types[:first_shared]) if t not in _ATTENDING or _claimed(attention, t)}
    none = {i for i in model.no_mlp_layers or () if 0 <= i < L}
    dense = {i for i in model.moe.dense_layers if 0 <= i < L} if model.moe is not None else set()
    plain_mlp = "dense" if model.moe is None else "sparse"

    def kind(i: int) -> tuple:
        mixer = mixers.get(i, "shared" if i >= first_shared else "full_attention")
        return mixer, "none" if i in none else "dense" if i in dense else plain_mlp

    special = set(mixers) | none | dense
    counts = Counter(kind(i) for i in special)
    shared_special = sum(i >= first_shared for i in special)
    counts["full_attention", plain_mlp] += first_shared - (len(special) - shared_special)
    counts["shared", plain_mlp] += (L - first_shared) - shared_special
    return Counter({k: n for k, n in counts.items() if n})


def _claimed(attention: AttentionConfig, layer_type: str) -> Optional[str]:
    """The first layer type of the kind that claims ``layer_type`` in ``attention``'s pattern (None: its own
    kind's, as attention.type says)."""
    if layer_type not in ("full_attention", "sliding_attention"):  # a recurrent kind's, or a shared layer
        return None
    kind = layer_kind(attention, layer_type)
    return kind.layer_types[0] if layer_type in kind.claims else None


def parameter_count(model: ModelConfig, attention: Optional[AttentionConfig] = None) -> int:
    """The decoder's exact parameter count (:func:`parameter_counts`), every expert included."""
    return parameter_counts(model, attention).total


def rope_peak_bytes(model: ModelConfig) -> int:
    """Bytes the rotary tables take while they are built (float64 intermediates)."""
    # partial rotary: its width; a float64 position per row beside it (none where nothing rotates)
    return model.max_seq_len * (model.rotary_dim * ROPE_PEAK_BYTES_PER_ELEMENT + 8 * bool(model.rotary_dim))


def recall_data_bytes(cfg: BenchConfig) -> int:
    """task=recall's held-out sets, all held at once (tasks/recall.py): ``eval_sequences`` rows
    of inputs and targets (int64) per condition; an MQAR draw also holds a float32 permutation of
    the keys and its int64 argsort per row (quality/recall.py). A lower bound: the draws hold more."""
    r = cfg.recall
    per_length = len(r.num_pairs) if r.kind == "mqar" else len(r.distances)  # conditions per seq_len
    sets = r.eval_sequences * per_length * sum(r.seq_len) * 2 * 8
    keys = r.eval_sequences * max(0, r.vocab_size // 2 - 1) * (4 + 8) if r.kind == "mqar" else 0
    return max(sets, keys)


@dataclass
class Footprint:
    """A job's memory before activations: weights as built, rotary tables, KV cache (formula),
    and the data a task holds whole (task=recall's held-out sets)."""

    weights: int
    rope: int
    kv_cache: int
    data: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.rope + self.kv_cache + self.data

    def describe(self) -> str:
        return (f"weights {human_bytes(self.weights)} + rotary tables {human_bytes(self.rope)} + "
                f"KV cache {human_bytes(self.kv_cache)}"
                + (f" + held-out recall sets {human_bytes(self.data)}" if self.data else ""))


def job_footprint(cfg: BenchConfig) -> Footprint:
    """The :class:`Footprint` of ``cfg``'s job: a task=bench job's cache holds its workload's
    longest sequence for the whole batch; other tasks size their caches as they go (capacity
    searches them) and count only the model here."""
    m, a = cfg.model, cfg.attention
    kv = 0
    # a served workload (serving, conversations): the store its budget asks for, allocated whole
    if cfg.task == "bench" and isinstance(cfg.workload, ServingWorkload):
        kv = serving_store_bytes(cfg)
    elif cfg.task == "bench" and cfg.cache.impl != "none":
        # The record's formula (workloads/decode.py): each layer's own positions and widths (kvbench.layouts).
        kv = build_layouts(m, a, cfg.cache.state_dtype).cache_bytes(cfg.workload.total_len, cfg.workload.batch_size,
                                             DTYPE_BYTES[cfg.runtime.dtype], cfg.cache.dtype)
    data = 0
    if cfg.task == "recall":  # its model has the task's vocabulary (tasks/recall.py)
        m, data = dataclasses.replace(m, vocab_size=cfg.recall.vocab_size), recall_data_bytes(cfg)
    return Footprint(parameter_count(m, a) * BUILD_BYTES_PER_PARAM, rope_peak_bytes(m), kv, data)


def kv_bytes_per_token(cfg: BenchConfig) -> int:
    """KV bytes one token of one sequence holds in all layers, from the config: what
    :func:`kvbench.serving.paged.bytes_per_token` gives for the model once built."""
    return build_layouts(cfg.model, cfg.attention, cfg.cache.state_dtype).bytes_per_token(
        DTYPE_BYTES[cfg.runtime.dtype])


def serving_store_bytes(cfg: BenchConfig) -> int:
    """The store ``workload.kv_budget_mb`` or ``workload.kv_budget_blocks`` asks for, bytes: the
    budget (blocks of ``cache.block_size`` tokens, or slots of ``workload.slot_len``, else of the
    longest request's positions; a trace's are known once it is read: 1 here, a lower bound). The
    unified allocator is counted once per group, an upper bound: its groups' tensors are views of one
    byte pool, except where a part cannot sit aligned in a page and each group keeps its own storage
    (kvbench.serving.paged), which this check, made before anything is built, cannot tell."""
    w = cfg.workload
    groups = groups_of(build_layouts(cfg.model, cfg.attention, cfg.cache.state_dtype), DTYPE_BYTES[cfg.runtime.dtype],
                       cfg.cache.dtype)
    if w.store == "paged":
        return int(budget_bytes(w.kv_budget_mb, w.kv_budget_blocks, cfg.cache.block_size, groups)) * (
            len(groups) if w.allocator == "unified" else 1)
    size = w.slot_len or max(w.total_len, 1)
    slot = sum(slot_bytes(g, size, w.max_prefill_tokens) for g in groups)
    return (w.kv_budget_blocks if w.kv_budget_blocks is not None else int(w.kv_budget_mb * 1e6 // slot)) * slot


def available_bytes(device: torch.device) -> int:
    """Memory a job can still take: free device memory on CUDA; on a CPU what the kernel says is
    available, or less where a cgroup (a container's limit) allows less."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    available = int(psutil.virtual_memory().available)
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text().strip())
        if limit != "max":
            available = min(available, int(limit) - used)
    except (OSError, ValueError):
        pass  # no cgroup v2 limit here
    return available


def check_model_fits(model: ModelConfig, device: torch.device | str, where: str,
                     attention: Optional[AttentionConfig] = None) -> None:
    """Raise :class:`ConfigError` naming ``where`` (the checkpoint's config.json or kvbench
    checkpoint file) when the model it describes, in ``attention`` (default: its own), cannot be
    built in the memory ``device`` has available."""
    try:
        own = parameter_count(model, attention or AttentionConfig().resolved(model))
    except (TypeError, RuntimeError, OverflowError) as exc:  # a shape torch cannot index, even on the meta device
        if "overflow" not in str(exc).lower():
            raise
        raise ConfigError(f"{where}: a model of {model.num_layers} layers and d_model {model.d_model} has a tensor "
                          "of more than 2**63 elements; nothing was built") from None
    need = Footprint(own * BUILD_BYTES_PER_PARAM, rope_peak_bytes(model), 0)
    have = available_bytes(torch.device(device))
    if need.total > have:
        experts = "" if model.moe is None else f", {model.moe.num_experts} experts of {model.moe.expert_ffn_dim}"
        raise ConfigError(f"{where}: a model of {model.num_layers} layers, d_model {model.d_model}{experts} and "
                          f"{model.max_seq_len} positions needs at least {human_bytes(need.total)} "
                          f"({need.describe()}), more than the {human_bytes(have)} available; nothing was built")


def _check_probe_range(cfg: BenchConfig, need: Footprint, have: int) -> None:
    """A capacity search probes batches up to ``capacity.max_batch``: refuse a limit whose probe
    at the longest context could not even hold its hidden states (B x T x d_model floats, one
    layer's worth) beside the weights, rather than searching for hours towards it."""
    longest = max(cfg.capacity.context_lens) if cfg.workload.name != "multiturn" else cfg.workload.total_len
    per_sequence = longest * cfg.model.d_model * 4
    room = max(0, have - need.total)
    largest = room // per_sequence
    if cfg.capacity.max_batch > largest:
        raise ConfigError(f"capacity.max_batch={cfg.capacity.max_batch}: a probe of that batch at context {longest} "
                          f"needs at least {human_bytes(cfg.capacity.max_batch * per_sequence)} for its hidden states "
                          f"alone, more than the {human_bytes(room)} left beside the weights; at most {largest} "
                          "could run here")


def check_fits(cfg: BenchConfig, device: torch.device) -> Footprint:
    """Raise :class:`ConfigError` (one line naming the sizes and the keys behind them) when the
    job's :class:`Footprint` alone exceeds the memory ``device`` has available."""
    # eval: its model is train.checkpoint's, sized as the checkpoint is read; capacity.plan builds none
    if cfg.task == "eval" or (cfg.task == "capacity" and cfg.capacity.plan):
        return Footprint(0, 0, 0)
    need = job_footprint(cfg)
    have = available_bytes(device)
    if cfg.task == "compare" and need.total <= have:  # a base that does not fit at all is said so below
        _check_variants(cfg, need, have, device)
    if need.total <= have and cfg.task == "capacity":  # a model that does not fit at all is said so below
        _check_probe_range(cfg, need, have)
    if need.total > have:
        m = cfg.model
        keys = (f"model.num_layers={m.num_layers}, model.d_model={m.d_model}, model.max_seq_len={m.max_seq_len}"
                + (f", model.moe.num_experts={m.moe.num_experts}, model.moe.expert_ffn_dim={m.moe.expert_ffn_dim}"
                   if m.moe is not None else "")
                # the attention keys that size the layers' weights and caches (Layouts.size_keys)
                + "".join(f", attention.{k}={getattr(cfg.attention, k)}"
                          for k in build_layouts(m, cfg.attention).size_keys())
                + (_store_keys(cfg) if isinstance(cfg.workload, ServingWorkload) and cfg.task == "bench"
                   else f", workload.batch_size={cfg.workload.batch_size}" if need.kv_cache else "")
                + (f", recall.vocab_size={cfg.recall.vocab_size}, recall.eval_sequences={cfg.recall.eval_sequences}"
                   if cfg.task == "recall" else ""))
        where = f"model.path={m.path}: " if m.path else ""
        raise ConfigError(f"{where}the job needs at least {human_bytes(need.total)} ({need.describe()}; {keys}), "
                          f"more than the {human_bytes(have)} {device.type} memory available; nothing was built")
    return need


def _check_variants(cfg: BenchConfig, base: Footprint, have: int, device: torch.device) -> None:
    """task=compare holds every variant at once beside its base model, each with a static cache for
    its longest context: refuse variants whose weights and caches (one rank of 10^12, say) could not
    all be held, naming the largest, before the base model is built (it was an ``oom`` minutes in)."""
    element, longest = DTYPE_BYTES[cfg.runtime.dtype], max(cfg.compare.contexts) + 1
    sizes = []
    for spec, attention in zip(cfg.compare.variants, cfg.compare.attentions(cfg.model)):
        layouts = build_layouts(cfg.model, attention, cfg.cache.state_dtype)
        sizes.append((spec, Footprint(parameter_count(cfg.model, attention) * BUILD_BYTES_PER_PARAM, 0,
                                      layouts.cache_bytes(longest, cfg.workload.batch_size, element, cfg.cache.dtype))))
    total = base.total + sum(f.total for _, f in sizes)
    if total > have:
        spec, largest = max(sizes, key=lambda s: s[1].total)
        raise ConfigError(f"compare.variants={cfg.compare.variants!r}: the variants and their base need at least "
                          f"{human_bytes(total)}, more than the {human_bytes(have)} {device.type} memory available; "
                          f"the largest, {spec!r}: weights {human_bytes(largest.weights)} + KV cache "
                          f"{human_bytes(largest.kv_cache)} (contexts up to {longest - 1}, "
                          f"workload.batch_size={cfg.workload.batch_size}); nothing was built")


def _store_keys(cfg: BenchConfig) -> str:
    w = cfg.workload
    if w.kv_budget_mb is not None:
        return f", workload.kv_budget_mb={w.kv_budget_mb}"
    return f", workload.kv_budget_blocks={w.kv_budget_blocks}" + (
        f" of cache.block_size={cfg.cache.block_size} tokens" if w.store == "paged" else " slots")
