"""``task=recall``'s section of the config (:class:`RecallConfig`): which synthetic recall task,
its conditions, vocabulary and seeds (kvbench/quality/recall.py generates them). Checked where the
values enter, each failure one line naming the key and the value."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from kvbench.core.errors import check, check_choice, check_numbers, check_positive
from kvbench.core.task import ALL, QUALITY_RUNTIME, Asked, Task, Without

RECALL_KINDS = ("mqar", "passkey")


@dataclass
class RecallConfig:
    """``task=recall``: a synthetic recall task (kvbench/quality/recall.py) learnt from scratch by
    the ``attention`` variant, ``seeds`` times under the ``train`` budget, scored per condition.

    ``kind=mqar``: every (``num_pairs``, ``seq_len``) pair of the lists is a condition;
    ``kind=passkey``: every (``seq_len``, ``distance``) pair. ``vocab_size`` is the model's
    vocabulary for the run (``model.vocab_size`` is not read). Seeds are ``runtime.seed`` and
    the next ``seeds - 1`` integers; each seed draws the weights, the training stream and its
    ``eval_sequences`` held-out sequences per condition (the same for every variant)."""

    kind: str = "mqar"
    vocab_size: int = 64
    num_pairs: List[int] = field(default_factory=lambda: [4, 8])
    seq_len: List[int] = field(default_factory=lambda: [64])
    distances: List[int] = field(default_factory=lambda: [16, 32, 56])
    digits: int = 4  # passkey: digits of the number hidden
    seeds: int = 3
    eval_sequences: int = 256
    # null: trained from scratch; N: an MHA model trained first (the same budget), its KV heads
    # mean-pooled to attention.num_kv_heads, scored, then uptrained N steps and scored again
    uptrain_steps: Optional[int] = None

    def __post_init__(self) -> None:
        check_numbers("recall", self)
        check_choice("recall.kind", self.kind, RECALL_KINDS)
        check_positive("recall", self, ("digits", "seeds", "eval_sequences"))
        check(self.uptrain_steps is None or self.uptrain_steps >= 0, "recall.uptrain_steps",
               self.uptrain_steps, "must be >= 0 or null")
        for key in ("num_pairs", "seq_len", "distances"):
            values = getattr(self, key)
            check(len(values) > 0 and all(isinstance(v, int) and v >= 1 for v in values), f"recall.{key}",
                   values, "must be a non-empty list of integers >= 1")
            check(len(set(values)) == len(values), f"recall.{key}", values, "lists a value twice")
        if self.kind == "mqar":
            half = self.vocab_size // 2
            check(max(self.num_pairs) <= half - 1, "recall.num_pairs", self.num_pairs,
                   f"{max(self.num_pairs)} distinct keys need recall.vocab_size >= {2 * max(self.num_pairs) + 2} "
                   f"(keys are [1, V/2), values [V/2, V)); recall.vocab_size={self.vocab_size}")
            need = 3 * max(self.num_pairs)
            check(min(self.seq_len) >= need, "recall.seq_len", self.seq_len,
                   f"{max(self.num_pairs)} pairs and their queries need {need} positions")
        else:
            check(self.vocab_size > 12, "recall.vocab_size", self.vocab_size,
                   "passkey needs > 12 tokens (10 digits, KEY, QUERY and filler)")
            check(self.digits >= 2, "recall.digits", self.digits, "must be >= 2")
            low, high = self.digits + 1, min(self.seq_len) - self.digits - 1
            check(all(low <= d <= high for d in self.distances), "recall.distances", self.distances,
                   f"must be in [{low}, {high}] (recall.digits={self.digits}, shortest recall.seq_len="
                   f"{min(self.seq_len)})")


def check_recall_run(r: RecallConfig, max_seq_len: int, num_heads: int, attention: Any) -> None:
    """task=recall's rules across groups (``attention``: the resolved AttentionConfig), checked
    when the config is typed, before any seed trains: every length fits the model (the closing
    decode timing included: it stays within the longest length), and ``uptrain_steps`` only towards
    fewer K/V heads than the trained MHA model's (a layout pooling cannot make refuses it by its
    ``kv_conversion`` Limit: :func:`recall_settings`) — anything else would score another model
    under the variant's label."""
    check(max(r.seq_len) <= max_seq_len, "recall.seq_len", r.seq_len, f"longer than model.max_seq_len={max_seq_len}")
    if r.uptrain_steps is None:
        return
    kv = attention.num_kv_heads  # a divisor of num_heads (the resolved attention's rule)
    check(kv < num_heads, "recall.uptrain_steps", r.uptrain_steps,
          f"converts a trained MHA model to fewer KV heads; attention.num_kv_heads={kv} of model.num_heads="
          f"{num_heads} is that MHA model (use attention=gqa or mqa, or recall.uptrain_steps=null)")


def recall_settings(r: RecallConfig) -> Dict[str, Any]:
    """What a layer's layout may refuse of task=recall: ``uptrain_steps`` mean-pools a trained MHA
    model's K/V heads into the variant's (a ``kv_conversion``)."""
    return {} if r.uptrain_steps is None else {
        "kv_conversion": Asked("mean-pool", f"recall.uptrain_steps={r.uptrain_steps}",
                               "use recall.uptrain_steps=null to train the variant from scratch")}


# Trains from generated sequences (no text, no workload) and scores them through a cache of
# cache.dtype (auto: none), as task=eval scores text.
RECALL = Task(reads={"attention": ALL, "cache": ("dtype",), "runtime": QUALITY_RUNTIME,
                     "train": Without("checkpoint", "init_from", "seq_len", "eval_batches"), "recall": ALL},
              check=lambda cfg: check_recall_run(cfg.recall, cfg.model.max_seq_len, cfg.model.num_heads,
                                                 cfg.attention),
              settings=lambda cfg: recall_settings(cfg.recall))
