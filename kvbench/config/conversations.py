"""``workload=conversations``' dataclass (:class:`ConversationsWorkload`): multi-turn chats served
as ``workload=serving`` serves requests (the same arrivals, store, budget, scheduler and rate
search), where each arrival is a conversation. A conversation's turn is a request whose prompt is
the whole history (every earlier message and answer) and a new user message; the next turn arrives
a think time after the answer is finished. Checked where it enters, one line naming key and value."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Optional

from kvbench.config import serving
from kvbench.config.serving import LengthConfig, RateSearchConfig, ServingWorkload
from kvbench.core.errors import check, check_choice, check_numbers

THINK_DISTS = ("fixed", "exponential", "uniform", "lognormal")


@dataclass
class ThinkConfig:
    """A think time (seconds) between an answer's last token and the next user message: ``fixed``
    (``mean``), ``exponential`` of ``mean``, ``uniform`` on [lo, hi], or ``lognormal`` of ``mean``
    and ``cv`` clipped to [lo, hi]."""

    dist: str = "exponential"  # fixed | exponential | uniform | lognormal
    mean: float = 2.0  # seconds
    cv: float = 0.5  # lognormal: std / mean
    lo: float = 0.0  # uniform: the least; lognormal: clipped below here
    hi: float = 60.0  # uniform: the most; lognormal: clipped above here

    def check(self, key: str) -> None:
        check_numbers(key, self)
        check_choice(f"{key}.dist", self.dist, THINK_DISTS)
        check(self.mean >= 0, f"{key}.mean", self.mean, "must be >= 0 seconds")
        check(self.mean <= serving.MAX_SPAN_S, f"{key}.mean", self.mean, f"must be <= {serving.MAX_SPAN_S:g} s (a day)")
        if self.dist in ("uniform", "lognormal"):
            check(self.lo >= 0, f"{key}.lo", self.lo, "must be >= 0 seconds")
            check(self.hi >= self.lo, f"{key}.hi", self.hi, f"must be >= {key}.lo={self.lo}")
            check(self.hi <= serving.MAX_SPAN_S, f"{key}.hi", self.hi, f"must be <= {serving.MAX_SPAN_S:g} s (a day)")
        if self.dist == "lognormal":
            check(self.lo <= self.mean <= self.hi and self.mean > 0, f"{key}.mean", self.mean,
                  f"must be > 0 and in [{key}.lo={self.lo}, {key}.hi={self.hi}]")
            check(0 < self.cv <= serving.MAX_CV, f"{key}.cv", self.cv, f"must be in (0, {serving.MAX_CV:g}]")

    @property
    def max_s(self) -> float:
        """The longest think time this distribution gives (an exponential's: 50 means, a bound)."""
        return {"fixed": self.mean, "exponential": 50 * self.mean}.get(self.dist, self.hi)


@dataclass
class ConversationsWorkload(ServingWorkload):
    """Multi-turn chats at serving scale (docs/serving.md, "Conversations"). ``num_requests`` /
    ``duration_s``, ``rate`` and ``arrival`` are those of conversations; ``prompt`` is each user
    message's length, ``output`` each answer's; ``prefix_len`` a system prompt before the first
    message. ``sharegpt``: a ShareGPT-style JSON whose conversations give the turns and their
    lengths (the checkpoint's tokenizer.json at model.path, else UTF-8 bytes); ``arrival=trace``:
    ``trace`` is a CSV / JSONL of conversation, turn, arrival_s, user_len, output_len (optional
    think_s)."""

    name: str = "conversations"  # the option, conf/workload/<name>.yaml
    rate: float = 1.0  # conversations per second (mean); arrival=trace ignores it
    num_requests: Optional[int] = 16  # conversations drawn (null: until duration_s)
    prompt: LengthConfig = field(default_factory=lambda: LengthConfig("lognormal", 64, 0.5, 8, 256))  # a message
    output: LengthConfig = field(default_factory=lambda: LengthConfig("uniform", 32, 0.5, 16, 48))  # an answer's
    search: RateSearchConfig = field(default_factory=lambda: RateSearchConfig(lo=0.25, hi=16.0))  # conversations/s
    turns: LengthConfig = field(default_factory=lambda: LengthConfig("uniform", 4, 0.5, 2, 6))  # per conversation
    think: ThinkConfig = field(default_factory=ThinkConfig)  # seconds from an answer to the next message
    sharegpt: Optional[str] = None  # a ShareGPT-style JSON of conversations (their turns and lengths)

    OPTION: ClassVar[str] = "conversations"

    def __post_init__(self) -> None:
        super().__post_init__()
        w = self
        check_choice("workload.name", w.name, ("conversations",))
        w.turns.check("workload.turns")
        w.think.check("workload.think")
        if w.arrival == "trace":
            check(w.sharegpt is None, "workload.sharegpt", w.sharegpt, "workload.arrival=trace reads its "
                  "conversations from workload.trace; a ShareGPT file's conversations arrive at workload.rate "
                  "(workload.arrival=poisson or gamma)")
            check(w.prefix_len == 0, "workload.prefix_len", w.prefix_len, "a conversation trace has no system "
                  "prompt (its lengths are the trace's); use workload.prefix_len=0")
        else:  # a file's lengths are checked as it is read (serving/conversation_traces.py)
            turns = w.turns.mean_len if w.sharegpt is None else 1.0
            count = (w.num_requests if w.num_requests is not None
                     else w.duration_s * (w.search.hi if w.search.enabled else w.rate))
            key = "workload.num_requests" if w.num_requests is not None else "workload.duration_s"
            serving.check_record_size(key, getattr(w, key.split(".")[1]), count * turns, w.output.mean_len,
                              f"{turns:g} turns a conversation on average, ")

    @property
    def total_len(self) -> int:
        """The longest turn the distributions give: the system prompt and every message and answer
        of the longest conversation (a file's lengths are checked when it is read: 0 here)."""
        if self.arrival == "trace" or self.sharegpt is not None:
            return 0
        return self.prefix_len + self.turns.max_len * (self.prompt.max_len + self.output.max_len)
