"""A Mamba-2 hybrid through the studies that choose a layout: task=compare with a Mamba-2 variant
(experiment=layouts' letter :m), task=capacity with experiment=choose's attention=choose/mamba2, and
task=recall with experiment=recall's attention=recall/mamba2 beside Gated DeltaNet and MHA. Each
record names the variant once and holds the Mamba-2 layers' state per sequence by the hand formula:
per layer H·P·N float32 (the SSM state) plus the convolution's last K - 1 inputs of H·P + 2·G·N
channels in the compute dtype, with the kind's defaults H = num_heads, P = 2·d_model / H, N =
head_dim, G = 1, K = 4."""

import pytest
import torch
from conftest import compose

from kvbench.config.layer_pattern import variant_label
from kvbench.core.errors import ConfigError
from kvbench.jobs.job_config import to_bench_config
from kvbench.jobs.runner import run_job
from kvbench.results import RunResult
from kvbench.tasks import capacity


def mamba2_state(d_model: int, heads: int, head_dim: int, element: int = 4) -> int:
    """One Mamba-2 layer's bytes per sequence with the kind's default shape (the module docstring)."""
    P, N, K = 2 * d_model // heads, head_dim, 4
    return heads * P * N * 4 + (K - 1) * (heads * P + 2 * N) * element


def test_compare_takes_a_mamba2_variant_whose_state_is_the_formula(tmp_path):
    """experiment=layouts' syntax: gqa:m3 on 3 layers is 2 Mamba-2 layers to 1 full (model=tiny: 8
    heads of 8, float32)."""
    cfg = compose("model=tiny", "model.num_layers=3", "model.max_seq_len=32", "runtime.threads=1", "task=compare",
                  "wandb.mode=disabled", "compare.variants=[gqa,gqa:m3]", "compare.contexts=[8]",
                  "compare.steps=1", "runtime.warmup=0", "runtime.repeats=1", "workload.batch_size=2")
    record = run_job(cfg, tmp_path)
    assert record.status == "ok", record.error
    gqa, hybrid = record.tables["compare"]
    assert (hybrid["layout"], hybrid["variant"]) == ("gqa kv=2 mamba2 2:1", "gqa_kv2_mamba2_2to1")
    state, per_position = 2 * mamba2_state(64, 8, 8), 2 * 2 * 8 * 4  # 2 Mamba-2 layers; K and V of 2 heads of 8
    assert (gqa["kv_state_bytes"], hybrid["kv_state_bytes"]) == (0, state)
    assert hybrid["kv_bytes_ctx8"] == state + per_position * 8
    assert hybrid["kv_cache_bytes"] == hybrid["kv_cache_bytes_formula"] == 2 * (state + per_position * 9)
    assert record.metrics["gqa_kv2_mamba2_2to1_kv_state_bytes"] == state


def test_choose_takes_a_mamba2_hybrid_whose_probes_hold_the_formula():
    """experiment=choose with attention=choose/mamba2: 6 Mamba-2 layers to 2 full of choose's model (8
    layers of 256, 8 heads of 32, 2 KV heads); a real probe's cache is batch x (the states + the full
    layers' K/V of its positions), and the shared chat is refused in one line (a state is each
    sequence's own)."""
    torch.set_num_threads(1)
    cfg = to_bench_config(compose("experiment=choose", "attention=choose/mamba2", "scenario=decode",
                                  "capacity.context_lens=[16]", "capacity.max_batch=2", "capacity.tpot_pairs=2",
                                  "workload.gen_len=2",
                                  "runtime.memory_budget_gb=64", "slo.tpot_ms=100000", "slo.stat=p50"))
    assert variant_label(cfg.attention, num_layers=cfg.model.num_layers) == "gqa kv=2 mamba2 3:1"
    state, per_position = 6 * mamba2_state(256, 8, 32), 2 * 2 * 2 * 32 * 4
    assert capacity.state_bytes_per_sequence(cfg) == state
    from kvbench.tasks.common import build_model

    result = RunResult(status="ok", config={})
    capacity.run_probes(cfg, build_model(cfg, torch.device("cpu")), torch.device("cpu"), result,
                        capacity.baseline_bytes(torch.device("cpu")))
    assert result.metrics["kv_state_bytes_per_sequence"] == state
    probes = result.tables["capacity_probes"]
    assert probes and all(p["kv_bytes"] == p["batch"] * (state + per_position * 18) for p in probes)
    with pytest.raises(ConfigError) as refused:
        to_bench_config(compose("experiment=choose", "attention=choose/mamba2", "scenario=chat_shared"))
    assert str(refused.value).startswith("cache.shared=True") and "\n" not in str(refused.value)


def test_recall_trains_a_mamba2_hybrid_with_its_own_costs(tmp_path):
    """experiment=recall's model (2 layers of 64, 4 heads of 16) with attention=recall/mamba2: layer 0
    Mamba-2, layer 1 MHA; its record holds the state by the formula and one layer's K/V per token."""
    cfg = compose("experiment=recall", "attention=recall/mamba2", "wandb.mode=disabled", "train.steps=3",
                  "train.batch_size=4", "recall.eval_sequences=8", "recall.num_pairs=[2]", "recall.seq_len=[12]",
                  "recall.seeds=1")
    record = run_job(cfg, tmp_path)
    assert record.status == "ok", record.error
    assert record.config["attention"]["layer_types"] == ["mamba", "full_attention"]
    assert record.metrics["kv_state_bytes_per_sequence"] == mamba2_state(64, 4, 16)
    assert record.metrics["kv_bytes_per_token"] == 2 * 4 * 16 * 4  # K and V of 4 heads of 16, one layer
    from kvbench.sinks.recall import groups, recall_table

    [group] = groups([record.to_dict()])
    header, rows = recall_table(group)
    assert header[1] == "mha kv=4 mamba2 1:1"
    assert [r[:2] for r in rows[1:3]] == [["KV / token", "512 B"], ["state / sequence", "9.88 KiB"]]
