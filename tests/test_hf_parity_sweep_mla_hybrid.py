"""A randomized parity sweep, frozen to a few seeds: DeepSeek-V2/V3/V3.2 and Qwen3-Next / Qwen3.5 /
Qwen3.5-MoE (and Qwen3.5's multimodal checkpoint) checkpoints of shapes no other test builds, drawn
per seed within what each architecture allows, saved with save_pretrained and loaded as a user
does: prefill, cached decode (both MLA forms) and chunked prefill against transformers' own class,
max logit difference <= 1e-4 in float32. The sweep this freezes ran hundreds of seeds per
architecture (it found DeepSeek's ignored sliding_window and its first_k_dense_replace default).

DSA's top-k: with few indexer heads, tokens whose every head's ReLU is 0 tie at the k-th place;
transformers' topk breaks ties by the call's shape, kvbench by token order (kvbench.layouts.
latent_indexer). transformers' indexer runs here with kvbench's documented rule, so ties compare."""

import inspect
import logging
import random

import pytest
import torch

from kvbench.cache import cache_for
from kvbench.checkpoint import load_llama_dir
from kvbench.layouts.attention import decode_form

CLASSES = {"deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM"),
           "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
           "deepseek_v32": ("DeepseekV32Config", "DeepseekV32ForCausalLM"),
           "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM"),
           "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM"),
           "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM"),
           "qwen3_5_vl": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration")}
# seeds whose draws cover, between them: q_lora_rank none and set, v_head_dim != qk_nope_head_dim,
# yarn with mscale and mscale_all_dim, llama3 rope, rope_interleave true and false, grouped routing,
# V2's group_limited_greedy, a DSA top-k of 3 (one indexer head: ties) and one above the sequence,
# partial rotary 0.25 / 0.5 / 1, conv kernels 2-5, value heads sharing key heads, mlp_only_layers,
# tied heads, the multimodal checkpoint's language model
SEEDS = {"deepseek_v2": [0, 6], "deepseek_v3": [1, 2], "deepseek_v32": [0, 3], "qwen3_next": [1, 9],
         "qwen3_5": [1, 10], "qwen3_5_moe": [3, 5], "qwen3_5_vl": [6]}
CASES = [(family, seed) for family, seeds in SEEDS.items() for seed in seeds]


def _rope(rng):
    theta = rng.choice([500.0, 10000.0, 1e6])
    kind = rng.choice(["default", "yarn", "yarn", "linear", "llama3"])
    if kind == "linear":
        return {"rope_type": "linear", "rope_theta": theta, "factor": 2.0,
                **({"mscale_all_dim": 0.5} if rng.random() < 0.5 else {})}
    if kind == "llama3":
        return {"rope_type": "llama3", "rope_theta": theta, "factor": 4.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    if kind == "yarn":
        extra = {k: rng.choice(v) for k, v in (("mscale", [0.707, 1.0]), ("mscale_all_dim", [0.8, 1.0]),
                                                ("beta_fast", [16, 32])) if rng.random() < 0.6}
        return {"rope_type": "yarn", "rope_theta": theta, "factor": rng.choice([4.0, 40.0]),
                "original_max_position_embeddings": rng.choice([16, 32]), **extra}
    return {"rope_type": "default", "rope_theta": theta}


def deepseek_config(rng, family):
    heads = rng.choice([1, 2, 3, 4])
    layers, experts = rng.randint(1, 3), rng.choice([4, 6, 8])
    group = rng.choice([g for g in (1, 2) if experts % g == 0])
    topk_group = rng.randint(1, group)
    cfg = dict(hidden_size=12 * rng.choice([2, 4]), num_hidden_layers=layers, num_attention_heads=heads,
               num_key_value_heads=heads, intermediate_size=40, vocab_size=97, max_position_embeddings=64,
               rms_norm_eps=rng.choice([1e-6, 1e-3]), q_lora_rank=rng.choice([None, 12]),
               kv_lora_rank=rng.choice([4, 16]), qk_nope_head_dim=rng.choice([2, 6, 8]),
               qk_rope_head_dim=rng.choice([2, 4, 8]), v_head_dim=rng.choice([3, 5, 8]),
               tie_word_embeddings=rng.random() < 0.3, rope_parameters=_rope(rng), n_routed_experts=experts,
               num_experts_per_tok=min(rng.randint(1, 3), topk_group * experts // group),
               moe_intermediate_size=rng.choice([4, 8]), n_shared_experts=rng.choice([1, 2]),
               routed_scaling_factor=rng.choice([1.0, 2.5]), n_group=group, topk_group=topk_group,
               first_k_dense_replace=rng.randint(0, layers), norm_topk_prob=rng.random() < 0.7)
    if family == "deepseek_v2":
        cfg["topk_method"] = rng.choice(["greedy", "group_limited_greedy"])
    if family == "deepseek_v3":
        cfg["rope_interleave"] = rng.random() < 0.5
    if family == "deepseek_v32":
        cfg.update(q_lora_rank=12, index_n_heads=rng.choice([1, 2, 4]), index_topk=rng.choice([1, 3, 8, 200]),
                   index_head_dim=rng.choice([d for d in (8, 12, 16) if d >= cfg["qk_rope_head_dim"]]))
    return cfg


def qwen_config(rng, family):
    layers, heads, head_dim = rng.randint(2, 4), rng.choice([1, 2, 4]), rng.choice([8, 12, 16])
    key_heads = rng.choice([1, 2])
    cfg = dict(hidden_size=rng.choice([16, 32]), num_hidden_layers=layers, num_attention_heads=heads,
               num_key_value_heads=rng.choice([d for d in (1, 2, 4) if heads % d == 0]), head_dim=head_dim,
               intermediate_size=40, vocab_size=97, max_position_embeddings=64,
               rms_norm_eps=rng.choice([1e-6, 1e-3]), linear_num_key_heads=key_heads,
               linear_num_value_heads=key_heads * rng.choice([1, 2]), linear_key_head_dim=rng.choice([4, 8]),
               linear_value_head_dim=rng.choice([4, 6, 8]), linear_conv_kernel_dim=rng.choice([2, 3, 4, 5]),
               tie_word_embeddings=rng.random() < 0.3, initializer_range=0.1,
               layer_types=[rng.choice(["full_attention", "linear_attention"]) for _ in range(layers - 1)]
               + ["full_attention"],  # one full-attention layer: transformers cannot cache linear layers alone
               rope_parameters={"rope_type": "default", "rope_theta": rng.choice([500.0, 1e6]),
                                # transformers needs an even number of rotated dimensions
                                "partial_rotary_factor": rng.choice([f for f in (0.25, 0.5, 1.0)
                                                                     if int(head_dim * f) % 2 == 0])})
    if family in ("qwen3_next", "qwen3_5_moe"):
        cfg.update(num_experts=rng.choice([4, 8]), moe_intermediate_size=8, shared_expert_intermediate_size=12,
                   num_experts_per_tok=rng.randint(1, 3))
    if family == "qwen3_next":
        cfg.update(decoder_sparse_step=rng.choice([1, 2]), norm_topk_prob=rng.random() < 0.6,
                   mlp_only_layers=rng.sample(range(layers), rng.randint(0, 1)))
    if family == "qwen3_5_moe":
        del cfg["intermediate_size"]
    return cfg


def build(family, cfg, seed):
    """transformers' random model of ``cfg``, with norms, decays, gates and DeepSeek's correction
    bias drawn away from their neutral starts (where a misread one would not show)."""
    import transformers

    config_class, model_class = (getattr(transformers, name) for name in CLASSES[family])
    torch.manual_seed(seed)
    if family == "qwen3_5_vl":  # the language model of the multimodal checkpoint; its head's tying at the top
        vision = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=32, patch_size=4,
                      out_hidden_size=cfg["hidden_size"])
        config = config_class(text_config={k: v for k, v in cfg.items() if k != "tie_word_embeddings"},
                              vision_config=vision, tie_word_embeddings=cfg["tie_word_embeddings"])
    else:
        config = config_class(**cfg)
    config._attn_implementation = "eager"
    hf = model_class(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(0.001, 0.3).log())
            elif name.endswith("dt_bias"):
                p.normal_()
            elif "visual" in name:
                continue
            elif "linear_attn.norm" in name:  # the gated norm: around 1
                p.normal_(1.0, 0.3)
            elif "norm" in name:  # Qwen's zero-centred norms around 0, DeepSeek's around 1
                p.uniform_(-0.5, 0.5) if family.startswith("qwen") else p.uniform_(0.5, 1.5)
            elif name.endswith("gate.weight"):  # routers and shared-expert gates start at zero
                p.normal_(0, 0.5)
            elif name.endswith(".bias"):
                p.uniform_(-0.5, 0.5)
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.3)
    return hf


def _stable_indexer_topk(monkeypatch):
    """transformers' DSA indexer (its one 3-D topk) with kvbench's tie rule: the earlier token first."""
    topk = torch.Tensor.topk

    def stable(t, k, dim=-1, *args, **kwargs):
        if t.dim() != 3:
            return topk(t, k, dim, *args, **kwargs)
        values, indices = t.sort(dim=dim, descending=True, stable=True)
        return torch.return_types.topk((values[..., :k], indices[..., :k]))

    monkeypatch.setattr(torch.Tensor, "topk", stable)


@pytest.fixture(autouse=True)
def _quiet():
    logging.disable(logging.WARNING)  # transformers' notes on missing fast kernels
    yield
    logging.disable(logging.NOTSET)


@pytest.mark.parametrize("family, seed", CASES, ids=[f"{f}-{s}" for f, s in CASES])
@torch.no_grad()
def test_a_random_checkpoint_is_transformers_in_prefill_cached_decode_and_chunks(
        tmp_path, monkeypatch, one_torch_thread, family, seed):
    rng = random.Random(f"{family}-{seed}")
    cfg = deepseek_config(rng, family) if family.startswith("deepseek") else qwen_config(rng, family)
    hf = build(family, cfg, seed)
    hf.save_pretrained(tmp_path)
    if family == "deepseek_v32":
        _stable_indexer_topk(monkeypatch)
    model, _ = load_llama_dir(tmp_path, torch.float32)
    P, T = rng.choice([5, 17, 33]), 40
    tokens = torch.randint(0, cfg["vocab_size"], (2, T), generator=torch.Generator().manual_seed(seed))
    full = hf(tokens, use_cache=False).logits
    past_name = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    out = hf(tokens[:, :P], use_cache=True)
    cached = [out.logits]
    for pos in range(P, T):
        out = hf(tokens[:, pos:pos + 1], **{past_name: out.past_key_values}, use_cache=True)
        cached.append(out.logits)
    cached = torch.cat(cached, 1)
    diffs = {"prefill": (model(tokens) - full).abs().max().item()}
    cuts = sorted(rng.sample(range(1, T), 2)) + [T]
    for form in ["absorbed", "expanded"] if family.startswith("deepseek") else [None]:
        with decode_form(model, form) if form else torch.no_grad():
            cache = cache_for(model, "static", 2, T)
            ours = [model(tokens[:, :P], cache, 0)] + [model(tokens[:, p:p + 1], cache, p) for p in range(P, T)]
            diffs[f"decode {form}"] = (torch.cat(ours, 1) - cached).abs().max().item()
            cache, start, chunks = cache_for(model, "static", 2, T), 0, []
            for end in cuts:
                chunks.append(model(tokens[:, start:end], cache, start))
                start = end
            diffs[f"chunks {form}"] = (torch.cat(chunks, 1) - full).abs().max().item()
    assert max(diffs.values()) <= 1e-4, (diffs, cfg)
    assert full.std() > 0.05  # logits that vary: a zero model would match anything
