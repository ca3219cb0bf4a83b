"""task=compare of the layouts beyond MHA/GQA/MQA: MLA and a 5:1 hybrid (five local layers of a
window W to one global) run side by side with MHA and GQA under distinguishable names, every
variant's timed cache allocates exactly the KV formula (checked against arithmetic from the
shapes, not the formula's code), and a windowed variant's cost is fitted below and past W."""

import numpy as np
import pytest
import torch
from conftest import compose

from kvbench.config.layer_pattern import variant_key, variant_label
from kvbench.config.model import AttentionConfig
from kvbench.core.errors import ConfigError
from kvbench.jobs.job_config import to_bench_config
from kvbench.jobs.runner import run_job
from kvbench.tasks.common import build_model
from kvbench.tasks.compare import summarize, variants

# tiny with 6 layers: global_every=6 makes layer 5 global and 0-4 local (Gemma 3's 5:1)
TINY = ["wandb.mode=disabled", "task=compare", "model=tiny", "model.max_seq_len=64", "model.num_layers=6",
        "runtime.threads=1"]
VARIANTS = "compare.variants=[mha,gqa,mla,mha:w8:g6]"
L, H, D, B, W = 6, 8, 8, 2, 8  # tiny: 8 heads of 8; float32
R, ROPE = 4 * D, D // 2  # attention=mla's default ranks: kv_lora_rank 4 x head_dim, qk_rope half of it


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    cfg = compose(*TINY, VARIANTS, "compare.contexts=[2,4,8,16,32]", "compare.steps=2", "runtime.warmup=0",
                  "runtime.repeats=3", f"workload.batch_size={B}")
    return run_job(cfg, tmp_path_factory.mktemp("compare_layouts"))


def test_mla_and_a_hybrid_are_compared_under_distinguishable_names(record):
    assert record.status == "ok", record.error
    rows = record.tables["compare"]
    assert [r["variant"] for r in rows] == ["mha_kv8", "gqa_kv2", f"mla_r{R}", "mha_kv8_w8_5to1"]
    assert [r["layout"] for r in rows] == ["mha kv=8", "gqa kv=2", f"mla r={R}", "mha kv=8 w=8 5:1"]
    assert {t["variant"] for t in record.tables["trials"]} == {r["variant"] for r in rows}
    for v in ("mha_kv8", "gqa_kv2", f"mla_r{R}", "mha_kv8_w8_5to1"):
        assert record.metrics[f"{v}_step_ms_ctx32"] > 0 and f"{v}_decode_us_per_1k_ctx" in record.metrics
    assert record.metrics["window_split_ctx"] == W
    assert rows[2]["weights"].startswith("drawn") and rows[3]["weights"] == "mha's"


def test_every_variants_cache_allocates_the_formula(record):
    """Allocated bytes (the timed cache's storage) == the formula == the arithmetic of each layout:
    K and V of H_kv heads of D per position per layer; MLA one latent of R + d_rope; a local layer
    at most W positions. The cache holds the longest context + 1 positions for B sequences."""
    S = 33
    per_position = {"mha_kv8": 2 * H * D * 4 * L, "gqa_kv2": 2 * 2 * D * 4 * L, f"mla_r{R}": (R + ROPE) * 4 * L}
    expected = {v: per_position[v] * S * B for v in per_position}
    expected["mha_kv8_w8_5to1"] = 2 * H * D * 4 * (5 * W + 1 * S) * B
    for row in record.tables["compare"]:
        v = row["variant"]
        assert row["kv_cache_bytes"] == row["kv_cache_bytes_formula"] == expected[v], v
    hybrid = next(r for r in record.tables["compare"] if r["variant"] == "mha_kv8_w8_5to1")
    for ctx in (2, 4, 8, 16, 32):  # one sequence at each context: five layers stop at W
        assert hybrid[f"kv_bytes_ctx{ctx}"] == 2 * H * D * 4 * (5 * min(ctx, W) + ctx)
    # the formula's growth past W is the one global layer's: a sixth of MHA's
    mha = record.tables["compare"][0]
    assert hybrid["kv_bytes_per_1k_ctx_past_w"] == pytest.approx(mha["kv_bytes_per_1k_ctx_past_w"] / 6)
    assert hybrid["kv_bytes_per_1k_ctx_below_w"] == mha["kv_bytes_per_1k_ctx_below_w"] == 2 * H * D * 4 * L * 1e3
    assert hybrid["kv_bytes_ratio"] == (5 * W + 32) / (6 * 32)


def test_variants_hold_the_mha_models_tensors_outside_attention():
    cfg = to_bench_config(compose(*TINY, VARIANTS, "compare.contexts=[4,8,16]"))
    base = build_model(cfg.__class__(**{**cfg.__dict__, "attention": AttentionConfig("mha", window=0)}),
                       torch.device("cpu"))
    runs = variants(cfg, base)
    base_state = base.state_dict()
    for v in runs:
        state = v.model.state_dict()
        for name, tensor in state.items():
            if ".attn." not in name:  # shared, not copied
                assert tensor.data_ptr() == base_state[name].data_ptr(), (v.label, name)
    hybrid = runs[3].model
    assert list(hybrid.layouts.windows) == [W] * 5 + [None]
    for name in base_state:  # a window is only a mask: the hybrid is MHA's weights exactly
        assert torch.equal(hybrid.state_dict()[name], base_state[name])
    assert runs[2].model.layouts[0].stored == (1, (R + ROPE,))


def test_a_windowed_cost_flattens_past_w_on_synthetic_trials():
    """Steps that cost a + slope x (positions the layers read): below W every layer grows, past
    W one of six; the fits and the paired ratio recover it, the formula's ratio beside it."""
    contexts, Wn = [256, 512, 768, 1024, 2048, 3072, 4096], 1024
    slope = 1e-3  # ms per position read per layer
    rng = np.random.default_rng(2)
    trials = []
    for r in range(8):
        drift = 1 + 0.05 * rng.random()
        for v, local in (("full", 0), ("hybrid", 5)):
            for c in contexts:
                read = local * min(c, Wn) + (6 - local) * c
                trials.append({"round": r, "variant": v, "context": c, "step_ms": drift * (5.0 + slope * read)})
    kv = {v: {"kv_bytes_per_token": 6, **{f"kv_bytes_ctx{c}": local * min(c, Wn) + (6 - local) * c for c in contexts}}
          for v, local in (("full", 0), ("hybrid", 5))}
    full, hybrid = summarize(trials, ["full", "hybrid"], contexts, kv, Wn)
    assert hybrid["decode_us_per_1k_ctx_below_w"] == pytest.approx(6 * slope * 1e6, rel=0.06)
    assert hybrid["decode_us_per_1k_ctx_past_w"] == pytest.approx(slope * 1e6, rel=0.06)
    assert hybrid["past_w_slope_ratio"] == pytest.approx(1 / 6, rel=0.1)
    assert hybrid["past_w_slope_ratio_ci_low"] <= hybrid["past_w_slope_ratio"] <= hybrid["past_w_slope_ratio_ci_high"]
    assert full["past_w_slope_ratio"] == pytest.approx(1, rel=0.1)
    assert hybrid["slope_ratio_past_w"] == pytest.approx(1 / 6, rel=0.1) and full["slope_ratio_past_w"] == 1
    assert hybrid["kv_bytes_per_1k_ctx_past_w"] / hybrid["kv_bytes_per_1k_ctx_below_w"] == pytest.approx(1 / 6)


def test_labels_name_each_layout_once():
    cfg = to_bench_config(compose(*TINY, "compare.variants=[mha,4,mqa:w16,gqa:w16:g6,mla:r16,mla:r16:w16]",
                                  "compare.contexts=[4,8,16]"))
    labels = [variant_label(a) for a in cfg.compare.attentions(cfg.model)]
    assert labels == ["mha kv=8", "gqa kv=4", "mqa kv=1 w=16", "gqa kv=2 w=16 5:1", "mla r=16", "mla r=16 w=16"]
    assert [variant_key(x) for x in labels][3] == "gqa_kv2_w16_5to1"
    types = ["sliding_attention", "full_attention"] * 3
    assert variant_label({"type": "gqa", "num_kv_heads": 2, "window": 8, "layer_types": types}) == "gqa kv=2 w=8 1:1"
    assert variant_label(AttentionConfig("mha", num_kv_heads=8), "int8") == "mha kv=8 int8"


@pytest.mark.parametrize("variants_, needle", [
    ("[mha,mha:g6]", "needs a window"),
    ("[mha,mha:x3]", "option 'x3'"),
    ("[mha,mha:w0]", "option 'w0'"),
    ("[mha,gqa:r8]", "attention.kv_lora_rank=8"),
    ("[mha:w8,mha:w8]", "two variants are the same layout"),
    ("[mha,mha:w8:w9]", "each once"),
])
def test_bad_variant_options_name_the_key(variants_, needle):
    with pytest.raises(ConfigError) as err:
        to_bench_config(compose(*TINY, f"compare.variants={variants_}", "compare.contexts=[4,8,16]"))
    assert str(err.value).startswith("compare.variants") and needle in str(err.value) and "\n" not in str(err.value)


def test_dsa_and_shared_kv_variants_run_side_by_side(tmp_path):
    """:k<K> (DSA's top-k) and :s<N> (the last N layers share K/V) are variants like the others:
    named by their layout, their caches allocating the arithmetic of their shapes (DSA: a latent
    and an index key of 2 x d_rope per position; 3 of 6 shared layers: half of MHA's), the shared
    variant holding MHA's weights except the shared layers' K/V projections; :s0 is refused."""
    cfg = compose(*TINY, "compare.variants=[mha,mla:k4,mha:s3]", "compare.contexts=[4,8,16]", "compare.steps=1",
                  "runtime.warmup=0", "runtime.repeats=2", f"workload.batch_size={B}")
    record = run_job(cfg, tmp_path)
    assert record.status == "ok", record.error
    rows = {r["variant"]: r for r in record.tables["compare"]}
    assert list(rows) == ["mha_kv8", f"mla_r{R}_topk4", "mha_kv8_kvshare3"]
    S = 17
    assert rows[f"mla_r{R}_topk4"]["kv_cache_bytes"] == (R + ROPE + 2 * ROPE) * 4 * L * S * B
    assert rows["mha_kv8_kvshare3"]["kv_cache_bytes"] == 2 * H * D * 4 * (L - 3) * S * B
    typed = to_bench_config(cfg)
    base = build_model(typed.__class__(**{**typed.__dict__, "attention": AttentionConfig("mha", window=0)}),
                       torch.device("cpu"))
    shared = variants(typed, base)[2].model
    assert [layer.kv_source for layer in shared.layouts] == [None] * 3 + [2] * 3
    assert set(base.state_dict()) - set(shared.state_dict()) == {f"blocks.{i}.attn.{w}.weight" for i in (3, 4, 5)
                                                                  for w in ("wk", "wv")}
    with pytest.raises(ConfigError, match="option 's0'"):
        to_bench_config(compose(*TINY, "compare.variants=[mha,mha:s0]", "compare.contexts=[4,8,16]"))


def test_the_models_own_pattern_is_left_out_of_the_mha_base(tmp_path):
    """Every variant names its own pattern, so the MHA base has none of the model's: no window, no KV
    sharing (a base that kept the model's 2 shared layers had no K/V of theirs for a variant without
    sharing, which failed to load); a base given with the model's window is built again without it,
    holding the same weights (a window is only a mask)."""
    own = ["model.preset_window=4", "model.preset_global_every=3"]
    cfg = compose(*TINY, *own, "model.preset_kv_shared_layers=2", "compare.variants=[mha,gqa,mha:s3]",
                  "compare.contexts=[4,8,16]", "compare.steps=1", "runtime.warmup=0", "runtime.repeats=2",
                  f"workload.batch_size={B}")
    record = run_job(cfg, tmp_path)
    assert record.status == "ok", record.error
    rows = {r["variant"]: r for r in record.tables["compare"]}
    assert list(rows) == ["mha_kv8", "gqa_kv2", "mha_kv8_kvshare3"]
    S = 17
    assert rows["mha_kv8"]["kv_cache_bytes"] == 2 * H * D * 4 * L * S * B  # every layer its own K/V, no ring
    assert rows["mha_kv8_kvshare3"]["kv_cache_bytes"] == 2 * H * D * 4 * (L - 3) * S * B
    typed = to_bench_config(compose(*TINY, *own, "compare.variants=[mha,gqa]", "compare.contexts=[4,8,16]"))
    base = build_model(typed.__class__(**{**typed.__dict__, "attention": AttentionConfig("mha")}), torch.device("cpu"))
    assert list(base.layouts.windows) == [4, 4, None] * 2  # the model's own
    mha = variants(typed, base)[0].model
    assert list(mha.layouts.windows) == [None] * L
    for name, tensor in base.state_dict().items():
        assert torch.equal(mha.state_dict()[name], tensor)


@pytest.mark.parametrize("contexts", [[256, 512, 768], [2048, 3072, 4096]])
def test_a_window_beyond_or_below_every_context_gives_no_split_fit_and_no_error(contexts):
    """A windowed variant whose W is past every context timed (or below every one) leaves one side
    of the split empty: that side's fit and the ratio across it are null, the rest of the table is
    there (it raised a ValueError from the paired ratio, and the job's record was an error)."""
    trials = [{"round": r, "variant": v, "context": c, "step_ms": 5.0 + 1e-3 * c * (1 + r / 10)}
              for r in range(3) for v in ("full", "hybrid") for c in contexts]
    kv = {v: {"kv_bytes_per_token": 6, **{f"kv_bytes_ctx{c}": 6 * c for c in contexts}} for v in ("full", "hybrid")}
    full, hybrid = summarize(trials, ["full", "hybrid"], contexts, kv, 1024)
    assert hybrid["past_w_slope_ratio"] is None and hybrid["decode_us_per_1k_ctx"] > 0
    assert hybrid["slope_ratio"] == pytest.approx(1.0)
