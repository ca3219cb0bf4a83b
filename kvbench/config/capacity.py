"""``task=capacity``'s sections of the config: its latency targets (:class:`SloConfig`, the ``slo``
group) and its search (:class:`CapacityConfig`). Checked where the values enter, each failure one
line naming the key and the value."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from kvbench.config.errors import check, check_choice, check_numbers, check_positive

SLO_STATS = ("p50", "p99")


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

    def __post_init__(self) -> None:
        check_numbers("capacity", self)
        check(len(self.context_lens) > 0 and all(isinstance(n, int) and n >= 1 for n in self.context_lens),
               "capacity.context_lens", self.context_lens, "must be a non-empty list of lengths >= 1")
        check_positive("capacity", self, ("max_batch", "batch_step", "tpot_pairs"))
