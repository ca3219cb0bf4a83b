"""The files a serving run reads rows from (a trace of requests, a trace of conversation turns):
read whole within a size limit, as JSONL (one object a line) or CSV with a header row, and each
field a checked number. Every problem is one :class:`ConfigError` naming the key, the file and
the line."""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from kvbench.config.serving import duration_text
from kvbench.core.errors import ConfigError, one_line
from kvbench.jsonio import path_problem, read_regular

Rows = List[Tuple[int, Dict[str, Any]]]  # (line, row)


def read_text(key: str, path: str, max_bytes: int, what: str) -> str:
    """The file at ``path`` as text: one that is missing, larger than ``max_bytes`` (``what``
    names the file in that line), unreadable or not UTF-8 is refused."""
    p = Path(path)
    why = path_problem(p)
    if why is not None:
        raise ConfigError(f"{key}: {why}")
    size = p.stat().st_size
    if size > max_bytes:
        raise ConfigError(f"{key}: {size:,} bytes, more than the {max_bytes:,} {what} may have")
    try:
        raw = read_regular(p, max_bytes + 1)
    except OSError as exc:
        raise ConfigError(f"{key}: cannot be read ({exc.strerror or exc})") from None
    try:  # a byte-order mark (spreadsheets write one) is not part of the first column's name
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{key}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def table_rows(text: str, key: str, columns: Sequence[str], columns_text: str, limit: int, unit: str) -> Rows:
    """The rows of ``text``: JSONL when it starts with an object, else CSV whose header must name
    ``columns`` (``columns_text`` lists them for the refusal); more than ``limit`` rows (``unit``)
    are refused."""
    if text.lstrip().startswith("{"):
        return _jsonl_rows(text, key, limit, unit)
    # skipinitialspace: a header written "arrival_s, prompt_len, output_len" names the same columns
    reader = csv.DictReader(io.StringIO(text), skipinitialspace=True)
    rows: Rows = []
    try:
        missing = [c for c in columns if c not in (reader.fieldnames or [])]
        if missing:
            raise ConfigError(f"{key}: the header lacks {', '.join(missing)} (columns: {columns_text})")
        for row in reader:
            rows.append((reader.line_num, {k: v for k, v in row.items() if v not in ("", None)}))
            if len(rows) > limit:
                raise ConfigError(f"{key}: more than {limit:,} {unit}")
    except csv.Error as exc:  # a field past csv's limit, a quote left open
        raise ConfigError(f"{key}: line {max(1, reader.line_num)}: not CSV ({exc})") from None
    return rows


def _jsonl_rows(text: str, key: str, limit: int, unit: str) -> Rows:
    rows: Rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{key}: line {n}: not JSON ({exc.msg})") from None
        except RecursionError:
            raise ConfigError(f"{key}: line {n}: nested too deeply to parse") from None
        if not isinstance(row, dict):
            raise ConfigError(f"{key}: line {n}: a JSON object is expected, got {type(row).__name__}")
        rows.append((n, row))
        if len(rows) > limit:
            raise ConfigError(f"{key}: more than {limit:,} {unit}")
    return rows


def number(row: Dict[str, Any], name: str, where: str, kind, least, optional: bool = False,
           longest_s: Optional[float] = None):
    """``row[name]`` as a finite ``kind`` (int or float) of at least ``least``; None when absent and
    ``optional``. ``longest_s``: a float above it (seconds from the run's start) is refused too."""
    if name not in row:
        if optional:
            return None
        raise ConfigError(f"{where}: no {name}")
    value = row[name]
    shown = one_line(repr(value), 60)
    try:
        if isinstance(value, (bool, list, dict)):  # float(True) is 1.0: a flag is no time, no length
            raise TypeError
        result = float(value) if kind is float else int(str(value))
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: {name}={shown} is not a{'n integer' if kind is int else ' number'}") from None
    if kind is float and not math.isfinite(result):
        raise ConfigError(f"{where}: {name}={shown} must be finite")
    if result < least:
        raise ConfigError(f"{where}: {name}={shown} must be >= {least}")
    if longest_s is not None and kind is float and result > longest_s:  # the scheduler would sleep until it
        raise ConfigError(f"{where}: {name}={shown} is {duration_text(result)}, more than the "
                          f"{duration_text(longest_s)} a serving run may span (seconds from the run's start)")
    return result
