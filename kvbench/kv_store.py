"""How a cache stores K or V: in the compute dtype, or as int8 / float8_e4m3fn codes with a
float32 scale per (sequence, KV head, position), quantized on write and dequantized on read
(``cache.dtype``). :class:`KVStore` holds every layer's tensors; the caches in
:mod:`kvbench.cache` decide which positions go where."""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from kvbench.config import CACHE_DTYPES

# A quantized cache keeps one float32 scale per (sequence, KV head, position) for K and one for V.
SCALE_BYTES = 4
# The largest code: symmetric int8 uses -127..127 (not -128, so that -x quantizes as -q);
# float8_e4m3fn's largest finite value is 448.
_CODE_MAX = {"int8": 127.0, "float8_e4m3fn": 448.0}


def storage_dtype(cache_dtype: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype a cache stores K/V codes in: ``dtype`` (the compute dtype) for auto."""
    if cache_dtype not in CACHE_DTYPES:
        raise ValueError(f"cache.dtype={cache_dtype!r}: must be one of {', '.join(CACHE_DTYPES)}")
    return dtype if cache_dtype == "auto" else getattr(torch, cache_dtype)


def quantize(x: torch.Tensor, cache_dtype: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """``x`` (..., D) as (codes (..., D) in ``cache_dtype``, float32 scales (..., 1)): symmetric,
    one scale per vector of D (one position of one head), ``scale = max|x| / code max``.

    int8 rounds to the nearest code: |x - dequantize| <= scale / 2. float8_e4m3fn keeps 3 mantissa
    bits: a relative error <= 2**-4 for normal codes, an absolute one <= scale * 2**-10 below them.
    An all-zero vector gets scale 1 (its codes are 0 whatever the scale)."""
    xf = x.float()
    scale = xf.abs().amax(-1, keepdim=True) / _CODE_MAX[cache_dtype]
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    scaled = xf / scale
    if cache_dtype == "int8":
        return scaled.round().clamp_(-127, 127).to(torch.int8), scale
    return scaled.clamp_(-448, 448).to(torch.float8_e4m3fn), scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Codes (..., D) times their scales (..., 1), in ``dtype`` (the compute dtype)."""
    return (codes.float() * scale).to(dtype)


class KVStore:
    """K or V of every layer, (B, H_kv, S, D) each, in ``cache.dtype``: as given (auto), or as
    codes with a float32 scale per (sequence, head, position), (B, H_kv, S, 1).

    Why a scale per position and head (not KIVI's per-channel keys): a write quantizes only what
    it writes, so earlier positions are never requantized and a static cache stays static; with
    int8's 255 levels the per-channel outliers of keys cost little (KIVI needs channel scales at
    2 bits, with a full-precision residual of recent tokens to fill a channel group)."""

    def __init__(self, num_layers: int, shape: Tuple[int, ...], cache_dtype: str, dtype: torch.dtype,
                 device: torch.device, lengths: Optional[Sequence[int]] = None):
        # lengths: per layer the positions held (a local layer's ring: W), default shape[2]
        self.cache_dtype, self.dtype = cache_dtype, dtype
        shapes = [shape[:2] + (n,) + shape[3:] for n in (lengths or [shape[2]] * num_layers)]
        self.codes = [torch.zeros(sh, dtype=storage_dtype(cache_dtype, dtype), device=device) for sh in shapes]
        self.scales = ([] if cache_dtype == "auto" else
                       [torch.ones(sh[:-1] + (1,), device=device) for sh in shapes])

    def write(self, layer: int, start: int, x: torch.Tensor) -> None:
        """Store ``x`` (B', H_kv, T, D) at sequences 0..B'-1, positions ``start .. start + T``."""
        B, end = x.shape[0], start + x.shape[2]
        if not self.scales:
            self.codes[layer][:B, :, start:end] = x
            return
        codes, scale = quantize(x, self.cache_dtype)
        self.codes[layer][:B, :, start:end] = codes
        self.scales[layer][:B, :, start:end] = scale

    def write_slots(self, layer: int, slots: torch.Tensor, x: torch.Tensor) -> None:
        """Store ``x`` (B', H_kv, n, D) at storage indices ``slots`` (n,) of sequences 0..B'-1."""
        B = x.shape[0]
        if not self.scales:
            self.codes[layer][:B].index_copy_(2, slots, x)
            return
        codes, scale = quantize(x, self.cache_dtype)
        self.codes[layer][:B].index_copy_(2, slots, codes)
        self.scales[layer][:B].index_copy_(2, slots, scale)

    def gather(self, layer: int, batch_size: int, slots: torch.Tensor) -> torch.Tensor:
        """Storage indices ``slots`` (n,) of the first ``batch_size`` sequences, (B, H_kv, n, D), a copy."""
        codes = self.codes[layer][:batch_size].index_select(2, slots)
        if not self.scales:
            return codes
        return dequantize(codes, self.scales[layer][:batch_size].index_select(2, slots), self.dtype)

    def read(self, layer: int, batch_size: int, end: int) -> torch.Tensor:
        """Positions 0..end-1 of the first ``batch_size`` sequences, (B, H_kv, end, D), in the compute
        dtype: a view for auto, a dequantized copy otherwise."""
        codes = self.codes[layer][:batch_size, :, :end]
        if not self.scales:
            return codes
        return dequantize(codes, self.scales[layer][:batch_size, :, :end], self.dtype)

    def tensors(self) -> List[torch.Tensor]:
        return self.codes + self.scales


