"""What a stored element costs: the compute dtypes' sizes, the cache's storage choices
(``cache.impl``, ``cache.dtype``) and the bytes of one stored vector. The bottom of the byte
formulas (:mod:`kvbench.layouts`); torch-free."""

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
CACHE_IMPLS = ("static", "concat", "none")
# cache.dtype: how K/V are stored. auto: the compute dtype (runtime.dtype); the others store codes
# of this many bytes per element plus a float32 scale per (sequence, KV head, position), K and V each.
CACHE_DTYPE_BYTES = {"int8": 1, "float8_e4m3fn": 1}
CACHE_DTYPES = ("auto", *CACHE_DTYPE_BYTES)
# A quantized cache keeps one float32 scale per (position, head) of each stored tensor.
SCALE_BYTES = 4


def element_bytes(width: int, element: int, cache_dtype: str) -> int:
    """Bytes one stored vector of ``width`` takes: its elements in the compute dtype (``element``
    bytes each), or 1-byte codes and their float32 scale (``cache.dtype`` int8 / float8_e4m3fn)."""
    return width * element if cache_dtype == "auto" else width * CACHE_DTYPE_BYTES[cache_dtype] + SCALE_BYTES
