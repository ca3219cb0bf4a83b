"""The one K/V storage under every cache and the serving store: one stored tensor (keys, or
values) in the compute dtype, as int8 / float8_e4m3fn codes with a float32 scale per
(position, head), or as 4-bit codes with a byte scale per block of a head (:mod:`kvbench.quant4`),
quantized on write and dequantized on read (``cache.dtype``). A store only writes and reads along its
position axis: 2 in a sequence cache's (B, H_kv, S, D), 0 in the serving pool's (slots, H_kv, D).
"""

from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import torch

from kvbench import quant4
from kvbench.core.dtypes import CACHE_DTYPES, FP4_BLOCK, SCALE_BYTES  # noqa: F401 (SCALE_BYTES: what a quantized vector adds)

# The largest code: symmetric int8 uses -127..127 (not -128, so that -x quantizes as -q);
# float8_e4m3fn's largest finite value is 448.
_CODE_MAX = {"int8": 127.0, "float8_e4m3fn": 448.0}


def storage_dtype(cache_dtype: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype a cache stores K/V codes in: ``dtype`` (the compute dtype) for auto, bytes of two codes for 4-bit."""
    if cache_dtype not in CACHE_DTYPES:
        raise ValueError(f"cache.dtype={cache_dtype!r}: must be one of {', '.join(CACHE_DTYPES)}")
    if cache_dtype in FP4_BLOCK:
        return torch.uint8
    return dtype if cache_dtype == "auto" else getattr(torch, cache_dtype)


def quantize(x: torch.Tensor, cache_dtype: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """``x`` (..., D) as (codes in ``cache_dtype``, float32 scales (..., 1)): symmetric, one scale per
    vector of D, ``scale = max|x| / code max``.

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


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """float8 codes as their bytes: index_copy_ and index_select have no float8 kernel on a CPU,
    and moving codes needs none (the same bits either way)."""
    return t.view(torch.uint8) if t.dtype == getattr(torch, "float8_e4m3fn", None) else t


class KVStore:
    """One tensor of ``shape`` in ``cache.dtype``, positions along ``axis`` (with 2, the first
    dimension is the batch and B' sequences touch rows 0..B'-1).

    A scale per position and head, not KIVI's per-channel keys: a write quantizes only what it
    writes, so earlier positions are never requantized; with int8's 255 levels the keys' channel
    outliers cost little (KIVI needs channel scales at 2 bits). 4-bit codes keep a scale per block
    of a head instead (16 or 32 values), and nvfp4 one float32 per store, set by its first write
    (:mod:`kvbench.quant4`): the layer's constant, not a position's bytes, so not in :meth:`tensors`.

    ``carve(shape, dtype)``: where its tensors live instead of allocations of their own (views of a
    serving pool's shared bytes, :mod:`kvbench.serving.managers`), codes first, then scales."""

    def __init__(self, shape: Tuple[int, ...], cache_dtype: str, dtype: torch.dtype, device: torch.device,
                 axis: int = 2, carve: Optional[Callable[[Tuple[int, ...], torch.dtype], torch.Tensor]] = None):
        self.cache_dtype, self.dtype, self.axis = cache_dtype, dtype, axis
        self.shape = tuple(shape)  # what is stored, before codes are packed: (..., D)
        block = FP4_BLOCK.get(cache_dtype)
        *lead, D = shape
        carve = carve or (lambda size, kind: torch.zeros(size, dtype=kind, device=device))
        self.codes = carve(shape if block is None else (*lead, D // 2), storage_dtype(cache_dtype, dtype))
        self.scales = (None if cache_dtype == "auto" else carve(shape[:-1] + (1,), torch.float32).fill_(1)
                       if block is None else carve((*lead, D // block), torch.uint8))
        # nvfp4's per-tensor scale; 0 until a write holds a nonzero value
        self.global_scale = torch.zeros((), device=device) if cache_dtype.startswith("nvfp4") else None
        self.scale_set = False  # global_scale set by a write that held a nonzero value: kept from then on

    def _encode(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        if self.cache_dtype not in FP4_BLOCK:
            return quantize(x, self.cache_dtype)
        g = self.global_scale
        if g is not None and not self.scale_set:  # until a write holding a nonzero value sets it
            g = quant4.global_scale(quant4.hadamard(x) if self.cache_dtype == "nvfp4_rotated" else x)
        encoded = quant4.encode(x, self.cache_dtype, g)  # refuses a NaN or inf before the scale is kept
        if g is not None and not self.scale_set:
            self.global_scale = g
            self.scale_set = bool(g > 0)  # one wait on the device per store, not one per decode step
        return encoded

    def _decode(self, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        if self.cache_dtype not in FP4_BLOCK:
            return dequantize(codes, scales, self.dtype)
        return quant4.decode(codes, scales, self.cache_dtype, self.dtype, self.global_scale)

    @property
    def length(self) -> int:
        """Positions the store holds."""
        return self.codes.shape[self.axis]

    def _rows(self, t: torch.Tensor, batch: Optional[int]) -> torch.Tensor:
        return t if batch is None or self.axis == 0 else t[:batch]


    def write(self, where: int | torch.Tensor, x: torch.Tensor) -> None:
        """Store ``x`` at ``where``: an int starts a run of x's positions, a tensor indexes each."""
        batch = x.shape[0]
        parts = [(self.codes, x)] if self.scales is None else list(zip((self.codes, self.scales), self._encode(x)))
        for store, value in parts:
            store = self._rows(store, batch)
            if isinstance(where, int):
                store.narrow(self.axis, where, value.shape[self.axis]).copy_(value)
            else:
                _bytes(store).index_copy_(self.axis, where, _bytes(value))

    def read(self, end: int, batch: Optional[int] = None) -> torch.Tensor:
        """Positions 0..end-1 of the first ``batch`` sequences: a view for auto, else a dequantized copy."""
        codes = self._rows(self.codes, batch).narrow(self.axis, 0, end)
        if self.scales is None:
            return codes
        return self._decode(codes, self._rows(self.scales, batch).narrow(self.axis, 0, end))

    def gather(self, index: torch.Tensor, batch: Optional[int] = None) -> torch.Tensor:
        """Positions ``index`` (n,) of the first ``batch`` sequences, a copy in the compute dtype."""
        codes = _bytes(self._rows(self.codes, batch)).index_select(self.axis, index).view(self.codes.dtype)
        if self.scales is None:
            return codes
        return self._decode(codes, self._rows(self.scales, batch).index_select(self.axis, index))

    def tensors(self) -> List[torch.Tensor]:
        return [self.codes] + ([] if self.scales is None else [self.scales])
