"""What a stored element costs: the compute dtypes' sizes, the cache's storage choices
(``cache.impl``, ``cache.dtype``) and the bytes of one stored vector. The bottom of the byte
formulas (:mod:`kvbench.layouts`); torch-free."""

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
CACHE_IMPLS = ("static", "concat", "none")
# cache.dtype: how K/V are stored. auto: the compute dtype (runtime.dtype); the others store codes
# of this many bytes per element plus a float32 scale per (sequence, KV head, position), K and V each.
CACHE_DTYPE_BYTES = {"int8": 1, "float8_e4m3fn": 1}
# 4-bit codes (kvbench/quant4.py): two E2M1 codes per byte and a 1-byte scale per block of this many
# values of a head (E4M3 for nvfp4, E8M0 for mxfp4); nvfp4_rotated: nvfp4 after a Hadamard rotation.
FP4_BLOCK = {"nvfp4": 16, "mxfp4": 32, "nvfp4_rotated": 16}
QUANTIZED_DTYPES = (*CACHE_DTYPE_BYTES, *FP4_BLOCK)
CACHE_DTYPES = ("auto", *QUANTIZED_DTYPES)
# A quantized cache keeps one float32 scale per (position, head) of each stored tensor (8-bit codes).
SCALE_BYTES = 4
# what a quantized cache.dtype stores, in words (inspect, the record)
STORED_AS = {"int8": "int8 codes + a float32 scale per (position, head)",
             "float8_e4m3fn": "float8 e4m3 codes + a float32 scale per (position, head)",
             "nvfp4": "E2M1 codes + an E4M3 scale per 16 values (and a float32 per layer)",
             "mxfp4": "E2M1 codes + an E8M0 scale per 32 values",
             "nvfp4_rotated": "Hadamard-rotated heads in nvfp4 (E2M1 codes + an E4M3 scale per 16 values)"}


def element_bytes(width: int, element: int, cache_dtype: str) -> int:
    """Bytes one stored vector of ``width`` takes: its elements in the compute dtype (``element``
    bytes each), 1-byte codes and their float32 scale (``cache.dtype`` int8 / float8_e4m3fn), or half a
    byte per code and a byte per block (nvfp4: 128 values in 64 + 8 = 72 B; mxfp4: 64 + 4 = 68 B). A width
    that is not a whole number of blocks is refused before a store is made (the layouts' Limits)."""
    if cache_dtype == "auto":
        return width * element
    if cache_dtype in FP4_BLOCK:
        return -(-width // 2) + -(-width // FP4_BLOCK[cache_dtype])
    return width * CACHE_DTYPE_BYTES[cache_dtype] + SCALE_BYTES


def block_refusal(width: int, cache_dtype: str, name: str = "head_dim") -> str:
    """Why ``cache.dtype`` cannot store a head of ``width`` values ('' when it can): 4-bit codes come in
    whole blocks, and a rotation needs a power-of-two width (the Walsh-Hadamard matrix's order)."""
    block = FP4_BLOCK.get(cache_dtype)
    if block is None:
        return ""
    if width % block:
        return f"stores blocks of {block} values of a head, and {name}={width} is not a multiple of {block}"
    if cache_dtype == "nvfp4_rotated" and width & (width - 1):
        return f"rotates each head by a Walsh-Hadamard matrix, and {name}={width} is not a power of two"
    return ""
