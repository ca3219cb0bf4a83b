"""The decoder split over tensor-parallel ranks (Megatron's column/row split): each rank runs
1 / ranks of every layer's query heads and MLP width, and one all-reduce after each block's
attention and after its MLP sums the ranks' parts; the embedding and the LM head are split by
vocabulary (:mod:`kvbench.parallel.vocab`: an all-reduce after the lookup, an all-gather of the logits).

A layer's part is its layout's :meth:`~kvbench.layouts.sharding.Sharding.shard` (fewer query
heads; K/V heads cut, or one replicated where there are fewer than ranks, as MLA's one cached head is),
built by its kind's own module, so no kind is named here: the part's weights are the whole
module's, cut along each dimension where the part's shape is smaller. Query-side projections lose
rows (column parallel), the output projection columns (row parallel, its bias added once: rank 0's),
a K/V head read by several ranks is each one's copy. A parameter that stacks sections along a
dimension (a module's ``tp_sections``: an expert's gate and up rows, Gated DeltaNet's q | k | v
channels) has each section cut alike. A routed expert is cut by width, or with ``expert_parallel``
whole experts are split by expert. The norms and the router are whole on every rank.

:func:`shard_decoder` cuts a built decoder in place (on the meta device too: a rank's weights
counted without memory, :func:`rank_weight_bytes`); :class:`RankGroup` is the process's rank and
the all-reduce it times.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Optional

import torch
from torch import nn

from kvbench.layouts.attention import attention_module
from kvbench.layouts.base import Layouts
from kvbench.metrics import Metric, metric_table
from kvbench.mlp.experts import Experts, mlp_module
from kvbench.model import Decoder
from kvbench.parallel.plan import Split
from kvbench.parallel.vocab import VocabEmbedding, VocabHead
from kvbench.quant_weights import checkpoint_bytes, stored_bytes

# what a job run as ranks records (kvbench.parallel.launch)
RANK_METRICS: Dict[str, Metric] = metric_table(
    Metric("tensor_parallel_ranks", "count", "runtime.tensor_parallel: the processes the job ran as, one part of "
                                             "the model each (kvbench/parallel/)"),
    Metric("allreduce_ms_per_step", "ms", "a decode step's collectives on this rank (an all-reduce after each "
                                          "block's attention and one after its MLP, the embedding's all-reduce and "
                                          "the logits' all-gather): the median time of one, T = 1, times their "
                                          "number per forward; each timed from the call to its return (by CUDA "
                                          "events on a GPU), so a wait for a slower rank counts"),
    Metric("allreduce_calls", "count", "collectives the rank ran over the whole job (warm-up, trials, fidelity)"),
    Metric("tables.ranks", "", "per rank: status, kv_cache_bytes (allocated) and kv_cache_bytes_formula (the "
                               "rank's layouts: each layer's part as its layout cuts it), weight_bytes, "
                               "allreduce_ms_per_step, decode_ms_p50"),
)


@dataclass
class RankGroup:
    """This process's place among ``ranks`` tensor-parallel ranks, and the time its all-reduces took
    (a decode step's, T = 1, apart: what tensor parallelism adds to a step)."""

    rank: int
    ranks: int
    expert_parallel: int = 1
    group: Any = None  # a torch.distributed process group (None: the default one)
    step_ms: List[float] = field(default_factory=list)  # each decode step's all-reduce, timed on the host
    step_events: List[Any] = field(default_factory=list)  # on CUDA: its (start, end) events, read at the end
    calls: int = 0
    hooks: int = 0  # all-reduces per forward

    def all_reduce(self, out: torch.Tensor) -> torch.Tensor:
        """Sum ``out`` over the ranks in place, timed (:meth:`_timed`)."""
        import torch.distributed as dist

        self._timed(out, lambda: dist.all_reduce(out, group=self.group))
        return out

    def all_gather(self, part: torch.Tensor) -> torch.Tensor:
        """Every rank's ``part`` (one shape on every rank) concatenated along the last dimension in rank
        order (the vocabulary's logits, :mod:`kvbench.parallel.vocab`), timed (:meth:`_timed`)."""
        import torch.distributed as dist

        parts = [torch.empty_like(part) for _ in range(self.ranks)]
        self._timed(part, lambda: dist.all_gather(parts, part.contiguous(), group=self.group))
        return torch.cat(parts, -1)

    def _timed(self, out: torch.Tensor, collective) -> None:
        """Run ``collective`` on ``out``: on CUDA between events (no wait on the host in the decode step;
        read once by :attr:`decode_ms`), on a CPU by the clock (gloo returns when done); a decode step's
        (B, 1, C) kept apart."""
        step = out.dim() == 3 and out.shape[1] == 1
        if out.is_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            collective()
            end.record()
            if step:
                self.step_events.append((start, end))
        else:
            begin = time.perf_counter()
            collective()
            if step:
                self.step_ms.append((time.perf_counter() - begin) * 1e3)
        self.calls += 1

    @property
    def decode_ms(self) -> List[float]:
        """Each decode step's all-reduce in ms (CUDA's events read here, after one synchronize)."""
        if self.step_events:
            torch.cuda.synchronize()
            self.step_ms.extend(start.elapsed_time(end) for start, end in self.step_events)
            self.step_events.clear()
        return self.step_ms


_current: Optional[RankGroup] = None


def current() -> Optional[RankGroup]:
    """The rank group of this process (None: one process runs the whole model)."""
    return _current


def join(group: Optional[RankGroup]) -> None:
    """Make ``group`` this process's (:mod:`kvbench.parallel.launch`, once per rank)."""
    global _current
    _current = group


def shard_decoder(model: Decoder, ranks: int, rank: int, expert_parallel: int = 1,
                  group: Optional[RankGroup] = None) -> Decoder:
    """Cut ``model`` in place to rank ``rank``'s part of ``ranks``; with ``group``, an all-reduce after
    each block's attention and MLP. The layouts become the rank's (its cache is the rank's part). A layer
    whose kind has no ``shard`` stays whole (the job's check refuses such a model before it runs; the
    capacity figures count it by :func:`rank_weight_bytes`)."""
    cfg, split = model.config, Split(ranks, 1, expert_parallel)
    moe = cfg.moe
    mlp_cfg = replace(cfg, ffn_dim=cfg.ffn_dim // ranks, moe=None if moe is None else replace(
        moe, expert_ffn_dim=moe.expert_ffn_dim // split.expert_width_ranks, shared_ffn_dim=moe.shared_ffn_dim // ranks))
    parts = {id(layout): layout.shard(ranks) or layout for layout in model.layouts.unique()}
    layouts = Layouts(parts[id(layout)] for layout in model.layouts)
    for index, (block, layout) in enumerate(zip(model.blocks, layouts)):
        with torch.device("meta"):
            attn = None if layout is model.layouts[index] else attention_module(cfg, layout)
            mlp = None if block.mlp is None else mlp_module(mlp_cfg, index)
        if attn is not None:
            block.attn = _cut(block.attn, attn, rank, ranks)
        if mlp is not None:
            if expert_parallel > 1 and hasattr(mlp, "experts"):
                with torch.device("meta"):  # the rank's E / ep experts, whole
                    mlp.experts = Experts(cfg.d_model, replace(moe, num_experts=moe.num_experts // expert_parallel),
                                          mlp.experts.gated)
                mlp.experts.first = rank * (moe.num_experts // expert_parallel)
            block.mlp = _cut(block.mlp, mlp, rank, ranks)
        if group is not None:
            for part in (block.attn, block.mlp):
                if part is not None:
                    part.register_forward_hook(lambda module, args, out: group.all_reduce(out))
                    group.hooks += 1
                    for module in part.modules():  # one that sums across the ranks itself (a norm over a
                        if hasattr(module, "tp_group"):  # group cut across them: a recurrent kind's gated norm)
                            module.tp_group = group
    # the vocabulary split: each rank ceil(V / N) rows of the embedding (an all-reduce sums the lookups) and of
    # the LM head (an all-gather joins the logits)
    model.embed = VocabEmbedding(model.embed, rank, ranks, group)
    model.lm_head = VocabHead(model.lm_head, rank, ranks, group)
    if group is not None:
        group.hooks += 2
    model.layouts = layouts
    return model


def _offset(full: int, part: int, rank: int, ranks: int) -> int:
    """Where rank ``rank``'s ``part`` of a dimension of ``full`` starts: the rank-th of ``ranks`` equal
    parts, or where fewer parts than ranks exist (a K/V head read by ranks / heads ranks), the one
    holding the rank's share: heads 0..H_kv-1 over ranks in order, as the query heads are."""
    return (rank * full) // (ranks * part) * part


def _cut(whole: nn.Module, part: nn.Module, rank: int, ranks: int) -> nn.Module:
    """``part`` (built on the meta device, the rank's shapes) holding ``whole``'s values cut to them."""
    full = whole.state_dict()
    cut: Dict[str, torch.Tensor] = {}
    row_split = {f"{name}.bias" for name, m in part.named_modules() if isinstance(m, nn.Linear)
                 and m.weight.shape[1] != full[f"{name}.weight".lstrip(".")].shape[1]}
    for name, t in part.state_dict(keep_vars=True).items():
        value = full[name]
        if value.is_meta:  # shapes only (a rank's weights counted): nothing to cut
            cut[name] = torch.empty(t.shape, dtype=value.dtype, device="meta")
            continue
        stacked, sizes = _sections(whole, name) or (None, ())
        _, part_sizes = _sections(part, name) or (None, ())
        for dim, (f, p) in enumerate(zip(value.shape, t.shape)):
            if f == p:
                continue
            if dim == stacked:  # sections stacked along it (gate rows, then up rows): each cut alike
                value = torch.cat([c.narrow(dim, _offset(fs, ps, rank, ranks), ps)
                                   for c, fs, ps in zip(value.split(list(sizes), dim), sizes, part_sizes)], dim)
            else:
                value = value.narrow(dim, _offset(f, p, rank, ranks), p)
        owner, _, leaf = name.rpartition(".")
        module = part.get_submodule(owner) if owner else part
        once = name in row_split or leaf in getattr(module, "TP_ONCE", ())
        if once and value.shape == full[name].shape and rank:
            value = torch.zeros_like(value)  # added after the sum: rank 0's alone
        cut[name] = value.contiguous()
    part.load_state_dict(cut, assign=True)
    return part.train(whole.training)


def _sections(root: nn.Module, name: str):
    """``(dim, sizes)`` where a module above parameter ``name`` (its ``tp_sections()``) says the
    parameter stacks sections of these sizes along ``dim`` (q | k | v channels, gate | up rows); None."""
    parts = name.split(".")
    for i in range(len(parts)):
        owner = root.get_submodule(".".join(parts[:i])) if i else root
        sections = getattr(owner, "tp_sections", None)
        if sections is not None and ".".join(parts[i:]) in sections():
            return sections()[".".join(parts[i:])]
    return None


def rank_weight_bytes(model: Decoder, split: Split, stored: Optional[str] = None) -> int:
    """Bytes of weights one rank of ``split`` holds of ``model`` (built on the meta device; cut in place):
    attention and MLP cut over split.tp, the routed experts over split.ep by expert and
    split.expert_width_ranks by width; as the checkpoint stores them with ``stored``
    (``model.weights_stored``). A layer whose kind runs whole here counts 1 / tp of its weights, as an
    engine cutting it by heads holds them."""
    if split.tp == 1:
        _experts_only(model, split.ep)
        return checkpoint_bytes(model, stored)
    whole = tuple(f"blocks.{i}.attn." for i, layout in enumerate(model.layouts) if layout.shard(split.tp) is None)
    uncut = sum(stored_bytes(name, p.shape, p.element_size(), stored) for name, p in model.named_parameters()
                if name.startswith(whole))
    shard_decoder(model, split.tp, 0, split.ep)
    return checkpoint_bytes(model, stored) - uncut + uncut // split.tp


def _experts_only(model: Decoder, ep: int) -> None:
    """Data-parallel attention beside expert-parallel experts: only the experts split."""
    moe = model.config.moe
    if ep == 1 or moe is None:
        return
    for block in model.blocks:
        if block.mlp is not None and hasattr(block.mlp, "experts"):
            with torch.device("meta"):
                part = Experts(model.config.d_model, replace(moe, num_experts=moe.num_experts // ep),
                               block.mlp.experts.gated)
            block.mlp.experts = _cut(block.mlp.experts, part, 0, 1)
