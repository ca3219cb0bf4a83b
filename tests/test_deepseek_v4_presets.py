"""conf/model/deepseek_v4_flash.yaml and deepseek_v4_pro.yaml: their parameters against the model cards
(Flash 284B total, 13B active; Pro 1.6T total, 49B active), and the bytes a sequence holds, adds per token
and a step reads, derived by hand from the config (docs/layout.md's V4 section): beside V3's MLA and V3.2's
DSA at 8k, 128k and 1M tokens."""

import pytest
from conftest import compose

from kvbench.footprint import parameter_counts
from kvbench.jobs.job_config import to_bench_config
from kvbench.layouts.build import build_layouts
from kvbench.layouts.compressed import CSA, HCA, SLIDING

E = 2  # bfloat16
W, D, DI, M, M2, TOPK = 128, 512, 128, 4, 128, {"deepseek_v4_flash": 512, "deepseek_v4_pro": 1024}


def job(model):
    return to_bench_config(compose(f"model={model}", "task=inspect", "runtime.dtype=bfloat16"))


@pytest.mark.parametrize("model,total,active,digits", [("deepseek_v4_flash", 284, 13, 0),
                                                       ("deepseek_v4_pro", 1.6e3, 49, -2)])
def test_the_v4_presets_have_their_model_cards_parameters(model, total, active, digits):
    """Total as the card rounds it (Flash 284B, Pro 1.6T) and active without the input embedding (a token
    reads one row of it), to the card's whole billions (Flash 13B, Pro 49B)."""
    j = job(model)
    counts = parameter_counts(j.model, j.attention)
    assert round(counts.total / 1e9, digits) == total
    assert round(counts.active / 1e9) == active


def hand_held(types, S, topk):
    """Held per sequence at S tokens, from the config by hand: every layer a ring of min(S, W) x D; a CSA
    layer floor(S / 4) entries of D + D_i, its buffers of 3 tokens x 2 (kv, gate) x (2D + 2D_i) and its
    overlap of 4 x (D + D_i) x (e + 4); an HCA layer floor(S / 128) entries of D and 127 x 2 x D buffered."""
    ring = min(S, W) * D * E
    per = {SLIDING: ring,
           CSA: ring + S // M * (D + DI) * E + (M - 1) * 2 * (2 * D + 2 * DI) * E + M * (D + DI) * (E + 4),
           HCA: ring + S // M2 * D * E + (M2 - 1) * 2 * D * E}
    read = {SLIDING: ring, CSA: ring + min(S // M, topk) * D * E + S // M * DI * E, HCA: ring + S // M2 * D * E}
    return sum(per[t] for t in types), sum(read[t] for t in types)


@pytest.mark.parametrize("model", ["deepseek_v4_flash", "deepseek_v4_pro"])
def test_held_per_sequence_and_read_per_step_are_the_hand_formula(model):
    j = job(model)
    layouts = build_layouts(j.model, j.attention)
    types = [lay.layer_type for lay in layouts]
    assert types == j.model.preset_layer_types
    for S in (8192, 131072, 1 << 20):
        held, read = hand_held(types, S, TOPK[model])
        assert layouts.cache_bytes(S, 1, E) == held and layouts.read_bytes(S, 1, E) == read, S


def test_v4_holds_an_order_of_magnitude_less_than_v3_and_v32_and_reads_less_at_long_context():
    """Per token past the ring, Flash in bfloat16: 21 CSA layers x (512 + 128) x 2 / 4 + 20 HCA layers x 512
    x 2 / 128 = 6,880 B, against V3's 61 x 576 x 2 = 70,272 B (the issue's figures); at 1M tokens a V4
    step reads less than a tenth of what V3.2's does (top 512 entries of the pool against DSA's top 2048
    tokens, but V3.2 reads every index key and V4 a quarter of them)."""
    flash = build_layouts(*(lambda j: (j.model, j.attention))(job("deepseek_v4_flash")))
    S = 1 << 20
    per_token = (flash.cache_bytes(S + 128, 1, E) - flash.cache_bytes(S, 1, E)) / 128
    assert per_token == 21 * (512 + 128) * 2 / 4 + 20 * 512 * 2 / 128 == 6880
    v3, v32 = (build_layouts(*(lambda j: (j.model, j.attention))(job(m))) for m in ("deepseek_v3", "deepseek_v32"))
    assert v3.bytes_per_token(E) == 61 * (512 + 64) * 2 == 70272
    assert 10 * flash.cache_bytes(S, 1, E) < v3.cache_bytes(S, 1, E)
    assert 10 * flash.read_bytes(S, 1, E) < v32.read_bytes(S, 1, E) < v3.read_bytes(S, 1, E)
