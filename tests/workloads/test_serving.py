"""``workload=serving`` composed as the CLI composes it and run in-process on the tiny model: the
record holds the whole timeline (requests, token times, samples), its metrics are those of the
timeline rebuilt from the record, the store's bytes are the formula's, and bad values are one
line naming the key before any work."""

import json

import pytest
import torch
from conftest import compose
from kv_formula import kv_cache_bytes

from kvbench.core.errors import ConfigError
from kvbench.jobs.job_config import to_bench_config
from kvbench.jobs.runner import run_job
from kvbench.results import read_record
from kvbench.serving.metrics import timeline_metrics
from kvbench.serving.record import timeline_from_record
from kvbench.workloads.serving import build_store, check_requests, requests_and_prompts

SMALL = ["workload=serving", "model=tiny", "model.max_seq_len=256", "workload.num_requests=10", "workload.rate=50",
         "workload.prompt.mean=24", "workload.prompt.lo=8", "workload.prompt.hi=48", "workload.output.lo=2",
         "workload.output.hi=8", "runtime.isolate=false", "wandb=disabled", "runtime.threads=1"]


@pytest.fixture(scope="module")
def paged_record(tmp_path_factory):
    out = tmp_path_factory.mktemp("serving")
    # 0.05 MB: 3 blocks of 16 tokens for tiny's 1 KB per token
    cfg = compose(*SMALL, "workload.kv_budget_mb=0.05", "slo.ttft_ms=1000", "slo.tpot_ms=500")
    torch.set_num_threads(1)
    run_job(cfg, out)
    return read_record(out / "results.json"), to_bench_config(cfg)


def test_a_serving_job_records_its_timeline_and_the_metrics_of_it(paged_record):
    record, cfg = paged_record
    assert record.status == "ok", record.error
    m = record.metrics
    rows = record.tables["serving_requests"]
    assert len(rows) == m["requests"] == m["requests_finished"] == 10
    assert all(r["output_tokens"] == r["output_len"] for r in rows)
    assert len(record.tables["serving_tokens"]) == sum(r["output_len"] for r in rows) == m["output_tokens"]
    assert len(record.tables["serving_samples"]) == m["iterations"] == m["samples"]
    assert m["kv_store"] == "paged" and m["block_size"] == 16 and m["kv_blocks_total"] == 3
    assert m["kv_bytes_per_token"] == kv_cache_bytes(2, 8, 8, 1, 1, 4)  # tiny: MHA-8, head_dim 8, float32
    assert m["kv_store_bytes"] == m["kv_store_bytes_formula"] == 3 * 16 * m["kv_bytes_per_token"]
    assert m["kv_budget_bytes"] == 50_000
    assert m["preemptions"] == sum(r["preemptions"] for r in rows)  # how many: the wall clock's (engine tests)
    assert m["block_waste_within_bound"] is True
    assert record.config["workload"]["kv_budget_mb"] == 0.05 and record.config["cache"]["block_size"] == 16
    assert record.config["slo"]["ttft_ms"] == 1000  # kept: goodput is judged by it
    assert "batch_size" not in record.config["workload"]  # the decode keys mean nothing here
    # the record alone gives back the timeline, and the timeline the record's metrics
    timeline = timeline_from_record(record.tables, m)
    again = json.loads(json.dumps(timeline_metrics(timeline, cfg.slo, intervals=False), default=str))
    for key, value in again.items():
        if "_ci_" not in key:
            assert m[key] == value or m[key] == pytest.approx(value), key
    assert record.series["serving_kv_blocks_used"] == [s["kv_blocks_used"] for s in record.tables["serving_samples"]]


@pytest.mark.parametrize("attention", ["gqa", "mla"])
def test_other_layouts_serve_through_the_config(tmp_path, attention):
    """... and with runtime.tensor_parallel=2 (served in one process: the split's figures by formula, issue 58)
    the record gives a GPU's part: GQA's K/V heads split in two, MLA's latent whole on both GPUs (2x), each
    GPU holding its part of budget // that sequences of its TP group of 2."""
    record = run_job(compose(*SMALL, "workload.kv_budget_mb=0.2", f"attention={attention}",
                             "runtime.tensor_parallel=2"), tmp_path)
    assert record.status == "ok", record.error
    m = record.metrics
    cfg = to_bench_config(compose(*SMALL, f"attention={attention}"))
    heads, width, latent = ((1, cfg.attention.kv_lora_rank + cfg.attention.qk_rope_head_dim, True) if attention == "mla"
                            else (cfg.attention.num_kv_heads, cfg.model.head_dim, False))
    assert m["kv_bytes_per_token"] == kv_cache_bytes(2, heads, width, 1, 1, 4, latent=latent)
    assert m["requests_finished"] == 10 and m["kv_store_bytes"] == m["kv_store_bytes_formula"]
    gpu = kv_cache_bytes(2, heads if latent else heads // 2, width, 1, 1, 4, latent=latent)
    assert m["gpu_split"] == "TP=2" and m["kv_bytes_per_token_gpu"] == gpu
    assert m["kv_sequence_bytes_gpu"] == gpu * m["kv_sequence_positions"]
    assert m["kv_replication_gpus"] == (2 if latent else 1)
    assert m["sequences_per_gpu"] == (200_000 // (gpu * m["kv_sequence_positions"])) / 2


def test_the_same_seed_gives_every_variant_the_same_requests():
    a = requests_and_prompts(to_bench_config(compose(*SMALL, "workload.kv_budget_mb=1", "attention=mqa")))
    b = requests_and_prompts(to_bench_config(compose(*SMALL, "workload.kv_budget_mb=1", "attention=mha")))
    assert a == b


def test_a_slot_store_from_a_trace_file(tmp_path):
    trace = tmp_path / "trace.csv"
    trace.write_text("arrival_s,prompt_len,output_len,prefix_id\n0,20,4,0\n0.01,30,3,0\n0.02,10,5,\n")
    cfg = compose(*SMALL, "workload.arrival=trace", f"workload.trace={trace}", "workload.prefix_len=16",
                  "workload.store=slots", "workload.kv_budget_mb=null", "workload.kv_budget_blocks=2")
    record = run_job(cfg, tmp_path / "run")
    assert record.status == "ok", record.error
    assert record.metrics["kv_store"] == "slots" and record.metrics["block_size"] == 32  # 30 + 3 - 1 positions
    assert [r["prefix_len"] for r in record.tables["serving_requests"]] == [16, 16, 0]
    assert record.metrics["requests_finished"] == 3 and record.metrics["running_max"] <= 2


@pytest.mark.parametrize("override, key", [
    ("workload.kv_budget_mb=0.01", "workload.kv_budget_mb=0.01: holds 0 blocks of 16 tokens"),
    ("workload.kv_budget_blocks=2", "workload.kv_budget_blocks=2: holds 2 blocks of 16 tokens"),
])
def test_a_budget_too_small_for_one_request_is_one_line_naming_the_key(override, key):
    cfg = compose(*SMALL, override) if "blocks" not in override else compose(*SMALL, "workload.kv_budget_mb=null",
                                                                             override)
    bench = to_bench_config(cfg)
    requests, _ = requests_and_prompts(bench)
    from kvbench.tasks.common import build_model

    with pytest.raises(ConfigError) as err:
        build_store(build_model(bench, torch.device("cpu")), bench.workload, bench.cache.block_size, requests)
    assert str(err.value).startswith(key) and "needs" in str(err.value) and "\n" not in str(err.value)


def test_the_job_records_the_refusal_as_invalid(tmp_path):
    record = run_job(compose(*SMALL, "workload.kv_budget_mb=0.01"), tmp_path)
    assert record.status == "invalid" and record.error.startswith("workload.kv_budget_mb=0.01")


@pytest.mark.parametrize("override, key", [
    ("workload.rate=0", "workload.rate=0"), ("workload.arrival=closed", "workload.arrival='closed'"),
    ("workload.prompt.dist=zipf", "workload.prompt.dist='zipf'"), ("cache.block_size=0", "cache.block_size=0"),
    ("workload.kv_budget_blocks=4", "workload.kv_budget_mb=64"), ("workload.prompt.hi=4096", "workload.prompt="),
    ("workload.max_prefill_tokens=0", "workload.max_prefill_tokens=0"),
    ("runtime.compile=graph", "runtime.compile='graph'"),
    ("workload.allocator=buddy", "workload.allocator='buddy'"),
    ("workload.allocator=unified workload.store=slots", "workload.allocator='unified': pages blocks on demand"),
    ("workload.state_checkpoint=sometimes", "workload.state_checkpoint='sometimes'"),
    ("workload.state_checkpoint=every_n", "workload.state_checkpoint_tokens=0: workload.state_checkpoint=every_n"),
    ("workload.state_checkpoint_tokens=64", "workload.state_checkpoint_tokens=64: only workload.state_checkpoint"),
    # a hybrid's attention layers take a quantized cache, in whole blocks (tiny's heads of 8: no 4-bit block)
    ("attention.layer_types=[linear_attention,full_attention] cache.dtype=mxfp4",
     "cache.dtype='mxfp4': stores blocks of 32 values of a head, and head_dim=8 is not a multiple of 32"),
])
def test_bad_serving_values_are_refused_before_work(override, key):
    with pytest.raises(ConfigError) as err:
        to_bench_config(compose("workload=serving", "model=tiny", *override.split()))
    assert str(err.value).startswith(key), str(err.value)
    assert "\n" not in str(err.value)


def test_a_checkpoint_off_the_raised_block_is_refused_before_the_model_is_built():
    """every_n must be a multiple of the attention block, which the unified allocator raises to
    hold a state: the plan, not the config alone, knows it."""
    hybrid = [*SMALL, "workload.kv_budget_mb=1", "attention.layer_types=[linear_attention,full_attention]",
              "model.linear_key_head_dim=32", "model.linear_value_head_dim=32", "workload.state_checkpoint=every_n",
              "workload.state_checkpoint_tokens=16"]  # a state of ~17 KB: 48 positions of the attention layer
    check_requests(to_bench_config(compose(*hybrid)))  # per_kind keeps blocks of 16
    cfg = to_bench_config(compose(*hybrid, "workload.allocator=unified"))
    with pytest.raises(ConfigError, match=r"^workload.state_checkpoint_tokens=16: with workload.state_checkpoint="
                                          r"every_n it must be a positive multiple of the attention block \(\d+ "
                                          r"tokens with workload.allocator=unified\)"):
        check_requests(cfg)


@pytest.mark.parametrize("overrides", [
    ["attention=gqa", "attention.window=8", "attention.global_every=2"],
    ["attention.layer_types=[linear_attention,full_attention]"],
    ["attention.layer_types=[linear_attention,full_attention]", "workload.allocator=unified"],
    ["attention=gqa", "cache.dtype=int8"],
    ["attention=gqa", "attention.window=8", "cache.dtype=float8_e4m3fn"],
])
def test_every_layout_serves_through_the_config(tmp_path, overrides):
    """Windows, a Gated DeltaNet hybrid under both allocators, int8 and float8 pages: served end to
    end, the store's bytes the formula of its groups, the reserve within the budget."""
    record = run_job(compose(*SMALL, "workload.kv_budget_mb=0.4", "workload.prefix_len=16", *overrides), tmp_path)
    assert record.status == "ok", record.error
    m = record.metrics
    assert m["requests_finished"] == 10
    assert m["kv_reserved_bytes"] <= m["kv_budget_bytes"]
    if m["kv_allocator"] == "per_kind":
        assert m["kv_store_bytes"] == m["kv_store_bytes_formula"]
    # the capacity figures: at least the formula's bytes per sequence (block rounding, whole windows and pages)
    assert m["kv_sequence_reserved_bytes"] >= m["kv_sequence_bytes_formula"] > 0
    assert 1 <= m["kv_sequences_fit"] <= m["kv_sequences_fit_formula"]
    assert m["kv_sequences_fit"] * m["kv_sequence_reserved_bytes"] <= m["kv_reserved_bytes"]
    if "linear_attention" in str(overrides):
        assert m["state_checkpoints_saved"] > 0 and m["state_checkpoint_bytes_max"] > 0


@pytest.mark.parametrize("attention", ["mha", "gqa", "mqa"])
def test_a_unified_pool_reserves_what_its_store_holds(tmp_path, attention):
    """MQA in 2 MB (a page of one layer's block: 1,024 bytes; a block: 2 pages of the 2 layers)
    reported 1,999,872 bytes reserved against 1,998,848 stored: the budget's 1,953rd page, which no
    block can use, was counted. One group of layers: what is reserved is what is stored, the formula."""
    record = run_job(compose(*SMALL, "workload.kv_budget_mb=2", f"attention={attention}",
                             "workload.allocator=unified"), tmp_path)
    assert record.status == "ok", record.error
    m = record.metrics
    assert m["kv_reserved_bytes"] == m["kv_store_bytes"] == m["kv_store_bytes_formula"] <= m["kv_budget_bytes"]
    if attention == "mqa":
        assert m["kv_reserved_bytes"] == 1_998_848


def test_a_hybrids_unified_pool_allocates_what_it_reserves(tmp_path):
    """Gated DeltaNet, a window of 8 and full attention in one unified pool of 1 MB: three groups
    (full, window, states) share one byte pool, so the store holds what the allocator reserves (it
    held about three times as much, a buffer per group), its pages x its page."""
    record = run_job(compose(*SMALL, "workload.kv_budget_mb=1", "workload.allocator=unified", "model.num_layers=4",
                             "attention.layer_types=[linear_attention,sliding_attention,full_attention,linear_attention]",
                             "attention.window=8"), tmp_path)
    assert record.status == "ok", record.error
    m = record.metrics
    assert m["kv_reserved_bytes"] == m["kv_store_bytes"] == m["kv_store_bytes_formula"] <= m["kv_budget_bytes"]
    assert m["requests_finished"] == 10


def test_a_state_raises_the_unified_block_and_the_record_shows_what_prefix_caching_loses(tmp_path, scripted_clock):
    """A Gated DeltaNet + MQA hybrid whose requests share a 32-token system prompt: per_kind pages attention
    in blocks of cache.block_size=16 and caches the prefix's 2 whole blocks; unified raises the block to the
    first multiple of 16 whose page holds a layer's state (vLLM's rule), longer than the prefix, so no
    request finds it cached. The record says both: the block each used and the hit rate it gave.
    On the scripted clock: on the wall clock, a loaded machine once admitted every request together."""
    hybrid = [*SMALL, "workload.kv_budget_mb=1", "workload.prefix_len=32", "workload.rate=1000", "attention=mqa",
              "attention.layer_types=[linear_attention,full_attention]"]
    m = {a: run_job(compose(*hybrid, f"workload.allocator={a}"), tmp_path / a).metrics for a in ("per_kind", "unified")}
    # tiny's Gated DeltaNet layer: 16 value heads' 4 x 4 float32 state + 3 conv taps of 2 x 8 x 4 + 16 x 4 channels
    layer_state = 16 * 4 * 4 * 4 + 3 * (2 * 8 * 4 + 16 * 4) * 4
    per_position = 2 * 1 * 8 * 4  # the MQA layer's K and V, one head of 8, float32
    raised = -(-layer_state // (16 * per_position)) * 16
    assert m["per_kind"]["kv_block_tokens"] == 16 and m["unified"]["kv_block_tokens"] == raised == 48
    assert m["per_kind"]["prefix_hit_rate"] > 0 == m["unified"]["prefix_hit_tokens"]


@pytest.mark.parametrize("ttft_ms, probes", [(1e6, [50.0, 100.0, 200.0]), (1e-6, [50.0])])
def test_a_rate_search_records_its_curve_and_the_run_at_its_answer(tmp_path, ttft_ms, probes):
    """Targets nothing can miss (the SLO never binds: every rate up to hi measured, the answer at
    least hi) or nothing can meet (the lowest rate fails): the search's outcome whatever the clock."""
    cfg = compose(*SMALL, "workload.num_requests=6", "workload.kv_budget_mb=1", "workload.search.enabled=true",
                  "workload.search.lo=50", "workload.search.hi=200", f"slo.ttft_ms={ttft_ms}")
    record = run_job(cfg, tmp_path)
    assert record.status == "ok", record.error
    m, curve = record.metrics, record.tables["serving_rate_curve"]
    assert [row["rate"] for row in curve] == probes and m["max_rate_probes"] == len(probes)
    assert m["max_rate_under_slo"] is None and m["max_rate_under_slo_reason"]
    if ttft_ms > 1:
        assert all(row["ok"] for row in curve) and m["max_rate_at_least"] == 200.0 and m["timeline_rate"] == 200.0
    else:
        assert m["max_rate_failed_at"] == 50.0 and "ttft_ms" in m["max_rate_bound"] and m["timeline_rate"] == 50.0
    # the recorded timeline is the run at timeline_rate: its arrivals are the seed's at that rate
    requests, _ = requests_and_prompts(to_bench_config(cfg), m["timeline_rate"])
    assert [r["arrival_s"] for r in record.tables["serving_requests"]] == [r.arrival_s for r in requests]
    at_base, _ = requests_and_prompts(to_bench_config(cfg))
    scale = to_bench_config(cfg).workload.rate / m["timeline_rate"]  # the same gaps, scaled
    assert [r.arrival_s for r in requests] == pytest.approx([r.arrival_s * scale for r in at_base])


def test_a_rate_search_needs_an_slo():
    with pytest.raises(ConfigError, match=r"^workload.search.enabled=True: the rate search needs an SLO"):
        to_bench_config(compose(*SMALL, "workload.kv_budget_mb=1", "workload.search.enabled=true"))
