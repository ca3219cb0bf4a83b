"""The decode workload: fidelity in every run's record, and the compile option against eager."""

import json

import pytest
import torch
from conftest import make_decoder
from hydra import compose, initialize_config_dir

from kvbench.cache import cache_for
from kvbench.config import CONF_DIR
from kvbench.generate import greedy_generate
from kvbench.runner import run_job
from kvbench.workloads.decode import compile_model


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


def test_compiled_decode_matches_eager():
    """runtime.compile=true: the compiled decoder gives eager's logits; compile time is apart."""
    model = make_decoder(2, num_layers=1)
    prompt = torch.randint(0, 97, (2, 8))
    cache = cache_for(model, "static", 2, 20)
    metrics = {}
    compiled = compile_model(model, torch.device("cpu"), prompt, cache, metrics)
    assert metrics["compile_s"] > 0 and cache.length == 0  # compiled, then rolled back
    got = greedy_generate(compiled, prompt, 6, cache, keep_logits=True)
    want = greedy_generate(model, prompt, 6, cache_for(model, "static", 2, 20), keep_logits=True)
    torch.testing.assert_close(got.logits, want.logits, atol=1e-5, rtol=0)
