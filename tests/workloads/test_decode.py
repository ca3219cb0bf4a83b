"""The decode workload: fidelity in every run's record, the compile modes against eager, the overhead floor."""

import json

import pytest
import torch
from conftest import BENCH_OVERRIDES, make_decoder
from hydra import compose, initialize_config_dir

from kvbench.cache import cache_for
from kvbench.config import CONF_DIR
from kvbench.generate import compile_phase, compiled_step, greedy_generate
from kvbench.measure.roofline import decode_bytes_read
from kvbench.runner import run_job
from kvbench.workloads.decode import floor_model


def job(tmp_path, *overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["wandb.mode=disabled", "runtime.peak_gb_per_s=10", *overrides])
    return run_job(cfg, tmp_path)


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
    layers, kv_heads, head_dim, batch = 2, 2, 16, 2  # model=tiny d_model=128 attention=gqa: 8 heads, 2 KV heads
    assert m["kv_bytes_read_per_step"] == 2 * layers * kv_heads * head_dim * 129 * batch * 4
    assert m["overhead_ms_per_step"] > 0
    assert m["overhead_share"] == pytest.approx(m["overhead_ms_per_step"] / m["decode_ms_p50"])
    assert {"compile_s", "recompiles", "overhead_ms_per_step", "probe_gemv_gb_per_s"} <= result.methods.keys()


def test_floor_model_runs_the_same_operations_on_almost_no_bytes():
    """The overhead floor keeps the layers, heads and grouping (so a step runs the same
    operations) and reads a tiny fraction of the bytes."""
    model = make_decoder(2)
    floor = floor_model(model)
    assert (floor.config.num_layers, floor.config.num_heads, floor.num_kv_heads) == (2, 8, 2)
    assert floor.dtype == model.dtype
    ops = lambda m: [type(mod).__name__ for mod in m.modules()]
    assert ops(floor) == ops(model)
    assert decode_bytes_read(floor, 1, 1)[0] * 50 < decode_bytes_read(model, 1, 1)[0]
