"""Mamba-2 hybrid checkpoints through kvbench's loader (model.path), exact against transformers' own
classes with random weights: Nemotron-H (NemotronHForCausalLM: one mixer per layer, M Mamba-2,
* attention without rotary embeddings, - a relu2 MLP) as kvbench's blocks of a mixer and the MLP
after it. Perplexity within 1e-5 relative (task=eval's record against transformers' logits), 40
greedy cached decode steps token-equal to generate, the state per sequence against a hand formula
in task=inspect, and what the reader refuses, in one line naming the key."""

import json

import pytest
import torch
from conftest import edit_config_json
from hf_parity import check_greedy_steps, check_logits_and_perplexity, check_task_eval

from kvbench.checkpoint import load_llama_dir
from kvbench.config.model import ModelConfig
from kvbench.core.errors import ConfigError
from kvbench.layouts.kv_heads import KVHeads
from kvbench.layouts.mamba2 import Mamba2

VOCAB = 256  # the byte corpus of task=eval
# 9 Nemotron-H layers: mamba + MLP, attention + MLP, mamba alone (a mixer followed by a mixer),
# mamba + MLP, attention alone, mamba + MLP: six kvbench blocks, two of them without an MLP
PATTERN = "M-*-MM-*M-"
NEMOTRON_H = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  intermediate_size=96, mamba_num_heads=8, mamba_head_dim=8, ssm_state_size=16, n_groups=2,
                  conv_kernel=4, chunk_size=16, use_bias=True, initializer_range=0.1, max_position_embeddings=512,
                  hybrid_override_pattern=PATTERN)


# transformers' warnings off: it falls back to the torch path compared with (conftest.quiet_transformers)
pytestmark = pytest.mark.usefixtures("quiet_transformers")


def assert_exact(model, hf, length, spread):
    """``model`` against transformers' ``hf`` on 2 seeded sequences of ``length``: logits within 1e-5 of their
    largest (their spread above ``spread``: not a flat output), perplexity within 1e-5, and 40 greedy cached
    steps after 21 prompt tokens the tokens of ``hf.generate``; the tokens generated."""
    tokens = torch.randint(0, VOCAB, (2, length), generator=torch.Generator().manual_seed(1))
    check_logits_and_perplexity(model, hf, tokens, spread=spread)
    return check_greedy_steps(model, hf, tokens[:, :21])


def nemotron_h_dir(path, **overrides):
    """A random NemotronHForCausalLM saved with save_pretrained; (dir, model)."""
    from transformers import NemotronHConfig, NemotronHForCausalLM

    return _saved(path, lambda: NemotronHForCausalLM(NemotronHConfig(**{**NEMOTRON_H, **overrides})))


def _saved(path, make):
    """``make``, a random transformers model built under seed 0, saved to ``path``; (dir, model). Decays slow
    enough that the state carries across chunks and steps; dt biases, D and the norms off their initial values."""
    torch.manual_seed(0)
    hf = make().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(0.01, 0.3).log())
            elif name.endswith(("dt_bias", ".D")):
                p.normal_()
            elif "norm" in name:
                p.normal_(1.0, 0.3)
    hf.save_pretrained(path)
    hf.generation_config.eos_token_id = None  # every step whatever is drawn
    return path, hf


@torch.no_grad()
def test_a_nemotron_h_checkpoint_is_transformers_in_logits_and_40_greedy_cached_steps(tmp_path, one_torch_thread):
    path, hf = nemotron_h_dir(tmp_path)
    model, _ = load_llama_dir(path)
    assert [type(layer) for layer in model.layouts] == [Mamba2, KVHeads, Mamba2, Mamba2, KVHeads, Mamba2]
    assert model.config.no_mlp_layers == [2, 4] and model.layouts.rotary_dim() == 0
    mamba = model.layouts[0]
    assert (mamba.mamba_num_heads, mamba.mamba_head_dim, mamba.ssm_state_size, mamba.n_groups) == (8, 8, 16, 2)
    assert model.num_params() == hf.num_parameters()

    tokens = torch.randint(0, VOCAB, (2, 75), generator=torch.Generator().manual_seed(1))  # 4+ chunks of 16
    check_logits_and_perplexity(model, hf, tokens)
    check_greedy_steps(model, hf, tokens[:, :21])  # a prompt that is no multiple of the chunk, then 40 steps


@torch.no_grad()
def test_a_nemotron_h_checkpoint_with_experts_is_transformers(tmp_path, one_torch_thread):
    """E layers (NemotronHMoE): relu2 experts routed by the sigmoid router with its correction bias, in
    groups (the best 1 of 2), one relu2 shared expert; beside - layers, the dense blocks. Logits,
    perplexity and 40 greedy cached steps as transformers; the parameters counted without building."""
    from kvbench.footprint import parameter_counts

    path, hf = nemotron_h_dir(tmp_path, hybrid_override_pattern="ME*-ME", n_routed_experts=8, num_experts_per_tok=2,
                              moe_intermediate_size=32, moe_shared_expert_intermediate_size=48, n_group=2,
                              topk_group=1, routed_scaling_factor=1.5)
    with torch.no_grad():  # a correction bias off 0, so that it moves the choice
        for layer in (1, 5):
            hf.model.layers[layer].mixer.gate.e_score_correction_bias.normal_(0, 0.1)
    hf.save_pretrained(path)
    model, _ = load_llama_dir(path)
    moe = model.config.moe
    assert (moe.num_experts, moe.top_k, moe.router, moe.n_group, moe.dense_layers) == (8, 2, "sigmoid", 2, [1])
    assert model.num_params() == hf.num_parameters() == parameter_counts(model.config, model.attention).total
    assert_exact(model, hf, 60, spread=0.5)


def test_task_eval_of_a_nemotron_h_checkpoint_is_transformers_perplexity(tmp_path, one_torch_thread):
    """model.path's route (task=eval reads the checkpoint whole): the record's perplexity within 1e-5
    relative of transformers' over the same slices of the byte corpus."""
    path, hf = nemotron_h_dir(tmp_path / "ck")
    model = check_task_eval(path, hf, tmp_path, seq_len=100)
    assert model.preset_layer_types == ["mamba", "full_attention", "mamba", "mamba", "full_attention", "mamba"]


# Granite 4 (dense): 4 layers, mamba and attention, each with the shared gated MLP; its multipliers off 1
GRANITE = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
               shared_intermediate_size=96, num_local_experts=0, mamba_n_heads=8, mamba_n_groups=2, mamba_d_state=12,
               mamba_d_conv=3, mamba_chunk_size=24, mamba_expand=2, initializer_range=0.1, max_position_embeddings=512,
               layer_types=["mamba", "attention", "mamba", "attention"], num_hidden_layers=4,
               embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=2.5)


def granite_dir(path, **overrides):
    """A random dense GraniteMoeHybridForCausalLM saved with save_pretrained; (dir, model)."""
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    return _saved(path, lambda: GraniteMoeHybridForCausalLM(GraniteMoeHybridConfig(**{**GRANITE, **overrides})))


@pytest.mark.parametrize("position", ["nope", "rope"])
@torch.no_grad()
def test_a_granite_4_checkpoint_is_transformers_in_logits_perplexity_and_40_greedy_cached_steps(
        tmp_path, one_torch_thread, position):
    """Granite 4's multipliers (embedding, residual, attention logits, output logits) and its shared MLP
    whose gate and up rows are one tensor, without rotary embeddings (nope: Granite 4.0-H) or with."""
    path, hf = granite_dir(tmp_path, position_embedding_type=position)
    model, _ = load_llama_dir(path)
    assert [type(layer) for layer in model.layouts] == [Mamba2, KVHeads] * 2
    assert model.layouts.rotary_dim() == (16 if position == "rope" else 0)
    assert model.num_params() == hf.num_parameters()
    got = assert_exact(model, hf, 75, spread=0.1)
    assert len(set(got[0].tolist())) > 5


def test_a_model_without_rotary_embeddings_builds_no_position_table_however_long_its_positions(tmp_path):
    """Granite 4.0-H rotates nothing, yet a config.json of 10**12 positions asked its loader for a float64
    position per row (8 TB, a crash where the memory check counted 0 B for its rotary tables). Nothing is
    built per position now, and the memory check counts the positions only where a table is built."""
    from kvbench.footprint import rope_peak_bytes

    path, hf = granite_dir(tmp_path, position_embedding_type="nope")
    edit_config_json(path, max_position_embeddings=10 ** 12)
    model, _ = load_llama_dir(path)
    assert model.config.max_seq_len == 10 ** 12 and rope_peak_bytes(model.config) == 0
    assert model.num_params() == hf.num_parameters()
    rotated = ModelConfig(name="r", num_layers=1, d_model=32, num_heads=4, preset_kv_heads=4, max_seq_len=1000)
    assert rope_peak_bytes(rotated) >= 1000 * 8  # each row's position, beside its angles


@pytest.mark.parametrize("change, line", [
    ({"hybrid_override_pattern": "-M*"}, "hybrid_override_pattern='-M*': layer 0 is an MLP (-) that follows no "
     "mixer layer (M or *); a block of an MLP alone is not built"),
    ({"hybrid_override_pattern": "M--"}, "hybrid_override_pattern='M--': layer 2 is an MLP (-) that follows no "
     "mixer layer (M or *); a block of an MLP alone is not built"),
    ({"hybrid_override_pattern": "EM"}, "hybrid_override_pattern='EM': layer 0 is an MLP (E) that follows no "
     "mixer layer (M or *); a block of an MLP alone is not built"),
    ({"hybrid_override_pattern": "ME", "moe_latent_size": 16}, "moe_latent_size=16: experts in a latent space"),
    ({"hybrid_override_pattern": "MX*"}, "hybrid_override_pattern='MX*': must be letters of M*-E"),
    ({"mlp_hidden_act": "gelu"}, "mlp_hidden_act='gelu': not supported in a Nemotron-H MLP (relu2 only)"),
    ({"mamba_num_heads": "8"}, "mamba_num_heads='8': must be a positive integer"),
    ({"n_groups": 3}, "n_groups=3: must divide mamba_num_heads=8"),
])
def test_a_nemotron_h_config_json_it_cannot_run_is_refused_in_one_line_naming_the_key(tmp_path, change, line):
    """A hand-edited config.json: refused where it is read, naming the file, the key and the value."""
    (tmp_path / "config.json").write_text(json.dumps({**NEMOTRON_H, "architectures": ["NemotronHForCausalLM"],
                                                      **change}))
    with pytest.raises(ConfigError) as info:
        ModelConfig(path=str(tmp_path))
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"model.path={str(tmp_path)!r}: ") and line in message


def test_a_nemotron_h_checkpoint_missing_a_mixer_tensor_is_refused_naming_it(tmp_path):
    from kvbench.hf_weights import CheckpointError

    path, hf = nemotron_h_dir(tmp_path, hybrid_override_pattern="M-*")
    state = {k: v for k, v in hf.state_dict().items() if k != "model.layers.0.mixer.A_log"}
    from safetensors.torch import save_file

    (path / "model.safetensors").unlink()
    save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"))
    edit_config_json(path)
    with pytest.raises(CheckpointError) as info:
        load_llama_dir(path)
    assert "missing" in str(info.value) and "A_log" in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("state_dtype, dtype", [("float32", "float32"), ("bfloat16", "float16")])
def test_task_inspect_of_a_nemotron_h_checkpoint_prints_the_state_per_sequence_by_hand(tmp_path, state_dtype, dtype):
    """task=inspect with model.path: the mamba layers' state per sequence is, per layer, the SSM state
    H·P·N in cache.state_dtype plus the convolution's last K − 1 inputs of H·P + 2·G·N channels in the
    compute dtype, whatever the length; the parameters counted are transformers'."""
    from conftest import compose

    from kvbench.jobs.job_config import to_bench_config
    from kvbench.tasks.inspect import describe

    path, hf = nemotron_h_dir(tmp_path)
    job = to_bench_config(compose("model=hf_dir", f"model.path={path}", "task=inspect", "workload.prompt_len=100",
                                  f"cache.state_dtype={state_dtype}", f"runtime.dtype={dtype}"))
    H, P, N, G, K = 8, 8, 16, 2, 4
    bytes_of = {"float32": 4, "bfloat16": 2, "float16": 2}
    per_layer = H * P * N * bytes_of[state_dtype] + (K - 1) * (H * P + 2 * G * N) * bytes_of[dtype]
    lines = describe(job).splitlines()
    row = next(line.split() for line in lines if line.startswith("mamba2 "))
    assert row[:3] == ["mamba2", "4", "0"]  # 4 mamba layers, no position held
    assert f"({4 * per_layer:,})" in " ".join(row)
    state_column = [line for line in lines if line.startswith(f"{dtype} ")][0]
    assert f"({4 * per_layer:,})" in state_column
    assert f"{hf.num_parameters():,}" in describe(job)


def test_the_registry_example_builds_a_mamba2_hybrid_named_and_counted_by_its_kind():
    """The kind's example (model=tiny, attention.layer_types=[mamba,full_attention]): a Mamba-2 layer in
    the model's proportions (its 8 heads, expand 2: heads of 16, a state of head_dim 8, one group),
    its state per sequence by hand, its label, and a parameter count equal to the built decoder's."""
    from conftest import compose

    from kvbench.config.layer_pattern import job_variant_label
    from kvbench.footprint import parameter_counts
    from kvbench.jobs.job_config import to_bench_config
    from kvbench.layouts.registry import by_layer_type
    from kvbench.model import Decoder

    job = to_bench_config(compose(*by_layer_type("mamba").examples["mamba2"], "task=inspect"))
    model = Decoder(job.model, job.attention)
    mamba = model.layouts[0]
    assert isinstance(mamba, Mamba2) and isinstance(model.layouts[1], KVHeads)
    H, P, N, G, K = 8, 16, 8, 1, 4
    assert (mamba.mamba_num_heads, mamba.mamba_head_dim, mamba.ssm_state_size, mamba.n_groups) == (H, P, N, G)
    assert model.layouts.state_bytes(4) == H * P * N * 4 + (K - 1) * (H * P + 2 * G * N) * 4
    assert job_variant_label(job) == "mha kv=8 mamba2 1:1"
    assert parameter_counts(job.model, job.attention).total == model.num_params()


def test_compare_names_a_mamba2_hybrid_by_its_letter_as_its_layer_types_would():
    """``:m<k>`` is transformers' full_attention_interval k over Mamba-2 layers (layers k-1, 2k-1, ...
    full attention, the others mamba), the same layout and label as listing them in
    attention.layer_types; beside Gated DeltaNet's ``:d<k>`` it is its own variant, and both in one
    variant, or with MLA, are refused in one line naming compare.variants and the entry."""
    from conftest import compose

    from kvbench.config.layer_pattern import job_variant_label, variant_label
    from kvbench.jobs.job_config import to_bench_config

    L, k = 6, 3
    job = to_bench_config(compose("model=tiny", f"model.num_layers={L}", "task=compare",
                                  f"compare.variants=[gqa,gqa:m{k},gqa:d{k}]"))
    _, mamba, gdn = job.compare.attentions(job.model)
    interval = ["full_attention" if (i + 1) % k == 0 else "mamba" for i in range(L)]  # transformers' rule
    assert mamba.layer_types == interval and gdn.layer_types == [t.replace("mamba", "linear_attention")
                                                                 for t in interval]
    listed = to_bench_config(compose("model=tiny", f"model.num_layers={L}", "attention=gqa",
                                     f"attention.layer_types=[{','.join(interval)}]"))
    assert variant_label(mamba, num_layers=L) == job_variant_label(listed) == "gqa kv=2 mamba2 2:1"
    for variants, line in [("[gqa,gqa:m3:d3]", "compare.variants=['gqa', 'gqa:m3:d3']: 'gqa:m3:d3': option 'd3'"),
                           ("[mla,mla:m3]", "compare.variants=['mla', 'mla:m3']: 'mla:m3': attention.type='mla': "
                                            "mla beside mamba (Mamba-2) layers is not built")]:
        with pytest.raises(ConfigError) as info:
            to_bench_config(compose("model=tiny", f"model.num_layers={L}", "task=compare",
                                    f"compare.variants={variants}"))
        assert str(info.value).startswith(line) and "\n" not in str(info.value)


@pytest.mark.parametrize("override, line", [
    ("+model.layer_shapes.mamba2.n_groups=3", "model.layer_shapes.mamba2.n_groups=3: must divide mamba_num_heads=8"),
    ("+model.layer_shapes.mamba2.heads=4", "model.layer_shapes.mamba2.heads=4: not a Mamba-2 field"),
    ("+model.layer_shapes.mamba2.conv_kernel=0", "model.layer_shapes.mamba2.conv_kernel=0: must be a positive integer"),
])
def test_a_mamba2_shape_it_cannot_build_is_refused_naming_the_key(override, line):
    from conftest import compose

    from kvbench.jobs.job_config import to_bench_config
    from kvbench.layouts.build import build_layouts

    with pytest.raises(ConfigError) as info:
        job = to_bench_config(compose("model=tiny", "attention.layer_types=[mamba,full_attention]", override))
        build_layouts(job.model, job.attention)
    assert line in str(info.value) and "\n" not in str(info.value)


def test_the_nemotron3_nano_preset_has_the_model_cards_parameters_and_state():
    """conf/model/nemotron3_nano.yaml: 31.6 B parameters, 3.2 B active (the input embedding left out, as
    its model card counts), and per sequence 23 Mamba-2 states of 64·64·128 float32 plus a bfloat16
    convolution tail of 3 x (64·64 + 2·8·128) channels, whatever the length."""
    from conftest import compose

    from kvbench.footprint import parameter_counts
    from kvbench.jobs.job_config import to_bench_config
    from kvbench.layouts.build import build_layouts

    job = to_bench_config(compose("model=nemotron3_nano", "task=inspect", "runtime.dtype=bfloat16"))
    counts = parameter_counts(job.model, job.attention)
    assert round(counts.total / 1e9, 1) == 31.6 and round(counts.active / 1e9, 1) == 3.2
    layouts = build_layouts(job.model, job.attention)
    assert sum(isinstance(layer, Mamba2) for layer in layouts) == 23
    assert layouts.state_bytes(2) == 23 * (64 * 64 * 128 * 4 + 3 * (64 * 64 + 2 * 8 * 128) * 2)
    assert layouts.bytes_per_token(2) == 6 * 2 * 2 * 128 * 2


# (preset, total, active, the card's billions total and active, Mamba-2 layers, heads, groups, attention layers x
# K/V width): total and active as the checkpoint holds them (one table where it ties them), by hand from each
# config.json and equal to transformers' own class built on the meta device from it (GraniteMoeHybridForCausalLM,
# NemotronHForCausalLM: 32,207,337,984, 3,191,396,096 and, with its latent projections, 120,668,687,360).
# Nemotron 3 Super's experts run in a latent kvbench does not build: its counts are the published ones less the two
# latent projections of its 40 MoE layers (conf/model/nemotron3_super.yaml says how its experts are shaped instead).
SUPER_LATENT = 40 * 2 * 4096 * 1024
PRESETS = [
    ("nemotron3_super", 120_668_687_360 - SUPER_LATENT, 12_770_216_960 - SUPER_LATENT, (120, 12), 40, 128, 8, 8 * 256),
    ("granite4_h_small", 32_207_337_984, 8_803_121_664, (32, 9), 36, 128, 1, 4 * 1024),
    ("granite4_h_micro", 3_191_396_096, 3_191_396_096, (3, 3), 36, 64, 1, 4 * 512),
]


@pytest.mark.parametrize("preset, total, active, card, mambas, heads, groups, kv_width", PRESETS)
def test_the_mamba2_presets_have_the_model_cards_parameters_and_state(preset, total, active, card, mambas, heads,
                                                                        groups, kv_width):
    """conf/model/{nemotron3_super, granite4_h_small, granite4_h_micro}.yaml: the parameters as their checkpoints
    count them (kvbench's decoder keeps a tied output table apart: Granite's counted once here), rounding to
    the model cards' billions; per sequence each Mamba-2 layer's state of H·64·128 float32 plus a bfloat16
    convolution tail of 3 x (H·64 + 2·G·128) channels, and K/V per token only in the attention layers."""
    from conftest import compose

    from kvbench.footprint import parameter_counts
    from kvbench.jobs.job_config import to_bench_config
    from kvbench.layouts.build import build_layouts

    job = to_bench_config(compose(f"model={preset}", "task=inspect", "runtime.dtype=bfloat16"))
    counts = parameter_counts(job.model, job.attention)
    tied = preset.startswith("granite")  # tie_word_embeddings: one table in the checkpoint
    held, running = counts.total - tied * counts.embedding, counts.active + (not tied) * counts.embedding
    assert (held, running) == (total, active)
    assert (round(held / 1e9), round(running / 1e9)) == card
    layouts = build_layouts(job.model, job.attention)
    assert sum(isinstance(layer, Mamba2) for layer in layouts) == mambas
    assert layouts.state_bytes(2) == mambas * (heads * 64 * 128 * 4 + 3 * (heads * 64 + 2 * groups * 128) * 2)
    assert layouts.bytes_per_token(2) == 2 * kv_width * 2


@pytest.mark.parametrize("claim, clash", [
    ({"layer_types": ("mamba",)}, "['mamba']"),
    ({"letters": {"m": "full_attention_interval"}}, "['m']"),
    ({"hf_architectures": ("NemotronHForCausalLM",)}, "['NemotronHForCausalLM']"),  # its whole file: one reader
    ({"architectures": {"GraniteMoeHybridForCausalLM": {}}}, "['GraniteMoeHybridForCausalLM']"),
])
def test_a_kind_claiming_what_mamba2_registered_is_refused_in_one_line(claim, clash):
    """Layer types, compare letters and whole-file architectures have one owner each: a second kind
    claiming Mamba-2's is refused naming both, and the registry keeps what it had."""
    from kvbench.layouts.base import LayerLayout
    from kvbench.layouts.kinds import LayerKind, registered
    from kvbench.layouts.registry import register

    before = registered()
    with pytest.raises(ValueError) as info:
        register(LayerKind("intruder", LayerLayout, **claim))
    assert str(info.value) == f"layer kind 'intruder' claims {clash}, already 'mamba2''s"
    assert registered() == before
