"""4-bit K/V codes (``cache.dtype`` nvfp4, mxfp4, nvfp4_rotated), in torch: what :class:`kvbench.kv_store.KVStore`
writes and reads. No kernel: encode on write, decode on read, as the 8-bit codes are.

Each value is an E2M1 code (sign, 2 exponent bits, 1 mantissa bit: ±{0, 0.5, 1, 1.5, 2, 3, 4, 6}), two codes
per byte (the first value of a pair in the low nibble, as the OCP MX spec and PyTorch's float4_e2m1fn_x2 pack
them), and every block of values along a head has one 1-byte scale:

- ``nvfp4`` (NVIDIA's NVFP4): blocks of 16, an E4M3 scale per block, and a float32 per-tensor scale ``g``.
  Block scale ``s = e4m3(min(amax / (g * 6), 448))``; value ``x -> e2m1(x / (s * g))``; read ``code * s * g``.
- ``mxfp4`` (OCP MX): blocks of 32, an E8M0 scale per block (a power of two, byte = exponent + 127):
  exponent ``floor(log2(amax)) - 2`` (2: E2M1's largest exponent), clamped to [-127, 127]; an all-zero
  block gets byte 0; value ``x -> e2m1(x / 2**exponent)``.
- ``nvfp4_rotated``: each head vector turned by the normalized Walsh-Hadamard matrix (H / sqrt(D), its own
  inverse), as rotation-based caches (QuaRot, SpinQuant) spread a channel's outlier over the head, then
  nvfp4; a read decodes and turns back. head_dim must be a power of two.

``e2m1`` rounds to the nearest grid value, a tie to the even code (the one whose last bit is 0),
saturates at ±6 and keeps the sign (-0.1 is code 8, -0), as a float cast does; a block whose scale is 0
(all zeros, or below the smallest scale) is all code 0. A NaN or infinity in K/V is refused: no code
holds it, and a scale would spread it over its block.

Per-tensor, for a cache written a few positions at a time: one float32 ``g`` per store (a layer's K, or its
V), set by the first write holding a nonzero value (``amax / (6 * 448)``, so that write's largest block
scale is E4M3's largest) and kept after, as an engine calibrates a layer's k_scale / v_scale once
(vLLM's ``calculate_kv_scales``). A later value beyond 6 · 448 · g saturates. Like those scales, ``g`` is
the layer's constant, not part of the cache: the bytes per position are the codes and block scales only
(NVFP4: 64 + 8 = 72 B per 128 values).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from kvbench.core.dtypes import FP4_BLOCK

# the E2M1 magnitudes, indexed by the code's low 3 bits; bit 3 is the sign
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
E4M3_MAX = 448.0
_MIDPOINTS = tuple((a + b) / 2 for a, b in zip(E2M1_GRID, E2M1_GRID[1:]))


def check_finite(x: torch.Tensor, cache_dtype: str) -> None:
    """Refuse a NaN or infinity in K/V in one line (a scale would spread it over its block)."""
    if not bool(torch.isfinite(x).all()):
        bad = x[~torch.isfinite(x)].flatten()[0].item()
        raise ValueError(f"cache.dtype={cache_dtype}: K/V hold {bad} (non-finite), which a 4-bit code cannot "
                         "store; the model's activations overflowed (try runtime.dtype=float32 or cache.dtype=auto)")


def e2m1(scaled: torch.Tensor) -> torch.Tensor:
    """Codes 0..15 (uint8) of float32 values already divided by their scale: round to the nearest grid
    value, a tie to the even code, beyond ±6 to ±6."""
    mag = scaled.abs().contiguous()
    mids = torch.tensor(_MIDPOINTS, dtype=mag.dtype, device=mag.device)
    down = torch.bucketize(mag, mids)  # a value on a midpoint: the lower code
    up = torch.bucketize(mag, mids, right=True)  # ... the upper one
    code = torch.where((down != up) & (down % 2 == 1), up, down)  # a tie goes to the even code
    return (code | torch.signbit(scaled).to(code.dtype) << 3).to(torch.uint8)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """The float32 values of codes 0..15."""
    grid = torch.tensor(E2M1_GRID, device=codes.device)
    mag = grid[(codes & 7).long()]
    return torch.where(codes >= 8, -mag, mag)


def pack(codes: torch.Tensor) -> torch.Tensor:
    """Codes (..., D) as bytes (..., D / 2): value 2i in the low nibble, 2i + 1 in the high one."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """Bytes (..., D / 2) as codes (..., D)."""
    return torch.stack((packed & 15, packed >> 4), -1).flatten(-2)


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """x (..., D) times the normalized Walsh-Hadamard matrix (Sylvester's order; D a power of two):
    symmetric and orthogonal, so applying it twice returns x."""
    D = x.shape[-1]
    out = x.float()
    h = 1
    while h < D:
        pairs = out.reshape(*out.shape[:-1], D // (2 * h), 2, h)  # (..., D / 2h, 2, h): butterflies of span h
        out = torch.stack((pairs[..., 0, :] + pairs[..., 1, :], pairs[..., 0, :] - pairs[..., 1, :]), -2)
        out = out.reshape(x.shape)
        h *= 2
    return out * D ** -0.5


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    return x.float().reshape(*x.shape[:-1], x.shape[-1] // block, block)  # (..., D / block, block)


def global_scale(x: torch.Tensor) -> torch.Tensor:
    """NVFP4's per-tensor scale for ``x``: amax / (6 · 448), float32; 0 when x is all zeros (not yet set)."""
    return x.float().abs().amax() / (E2M1_MAX * E4M3_MAX)


def nvfp4_encode(x: torch.Tensor, g: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """x (..., D) as (codes (..., D / 2) uint8, E4M3 block scales (..., D / 16) as their bytes) under
    per-tensor scale ``g`` (a float32 scalar; 0: x is all zeros, every code 0)."""
    g = torch.where(g > 0, g, torch.ones_like(g)).float()
    blocks = _blocks(x, FP4_BLOCK["nvfp4"])
    amax = blocks.abs().amax(-1, keepdim=True)
    scale = (amax / (g * E2M1_MAX)).clamp_(max=E4M3_MAX).to(torch.float8_e4m3fn)
    step = scale.float() * g  # what a code of 1 is worth in this block
    scaled = blocks / torch.where(step > 0, step, torch.ones_like(step))
    codes = torch.where(step > 0, e2m1(scaled), torch.zeros_like(scaled, dtype=torch.uint8))
    return pack(codes.flatten(-2)), scale.view(torch.uint8).squeeze(-1)


def nvfp4_decode(packed: torch.Tensor, scales: torch.Tensor, g: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    g = torch.where(g > 0, g, torch.ones_like(g)).float()
    values = _blocks(e2m1_values(unpack(packed)), FP4_BLOCK["nvfp4"])
    step = scales.view(torch.float8_e4m3fn).float().unsqueeze(-1) * g
    return (values * step).flatten(-2).to(dtype)


def mxfp4_encode(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """x (..., D) as (codes (..., D / 2) uint8, E8M0 block scales (..., D / 32) uint8)."""
    blocks = _blocks(x, FP4_BLOCK["mxfp4"])
    amax = blocks.abs().amax(-1, keepdim=True)
    # frexp: amax = m · 2**e with m in [0.5, 1), so floor(log2(amax)) = e - 1, exactly
    exponent = (torch.frexp(amax).exponent - 1 - 2).clamp_(-127, 127)
    exponent = torch.where(amax > 0, exponent, torch.full_like(exponent, -127))
    codes = e2m1(torch.ldexp(blocks, -exponent.float()))
    return pack(codes.flatten(-2)), (exponent + 127).to(torch.uint8).squeeze(-1)


def mxfp4_decode(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    values = _blocks(e2m1_values(unpack(packed)), FP4_BLOCK["mxfp4"])
    return torch.ldexp(values, scales.float().unsqueeze(-1) - 127).flatten(-2).to(dtype)


def encode(x: torch.Tensor, cache_dtype: str, g: Optional[torch.Tensor] = None
           ) -> Tuple[torch.Tensor, torch.Tensor]:
    """x (..., D) in ``cache_dtype``'s codes and block scales (``g``: nvfp4's per-tensor scale; None:
    x's own, :func:`global_scale` of what is encoded)."""
    check_finite(x, cache_dtype)
    if cache_dtype == "mxfp4":
        return mxfp4_encode(x)
    x = hadamard(x) if cache_dtype == "nvfp4_rotated" else x
    return nvfp4_encode(x, global_scale(x) if g is None else g)


def decode(packed: torch.Tensor, scales: torch.Tensor, cache_dtype: str, dtype: torch.dtype,
           g: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The values :func:`encode` stored, in ``dtype`` (a rotated head turned back); nvfp4 needs the
    ``g`` they were encoded with."""
    if cache_dtype == "mxfp4":
        return mxfp4_decode(packed, scales, dtype)
    if g is None:
        raise ValueError(f"cache.dtype={cache_dtype}: decoding needs the per-tensor scale the codes were written with")
    if cache_dtype == "nvfp4_rotated":
        return hadamard(nvfp4_decode(packed, scales, g, torch.float32)).to(dtype)
    return nvfp4_decode(packed, scales, g, dtype)
