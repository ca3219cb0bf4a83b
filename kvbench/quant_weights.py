"""Quantized checkpoint weights (``model.weights_stored``, :mod:`kvbench.config.quant`), dequantized on
load, and the bytes they take as stored.

The decoder runs in the compute dtype; a quantized checkpoint's tensors are read as float32 values
(then cast to ``runtime.dtype`` with the rest). :func:`read_dequantized_headers` folds each quantized
weight and its scales into one :class:`~kvbench.hf_weights.Derived` header of the dequantized
tensor, by the headers alone, so names, shapes, dtypes and scale grids are checked before a byte is
read; the scales' values are checked as they are read. Each refusal is one CheckpointError naming
the tensor as the file names it; nothing is built until every tensor is read.

- ``fp8_e4m3_<M>x<N>`` (DeepSeek-V3/V3.2; transformers' ``integrations/finegrained_fp8.py``): each
  F8_E4M3 ``X.weight`` (R, C) has ``X.weight_scale_inv`` of (ceil(R/M), ceil(C/N)); a value is its FP8
  value times its block's scale. Edge blocks are partial (DeepSeek-V3's ``kv_a_proj_with_mqa`` has 576
  rows: 4.5 blocks), as DeepSeek's own ``weight_dequant`` reads them.
- ``mxfp4`` (GPT-OSS; transformers' ``integrations/mxfp4.py``, ``convert_moe_packed_tensors``): ``X_blocks``
  (..., G, 16) uint8 holds 32 E2M1 values per row of G, the low nibble first, and ``X_scales`` (..., G)
  uint8 an E8M0 exponent per 32 (2^(byte - 127)); the stacked experts (E, R, G, 16) are (E, G x 32, R)
  once dequantized (transformers' transpose), as GPT-OSS's bf16 files store ``X``.
- ``nvfp4`` (ModelOpt; transformers has no CPU reading of it, so written from NVIDIA's published
  description of the format, as vLLM's emulation reads it): ``X.weight`` (R, C/2) uint8 holds two E2M1
  values per byte, the low nibble first; ``X.weight_scale`` (R, C/16) F8_E4M3 a scale per 16 values and
  ``X.weight_scale_2`` a float32 per tensor: value = E2M1 x weight_scale x weight_scale_2. ``input_scale``
  (activations) and ``k_scale``/``v_scale`` (ModelOpt's KV cache) are not weights: left unread.
"""

from __future__ import annotations

import math
from functools import partial
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence

import torch

from kvbench.config.quant import KEY, fp8_block, weights_stored
from kvbench.hf_weights import CheckpointError, Derived, StoredTensor, read_headers

# E2M1's 16 codes: sign bit 3, then two exponent bits and one mantissa bit (the OCP MX spec's table)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MX_BLOCK, NV_BLOCK = 32, 16  # values per scale
SCALE_DTYPES = ("F32", "BF16", "F16")
# tensors a ModelOpt checkpoint keeps beside its weights for activations and the KV cache
_NOT_WEIGHTS = (".input_scale", ".k_scale", ".v_scale")
_EXPERT_WEIGHTS = ("experts.w_gate_up", "experts.w_down")
_SCALES = ("_scale_inv", ".weight_scale", ".weight_scale_2")


def read_dequantized_headers(directory: Path, hf: Mapping[str, Any]) -> Dict[str, StoredTensor]:
    """:func:`~kvbench.hf_weights.read_headers` of ``directory``, each quantized weight of the format
    the config.json contents ``hf`` name folded with its scales into one header of what it dequantizes to."""
    stored = read_headers(directory)
    fmt = weights_stored(hf)
    if fmt is None:
        # without it the FP8 values would be read unscaled: a checkpoint stripped of its config's key
        scales = [n for n in sorted(stored) if n.endswith(_SCALES) or n.endswith("_blocks") and
                  n[: -len("_blocks")] + "_scales" in stored]
        if scales:
            raise _fail(directory, f"tensor {scales[0]}: the scales of a quantized weight, but config.json has "
                                   f"no {KEY}")
        return stored
    fold = _fold_mxfp4 if fmt == "mxfp4" else _fold_nvfp4 if fmt == "nvfp4" else partial(_fold_fp8, fp8_block(fmt))
    folded = fold(directory, dict(stored))
    if not any(isinstance(t, Derived) for t in folded.values()):  # the record would say a format the files lack
        raise _fail(directory, f"{KEY}.quant_method={hf[KEY]['quant_method']!r}, but no tensor of the files is "
                               f"stored so ({fmt}: {describe_stored(fmt)}); drop {KEY} from config.json")
    return folded


def _fail(directory: Path, what: str) -> CheckpointError:
    return CheckpointError(f"{directory}: {what}")


def _take(directory: Path, stored: Dict[str, StoredTensor], name: str, by: str, dtypes: Sequence[str],
          shape: Optional[tuple] = None, why: str = "") -> StoredTensor:
    """The header of ``name``, which ``by`` needs, removed from ``stored``: there, of ``dtypes`` and ``shape``."""
    tensor = stored.pop(name, None)
    if tensor is None:
        raise _fail(directory, f"tensor {by} has no {name} beside it ({KEY}: each quantized weight is stored with "
                               "its scales)")
    if tensor.dtype not in dtypes:
        raise _fail(directory, f"tensor {name} is {tensor.dtype}, not {' or '.join(dtypes)}")
    if shape is not None and tuple(tensor.shape) != tuple(shape):
        raise _fail(directory, f"tensor {name} has shape {tuple(tensor.shape)}, {by} {why}implies {tuple(shape)}")
    return tensor


def _fold_fp8(block: tuple, directory: Path, stored: Dict[str, StoredTensor]) -> Dict[str, StoredTensor]:
    M, N = block
    for name in [n for n in stored if n.endswith("_scale_inv")]:
        if name[: -len("_scale_inv")] not in stored:
            raise _fail(directory, f"tensor {name} scales {name[: -len('_scale_inv')]}, which the files do not hold")
    for name in [n for n, t in stored.items() if t.dtype.startswith("F8_")]:
        weight = stored[name]
        if weight.dtype != "F8_E4M3" or len(weight.shape) < 2:
            raise _fail(directory, f"tensor {name} is {weight.dtype} of shape {tuple(weight.shape)}: {KEY} "
                                   "reads F8_E4M3 matrices")
        *lead, R, C = weight.shape
        grid = (*lead, math.ceil(R / M), math.ceil(C / N))
        scale = _take(directory, stored, f"{name}_scale_inv", name, SCALE_DTYPES, grid,
                      f"{tuple(weight.shape)} in {KEY}.weight_block_size=[{M}, {N}] blocks ")
        stored[name] = Derived(weight.file, weight.name, weight.shape, weight.dtype, (weight, scale),
                               partial(_fp8_values, directory, block, scale.name))
    for name in [n for n in stored if n.endswith("_scale_inv")]:  # left: its weight is not FP8
        weight = stored[name[: -len("_scale_inv")]]
        raise _fail(directory, f"tensor {name} scales {weight.name}, which is {weight.dtype}, not F8_E4M3")
    return stored


def _fp8_values(directory: Path, block: tuple, scale_name: str, parts: List[torch.Tensor]) -> torch.Tensor:
    weight, scale = parts
    scale = _finite(directory, scale_name, scale.float())
    R, C = weight.shape[-2:]
    # each scale over its M x N block, the last row and column of blocks cut to the matrix
    scale = scale.repeat_interleave(block[0], -2)[..., :R, :].repeat_interleave(block[1], -1)[..., :C]
    return weight.float() * scale


def _finite(directory: Path, name: str, scale: torch.Tensor) -> torch.Tensor:
    if not torch.isfinite(scale).all():
        raise _fail(directory, f"tensor {name} holds NaN or infinite scales")
    return scale


def _e2m1(codes: torch.Tensor) -> torch.Tensor:
    """(..., n) uint8 of two E2M1 codes each, the low nibble first -> (..., 2n) float32 values."""
    table = torch.tensor(E2M1_VALUES)
    return torch.stack([table[(codes & 0x0F).long()], table[(codes >> 4).long()]], -1).flatten(-2)


def _fold_mxfp4(directory: Path, stored: Dict[str, StoredTensor]) -> Dict[str, StoredTensor]:
    for name in [n for n in stored if n.endswith("_scales") and n[: -len("_scales")] + "_blocks" not in stored]:
        raise _fail(directory, f"tensor {name} scales {name[: -len('_scales')]}_blocks, which the files do not hold")
    for name in [n for n in stored if n.endswith("_blocks")]:
        blocks = stored.pop(name)
        base = name[: -len("_blocks")]
        if blocks.dtype != "U8" or len(blocks.shape) not in (3, 4) or blocks.shape[-1] != MX_BLOCK // 2:
            raise _fail(directory, f"tensor {name} is {blocks.dtype} of shape {tuple(blocks.shape)}: MXFP4 blocks "
                                   f"are uint8 (rows, groups, {MX_BLOCK // 2}) or (experts, rows, groups, "
                                   f"{MX_BLOCK // 2}): {MX_BLOCK} values of 4 bits per group")
        scales = _take(directory, stored, base + "_scales", name, ("U8",), blocks.shape[:-1],
                       "(one E8M0 exponent per group) ")
        *lead, R, G, _ = blocks.shape
        shape = (lead[0], G * MX_BLOCK, R) if lead else (R, G * MX_BLOCK)  # stacked experts: transposed
        if base in stored:
            raise _fail(directory, f"tensors {base} and {name} are the same weight: which one is meant is not defined")
        stored[base] = Derived(blocks.file, blocks.name, shape, "MXFP4", (blocks, scales),
                               partial(_mxfp4_values, directory, scales.name))
    return stored


def _mxfp4_values(directory: Path, scale_name: str, parts: List[torch.Tensor]) -> torch.Tensor:
    blocks, scales = parts
    if (scales == 255).any():  # E8M0's one NaN code; it has no infinity
        raise _fail(directory, f"tensor {scale_name} holds 255, E8M0's NaN")
    values = _e2m1(blocks) * torch.exp2(scales.float() - 127)[..., None]  # (..., R, G, 32)
    values = values.flatten(-2)  # (..., R, G x 32)
    return values.transpose(-2, -1).contiguous() if values.dim() == 3 else values


def _fold_nvfp4(directory: Path, stored: Dict[str, StoredTensor]) -> Dict[str, StoredTensor]:
    for name in [n for n in stored if n.endswith(_NOT_WEIGHTS)]:
        del stored[name]
    for name in [n for n in stored if n.endswith((".weight_scale", ".weight_scale_2"))]:
        if name.rsplit(".", 1)[0] + ".weight" not in stored:
            raise _fail(directory, f"tensor {name} scales {name.rsplit('.', 1)[0]}.weight, which the files do not hold")
    for name in [n for n, t in stored.items() if n.endswith(".weight") and t.dtype == "U8"]:
        weight = stored[name]
        if len(weight.shape) != 2 or (2 * weight.shape[1]) % NV_BLOCK:
            raise _fail(directory, f"tensor {name} has shape {tuple(weight.shape)}: NVFP4 packs a matrix's rows two "
                                   f"values a byte, in blocks of {NV_BLOCK} values (columns a multiple of "
                                   f"{NV_BLOCK // 2} bytes)")
        R, C = weight.shape[0], 2 * weight.shape[1]
        scale = _take(directory, stored, name + "_scale", name, ("F8_E4M3",), (R, C // NV_BLOCK),
                      f"({R} x {C} values, one scale per {NV_BLOCK}) ")
        scale_2 = _take(directory, stored, name + "_scale_2", name, SCALE_DTYPES)
        if math.prod(scale_2.shape) != 1:
            raise _fail(directory, f"tensor {scale_2.name} has shape {tuple(scale_2.shape)}: one scale per tensor")
        stored[name] = Derived(weight.file, weight.name, (R, C), "NVFP4", (weight, scale, scale_2),
                               partial(_nvfp4_values, directory, scale.name, scale_2.name))
    return stored


def _nvfp4_values(directory: Path, scale_name: str, scale_2_name: str, parts: List[torch.Tensor]) -> torch.Tensor:
    weight, scale, scale_2 = parts
    scale = _finite(directory, scale_name, scale.float())
    scale_2 = _finite(directory, scale_2_name, scale_2.float().reshape(()))
    values = _e2m1(weight).unflatten(-1, (-1, NV_BLOCK))  # (R, C / 16, 16)
    return (values * scale[..., None] * scale_2).flatten(-2)


# ---- bytes as stored ------------------------------------------------------------------------

def quantized(name: str, shape: Sequence[int], stored: Optional[str]) -> bool:
    """Whether the decoder's parameter ``name`` is one a checkpoint of format ``stored`` quantizes: GPT-OSS's
    MXFP4, the experts' matrices; FP8 and NVFP4, every matrix of a layer (the router's aside), as DeepSeek-V3
    stores them. A checkpoint's own list (``modules_to_not_convert``) may keep a few more in bf16."""
    experts = name.endswith(_EXPERT_WEIGHTS)
    if stored is None or stored == "mxfp4":
        return stored is not None and experts
    return experts or (name.startswith("blocks.") and len(shape) == 2 and name.endswith(".weight")
                       and not name.endswith("router.weight"))


def stored_bytes(name: str, shape: Sequence[int], element: int, stored: Optional[str]) -> int:
    """Bytes the decoder's parameter ``name`` of ``shape`` takes as a checkpoint of format ``stored``
    holds it (``element``: its bytes per value in the compute dtype, for a parameter not quantized).
    FP8: a byte per value + a float32 per block; MXFP4: half a byte per value + a byte per 32; NVFP4: half
    a byte + a byte per 16 + a float32 per matrix. The stacked gate-and-up matrix of experts is two matrices."""
    n = math.prod(shape)
    if not quantized(name, shape, stored):
        return n * element
    if stored == "mxfp4":
        return n // 2 + n // MX_BLOCK
    *lead, R, C = shape
    matrices = math.prod(lead) * (2 if name.endswith("w_gate_up") else 1)
    R = R // 2 if name.endswith("w_gate_up") else R
    if stored == "nvfp4":
        return n // 2 + n // NV_BLOCK + 4 * matrices
    M, N = fp8_block(stored)
    return n + 4 * matrices * math.ceil(R / M) * math.ceil(C / N)


def module_stored_bytes(module: torch.nn.Module, stored: Optional[str], element: Optional[int] = None) -> int:
    """Bytes of ``module``'s parameters (tied ones once) as a checkpoint of format ``stored`` holds them, those
    it does not quantize in ``element`` bytes a value (None: as ``module`` holds them)."""
    return sum(stored_bytes(n, p.shape, element or p.element_size(), stored) for n, p in module.named_parameters())


def checkpoint_bytes(model: torch.nn.Module, stored: Optional[str]) -> int:
    """Bytes of what ``model``'s checkpoint holds in format ``stored``: its parameters as stored (tied ones once)
    and its persistent buffers as held (kvbench.measure.memory.weight_bytes, the weights as stored)."""
    params = {id(p) for p in model.parameters()}
    buffers = {id(t): t for t in model.state_dict(keep_vars=True).values() if id(t) not in params}
    return module_stored_bytes(model, stored) + sum(t.numel() * t.element_size() for t in buffers.values())


def describe_stored(stored: str) -> str:
    """What format ``stored`` (:data:`~kvbench.config.quant.WEIGHTS_STORED`) keeps per weight, in words."""
    if stored == "mxfp4":
        return "MXFP4 experts: half a byte per weight + an E8M0 exponent per 32"
    if stored == "nvfp4":
        return "NVFP4 matrices: half a byte per weight + an E4M3 scale per 16 + a float32 per matrix"
    M, N = fp8_block(stored)
    return f"FP8 matrices: a byte per weight + a float32 scale per {M}x{N} block"


def expert_stored_bytes(experts: torch.nn.Module, stored: Optional[str]) -> int:
    """Bytes one expert of the stacked ``experts`` takes as stored: what a step reads per expert it routes to."""
    return sum(stored_bytes("experts." + n, (1, *p.shape[1:]), p.element_size(), stored)
               for n, p in experts.named_parameters())
