"""task=inspect's text: the head→group map."""

from kvbench.layouts.base import Layouts
from kvbench.layouts.kv_heads import KVHeads, describe_kv_groups, kv_group_map
from kvbench.tasks.inspect import kv_memory_table


def test_group_map_32_query_8_kv_heads():
    mapping = kv_group_map(32, 8)
    assert mapping == [h // 4 for h in range(32)]
    assert [mapping.count(g) for g in range(8)] == [4] * 8
    text = describe_kv_groups(32, 8).splitlines()
    assert text[0] == "query heads 0-3 → KV head 0"
    assert text[7] == "query heads 28-31 → KV head 7"
    assert describe_kv_groups(4, 4).splitlines()[2] == "query head 2 → KV head 2"


def test_kv_table_has_a_row_per_cache_dtype():
    """Llama-2-7B's shape (32 layers, 32 KV heads, head_dim 128): 512 KiB per token in float16;
    an int8 cache stores 128 one-byte codes + one 4-byte scale per head, K and V, per layer; nvfp4
    64 bytes of codes + 8 one-byte scales (72 B, 3.56x fewer than float16), mxfp4 64 + 4."""
    llama2_7b = Layouts([KVHeads(None, 32, 32, 128)] * 32)
    rows = {r["dtype"]: r for r in kv_memory_table(llama2_7b, 4096, 2)}
    assert list(rows) == ["float32", "float16", "bfloat16", "int8", "float8_e4m3fn", "nvfp4", "mxfp4",
                          "nvfp4_rotated"]
    assert rows["nvfp4"]["per_token"] == rows["nvfp4_rotated"]["per_token"] == 2 * 32 * 32 * 72 == 147_456
    assert rows["mxfp4"]["per_token"] == 2 * 32 * 32 * 68
    assert round(rows["float16"]["per_token"] / rows["nvfp4"]["per_token"], 2) == 3.56
    assert rows["float16"]["per_token"] == 2 * 32 * 32 * 128 * 2 == 524_288
    assert rows["int8"]["per_token"] == rows["float8_e4m3fn"]["per_token"] == 2 * 32 * 32 * (128 + 4) == 270_336
    assert rows["int8"]["per_batch"] == 270_336 * 4096 * 2
