"""Markdown from records' values: a value a user wrote (a config value, an error, a directory's
name) is shown as the text it is, never as markup (``[l](javascript:...)`` is text, not a live link).
A bracket that opens or closes nothing (``[9.8, 10.6]``) is left as it is."""

from __future__ import annotations

import html
from typing import Any

# Backslash first: the escapes that follow add backslashes of their own. Without "](" or "][" no
# inline or reference link (nor image) can close; a bare "[ref]" links only to a definition, which
# a value inside a line cannot make.
_ESCAPES = (("\\", "\\\\"), ("](", "\\]("), ("][", "\\]["), ("|", "\\|"))


def md_text(value: Any) -> str:
    """``value`` as Markdown that renders it literally, on one line."""
    text = html.escape(str(value), quote=False)
    for raw, escaped in _ESCAPES:
        text = text.replace(raw, escaped)
    return text.replace("\r\n", " ").replace("\n", " ").replace("\r", " ")
