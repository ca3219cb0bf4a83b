"""How numbers are written for people: bytes in binary units."""

from __future__ import annotations

from typing import Optional


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
