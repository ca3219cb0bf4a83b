"""Quantized checkpoints written in the published formats by encoders of the tests' own (none of
kvbench's code): a float checkpoint rewritten as DeepSeek's FP8 blocks, GPT-OSS's MXFP4 experts or
ModelOpt's NVFP4, with the dequantized copy each encodes, element by element from the formats' bit
fields (not kvbench's tables nor its vectorised arithmetic)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Callable, Dict, Tuple

import torch
from safetensors.torch import load_file, save_file

E4M3_MAX = 448.0


def e2m1_value(code: int) -> float:
    """The value of a 4-bit E2M1 code from its fields: sign bit 3, exponent bits 2-1 (bias 1), mantissa bit 0;
    exponent 0 is subnormal (0 or 0.5)."""
    sign = -1.0 if code & 8 else 1.0
    exponent, mantissa = (code >> 1) & 3, code & 1
    magnitude = mantissa * 0.5 if exponent == 0 else 2.0 ** (exponent - 1) * (1 + mantissa / 2)
    return sign * magnitude


_MAGNITUDES = torch.tensor([e2m1_value(c) for c in range(8)])


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """x (already divided by its scale) rounded to the nearest E2M1 value, saturating at 6: its codes (uint8)."""
    nearest = (x.abs().clamp(max=6.0)[..., None] - _MAGNITUDES).abs().argmin(-1)
    return (nearest + 8 * (x < 0)).to(torch.uint8)


def pack(codes: torch.Tensor) -> torch.Tensor:
    """(..., 2n) codes -> (..., n) bytes, the even-indexed value in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_values(packed: torch.Tensor) -> torch.Tensor:
    """(..., n) bytes -> (..., 2n) float32 values, one element at a time."""
    flat = [v for byte in packed.flatten().tolist() for v in (e2m1_value(byte & 15), e2m1_value(byte >> 4))]
    return torch.tensor(flat, dtype=torch.float32).reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def fp8_blocks(w: torch.Tensor, block: Tuple[int, int]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fp8 weight, weight_scale_inv, dequantized) of a matrix (R, C): each M x N block (the last ones
    partial) scaled by its absolute maximum / 448, as DeepSeek's weight quantization does."""
    (R, C), (M, N) = w.shape, block
    q = torch.empty(R, C, dtype=torch.float8_e4m3fn)
    scales = torch.empty(math.ceil(R / M), math.ceil(C / N))
    out = torch.empty(R, C)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            part = w[i * M:(i + 1) * M, j * N:(j + 1) * N].float()
            scale = max(part.abs().max().item(), 1e-12) / E4M3_MAX
            scales[i, j] = scale
            codes = (part / scale).to(torch.float8_e4m3fn)
            q[i * M:(i + 1) * M, j * N:(j + 1) * N] = codes
            out[i * M:(i + 1) * M, j * N:(j + 1) * N] = codes.float() * scales[i, j]
    return q, scales, out


def mxfp4_rows(w: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(blocks (..., G, 16), scales (..., G), dequantized (..., C)) of rows of C values in groups of 32: each
    group's E8M0 exponent the one that brings its largest magnitude below 8 (floor(log2(amax)) - 2)."""
    groups = w.float().unflatten(-1, (-1, 32))
    amax = groups.abs().amax(-1).clamp(min=2.0 ** -126)
    exponent = (torch.floor(torch.log2(amax)) - 2).clamp(-127, 127)
    codes = e2m1_codes(groups / torch.exp2(exponent)[..., None])
    blocks = pack(codes)
    scales = (exponent + 127).to(torch.uint8)
    out = unpack_values(blocks) * torch.tensor([2.0 ** (s - 127) for s in scales.flatten().tolist()]).reshape(
        scales.shape)[..., None]
    return blocks, scales, out.flatten(-2)


def nvfp4_matrix(w: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weight (R, C/2) uint8, weight_scale (R, C/16) float8_e4m3fn, weight_scale_2 (), dequantized (R, C)), as
    ModelOpt scales: the tensor's scale amax / (6 x 448), each 16 values' amax / 6 over it in E4M3."""
    groups = w.float().unflatten(-1, (-1, 16))
    scale_2 = torch.tensor(max(w.abs().max().item(), 1e-12) / (6 * E4M3_MAX))
    scale = (groups.abs().amax(-1) / 6 / scale_2).to(torch.float8_e4m3fn)
    divisor = (scale.float() * scale_2)[..., None]
    codes = e2m1_codes(torch.where(divisor > 0, groups / divisor, torch.zeros_like(groups)))
    packed = pack(codes.flatten(-2))
    out = unpack_values(packed).unflatten(-1, (-1, 16)) * scale.float()[..., None] * scale_2
    return packed, scale, scale_2, out.flatten(-2)


def rewrite(src: Path, quant: Path, dequant: Path, quantization_config: dict,
            encode: Callable[[str, torch.Tensor], Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    """The float checkpoint ``src`` as ``quant`` (each tensor ``encode`` returns the file's tensors for, with
    ``quantization_config``) and ``dequant`` (the same with the dequantized values under the tensor's own
    name, config.json unchanged): what a loader of ``quant`` must compute. Returns the dequantized tensors."""
    tensors = load_file(src / "model.safetensors")
    stored, plain = {}, {}
    for name, t in tensors.items():
        files = encode(name, t)
        plain[name] = files.pop("", t)
        stored.update(files or {name: t})
    for out, held, extra in ((quant, stored, {"quantization_config": quantization_config}), (dequant, plain, {})):
        shutil.copytree(src, out)
        save_file({k: v.contiguous() for k, v in held.items()}, out / "model.safetensors", metadata={"format": "pt"})
        cfg = json.loads((src / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**cfg, **extra}))
    return plain


def fp8_encoder(block: Tuple[int, int]) -> Callable[[str, torch.Tensor], Dict[str, torch.Tensor]]:
    """DeepSeek-V3's: every matrix of a layer in FP8 blocks but the router (mlp.gate); norms, embeddings and
    the head as they were."""
    def encode(name: str, t: torch.Tensor) -> Dict[str, torch.Tensor]:
        if not (name.startswith("model.layers.") and t.dim() == 2 and name.endswith(".weight")
                and not name.endswith("mlp.gate.weight")):
            return {}
        q, scale, out = fp8_blocks(t, block)
        return {name: q, name + "_scale_inv": scale, "": out}
    return encode


def mxfp4_encoder(name: str, t: torch.Tensor) -> Dict[str, torch.Tensor]:
    """GPT-OSS's: the experts' gate_up_proj (E, C, 2I) and down_proj (E, I, C) as blocks of their transposes,
    32 input values a group; everything else as it was."""
    if not name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
        return {}
    blocks, scales, out = mxfp4_rows(t.transpose(1, 2))  # (E, out, in): the groups run along the input
    return {name + "_blocks": blocks, name + "_scales": scales, "": out.transpose(1, 2).contiguous()}


def nvfp4_encoder(name: str, t: torch.Tensor) -> Dict[str, torch.Tensor]:
    """ModelOpt's: every matrix of a layer (the router aside) in NVFP4, with an input_scale kvbench leaves unread."""
    if not (name.startswith("model.layers.") and t.dim() == 2 and name.endswith(".weight")
            and not name.endswith(("mlp.gate.weight", "mlp.router.weight"))):
        return {}
    packed, scale, scale_2, out = nvfp4_matrix(t)
    return {name: packed, name + "_scale": scale, name + "_scale_2": scale_2,
            name.rsplit(".", 1)[0] + ".input_scale": torch.tensor(1.0), "": out}
