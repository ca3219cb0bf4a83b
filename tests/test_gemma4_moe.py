"""Gemma 4's mixture-of-experts form (26B-A4B: transformers' Gemma4ForCausalLM with ``enable_moe_block``)
through kvbench's loader, exact against transformers with random weights: the dense GeGLU and the routed
experts beside it in every layer, each with its own norms, the router's scales (kvbench.mlp.beside).
Logits and perplexity within 1e-5 relative, 40 greedy cached steps token-equal to ``generate``; the
parameters transformers counts, and the active ones against the formula; the routing each forward
records; what the reader refuses, in one line naming the key."""

import json

import pytest
import torch
from test_mamba2_hybrids import VOCAB, assert_exact

from kvbench.checkpoint import load_llama_dir
from kvbench.config.model import ModelConfig
from kvbench.core.errors import ConfigError
from kvbench.footprint import parameter_counts
from kvbench.mlp.beside import DenseBesideExperts
from kvbench.mlp.experts import record_routing

pytestmark = pytest.mark.usefixtures("quiet_transformers")

SLIDING, FULL = "sliding_attention", "full_attention"
E, K, I, C, L = 4, 2, 32, 64, 3  # noqa: E741  experts, top k, an expert's width, d_model, layers
MOE = dict(vocab_size=VOCAB, hidden_size=C, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
           head_dim=16, global_head_dim=32, sliding_window=8, final_logit_softcapping=30.0,
           max_position_embeddings=128, num_hidden_layers=L, layer_types=[SLIDING, SLIDING, FULL],
           attention_k_eq_v=True, num_global_key_value_heads=1, hidden_size_per_layer_input=0,
           enable_moe_block=True, num_experts=E, top_k_experts=K, moe_intermediate_size=I)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The MoE form saved with save_pretrained, its norms, router scales and per-expert scales off their
    initial values (so that reading them is checked); (dir, transformers model)."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    torch.manual_seed(0)
    hf = Gemma4ForCausalLM(Gemma4TextConfig(**MOE)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name or "scale" in name:
                p.normal_(1.0, 0.3)
            elif ".experts." in name:  # transformers leaves them as torch.empty made them
                p.normal_(0.0, 0.1)
        for i, layer in enumerate(hf.model.layers):
            layer.layer_scalar.fill_(0.8 + 0.1 * i)
    path = tmp_path_factory.mktemp("gemma4_moe")
    hf.save_pretrained(path)
    hf.generation_config.eos_token_id = None  # every step whatever is drawn
    return path, hf


@torch.no_grad()
def test_a_gemma4_moe_checkpoint_is_transformers_in_logits_perplexity_and_40_greedy_cached_steps(
        checkpoint, one_torch_thread):
    path, hf = checkpoint
    model, _ = load_llama_dir(path)
    assert all(isinstance(block.mlp, DenseBesideExperts) for block in model.blocks)
    got = assert_exact(model, hf, 40, spread=0.1)  # 21 prompt tokens and 40 steps: far past the window of 8
    assert len(set(got[0].tolist())) > 5
    with record_routing(model) as routing:  # every layer routes: a token's k experts, at most E in all
        model(torch.arange(6)[None])
    assert routing.logs and all(K <= n <= E for log in routing.logs for n in log) and len(routing.logs) == L


def test_a_gemma4_moe_checkpoints_parameters_are_transformers_count_and_active_the_formula(checkpoint):
    path, hf = checkpoint
    with torch.device("meta"):
        model, _ = load_llama_dir(path, device="meta")
    counts = parameter_counts(model.config, model.attention)
    embedding = VOCAB * C
    assert counts.total == model.num_params() == hf.num_parameters() + embedding  # its head is its embedding
    # a token skips E - k experts of each layer: their gate, up (C -> I) and down (I -> C)
    assert counts.active == counts.total - L * (E - K) * 3 * C * I - embedding
    assert counts.embedding == embedding


@pytest.mark.parametrize("change, line", [
    ({"top_k_experts": None}, "top_k_experts=None: enable_moe_block=True needs it"),
    ({"num_experts": 0}, "num_experts=0: must be an integer >= 1"),
    ({"top_k_experts": 5}, "top_k_experts=5: must be <= num_experts=4"),
])
def test_a_gemma4_moe_config_json_it_cannot_run_is_refused_in_one_line_naming_the_key(checkpoint, tmp_path, change,
                                                                                      line):
    path, _ = checkpoint
    saved = json.loads((path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**saved, **change}))
    with pytest.raises(ConfigError) as info:
        ModelConfig(path=str(tmp_path))
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"model.path={str(tmp_path)!r}: ") and line in message, message


# google/gemma-4-26B-A4B's text_config as public readers of its config.json quote it (conf/model/gemma4_26b_a4b.yaml)
PUBLISHED = dict(vocab_size=262144, hidden_size=2816, intermediate_size=2112, num_hidden_layers=30,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=256, global_head_dim=512,
                 num_global_key_value_heads=2, attention_k_eq_v=True, sliding_window=1024,
                 max_position_embeddings=262144, final_logit_softcapping=30.0, hidden_size_per_layer_input=0,
                 enable_moe_block=True, num_experts=128, top_k_experts=8, moe_intermediate_size=704,
                 layer_types=([SLIDING] * 5 + [FULL]) * 5)


def test_the_gemma4_26b_a4b_preset_is_its_config_json_and_counts_what_the_card_says(tmp_path):
    from conftest import compose
    from transformers import Gemma4TextConfig

    from kvbench.jobs.job_config import to_bench_config

    cfg = to_bench_config(compose("model=gemma4_26b_a4b", "task=inspect"))
    (tmp_path / "config.json").write_text(Gemma4TextConfig(**PUBLISHED, architectures=["Gemma4ForCausalLM"])
                                          .to_json_string())
    read = ModelConfig(path=str(tmp_path))
    for key in ("num_layers", "d_model", "num_heads", "preset_kv_heads", "head_dim", "ffn_dim", "vocab_size",
                "max_seq_len", "rope_theta", "norm_eps", "mlp_act", "preset_window", "preset_k_eq_v", "moe",
                "layer_shapes", "residual"):
        assert getattr(cfg.model, key) == getattr(read, key), key
    c = parameter_counts(cfg.model, cfg.attention)
    # the card: 25.2B without the tied embedding table (26B "total"), 3.8B active ("A4B")
    assert c.total - c.embedding == pytest.approx(25.2e9, rel=0.005) and c.embedding == 262144 * 2816
    assert c.active == pytest.approx(3.8e9, rel=0.01)


@pytest.mark.parametrize("factor", [0, True, 2.0])
def test_a_shared_mlp_factor_that_is_not_a_whole_widening_is_refused_in_one_line(factor):
    from kvbench.config.residual import ResidualForm

    with pytest.raises(ConfigError) as info:
        ResidualForm(shared_mlp_factor=factor)
    assert str(info.value).startswith(f"model.residual.shared_mlp_factor={factor!r}: must be an integer")
