"""Where each ModelConfig field read from a transformers ``config.json`` came from, and a refusal of
the shape said in the keys of that file.

:func:`kvbench.config.hf.model_fields` records, as it reads each field, the key it read it from
(:class:`Source`); ``ModelConfig``'s checks name kvbench's fields (``model.num_heads``), which a user
who gave a checkpoint never wrote, so :func:`in_file_keys` names the file's keys instead
(``num_attention_heads``), and says so where the file left the value out. Imports nothing of kvbench's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Dict, Mapping

# A kvbench field named in a check's message: model.<field>, or a nested one (model.preset_mla.kv_lora_rank).
_MENTION = re.compile(r"(?<![\w.])model\.(\w+(?:\.\w+)?)")
DEFAULT = "the default"  # what a value is when config.json leaves its key out and nothing else is said


@dataclass(frozen=True)
class Source:
    """The config.json key a field's value came from (nested ones dotted: ``rope_scaling.factor``,
    ``text_config.num_attention_heads``), or an expression of keys (``qk_nope_head_dim +
    qk_rope_head_dim``). ``unset``: empty when the file sets the value; else how it was found
    instead (:data:`DEFAULT`, ``hidden_size / num_attention_heads``), which a refusal says."""

    key: str
    unset: str = ""


def file_sources(keys: Mapping[str, Any], given: Mapping[str, Any], nested: str = "") -> Dict[str, Source]:
    """Each field's :class:`Source` from ``keys`` (field -> the key read, or a Source for a value found
    another way): a key ``given`` (the file's contents) does not set gave :data:`DEFAULT`. ``nested``:
    where in the file ``given`` is (``text_config.``)."""
    return {field: Source(nested + key.key, key.unset) if isinstance(key, Source)
            else Source(nested + key, "" if is_set(given, key) else DEFAULT) for field, key in keys.items()}


def is_set(cfg: Mapping[str, Any], key: str) -> bool:
    """Whether the dotted ``key`` holds a value (not null) in the config.json contents ``cfg``."""
    node: Any = cfg
    for part in key.split("."):
        if not isinstance(node, Mapping) or node.get(part) is None:
            return False
        node = node[part]
    return True


def in_file_keys(message: str, sources: Mapping[str, Source]) -> str:
    """``message`` (a ModelConfig refusal) with each ``model.<field>`` that ``sources`` holds named
    by its config.json key, and a note for each of those the file leaves unset; fields without a
    source (a value the user passed, kvbench's own default) keep kvbench's key."""
    notes = []

    def name(match: re.Match) -> str:
        source = sources.get(match.group(1))
        if source is None:
            return match.group(0)
        note = f"config.json sets no {source.key}: {source.unset}"
        if source.unset and note not in notes:
            notes.append(note)
        return source.key

    return "; ".join([_MENTION.sub(name, message), *notes])


# A key a refusal names, dotted where it is nested: ``key=value``, or ``missing key 'key'``.
_KEY = re.compile(r"(?<![\w.])(?:(\w+(?:\.\w+)*)(?==[^=])|(?<=missing key ')(\w+(?:\.\w+)*)(?='))")


def nested_keys(message: str, nested: str, top: Mapping[str, Any]) -> str:
    """``message`` (a refusal of keys read at ``nested`` in the file, ``text_config.``) with each
    key it names under ``nested``, but those of the file's top level ``top``."""
    return _KEY.sub(lambda m: m.group(0) if m.group(0).split(".")[0] in top else nested + m.group(0), message)
