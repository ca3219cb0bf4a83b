"""task=inspect's text: the head→group map."""

from kvbench.inspection import describe_kv_groups
from kvbench.model import kv_group_map


def test_group_map_32_query_8_kv_heads():
    mapping = kv_group_map(32, 8)
    assert mapping == [h // 4 for h in range(32)]
    assert [mapping.count(g) for g in range(8)] == [4] * 8
    text = describe_kv_groups(32, 8).splitlines()
    assert text[0] == "query heads 0-3 → KV head 0"
    assert text[7] == "query heads 28-31 → KV head 7"
    assert describe_kv_groups(4, 4).splitlines()[2] == "query head 2 → KV head 2"
