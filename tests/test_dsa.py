"""DeepSeek Sparse Attention (attention=mla with attention.index_topk, DeepSeek-V3.2): its attention
and lightning indexer against transformers' DeepseekV32 modules, DeepSeek-V3.2 checkpoints against
DeepseekV32ForCausalLM with a top-k smaller than the context (logits, task=eval perplexity, 40
greedy cached steps), cached decode against a recompute, the bytes it holds and reads and its
FLOPs against hand formulas, the preset's arithmetic, refusals in one line naming the key."""

import json
import math

import pytest
import torch
from conftest import VOCAB, compose, deepseek_dir, eval_job, transformers_perplexity
from test_checkpoint import PROMPT, STEPS, logits_with_cache
from test_cli import TINY, kvbench

from kvbench.cache import Positions, cache_for, make_cache
from kvbench.checkpoint import CheckpointError, load_llama_dir, to_layout
from kvbench.config.model import AttentionConfig, ModelConfig
from kvbench.core.errors import ConfigError
from kvbench.generate import greedy_generate
from kvbench.jobs.job_config import to_bench_config
from kvbench.layouts.attention import decode_form
from kvbench.layouts.base import Layouts
from kvbench.layouts.build import build_layouts
from kvbench.layouts.latent_attention import LatentAttention
from kvbench.model import Decoder
from kvbench.quality.train import run_eval
from kvbench.rope import rope_tables
from kvbench.tasks import capacity
from kvbench.tasks.inspect import describe

MODEL = ModelConfig(name="t", num_layers=2, d_model=64, num_heads=8, ffn_dim=96, vocab_size=VOCAB, max_seq_len=64)
TOPK = 5
# A tiny DeepSeek-V3.2 indexer; with DEEPSEEK_SHAPE's attention (conftest), top 8 of up to 80 tokens.
DSA_SHAPE = dict(index_topk=8, index_n_heads=8, index_head_dim=8)


def dsa_decoder(**dims) -> Decoder:
    torch.manual_seed(0)
    return Decoder(MODEL, AttentionConfig(type="mla", index_topk=TOPK, **dims)).eval()


def unbound(model) -> Decoder:
    """``model`` with its selection off (each query attends every token it sees): what a top-k
    that binds must differ from."""
    for block in model.blocks:
        block.attn.indexer.topk = 10**9
    return model


def test_defaults_follow_deepseek_v32_ratios_and_the_layout_stores_the_index_key():
    a = AttentionConfig(type="mla", index_topk=TOPK).resolved(MODEL)  # head_dim 8: r 32, rope 4
    assert (a.index_topk, a.index_n_heads, a.index_head_dim, a.q_lora_rank) == (TOPK, 4, 8, 96)
    layer = build_layouts(MODEL, a)[0]
    assert layer.stored == (1, (36, 8)) and layer.fields() == {"kv_lora_rank": 32, "index_topk": TOPK}
    assert AttentionConfig(type="mla", index_topk=TOPK, q_lora_rank=16).resolved(MODEL).q_lora_rank == 16
    assert AttentionConfig(type="mla").resolved(MODEL).index_topk == 0  # no indexer unless asked


@pytest.mark.parametrize("form", ["absorbed", "expanded"])
@pytest.mark.parametrize("impl", ["static", "concat", "none"])
def test_cached_decode_equals_recompute_with_a_binding_top_k(form, impl):
    """A 12-token prefill and 8 one-token steps select the top 5 of up to 20 tokens through the
    cache and give the logits of one forward over all 20 (the recompute); without the selection
    the logits are another model's."""
    model = dsa_decoder(mla_decode=form)
    tokens = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(tokens)
        cache = cache_for(model, impl, 2, 20)
        if impl == "none":
            steps = [model(tokens[:, :12], cache, 0)] + [model(tokens[:, :p + 1], cache, 0)[:, -1:]
                                                         for p in range(12, 20)]
        else:
            steps = [model(tokens[:, :12], cache, 0)] + [model(tokens[:, p:p + 1], cache, p) for p in range(12, 20)]
        dense = unbound(model)(tokens)
    assert (torch.cat(steps, 1) - full).abs().max().item() <= 1e-5
    assert (dense - full)[:, TOPK:].abs().amax(-1).min().item() > 1e-3  # every position past k is changed


def test_a_decode_step_attends_only_k_latents_and_the_formulas_stop_growing_past_k():
    """Past k cached tokens each decode step's latent attention gets k latents (both forms); the
    layout's bytes read and FLOPs grow past k only by the indexer's share (hand formulas)."""
    model = dsa_decoder()
    seen = []
    for block in model.blocks:
        for name in ("_absorbed", "_expanded"):
            form = getattr(block.attn, name)
            setattr(block.attn, name, lambda q_n, q_r, keys, *rest, _f=form: seen.append(keys.shape[2]) or
                    _f(q_n, q_r, keys, *rest))
    tokens = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        greedy_generate(model, tokens[:, :3], 8, cache_for(model, "static", 2, 12))
    # per step, 2 layers: the prefill's 3 keys, steps at 4, 5 held keys (all), then k = 5 of 6..11
    assert seen == [3, 3, 4, 4, 5, 5] + [TOPK] * 12
    layer = model.layouts[0]
    for S in (1, 5, 6, 100, 10_000):
        assert layer.read_bytes(S, 4) == S * 8 * 4 + min(S, TOPK) * 36 * 4  # every index key, <= k latents
        assert layer.step_flops(S) == 2 * 8 * (2 * 32 + 4) * min(S, TOPK) + 2 * 4 * (8 + 1) * S
        assert layer.sequence_bytes(S, 4) == S * (36 + 8) * 4  # held: every latent and index key


@pytest.mark.parametrize("cache_dtype", ["auto", "int8"])
def test_the_cache_allocates_the_latent_and_the_index_key_per_token(cache_dtype):
    """layers x (r + d_rope + index_head_dim) x bytes x tokens x batch (int8: 1-byte codes and a
    4-byte scale per latent and per index key), allocated, in the layouts' formula and the record."""
    model = dsa_decoder()
    per_token = (32 + 4 + 8) * 4 if cache_dtype == "auto" else (32 + 4 + 4) + (8 + 4)
    cache = cache_for(model, "static", 3, 20, cache_dtype)
    assert cache.nbytes == model.layouts.cache_bytes(20, 3, 4, cache_dtype) == 2 * per_token * 20 * 3


def _random_(module, std=0.3):
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name:  # RMSNorm / LayerNorm weights near 1, the indexer's LayerNorm bias near 0
                p.uniform_(-0.5, 0.5) if name.endswith("bias") else p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, std)


def test_the_attention_and_indexer_modules_match_transformers_deepseek_v32():
    """transformers' DeepseekV32Attention and DeepseekV32Indexer with random weights against
    kvbench's latent attention with the same weights (rope rows de-interleaved, as the loader
    does): a 10-token prefill and 6 cached decode steps, top 4, max abs difference <= 1e-5; the
    indexer picks the same tokens for every query that sees more than 4."""
    from transformers import DeepseekV32Config, DynamicCache
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32Attention

    H, R, d_nope, d_rope, P, T = 4, 16, 6, 4, 10, 16
    hf_cfg = DeepseekV32Config(hidden_size=32, num_attention_heads=H, num_key_value_heads=H, q_lora_rank=12,
                               kv_lora_rank=R, qk_nope_head_dim=d_nope, qk_rope_head_dim=d_rope, v_head_dim=5,
                               num_hidden_layers=1, first_k_dense_replace=1, index_topk=4, index_n_heads=8,
                               index_head_dim=8)
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    theirs = DeepseekV32Attention(hf_cfg, 0).eval()
    _random_(theirs)
    model = ModelConfig(name="t", num_layers=1, d_model=32, num_heads=H, preset_kv_heads=H, head_dim=d_nope + d_rope,
                        ffn_dim=8, vocab_size=8, max_seq_len=T)
    attention = AttentionConfig(type="mla", q_lora_rank=12, kv_lora_rank=R, qk_nope_head_dim=d_nope,
                                qk_rope_head_dim=d_rope, v_head_dim=5, index_topk=4, index_n_heads=8,
                                index_head_dim=8).resolved(model)
    layout = build_layouts(model, attention)[0]
    ours = LatentAttention(model, layout).eval()
    order = torch.cat([torch.arange(0, d_rope, 2), torch.arange(1, d_rope, 2)])  # interleaved pairs -> halves
    q_b = theirs.q_b_proj.weight.view(H, d_nope + d_rope, -1)
    kv_a = theirs.kv_a_proj_with_mqa.weight
    ours.load_state_dict({
        "wq.0.weight": theirs.q_a_proj.weight, "wq.1.weight": theirs.q_a_layernorm.weight,
        "wq.2.weight": torch.cat([q_b[:, :d_nope], q_b[:, d_nope:][:, order]], 1).reshape(-1, 12),
        "wkv_a.weight": torch.cat([kv_a[:R], kv_a[R:][order]]), "kv_norm.weight": theirs.kv_a_layernorm.weight,
        "wkv_b.weight": theirs.kv_b_proj.weight, "wo.weight": theirs.o_proj.weight,
        **{f"indexer.{k}": v for k, v in theirs.indexer.state_dict().items()}})
    cos, sin = rope_tables(model, d_rope)
    x = torch.randn(2, T, 32, generator=torch.Generator().manual_seed(3))
    causal = torch.full((P, P), torch.finfo(torch.float32).min).triu(1)[None, None].expand(2, 1, P, P)
    with torch.no_grad():
        hf_cache, cache = DynamicCache(config=hf_cfg), make_cache("static", Layouts([layout]), 2, T).layers[0]
        want = [theirs(x[:, :P], (cos[None, :P], sin[None, :P]), causal, cache=hf_cache)[0]]
        got = [ours(x[:, :P], cos[:P], sin[:P], cache, Positions(0, P))]
        for t in range(P, T):
            step = (cos[None, t:t + 1], sin[None, t:t + 1])
            want.append(theirs(x[:, t:t + 1], step, torch.zeros(2, 1, 1, t + 1), cache=hf_cache)[0])
            got.append(ours(x[:, t:t + 1], cos[t:t + 1], sin[t:t + 1], cache, Positions(t, 1)))
        q_latent = theirs.q_a_layernorm(theirs.q_a_proj(x))
        picked = theirs.indexer(x, q_latent, (cos[None], sin[None]), torch.full((T, T), -math.inf).triu(1)[None],
                                None).long()
        mine = ours.indexer.top(x, q_latent, cos, sin, ours.indexer.key(x, cos, sin),
                                torch.ones(T, T, dtype=torch.bool).tril())
        ours.indexer.topk = 10**9
        dense = ours(x[:, :P], cos[:P], sin[:P], make_cache("static", Layouts([layout]), 2, T).layers[0],
                     Positions(0, P))
    assert (torch.cat(got, 1) - torch.cat(want, 1)).abs().max().item() <= 1e-5
    assert (dense - want[0]).abs().max().item() > 1e-3  # the top 4 binds from the 5th token on
    binding = slice(4, T)  # queries that see more than 4 tokens
    assert torch.equal(picked[:, binding].sort(-1).values, mine[:, binding].sort(-1).values)


@pytest.mark.parametrize("form", ["absorbed", "expanded"])
def test_a_deepseek_v32_checkpoint_matches_transformers_with_a_binding_top_k(tmp_path, form):
    """Max logit difference <= 1e-5 (float32) against transformers' DeepseekV32ForCausalLM over a
    64-token prompt and 16 cached decode steps, each query attending its top 8; the loaded
    layout caches the latent and the indexer's key."""
    path, hf = deepseek_dir(tmp_path, "deepseek_v32", max_position_embeddings=PROMPT + STEPS, **DSA_SHAPE)
    model, _ = load_llama_dir(path, torch.float32)
    assert model.layouts[0].stored == (1, (16 + 4, 8)) and model.attention.index_topk == 8
    tokens = torch.randint(0, VOCAB, (2, PROMPT + STEPS), generator=torch.Generator().manual_seed(1))
    with decode_form(model, form):
        ours, theirs = logits_with_cache(model, hf, tokens)
        with torch.no_grad():
            dense = unbound(model)(tokens)
    assert (ours - theirs).abs().max().item() <= 1e-5
    assert (dense - theirs).abs().max().item() > 1e-3


def test_forty_greedy_cached_steps_are_transformers_tokens(tmp_path):
    """kvbench's greedy decoding through its static cache and transformers' generate() (its own
    cache) pick the same 41 tokens for 2 prompts (weights at std 0.3, so the tokens vary); the
    top 8 binds from the prompt on: without it the tokens differ."""
    path, hf = deepseek_dir(tmp_path, "deepseek_v32", max_position_embeddings=128, initializer_range=0.3,
                            eos_token_id=None, **DSA_SHAPE)
    model, _ = load_llama_dir(path, torch.float32)
    prompt = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    ours = greedy_generate(model, prompt, 40, cache_for(model, "static", 2, 65)).tokens
    with torch.no_grad():
        theirs = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=41, do_sample=False)
    assert torch.equal(ours, theirs[:, 24:]) and len(set(ours[0].tolist())) > 10
    assert not torch.equal(greedy_generate(unbound(model), prompt, 40, cache_for(model, "static", 2, 65)).tokens, ours)


def test_eval_perplexity_is_transformers_on_the_same_slices(tmp_path, corpus):
    """task=eval of a DeepSeek-V3.2 directory (slices of 32 tokens, top 8): transformers'
    perplexity over the same slices, 1e-4 relative; another top-k on its weights is refused."""
    path, hf = deepseek_dir(tmp_path / "ds", "deepseek_v32", vocab_size=256, max_position_embeddings=64, **DSA_SHAPE)
    cfg = eval_job(MODEL, AttentionConfig(type="mla"), corpus, path)
    m = run_eval(cfg, torch.device("cpu"))
    assert m["perplexity"] == pytest.approx(transformers_perplexity(hf, cfg), rel=1e-4)
    cfg.attention = AttentionConfig(type="mla", index_topk=4)
    with pytest.raises(CheckpointError, match=r"^attention.index_topk=4: the checkpoint's is 8 \(leave it null\)$"):
        run_eval(cfg, torch.device("cpu"))


def test_a_deepseek_v32_checkpoint_with_a_mixture_of_experts_layer_matches_transformers(tmp_path):
    """A V3.2 layer whose MLP is a mixture of experts (config.json's mlp_layer_types 'sparse') is
    read as one beside DSA's indexer: max logit difference <= 1e-5 against transformers (prompt and
    16 cached steps)."""
    path, hf = deepseek_dir(tmp_path, "deepseek_v32", first_k_dense_replace=1, moe_intermediate_size=12,
                            max_position_embeddings=PROMPT + STEPS, **DSA_SHAPE)
    assert json.loads((path / "config.json").read_text())["mlp_layer_types"] == ["dense", "sparse"]
    model, _ = load_llama_dir(path, torch.float32)
    assert model.config.moe.dense_layers == [0] and model.config.moe.num_experts == 4
    assert model.attention.index_topk == 8
    tokens = torch.randint(0, VOCAB, (2, PROMPT + STEPS), generator=torch.Generator().manual_seed(1))
    ours, theirs = logits_with_cache(model, hf, tokens)
    assert (ours - theirs).abs().max().item() <= 1e-5


FAST = ["wandb=disabled", "runtime.isolate=false", "workload.prompt_len=8", "workload.gen_len=2"]


@pytest.mark.parametrize("overrides, line", [
    (["runtime.compile=graph"], "runtime.compile='graph': attention.index_topk=4 (DSA's top-k selection) is not "
                                "built for the fixed-shape step; use false or default"),
    (["workload=multiturn", "cache.shared=true"], "cache.shared=True: attention.index_topk=4 (DSA's top-k "
                                                  "selection) is not built for a shared prefix"),
    (["attention.window=8"], "attention.index_topk=4: selects among every cached token; with a window (8)"),
    (["attention.q_lora_rank=0"], "attention.q_lora_rank=0: must be >= 1 with attention.index_topk=4"),
    (["attention.index_head_dim=2"], "attention.index_head_dim=2: must be even and >= qk_rope_head_dim=4"),
    (["attention.index_n_heads=0"], "attention.index_n_heads=0: must be >= 1"),
    (["attention.index_topk=-1"], "attention.index_topk=-1: must be >= 0"),
])
def test_what_dsa_does_not_run_with_is_one_line_naming_the_key(overrides, line):
    with pytest.raises(ConfigError) as info:
        overrides = ["attention.index_topk=4", *overrides] if "attention.index_topk=-1" not in overrides else overrides
        to_bench_config(compose(*FAST, "model=tiny", "attention=mla", *overrides))
    [message] = str(info.value).splitlines()
    assert message.startswith(line), message


def test_an_indexer_shape_without_a_top_k_or_on_k_v_heads_is_refused():
    with pytest.raises(ConfigError, match=r"^attention.index_n_heads=8: is a DSA indexer's shape; set "
                                          r"attention.index_topk >= 1 too"):
        to_bench_config(compose(*FAST, "model=tiny", "attention=mla", "attention.index_n_heads=8"))
    with pytest.raises(ConfigError, match=r"^attention.index_topk=4: is a multi-head latent attention rank; "
                                          r"attention.type=gqa has none"):
        to_bench_config(compose(*FAST, "model=tiny", "attention=gqa", "attention.index_topk=4"))


def test_inspect_of_deepseek_v32_prints_bytes_per_token_and_per_sequence_by_hand():
    """61 layers x (512 + 64 latent + 128 index key) x 2 bytes = 85,888 B per token in bfloat16;
    per sequence of 8,192 tokens 8,192 times that; a decode step there reads every index key and
    2,048 latents per layer."""
    cfg = to_bench_config(compose("model=deepseek_v32", "task=inspect", "workload.prompt_len=8000",
                                  "workload.gen_len=192", "runtime.dtype=bfloat16"))
    assert cfg.attention.index_topk == 2048 and build_layouts(cfg.model, cfg.attention)[0].stored == (1, (576, 128))
    per_token = 61 * (512 + 64 + 128) * 2
    per_sequence = per_token * 8192
    read = 61 * (8192 * 128 + 2048 * 576) * 2
    text = describe(cfg)
    bf16 = next(line for line in text.splitlines() if line.startswith("bfloat16"))
    assert f"({per_token:,})" in bf16 and per_token == 85_888 and f"({per_sequence:,})" in bf16
    assert f"({read:,}) read of" in text and f"({per_sequence:,}) held per sequence" in text
    capacity_cfg = to_bench_config(compose("model=deepseek_v32", "task=capacity", "runtime.memory_budget_gb=1",
                                           "runtime.dtype=bfloat16", "workload.gen_len=96",
                                           "capacity.context_lens=[4000]"))
    assert capacity.kv_bytes(capacity_cfg, 4000, 8) == per_token * 4096 * 8  # task=capacity's prediction


def test_to_layout_keeps_a_dsa_checkpoint_as_it_is(tmp_path):
    path, _ = deepseek_dir(tmp_path, "deepseek_v32", **DSA_SHAPE)
    model = load_llama_dir(path)[0]
    same, how = to_layout(model, AttentionConfig(type="mla").resolved(model.config))
    assert how == "none" and same.attention.index_topk == 8


@pytest.mark.e2e
def test_cli_run_of_dsa_is_an_ok_record_with_its_bytes_held_and_read(tmp_path):
    out = tmp_path / "run"
    kvbench(*TINY, "attention=mla", "attention.index_topk=4", "workload.batch_size=2", f"hydra.run.dir={out}",
            cwd=tmp_path)
    rec = json.loads((out / "results.json").read_text())
    assert rec["status"] == "ok", rec["error"]
    m = rec["metrics"]
    # tiny: 2 layers, r 32 + d_rope 4 + index key 8 (head_dim 8 x 2); 12 + 6 positions; batch 2; float32
    assert m["kv_cache_bytes"] == m["kv_cache_bytes_formula"] == 2 * (32 + 4 + 8) * 4 * 18 * 2
    context = 12 + (6 + 1) / 2  # the mean context of the decode steps
    assert m["kv_bytes_read_per_step"] == int(2 * 2 * (context * 8 + 4 * 36) * 4)
    assert m["fidelity_max_abs_logit_diff"] <= 1e-5 and rec["config"]["attention"]["index_topk"] == 4


def test_records_with_and_without_the_indexer_are_two_variants():
    """The tables, the report and W&B name a record by its Variant: a sweep over index_topk has a
    row per k (they were one name, mla r=32, for both)."""
    from kvbench.sinks.views import Variant

    rows = [Variant.from_config({"attention": {"type": "mla", "kv_lora_rank": 32, "index_topk": k}}) for k in (0, 4)]
    assert [v.label for v in rows] == ["mla r=32", "mla r=32 topk=4"]
    assert Variant.of_attention(AttentionConfig(type="mla", index_topk=4).resolved(MODEL)).label == "mla r=32 topk=4"
