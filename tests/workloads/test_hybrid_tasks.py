"""A Gated DeltaNet hybrid (Qwen3.5's linear:full layers) through every task: inspect's bytes per
token and per sequence of the Qwen3.5 / Qwen3-Next presets against a hand formula, bench
(decode, multi-turn), task=compare with a hybrid variant (its KV cost per 1k tokens grows with
its full layers only), task=capacity with a per-sequence state, and workload=serving refused in
one line."""

import logging

import pytest
import torch
from conftest import compose

from kvbench.core.dtypes import DTYPE_BYTES
from kvbench.core.errors import ConfigError
from kvbench.footprint import parameter_count
from kvbench.jobs.job_config import to_bench_config
from kvbench.jobs.runner import run_job
from kvbench.layouts.build import build_layouts
from kvbench.results import RunResult
from kvbench.tasks import capacity
from kvbench.tasks.capacity_search import formula_max_batch
from kvbench.tasks.inspect import describe, kv_memory_table, layer_kind_table
from kvbench.workloads.serving import check_requests

# the released shapes (conf/model/*.yaml): layers, full layers, KV heads, head_dim, linear key heads,
# value heads, d_k, d_v, conv kernel
PRESETS = {"qwen3_5_9b": (32, 8, 4, 256, 16, 32, 128, 128, 4), "qwen3_next_80b": (48, 12, 2, 256, 16, 32, 128, 128, 4)}


def hand(preset, element, seq_len):
    """(bytes per token, state bytes per sequence, bytes per sequence) by hand: K and V of the full
    layers' KV heads per token; per linear layer a float32 H_v x d_k x d_v state and the last K - 1
    inputs of q, k (H_k x d_k each) and v (H_v x d_v) in the compute dtype."""
    layers, full, kv, D, H_k, H_v, d_k, d_v, K = PRESETS[preset]
    per_token = full * 2 * kv * D * element
    state = (layers - full) * (H_v * d_k * d_v * 4 + (2 * H_k * d_k + H_v * d_v) * (K - 1) * element)
    return per_token, state, state + seq_len * per_token


@pytest.mark.parametrize("preset", list(PRESETS))
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_inspect_prints_bytes_per_token_and_per_sequence_by_kind_of_layer(preset, dtype):
    cfg = to_bench_config(compose(f"model={preset}", "task=inspect", f"runtime.dtype={dtype}",
                                  "workload.prompt_len=32767", "workload.gen_len=1", "workload.batch_size=4"))
    element, S = DTYPE_BYTES[dtype], 32768
    per_token, state, per_sequence = hand(preset, element, S)
    layers = build_layouts(cfg.model, cfg.attention)
    row = next(r for r in kv_memory_table(layers, S, 4) if r["dtype"] == dtype)
    assert (row["per_token"], row["state"], row["per_sequence"], row["per_batch"]) == (
        per_token, state, per_sequence, 4 * per_sequence)
    # a quantized cache stores the full layers' K/V as codes and scales; the states keep their bytes
    rows = {r["dtype"]: r for r in kv_memory_table(layers, S, 4, element=element)}
    assert list(rows) == [*DTYPE_BYTES, "int8", "float8_e4m3fn", "nvfp4", "mxfp4", "nvfp4_rotated"]
    full_n, kv, D = PRESETS[preset][1:4]
    for code, per_vector in (("int8", D + 4), ("nvfp4", D // 2 + D // 16), ("mxfp4", D // 2 + D // 32)):
        assert (rows[code]["per_token"], rows[code]["state"]) == (full_n * 2 * kv * per_vector, state), code
    full, linear = layer_kind_table(layers, S, 4, element)
    layers_n, full_n = PRESETS[preset][:2]
    assert (full["layers"], full["per_token"], full["state"], full["per_sequence"]) == (
        full_n, per_token, 0, S * per_token)
    assert (linear["kind"], linear["layers"], linear["per_token"], linear["state"], linear["per_sequence"]) == (
        "gated_deltanet", layers_n - full_n, 0, state, state)
    text = describe(cfg)
    line = next(x for x in text.splitlines() if x.startswith(dtype))
    assert f"({per_token:,})" in line and f"({state:,})" in line and f"({per_sequence:,})" in line
    assert next(x for x in text.splitlines() if x.startswith("gated_deltanet")).split()[1] == str(layers_n - full_n)
    assert f"= 2 · {full_n} · {PRESETS[preset][2]} · 256 · seq_len" in text


def test_the_presets_have_transformers_parameter_counts():
    """The preset is the model transformers builds from its config class's (Qwen3.5-9B) defaults;
    Qwen3-Next's with its experts in every layer (79.67B: the card's "80B in total")."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig, Qwen3NextConfig, Qwen3NextForCausalLM

    logging.disable(logging.WARNING)
    try:
        with torch.device("meta"):
            q35 = Qwen3_5ForCausalLM(Qwen3_5TextConfig())
            qnext = Qwen3NextForCausalLM(Qwen3NextConfig(intermediate_size=5120))
    finally:
        logging.disable(logging.NOTSET)
    for preset, hf in (("qwen3_5_9b", q35), ("qwen3_next_80b", qnext)):
        cfg = to_bench_config(compose(f"model={preset}", "task=inspect"))
        assert parameter_count(cfg.model, cfg.attention) == sum(p.numel() for p in hf.parameters()), preset


TINY = ["model=tiny", "model.num_layers=6", "runtime.threads=1", "runtime.warmup=0", "runtime.repeats=1",
        "wandb.mode=disabled", "runtime.isolate=false"]
L, H, D = 6, 8, 8  # tiny: 8 heads of 8, float32; :d3 / full_attention_interval=3: layers 2 and 5 full
# tiny's derived Gated DeltaNet: 8 key heads, 16 value heads, d_k = d_v = 4, 4 taps
STATE = 4 * (16 * 4 * 4 * 4 + (2 * 8 * 4 + 16 * 4) * 3 * 4)  # 4 linear layers, float32


@pytest.mark.parametrize("workload", [["workload.gen_len=4"],
                                      ["workload=multiturn", "workload.system_len=16", "workload.turns=2",
                                       "workload.user_len=4", "workload.reply_len=3"]])
def test_bench_runs_a_hybrid_and_allocates_its_formula(tmp_path, workload):
    record = run_job(compose(*TINY, "attention=gqa", "attention.full_attention_interval=3", *workload), tmp_path)
    assert record.status == "ok", record.error
    assert record.config["attention"]["layer_types"] == ["linear_attention"] * 2 + ["full_attention"] + [
        "linear_attention"] * 2 + ["full_attention"]
    m = record.metrics
    assert m["kv_cache_bytes"] == m["kv_cache_bytes_formula"]
    if "gen_len" in workload[0]:  # one sequence of 512 + 4 positions, batch 1: 2 full layers, 2 KV heads
        assert m["kv_cache_bytes"] == STATE + 2 * 2 * 2 * D * 4 * 516


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    cfg = compose(*TINY, "task=compare", "model.max_seq_len=64", "compare.variants=[gqa,gqa:d3]",
                  "compare.contexts=[4,8,16,32]", "compare.steps=2", "runtime.repeats=3", "workload.batch_size=2")
    return run_job(cfg, tmp_path_factory.mktemp("compare_hybrid"))


def test_compare_takes_a_hybrid_variant_whose_kv_grows_with_its_full_layers_only(compared):
    assert compared.status == "ok", compared.error
    gqa, hybrid = compared.tables["compare"]
    assert (gqa["layout"], hybrid["layout"]) == ("gqa kv=2", "gqa kv=2 gdn 2:1")
    assert hybrid["variant"] == "gqa_kv2_gdn_2to1" and hybrid["weights"].endswith("Gated DeltaNet layers drawn from "
                                                                                  "runtime.seed")
    per_position = 2 * 2 * D * 4  # K and V of 2 KV heads, float32, per layer
    assert gqa["kv_bytes_per_token"] == L * per_position and hybrid["kv_bytes_per_token"] == 2 * per_position
    for ctx in (4, 8, 16, 32):
        assert hybrid[f"kv_bytes_ctx{ctx}"] == STATE + 2 * per_position * ctx
    assert hybrid["kv_cache_bytes"] == hybrid["kv_cache_bytes_formula"] == 2 * (STATE + 2 * per_position * 33)
    # the state apart, and the bytes per 1k tokens of context: the full layers' positions only
    assert (gqa["kv_state_bytes"], hybrid["kv_state_bytes"]) == (0, STATE)
    assert hybrid["kv_bytes_per_1k_ctx"] == 2 * per_position * 1000
    assert gqa["kv_bytes_per_1k_ctx"] == L * per_position * 1000
    assert compared.metrics["gqa_kv2_gdn_2to1_step_ms_ctx32"] > 0


def test_the_same_variant_named_twice_and_a_bad_option_are_one_line():
    with pytest.raises(ConfigError, match=r"^compare.variants=\['gqa:d3', 'gqa:d0'\]: 'gqa:d0': option 'd0' must be "
                                          r"one of :w<W>, :c<C>, :g<k>, :s<N>, .*:d<full_attention_interval>"):
        to_bench_config(compose(*TINY, "task=compare", "compare.variants=[gqa:d3,gqa:d0]"))
    with pytest.raises(ConfigError, match=r"^compare.variants=\['mla', 'mla:d3'\]: 'mla:d3': attention.type='mla': "
                                          r"mla beside linear_attention"):
        to_bench_config(compose(*TINY, "task=compare", "compare.variants=[mla,mla:d3]"))


def test_capacity_counts_a_state_per_sequence_and_the_full_layers_per_position():
    """Max batch as a function of the context: each sequence holds the state whatever its length
    plus the full layers' K/V of its positions, so the batch falls with the context, and short
    contexts are bounded by the state."""
    cfg = to_bench_config(compose("task=capacity", *TINY, "attention=gqa", "attention.full_attention_interval=3",
                                  "capacity.context_lens=[16,32]", "workload.gen_len=4"))
    per_position = 2 * 2 * 2 * D * 4  # 2 full layers
    for context in (16, 32):
        for batch in (1, 3):
            assert capacity.kv_bytes(cfg, context, batch) == batch * (STATE + per_position * (context + 4))
    weights, room = 10_000, 50 * (STATE + per_position * 20)
    assert formula_max_batch(cfg, 16, weights + room, weights) == 50
    assert formula_max_batch(cfg, 32, weights + room, weights) == room // (STATE + per_position * 36) == 39
    per_token, positions = capacity.kv_bytes_per_token(cfg)
    assert (per_token, positions) == ((STATE + per_position * 36) / 36, 36)
    assert capacity.state_bytes_per_sequence(cfg) == STATE
    assert capacity.state_bytes_per_sequence(to_bench_config(compose("task=capacity", *TINY, "attention=gqa"))) == 0


def test_real_capacity_probes_of_a_hybrid():
    torch.set_num_threads(1)
    cfg = to_bench_config(compose("task=capacity", *TINY, "attention=gqa", "attention.full_attention_interval=3",
                                  "capacity.context_lens=[16]", "capacity.max_batch=4", "workload.gen_len=2",
                                  "runtime.repeats=2", "runtime.memory_budget_gb=64", "slo.tpot_ms=100000",
                                  "slo.stat=p50"))
    from kvbench.tasks.common import build_model

    result = RunResult(status="ok", config={})
    capacity.run_probes(cfg, build_model(cfg, torch.device("cpu")), torch.device("cpu"), result,
                        capacity.baseline_bytes(torch.device("cpu")))
    (answer,) = result.tables["capacity"]
    assert answer["max_batch"] == 4 and result.metrics["kv_state_bytes_per_sequence"] == STATE
    for p in result.tables["capacity_probes"]:
        assert p["measured"] and p["ok"] and p["kv_bytes"] == p["batch"] * (STATE + 2 * 2 * 2 * D * 4 * 18)


@pytest.mark.parametrize("preset", ["model=qwen3_5_9b", "model=tiny"])
def test_serving_takes_a_hybrid(preset):
    """A Gated DeltaNet hybrid is served (a state page per running sequence, tests/test_serving_engine.py):
    its config composes, and the tiny one's store plan holds its requests."""
    overrides = [preset, "workload=serving"] + (["attention.full_attention_interval=2"] if preset == "model=tiny"
                                                else [])
    cfg = to_bench_config(compose(*overrides))
    assert "linear_attention" in cfg.attention.layer_kinds(cfg.model.num_layers)
    if preset == "model=tiny":
        assert len(check_requests(cfg)) == cfg.workload.num_requests
