"""A hook named as ``"package.module:name"``: what lower code asks of higher code without importing it
(a layer kind's torch module, its cache class), imported when first asked for."""

from __future__ import annotations

import importlib
from typing import Any, Callable, Union


def resolve(hook: Union[str, Callable[..., Any]]) -> Any:
    """A hook given as ``"package.module:name"`` (imported when first asked for), or the callable itself."""
    if not isinstance(hook, str):
        return hook
    module, _, name = hook.partition(":")
    return getattr(importlib.import_module(module), name)
