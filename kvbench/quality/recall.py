"""Synthetic recall tasks, generated from a seed (nothing to download): where the KV layout
decides the answer, because the answer is a token stored many positions back.

- **MQAR**, multi-query associative recall (Arora et al. 2023, the Zoology study of attention
  variants): ``num_pairs`` key-value pairs ``k1 v1 k2 v2 ...``, then a query region where each
  key appears once more, at a random position among blanks; the target at a query is its value.
  Keys are distinct within a sequence and drawn from ``[1, V // 2)``, values from ``[V // 2, V)``
  (with replacement), token 0 is the blank. Chance without recall: ``1 / (V - V // 2)``; a model
  that copies a value from the context without binding it to its key does far better
  (:func:`copy_baseline`), so that is the floor a recall result must clear.
- **passkey** retrieval (Mohtashami & Jaggi 2023): filler, then ``KEY d1 .. dn`` at a chosen
  depth, more filler, and ``QUERY d1 .. dn`` at the end; the targets are the n digits after
  ``QUERY`` (teacher-forced, so "every digit's argmax right" is exactly what a greedy decode of
  the passkey would produce). ``distance`` = positions from the first digit of the passkey to
  ``QUERY``. Tokens 0-9 are digits, 10 ``KEY``, 11 ``QUERY``, the rest filler (uniform random).

Targets are :data:`IGNORE` everywhere but the answers (``F.cross_entropy``'s default
``ignore_index``), so the training loss is the answer loss. A sequence belongs to the train or
the eval split by a hash of its tokens (:func:`split_of`), so the two splits can never share a
sequence whatever seeds draw them.

Notation: N sequences, T sequence length.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence, Tuple

import torch

from kvbench.cache import cache_for

IGNORE = -100
DIGITS, KEY, QUERY, FIRST_FILLER = 10, 10, 11, 12
EVAL_BUCKETS = 8  # one sequence in 8 (by hash) is eval's, the other 7 train's
SPLITS = ("train", "eval")

Batch = Tuple[torch.Tensor, torch.Tensor]  # inputs (N, T) int64, targets (N, T) int64


@dataclass(frozen=True)
class Condition:
    """One difficulty: ``mqar`` at (num_pairs, seq_len), or ``passkey`` at (seq_len, distance)."""

    kind: str
    seq_len: int
    num_pairs: Optional[int] = None  # mqar
    distance: Optional[int] = None  # passkey

    @property
    def label(self) -> str:
        if self.kind == "mqar":
            return f"pairs={self.num_pairs} len={self.seq_len}"
        return f"len={self.seq_len} distance={self.distance}"


def mqar(gen: torch.Generator, n: int, vocab_size: int, num_pairs: int, seq_len: int) -> Batch:
    """``n`` MQAR sequences of ``seq_len`` tokens with ``num_pairs`` pairs, each key queried once."""
    half = vocab_size // 2
    if not 1 <= num_pairs <= half - 1:
        raise ValueError(f"num_pairs={num_pairs}: needs 1..{half - 1} distinct keys (vocab_size={vocab_size})")
    if seq_len < 3 * num_pairs:
        raise ValueError(f"seq_len={seq_len}: {num_pairs} pairs and their queries need {3 * num_pairs}")
    # distinct keys: the first num_pairs of a random permutation of the key range, per sequence
    keys = torch.rand(n, half - 1, generator=gen).argsort(dim=1)[:, :num_pairs] + 1  # (N, P)
    values = torch.randint(half, vocab_size, (n, num_pairs), generator=gen)  # (N, P)
    context = torch.stack([keys, values], dim=2).reshape(n, 2 * num_pairs)  # k1 v1 k2 v2 ...
    region = seq_len - 2 * num_pairs
    # each key's query at a distinct random slot of the query region, in random order
    slots = torch.rand(n, region, generator=gen).argsort(dim=1)[:, :num_pairs] + 2 * num_pairs  # (N, P)
    inputs = torch.cat([context, torch.zeros(n, region, dtype=torch.long)], dim=1)  # (N, T)
    inputs.scatter_(1, slots, keys)
    targets = torch.full((n, seq_len), IGNORE, dtype=torch.long)
    targets.scatter_(1, slots, values)
    return inputs, targets


def passkey(gen: torch.Generator, n: int, vocab_size: int, seq_len: int, distance: Optional[int],
            digits: int) -> Batch:
    """``n`` passkey sequences; ``distance`` None draws each sequence's depth uniformly from
    every distance that fits (training), else every sequence has that distance."""
    if vocab_size <= FIRST_FILLER:
        raise ValueError(f"vocab_size={vocab_size}: needs > {FIRST_FILLER} (10 digits, KEY, QUERY, filler)")
    query = seq_len - digits  # position of QUERY; the last input token is digit n - 1
    low, high = digits + 1, query - 1  # distances that fit: KEY at query - 1 - distance >= 0
    if high < low or (distance is not None and not low <= distance <= high):
        raise ValueError(f"distance={distance}: must be in [{low}, {high}] for seq_len={seq_len} and "
                         f"{digits} digits")
    inputs = torch.randint(FIRST_FILLER, vocab_size, (n, seq_len), generator=gen)  # filler
    key = torch.randint(0, DIGITS, (n, digits), generator=gen)  # (N, n)
    if distance is None:
        dist = torch.randint(low, high + 1, (n,), generator=gen)
    else:
        dist = torch.full((n,), distance, dtype=torch.long)
    first = query - dist  # (N,) position of the first digit
    rows = torch.arange(n)[:, None]
    inputs[rows, (first - 1)[:, None]] = KEY
    inputs[rows, first[:, None] + torch.arange(digits)] = key
    inputs[:, query] = QUERY
    inputs[:, query + 1:] = key[:, :-1]
    targets = torch.full((n, seq_len), IGNORE, dtype=torch.long)
    targets[:, query:] = key
    return inputs, targets


def generate(cond: Condition, gen: torch.Generator, n: int, vocab_size: int, digits: int,
             distance: Optional[int] = None) -> Batch:
    """``n`` sequences of ``cond`` (passkey at ``cond.distance``; pass ``distance=None`` through
    :func:`train_stream` to draw depths)."""
    if cond.kind == "mqar":
        return mqar(gen, n, vocab_size, cond.num_pairs, cond.seq_len)
    return passkey(gen, n, vocab_size, cond.seq_len, distance, digits)


def split_of(inputs: torch.Tensor) -> torch.Tensor:
    """(N,) bool, True where a sequence (a row of ``inputs``) belongs to the eval split: a hash
    of its tokens, so the same sequence lands in the same split whichever seed drew it."""
    rows = inputs.to(torch.int64).cpu().numpy()
    return torch.tensor([int.from_bytes(hashlib.blake2b(r.tobytes(), digest_size=8).digest(), "little")
                         % EVAL_BUCKETS == 0 for r in rows], dtype=torch.bool)


def sample(split: str, cond: Condition, gen: torch.Generator, n: int, vocab_size: int, digits: int,
           distance: Optional[int] = None) -> Batch:
    """``n`` sequences of ``cond`` from ``split`` (``train`` | ``eval``): drawn, and kept where
    :func:`split_of` puts them in that split."""
    if split not in SPLITS:
        raise ValueError(f"split={split!r}: must be one of {', '.join(SPLITS)}")
    kept, have = [], 0
    for _ in range(10_000):
        draw = n if split == "train" else n * EVAL_BUCKETS
        x, y = generate(cond, gen, max(8, draw + draw // 4), vocab_size, digits, distance)
        keep = split_of(x) == (split == "eval")
        kept.append((x[keep], y[keep]))
        have += int(keep.sum())
        if have >= n:
            break
    else:  # a vocabulary with almost no distinct sequences
        raise ValueError(f"{cond.label}: fewer than {n} distinct {split} sequences after 10,000 draws")
    x, y = (torch.cat(parts)[:n] for parts in zip(*kept))
    return x, y


def train_stream(conditions: Sequence[Condition], batch_size: int, vocab_size: int, digits: int, seed: int,
                 device: torch.device | str = "cpu") -> Iterator[Batch]:
    """Endless training batches of the train split: each step one condition (drawn uniformly from
    ``conditions``); passkey depths drawn uniformly over all that fit that length."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        cond = conditions[int(torch.randint(len(conditions), (1,), generator=gen))]
        x, y = sample("train", cond, gen, batch_size, vocab_size, digits, None)
        yield x.to(device), y.to(device)


def eval_set(cond: Condition, n: int, vocab_size: int, digits: int, seed: int) -> Batch:
    """The ``n`` held-out sequences of ``cond`` for ``seed``: the same for every variant."""
    gen = torch.Generator().manual_seed(seed)
    return sample("eval", cond, gen, n, vocab_size, digits, cond.distance)


@torch.no_grad()
def accuracy(model, kind: str, inputs: torch.Tensor, targets: torch.Tensor, batch_size: int = 64,
             mask: Optional[torch.Tensor] = None, cache_dtype: str = "auto") -> float:
    """Fraction answered right by the argmax: for ``mqar`` each query counts on its own (the
    Zoology metric), for ``passkey`` a sequence counts when every digit is right. ``mask``
    (T, S) is passed to the model (an ablation: attention cut to the last few positions).
    A quantized ``cache_dtype`` (``cache.dtype``: int8, float8_e4m3fn, nvfp4, ...) scores each batch
    through a static cache of that dtype: every position attends the dequantized K/V of the positions
    before it (quantized per position, so one pass answers as a token-by-token decode through that
    cache would; nvfp4's per-tensor scale is set by that first write, a layer's constant as an engine
    calibrates it); ``auto``: one causal forward, no cache."""
    if mask is not None and cache_dtype != "auto":
        raise ValueError(f"cache_dtype={cache_dtype!r}: a mask ablation runs without a cache")
    was_training = model.training
    model.eval()
    right, total = 0, 0
    for x, y in zip(inputs.split(batch_size), targets.split(batch_size)):
        x, y = x.to(model.device), y.to(model.device)
        cache = None if cache_dtype == "auto" else cache_for(model, "static", len(x), x.shape[1], cache_dtype)
        pred = model(x, cache, mask=mask).argmax(-1)  # (N, T)
        answer = y != IGNORE
        if kind == "passkey":
            right += int(((pred == y) | ~answer).all(dim=1).sum())
            total += len(x)
        else:
            right += int(((pred == y) & answer).sum())
            total += int(answer.sum())
    model.train(was_training)
    return right / total


def chance(cond: Condition, vocab_size: int, digits: int) -> float:
    """Accuracy of a guess that sees no context: one value of ``V - V // 2``, or all n digits."""
    return 1 / (vocab_size - vocab_size // 2) if cond.kind == "mqar" else 10.0 ** -digits


def copy_baseline(cond: Condition, vocab_size: int) -> Optional[float]:
    """MQAR: accuracy of a model that answers each query with one of the P values of its context,
    picked uniformly, without learning which key it belongs to. It is right when it picks the
    queried key's own value (1 in P) or another that is equal: the values are drawn with
    replacement from M = V - V // 2, so each of the other P - 1 is with probability 1 / M, and the
    accuracy is ``(1 + (P - 1) / M) / P``: 0.273, 0.152 and 0.112 at 4, 8 and 12 pairs with V = 64,
    against chance 0.031. None for passkey: its context holds no digit but the passkey's, and
    copying them in order is the task itself."""
    if cond.kind != "mqar":
        return None
    values, pairs = vocab_size - vocab_size // 2, cond.num_pairs
    return (1 + (pairs - 1) / values) / pairs
