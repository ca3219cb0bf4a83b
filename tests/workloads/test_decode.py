"""The decode workload: fidelity in every run's record, the compile modes against eager, the overhead floor."""

import json

import pytest
import torch
from conftest import BENCH_OVERRIDES, compose, make_decoder

from kvbench.cache import cache_for
from kvbench.generate import compile_phase, compiled_step, greedy_generate
from kvbench.jobs.runner import run_job
from kvbench.measure.roofline import decode_bytes_read
from kvbench.workloads.decode import DecodeTimings, floor_model, kv_cost, summarize_decode, time_decode


def job(tmp_path, *overrides):
    return run_job(compose("wandb.mode=disabled", "runtime.peak_gb_per_s=10", *overrides), tmp_path)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_decode_run_reports_fidelity(tmp_path, dtype):
    result = job(tmp_path, "model=tiny", "workload.prompt_len=16", "workload.gen_len=6", "workload.batch_size=3",
                 f"runtime.dtype={dtype}", "runtime.repeats=1")
    m = result.metrics
    assert result.status == "ok", result.error
    assert m["fidelity_max_abs_logit_diff"] < (1e-4 if dtype == "float32" else 0.5)
    assert m["fidelity_top1_agreement"] >= (1.0 if dtype == "float32" else 0.8)
    if dtype == "bfloat16":  # half precision differs from float32, but boundedly
        assert 0 < m["dtype_max_abs_logit_diff"] < 1.0 and m["dtype_top1_agreement"] >= 0.5
    else:
        assert "dtype_max_abs_logit_diff" not in m
    on_disk = json.loads((tmp_path / "results.json").read_text())["metrics"]
    assert on_disk["fidelity_max_abs_logit_diff"] == m["fidelity_max_abs_logit_diff"]


def test_int8_cache_run_records_its_bytes_quality_and_roofline(tmp_path):
    """cache.dtype=int8 end to end: the cache holds 1-byte codes + 4-byte scales (its tensors'
    bytes equal the formula), the quantization's cost against the unquantized cache is recorded
    with its method, the roofline reads the stored bytes and the record keeps cache.dtype."""
    result = job(tmp_path, "model=tiny", "workload.prompt_len=16", "workload.gen_len=6", "workload.batch_size=3",
                 "cache.dtype=int8", "runtime.repeats=1")
    m = result.metrics
    assert result.status == "ok", result.error
    layers, kv, head_dim, seq = 2, result.config["attention"]["num_kv_heads"], 8, 22  # model=tiny
    assert m["kv_cache_bytes"] == m["kv_cache_bytes_formula"] == 2 * layers * kv * seq * 3 * (head_dim + 4)
    assert m["kv_bytes_read_per_step"] == int(2 * layers * kv * 3 * (head_dim + 4) * (16 + 7 / 2))  # mean context
    assert 0 < m["kvq_max_abs_logit_diff"] < 0.1 and m["kvq_top1_agreement"] >= 0.8
    assert {"kvq_max_abs_logit_diff", "kvq_top1_agreement"} <= set(result.methods)
    assert result.config["cache"]["dtype"] == "int8"


@pytest.mark.e2e
def test_default_compile_matches_eager():
    """runtime.compile=true (default): the compiled decoder gives eager's logits; compile time is apart."""
    model = make_decoder(2, num_layers=1)
    prompt = torch.randint(0, 97, (2, 8))
    cache = cache_for(model, "static", 2, 20)
    compiled, step = compiled_step("default", model, torch.device("cpu"))
    metrics = compile_phase(lambda: greedy_generate(compiled, prompt, 3, cache, step=step), torch.device("cpu"),
                            "default")
    assert metrics["compile_s"] > 0 and metrics["compiled_graphs"] >= 1
    cache.reset()
    got = greedy_generate(compiled, prompt, 6, cache, keep_logits=True, step=step)
    want = greedy_generate(model, prompt, 6, cache_for(model, "static", 2, 20), keep_logits=True)
    torch.testing.assert_close(got.logits, want.logits, atol=1e-5, rtol=0)


@pytest.mark.e2e
def test_graph_run_records_compile_recompiles_and_the_bytes_its_window_reads(tmp_path):
    """runtime.compile=graph end to end: compiled before the trials (compile_s, one graph for
    the one context bucket), no recompile during them, fidelity checked on the compiled step,
    and the roofline counting the positions the window reads (the whole cache of 129), not the
    mean context (125)."""
    result = job(tmp_path, *BENCH_OVERRIDES, "workload.prompt_len=120", "workload.gen_len=9",
                 "runtime.compile=graph", "runtime.repeats=1")
    m = result.metrics
    assert result.status == "ok", result.error
    # One bucket, so at most one graph (none when an earlier test in this process compiled it).
    assert m["compile_s"] > 0 and m["compiled_graphs"] <= 1 and m["recompiles"] == 0
    assert m["fidelity_max_abs_logit_diff"] < 1e-4 and m["fidelity_top1_agreement"] == 1.0
    layers, kv_heads, head_dim, batch = 2, 8, 16, 2  # model=tiny d_model=128, its own layout: 8 heads, 8 KV heads
    assert m["kv_bytes_read_per_step"] == 2 * layers * kv_heads * head_dim * 129 * batch * 4
    assert m["overhead_ms_per_step"] > 0
    assert m["overhead_share"] == pytest.approx(m["overhead_ms_per_step"] / m["decode_ms_p50"])
    assert {"compile_s", "recompiles", "overhead_ms_per_step", "probe_gemv_gb_per_s"} <= result.methods.keys()


def test_floor_model_runs_the_same_operations_on_almost_no_bytes():
    """The overhead floor keeps the layers (so a step runs the same operations, whatever the
    grouping) and reads a tiny fraction of the bytes."""
    model = make_decoder(2)
    floor = floor_model(model)
    assert floor.config.num_layers == 2 and floor.dtype == model.dtype
    ops = lambda m: [type(mod).__name__ for mod in m.modules()]
    assert ops(floor) == ops(model)
    assert decode_bytes_read(floor, 1, 1)[0] * 50 < decode_bytes_read(model, 1, 1)[0]


@pytest.mark.cuda
def test_decode_on_a_gpu_records_events_allocation_and_nvml(tmp_path):
    """bf16 on the GPU: CUDA-event timing, the static cache's allocation seen by torch equals the
    formula up to the allocator's 512-byte rounding, NVML fields filled, energy per token."""
    result = job(tmp_path, "model=tiny", "workload.prompt_len=64", "workload.gen_len=16", "workload.batch_size=4",
                 "runtime.dtype=bfloat16", "runtime.device=cuda", "runtime.repeats=2")
    m = result.metrics
    assert result.status == "ok", result.error
    assert m["timing_method"] == "cuda_events" and m["decode_ms_p50"] > 0
    layers = 2  # model=tiny
    assert m["kv_cache_bytes_formula"] <= m["kv_cache_bytes_torch"] <= m["kv_cache_bytes_formula"] + 2 * layers * 512
    assert m["kv_cache_bytes"] == m["kv_cache_bytes_formula"]
    assert m["nvml_reason"] is None and m["nvml_peak_used_bytes"] > 0
    assert m["torch_peak_allocated_bytes"] >= m["kv_cache_bytes"] + m["weight_bytes"]
    assert m["energy_mj_per_token"] is None or m["energy_mj_per_token"] >= 0
    # bf16 on random weights: bounded differences (argmax flips where the logits are nearly flat)
    assert m["fidelity_max_abs_logit_diff"] < 0.5 and m["fidelity_top1_agreement"] >= 0.5
    assert 0 < m["dtype_max_abs_logit_diff"] < 1.0


@pytest.mark.cuda
def test_a_gpu_out_of_memory_is_an_oom_record_that_keeps_what_was_measured(tmp_path):
    free, _ = torch.cuda.mem_get_info()
    # A static cache 10x the free memory, from a short prompt (the prompt tensor stays small):
    # model=tiny, GQA: 2 layers x 2 (K, V) x 2 KV heads x 8 dims x 4 bytes = 256 bytes per position.
    batch = 10 * free // (256 * 4008)
    result = job(tmp_path, "model=tiny", "workload.prompt_len=8", "workload.gen_len=4000",
                 f"workload.batch_size={batch}", "runtime.device=cuda", "runtime.repeats=1")
    assert result.status == "oom", (result.status, result.error)
    assert "out of memory" in result.error.lower()
    assert result.metrics["weight_bytes"] > 0 and result.metrics["kv_cache_bytes_formula"] > free


def test_min_time_keeps_running_trials_until_both_the_repeats_and_the_time_are_reached():
    """A fake clock that advances one second per finished trial: no timing luck involved."""
    model = make_decoder(2, num_layers=1)
    prompt = torch.randint(0, 97, (1, 4))
    cache = cache_for(model, "static", 1, 8)
    finished = []
    tick, clock = (lambda description=None: finished.append(1)), (lambda: float(len(finished)))

    def trials(warmup, repeats, min_time_s):
        finished.clear()
        t = time_decode(model, prompt, 3, cache, warmup, repeats, "cpu", tick, min_time_s=min_time_s, clock=clock)
        assert len(t.prefill_ms) == len(t.decode_ms) == len(finished) - warmup
        return len(t.decode_ms)

    assert trials(warmup=1, repeats=2, min_time_s=5) == 5  # the time is the floor: 5 s of 1-s trials
    assert trials(warmup=1, repeats=7, min_time_s=5) == 7  # the repeats are
    assert trials(warmup=0, repeats=2, min_time_s=0) == 2


def test_a_run_records_the_trials_it_ran(tmp_path):
    result = job(tmp_path, "model=tiny", "workload.prompt_len=4", "workload.gen_len=2", "runtime.repeats=2",
                 "runtime.min_time_s=0.3", "runtime.fidelity=false", "runtime.threads=1")
    m = result.metrics
    assert result.status == "ok", result.error
    # at least the repeats; more while under 0.3 s (how many depends on the machine, not asserted)
    assert m["trials_run"] >= 2 and m["prefill_ms_n"] == m["trials_run"]
    assert m["decode_ms_p50_n"] == m["tokens_per_s_n"] == 2 * m["trials_run"]  # tokens/s from the steps
    if m["trials_run"] >= 6:
        assert m["prefill_ms_ci_low"] <= m["prefill_ms"] <= m["prefill_ms_ci_high"]
    else:  # too few trials for an interval: none, and the reason
        assert m["prefill_ms_ci_low"] is None and "needs at least 6" in m["prefill_ms_ci_reason"]


def test_summary_takes_the_true_median_of_an_even_number_of_trials():
    t = DecodeTimings(prefill_ms=[4.0, 1.0, 3.0, 2.0], decode_ms=[[1.0, 1.0]] * 4, decode_host_ms=[[1.0, 1.0]] * 4)
    m = summarize_decode(t, batch_size=1)
    assert m["prefill_ms"] == 2.5 and m["e2e_ms"] == 4.5  # torch.median gave 2.0 and 4.0
    assert m["tokens_per_s"] == 1000.0 and m["tokens_per_s_ci_low"] == m["tokens_per_s_ci_high"] == 1000.0
    assert m["trials_run"] == 4


def test_a_decode_record_reports_no_kv_cost_slope(tmp_path):
    """Within one decode, context and time within the trial rise together: a drift of the machine
    read as a KV cost (-1745 µs per 1k positions once, on a quiet machine). A decode record leaves
    the slope null and says why, however long the decode."""
    assert kv_cost()["decode_us_per_1k_ctx"] is None and kv_cost()["decode_ms_at_ctx0"] is None
    result = job(tmp_path, "model=tiny", "workload.prompt_len=4", "workload.gen_len=300", "runtime.repeats=1",
                 "runtime.warmup=0", "runtime.fidelity=false", "runtime.threads=1")
    m = result.metrics
    assert result.status == "ok", result.error
    assert m["decode_us_per_1k_ctx"] is None and m["decode_us_per_1k_ctx_ci_low"] is None
    assert "drift" in m["decode_us_per_1k_ctx_reason"] and "task=compare" in m["decode_us_per_1k_ctx_reason"]
    assert not any(item["metric"].endswith("us_per_1k_ctx") for item in result.implausible)
