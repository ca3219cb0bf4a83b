"""Write a small random checkpoint directory of an accepted architecture, as transformers'
save_pretrained writes a real one (config.json + model.safetensors), to try kvbench on without
downloading weights:

    python scripts/make_hf_dir.py --out llama32_tiny            # Llama-3.2-shaped, 3 layers
    python scripts/make_hf_dir.py --family qwen3 --out qwen3_tiny
    python scripts/make_hf_dir.py --family gpt_oss --out gpt_oss_tiny   # a mixture of experts

``llama3.2`` keeps Llama-3.2-1B's architecture (32 query heads, 8 KV heads, tied embeddings,
rope_theta 5e5 and its llama3 rope scaling: factor 32 over an original 8192-token context, up to
131072 positions) at a width a CPU runs in seconds (hidden 256, head_dim 8) and a byte vocabulary
(256), so ``task=eval`` reads plain text without a tokenizer. The weights are random: perplexity
is near 256, the point is the shape and the code path.
"""

from __future__ import annotations

import argparse
from pathlib import Path

# transformers class names and the config of each family (widths shrunk, architecture kept).
COMMON = dict(hidden_size=256, num_attention_heads=32, num_key_value_heads=8, head_dim=8, intermediate_size=512,
              vocab_size=256, rms_norm_eps=1e-5)
FAMILIES = {
    "llama3.2": ("LlamaConfig", "LlamaForCausalLM", dict(
        max_position_embeddings=131072, tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192}, rope_theta=500000.0)),
    "qwen2.5": ("Qwen2Config", "Qwen2ForCausalLM", dict(max_position_embeddings=32768, tie_word_embeddings=True,
                                                        rope_theta=1000000.0)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(max_position_embeddings=40960, tie_word_embeddings=True,
                                                      rope_theta=1000000.0)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(max_position_embeddings=32768, sliding_window=None,
                                                            rope_theta=1000000.0)),
    # mixtures of experts (docs/moe.md): 16 experts of 64, 4 per token, in the families' own routing
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        max_position_embeddings=40960, rope_theta=1000000.0, num_experts=16, num_experts_per_tok=4,
        moe_intermediate_size=64, norm_topk_prob=True)),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(  # sinks, alternating windows of 128, yarn, clamped SwiGLU
        max_position_embeddings=131072, rope_theta=150000.0, intermediate_size=64, num_local_experts=16,
        num_experts_per_tok=4, sliding_window=128,
        rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                      "original_max_position_embeddings": 4096})),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(  # MLA; layer 0 dense, then experts
        max_position_embeddings=4096, rope_theta=10000.0, num_key_value_heads=32, q_lora_rank=64, kv_lora_rank=32,
        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
        topk_group=2, moe_intermediate_size=64, n_shared_experts=1, first_k_dense_replace=1)),
}


def rope_keys(settings: dict) -> dict:
    """transformers >= 5 reads rope settings from rope_parameters; older versions from
    rope_theta and rope_scaling."""
    import transformers

    if int(transformers.__version__.split(".")[0]) < 5:
        return settings
    settings = dict(settings)
    scaling = settings.pop("rope_scaling", None) or {"rope_type": "default"}
    return {**settings, "rope_parameters": {"rope_theta": settings.pop("rope_theta"), **scaling}}


def make(out: Path, family: str = "llama3.2", layers: int = 3, seed: int = 0) -> Path:
    import torch
    import transformers

    config_name, model_name, settings = FAMILIES[family]
    config = getattr(transformers, config_name)(num_hidden_layers=layers, **{**COMMON, **rope_keys(settings)})
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).eval()
    model.save_pretrained(out)
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the directory to write")
    parser.add_argument("--family", choices=FAMILIES, default="llama3.2")
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(f"{args.family}: {make(args.out, args.family, args.layers, args.seed)}")


if __name__ == "__main__":
    main()
