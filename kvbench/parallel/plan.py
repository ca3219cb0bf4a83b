"""What each rank of a model split over GPUs holds, from the config and the layouts alone (no torch):
per-rank KV bytes per token and per sequence, the replication a split makes, and the sequences that fit
per GPU and per node (:func:`per_gpu`); and which splits a job may run (:func:`check_parallel`).

A split (:class:`Split`) of a node's GPUs: ``tp`` tensor-parallel ranks per copy of the model (each
runs 1 / tp of the query heads and holds 1 / parts of each layer's cache, parts its
:meth:`~kvbench.layouts.sharding.Sharding.tensor_parts`), ``dp`` copies each serving its own
sequences (data parallel), and the routed experts split by expert over ``ep`` ranks (expert
parallel; each expert's width is cut over the tp / ep ranks left). Each layout says how it splits;
nothing here names a kind.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Dict

from kvbench.core.errors import ConfigError, check
from kvbench.layouts.base import Layouts, first_of_each
from kvbench.layouts.build import build_layouts
from kvbench.layouts.kinds import kind_of


@dataclass(frozen=True)
class Split:
    """``tp`` tensor-parallel ranks per copy of the model, ``dp`` copies, the routed experts over
    ``ep`` ranks by expert: ``tp * dp`` GPUs (``ep`` of them among them)."""

    tp: int = 1
    dp: int = 1
    ep: int = 1

    @property
    def gpus(self) -> int:
        return self.tp * self.dp

    @property
    def expert_width_ranks(self) -> int:
        """Ranks each expert's width is cut over: the tensor-parallel ranks the expert split leaves."""
        return self.tp // self.ep if self.ep <= self.tp and self.tp % self.ep == 0 else 1

    def name(self) -> str:
        parts = [f"TP={self.tp}" if self.tp > 1 else "", f"DP={self.dp}" if self.dp > 1 else "",
                 f"EP={self.ep}" if self.ep > 1 else ""]
        return " ".join(p for p in parts if p) or "1 GPU"


@dataclass(frozen=True)
class RankKV:
    """One rank's share of a sequence's cache under ``tp`` ranks: ``per_token`` bytes one position
    adds while no window is full, ``per_sequence`` at ``seq_len``, ``whole_sequence`` the unsplit
    model's, and ``replication``: what the tp ranks hold together over what one unsplit copy holds
    (1: the heads split evenly; tp for a layout of one cached head, MQA's or MLA's)."""

    tp: int
    seq_len: int
    per_token: float
    per_sequence: float
    whole_sequence: float

    @property
    def replication(self) -> float:
        return self.tp * self.per_sequence / self.whole_sequence if self.whole_sequence else 1.0


def rank_kv(layouts: Layouts, tp: int, seq_len: int, element: int, cache_dtype: str = "auto") -> RankKV:
    """The cache one of ``tp`` ranks holds: each layer's part as its layout cuts it (its ``shard``'s bytes:
    a K/V head, a single cached head or a group of a state replicated where there are fewer than ranks); a layer that
    does not cut into whole parts, or whose module runs whole, its bytes / its ``tensor_parts``."""
    def part(layer):
        return layer.shard(tp) if tp > 1 and layer.tensor_refusal(tp) is None else None

    def share(figure) -> float:
        return sum(n * (figure(part(layer)) if part(layer) is not None else figure(layer) / layer.tensor_parts(tp))
                   for _, layer, n in layouts.distinct)
    return RankKV(tp, seq_len, share(lambda layer: layer.bytes_per_position(element, cache_dtype)),
                  share(lambda layer: layer.sequence_bytes(seq_len, element, cache_dtype)),
                  layouts.cache_bytes(seq_len, 1, element, cache_dtype))


def per_gpu(kv: RankKV, split: Split, weights_per_rank: int, gpu_bytes: int, gpus_per_node: int) -> Dict[str, Any]:
    """Sequences of ``kv.seq_len`` that fit: a GPU's ``gpu_bytes`` less its ``weights_per_rank`` holds
    its part of every sequence its tp group serves (activations left out); a node of
    ``gpus_per_node`` runs gpus_per_node / tp such groups, each serving its own sequences."""
    budget = gpu_bytes - weights_per_rank
    group = int(budget // kv.per_sequence) if budget > 0 and kv.per_sequence else 0
    node = group * (gpus_per_node // split.tp)
    return {"split": split.name(), "kv_bytes_per_token_rank": kv.per_token, "kv_bytes_per_sequence_rank":
            kv.per_sequence, "kv_replication": kv.replication, "weight_bytes_rank": weights_per_rank,
            "kv_budget_bytes_gpu": budget, "sequences_per_node": node, "sequences_per_gpu": node / gpus_per_node}


def cuts_whole(model: Any, layouts: Layouts, split: Split) -> bool:
    """Whether ``split`` cuts ``model`` (a ModelConfig) into whole parts: query heads, each layer's heads
    (or one replicated), MLP and expert widths, experts."""
    tp, moe = split.tp, model.moe
    ok = model.num_heads % tp == 0 and model.ffn_dim % tp == 0
    ok = ok and all(layer.tensor_refusal(tp) is None for layer in layouts.unique())
    if moe is not None:
        ok = ok and moe.num_experts % split.ep == 0 and moe.shared_ffn_dim % tp == 0
        ok = ok and moe.expert_ffn_dim % split.expert_width_ranks == 0
    return ok


def node_splits(model: Any, layouts: Layouts, gpus: int) -> list:
    """The splits of a node of ``gpus`` GPUs worth comparing: each tensor-parallel size (1, 2, 4, ... gpus)
    that cuts the model whole, the rest data parallel; with experts, also the experts split by expert over
    the node under TP (TP=g EP=g) and under data-parallel attention (DP=g EP=g)."""
    sizes, tp = [], 1
    while tp <= gpus:
        if gpus % tp == 0:
            sizes.append(Split(tp, gpus // tp))
        tp *= 2
    if model.moe is not None:
        sizes += [Split(gpus, 1, gpus), Split(1, gpus, gpus)]
    return [split for split in dict.fromkeys(sizes) if cuts_whole(model, layouts, split)]


# the tasks (and workloads of task=bench) that take a split as per-GPU figures by formula, running nothing as ranks
FIGURE_TASKS = ("inspect", "capacity")
FIGURE_WORKLOADS = ("serving",)


def runs_as_ranks(job: Any) -> bool:
    """Whether ``job`` (a BenchConfig) with ``runtime.tensor_parallel`` > 1 runs as that many processes
    (task=bench workload=decode); a task of :data:`FIGURE_TASKS` gives the split's figures instead."""
    return job.task == "bench" and job.workload.name == "decode"


def check_parallel(job: Any) -> None:
    """Refuse, in one line naming the key and the value, a ``runtime.tensor_parallel`` /
    ``runtime.expert_parallel`` the job cannot run: not a count, more ranks than the machine's CPUs
    (on a CPU; a GPU count is checked where the ranks start), a task other than decode (or one that
    prints the split's figures), query heads or widths it does not divide, a layer whose module runs
    whole only or whose heads it cannot cut."""
    rt, model = job.runtime, job.model
    tp, ep = rt.tensor_parallel, rt.expert_parallel
    for key, value in (("runtime.tensor_parallel", tp), ("runtime.expert_parallel", ep)):
        check(isinstance(value, int) and not isinstance(value, bool) and value >= 1, key, value,
              "must be an integer >= 1 (ranks, one process each)")
    if tp == 1 and ep == 1:
        return
    key, value = ("runtime.tensor_parallel", tp) if tp > 1 else ("runtime.expert_parallel", ep)
    check(ep in (1, tp), "runtime.expert_parallel", ep,
          f"splits the experts over the runtime.tensor_parallel={tp} ranks (1: each expert's width is cut instead)")
    ranks = runs_as_ranks(job)
    runs = f"task={job.task}" + (f" workload={job.workload.name}" if job.task == "bench" else "")
    figures = job.task in FIGURE_TASKS or (job.task == "bench" and job.workload.name in FIGURE_WORKLOADS)
    check(ranks or figures, key, value,
          f"only task=bench workload=decode runs as ranks, and task=inspect, task=capacity and workload=serving "
          f"give the split's per-GPU figures, not {runs}; use 1")
    cpus = os.cpu_count() or 1
    check(not ranks or rt.device != "cpu" or tp <= cpus, key, value, f"more ranks than this machine's {cpus} CPUs")
    check(not ranks or rt.compile == "false", "runtime.compile", rt.compile,
          f"with runtime.tensor_parallel={tp}: the all-reduce between ranks runs eagerly (not built); use false")
    check(model.num_heads % tp == 0, key, value, f"must divide model.num_heads={model.num_heads} (each rank runs "
          "whole query heads)")
    for index, layer in first_of_each(build_layouts(model, job.attention)):
        if ranks and layer.shard(tp) is None:
            raise ConfigError(f"{key}={value!r}: layer {index} is {kind_of(layer).title or layer.kind}, whose module "
                              "runs whole (sharding it is not built); use 1")
        why = layer.tensor_refusal(tp)
        if why:
            raise ConfigError(f"{key}={value!r}: layer {index}: {why}")
    # Gemma 4's experts beside the dense MLP norm each part before the sum: a rank's partial sum is not theirs
    check(not ranks or model.moe is None or not model.moe.beside_dense, key, value, "the mixture of experts "
          "beside the dense MLP (model.moe.beside_dense) norms each part's output, which sharding it would cut "
          "(not built); use 1")
    check(not ranks or model.residual is None or model.residual.shared_mlp_factor == 1, key, value,
          "the shared layers' wider MLP (model.residual.shared_mlp_factor) is not cut across ranks (not built); use 1")
    dense = model.moe is None or len(model.moe.dense_layers) > 0
    check(not dense or model.ffn_dim % tp == 0, key, value, f"must divide model.ffn_dim={model.ffn_dim}")
    if model.moe is not None:
        moe, split = model.moe, Split(tp, 1, ep)
        check(moe.num_experts % ep == 0, "runtime.expert_parallel", ep,
              f"must divide model.moe.num_experts={moe.num_experts}")
        check(moe.expert_ffn_dim % split.expert_width_ranks == 0, key, value,
              f"must divide model.moe.expert_ffn_dim={moe.expert_ffn_dim}")
        check(moe.shared_ffn_dim % tp == 0, key, value, f"must divide model.moe.shared_ffn_dim={moe.shared_ffn_dim}")
