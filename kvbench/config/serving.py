"""``workload=serving``'s dataclass (:class:`ServingWorkload`): the arrival process, the length
distributions, the shared prefix and the KV store the scheduler serves them from, each checked
where it enters, one line naming the key and the value."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Dict, Optional

from kvbench.core.errors import ConfigError, check, check_choice, check_numbers
from kvbench.core.task import ALL, Keys
from kvbench.layouts.kinds import recurrent_in, recurrent_layer_types

ALLOCATORS = ("per_kind", "unified")  # workload.allocator: kvbench.serving.allocator
CHECKPOINTS = ("block", "every_n", "prompt_end")  # workload.state_checkpoint: where a state is saved

ARRIVALS = ("poisson", "gamma", "trace")
LENGTH_DISTS = ("fixed", "uniform", "lognormal")
STORES = ("paged", "slots")

# A lognormal's spread beyond this puts nearly every length at lo or hi (and its sigma^2 =
# ln(1 + cv^2) overflows near 1e154).
MAX_CV = 100.0

# What one run can do. Its record holds every request (a row of tables.serving_requests), every
# output token's time (tables.serving_tokens) and, at worst one per output token (a CPU run decodes
# one sequence an iteration), the scheduler's state after each iteration (tables.serving_samples and
# the series): about these many bytes each in results.json (model=tiny records, rounded up). A
# record larger than results.json is read back at (kvbench.results.MAX_RECORD_BYTES; a test holds the
# two equal) would be written and then be unreadable: hours of serving lost to resume and reports.
RECORD_BYTES_PER_REQUEST = 400
RECORD_BYTES_PER_TOKEN = 300
MAX_RECORD_BYTES = 64 * 2**20
MAX_REQUESTS = MAX_RECORD_BYTES // RECORD_BYTES_PER_REQUEST  # requests of one output token each, at most
# Arrivals spread over more than a day are a typo (workload.rate=1e-6) or a trace of absolute
# timestamps: the scheduler would sleep until each one.
MAX_SPAN_S = 86_400.0


@dataclass
class LengthConfig:
    """A length distribution (tokens). ``fixed``: always ``mean``; ``uniform``: an integer in
    [lo, hi]; ``lognormal``: mean ``mean`` and coefficient of variation ``cv`` (std / mean),
    rounded and clipped to [lo, hi]."""

    dist: str = "fixed"  # fixed | uniform | lognormal
    mean: float = 128.0  # fixed: the length; lognormal: the mean before clipping
    cv: float = 0.5  # lognormal: std / mean
    lo: int = 1  # uniform: the least length; lognormal: clipped below here
    hi: int = 512  # uniform: the largest length; lognormal: clipped above here

    def check(self, key: str) -> None:
        check_numbers(key, self)
        check_choice(f"{key}.dist", self.dist, LENGTH_DISTS)
        if self.dist == "fixed":
            check(self.mean >= 1 and float(self.mean).is_integer(), f"{key}.mean", self.mean,
                  "dist=fixed: must be a whole number of tokens >= 1")
            return
        check(self.lo >= 1, f"{key}.lo", self.lo, "must be >= 1")
        check(self.hi >= self.lo, f"{key}.hi", self.hi, f"must be >= {key}.lo={self.lo}")
        if self.dist == "lognormal":
            check(self.lo <= self.mean <= self.hi, f"{key}.mean", self.mean,
                  f"must be in [{key}.lo={self.lo}, {key}.hi={self.hi}]")
            check(self.cv > 0, f"{key}.cv", self.cv, "must be > 0 (dist=fixed for no spread)")
            check(self.cv <= MAX_CV, f"{key}.cv", self.cv, f"must be <= {MAX_CV:g} (a larger spread puts nearly "
                                                           f"every length at {key}.lo or {key}.hi)")

    @property
    def max_len(self) -> int:
        """The longest length this distribution gives."""
        return int(self.mean) if self.dist == "fixed" else self.hi

    @property
    def mean_len(self) -> float:
        """The mean length this distribution gives (a lognormal's before clipping)."""
        return (self.lo + self.hi) / 2 if self.dist == "uniform" else float(self.mean)


@dataclass
class RateSearchConfig:
    """``workload.search``: find the highest ``workload.rate`` whose run meets the SLO (``slo.*``,
    judged on ``slo.stat``) by :func:`kvbench.serving.rate_search.max_rate_under_slo`: gallop by
    ``growth`` from ``lo``, then bisect geometrically to within ``1 + rel_tol``, at most
    ``max_probes`` runs. Every run serves the same requests, their gaps scaled to its rate."""

    enabled: bool = False
    lo: float = 0.5  # requests/s: the lowest rate tried
    hi: float = 64.0  # requests/s: the highest rate tried
    growth: float = 2.0  # each gallop step multiplies the rate by this
    rel_tol: float = 0.1  # stop when the lowest failing rate / the highest passing one <= 1 + rel_tol
    max_probes: int = 10  # serving runs at most
    check_above: bool = True  # one run above the first failure (a pass there is reported as non-monotone)

    def check(self) -> None:
        check_numbers("workload.search", self)
        check(self.lo > 0, "workload.search.lo", self.lo, "must be > 0 requests/s")
        check(self.hi > self.lo, "workload.search.hi", self.hi, f"must be > workload.search.lo={self.lo}")
        check(self.growth > 1, "workload.search.growth", self.growth, "must be > 1")
        check(self.rel_tol > 0, "workload.search.rel_tol", self.rel_tol, "must be > 0")
        check(self.max_probes >= 2, "workload.search.max_probes", self.max_probes, "must be >= 2")


@dataclass
class ServingWorkload:
    """Open-loop arrivals served by continuous batching from a KV store of a fixed budget
    (docs/serving.md). The same ``seed`` gives every variant the same requests."""

    name: str = "serving"  # the option, conf/workload/<name>.yaml
    arrival: str = "poisson"  # poisson | gamma (burstiness) | trace (workload.trace)
    rate: float = 4.0  # requests per second (mean); arrival=trace ignores it
    burstiness: float = 1.0  # gamma's shape: 1 = Poisson, < 1 burstier, > 1 more regular (CV^2 = 1/burstiness)
    num_requests: Optional[int] = 32  # requests drawn (null: until duration_s)
    duration_s: Optional[float] = None  # draw arrivals until this many seconds (num_requests null)
    trace: Optional[str] = None  # arrival=trace: JSONL or CSV of arrival_s, prompt_len, output_len[, prefix_id]
    # a request's own prompt tokens: .dist fixed|uniform|lognormal, .mean, .cv, .lo, .hi (LengthConfig)
    prompt: LengthConfig = field(default_factory=lambda: LengthConfig("lognormal", 128, 0.5, 16, 512))
    output: LengthConfig = field(default_factory=lambda: LengthConfig("uniform", 32, 0.5, 16, 64))  # as prompt
    prefix_len: int = 0  # a shared system prompt of this many tokens before a prefixed request's own prompt
    prefix_fraction: float = 1.0  # share of requests that carry a prefix (when prefix_len > 0)
    prefix_groups: int = 1  # distinct system prompts (prefix_id 0 .. groups - 1)
    store: str = "paged"  # paged (blocks of cache.block_size, on demand) | slots (a static slot per request)
    prefix_caching: bool = True  # paged: reuse full blocks of equal token chains across requests (vLLM's APC)
    kv_budget_mb: Optional[float] = None  # KV memory the store may hold, MB (1e6 bytes)
    kv_budget_blocks: Optional[int] = None  # or as blocks (slots: as slots); exactly one of the two
    # paged: per_kind (a pool per group of layers: full, each ring size, recurrent states) | unified (one pool
    # of equal pages, the attention block raised until a page holds a state: vLLM's hybrid allocator)
    allocator: str = "per_kind"
    # prefix caching of a recurrent (Gated DeltaNet) layer: where its state is saved, block (every block
    # boundary) | every_n (every state_checkpoint_tokens) | prompt_end (the prompt's last block boundary)
    state_checkpoint: str = "block"
    state_checkpoint_tokens: int = 0  # state_checkpoint=every_n: a multiple of the attention block
    max_prefill_tokens: int = 512  # prompt tokens prefilled per iteration; a longer prompt is chunked
    max_running: int = 64  # requests running at once at most (vLLM's max_num_seqs)
    slot_len: Optional[int] = None  # store=slots: positions per slot; null: the longest request
    seed: int = 0  # arrivals, lengths and token ids: the same seed gives every variant the same requests
    search: RateSearchConfig = field(default_factory=RateSearchConfig)  # the highest rate under the SLO

    OPTION: ClassVar[str] = "serving"  # its workload= option (a subclass: conversations)
    # its goodput and rate search are judged by the slo group's targets
    READS: ClassVar[Dict[str, Keys]] = {"cache": ("block_size", "dtype", "state_dtype"), "slo": ALL}
    LENGTH_KEY: ClassVar[str] = "workload.prompt"
    # The scheduler forms each batch; a task that reads only a batch size (compare, inspect) sees one
    # sequence.
    batch_size: ClassVar[int] = 1

    def __post_init__(self) -> None:
        w = self
        check_numbers("workload", w)
        if w.OPTION == "serving":  # a subclass checks its own name
            check_choice("workload.name", w.name, ("serving",))
        check_choice("workload.arrival", w.arrival, ARRIVALS)
        check(w.rate > 0, "workload.rate", w.rate, "must be > 0 requests per second")
        check(w.burstiness > 0, "workload.burstiness", w.burstiness, "must be > 0 (1 = Poisson, < 1 burstier)")
        if w.arrival == "trace":
            check(bool(w.trace), "workload.trace", w.trace, "workload.arrival=trace needs a trace file (JSONL or CSV)")
        else:
            check((w.num_requests is None) != (w.duration_s is None), "workload.num_requests", w.num_requests,
                  f"give exactly one of workload.num_requests and workload.duration_s (duration_s={w.duration_s})")
            check(w.num_requests is None or w.num_requests >= 1, "workload.num_requests", w.num_requests,
                  "must be >= 1 or null")
            check(w.duration_s is None or w.duration_s > 0, "workload.duration_s", w.duration_s,
                  "must be > 0 or null")
        w.prompt.check("workload.prompt")
        w.output.check("workload.output")
        check(w.prefix_len >= 0, "workload.prefix_len", w.prefix_len, "must be >= 0")
        check(0 <= w.prefix_fraction <= 1, "workload.prefix_fraction", w.prefix_fraction, "must be in [0, 1]")
        check(w.prefix_groups >= 1, "workload.prefix_groups", w.prefix_groups, "must be >= 1")
        check_choice("workload.store", w.store, STORES)
        check_choice("workload.allocator", w.allocator, ALLOCATORS)
        check(w.allocator == "per_kind" or w.store == "paged", "workload.allocator", w.allocator,
              f"pages blocks on demand; workload.store={w.store} takes a whole slot per request (use "
              "workload.allocator=per_kind or workload.store=paged)")
        check_choice("workload.state_checkpoint", w.state_checkpoint, CHECKPOINTS)
        if w.state_checkpoint == "every_n":
            check(w.state_checkpoint_tokens >= 1, "workload.state_checkpoint_tokens", w.state_checkpoint_tokens,
                  "workload.state_checkpoint=every_n needs the tokens between saves (>= 1, a multiple of the "
                  "attention block)")
        else:
            check(w.state_checkpoint_tokens == 0, "workload.state_checkpoint_tokens", w.state_checkpoint_tokens,
                  f"only workload.state_checkpoint=every_n reads it (state_checkpoint={w.state_checkpoint}); "
                  "set it to 0")
        check(w.kv_budget_mb is None or w.kv_budget_mb > 0, "workload.kv_budget_mb", w.kv_budget_mb,
              "must be > 0 or null")
        check(w.kv_budget_blocks is None or w.kv_budget_blocks >= 1, "workload.kv_budget_blocks",
              w.kv_budget_blocks, "must be >= 1 or null")
        check((w.kv_budget_mb is None) != (w.kv_budget_blocks is None), "workload.kv_budget_mb", w.kv_budget_mb,
              f"give exactly one of workload.kv_budget_mb and workload.kv_budget_blocks (kv_budget_blocks="
              f"{w.kv_budget_blocks}); for a budget in blocks set workload.kv_budget_mb=null")
        check(w.max_prefill_tokens >= 1, "workload.max_prefill_tokens", w.max_prefill_tokens, "must be >= 1")
        check(w.max_running >= 1, "workload.max_running", w.max_running, "must be >= 1")
        check(w.slot_len is None or w.slot_len >= 2, "workload.slot_len", w.slot_len, "must be >= 2 or null")
        check(w.seed >= 0, "workload.seed", w.seed, "must be >= 0")
        w.search.check()
        check(not (w.search.enabled and w.arrival == "trace"), "workload.search.enabled", w.search.enabled,
              "a rate search draws arrivals at each rate; workload.arrival=trace has its own times")
        if w.arrival != "trace":  # a trace's size and span are checked as it is read (serving/arrivals.py)
            _check_run_size(w)

    @property
    def total_len(self) -> int:
        """The longest request the distributions give (prefix + prompt + output positions); a trace's
        lengths are checked when it is read (0 here)."""
        if self.arrival == "trace":
            return 0
        return self.prefix_len + self.prompt.max_len + self.output.max_len

    def layout_settings(self, cfg: Any) -> Dict[str, Any]:
        return {"workload.store": self.store}

    def check_run(self, cfg: Any) -> None:
        """Rules across groups (``cfg``: the job's config, its attention resolved): a rate search
        needs a latency target; the forwards are eager (what a layer's layout does not run with,
        a quantized state, is its own Limit)."""
        check(not self.search.enabled or any(v is not None for v in (cfg.slo.ttft_ms, cfg.slo.tpot_ms,
                                                                       cfg.slo.e2e_ms)),
              "workload.search.enabled", self.search.enabled, "the rate search needs an SLO: set slo.ttft_ms, "
              "slo.tpot_ms and/or slo.e2e_ms (or slo=llama2_70b_server)")
        check(cfg.slo.tpot_x_batch1 is None, "slo.tpot_x_batch1", cfg.slo.tpot_x_batch1,
              "workload=serving judges TPOT against slo.tpot_ms (a multiple of the batch-1 step is task=capacity's)")
        check(cfg.runtime.compile == "false", "runtime.compile", cfg.runtime.compile,
              "workload=serving runs eager forwards (the batch's shapes change every iteration); use "
              "runtime.compile=false")
        if self.state_checkpoint != "block":  # the default: a setting that does nothing is refused, not recorded
            # where a recurrent layer's state is saved for prefix caching: without such a layer, or
            # without prefix caching, no state is ever saved and the run would record a policy it never used
            recurrent = recurrent_in(cfg.attention.layer_types)
            why = ("workload.prefix_caching=false" if recurrent
                   else f"model {cfg.model.name} with this attention has no "
                        f"{' or '.join(recurrent_layer_types())} layer")
            check(recurrent and self.prefix_caching, "workload.state_checkpoint", self.state_checkpoint,
                  f"says where a recurrent layer's state is saved for prefix caching, and {why}; leave it block")


def _check_run_size(w) -> None:
    """A run of drawn arrivals that its record can hold and that ends within :data:`MAX_SPAN_S`
    (the mean span; the drawn arrivals are checked again: :func:`kvbench.serving.arrivals.check_drawn`).
    A rate search runs from ``search.lo`` (the longest span) to ``search.hi`` (the most requests in
    a duration)."""
    slowest, fastest = (w.search.lo, w.search.hi) if w.search.enabled else (w.rate, w.rate)
    rate_key, fast_key = (("workload.search.lo", "workload.search.hi") if w.search.enabled
                          else ("workload.rate", "workload.rate"))
    if w.num_requests is not None:
        check_record_size("workload.num_requests", w.num_requests, w.num_requests, w.output.mean_len)
        span = w.num_requests / slowest
        check(span <= MAX_SPAN_S, rate_key, slowest,
              f"{w.num_requests} requests (workload.num_requests) at this rate arrive over ~{duration_text(span)}, "
              f"more than the {duration_text(MAX_SPAN_S)} a serving run may span; raise the rate or lower "
              "workload.num_requests")
    else:
        check(w.duration_s <= MAX_SPAN_S, "workload.duration_s", w.duration_s,
              f"more than the {duration_text(MAX_SPAN_S)} a serving run may span")
        check_record_size("workload.duration_s", w.duration_s, w.duration_s * fastest, w.output.mean_len,
                          f"at {fast_key}={fastest:g} req/s, ")


def check_record_size(key: str, value, requests: float, mean_output: float, how: str = "") -> None:
    """Refuse (one line naming ``key``) a run of ``requests`` requests of ``mean_output`` output
    tokens on average whose record would be larger than :data:`MAX_RECORD_BYTES`."""
    size = requests * (RECORD_BYTES_PER_REQUEST + RECORD_BYTES_PER_TOKEN * mean_output)
    if size > MAX_RECORD_BYTES:
        most = int(MAX_RECORD_BYTES // (RECORD_BYTES_PER_REQUEST + RECORD_BYTES_PER_TOKEN * mean_output))
        raise ConfigError(f"{key}={value!r}: {how}~{requests:.3g} requests of ~{mean_output:g} output tokens would "
                          f"make a record of ~{size / 2**20:.3g} MiB (every request, every token's time and every "
                          f"scheduler iteration), more than the {MAX_RECORD_BYTES // 2**20} MiB a results.json may "
                          f"hold; at most ~{most:,} requests of these lengths in one run")


def duration_text(seconds: float) -> str:
    """``90 s``, ``12 min``, ``3.5 h``, ``41 days``: a span as a person reads it."""
    if seconds < 120:
        return f"{seconds:.3g} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 3 * 86_400:
        return f"{seconds / 3600:.3g} h"
    return f"{seconds / 86_400:.3g} days"


def kv_budget_note(kv_budget_mb: Optional[float], kv_budget_blocks: Optional[int]) -> str:
    """The budget as the config gave it, for error lines."""
    if kv_budget_blocks is not None:
        return f"workload.kv_budget_blocks={kv_budget_blocks}"
    return f"workload.kv_budget_mb={kv_budget_mb}"
