"""Global layers of a shape of their own, and keys that are values (Gemma 4: transformers'
``Gemma4TextAttention`` with ``per_layer_config`` and ``attention_k_eq_v``).

Gemma 4 gives its global (full-attention) layers other heads than its sliding ones: ``global_head_dim``
(512 against 256) and ``num_global_key_value_heads`` (31B: 4 against 16), rotary embeddings of their own
base over a quarter of the head (``proportional``: the first ``int(p D / 2)`` frequencies of a D-wide
head, the rest zero, so dims i and i + D/2 turn together and the others pass), and on the dense
models one projection that serves as key and value (``attention_k_eq_v``): the value is the
projection RMS-normed without a scale (``v_norm``), the key the same times the key norm's weight,
then rotated. A position of such a layer caches that one tensor, not two: its bytes held and read
halve, a serving page of it is half as wide, and a decode step derives the keys from it again (an
elementwise product and rotation over the positions read, no bytes).

Here (``model.v_norm``: every layer's values normed): ``model.layer_shapes.global_heads`` (a
preset's or checkpoint's; null: the model's own heads) reshapes every full K/V-head layer of a run,
and ``attention.k_eq_v`` (null: ``model.preset_k_eq_v``) makes those layers K=V, with or without a
shape of their own. A layer that reads another's K/V
(``attention.kv_shared_layers``) does not read a K=V donor (its keys need the donor's key norm).

Notation: H query heads, H_kv KV heads, D head_dim, S positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from kvbench.core.errors import ConfigError
from kvbench.layouts import global_heads_hf as hf
from kvbench.layouts.base import Layouts, Limit, elements_line
from kvbench.layouts.kv_heads import KVHeads
from kvbench.layouts.registry import LayerKind, LayerOption, register

SHAPE_KEY = "global_heads"  # model.layer_shapes' key: the global layers' own shape
ROPE_TYPES = ("default", "proportional")
# model.layer_shapes.global_heads: each key, its type and its default (None: the model's own)
SHAPE_FIELDS: Dict[str, Tuple[type, Any]] = {
    "num_kv_heads": (int, None), "head_dim": (int, None), "rope_theta": (float, None),
    "partial_rotary_factor": (float, 1.0), "rope_type": (str, "default")}


@dataclass(frozen=True)
class GlobalHeads(KVHeads):
    """A global K/V-head layer: ``k_eq_v``, its key projection's output (RMS-normed: ``model.v_norm``) is
    cached once and serves as values, the keys derived from it; ``rope_theta`` its rotary base (None:
    the model's); ``proportional``, its rotated frequencies over the whole head (``rotary`` of them
    rotate in pairs i, i + D/2), else the first ``rotary`` dims rotate (kvbench's partial rotary)."""

    k_eq_v: bool = False
    rope_theta: Optional[float] = None
    proportional: bool = False

    kind = "global_heads"

    @property
    def stored(self) -> Tuple[int, Tuple[int, ...]]:
        return self.num_kv_heads, (self.head_dim,) if self.k_eq_v else (self.head_dim, self.head_dim)

    @property
    def rotary_dim(self) -> int:
        # its module turns its own rotary table (its base, its frequencies): the decoder's needs none of it
        return 0

    @property
    def rotary_dims(self) -> int:
        """The dims of a head its rotary embeddings turn (proportional: spread over the whole head)."""
        return self.head_dim if self.rotary is None else self.rotary

    def as_mha(self) -> KVHeads:
        return KVHeads(None, self.num_heads, self.num_heads, self.head_dim)

    def step_flops(self, context: float) -> float:
        # q·k and p·v over every position read: 2 D per position and query head whether or not K is V
        return 2.0 * self.num_heads * 2 * self.head_dim * self.positions_held(context)

    def fields(self) -> Dict[str, Any]:
        return {**super().fields(), **({"k_eq_v": 1} if self.k_eq_v else {})}

    def limits(self, index: Optional[int] = None) -> Tuple[Limit, ...]:
        if not self.k_eq_v:
            return super().limits(index)
        why = (f"{'a' if index is None else f'layer {index},'} K=V layer (attention.k_eq_v=1) derives its keys from "
               "the positions it holds in order")
        return super().limits(index) + (
            Limit("cache.shared", (False, None), f"{why}; a shared prefix is not built for it: use cache.shared=false"),
            Limit("runtime.compile", ("false", "default"), f"{why}; the fixed-shape step is not built for it: "
                  "use false or default"))

    # ---- how inspect describes it ----

    note = ("global layers of their own heads; K=V: a global position caches one tensor, the keys are the values "
            "times the key norm's weight, rotated when read")

    @property
    def step_note(self) -> str:
        """What a decode step moves beyond the bytes held (compare's record says it beside its figures)."""
        return ("K=V: each step derives the keys from the cached values in one pass (kvbench's "
                "global_heads_attention), writing keys the attention then reads beside the values: about 3x "
                "the held bytes move per position, not 1x; an engine fusing the rotation into the attention's "
                "read of the cache would not write them") if self.k_eq_v else ""

    def table_name(self) -> str:
        return f"global D={self.head_dim}" + (" K=V" if self.k_eq_v else "")

    def in_words(self) -> str:
        return f"{self.num_kv_heads} KV heads of {self.head_dim}" + (", K=V" if self.k_eq_v else "")

    def describe_layers(self, layers, attention, seq_len: int, batch_size: int) -> List[str]:
        """Every layer global (the lead attends): its heads and its formula."""
        n = sum(count for _, layer, count in layers.distinct
                if isinstance(layer, GlobalHeads) and layer.kv_source is None)
        tensors = len(self.stored[1])
        return [f"attention {attention.type}: {self.in_words()} in {n} of {len(layers)} layers",
                f"KV cache = {tensors} · layers · kv_heads · head_dim · seq_len · batch · bytes = {tensors} · {n} · "
                f"{self.num_kv_heads} · {self.head_dim} · seq_len · batch · bytes"
                + (" (K=V: one tensor per position)" if self.k_eq_v else ""),
                elements_line(tensors * self.num_kv_heads * self.head_dim, seq_len, batch_size,
                              "K=V" if self.k_eq_v else "K+V")]

    def memory_lines(self, layers, dtype: str, element: int) -> List[str]:
        holding = [(layer, n) for _, layer, n in layers.distinct if layer.state is None and layer.kv_source is None]
        globals_ = sum(n for layer, n in holding if isinstance(layer, GlobalHeads))
        if globals_ == sum(n for _, n in holding):
            return []  # every attending layer is one: describe_layers said it
        tensors = len(self.stored[1])
        per = tensors * self.num_kv_heads * self.head_dim
        return [f"global layers: {globals_} of {len(layers)} hold {tensors} · {self.num_kv_heads} · "
                f"{self.head_dim} = {per:,} elements per position ({per * element:,} B in {dtype})"
                + (", K=V: one tensor serves as keys and values" if self.k_eq_v else "")
                + "; the formula above counts the other layers"]


# ---- its config: model.layer_shapes.global_heads, attention.k_eq_v ----

def global_shape(model) -> Dict[str, Any]:
    """``model.layer_shapes.global_heads`` checked and completed with its defaults ({}: none given); a
    bad key or value refused in one line naming ``model.layer_shapes.global_heads.<key>``."""
    given = (model.layer_shapes or {}).get(SHAPE_KEY)
    if given is None:
        return {}
    prefix = f"model.layer_shapes.{SHAPE_KEY}"
    if not isinstance(given, Mapping):
        raise ConfigError(f"{prefix}={given!r}: must be a mapping of {', '.join(SHAPE_FIELDS)}")
    out = {}
    for key, value in given.items():
        if key == "layers":  # which layers, by index (transformers' per_layer_config keys)
            ok = value is None or not isinstance(value, (str, Mapping)) and isinstance(value, Sequence) and all(
                isinstance(i, int) and not isinstance(i, bool) and 0 <= i for i in value)
            if not ok:
                raise ConfigError(f"{prefix}.layers={value!r}: must list layer indices >= 0, or be null (every full "
                                  "layer of a run)")
            out[key] = None if value is None else sorted(set(value))
            continue
        if key not in SHAPE_FIELDS:
            raise ConfigError(f"{prefix}.{key}={value!r}: not a key of the global layers' shape (one of layers, "
                              f"{', '.join(SHAPE_FIELDS)})")
        kind, _ = SHAPE_FIELDS[key]
        ok = value is None or (isinstance(value, kind) or kind is float and isinstance(value, int)) \
            and (kind is bool or not isinstance(value, bool))
        if not ok or (kind in (int, float) and value is not None and not 0 < value < float("inf")):
            raise ConfigError(f"{prefix}.{key}={value!r}: must be a {'positive ' * (kind is not bool)}{kind.__name__}"
                              + (" or null (the model's own)" if SHAPE_FIELDS[key][1] is None else ""))
        out[key] = value
    out = {"layers": out.get("layers"), **{key: out.get(key, default) if out.get(key) is not None else default
                                            for key, (_, default) in SHAPE_FIELDS.items()}}
    if out["rope_type"] not in ROPE_TYPES:
        raise ConfigError(f"{prefix}.rope_type={out['rope_type']!r}: must be one of {', '.join(ROPE_TYPES)}")
    D = out["head_dim"] or model.head_dim
    if D % 2 or not 0 < out["partial_rotary_factor"] <= 1 or _rotated(D, out["partial_rotary_factor"],
                                                                     out["rope_type"]) < 2:
        raise ConfigError(f"{prefix}.partial_rotary_factor={out['partial_rotary_factor']!r}: must be in (0, 1] and "
                          f"rotate an even number >= 2 of the head_dim={D} dimensions")
    return out


def _rotated(D: int, factor: float, rope_type: str) -> int:
    """The dims of a D-wide head that turn: int(D x factor), or twice int(factor x D / 2) (proportional)."""
    return 2 * int(factor * D // 2) if rope_type == "proportional" else int(D * factor)


def check_model(model) -> None:
    global_shape(model)
    if model.v_norm and not model.qk_norm and (model.preset_k_eq_v or global_shape(model)):
        raise ConfigError("model.v_norm=True: needs model.qk_norm=true beside K=V layers (their keys are the normed "
                          "values times the key norm's weight)")
    if model.preset_k_eq_v not in (0, 1):
        raise ConfigError(f"model.preset_k_eq_v={model.preset_k_eq_v!r}: must be 1 (keys are values) or 0")


def global_layout(layer: KVHeads, model, k_eq_v: bool) -> GlobalHeads:
    """``layer`` (a full K/V-head layer) with the model's global shape and K=V or not."""
    shape = global_shape(model)
    D = shape.get("head_dim") or layer.head_dim
    kv = shape.get("num_kv_heads") or layer.num_kv_heads
    if model.num_heads % kv:
        raise ConfigError(f"model.layer_shapes.{SHAPE_KEY}.num_kv_heads={kv!r}: must divide model.num_heads="
                          f"{model.num_heads}")
    if shape:
        factor, proportional = shape["partial_rotary_factor"], shape["rope_type"] == "proportional"
        rotary, theta = _rotated(D, factor, shape["rope_type"]), shape["rope_theta"]
    else:  # the model's own rotary, as the layer it replaces turns it
        rotary, theta, proportional = layer.rotary_dim, None, False
    return GlobalHeads(None, layer.num_heads, kv, D, layer.sinks, output_gate=layer.output_gate,
                       rotary=None if rotary == D else rotary, k_eq_v=k_eq_v,
                       rope_theta=theta, proportional=proportional)


def remake(layers: Sequence, model, attention) -> Sequence:
    """``layers`` with the model's global layers in its global shape: those its shape's ``layers`` names
    (by index, whatever the run's windows: the weights are theirs), else every full K/V-head layer of
    the run; K=V where the run asks it (:func:`global_layout`). Nothing where neither applies (a model
    of 10^8 layers keeps its tuple; layout objects replaced once each)."""
    k_eq_v, shape = bool(attention.k_eq_v), global_shape(model)
    if not k_eq_v and not shape:
        return layers
    layers, made = Layouts(layers), {}
    if shape.get("layers") is not None:
        chosen = [i for i in shape["layers"] if i < len(layers)]  # past num_layers: no layer (a smaller model)
    else:
        full = {id(layer) for layer in layers.unique() if layer.window is None}
        if len(layers.distinct) == 1:  # every layer alike (counted in C: a model may have 10^8)
            chosen = range(len(layers)) if full and type(layers[0]) is KVHeads else []
        else:
            chosen = [i for i, layer in enumerate(layers) if id(layer) in full]
    shared = attention.kv_shared_layers or 0
    if k_eq_v and shared and chosen and chosen[-1] >= len(layers) - shared:  # chosen ascends
        raise ConfigError(f"attention.k_eq_v=1: with attention.kv_shared_layers={shared} a global layer would read "
                          "a K=V layer's cache, whose keys need its key norm; not built (use attention.k_eq_v=0)")
    out = None
    for i in chosen:
        layer = layers[i]
        if type(layer) is not KVHeads or layer.kv_source is not None:
            continue
        if k_eq_v and layer.window is not None:
            raise ConfigError(f"attention.k_eq_v=1: layer {i} is local (window {layer.window}); a K=V layer keeps "
                              "every position (use attention.k_eq_v=0 or no window there)")
        if id(layer) not in made:
            made[id(layer)] = global_layout(layer, model, k_eq_v)
            if len(chosen) == len(layers) and len(layers.distinct) == 1:
                return (made[id(layer)],) * len(layers)
        out = out or list(layers)
        out[i] = made[id(layer)]
    return layers if out is None else out


K_EQ_V = LayerOption("k_eq_v", " k=v", 0, preset="preset_k_eq_v", values=(1,),
                     kv_heads_only="is a property of K/V-head layers (one projection as keys and values); "
                                   "attention=mla caches a latent")

KIND = register(LayerKind(
    "global_heads", GlobalHeads, module="kvbench.layouts.global_heads_attention:GlobalHeadsAttention",
    title="global K/V-head attention of its own shape", letters={"v": "k_eq_v"}, options=(K_EQ_V,),
    remake=remake, check_model=check_model, hf_architectures=hf.ARCHITECTURES, hf_tied=True,
    hf_model_fields=hf.hf_model_fields,
    hf_names=hf.hf_names,
    examples={"gemma4": ("model=tiny_gemma4",)}))  # K=V global layers beside sliding ones, Gemma 4's residual
