"""task=capacity of MLA, windowed and hybrid variants: what a probe's cache allocates is the KV
formula the prediction uses (a local layer's ring stops at W, a latent is kv_lora_rank +
qk_rope_head_dim), checked against arithmetic from the shapes; the predicted fit is that
arithmetic under the budget; real probes of a hybrid run, its paired TPOT steps repeating
positions through the ring."""

from dataclasses import replace

import pytest
import torch
from conftest import compose

from kvbench.jobs.job_config import to_bench_config
from kvbench.results import RunResult
from kvbench.tasks import capacity
from kvbench.tasks.capacity_search import formula_max_batch
from kvbench.tasks.common import build_model

# tiny with 6 layers: 8 heads of 8, float32; attention=mla's default latent 32 + rotary 4
L, H, D, W, GEN = 6, 8, 8, 8, 4
BASE = ["task=capacity", "model=tiny", "model.num_layers=6", "runtime.memory_budget_gb=64",
        f"workload.gen_len={GEN}", "runtime.warmup=0", "runtime.repeats=1"]
LAYOUTS = {  # overrides -> (elements per position per layer of one sequence, local layers)
    "mha": (["attention=mha"], 2 * H * D, 0),
    "gqa_local": (["attention=gqa", f"attention.window={W}"], 2 * 2 * D, L),
    "mha_hybrid": (["attention=mha", f"attention.window={W}", "attention.global_every=6"], 2 * H * D, 5),
    "mla": (["attention=mla"], 4 * D + D // 2, 0),
    "mla_hybrid": (["attention=mla", f"attention.window={W}", "attention.global_every=3"], 4 * D + D // 2, 4),
}


def config(*overrides):
    return to_bench_config(compose(*BASE, *overrides))


def by_hand(name: str, positions: int, batch: int) -> int:
    _, per_layer, local = LAYOUTS[name]
    return (local * min(positions, W) + (L - local) * positions) * per_layer * 4 * batch


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_probes_cache_allocates_the_formula_the_prediction_uses(name):
    cfg = config(*LAYOUTS[name][0])
    model = build_model(cfg, torch.device("cpu"))
    for context, batch in ((4, 3), (24, 2)):  # below and past W
        latency = capacity.decode_latency(cfg, model, torch.device("cpu"), context, batch)
        allocated = latency.stepper.cache.nbytes
        assert allocated == capacity.kv_bytes(cfg, context, batch) == by_hand(name, context + GEN, batch), name


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_the_predicted_fit_is_the_formula_under_the_budget(name):
    """weights + batch x (KV of one sequence + activation per sequence) + fixed <= budget, with the
    KV of one sequence worked out from the shapes (a hybrid's five local layers hold W, not S)."""
    cfg = config(*LAYOUTS[name][0])
    context, budget, weights, fixed, per_act = 1000, 10 ** 8, 3 * 10 ** 6, 10 ** 5, 5000
    per_sequence = by_hand(name, context + GEN, 1)
    expected = min(cfg.capacity.max_batch, (budget - weights - fixed) // (per_sequence + per_act))
    assert formula_max_batch(cfg, context, budget, weights, (fixed, per_act)) == expected
    if LAYOUTS[name][2]:  # a window holds fewer bytes: more sequences fit than without it
        full = config(*[o for o in LAYOUTS[name][0] if not o.startswith("attention.")] + ["attention.window=0"])
        assert formula_max_batch(cfg, context, budget, weights) > formula_max_batch(full, context, budget, weights)


def test_real_probes_of_a_hybrid_step_again_through_the_ring():
    """A 5:1 hybrid past W, judged against its own batch-1 step (slo.tpot_x_batch1): the probe's
    filled cache steps again and again over positions its ring has overwritten (the length moves
    back; the steps read W keys per local layer as before)."""
    torch.set_num_threads(1)
    cfg = config(*LAYOUTS["mha_hybrid"][0], "capacity.context_lens=[20]", "capacity.max_batch=4",
                 "slo.tpot_x_batch1=1000", "capacity.tpot_pairs=6", "slo.stat=p50")
    model = build_model(cfg, torch.device("cpu"))
    result = RunResult(status="ok", config={})
    capacity.run_probes(cfg, model, torch.device("cpu"), result, capacity.baseline_bytes(torch.device("cpu")))
    (answer,) = result.tables["capacity"]
    assert (answer["max_batch"], answer["stopped_by"]) == (4, "capacity.max_batch")
    for p in result.tables["capacity_probes"]:
        assert p["ok"] and p["tpot_paired_ms"] > 0 and p["tpot_reference_ms"] > 0
        assert p["kv_bytes"] == by_hand("mha_hybrid", 20 + GEN, p["batch"])
    assert answer["kv_bytes_per_sequence"] == by_hand("mha_hybrid", 20 + GEN, 1)


@pytest.mark.parametrize("shared", [False, True])
def test_real_chat_probes_of_a_windowed_mla_with_and_without_the_shared_cache(shared):
    """experiment=choose's chat serving with a window on MLA: the conversations' rings of latents
    (and the system prompt's last W, held once when shared) allocate what the prediction says."""
    torch.set_num_threads(1)
    cfg = config(*LAYOUTS["mla_hybrid"][0], "workload=multiturn", "workload.system_len=16", "workload.turns=2",
                 "workload.user_len=4", "workload.reply_len=3", f"cache.shared={str(shared).lower()}",
                 "capacity.max_batch=3", "slo.tpot_x_batch1=1000", "capacity.tpot_pairs=4", "slo.stat=p50")
    model = build_model(cfg, torch.device("cpu"))
    result = RunResult(status="ok", config={})
    capacity.run_probes(cfg, model, torch.device("cpu"), result, capacity.baseline_bytes(torch.device("cpu")))
    (answer,) = result.tables["capacity"]
    assert (answer["max_batch"], answer["stopped_by"]) == (3, "capacity.max_batch")
    (context,) = capacity.contexts(cfg)  # 16 + 2 x (4 + 3) - 1 = 29 positions per conversation
    for p in result.tables["capacity_probes"]:
        assert p["ok"] and p["tpot_paired_ms"] > 0
        expected = (by_hand("mla_hybrid", 16, 1) + by_hand("mla_hybrid", context - 16, p["batch"]) if shared
                    else by_hand("mla_hybrid", context, p["batch"]))
        assert p["kv_bytes"] == expected
    from kvbench.workloads.multiturn import ChatSession, chat_prompts

    system, users = chat_prompts(replace(cfg.workload, batch_size=3), cfg.model.vocab_size, 0)
    session = ChatSession(model, system, 3, shared, "static", context)
    for user in users:
        session.ask(user, cfg.workload.reply_len)
    assert session.cache.nbytes == capacity.kv_bytes(cfg, context, 3)  # what a probe's chats allocate
