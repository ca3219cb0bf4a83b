"""How numbers are written for people: bytes in binary units, lists of layer indices."""

from __future__ import annotations

from typing import Optional, Sequence


def human_bytes(n: Optional[float]) -> str:
    """``1536`` -> ``1.50 KiB``; None -> ``-``."""
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def count(n: int, noun: str) -> str:
    """``1 job``, ``2 jobs``: a count and its noun, singular for one."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def index_text(indices: Sequence[int]) -> str:
    """Layer indices in a few words: all of up to 32, else the first ones, a step and the last."""
    if len(indices) <= 32:
        return ", ".join(map(str, indices))
    steps = {b - a for a, b in zip(indices, indices[1:])}
    every = f" (every {steps.pop()})" if len(steps) == 1 else ""
    return f"{', '.join(map(str, indices[:3]))}, …, {indices[-1]}{every}"
