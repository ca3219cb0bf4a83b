"""The ``workload`` group's schema: what a ``task=bench`` run feeds the model (``conf/workload/``):
``decode`` (a prompt, then greedy steps), ``multiturn`` (a chat over a shared system prompt) and
``serving`` (open-loop arrivals served by continuous batching; its lengths, store and rate search
in :mod:`kvbench.config.serving`). Cross-group rules live in :class:`kvbench.config.bench.BenchConfig`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from kvbench.config.errors import check_choice, check_numbers, check_positive
from kvbench.config.serving import LengthConfig, RateSearchConfig, check_serving, serving_total_len

WORKLOADS = ("decode", "multiturn", "serving")


@dataclass
class WorkloadConfig:
    """What a run feeds the model. ``decode``: prefill ``prompt_len`` then ``gen_len`` greedy
    steps. ``multiturn``: a chat of ``turns`` turns after a shared system prompt."""

    name: str = "decode"
    batch_size: int = 1
    prompt_len: int = 512
    gen_len: int = 64
    # multiturn
    system_len: int = 512
    turns: int = 4
    user_len: int = 64
    reply_len: int = 32
    # serving (kvbench/config/serving.py): open-loop arrivals served by continuous batching
    arrival: str = "poisson"  # poisson | gamma (burstiness) | trace (workload.trace)
    rate: float = 4.0  # requests per second (mean); arrival=trace ignores it
    burstiness: float = 1.0  # gamma's shape: 1 = Poisson, < 1 burstier, > 1 more regular (CV^2 = 1/burstiness)
    num_requests: Optional[int] = 32  # requests drawn (null: until duration_s)
    duration_s: Optional[float] = None  # draw arrivals until this many seconds (num_requests null)
    trace: Optional[str] = None  # arrival=trace: JSONL or CSV of arrival_s, prompt_len, output_len[, prefix_id]
    # a request's own prompt tokens: .dist fixed|uniform|lognormal, .mean, .cv, .lo, .hi (config.serving.LengthConfig)
    prompt: LengthConfig = field(default_factory=lambda: LengthConfig("lognormal", 128, 0.5, 16, 512))
    output: LengthConfig = field(default_factory=lambda: LengthConfig("uniform", 32, 0.5, 16, 64))  # as prompt
    prefix_len: int = 0  # a shared system prompt of this many tokens before a prefixed request's own prompt
    prefix_fraction: float = 1.0  # share of requests that carry a prefix (when prefix_len > 0)
    prefix_groups: int = 1  # distinct system prompts (prefix_id 0 .. groups - 1)
    store: str = "paged"  # paged (blocks of cache.block_size, on demand) | slots (a static slot per request)
    prefix_caching: bool = True  # paged: reuse full blocks of equal token chains across requests (vLLM's APC)
    kv_budget_mb: Optional[float] = None  # KV memory the store may hold, MB (1e6 bytes)
    kv_budget_blocks: Optional[int] = None  # or as blocks (slots: as slots); exactly one of the two
    max_prefill_tokens: int = 512  # prompt tokens prefilled per iteration; a longer prompt is chunked
    max_running: int = 64  # requests running at once at most (vLLM's max_num_seqs)
    slot_len: Optional[int] = None  # store=slots: positions per slot; null: the longest request
    seed: int = 0  # arrivals, lengths and token ids: the same seed gives every variant the same requests
    search: RateSearchConfig = field(default_factory=RateSearchConfig)  # the highest rate under the SLO

    def __post_init__(self) -> None:
        check_numbers("workload", self)
        check_choice("workload.name", self.name, WORKLOADS)
        check_positive("workload", self, ("batch_size", "prompt_len", "gen_len", "system_len",
                                           "turns", "user_len", "reply_len"))
        if self.name == "serving":
            check_serving(self)

    @property
    def total_len(self) -> int:
        """Longest sequence the workload builds (what the cache must hold)."""
        if self.name == "multiturn":
            return self.system_len + self.turns * (self.user_len + self.reply_len)
        if self.name == "serving":
            return serving_total_len(self)
        return self.prompt_len + self.gen_len
