"""``task=train`` and ``task=eval``: their sections of the config, the text (:class:`DataConfig`)
and the training budget (:class:`TrainConfig`), and what each task reads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from kvbench.core.errors import check, check_numbers, check_positive
from kvbench.core.task import ALL, QUALITY_RUNTIME, Task, Without


@dataclass
class DataConfig:
    """Text for training and perplexity, read as bytes (a byte-level tokenizer: vocab 256)."""

    path: Optional[str] = None  # a text file or directory; null: the Python standard library's sources
    val_fraction: float = 0.1
    max_bytes: Optional[int] = 4_000_000  # cap on bytes read, in a deterministic file order; null: no cap

    def __post_init__(self) -> None:
        check_numbers("data", self)
        check(0 < self.val_fraction < 1, "data.val_fraction", self.val_fraction, "must be in (0, 1)")
        check(self.max_bytes is None or self.max_bytes >= 1, "data.max_bytes", self.max_bytes,
               "must be >= 1 or null (no cap)")


@dataclass
class TrainConfig:
    """Training / evaluation of the decoder for quality (``task=train`` / ``task=eval``)."""

    # Defaults fit model=train_small on a 2-core CPU in about three minutes (~2M tokens).
    steps: int = 1000  # 0 with init_from: evaluate the converted checkpoint without uptraining
    batch_size: int = 16
    seq_len: int = 128
    lr: float = 3e-3
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1  # cosine decay ends at lr * min_lr_ratio
    weight_decay: float = 0.1  # weight matrices only; norms are not decayed
    grad_clip: float = 1.0  # max global gradient norm
    eval_batches: int = 20
    eval_every: int = 200
    log_every: int = 20
    init_from: Optional[str] = None  # checkpoint to start from (converted to attention.num_kv_heads)
    checkpoint: Optional[str] = None  # task=eval: kvbench checkpoint file or transformers checkpoint directory

    def __post_init__(self) -> None:
        check_numbers("train", self)
        check(self.steps >= 0, "train.steps", self.steps, "must be >= 0")
        check_positive("train", self, ("batch_size", "seq_len", "warmup_steps", "eval_batches",
                                        "eval_every", "log_every"))
        check(self.lr > 0, "train.lr", self.lr, "must be > 0")
        check(0 <= self.min_lr_ratio <= 1, "train.min_lr_ratio", self.min_lr_ratio, "must be in [0, 1]")
        check(self.weight_decay >= 0, "train.weight_decay", self.weight_decay, "must be >= 0")
        check(self.grad_clip > 0, "train.grad_clip", self.grad_clip, "must be > 0")


def check_train_run(cfg: Any) -> None:
    # train.init_from's checkpoint must have the model's max_seq_len (quality/train.py)
    check(cfg.train.seq_len <= cfg.model.max_seq_len, "train.seq_len", cfg.train.seq_len,
          f"longer than model.max_seq_len={cfg.model.max_seq_len}")


TRAIN = Task(reads={"attention": ALL, "runtime": QUALITY_RUNTIME, "train": Without("checkpoint"), "data": ALL},
             check=check_train_run)
# Scores train.checkpoint through a cache of cache.dtype (auto: none); its shape is the checkpoint's.
EVAL = Task(reads={"attention": ALL, "cache": ("dtype",), "runtime": QUALITY_RUNTIME,
                   "train": ("checkpoint", "batch_size", "seq_len", "eval_batches"), "data": ALL}, own_shape=True)
