"""Tensor parallelism end to end: two processes joined by gloo (kvbench.parallel.launch, as
``runtime.tensor_parallel=2`` starts them) decode model=small token-equal to one process with GQA, MQA
and MLA, and the CLI's record gives each rank's allocated KV bytes equal to the formula by hand.
The fast, in-process checks of the same cut are tests/test_parallel.py's."""

import json
from dataclasses import replace

import pytest
import torch

from kvbench.cache import cache_for
from kvbench.config.model import AttentionConfig
from kvbench.generate import greedy_generate
from kvbench.jobs.job_config import to_bench_config
from kvbench.parallel.launch import run_ranks
from kvbench.results import RunResult, save
from kvbench.tasks.common import build_model
from tests.conftest import compose
from tests.test_cli import kvbench

pytestmark = pytest.mark.e2e

B, PROMPT, STEPS = 2, 6, 5
ATTENTIONS = {"gqa": AttentionConfig(type="gqa", num_kv_heads=4), "mqa": AttentionConfig(type="mqa"),
              "mla": AttentionConfig(type="mla")}


def greedy_job(job, where, overrides) -> RunResult:
    """A rank's job (the launcher's ``run_job``): greedy tokens of each attention on model=small, the
    rank's part of it as build_model cuts it, and the bytes its cache allocated."""
    result = RunResult(status="ok", config={})
    torch.manual_seed(0)
    prompt = torch.randint(0, job.model.vocab_size, (B, PROMPT), generator=torch.Generator().manual_seed(3))
    for name, attention in ATTENTIONS.items():
        variant = replace(job, attention=attention.resolved(job.model))
        model = build_model(variant, torch.device("cpu"))
        cache = cache_for(model, "static", B, PROMPT + STEPS + 1)
        result.series[name] = greedy_generate(model, prompt, STEPS, cache).tokens.flatten().tolist()
        result.metrics[f"{name}_kv_cache_bytes"] = cache.nbytes
    save(result, where)
    return result


def test_two_gloo_ranks_decode_model_small_token_equal_to_one_process(tmp_path):
    job = to_bench_config(compose("model=small", "runtime.device=cpu"))
    ranks = replace(job, runtime=replace(job.runtime, tensor_parallel=2))
    record = run_ranks(ranks, tmp_path, [], greedy_job, torch.device("cpu"))
    assert [row["status"] for row in record.tables["ranks"]] == ["ok", "ok"]
    whole = greedy_job(job, tmp_path / "whole", [])  # this process joined no ranks: the whole model
    rank1 = json.loads((tmp_path / "ranks" / "1" / "results.json").read_text())
    L, D, S, f32 = 4, 64, PROMPT + STEPS + 1, 4  # model=small: 4 layers, 16 heads of 64
    expected = {"gqa": 2 * L * (4 // 2) * D * S * B * f32,  # 4 K/V heads split: 2 a rank
                "mqa": 2 * L * 1 * D * S * B * f32,  # the one K/V head on both
                "mla": L * (4 * D + D // 2) * S * B * f32}  # the latent (4 x head_dim) + its rope key, on both
    for name in ATTENTIONS:
        assert record.series[name] == whole.series[name] == rank1["series"][name], name
        assert record.metrics[f"{name}_kv_cache_bytes"] == rank1["metrics"][f"{name}_kv_cache_bytes"] == expected[name]
    assert whole.metrics["gqa_kv_cache_bytes"] == 2 * expected["gqa"]
    assert whole.metrics["mqa_kv_cache_bytes"] == expected["mqa"]  # replicated: each rank holds what one process does


def test_cli_runs_two_ranks_and_records_each_ranks_bytes(tmp_path):
    out = tmp_path / "run"
    kvbench("model=small", "attention=gqa", "runtime.tensor_parallel=2", "runtime.device=cpu",
            "workload.prompt_len=8", "workload.gen_len=3", "runtime.warmup=0", "runtime.repeats=1",
            "runtime.fidelity=false", "wandb.mode=disabled", f"hydra.run.dir={out}", cwd=tmp_path)
    record = json.loads((out / "results.json").read_text())
    assert record["status"] == "ok"
    per_rank = 2 * 4 * (4 // 2) * 64 * (8 + 3) * 1 * 4  # 2 K/V heads a rank, 11 positions, batch 1, float32
    for row in record["tables"]["ranks"]:
        assert row["status"] == "ok"
        assert row["kv_cache_bytes"] == row["kv_cache_bytes_formula"] == per_rank
        assert row["allreduce_ms_per_step"] > 0
    assert record["metrics"]["tensor_parallel_ranks"] == 2


def test_cli_refuses_zero_ranks_with_exit_2(tmp_path):
    proc = kvbench("model=tiny", "runtime.tensor_parallel=0", "wandb.mode=disabled",
                   f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path, check=False)
    assert proc.returncode == 2
    assert "runtime.tensor_parallel=0: must be an integer >= 1" in proc.stderr


@pytest.mark.parametrize("expert_parallel", [1, 2])
def test_a_mixture_of_experts_cut_by_width_or_by_expert_decodes_token_equal(expert_parallel):
    """tiny_moe (8 experts of 64, a gated shared expert, a dense first layer) with GPT-OSS's expert biases:
    each expert's width cut over 2 thread ranks (gate and up rows cut alike, the down bias added once), or
    4 whole experts a rank. In process (tests/test_parallel.py's thread ranks); e2e for the MoE's first
    forward, which loads torch._dynamo (seconds)."""
    from tests.test_parallel import PROMPT, STEPS
    from tests.test_parallel import run_ranks as thread_ranks

    job = to_bench_config(compose("model=tiny_moe", "model.moe.expert_bias=true", "runtime.device=cpu"))
    model = build_model(job, torch.device("cpu"))
    for experts in model.modules():
        if hasattr(experts, "b_down") and experts.b_down is not None:  # nonzero biases, so adding one twice shows
            torch.nn.init.normal_(experts.b_down, std=0.5)
            torch.nn.init.normal_(experts.b_gate_up, std=0.5)
    prompt = torch.randint(0, job.model.vocab_size, (B, PROMPT), generator=torch.Generator().manual_seed(5))
    whole = greedy_generate(model, prompt, STEPS, cache_for(model, "static", B, PROMPT + STEPS + 1)).tokens
    ranks = thread_ranks(model, prompt, 2, expert_parallel)
    for tokens, _, _ in ranks:
        assert torch.equal(tokens, whole)
