"""A value of a transformers ``config.json``, checked against its JSON type where it is read
(:func:`get`): OmegaConf, which types the fields afterwards, would convert ``"32"`` silently and name
only its own key. Used by :mod:`kvbench.config.hf` and by each layer kind's ``hf_fields`` hook (in its
home under :mod:`kvbench.layouts`), so both name the file's key alike."""

from __future__ import annotations

from typing import Any, Mapping

from kvbench.core.errors import ConfigError

# JSON types of the values read from a config.json (a bool is not a number, as JSON says).
KINDS = {
    "int": (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
    "number": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "a number"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "list": (lambda v: isinstance(v, list), "a list"),
    "object": (lambda v: isinstance(v, Mapping), "a JSON object"),
}
REQUIRED = object()  # get()'s default for a key the file must hold


def get(cfg: Mapping[str, Any], key: str, kind: str, default: Any = None, prefix: str = "") -> Any:
    """``cfg[key]`` checked to be of ``kind`` (:data:`KINDS`); ``default`` when the key is absent
    or null (transformers' reading), a ConfigError naming ``prefix + key`` when it is required."""
    value = cfg.get(key)
    if value is None:
        if default is REQUIRED:
            raise ConfigError(f"missing key {prefix + key!r}")
        return default
    ok, what = KINDS[kind]
    if not ok(value):
        raise ConfigError(f"{prefix}{key}={value!r}: must be {what}")
    return value
