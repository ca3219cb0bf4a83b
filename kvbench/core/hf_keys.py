"""Where each ModelConfig field read from a transformers ``config.json`` came from, and a refusal of
the shape said in the keys of that file.

:func:`kvbench.config.hf.model_fields` records, as it reads each field, the key it read it from
(:class:`Source`); ``ModelConfig``'s checks name kvbench's fields (``model.num_heads``), which a user
who gave a checkpoint never wrote, so :func:`in_file_keys` names the file's keys instead
(``num_attention_heads``), and says so where the file left the value out. A multimodal checkpoint's
language model is read by its text model's reader (:func:`text_model_fields`, :func:`text_model_names`),
a refusal naming each key where the file holds it (``text_config.``). Imports only the errors.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Dict, Mapping, Optional

from kvbench.core.errors import ConfigError

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


# Where a multimodal checkpoint's config.json holds its language model's keys.
TEXT_CONFIG = "text_config."
# Keys a multimodal config.json holds at its top for the whole checkpoint, which its text model's reader reads.
TOP_KEYS = ("architectures", "tie_word_embeddings", "quantization_config")


def text_model_fields(read: Callable[[Mapping[str, Any], str], Dict[str, Any]], cfg: Mapping[str, Any],
                      arch: str) -> Dict[str, Any]:
    """``read`` (a text model's whole-file reader, ``read(cfg, arch)``) of the multimodal config.json
    contents ``cfg``'s ``text_config``, with the top's :data:`TOP_KEYS`; a refusal names each key it
    read there as ``text_config.<key>``."""
    text = cfg.get("text_config")
    if not isinstance(text, Mapping):
        raise ConfigError("missing key 'text_config'" if text is None else
                          f"text_config={text!r}: must be a JSON object (the language model's keys)")
    top = {key: cfg[key] for key in TOP_KEYS if key in cfg}
    try:
        return read({**text, **top}, arch)
    except ConfigError as exc:
        raise ConfigError(nested_keys(str(exc), TEXT_CONFIG, top)) from None


def text_model_names(prefixes: Mapping[str, str]) -> Callable[[str], Optional[str]]:
    """A multimodal checkpoint's tensor name as its text model names it: its prefix among ``prefixes``
    replaced by the one it maps to (``language_model.model.`` -> ``model.``); a name under none of them
    (a vision tower's, its projector's) None: not read."""
    def renamed(name: str) -> Optional[str]:
        for old, new in prefixes.items():
            if name.startswith(old):
                return new + name[len(old):]
        return None
    return renamed
