"""A checkpoint's expert tensors as the decoder's stacked expert weights, from the headers first.

Checkpoints store a layer's experts in one of two forms:

- one tensor per expert and projection (Qwen3-MoE, Qwen3-Next, Qwen3.5-MoE, DeepSeek):
  ``layers.L.mlp.experts.E.{gate,up,down}_proj.weight``, (I, C) and (C, I);
- GPT-OSS's stacked and transposed tensors, gate and up interleaved column by column:
  ``layers.L.mlp.experts.gate_up_proj`` (E, C, 2I) and its bias (E, 2I), ``down_proj`` (E, I, C) and
  its bias (E, C); Llama 4's the same without biases, its gate's columns then its up's
  (``layers.L.feed_forward.experts.gate_up_proj``).

:func:`expert_tensors` turns them, by their headers alone, into :class:`Assembled` entries of the
decoder's names (``w_gate_up`` (E, 2I, C): gate rows then up rows; ``w_down`` (E, C, I); the
biases), so every name and shape is checked against config.json before a tensor is read.

Notation: E experts, I an expert's width, C d_model.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional, Tuple

import torch

from kvbench.hf_weights import CheckpointError, StoredTensor

# transformers' names of an MoE layer's other tensors -> the decoder's (a key ending in "." is a
# submodule); the experts' own names pass through to expert_tensors.
MOE_NAMES = {"mlp.gate.e_score_correction_bias": "mlp.correction_bias", "mlp.gate.weight": "mlp.router.weight",
             "mlp.shared_expert_gate.": "mlp.shared_gate.",
             **{f"mlp.{shared}.{p}_proj.": f"mlp.shared.w_{p}." for shared in ("shared_experts", "shared_expert")
                for p in ("gate", "up", "down")}}
_PER_EXPERT = re.compile(r"blocks\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
_FUSED = re.compile(r"blocks\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_bias)?$")
_SHARED = re.compile(r"(blocks\.\d+\.)mlp\.shared\.w_(?:gate|up|down)\.weight$")
_SHARED_GATE = re.compile(r"(blocks\.\d+\.)mlp\.shared_gate\.weight$")


@dataclass(frozen=True)
class Assembled(StoredTensor):
    """A decoder tensor ``build`` makes from stored ``parts`` once read; its header fields are the result's."""

    parts: Tuple[StoredTensor, ...] = ()
    build: Callable[[List[torch.Tensor]], torch.Tensor] = lambda ts: ts[0]


def expert_file_name(name: str, stacked: bool) -> Optional[str]:
    """A layer's stacked expert weight (the decoder's ``mlp.experts.w_gate_up``) as the checkpoint names
    the tensor it starts from (``mlp.experts.0.gate_proj.weight``; GPT-OSS's ``mlp.experts.gate_up_proj``);
    None for another name."""
    match = re.fullmatch(r"mlp\.experts\.(w|b)_(gate_up|up|down)", name)
    if match is None:
        return None
    kind, proj = match.groups()
    if stacked:
        return f"mlp.experts.{proj}_proj" + ("_bias" if kind == "b" else "")
    return f"mlp.experts.0.{'gate' if proj == 'gate_up' else proj}_proj.weight"


def _assembled(key: str, shape: tuple, parts: List[StoredTensor], build) -> Assembled:
    dtypes = sorted({p.dtype for p in parts})
    if len(dtypes) > 1:
        odd = next(p for p in parts if p.dtype != parts[0].dtype)
        raise CheckpointError(f"{parts[0].file.parent}: tensors {parts[0].name} ({parts[0].dtype}) and {odd.name} "
                              f"({odd.dtype}) mix dtypes: one expert's weights are stored unlike another's")
    return Assembled(parts[0].file, parts[0].name, shape, dtypes[0], tuple(parts), build)


def _shape_error(where: Path, tensor: StoredTensor, implied: tuple) -> CheckpointError:
    return CheckpointError(f"{where}: tensor {tensor.name} has shape {tuple(tensor.shape)}, config.json implies "
                           f"{tuple(implied)}")


def expert_tensors(where: Path, model, stored: Mapping[str, StoredTensor]) -> Dict[str, StoredTensor]:
    """``stored`` (decoder names -> headers) with each MoE layer's expert tensors as stacked :class:`Assembled` ones,
    and without the empty tensors of a shared expert 0 wide."""
    moe, C = model.moe, model.d_model
    out = dict(stored)
    if moe is not None and not moe.shared_ffn_dim:
        # n_shared_experts=0 (DeepSeek), shared_expert_intermediate_size=0 (Qwen3-Next, Qwen3.5-MoE): transformers
        # builds a shared expert 0 wide, whose output is 0, and Qwen's gate that scales it; the decoder, which
        # then has no shared expert, holds neither its empty weights nor that gate
        empty = {m.group(1) for k, t in out.items() if (m := _SHARED.match(k)) and 0 in tuple(t.shape)}
        out = {k: t for k, t in out.items() if not (_SHARED.match(k) and 0 in tuple(t.shape))
               and not ((m := _SHARED_GATE.match(k)) and m.group(1) in empty)}
    layers: Dict[int, Dict[tuple, str]] = {}  # layer -> {(expert, projection) or (name, bias): key}
    for key in stored:
        if (m := _PER_EXPERT.match(key)) or (m := _FUSED.match(key)):
            layers.setdefault(int(m.group(1)), {})[m.groups()[1:]] = key
    for layer, found in sorted(layers.items()):
        first = stored[next(iter(found.values()))]
        if moe is None or not moe.sparse(layer):
            raise CheckpointError(f"{where}: tensor {first.name} is an expert of layer {layer}, whose MLP config.json "
                                  "makes dense")
        fused = {p in ("gate_up_proj", "down_proj") for p, *_ in found}
        if len(fused) > 1:
            raise CheckpointError(f"{where}: layer {layer} stores its experts both per expert and stacked "
                                  f"({first.name} ...): which copy is the model's is not defined")
        fused = fused.pop()
        build = _fused if fused else _per_expert
        for key in found.values():
            del out[key]
        out.update(build(where, layer, {k: stored[v] for k, v in found.items()}, moe, C, model.mlp_act == "silu"))
    return out


def _per_expert(where: Path, layer: int, found: Dict[tuple, StoredTensor], moe, C: int,
                gated: bool = True) -> Dict[str, Assembled]:
    E, I = moe.num_experts, moe.expert_ffn_dim  # noqa: E741
    projections = ("gate", "up", "down") if gated else ("up", "down")  # relu2 experts (Nemotron-H): no gate
    template = next(iter(found.values())).name  # a stored name, to name a missing one like it
    implied = {"gate": (I, C), "up": (I, C), "down": (C, I)}
    for (expert, proj), tensor in sorted(found.items()):
        if int(expert) >= E:
            raise CheckpointError(f"{where}: tensor {tensor.name} is expert {expert}, but config.json has {E} "
                                  "routed experts per layer: inconsistent expert counts")
        if proj not in projections:
            raise CheckpointError(f"{where}: tensor {tensor.name}: the experts of config.json have no {proj} "
                                  "projection (model.mlp_act relu2)")
        if tuple(tensor.shape) != implied[proj]:
            raise _shape_error(where, tensor, implied[proj])
    for expert in range(E):
        for proj in projections:
            if (str(expert), proj) not in found:
                name = re.sub(r"experts\.\d+\.\w+_proj", f"experts.{expert}.{proj}_proj", template)
                raise CheckpointError(f"{where}: missing tensor {name} (config.json: {E} routed experts per layer, "
                                      f"layer {layer} is a mixture of experts)")
    part = [[found[(str(e), proj)] for e in range(E)] for proj in projections]
    prefix = f"blocks.{layer}.mlp.experts."
    if not gated:
        return {prefix + "w_up": _assembled(prefix + "w_up", (E, I, C), part[0], torch.stack),
                prefix + "w_down": _assembled(prefix + "w_down", (E, C, I), part[1], torch.stack)}
    return {prefix + "w_gate_up": _assembled(prefix + "w_gate_up", (E, 2 * I, C), part[0] + part[1],
                                             lambda ts: torch.cat([torch.stack(ts[:E]), torch.stack(ts[E:])], 1)),
            prefix + "w_down": _assembled(prefix + "w_down", (E, C, I), part[2], torch.stack)}


def _deinterleave(t: torch.Tensor) -> torch.Tensor:
    # (..., 2I) with gate and up alternating -> (..., 2I) gate then up
    return torch.cat([t[..., ::2], t[..., 1::2]], -1)


def _fused(where: Path, layer: int, found: Dict[tuple, StoredTensor], moe, C: int,
           gated: bool = True) -> Dict[str, Assembled]:
    E, I = moe.num_experts, moe.expert_ffn_dim  # noqa: E741
    if not gated:
        raise CheckpointError(f"{where}: tensor {next(iter(found.values())).name}: stacked gate and up rows, but the "
                              "experts of config.json have no gate (model.mlp_act relu2)")
    bias = "_bias" if moe.expert_bias else None
    stored_shapes = {("gate_up_proj", None): (E, C, 2 * I), ("down_proj", None): (E, I, C),
                     ("gate_up_proj", "_bias"): (E, 2 * I), ("down_proj", "_bias"): (E, C)}
    prefix = f"blocks.{layer}.mlp.experts."
    for (name, suffix), tensor in found.items():
        if suffix and not bias:
            raise CheckpointError(f"{where}: tensor {tensor.name}: the experts of config.json have no biases")
        if tuple(tensor.shape) != stored_shapes[(name, suffix)]:
            if tensor.shape and tensor.shape[0] != E:
                raise CheckpointError(f"{where}: tensor {tensor.name} holds {tensor.shape[0]} experts, config.json "
                                      f"has {E} routed experts per layer: inconsistent expert counts")
            raise _shape_error(where, tensor, stored_shapes[(name, suffix)])
    for key in stored_shapes:
        if key not in found and (key[1] is None or bias):
            stem = next(iter(found.values())).name.rsplit(".", 1)[0]
            raise CheckpointError(f"{where}: missing tensor {stem}.{key[0]}{key[1] or ''} (layer {layer} is a "
                                  "mixture of experts)")
    # GPT-OSS interleaves gate and up columns; Llama 4 (feed_forward.experts) stores the gate's, then up's
    halves = ".feed_forward.experts." in found[("gate_up_proj", None)].name
    gate_up = (lambda t: t) if halves else _deinterleave
    out = {prefix + "w_gate_up": _assembled(prefix + "w_gate_up", (E, 2 * I, C), [found[("gate_up_proj", None)]],
                                            lambda ts: gate_up(ts[0]).transpose(1, 2).contiguous()),
           prefix + "w_down": _assembled(prefix + "w_down", (E, C, I), [found[("down_proj", None)]],
                                         lambda ts: ts[0].transpose(1, 2).contiguous())}
    if bias:
        out[prefix + "b_gate_up"] = _assembled(prefix + "b_gate_up", (E, 2 * I), [found[("gate_up_proj", bias)]],
                                               lambda ts: _deinterleave(ts[0]))
        out[prefix + "b_down"] = _assembled(prefix + "b_down", (E, C), [found[("down_proj", bias)]], lambda ts: ts[0])
    return out


def read_assembled(load: Callable[[Mapping[str, StoredTensor]], Dict[str, torch.Tensor]],
                   stored: Mapping[str, StoredTensor]) -> Dict[str, torch.Tensor]:
    """The tensors ``stored`` describes, read by ``load``, each :class:`Assembled` one built from its parts."""
    parts = {f"{key}\0{j}": part for key, t in stored.items() if isinstance(t, Assembled)
             for j, part in enumerate(t.parts)}
    plain = {key: t for key, t in stored.items() if not isinstance(t, Assembled)}
    loaded = load({**plain, **parts})
    out = {key: loaded[key] for key in plain}
    for key, t in stored.items():
        if isinstance(t, Assembled):
            out[key] = t.build([loaded.pop(f"{key}\0{j}") for j in range(len(t.parts))])
    return out
