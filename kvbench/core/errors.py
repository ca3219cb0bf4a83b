"""Configuration errors: one bounded line that names the key and the value.

:class:`ConfigError` is what every bad value raises (config validation, checkpoint import, the
CLI's checks); :func:`typed` types a composed config against a dataclass schema and turns
OmegaConf's errors into such lines; :func:`config_error_line` does the same for the errors Hydra
raises while composing a command line.
"""

from __future__ import annotations

import copy
import difflib
import functools
import json
import math
import os
import traceback
from dataclasses import fields
from typing import Any, Dict, List, Mapping, Optional, Sequence, Type, TypeVar, get_type_hints

import hydra
from hydra.errors import HydraException, MissingConfigException, OverrideParseException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

# An error line kept in a record or printed is at most this long: a malformed file once produced
# a 28 MB message, copied into every sink.
MAX_ERROR_CHARS = 1000


def one_line(text: Any, limit: int = MAX_ERROR_CHARS) -> str:
    """``text`` as one line of at most ``limit`` characters (plus a note of what was cut):
    whitespace runs become one space and the head of the text is kept."""
    text = str(text)
    head = " ".join(text[: limit * 4].split())  # bounded work whatever the input's size
    if len(head) <= limit and len(text) <= limit * 4:
        return head
    return f"{head[:limit]}… [cut: {len(text):,} characters in all]"


class ConfigError(ValueError):
    """A configuration value is invalid. The message names the key and the value, on one
    bounded line (:func:`one_line`)."""

    def __init__(self, message: Any) -> None:
        super().__init__(one_line(message))


# ---- checks a schema's __post_init__ makes ------------------------------------------------

INT64_MAX = 2**63 - 1


def check(ok: bool, key: str, value, why: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r}: {why}")


def check_numbers(prefix: str, obj) -> None:
    """Every float field finite, every int field within 64 bits: NaN slips through every
    comparison (``nan > 0`` is False, ``nan < 1`` too), infinity through every lower bound,
    and torch overflows on larger ints."""
    for f in fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, float):
            check(math.isfinite(value), f"{prefix}.{f.name}", value, "must be a finite number")
        elif isinstance(value, int) and not isinstance(value, bool):
            check(abs(value) <= INT64_MAX, f"{prefix}.{f.name}", value, "must fit in 64 bits")


def check_choice(key: str, value, choices) -> None:
    check(value in choices, key, value, f"must be one of {', '.join(choices)}")


def check_positive(prefix: str, obj, names) -> None:
    for name in names:
        value = getattr(obj, name)
        check(value >= 1, f"{prefix}.{name}", value, "must be >= 1")


# Keys that were renamed: an override of the old name fails with a one-line hint (the CLI
# reads this table) instead of Hydra's "key not in struct".
RENAMED_KEYS = {
    "model.num_kv_heads": "model.preset_kv_heads (the preset's published KV-head count; the count a "
                          "run uses is attention.num_kv_heads)",
}

# Config groups that were renamed: an override of the old name gets the new one.
RENAMED_GROUPS = {"serving": "scenario"}  # task=capacity's scenarios; "serving" is the workload

T = TypeVar("T")


def typed(schema: Type[T], data: Any, prefix: str = "") -> T:
    """``data`` (a DictConfig or a mapping) as an instance of the dataclass ``schema``.

    A mandatory ``???`` left unset, an unknown key, a value of the wrong type and an
    interpolation that does not resolve are each a :class:`ConfigError` naming the key
    (``prefix`` + its dotted path) and the value; then the dataclasses are built, whose
    ``__post_init__`` checks the values. Keys ``data`` lacks take the schema's defaults."""
    _check_bools(schema, OmegaConf.to_container(data, resolve=False) if isinstance(data, DictConfig) else data,
                 prefix)
    try:
        # Before the merge: merging ``???`` over a default keeps the default (OmegaConf's rule),
        # which once benchmarked a random model for model=llama_dir without model.path.
        missing = sorted(OmegaConf.missing_keys(data))
        node = OmegaConf.merge(_schema_node(schema), data)  # merge copies its first config: the cached one stays
        missing = missing or sorted(OmegaConf.missing_keys(node))  # a group no option filled
        if missing:
            key = prefix + missing[0]
            raise ConfigError(f"{key}=???: a value is required and none was given (add {key}=...)")
        return OmegaConf.to_object(node)
    except OmegaConfBaseException as exc:
        raise ConfigError(_omegaconf_error(exc, schema, data, prefix)) from None


@functools.lru_cache(maxsize=None)
def _schema_node(schema: type) -> DictConfig:
    """``schema``'s defaults as a structured DictConfig: built once per dataclass (~15 ms of reading
    its type hints for BenchConfig, a quarter of typing a job), never changed: typed merges onto a copy."""
    return OmegaConf.structured(schema)


def typed_once(schema: Type[T], values: Mapping[str, Any]) -> T:
    """:func:`typed`, once per distinct ``schema`` and ``values`` (a copy each call): typing through
    OmegaConf costs ~35 ms, and one process reads one config.json many times (a sweep's jobs, a
    capacity search)."""
    key = (schema, json.dumps(values, sort_keys=True, default=repr))
    if key not in _TYPED:
        _TYPED[key] = typed(schema, values)
        if len(_TYPED) > 64:
            _TYPED.pop(next(iter(_TYPED)))
    return copy.deepcopy(_TYPED[key])


_TYPED: Dict[Any, Any] = {}
_ABSENT = object()
_BOOL_WORDS = ("true", "false")


def _check_bools(schema: type, data: Any, prefix: str) -> None:
    """A bool field given anything but true or false is refused: OmegaConf reads any non-zero
    number as true (``attention.sinks=2`` ran with sinks, ``runtime.fidelity=2`` with fidelity), so
    a typo of another key's value would switch a setting silently. Nested dataclasses are walked;
    an interpolation is left to OmegaConf."""
    if not isinstance(data, Mapping) or not hasattr(schema, "__dataclass_fields__"):
        return
    hints = get_type_hints(schema)
    for f in fields(schema):
        if f.name not in data:
            continue
        value, hint = data[f.name], hints.get(f.name)
        inner = [a for a in getattr(hint, "__args__", ()) if a is not type(None)]
        hint = inner[0] if len(inner) == 1 and type(None) in getattr(hint, "__args__", ()) else hint
        if hint is bool:
            words = isinstance(value, str) and (value.lower() in _BOOL_WORDS or value.startswith("${")
                                                 or value == "???")
            if value is not None and not isinstance(value, bool) and not words:
                raise ConfigError(f"{prefix}{f.name}={value!r}: must be true or false")
        elif hasattr(hint, "__dataclass_fields__"):
            _check_bools(hint, value, f"{prefix}{f.name}.")


def _omegaconf_error(exc: OmegaConfBaseException, schema: type, data: Any, prefix: str) -> str:
    """One line for an OmegaConf error: ``key=value: what is wrong`` (a renamed key: its new name;
    an unknown key: the nearest known one)."""
    key = getattr(exc, "full_key", None) or ""
    if prefix + key in RENAMED_KEYS:
        return f"{prefix}{key}: renamed to {RENAMED_KEYS[prefix + key]}"
    # OmegaConf's text goes on with full_key / object_type lines: keep its first line.
    why = str(getattr(exc, "msg", None) or exc).strip().splitlines()[0]
    if "is not a ListConfig, list or tuple" in why:  # OmegaConf's words for a scalar given for a list
        why = "must be a list (brackets: [a,b])"
    parent, _, name = key.rpartition(".")
    if isinstance(exc, ConfigKeyError) and name:
        group = schema
        for part in parent.split(".") if parent else ():
            group = get_type_hints(group).get(part, object)
        known = [f.name for f in fields(group)] if hasattr(group, "__dataclass_fields__") else []
        close = difflib.get_close_matches(name, known, n=1)
        why = (f"unknown key (did you mean {prefix}{parent + '.' if parent else ''}{close[0]}?)" if close
               else f"unknown key ({prefix}{parent or 'the config'} has {', '.join(known)})")
    value = _raw(data, key)
    return f"{prefix}{key}={value!r}: {why}" if value is not _ABSENT else f"{prefix}{key}: {why}"


def _raw(data: Any, key: str) -> Any:
    """The value at dotted ``key`` as the user wrote it (interpolations unresolved)."""
    node = OmegaConf.to_container(data, resolve=False) if isinstance(data, DictConfig) else data
    for part in key.split(".") if key else ():
        if not isinstance(node, Mapping) or part not in node:
            return _ABSENT
        node = node[part]
    return node if key else _ABSENT


def config_error_line(exc: BaseException, names: Sequence[str] = ()) -> str:
    """One line for an error Hydra or OmegaConf raised while composing the config: the key (or
    the override) and what is wrong with it (a renamed key names its new name; a top-level name
    that is no group or key, ``atention=mha``, the nearest of ``names``)."""
    chain: List[BaseException] = []
    node: Optional[BaseException] = exc
    while node is not None and node not in chain:
        chain.append(node)
        node = node.__cause__ or node.__context__
    for err in chain:
        if isinstance(err, MissingConfigException) and err.missing_cfg_file:
            group, _, option = err.missing_cfg_file.rpartition("/")
            return one_line(f"{group}={option}: no such option in {group}/"
                            + (f" (available: {', '.join(err.options)})" if err.options else ""))
        if isinstance(err, OverrideParseException):
            return one_line(f"{err.override}: {err.message}")
        key = getattr(err, "full_key", None)
        if key:
            if key in RENAMED_KEYS:
                return f"{key}: renamed to {RENAMED_KEYS[key]}"
            msg = str(getattr(err, "msg", None) or err).strip().splitlines()[0]
            if "not in struct" in msg and key in RENAMED_GROUPS:
                override = _override_being_composed(exc) or key
                return one_line(f"{override}: the group {key} is renamed to {RENAMED_GROUPS[key]} "
                                f"({RENAMED_GROUPS[key]}{override[len(key):]})")
            if "not in struct" in msg and "." not in key and names:
                close = difflib.get_close_matches(key, list(names), n=1)
                why = (f"did you mean {close[0]}?" if close else f"groups and keys: {', '.join(names)}")
                return one_line(f"{_override_being_composed(exc) or key}: no such config group or key ({why})")
            return one_line(f"{key}: {msg}")
    lines = [line.strip() for err in chain[:1] for line in str(err).split("Config search path")[0].splitlines()
             if line.strip()]
    text = " ".join(lines) or type(exc).__name__
    for old, new in RENAMED_KEYS.items():
        if f"'{old}'" in text:
            return f"{old}: renamed to {new}"
    override = _override_being_composed(exc)
    return one_line(f"{override}: {text}" if override and override not in text else text)


def _override_being_composed(exc: BaseException) -> Optional[str]:
    # Some of Hydra's errors do not say which override they are about (``attention=null``:
    # "Config group override must be a string or a list"); the frame that raised holds it.
    for frame, _ in traceback.walk_tb(exc.__traceback__):
        line = getattr(frame.f_locals.get("override"), "input_line", None)
        if isinstance(line, str):
            return line
    return None


def is_composition_error(exc: BaseException) -> bool:
    """An error in the command line or the config files rather than in kvbench: Hydra's and
    OmegaConf's own types, a ConfigError, and the ValueErrors Hydra's code raises itself."""
    if isinstance(exc, (ConfigError, HydraException, OmegaConfBaseException)):
        return True
    frames = list(traceback.walk_tb(exc.__traceback__))
    return (isinstance(exc, ValueError) and bool(frames)
            and frames[-1][0].f_code.co_filename.startswith(os.path.dirname(hydra.__file__) + os.sep))
