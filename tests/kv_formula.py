"""The article's KV-bytes formula, written once more by hand as the tests' independent reference
for the layer layouts' byte figures (kvbench.layouts): 2 · layers · kv_heads · head_dim · seq_len ·
batch · bytes per element, a local layer holding min(seq_len, W) positions, MLA's one latent of
kv_lora_rank + qk_rope_head_dim per position, int8 / float8 codes with a 4-byte scale per
(position, head) of each stored tensor, and 4-bit codes (half a byte each) with a 1-byte scale per
block of 16 (nvfp4) or 32 (mxfp4) values."""

from typing import Optional, Sequence

CODE_BYTES = {"int8": 1, "float8_e4m3fn": 1}
FP4_BLOCKS = {"nvfp4": 16, "nvfp4_rotated": 16, "mxfp4": 32}


def kv_cache_bytes(num_layers: int, num_kv_heads: int, head_dim: int, seq_len: float, batch_size: int,
                   bytes_per_element: int, cache_dtype: str = "auto",
                   windows: Optional[Sequence[Optional[int]]] = None, *,
                   latent: bool = False, v_head_dim: Optional[int] = None) -> float:
    widths = [head_dim] if latent else [head_dim, head_dim if v_head_dim is None else v_head_dim]
    if cache_dtype == "auto":
        per_head = sum(widths) * bytes_per_element
    elif cache_dtype in FP4_BLOCKS:
        per_head = sum(w // 2 + w // FP4_BLOCKS[cache_dtype] for w in widths)
    else:
        per_head = sum(widths) * CODE_BYTES[cache_dtype] + 4 * len(widths)
    windows = [None] * num_layers if windows is None else windows
    assert len(windows) == num_layers
    positions = sum(seq_len if w is None else min(seq_len, w) for w in windows)
    return num_kv_heads * positions * batch_size * per_head
