"""KV-head layers: MHA, GQA or MQA purely by ``num_kv_heads``; optionally a sliding window,
learned attention sinks, an output gate and rotary embeddings over part of each head.

Query head h reads KV head h // G (contiguous groups, the Llama-checkpoint convention), G = H / H_kv.
Sinks (GPT-OSS): one learned logit per query head joins every softmax as a column with no value,
so a head can put weight on "nothing"; they cost no cache.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Dict, List, Optional, Tuple

from kvbench.core.dtypes import CACHE_DTYPE_BYTES, SCALE_BYTES
from kvbench.layouts import llama4
from kvbench.layouts.base import LayerLayout, elements_line, fp4_bytes_lines
from kvbench.layouts.chunked import CHUNK, Chunked
from kvbench.layouts.pages import positions_spec
from kvbench.layouts.registry import LayerKind, register


def kv_group_map(num_heads: int, num_kv_heads: int) -> List[int]:
    """KV head read by each query head: ``map[h] = h // (num_heads // num_kv_heads)``."""
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"num_kv_heads={num_kv_heads} must divide num_heads={num_heads}")
    group = num_heads // num_kv_heads
    return [h // group for h in range(num_heads)]


def describe_kv_groups(num_heads: int, num_kv_heads: int) -> str:
    """The head→group map as text, one line per KV head: ``query heads 0-3 → KV head 0``."""
    mapping = kv_group_map(num_heads, num_kv_heads)
    lines = []
    for kv in range(num_kv_heads):
        heads = [h for h, g in enumerate(mapping) if g == kv]
        span = f"heads {heads[0]}-{heads[-1]}" if len(heads) > 1 else f"head {heads[0]}"
        lines.append(f"query {span} → KV head {kv}")
    return "\n".join(lines)


@dataclass(frozen=True)
class KVHeads(LayerLayout):
    """A layer of ``num_kv_heads`` K and V heads of ``head_dim`` each."""

    num_heads: int = 1
    num_kv_heads: int = 1
    head_dim: int = 2
    sinks: bool = False
    v_head_dim: Optional[int] = None  # values of another width than keys (an MLA model's heads as MHA)
    # Qwen3.5 / Qwen3-Next: a sigmoid output gate per head from the query projection, and rotary on the
    # first ``rotary`` dims only; neither changes what is cached or read.
    output_gate: bool = False
    rotary: Optional[int] = None  # None: every dimension of the head

    kind = "kv_heads"
    reads_shared_kv = True

    @property
    def stored(self) -> Tuple[int, Tuple[int, ...]]:
        return self.num_kv_heads, (self.head_dim, self.head_dim if self.v_head_dim is None else self.v_head_dim)

    def as_mha(self) -> "KVHeads":
        return replace(self, num_kv_heads=self.num_heads, window=None, sinks=False, kv_source=None)

    def page_spec(self, element: int, cache_dtype: str = "auto"):
        """What a serving store keeps of a sequence here: positions in blocks, a window's ring
        (:mod:`kvbench.layouts.pages`), or nothing where the layer reads another's K/V."""
        return positions_spec(self, element, cache_dtype)

    def shard(self, ranks: int) -> "KVHeads":
        # each rank's query heads read whole K/V heads: 1 / ranks of them, or one replicated
        return replace(self, num_heads=self.num_heads // ranks, num_kv_heads=max(1, self.num_kv_heads // ranks))

    @property
    def rotary_dim(self) -> int:
        return self.head_dim if self.rotary is None else self.rotary

    def step_flops(self, context: float) -> float:
        # a multiply-add per element of each K and V vector read, for every query head
        return 2.0 * self.num_heads * sum(self.stored[1]) * self.positions_held(context)

    def fields(self) -> Dict[str, Any]:
        return {"num_kv_heads": self.num_kv_heads, **super().fields(), **({"sinks": True} if self.sinks else {})}

    # ---- how inspect describes it ----

    def in_words(self) -> str:
        return f"{self.num_kv_heads} KV heads"

    def describe_layers(self, layers, attention, seq_len: int, batch_size: int) -> List[str]:
        L, H, kv, d = len(layers), self.num_heads, self.num_kv_heads, self.head_dim
        attending = sum(layer.state is None for layer in layers)  # the others hold a constant state instead
        # layers of another shape (a model's global layers of their own: kvbench.layouts.global_heads) say theirs
        mine = [(layer, n) for _, layer, n in layers.distinct if layer.state is None and layer.stored == self.stored]
        own, shared = sum(n for _, n in mine), sum(n for layer, n in mine if layer.kv_source is not None)
        local = sum(w is not None for w in layers.windows)
        recurrent = next((layer for layer in layers if layer.state is not None), None)
        linear = "" if recurrent is None else f"; {L - attending} of {L} layers {recurrent.in_words()}"
        sinks = sum(bool(getattr(layer, "sinks", False)) for layer in layers)  # a logit per query head, not cached
        span = "chunk" if any(isinstance(layer, Chunked) for layer in layers.unique()) else "window"
        nope = sum(layer.state is None and not layer.rotary_dim for layer in layers)  # Llama 4's global layers
        return [
            f"attention {attention.type}: {kv} KV heads, G = {H // kv} query heads per KV head"
            + (f"; {span} {layers.smallest_window()} in {local} of {L} layers" if local else "") + linear
            + (f"; no rotary embeddings in {nope} of {L} layers" if nope and nope < L else "")
            + (f"; learned attention sinks in {sinks} of {L} layers (a logit per query head, nothing cached)"
               if sinks else ""),
            "",
            "head → KV group map:",
            describe_kv_groups(H, kv),
            "",
            f"KV cache = 2 · layers · kv_heads · head_dim · seq_len · batch · bytes "
            f"= 2 · {own - shared} · {kv} · {d} · seq_len · batch · bytes"
            + (f" (the {shared} of {L} layers that read an earlier layer's K/V hold none)" if shared else "")
            + (" before the windows fill (then a local layer holds W of the seq_len positions)" if local else "")
            + (" (the attention layers; the others hold a state per sequence)" if linear else "")
            + (f" (the {attending - own} layers of another shape: below)" if own < attending else ""),
            elements_line(2 * kv * d, seq_len, batch_size),
            *([f"cache.dtype {' / '.join(CACHE_DTYPE_BYTES)}: bytes = 1 per element + a {SCALE_BYTES}-byte scale per "
               f"(sequence, KV head, position), K and V each"] if layers.accepts({"cache.dtype": "int8"}) else []),
            *fp4_bytes_lines(layers),
        ]


@dataclass(frozen=True)
class ChunkedKVHeads(Chunked, KVHeads):
    """A K/V-head layer attending within chunks of ``window`` = C (:mod:`kvbench.layouts.chunked`)."""


def build(model, attention, window: Optional[int]) -> KVHeads:
    """A layer of ``model`` (a ModelConfig) under a resolved ``attention``: its K/V heads, sinks, output
    gate and the part of each head that rotates; a local layer of a chunked run attends in chunks."""
    rotary = None if model.rotary_dim == model.head_dim else model.rotary_dim
    layout = ChunkedKVHeads if window and getattr(attention, "chunk", None) else KVHeads
    return layout(window, model.num_heads, attention.num_kv_heads, model.head_dim, bool(attention.sinks),
                  output_gate=model.attn_output_gate, rotary=rotary)


KIND = register(LayerKind(
    "kv_heads", KVHeads, module="kvbench.layouts.kv_heads_attention:KVHeadsAttention",
    layer_types=("sliding_attention", "full_attention"), attention_types=("mha", "gqa", "mqa"),
    title="K/V-head attention", build=build, options=(CHUNK,),
    # Llama 4's whole config.json: its chunked and NoPE layers are K/V-head layers (kvbench.layouts.llama4)
    hf_architectures=llama4.ARCHITECTURES, hf_model_fields=llama4.hf_model_fields, hf_names=llama4.hf_names,
    examples={"mha": ("model=tiny",), "gqa": ("model=tiny", "attention=gqa", "attention.num_kv_heads=2"),
              "mqa": ("model=tiny", "attention=mqa"),
              "window": ("model=tiny", "attention=gqa", "attention.num_kv_heads=2", "attention.window=8"),
              "sinks": ("model=tiny", "attention.sinks=true"),
              "chunked": ("model=tiny", "attention=gqa", "attention.num_kv_heads=2", "attention.chunk=8"),
              "kv_shared": ("model=tiny", "model.num_layers=3", "attention.kv_shared_layers=1")},
    # Llama 4's pattern: a chunked layer with its queries and keys L2-normed, a global NoPE one with its query
    # temperature (a floor_scale of 4 positions, so that it varies within a test's few)
    decode_examples={"llama4": ("model=tiny", "attention=gqa", "attention.num_kv_heads=2", "model.preset_chunk=4",
                                "model.preset_global_every=2",
                                "+model.nope={layers:[1],floor_scale:4,attn_scale:0.5}")}))
