"""Conversation files as turns: a ShareGPT-style JSON, or a CSV / JSONL of turns with times.

- **ShareGPT** (``workload.sharegpt``): a JSON list of ``{"conversations": [{"from": "human",
  "value": "..."}, {"from": "gpt", "value": "..."}, ...]}``. A turn is a human message and the gpt
  answer after it (``user`` / ``assistant`` are read as the same roles); a leading ``system``
  message is part of the first turn's message; a last human message with no answer is not a turn.
  Lengths are the text's tokens under the checkpoint's own tokenizer when the model is a checkpoint
  directory with a tokenizer.json, else its UTF-8 bytes (a byte tokenizer: one token per byte):
  :mod:`kvbench.serving.tokenize`. The file has no times: its conversations arrive at
  ``workload.rate``.
- **Turns** (``workload.arrival=trace``, ``workload.trace``): JSONL (an object a line) or CSV with a
  header, columns ``conversation`` (any id), ``turn`` (0, 1, 2 ... in file order within a
  conversation), ``arrival_s`` (required on turn 0: seconds from the run's start; on a later turn
  optional, the earliest it is sent), ``user_len``, ``output_len`` and optional ``think_s`` (the
  least time after the previous answer; 0 when absent: the trace's times are the ones that count).

Every problem is one :class:`~kvbench.core.errors.ConfigError` naming the key, the file, the line
and the field.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from kvbench.config.serving import MAX_REQUESTS, MAX_SPAN_S
from kvbench.core.errors import ConfigError, one_line
from kvbench.serving.table_files import number, read_text, table_rows
from kvbench.serving.tokenize import Encode, byte_ids

MAX_FILE_BYTES = 64 * 2**20  # as a single-turn trace's (serving/arrivals.py)
MAX_TURNS = MAX_REQUESTS  # more than a record can hold (config.serving)
USER_ROLES, ANSWER_ROLES = ("human", "user"), ("gpt", "assistant")
TURN_COLUMNS = ("conversation", "turn", "user_len", "output_len")
_WS = re.compile(r"\s*")


@dataclass(frozen=True)
class TurnSpec:
    """One turn as a file or the config gives it: the new message's and the answer's lengths;
    ``think_s`` after the previous answer (None: drawn from ``workload.think``); ``arrival_s`` the
    earliest it is sent (turn 0: when its conversation arrives); ``text``: the message's token ids
    (a file's text, tokenized: its UTF-8 bytes under the byte tokenizer)."""

    user_len: int
    output_len: int
    think_s: Optional[float] = None
    arrival_s: Optional[float] = None
    text: Optional[Sequence[int]] = None


# ---- ShareGPT ----------------------------------------------------------------------------------


def _json_items(text: str, key: str) -> List[Tuple[int, Any]]:
    """The items of the JSON list ``text``, each with the line it starts on (one pass: a file of
    64 MiB is read in linear time)."""
    decoder, items = json.JSONDecoder(), []
    line, seen = 1, 0  # the line of offset ``seen``

    def line_of(i: int) -> int:
        nonlocal line, seen
        line, seen = line + text.count("\n", seen, i), i
        return line

    i = _WS.match(text, 0).end()
    try:
        if not text.startswith("[", i):
            raise ConfigError(f"{key}: line {line_of(i)}: a JSON list of conversations is expected")
        i = _WS.match(text, i + 1).end()
        while not (text.startswith("]", i) and not items):
            item, end = decoder.raw_decode(text, i)
            items.append((line_of(i), item))
            if len(items) > MAX_TURNS:
                raise ConfigError(f"{key}: more than {MAX_TURNS:,} conversations")
            i = _WS.match(text, end).end()
            if text.startswith("]", i):
                break
            if not text.startswith(",", i):
                raise ConfigError(f"{key}: line {line_of(i)}: ',' or ']' expected after a conversation")
            i = _WS.match(text, i + 1).end()
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{key}: line {exc.lineno}: not JSON ({exc.msg})") from None
    except RecursionError:
        raise ConfigError(f"{key}: line {line_of(i)}: nested too deeply to parse") from None
    after = _WS.match(text, i + 1).end()
    if after < len(text):
        raise ConfigError(f"{key}: line {line_of(after)}: text after the list")
    return items


def read_sharegpt(path: str, encode: Encode = byte_ids) -> List[List[TurnSpec]]:
    """The conversations of a ShareGPT-style JSON file, in file order (see the module's docstring),
    their text as ``encode`` tokenizes it."""
    key = f"workload.sharegpt={path!r}"
    items = _json_items(read_text(key, path, MAX_FILE_BYTES, "a conversation file"), key)
    if not items:
        raise ConfigError(f"{key}: holds no conversations")
    chats, total = [], 0
    for n, (line, item) in enumerate(items):
        where = f"{key}: line {line} (conversation {n})"
        messages = item.get("conversations") if isinstance(item, dict) else None
        if not isinstance(messages, list):
            raise ConfigError(f"{where}: conversations: a list of messages is expected, got "
                              f"{one_line(repr(messages if isinstance(item, dict) else item), 60)}")
        turns: List[TurnSpec] = []
        system, pending = "", None
        for j, m in enumerate(messages):
            field = f"conversations[{j}]"
            if not isinstance(m, dict):
                raise ConfigError(f"{where}: {field}: an object with from and value is expected")
            role, value = m.get("from"), m.get("value")
            if not isinstance(value, str):
                raise ConfigError(f"{where}: {field}.value={one_line(repr(value), 60)}: a string is expected")
            if role == "system" and j == 0:
                system = value
            elif role in USER_ROLES and pending is None:
                # tokenized apart: the system message's last word never merges with the message's first
                pending = encode(system) + encode(value) if system else encode(value)
                system = ""
                if not pending:
                    raise ConfigError(f"{where}: {field}.value={one_line(repr(value), 60)}: a message of no tokens")
            elif role in ANSWER_ROLES and pending is not None:
                answer = len(encode(value))
                if answer == 0:
                    raise ConfigError(f"{where}: {field}.value={one_line(repr(value), 60)}: an answer of no tokens")
                turns.append(TurnSpec(len(pending), answer, text=pending))
                pending = None
            else:
                expected = "human" if pending is None else "gpt"
                raise ConfigError(f"{where}: {field}.from={one_line(repr(role), 40)}: {expected} expected "
                                  "(turns alternate human, gpt; a system message only first)")
        if not turns:
            raise ConfigError(f"{where}: conversations: no human message with a gpt answer")
        total += len(turns)
        if total > MAX_TURNS:
            raise ConfigError(f"{key}: more than {MAX_TURNS:,} turns")
        chats.append(turns)
    return chats


# ---- a CSV / JSONL of turns ----------------------------------------------------------------------


def read_turns(path: str) -> List[List[TurnSpec]]:
    """The conversations of a CSV / JSONL file of turns, in order of their first row."""
    key = f"workload.trace={path!r}"
    rows = table_rows(read_text(key, path, MAX_FILE_BYTES, "a conversation file"), key, TURN_COLUMNS + ("arrival_s",),
                      "conversation, turn, arrival_s, user_len, output_len, optional think_s", MAX_TURNS, "turns")
    if not rows:
        raise ConfigError(f"{key}: holds no turns")
    chats: Dict[str, List[TurnSpec]] = {}
    for line, row in rows:
        where = f"{key}: line {line}"
        if "conversation" not in row:
            raise ConfigError(f"{where}: no conversation")
        conversation = one_line(str(row["conversation"]), 60)
        if isinstance(row["conversation"], (dict, list)):
            raise ConfigError(f"{where}: conversation={conversation}: an id (a number or a name) is expected")
        turns = chats.setdefault(conversation, [])
        turn = number(row, "turn", where, int, 0)
        if turn != len(turns):
            raise ConfigError(f"{where}: turn={turn}: conversation {conversation!r} expects turn {len(turns)} next "
                              "(turns count 0, 1, 2 ... in file order)")
        arrival = number(row, "arrival_s", where, float, 0, optional=turn > 0, longest_s=MAX_SPAN_S)
        think = number(row, "think_s", where, float, 0, optional=True, longest_s=MAX_SPAN_S) or 0.0
        turns.append(TurnSpec(number(row, "user_len", where, int, 1), number(row, "output_len", where, int, 1),
                              think, arrival))
    return list(chats.values())
