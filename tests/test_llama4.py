"""Llama 4 (transformers' Llama4ForCausalLM) through kvbench's loader (model.path), exact against transformers
with random weights: chunked layers (attention_chunk_size 8: the mask resets at each multiple of 8), a global
layer without rotary embeddings and with the query temperature (floor_scale 4: it grows within the test's
positions), the L2 norm of the rope layers' queries and keys, and mixture-of-experts layers every other
layer (a sigmoid of the top logit weighing the expert's input, and a shared expert). Logits and perplexity
within 1e-5 relative, 40 greedy cached steps past several chunk boundaries token-equal to generate, task=eval's
perplexity; the chunked layout's figures against hand formulas; the presets' parameters against the model
cards."""

import pytest
import torch
from conftest import edit_config_json
from hf_parity import check_task_eval
from test_mamba2_hybrids import VOCAB, assert_exact

from kvbench.checkpoint import load_llama_dir
from kvbench.config.model import AttentionConfig, ModelConfig
from kvbench.core.errors import ConfigError
from kvbench.layouts.build import build_layouts
from kvbench.layouts.chunked import average_positions, live_positions
from kvbench.layouts.kv_heads import ChunkedKVHeads, KVHeads
from kvbench.layouts.pages import Chunks

CHUNK = 8
# 4 layers: 0-2 chunked with rotary embeddings, 3 global without (no_rope_layer_interval 4); experts in 1 and 3
LLAMA4 = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, intermediate_size_mlp=64, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
              interleave_moe_layer_step=2, attention_chunk_size=CHUNK, max_position_embeddings=128, floor_scale=4,
              attn_scale=0.5, initializer_range=0.2)

pytestmark = pytest.mark.usefixtures("quiet_transformers")


@pytest.fixture(scope="module")
def llama4(tmp_path_factory):
    """A random Llama4ForCausalLM saved with save_pretrained, its norms off 1; (dir, model)."""
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    path = tmp_path_factory.mktemp("llama4")
    torch.manual_seed(0)
    hf = Llama4ForCausalLM(Llama4TextConfig(**LLAMA4)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3)
    hf.save_pretrained(path)
    hf.generation_config.eos_token_id = None  # every step whatever is drawn
    return path, hf


@torch.no_grad()
def test_a_llama4_checkpoint_is_transformers_in_logits_perplexity_and_40_greedy_cached_steps(llama4,
                                                                                              one_torch_thread):
    from kvbench.footprint import parameter_counts

    path, hf = llama4
    model, _ = load_llama_dir(path)
    assert [type(layer) for layer in model.layouts] == [ChunkedKVHeads] * 3 + [KVHeads]
    assert [layer.rotary_dim for layer in model.layouts] == [8, 8, 8, 0] and model.layouts[0].chunk == CHUNK
    assert model.config.nope.layers == [3] and model.config.moe.dense_layers == [0, 2]
    assert model.num_params() == hf.num_parameters() == parameter_counts(model.config, model.attention).total
    # 21 prompt tokens and 40 steps: 62 positions, the chunk's mask reset 7 times
    got = assert_exact(model, hf, 60, spread=0.5)
    assert len(set(got[0].tolist())) > 5  # the steps do not repeat one token


def test_task_eval_of_a_llama4_checkpoint_is_transformers_perplexity(llama4, tmp_path, one_torch_thread):
    """model.path's route (task=eval reads the checkpoint whole): the record's perplexity within 1e-5
    relative of transformers' over the same slices of the byte corpus (slices of 40: five chunks)."""
    path, hf = llama4
    model = check_task_eval(path, hf, tmp_path, seq_len=40)
    assert (model.preset_chunk, model.preset_layer_types) == (CHUNK, ["sliding_attention"] * 3 + ["full_attention"])


def test_a_chunked_layer_holds_its_chunk_and_frees_its_blocks_at_each_boundary():
    """C = 8: positions held and read by hand (the chunk of the last position), the worst case C, the
    mean over lengths, and a serving store's blocks of 4: both freed at each multiple of 8."""
    layer = ChunkedKVHeads(CHUNK, 4, 2, 8)
    assert [live_positions(t, CHUNK) for t in (0, 1, 7, 8, 9, 16, 17)] == [0, 1, 7, 8, 1, 8, 1]
    assert [layer.positions_held(t) for t in (1, 7, 8, 9, 100)] == [1, 7, 8, 8, 8]  # the worst case: C
    assert average_positions(16, CHUNK) == 4.5 and average_positions(10, CHUNK) == (36 + 3) / 10  # (C + 1) / 2
    per_position = 2 * 2 * 8 * 4  # K and V, 2 heads of 8, float32
    assert layer.sequence_bytes(100, 4) == 8 * per_position and layer.read_bytes(100, 4) == 4 * per_position
    assert (layer.sees(8, 7), layer.sees(9, 8), layer.sees(7, 0)) == (False, True, True)  # a reset, not a slide
    spec = layer.page_spec(4)
    assert type(spec) is Chunks and spec.position_bytes == per_position
    assert [spec.blocks_held(t, 4) for t in (4, 7, 8, 9, 15, 16, 17)] == [1, 2, 0, 1, 2, 0, 1]
    assert spec.worst_blocks(1000, 4, chunk=1) == 2 and spec.worst_blocks(1000, 4, chunk=5) == 3
    assert Chunks(per_position, 6).worst_blocks(1000, 4) == 3  # a chunk across a block: the one before too
    assert spec.paging != layer.unchunked().page_spec(4).paging


def test_the_llama4_reader_refuses_what_it_does_not_run_in_one_line(llama4, tmp_path):
    path, _ = llama4
    cases = [({"hidden_act": "gelu"}, "hidden_act='gelu': not supported"),
             ({"layer_types": ["chunked_attention"] * 3}, "layer_types=['chunked_attention', "),
             ({"no_rope_layers": [1, 2, 1, 0]}, "no_rope_layers=[1, 2, 1, 0]: must hold a 0"),
             ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0}}, "rope_parameters.rope_type='yarn': "),
             ({"attention_chunk_size": 0}, "attention_chunk_size=0: must be >= 1"),
             ({"num_key_value_heads": 3}, "num_key_value_heads=3: must divide num_attention_heads=4"),
             ({"attn_temperature_tuning": "yes"}, "attn_temperature_tuning='yes': must be a number"),
             ({"moe_layers": [1, 9]}, "moe_layers=[1, 9]: must list layer indices below num_hidden_layers=4")]
    for changes, message in cases:
        import shutil

        copy = tmp_path / str(len(list(tmp_path.iterdir())))
        shutil.copytree(path, copy)
        edit_config_json(copy, **changes)
        with pytest.raises(ConfigError) as info:
            ModelConfig(path=str(copy))
        assert message in str(info.value) and "\n" not in str(info.value), str(info.value)


def _hand_params(d, layers, heads, kv, D, vocab, experts, width, dense, moe_layers):
    """A Llama 4 language model's parameters from its config: attention (q, k, v, o), two norms per
    layer, a mixture of experts (router, routed experts, shared expert) or a dense SwiGLU, embeddings."""
    attention = 2 * d * heads * D + 2 * d * kv * D
    moe = experts * d + (experts + 1) * 3 * d * width
    return (layers * (attention + 2 * d) + moe_layers * moe + (layers - moe_layers) * 3 * d * dense
            + d + 2 * vocab * d)


@pytest.mark.parametrize("name, total, card_total, experts, moe_layers", [
    ("llama4_scout", 107_769_861_120, 109e9, 16, 48), ("llama4_maverick", 400_711_848_960, 400e9, 128, 24)])
def test_the_llama4_presets_have_the_model_cards_parameters(name, total, card_total, experts, moe_layers):
    """Total (the cards count a vision encoder of about 0.8B too) and active per token (17B: one routed
    expert and the shared one per MoE layer, the embedding row included) against the hand formula."""
    from conftest import compose

    from kvbench.footprint import parameter_counts
    from kvbench.jobs.job_config import to_bench_config

    job = to_bench_config(compose(f"model={name}", "task=inspect"))
    counts = parameter_counts(job.model, job.attention)
    assert counts.total == total == _hand_params(5120, 48, 40, 8, 128, 202048, experts, 8192, 16384, moe_layers)
    assert abs(counts.total / card_total - 1) < 0.015
    routed_off = moe_layers * (experts - 1) * 3 * 5120 * 8192
    assert counts.active == total - routed_off - 202048 * 5120  # without the embedding table
    assert abs((counts.active + counts.embedding) / 17e9 - 1) < 0.015
    assert job.attention.chunk == job.attention.window == 8192 and job.attention.global_every == 4


def test_inspect_of_llama4_scout_prints_the_bytes_the_docs_derive_by_hand(capsys):
    """docs/layouts-chunked.md: at 131,072 positions in bfloat16 a position of a layer is 2·8·128·2 B; 12
    global layers hold every position, 36 chunked layers C = 8192 at the worst, (C + 1)/2 on average."""
    from conftest import compose

    from kvbench.cli_job import _inspect

    assert _inspect(compose("model=llama4_scout", "task=inspect", "runtime.dtype=bfloat16",
                            "workload.prompt_len=131064", "workload.gen_len=8")) == 0
    out = " ".join(capsys.readouterr().out.split())  # the lines as printed, rewrapped
    position = 2 * 8 * 128 * 2
    glob, worst, mean = 12 * 131072 * position, 36 * 8192 * position, 36 * (8192 + 1) / 2 * position
    assert (glob, worst, int(mean)) == (6_442_450_944, 1_207_959_552, 604_053_504)
    assert f"bfloat16 57.00 KiB ({(glob + worst) // 131072:,}) 7.12 GiB ({glob + worst:,})" in out
    assert f"at the worst (C positions each) 1.12 GiB ({worst:,}), on average over its positions" in out
    assert f"({int(mean):,}) in bfloat16" in out and f"192.00 KiB ({48 * position:,}) in bfloat16" in out
    assert "chunk 8192 in 36 of 48 layers; no rotary embeddings in 12 of 48 layers" in out


@pytest.mark.parametrize("asked, model, message", [
    ({"chunk": -1}, {}, "attention.chunk=-1: must be >= 1 positions, 0 (none) or null"),
    ({}, {"preset_chunk": -3}, "model.preset_chunk=-3: must be >= 1 positions, 0 (none) or null"),
    ({"chunk": 9999}, {}, "attention.chunk=9999: must be <= model.max_seq_len=256"),
    ({"chunk": 8, "window": 4}, {}, "attention.chunk=8: makes the local layers attend within chunks of 8"),
    ({"type": "mla", "chunk": 8}, {}, "attention.chunk=8: is chunked attention of K/V-head layers"),
    ({"chunk": 8}, {"nope": {"layers": [5]}}, "model.nope.layers=[5]: must name layers below model.num_layers=2"),
    ({}, {"nope": {"floor_scale": -1.5}}, "model.nope.floor_scale=-1.5: must be a finite number > 0")])
def test_a_chunk_or_nope_layers_out_of_range_are_refused_in_one_line_naming_the_key(asked, model, message):
    with pytest.raises(ConfigError) as info:
        AttentionConfig(**asked).resolved(ModelConfig(**model))
    assert str(info.value).startswith(message) and "\n" not in str(info.value), str(info.value)


def test_compare_reads_a_chunk_by_its_letter():
    """``gqa:c8:g2``: the local layers (every second one global) chunked at 8, no window of their own."""
    from kvbench.config.compare import CompareConfig
    from kvbench.config.layer_pattern import variant_label

    model = ModelConfig(num_layers=4)
    chunked, windowed = CompareConfig(variants=["gqa:c8:g2", "gqa:w8:g2"]).attentions(model)
    assert (chunked.chunk, chunked.window, windowed.chunk) == (8, 8, 0)
    assert variant_label(chunked, num_layers=4) == "gqa kv=2 w=8 1:1 chunk=8"
    assert [type(layer).__name__ for layer in build_layouts(model, chunked)] == ["ChunkedKVHeads", "KVHeads"] * 2


def test_a_llama4_config_json_is_read_with_its_own_context_unless_capped(llama4):
    """The rotary table's rows: max_position_embeddings, or the cap a run gives (a checkpoint of 10M
    positions, as Scout's card claims, would otherwise hold 10M rows)."""
    import json

    path, _ = llama4
    cfg = json.loads((path / "config.json").read_text())
    assert ModelConfig.from_hf_config(cfg).max_seq_len == 128
    assert ModelConfig.from_hf_config(cfg, max_seq_len=64).max_seq_len == 64
