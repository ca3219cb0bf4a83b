"""Gemma 4 (transformers' Gemma4ForCausalLM) through kvbench's loader, exact against transformers with
random weights, in its two forms: a 31B-like one (sliding layers beside global layers of their own
heads whose keys are their values, K=V) and an E-model-like one (global layers of their own width with
K and V, KV sharing over the last layers, their MLPs twice as wide as E2B's, per-layer inputs). Logits
within 1e-5, perplexity within 1e-5 relative (task=eval's record too), 40 greedy cached steps past the
window token-equal to ``generate``; what a K=V layer holds and a serving page of it against the formula
(half a K+V layer's); the presets' parameters against the model cards and their bytes against the hand
derivation in docs/layouts-gemma4.md; what the reader refuses, in one line naming the key."""

import json

import pytest
import torch
from conftest import TEXT, compose, eval_job, transformers_perplexity
from test_mamba2_hybrids import VOCAB, assert_exact

from kvbench.cache import cache_for
from kvbench.checkpoint import load_llama_dir
from kvbench.config.model import AttentionConfig, ModelConfig
from kvbench.core.errors import ConfigError
from kvbench.footprint import parameter_counts
from kvbench.jobs.job_config import to_bench_config
from kvbench.layouts.global_heads import GlobalHeads
from kvbench.layouts.kv_heads import KVHeads

pytestmark = pytest.mark.usefixtures("quiet_transformers")

SLIDING, FULL = "sliding_attention", "full_attention"
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, global_head_dim=32, sliding_window=8, final_logit_softcapping=30.0,
            max_position_embeddings=128)
FORMS = {  # 31B: K=V globals of 1 KV head; E-model (E2B): K and V, 2 layers sharing with MLPs twice as wide,
    # per-layer inputs of 8
    "dense": dict(num_hidden_layers=4, layer_types=[SLIDING, FULL] * 2, attention_k_eq_v=True,
                  num_global_key_value_heads=1, hidden_size_per_layer_input=0),
    "e_model": dict(num_hidden_layers=6, layer_types=[SLIDING, SLIDING, FULL] * 2, attention_k_eq_v=False,
                    num_kv_shared_layers=2, hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB,
                    use_double_wide_mlp=True),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Each form saved with save_pretrained, its norms, layer scalars and per-layer inputs off their
    initial values (so that reading them is checked); {form: (dir, transformers model)}."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    out = {}
    for form, fields in FORMS.items():
        torch.manual_seed(0)
        hf = Gemma4ForCausalLM(Gemma4TextConfig(**BASE, **fields)).eval()
        with torch.no_grad():
            for name, p in hf.named_parameters():
                if "norm" in name:
                    p.normal_(1.0, 0.3)
            for i, layer in enumerate(hf.model.layers):
                layer.layer_scalar.fill_(0.8 + 0.1 * i)
        path = tmp_path_factory.mktemp(form)
        hf.save_pretrained(path)
        hf.generation_config.eos_token_id = None  # every step whatever is drawn
        out[form] = path, hf
    return out


@pytest.mark.parametrize("form", FORMS)
@torch.no_grad()
def test_a_gemma4_checkpoint_is_transformers_in_logits_perplexity_and_40_greedy_cached_steps(
        checkpoints, form, one_torch_thread):
    path, hf = checkpoints[form]
    model, _ = load_llama_dir(path)
    kinds = [type(layer) for layer in model.layouts]
    assert kinds == [KVHeads, GlobalHeads] * 2 if form == "dense" else [KVHeads, KVHeads, GlobalHeads] * 2
    assert model.num_params() - model.embed.weight.numel() == hf.num_parameters()  # its head is its embedding
    assert parameter_counts(model.config, model.attention).total == model.num_params()
    glob = model.layouts[2 if form == "e_model" else 1]
    assert (glob.num_kv_heads, glob.head_dim, glob.k_eq_v) == ((1, 32, True) if form == "dense" else (2, 32, False))
    got = assert_exact(model, hf, 40, spread=0.1)  # 21 prompt tokens and 40 steps: far past the window of 8
    assert len(set(got[0].tolist())) > 5
    if form == "e_model":  # the last two layers hold nothing: they read layer 3 (sliding) and 2 (global)
        assert [layer.kv_source for layer in model.layouts[4:]] == [3, 2]
        # use_double_wide_mlp: a shared layer's MLP twice intermediate_size wide, as transformers builds it
        assert [b.mlp.w_up.out_features for b in model.blocks] == [96] * 4 + [192] * 2 == \
            [layer.mlp.intermediate_size for layer in hf.model.layers]


@torch.no_grad()
def test_a_config_json_without_tie_word_embeddings_ties_as_transformers_does(checkpoints, tmp_path):
    """Gemma4TextConfig ties the head to the embedding unless the file says not (its default is true,
    Llama's false): a file without the key has no lm_head, and loads as transformers loads it."""
    import shutil

    src, hf = checkpoints["dense"]
    path = tmp_path / "untold"
    shutil.copytree(src, path)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg.pop("tie_word_embeddings") is True
    (path / "config.json").write_text(json.dumps(cfg))
    model, _ = load_llama_dir(path)
    tokens = torch.randint(0, BASE["vocab_size"], (1, 12), generator=torch.Generator().manual_seed(3))
    assert torch.equal(model.lm_head.weight, model.embed.weight)
    assert (model(tokens) - hf(tokens).logits).abs().max().item() <= 1e-5 * hf(tokens).logits.abs().max().item()


def test_task_eval_of_a_gemma4_checkpoint_is_transformers_perplexity(checkpoints, tmp_path, one_torch_thread):
    """model.path's route: the record's perplexity within 1e-5 relative of transformers' on the byte corpus."""
    from kvbench.quality.train import run_eval

    path, hf = checkpoints["dense"]
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(TEXT)
    cfg = eval_job(ModelConfig(path=str(path)), AttentionConfig(), corpus, path, val_fraction=0.25, seq_len=40,
                   batch_size=2)
    assert run_eval(cfg, torch.device("cpu"))["perplexity"] == pytest.approx(transformers_perplexity(hf, cfg),
                                                                             rel=1e-5)


def test_a_k_eq_v_layer_holds_one_tensor_and_its_page_is_half_as_wide(checkpoints):
    """The dense form's global layer: a static cache allocates B x H_kv x S x D once (the values), the
    formula says so, and its serving page is half of the same layer's with K and V apart."""
    path, _ = checkpoints["dense"]
    model, _ = load_llama_dir(path)
    B, S, layer = 2, 20, model.layouts[1]
    cache = cache_for(model, "static", B, S)
    assert sum(t.nbytes for t in cache.layers[1].tensors()) == B * 1 * S * 32 * 4 == layer.sequence_bytes(S, 4) * B
    apart = GlobalHeads(None, 4, 1, 32, k_eq_v=False)
    assert layer.page_spec(4).page_bytes(16) * 2 == apart.page_spec(4).page_bytes(16) == 2 * 16 * 32 * 4
    assert layer.read_bytes(S, 4) * 2 == apart.read_bytes(S, 4)


# (preset, the card's total, its effective figure: what the card counts as one, the text decoder's share)
# Gemma 4 31B's card: 30.7B. E4B's: 4.5B effective, 8B with embeddings, both with its vision (~150M) and
# audio (~300M) encoders, which kvbench's text decoder leaves out (written from memory of the cards).
ENCODERS = 450e6


@pytest.fixture(scope="module")
def presets():
    """Each preset's composed config (31B's workload a sequence of 32,768) and its job config."""
    out = {}
    for preset in ("gemma4_31b", "gemma4_e4b"):
        composed = compose(f"model={preset}", "task=inspect", "workload.prompt_len=32000", "workload.gen_len=768")
        out[preset] = composed, to_bench_config(composed)
    return out


def test_the_gemma4_presets_count_what_the_model_cards_say(presets):
    c = parameter_counts(presets["gemma4_31b"][1].model, presets["gemma4_31b"][1].attention)
    # the head is tied to the embedding: the card counts that table once (active leaves it out, and keeps the head)
    assert c.active == pytest.approx(30.7e9, rel=0.005) and c.embedding == 262144 * 5376
    c = parameter_counts(presets["gemma4_e4b"][1].model, presets["gemma4_e4b"][1].attention)
    per_layer_table = 262144 * 42 * 256
    assert c.active + ENCODERS == pytest.approx(8e9, rel=0.02)  # with the embeddings (the head's copy once)
    assert c.active - per_layer_table - c.embedding + ENCODERS == pytest.approx(4.5e9, rel=0.03)


def test_inspect_of_gemma4_31b_prints_the_bytes_docs_derive_by_hand(presets, capsys):
    """docs/layouts-gemma4.md: a bf16 token adds 50 x 2 x 16 x 256 x 2 + 10 x 1 x 4 x 512 x 2 bytes until
    the windows fill; a sequence of 32,768 holds 50 x 1,024 x 16,384 + 10 x 32,768 x 4,096."""
    from kvbench.cli_job import _inspect
    from kvbench.layouts.build import build_layouts

    composed, cfg = presets["gemma4_31b"]
    assert _inspect(composed) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("bfloat16 "))
    assert "(2,181,038,080)" in row and 50 * 1024 * 16384 + 10 * 32768 * 4096 == 2_181_038_080
    assert build_layouts(cfg.model, cfg.attention).bytes_per_token(2) == 50 * 2 * 16 * 256 * 2 + 10 * 4 * 512 * 2


@pytest.mark.parametrize("change, line", [
    ({"use_bidirectional_attention": "vision"}, "use_bidirectional_attention='vision': not supported"),
    ({"use_double_wide_mlp": True, "num_kv_shared_layers": 2, "enable_moe_block": True, "num_experts": 4,
      "top_k_experts": 2, "moe_intermediate_size": 8}, "use_double_wide_mlp=True: beside enable_moe_block=True"),
    ({"rope_parameters": {FULL: {"rope_type": "yarn", "rope_theta": 1e6}}},
     "rope_parameters.full_attention.rope_type='yarn': not supported"),
    ({"per_layer_config": {"0": {"head_dim": 32}}}, "per_layer_config.0: only the full-attention layers' heads"),
    ({"per_layer_config": {"1": {"sliding_window": 4}}}, "per_layer_config.1.sliding_window: not read"),
    ({"hidden_activation": "silu"}, "hidden_activation='silu': not supported (gelu_pytorch_tanh only)"),
    ({"layer_types": [SLIDING] * 3}, "layer_types=['sliding_attention', 'sliding_attention', 'sliding_attention']: "
     "must list 4 layers"),
])
def test_a_gemma4_config_json_it_cannot_run_is_refused_in_one_line_naming_the_key(checkpoints, tmp_path, change,
                                                                                  line):
    path, _ = checkpoints["dense"]
    saved = json.loads((path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**saved, **change}))
    with pytest.raises(ConfigError) as info:
        ModelConfig(path=str(tmp_path))
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"model.path={str(tmp_path)!r}: ") and line in message
