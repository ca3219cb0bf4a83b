"""Token ids of a conversation file's text (``workload.sharegpt``): the checkpoint's own tokenizer
when the run's model is a checkpoint directory with a ``tokenizer.json`` (``model.path``; read by
transformers' ``AutoTokenizer``, local files only, no special tokens added), else a byte tokenizer
(one token per UTF-8 byte, the ids the bytes). Either way a message's ids are taken modulo the
model's vocabulary where they are used (:func:`kvbench.serving.conversations.message_tokens`).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Callable, Optional, Sequence

from kvbench.hf_weights import reading

Encode = Callable[[str], Sequence[int]]
BYTES = "bytes (UTF-8, one token per byte)"


def byte_ids(text: str) -> bytes:
    """The byte tokenizer: one id per UTF-8 byte (the bytes themselves)."""
    return text.encode("utf-8")


@lru_cache(maxsize=4)  # a rate search plans its conversations once per probe: the tokenizer is read once
def checkpoint_encoder(path: Optional[str]) -> Optional[Encode]:
    """The tokenizer of the checkpoint directory ``path`` as an encoder, or None where it has no
    ``tokenizer.json`` (or there is no checkpoint); one that cannot be read is one line naming it
    (:class:`~kvbench.hf_weights.CheckpointError`)."""
    if not path or not (Path(path) / "tokenizer.json").is_file():
        return None
    from transformers import AutoTokenizer  # only a run that tokenizes a checkpoint's text pays for the import

    tokenizer = reading(Path(path) / "tokenizer.json", "tokenizer (transformers' AutoTokenizer)",
                        lambda: AutoTokenizer.from_pretrained(path, local_files_only=True))
    return lambda text: tuple(tokenizer.encode(text, add_special_tokens=False))


def tokenizer_name(path: Optional[str]) -> str:
    """How a conversation file's text becomes tokens for a model at ``path``, for the record."""
    return f"{Path(path) / 'tokenizer.json'} (AutoTokenizer)" if checkpoint_encoder(path) else BYTES
