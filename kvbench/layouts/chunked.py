"""Chunked attention (Llama 4's local layers, ``attention.chunk``): a layer that attends only within
its chunk of C positions. A query at position p sees the keys floor(p / C)·C .. p, so the mask resets
at every multiple of C: unlike a sliding window, the first query of a chunk sees only itself and the
last sees C keys. A chunked layer holds between (t mod C) and C positions; its cache drops a chunk's
positions at the boundary (a static cache: a ring of C slots that each chunk fills from slot 0; a
serving store: its blocks freed, :class:`~kvbench.layouts.pages.Chunks`).

A chunked layer is a local layer whose locality is its chunk: the run's window pattern
(``global_every``, ``layer_types``' sliding_attention) says which layers are local, and ``window``
is C on those (:func:`chunk_window`). :class:`Chunked` is the rule as a layout mixin: a kind's
layout class with it first is that kind's layer attending in chunks (``ChunkedKVHeads``).

Notation: C the chunk, p a query's position, t a sequence's length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Dict, List, Optional, Tuple

from kvbench.core.errors import check
from kvbench.layouts.base import LayerLayout, Limit, bytes_cell
from kvbench.layouts.pages import Chunks
from kvbench.layouts.registry import LayerOption, attention_kind

# attention.chunk: C positions per chunk on the local layers (null: the model's own, model.preset_chunk; 0: none)
CHUNK = LayerOption("chunk", " chunk={}", 0, preset="preset_chunk", positions=True, sets_window=True,
                    kv_heads_only="is chunked attention of K/V-head layers (Llama 4's); attention=mla has none")


def chunk_window(attention: Any, model: Any, window: Optional[int]) -> Optional[int]:
    """The window of the local layers of ``attention`` (an AttentionConfig being resolved against ``model``,
    a ModelConfig) whose own window is ``window``: its chunk C (asked, else the model's), a chunk being its
    layers' locality, else ``window``; a kind without chunks (MLA) keeps ``window``. A sliding window of
    another size beside a chunk would make each local layer two things: refused naming ``attention.chunk``."""
    kind = attention_kind(attention.type)
    key, chunk = ("model.preset_chunk", model.preset_chunk) if attention.chunk is None else \
        ("attention.chunk", attention.chunk)
    check(chunk >= 0, key, chunk, "must be >= 1 positions, 0 (none) or null")
    if not chunk or (kind is not None and CHUNK not in kind.options):
        return window
    check(not window or window == chunk, key, chunk,
          f"makes the local layers attend within chunks of {chunk} positions, and attention.window={window} "
          "makes them slide: give one (attention.window=0 with a chunk)")
    return chunk


def live_positions(length: float, chunk: int) -> float:
    """Positions a chunked layer holds once ``length`` are written: those of the chunk holding the last
    one, 1 .. C (none at length 0)."""
    return 0 if length <= 0 else length - chunk * math.floor((length - 1) / chunk)


def average_positions(length: int, chunk: int) -> float:
    """The mean of :func:`live_positions` over lengths 1 .. ``length``: a whole chunk averages (C + 1) / 2."""
    if length <= 0:
        return 0.0
    whole, rest = divmod(int(length), chunk)
    return (whole * chunk * (chunk + 1) / 2 + rest * (rest + 1) / 2) / length


@dataclass(frozen=True)
class Chunked(LayerLayout):
    """The chunk rule over a layer layout whose ``window`` is the chunk C. What it holds is given at its
    worst, C positions once a sequence has one chunk (``positions_held``: what a static cache allocates
    and a capacity must plan for); what a decode step reads, the positions of its own chunk."""

    note = ("chunked attention: a local layer attends within its chunk of C positions (a query at p sees "
            "floor(p/C)·C .. p) and holds between t mod C and C of them; per sequence is its worst case, C")

    @property
    def chunk(self) -> int:
        return self.window

    def unchunked(self) -> LayerLayout:
        """The same layer as its kind's layout without the chunk rule (and without a window)."""
        base = next(c for c in type(self).__mro__[1:] if not issubclass(c, Chunked))
        return base(**{f.name: getattr(self, f.name) for f in fields(self) if f.init and f.name != "window"})

    def sees(self, query: Any, key: Any) -> Any:
        return (key <= query) & (key // self.chunk == query // self.chunk)

    def first_kept(self, length: int) -> int:
        return length // self.chunk * self.chunk

    def read_bytes(self, context: float, element: int, cache_dtype: str = "auto") -> float:
        # a step reads its own chunk's positions: 1 .. C, not the C a ring keeps room for
        return super().read_bytes(live_positions(context, self.chunk), element, cache_dtype)

    def step_flops(self, context: float) -> float:
        return super().step_flops(live_positions(context, self.chunk))

    @property
    def retention(self) -> Tuple[int, ...]:
        return (2, self.chunk)

    def as_mha(self) -> LayerLayout:
        return self.unchunked().as_mha()

    def page_spec(self, element: int, cache_dtype: str = "auto"):
        """A serving store's pages: blocks freed at every chunk boundary (:class:`Chunks`)."""
        per_position = self.bytes_per_position(element, cache_dtype)
        return Chunks(per_position, self.chunk) if per_position else None

    def fields(self) -> Dict[str, Any]:
        return {**super().fields(), "chunk": self.chunk}

    def layers_text(self) -> str:
        return f"layers of chunk {self.chunk}"

    def table_name(self) -> str:
        return f"chunked C={self.chunk}"

    def _window_limits(self) -> Tuple[Limit, ...]:
        C = self.chunk
        return (Limit("cache.impl", ("static", "none"),
                      f"keeps every position; with attention.chunk={C} use cache.impl=static (a ring of C positions "
                      "per chunked layer, refilled from its first slot at each chunk) or none"),
                Limit("runtime.compile", ("false", "default"),
                      f"is not supported with chunked attention (attention.chunk={C}): the fixed-shape step reads a "
                      "context bucket, a chunk's ring is read to its own length; use false or default"),
                # a shared prefix's history counts positions from the prefix's end, and a chunk starts at a
                # multiple of C of the whole sequence's
                Limit("cache.shared", (False, None), f"is not built with chunked attention (attention.chunk={C}): "
                      "a conversation's history after a shared prefix would chunk from the prefix's end; use "
                      "cache.shared=false"))

    def memory_lines(self, layers, dtype: str, element: int) -> List[str]:
        return chunk_lines(layers, dtype, element) + super().memory_lines(layers, dtype, element)


def chunk_lines(layers, dtype: str, element: int) -> List[str]:
    """inspect's lines on the chunked layers of ``layers``: what one sequence holds in them at the worst
    (C positions each) next to the average over its positions, (C + 1) / 2 each."""
    chunked = [layer for layer in layers if isinstance(layer, Chunked)]
    if not chunked:
        return []
    C = chunked[0].chunk
    per_position = sum(layer.bytes_per_position(element) for layer in chunked)
    worst, mean = C * per_position, (C + 1) / 2 * per_position
    return [f"chunked layers ({len(chunked)} of {len(layers)}, C={C}): per sequence at the worst (C positions each) "
            f"{bytes_cell(worst)}, on average over its positions ((C + 1)/2 each) {bytes_cell(mean)} in {dtype}; "
            f"a decode step reads its own chunk's positions, 1 .. C"]
