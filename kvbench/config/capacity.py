"""``task=capacity``'s sections of the config: its latency targets (:class:`SloConfig`, the ``slo``
group) and its search (:class:`CapacityConfig`), and what the task reads. Checked where the values
enter, each failure one line naming the key and the value."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional

from kvbench.core.errors import check, check_choice, check_numbers, check_positive
from kvbench.core.task import ALL, Task, Without

SLO_STATS = ("p50", "p99")
MAX_GPUS_PER_NODE = 1024  # a node's GPUs: beyond it, a typo (the per-GPU table tries each power of two up to it)


@dataclass
class SloConfig:
    """Latency targets of ``task=capacity``: a batch meets them when the ``stat`` (p50 or p99) of
    its time to first token and of its time per output token are at most these (null: no target).
    ``workload=serving`` judges its goodput (per request) and its rate search (the run's ``stat``)
    by the same targets and ``e2e_ms``."""

    name: str = "none"
    ttft_ms: Optional[float] = None
    tpot_ms: Optional[float] = None
    e2e_ms: Optional[float] = None  # workload=serving only: end-to-end latency (task=capacity refuses it)
    stat: str = "p99"
    # a TPOT target relative to the machine: at most this many times the variant's own batch-1
    # step at the same context, measured by the job (a load that slows every step alike cancels)
    tpot_x_batch1: Optional[float] = None

    def __post_init__(self) -> None:
        check_numbers("slo", self)
        check_choice("slo.stat", self.stat, SLO_STATS)
        for key in ("ttft_ms", "tpot_ms", "e2e_ms"):
            value = getattr(self, key)
            check(value is None or value > 0, f"slo.{key}", value, "must be > 0 or null")
        check(self.tpot_x_batch1 is None or self.tpot_x_batch1 >= 1, "slo.tpot_x_batch1", self.tpot_x_batch1,
               "must be >= 1 (a multiple of the batch-1 step) or null")


@dataclass
class CapacityConfig:
    """``task=capacity``: the contexts (prompt lengths) searched, and the search's range and
    resolution (an answer is within ``batch_step`` of the largest batch that fits)."""

    context_lens: List[int] = field(default_factory=lambda: [512, 1024, 2048])
    max_batch: int = 256
    batch_step: int = 1
    # slo.tpot_x_batch1: decode steps of a probe timed one by one against as many of one sequence
    tpot_pairs: int = 32
    # A probe's prompts are prefilled in forwards of at most this many tokens over the batch
    # (max(1, prefill_chunk // batch) positions of each), as an engine's chunked prefill bounds its
    # working set (vLLM's max_num_batched_tokens; workload=serving's max_prefill_tokens); null: the whole
    # batch's prompts in one forward, whose working memory grows with batch x context.
    prefill_chunk: Optional[int] = 512
    # true: a probe of B > 1 sequences that no slo.ttft_ms judges prefills its first sequence and copies
    # its history into the other B - 1 (cache.impl=static); only the batch's last chunk forward runs over
    # all B, each its own tokens. The cache holds what B prefills leave, no forward holds more than
    # prefill_chunk tokens, the decode steps are the batch's: its memory and TPOT, for about 1/B of the
    # prefill's compute; its TTFT is not the batch's, so not recorded. false: every sequence prefilled.
    copy_prompts: bool = True
    # the record's per-GPU table (tables.per_gpu): the splits of a node of this many GPUs, each GPU's
    # memory the job's budget (runtime.memory_budget_gb)
    gpus_per_node: int = 8
    # true: the table from formulas and the serving store's plan only, no model built, no probe run
    # (tasks/capacity_plan.py): a preset on a stated budget from any machine
    plan: bool = False

    def __post_init__(self) -> None:
        check_numbers("capacity", self)
        check(len(self.context_lens) > 0 and all(isinstance(n, int) and n >= 1 for n in self.context_lens),
               "capacity.context_lens", self.context_lens, "must be a non-empty list of lengths >= 1")
        check_positive("capacity", self, ("max_batch", "batch_step", "tpot_pairs"))
        check(1 <= self.gpus_per_node <= MAX_GPUS_PER_NODE, "capacity.gpus_per_node", self.gpus_per_node,
              f"must be in [1, {MAX_GPUS_PER_NODE}]")
        check(self.prefill_chunk is None or (isinstance(self.prefill_chunk, int) and self.prefill_chunk >= 1),
              "capacity.prefill_chunk", self.prefill_chunk, "must be an integer >= 1 (tokens per forward) or null")


def check_capacity_run(cfg: Any) -> None:
    w = cfg.workload
    check(w.name in ("decode", "multiturn"), "workload", w.name,
          "task=capacity searches the batch of workload=decode or workload=multiturn; workload=serving finds "
          "its highest rate under the SLO itself (task=bench workload.search.enabled=true)")
    check(cfg.slo.e2e_ms is None, "slo.e2e_ms", cfg.slo.e2e_ms,
          "task=capacity judges TTFT and TPOT only (an E2E target is workload=serving's)")
    # the probes' caches are in the compute dtype, as the KV formula they are judged by
    check(cfg.cache.dtype == "auto", "cache.dtype", cfg.cache.dtype,
          "task=capacity stores K/V in the compute dtype only; use cache.dtype=auto")
    if cfg.slo.tpot_x_batch1 is not None:
        check(cfg.cache.impl != "none", "cache.impl", cfg.cache.impl,
              "keeps no history, and slo.tpot_x_batch1 times a probe's filled cache stepping again; "
              "use static or concat")
    if w.name == "multiturn":  # one chat, its length the workload's (checked for every task)
        check(w.reply_len >= 2 or (cfg.slo.tpot_ms is None and cfg.slo.tpot_x_batch1 is None),
              "workload.reply_len", w.reply_len, "a one-token reply has no decode step to judge against "
              "slo.tpot_ms / slo.tpot_x_batch1; use >= 2, or no TPOT target")
        return
    longest = max(cfg.capacity.context_lens) + w.gen_len
    check(longest <= cfg.model.max_seq_len, "capacity.context_lens", cfg.capacity.context_lens,
          f"the longest context + workload.gen_len is {longest} positions, more than "
          f"model.max_seq_len={cfg.model.max_seq_len}")


# The batch it searches, and for decode the prompt length (capacity.context_lens), are its own; a
# chat's context is the conversation.
CAPACITY = Task(reads={"attention": ALL, "workload": Without("batch_size", "prompt_len"), "runtime": ALL,
                       "slo": ALL, "capacity": ALL},
                runs_workload=True,
                by_workload={"multiturn": {"capacity": ("max_batch", "batch_step", "gpus_per_node")}},
                check=check_capacity_run)
