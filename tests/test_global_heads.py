"""The global-heads kind (kvbench.layouts.global_heads) outside a checkpoint: K=V halves what a global
layer holds, allocates and reads (the formula, and a static cache's tensors), compare's letter reads it
back, a global shape of its own counts its own parameters, and what it does not run with is refused in
one line naming the key and the value (tests/test_gemma4.py: against transformers)."""

import pytest
import torch
from conftest import compose

from kvbench.cache import cache_for
from kvbench.config.compare import CompareConfig, variant_fields
from kvbench.config.layer_pattern import variant_label
from kvbench.core.errors import ConfigError
from kvbench.footprint import parameter_counts
from kvbench.jobs.job_config import to_bench_config
from kvbench.layouts.global_heads import GlobalHeads
from kvbench.model import Decoder

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny():
    """model=tiny (2 layers of 8 heads of 8) as GQA of 2 KV heads, with K=V (1) and without (0)."""
    return {k: to_bench_config(compose("model=tiny", "attention=gqa", "attention.num_kv_heads=2",
                                       f"attention.k_eq_v={k}")) for k in (0, 1)}


def test_k_eq_v_halves_what_every_global_layer_holds_allocates_and_reads(tiny):
    S, B = 24, 2
    torch.manual_seed(0)
    models = {k: Decoder(cfg.model, cfg.attention) for k, cfg in tiny.items()}
    layers = {k: m.layouts for k, m in models.items()}
    assert all(isinstance(layer, GlobalHeads) and layer.k_eq_v for layer in layers[1])
    assert layers[1].cache_bytes(S, B, 4) * 2 == layers[0].cache_bytes(S, B, 4) == 2 * B * S * 2 * 2 * 8 * 4
    assert layers[1].read_bytes(S, B, 4) * 2 == layers[0].read_bytes(S, B, 4)
    assert cache_for(models[1], "static", B, S).nbytes * 2 == cache_for(models[0], "static", B, S).nbytes
    # no value projection: a K=V layer's weights are those of its K/V-head twin less wv
    wv = 2 * 8 * 64  # (H_kv D, C) per layer
    assert models[0].num_params() - models[1].num_params() == 2 * wv
    assert parameter_counts(tiny[1].model, tiny[1].attention).total == models[1].num_params()


def test_compare_reads_k_eq_v_by_its_letter_and_labels_it(tiny):
    cfg = tiny[1]
    assert variant_fields("gqa:w8:g2:v1")["k_eq_v"] == 1
    a, b = CompareConfig(variants=["2:w8:g2", "2:w8:g2:v1"]).attentions(cfg.model)
    assert (a.k_eq_v, b.k_eq_v) == (0, 1)
    assert variant_label(b, num_layers=2) == variant_label(a, num_layers=2) + " k=v" == "gqa kv=2 w=8 1:1 k=v"


@pytest.mark.parametrize("overrides, line", [
    (("attention.k_eq_v=2",), "attention.k_eq_v=2: must be 1 (keys are values), 0 or null"),
    (("attention=mla", "attention.k_eq_v=1"), "attention.k_eq_v=1: is a property of K/V-head layers"),
    (("attention.k_eq_v=1", "model.num_layers=3", "attention.kv_shared_layers=1"),
     "attention.k_eq_v=1: with attention.kv_shared_layers=1 a global layer would read a K=V layer's cache"),
    (("model=tiny_gemma4", "model.layer_shapes.global_heads.head_dim=-1"),
     "model.layer_shapes.global_heads.head_dim=-1: must be a positive int"),
    (("attention.k_eq_v=1", "workload=multiturn", "cache.shared=true"), "cache.shared=True: layer 0, K=V layer"),
])
def test_what_k_eq_v_and_a_global_shape_do_not_run_with_is_refused_in_one_line(overrides, line):
    with pytest.raises(ConfigError) as info:
        to_bench_config(compose("model=tiny", *overrides))
    message = str(info.value)
    assert "\n" not in message and line in message, message


def _reference_keys(values, weight, inv_freq, rotary, factor=1.0):
    """transformers' keys of a K=V layer from its cached values (B, H_kv, S, D) at positions 0..S-1, written
    from its formulas: (x.float() * w).type_as(x), then rotate-half over the first ``rotary`` dims with the
    float32 angles p * inv_freq (a proportional rope's zero frequencies included), in x's dtype."""
    x = values if weight is None else (values.float() * weight.float()).type_as(values)
    angles = torch.arange(values.shape[2]).float()[:, None] * inv_freq
    cos, sin = (torch.cat([f(angles), f(angles)], -1) * factor for f in (torch.cos, torch.sin))
    turn, rest = x[..., :rotary], x[..., rotary:]
    half = rotary // 2
    partner = torch.cat([-turn[..., half:], turn[..., :half]], -1)
    return torch.cat([turn * cos.to(x.dtype) + partner * sin.to(x.dtype), rest], -1)


@pytest.mark.parametrize("overrides", [("model=tiny_gemma4",), ("model=tiny", "attention.k_eq_v=1"),
                                       ("model=tiny", "attention.k_eq_v=1", "model.partial_rotary_factor=0.5")])
@torch.no_grad()
def test_a_decode_steps_keys_of_a_k_eq_v_layer_are_transformers_formula_in_one_pass(overrides):
    """The keys a decode step derives from the cached values (its weight and rotation folded into held
    tables) against the formula: Gemma 4's proportional quarter of a head of 32 under a random key-norm
    weight, a full rotation without a key norm, half a head rotated; float32 within 1e-6 of the largest,
    bfloat16 within its rounding; tables grown for a longer context and remade when the weight changes."""
    torch.manual_seed(0)
    cfg = to_bench_config(compose(*overrides))
    model = Decoder(cfg.model, cfg.attention)
    index = next(i for i, layer in enumerate(model.layouts) if isinstance(layer, GlobalHeads) and layer.k_eq_v)
    attn, layout = model.blocks[index].attn, model.layouts[index]
    D, H_kv = layout.head_dim, layout.num_kv_heads
    weight = attn._key_scale()
    if weight is not None:
        attn.k_norm.weight.normal_(1.0, 0.3)
    inv_freq, rotary = attn.inv_freq(torch.device("cpu")), 2 * attn.inv_freq(torch.device("cpu")).numel()
    assert (rotary, int(torch.count_nonzero(inv_freq))) == {"model=tiny_gemma4": (32, 4)}.get(overrides[0], (
        rotary, rotary // 2)) and rotary == (D // 2 if "model.partial_rotary_factor=0.5" in overrides else D)
    for S in (5, 37):  # the second longer than the tables made for the first
        values = torch.randn(2, H_kv, S, D)
        want = _reference_keys(values, attn._key_scale(), inv_freq, rotary, attn.rope_factor)
        got = attn._derived_keys(values)
        assert (got - want).abs().max().item() <= 1e-6 * want.abs().max().item()
        half = values.to(torch.bfloat16)
        got, want = attn._derived_keys(half).float(), _reference_keys(half, attn._key_scale(), inv_freq, rotary).float()
        assert (got - want).abs().max().item() <= 2 ** -6 * want.abs().max().item()
    if weight is not None:  # a changed weight: the tables follow it
        attn.k_norm.weight.mul_(2.0)
        values = torch.randn(1, H_kv, 9, D)
        want = _reference_keys(values, attn._key_scale(), inv_freq, rotary, attn.rope_factor)
        assert (attn._derived_keys(values) - want).abs().max().item() <= 1e-6 * want.abs().max().item()


def test_compare_records_what_a_k_eq_v_step_moves_beyond_the_bytes_it_holds(tiny):
    """The key pass a K=V step makes is said in compare's record (``<v>_kv_step_note``, a registered
    metric) and under its table, not left for the reader to infer from a slope above the bytes' ratio."""
    from kvbench.layouts.build import build_layouts
    from kvbench.results import RunResult
    from kvbench.sinks.interleaved import interleaved_notes
    from kvbench.tasks.compare import METRICS, _step_note

    notes = {k: _step_note(build_layouts(cfg.model, cfg.attention)) for k, cfg in tiny.items()}
    assert notes[0] == {} and notes[1]["kv_step_note"].startswith("K=V: each step derives the keys")
    assert "<v>_kv_step_note" in METRICS
    rows = [{"variant": v, "layout": v, "step_ms_ctx8": 1.0, **notes[k]} for k, v in ((0, "gqa kv=2"),
                                                                                      (1, "gqa kv=2 k=v"))]
    record = RunResult(status="ok", config={"task": "compare", "compare": {"contexts": [8]}},
                       tables={"compare": rows})
    assert [n for n in interleaved_notes(record) if "K=V" in n] == [f"gqa kv=2 k=v: {notes[1]['kv_step_note']}"]
