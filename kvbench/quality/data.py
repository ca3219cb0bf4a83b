"""Text for training and perplexity, with nothing to download.

Read as bytes (a byte-level tokenizer, vocab 256), by default the Python standard library's own
``*.py`` sources in a fixed (hashed) order; or through a checkpoint's ``tokenizers`` tokenizer.
The last ``data.val_fraction`` of the stream is validation, so the split never moves. Only
regular files are read (a FIFO would block forever, a device never end), and never more than
``data.max_bytes`` in all: each file is read up to what the cap has left.

Notation: B batch, T sequence length.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, List, Optional, Tuple

import torch

from kvbench.config.train import DataConfig
from kvbench.core.errors import ConfigError
from kvbench.jsonio import path_problem, read_regular

BYTE_VOCAB = 256
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


@dataclass
class TokenData:
    """Token ids of the train and validation text, (N,) int64 each."""

    train: torch.Tensor
    val: torch.Tensor
    vocab_size: int = BYTE_VOCAB
    bytes_per_token: float = 1.0  # of the validation text; 1 for the byte tokenizer
    source: str = ""


def default_corpus_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(path: Optional[str]) -> List[Path]:
    """The files of the corpus in a fixed order.

    A directory: every non-hidden regular file (FIFOs, sockets and devices are left out),
    sorted by relative path (binary files are skipped when read). Default: the standard
    library's ``*.py`` (installed packages excluded), ordered by a hash of the relative path: a
    fixed order in which the ``max_bytes`` cap and the validation tail sample the whole
    library, not its first modules alphabetically (which would put the ``encodings/`` codec
    tables in validation).
    """
    root = Path(path) if path else default_corpus_root()
    if not root.exists():  # a dangling link, a path under a file: said as such
        raise ConfigError(f"data.path={path!r}: {path_problem(root) or 'no such file or directory'}")
    if root.is_file():  # a regular file (or a link to one)
        return [root]
    if not root.is_dir():
        raise ConfigError(f"data.path={path!r}: not a regular file or a directory")
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS and not d.startswith(".")]
        found += [Path(folder, f) for f in files
                  if not f.startswith(".") and (path or f.endswith(".py")) and Path(folder, f).is_file()]

    def key(p: Path) -> str:
        rel = p.relative_to(root).as_posix()
        return rel if path else hashlib.sha256(rel.encode()).hexdigest()

    return sorted(found, key=key)


def read_corpus(cfg: DataConfig) -> bytes:
    """The corpus as one byte string, files joined in order, at most ``data.max_bytes``."""
    parts, total = [], 0
    for f in corpus_files(cfg.path):
        left = None if cfg.max_bytes is None else cfg.max_bytes - total
        try:
            blob = read_regular(f, left)
        except OSError as exc:  # unreadable, or no longer a regular file since it was listed
            raise ConfigError(f"data.path={cfg.path!r}: cannot read {f} ({exc.strerror})") from None
        if b"\x00" in blob[:4096]:
            continue  # binary
        parts.append(blob)
        total += len(blob)
        if left is not None and len(blob) >= left:
            break
    text = b"".join(parts)
    if not text:
        raise ConfigError(f"data.path={cfg.path!r}: no text found")
    return text


def _split(ids: torch.Tensor, val_fraction: float) -> Tuple[torch.Tensor, torch.Tensor]:
    cut = int(len(ids) * (1 - val_fraction))
    return ids[:cut], ids[cut:]


def byte_data(cfg: DataConfig) -> TokenData:
    """The corpus as byte ids, the last ``val_fraction`` of the stream held out."""
    text = read_corpus(cfg)
    ids = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    train, val = _split(ids, cfg.val_fraction)
    return TokenData(train, val, BYTE_VOCAB, 1.0, cfg.path or str(default_corpus_root()))


def tokenized_data(cfg: DataConfig, tokenizer) -> TokenData:
    """The corpus through a ``tokenizers.Tokenizer``; the split is on characters."""
    text = read_corpus(cfg).decode("utf-8", errors="replace")
    cut = int(len(text) * (1 - cfg.val_fraction))

    def encode(s: str) -> torch.Tensor:
        return torch.tensor(tokenizer.encode(s, add_special_tokens=False).ids, dtype=torch.long)

    train, val = encode(text[:cut]), encode(text[cut:])
    return TokenData(train, val, tokenizer.get_vocab_size(),
                     len(text[cut:].encode("utf-8")) / max(len(val), 1),
                     cfg.path or str(default_corpus_root()))


def batches(tokens: torch.Tensor, batch_size: int, seq_len: int, seed: int = 0,
            device: torch.device | str = "cpu") -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
    """Endless random slices: (inputs, next-token targets), each (B, T), from a seeded generator."""
    need_tokens(tokens, seq_len, "train")
    gen = torch.Generator().manual_seed(seed)
    offsets = torch.arange(seq_len + 1)
    while True:
        starts = torch.randint(0, len(tokens) - seq_len, (batch_size,), generator=gen)
        chunk = tokens[starts[:, None] + offsets].to(device)  # (B, T + 1)
        yield chunk[:, :-1], chunk[:, 1:]


def eval_starts(num_tokens: int, seq_len: int, count: int) -> torch.Tensor:
    """Start offsets of ``count`` validation slices of ``seq_len + 1`` tokens, spread evenly over the
    split: every model sees the same."""
    last = num_tokens - seq_len - 1
    return torch.linspace(0, last, count).round().long().unique()


def need_tokens(tokens: torch.Tensor, seq_len: int, split: str) -> None:
    if len(tokens) <= seq_len:
        raise ConfigError(f"train.seq_len={seq_len}: the {split} split has only {len(tokens)} tokens "
                          "(use more data or a shorter train.seq_len / other data.val_fraction)")
