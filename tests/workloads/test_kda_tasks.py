"""Kimi Delta Attention (KDA) hybrids through every task: task=inspect's bytes per token and per
sequence of the Kimi Linear 48B and Kimi K3 presets against a hand formula (the latent layers'
576 per token, the KDA layers' H·d·d float32 state and conv tails per sequence), their parameter
counts against transformers' KimiLinearForCausalLM built from the same config.json and against the
model cards; bench, compare's :a<k> variant, capacity, workload=serving with prefix caching (a KDA
state as a page, saved at block boundaries), workload=conversations and task=recall (MQAR), each
on a tiny hybrid against the same formula."""

import logging

import pytest
import torch
from conftest import compose

from kvbench.core.dtypes import DTYPE_BYTES
from kvbench.footprint import parameter_counts
from kvbench.jobs.job_config import to_bench_config
from kvbench.jobs.runner import run_job
from kvbench.layouts.build import build_layouts
from kvbench.results import read_record
from kvbench.tasks import capacity
from kvbench.tasks.inspect import describe, kv_memory_table, layer_kind_table

# the published shapes (conf/model/*.yaml): layers, latent layers, KDA heads, KDA head_dim, conv kernel
PRESETS = {"kimi_linear_48b": (27, 7, 32, 128, 4), "kimi_k3": (93, 24, 96, 128, 4)}
LATENT = 512 + 64  # kv_lora_rank + qk_rope_head_dim: what a latent layer holds per token


def hand(preset, element, seq_len):
    """(bytes per token, state bytes per sequence, bytes per sequence) by hand: the latent layers' 576
    elements per token; per KDA layer a float32 H x d x d state and the last K - 1 inputs of q, k and
    v (3 H d channels) in the compute dtype."""
    layers, full, H, d, K = PRESETS[preset]
    per_token = full * LATENT * element
    state = (layers - full) * (H * d * d * 4 + 3 * H * d * (K - 1) * element)
    return per_token, state, state + seq_len * per_token


@pytest.mark.parametrize("preset", list(PRESETS))
def test_inspect_prints_bytes_per_token_and_per_sequence_by_kind_of_layer(preset):
    cfg = to_bench_config(compose(f"model={preset}", "task=inspect", "runtime.dtype=bfloat16",
                                  "workload.prompt_len=32767", "workload.gen_len=1", "workload.batch_size=4"))
    S, element = 32768, DTYPE_BYTES["bfloat16"]
    per_token, state, per_sequence = hand(preset, element, S)
    layers = build_layouts(cfg.model, cfg.attention)
    row = next(r for r in kv_memory_table(layers, S, 4) if r["dtype"] == "bfloat16")
    assert (row["per_token"], row["state"], row["per_sequence"], row["per_batch"]) == (
        per_token, state, per_sequence, 4 * per_sequence)
    full, kda = layer_kind_table(layers, S, 4, element)
    n, n_full = PRESETS[preset][:2]
    assert (full["layers"], full["per_token"], full["per_sequence"]) == (n_full, per_token, S * per_token)
    assert (kda["kind"], kda["layers"], kda["per_token"], kda["state"]) == ("kda", n - n_full, 0, state)
    text = describe(cfg)
    line = next(x for x in text.splitlines() if x.startswith("bfloat16"))
    assert f"({per_token:,})" in line and f"({state:,})" in line and f"({per_sequence:,})" in line
    assert f"= {n_full} · {LATENT} · seq_len" in text.replace("\n  ", " ")
    assert f"{n - n_full} of {n} layers Kimi Delta Attention" in text.replace("\n  ", " ")


# Kimi Linear 48B's config.json keys that KimiLinearConfig reads (conf/model/kimi_linear_48b.yaml says where
# they come from); Kimi K3's text_config, the same keys
LINEAR_48B = dict(hidden_size=2304, intermediate_size=9216, moe_intermediate_size=1024, num_hidden_layers=27,
                  num_attention_heads=32, num_key_value_heads=32, kv_lora_rank=512, q_lora_rank=None,
                  qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, vocab_size=163840, num_experts=256,
                  num_experts_per_token=8, num_shared_experts=1, routed_scaling_factor=2.446, first_k_dense_replace=1,
                  linear_attn_config={"head_dim": 128, "num_heads": 32, "short_conv_kernel_size": 4,
                                      "full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
                                      "kda_layers": [i for i in range(1, 28) if i not in (4, 8, 12, 16, 20, 24, 27)]})
K3_FULL = [*range(4, 93, 4), 93]
K3 = dict(LINEAR_48B, hidden_size=7168, intermediate_size=33792, moe_intermediate_size=3072, num_hidden_layers=93,
          num_attention_heads=96, num_key_value_heads=96, q_lora_rank=1536, num_experts=896, num_experts_per_token=16,
          num_shared_experts=2, routed_scaling_factor=1.0,
          linear_attn_config={"head_dim": 128, "num_heads": 96, "short_conv_kernel_size": 4,
                              "full_attn_layers": K3_FULL, "kda_layers": [i for i in range(1, 94) if i not in K3_FULL]})


def test_the_presets_are_transformers_models_of_their_config_json_and_their_model_cards_counts():
    """Each preset is what kvbench reads from its config.json's keys, and has the parameters
    transformers' KimiLinearForCausalLM builds from them (on the meta device). Kimi Linear's card:
    "48B total, 3B activated" (49.12 B with the embedding and the output head, 48.37 B without; 3.11 B
    active). K3's "2.8T": the model transformers builds runs its 896 experts on the whole 7168-wide
    state; its latent MoE runs them on 3584 (routed_expert_hidden_size, not read), between two
    7168 x 3584 projections, and its KDA gates are full rank and its MLA outputs gated (use_full_rank_gate,
    mla_use_output_gate): put back by hand, 2.79 T."""
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    from kvbench.config.model import ModelConfig

    counts = {}
    for preset, keys in (("kimi_linear_48b", LINEAR_48B), ("kimi_k3", K3)):
        cfg = to_bench_config(compose(f"model={preset}", "task=inspect"))
        read = ModelConfig.from_hf_config({"architectures": ["KimiLinearForCausalLM"], **keys})
        for field in ("num_layers", "d_model", "num_heads", "head_dim", "ffn_dim", "vocab_size", "max_seq_len",
                      "preset_mla", "preset_layer_types", "layer_shapes", "moe", "rope_type"):
            assert getattr(read, field) == getattr(cfg.model, field), (preset, field)
        logging.disable(logging.WARNING)
        try:
            with torch.device("meta"):
                hf = KimiLinearForCausalLM(KimiLinearConfig(**keys))
        finally:
            logging.disable(logging.NOTSET)
        counts[preset] = parameter_counts(cfg.model, cfg.attention)
        assert counts[preset].total == sum(p.numel() for p in hf.parameters()), preset
    linear = counts["kimi_linear_48b"]
    assert round(linear.total / 1e9, 2) == 49.12 and round((linear.total - 2 * linear.embedding) / 1e9) == 48
    assert round(linear.active / 1e9) == 3
    C, I, E, wide, narrow = 7168, 3072, 896, 7168, 3584  # noqa: E741
    latent_moe = 92 * (E * 3 * I * (narrow - wide) + 2 * C * narrow)  # 92 sparse layers
    H_d, d = 96 * 128, 128
    full_rank = 69 * 2 * (C * H_d - (C * d + d * H_d))  # KDA's decay and output gates, each C -> H d at once
    output_gate = 24 * C * H_d  # an MLA layer's sigmoid gate on its H x v_head_dim output
    assert round((counts["kimi_k3"].total + latent_moe + full_rank + output_gate) / 1e12, 1) == 2.8


TINY = ["model=tiny", "model.num_layers=6", "runtime.threads=1", "runtime.warmup=0", "runtime.repeats=1",
        "wandb.mode=disabled", "runtime.isolate=false"]
KDA_EVERY_3 = "attention.layer_types=[kda,kda,full_attention,kda,kda,full_attention]"
L, H, D = 6, 8, 8  # tiny: 8 heads of 8, float32; its KDA layers the same 8 heads of 8, 4 taps
STATE = 4 * (H * D * D * 4 + 3 * H * D * 3 * 4)  # 4 KDA layers, float32 state and conv tails
PER_POSITION = 2 * 2 * D * 4  # a full layer's K and V, 2 KV heads (gqa), float32


def test_bench_runs_a_kda_hybrid_and_allocates_its_formula(tmp_path):
    record = run_job(compose(*TINY, "attention=gqa", KDA_EVERY_3, "workload.prompt_len=70", "workload.gen_len=4"),
                     tmp_path)
    assert record.status == "ok", record.error
    m = record.metrics
    # one sequence of 70 + 4 positions (a prompt past the delta rule's chunk): 2 full layers' K/V, 4 KDA states
    assert m["kv_cache_bytes"] == m["kv_cache_bytes_formula"] == STATE + 2 * PER_POSITION * 74


def test_compare_takes_a_kda_variant_whose_kv_grows_with_its_full_layers_only(tmp_path):
    """compare's :a<k>: every k-th layer full attention, the others KDA (its weights drawn from the seed)."""
    cfg = compose(*TINY, "model.num_layers=3", "task=compare", "model.max_seq_len=64", "compare.variants=[gqa,gqa:a3]",
                  "compare.contexts=[4,8,16]", "compare.steps=1", "runtime.repeats=2", "workload.batch_size=2")
    compared = run_job(cfg, tmp_path)
    assert compared.status == "ok", compared.error
    gqa, hybrid = compared.tables["compare"]
    assert (hybrid["layout"], hybrid["variant"]) == ("gqa kv=2 kda 2:1", "gqa_kv2_kda_2to1")  # layers 0, 1 KDA
    assert gqa["kv_bytes_per_token"] == 3 * PER_POSITION and hybrid["kv_bytes_per_token"] == PER_POSITION
    for ctx in (4, 8, 16):
        assert hybrid[f"kv_bytes_ctx{ctx}"] == STATE // 2 + PER_POSITION * ctx


def test_capacity_counts_a_kda_state_per_sequence_and_the_full_layers_per_position():
    cfg = to_bench_config(compose("task=capacity", *TINY, "attention=gqa", KDA_EVERY_3, "capacity.context_lens=[16]",
                                  "workload.gen_len=4"))
    for batch in (1, 3):
        assert capacity.kv_bytes(cfg, 16, batch) == batch * (STATE + 2 * PER_POSITION * 20)
    assert capacity.state_bytes_per_sequence(cfg) == STATE


SERVING = ["workload=serving", "model=tiny", "model.max_seq_len=256", "workload.num_requests=8", "workload.rate=50",
           "workload.prompt.mean=24", "workload.prompt.lo=8", "workload.prompt.hi=40", "workload.output.lo=2",
           "workload.output.hi=6", "runtime.isolate=false", "wandb=disabled", "runtime.threads=1",
           "attention.layer_types=[kda,full_attention]"]


def test_serving_pages_kda_states_and_prefix_caching_resumes_from_saved_ones(tmp_path, scripted_clock):
    """A KDA + full attention hybrid whose requests share a 32-token system prompt: the store holds its
    formula (a KDA page: tiny's 8 x 8 x 8 float32 state + 3 conv taps of 3 x 8 x 8, beside the full
    layer's blocks), states are saved at block boundaries and later requests find the prefix cached
    (on the scripted clock: which requests meet a cached prefix must not depend on the machine's load)."""
    record = run_job(compose(*SERVING, "workload.kv_budget_mb=0.5", "workload.prefix_len=32"), tmp_path)
    assert record.status == "ok", record.error
    m = record.metrics
    assert m["requests_finished"] == 8 and m["kv_store_bytes"] == m["kv_store_bytes_formula"]
    assert m["kv_sequence_bytes_formula"] >= H * D * D * 4 + 3 * H * D * 3 * 4
    assert m["state_checkpoints_saved"] > 0 and m["prefix_hit_tokens"] > 0


def test_conversations_of_a_kda_hybrid_classify_returning_turns_by_the_states_the_store_held(tmp_path):
    """The store says, when a turn finishes, how much of it a new sequence could continue from (on a
    KDA layer: up to its last saved state), so a KDA hybrid's returning turns are cached or evicted as
    an attention model's are (they were "not classified" before the store said so). Recomputed from the
    record's own requests: the next turn may find min(resumable, every full block of its prompt but the
    last token) and is cached when it found that much at its first admission."""
    conv = ["workload=conversations", "model=tiny", "model.max_seq_len=512", "workload.num_requests=4",
            "workload.rate=8", "workload.prompt.mean=16", "workload.prompt.lo=8", "workload.prompt.hi=24",
            "workload.output.lo=2", "workload.output.hi=6", "workload.think.mean=0.05", "workload.kv_budget_mb=0.25",
            "runtime.isolate=false", "wandb=disabled", "runtime.threads=1", "runtime.warmup=0",
            "attention.layer_types=[kda,full_attention]"]
    run_job(compose(*conv), tmp_path)
    record = read_record(tmp_path / "results.json")
    assert record.status == "ok", record.error
    m, bs = record.metrics, record.metrics["block_size"]
    turns = {(r["conversation"], r["turn"]): r for r in record.tables["serving_requests"]}
    kinds, reusable, recomputed = [], 0, 0
    for (c, k), r in turns.items():
        prev = turns.get((c, k - 1))
        if k == 0 or r["first_hit_tokens"] is None:
            continue
        # a state is saved at block boundaries only, and never past the last token whose K/V was computed
        assert prev["resumable_tokens"] % bs == 0
        assert prev["resumable_tokens"] <= prev["prompt_len"] + prev["output_len"] - 1
        could = min(prev["resumable_tokens"], (r["prompt_len"] - 1) // bs * bs)
        kinds.append("cached" if r["first_hit_tokens"] >= could else "evicted")
        reusable, recomputed = reusable + could, recomputed + max(0, could - r["first_hit_tokens"])
    assert m["returning_turns"] == len(kinds) > 0 and m["returning_reason"] is None
    assert (m["returning_cached"], m["returning_evicted"]) == (kinds.count("cached"), kinds.count("evicted"))
    assert (m["history_reusable_tokens"], m["history_recomputed_tokens"]) == (reusable, recomputed) and reusable > 0
    rows = record.tables["conversation_turns"]
    assert sum(row["cached"] for row in rows) == kinds.count("cached")
    assert sum(row["evicted"] for row in rows) == kinds.count("evicted")


def test_recall_trains_mqar_on_a_kda_hybrid_and_records_its_state(tmp_path):
    """experiment=recall's recall/kda, a few steps: the record's state per sequence is the KDA layer's
    (4 heads of 16: a 16 x 16 float32 state each, 3 conv taps of 3 x 64 channels) and nothing per token
    but the full layer's K/V."""
    record = run_job(compose("wandb.mode=disabled", "task=recall", "model=tiny", "model.num_heads=4",
                             "model.preset_kv_heads=4", "train.steps=3", "train.batch_size=4", "recall.seeds=1",
                             "recall.eval_sequences=16", "recall.vocab_size=32", "recall.num_pairs=[2,3]",
                             "recall.seq_len=[12]", "runtime.isolate=false", "attention=recall/kda"), tmp_path)
    assert record.status == "ok", record.error
    m = record.metrics
    assert m["kv_state_bytes_per_sequence"] == 4 * 16 * 16 * 4 + 3 * 3 * 64 * 4
    assert m["kv_bytes_per_token"] == 2 * 4 * 16 * 4  # the MHA layer's K and V, float32


@pytest.mark.parametrize("override, line", [
    ("+model.layer_shapes.kda.heads=4", "model.layer_shapes.kda.heads=4: not a KDA field (one of linear_num_heads, "),
    ("+model.layer_shapes.kda.linear_num_heads=0", "model.layer_shapes.kda.linear_num_heads=0: must be a positive "
                                                   "integer"),
    ("+model.layer_shapes.kda.gate_lower_bound=2.0", "model.layer_shapes.kda.gate_lower_bound=2.0: must be a "
                                                     "negative number"),
])
def test_a_kda_shape_it_cannot_build_is_refused_in_one_line_naming_the_key(override, line):
    from kvbench.core.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        job = to_bench_config(compose("model=tiny", "attention.layer_types=[kda,full_attention]", override))
        build_layouts(job.model, job.attention)
    assert str(info.value).startswith(line) and "\n" not in str(info.value), str(info.value)
