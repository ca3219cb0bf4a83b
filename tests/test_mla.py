"""Multi-head latent attention (attention=mla): cached decode against a recompute in both decode
forms, the latent cache's bytes against the formula, DeepSeek-V2/V3 checkpoints against
transformers (logits and task=eval perplexity), the DeepSeek-V3 preset's arithmetic, refusals."""

import json
import math

import pytest
import torch
from conftest import VOCAB, deepseek_dir, eval_job, llama_dir, transformers_perplexity
from hydra import compose, initialize_config_dir
from kv_formula import kv_cache_bytes
from test_checkpoint import PROMPT, STEPS, logits_with_cache, rope
from test_cli import TINY, kvbench

from kvbench.cache import cache_for
from kvbench.checkpoint import CheckpointError, load_llama_dir, to_layout
from kvbench.config.bench import CONF_DIR
from kvbench.config.compare import CompareConfig
from kvbench.config.model import AttentionConfig, ModelConfig
from kvbench.core.errors import ConfigError
from kvbench.jobs.job_config import to_bench_config
from kvbench.layouts.attention import decode_form
from kvbench.layouts.build import build_layouts
from kvbench.model import Decoder
from kvbench.quality.fidelity import form_fidelity
from kvbench.quality.train import run_eval
from kvbench.rope import rope_attention_factor, rope_inv_freq
from kvbench.shared_prefix import shared_cache_for
from kvbench.tasks.inspect import describe

MODEL = ModelConfig(name="t", num_layers=2, d_model=64, num_heads=8, ffn_dim=96, vocab_size=VOCAB, max_seq_len=64)


def mla_decoder(**dims) -> Decoder:
    torch.manual_seed(0)
    return Decoder(MODEL, AttentionConfig(type="mla", **dims)).eval()


def test_defaults_follow_deepseek_ratios_and_a_models_own_layout_wins():
    a = AttentionConfig(type="mla").resolved(MODEL)  # head_dim 8
    assert (a.num_kv_heads, a.q_lora_rank, a.kv_lora_rank, a.qk_nope_head_dim, a.qk_rope_head_dim,
            a.v_head_dim) == (1, 0, 32, 8, 4, 8)
    assert build_layouts(MODEL, a)[0].stored == (1, (36,))
    own = ModelConfig(**{**vars(MODEL), "preset_mla": {"kv_lora_rank": 16, "qk_rope_head_dim": 2}})
    a = AttentionConfig(type="mla", v_head_dim=4).resolved(own)
    assert (a.kv_lora_rank, a.qk_rope_head_dim, a.v_head_dim) == (16, 2, 4)


@pytest.mark.parametrize("form", ["absorbed", "expanded"])
@pytest.mark.parametrize("impl", ["static", "concat", "none"])
@pytest.mark.parametrize("q_lora_rank", [0, 16])
def test_cached_decode_equals_recompute(form, impl, q_lora_rank):
    """A 12-token prefill and 8 one-token steps through the cache give the logits of one forward
    pass over all 20 tokens (the recompute), in either decode form."""
    model = mla_decoder(q_lora_rank=q_lora_rank, mla_decode=form)
    tokens = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(tokens)
        cache = cache_for(model, impl, 2, 20)
        if impl == "none":  # no history: each step recomputes from position 0
            steps = [model(tokens[:, :p + 1], cache, 0)[:, -1:] for p in range(11, 20)]
            steps[0] = model(tokens[:, :12], cache, 0)
        else:
            steps = [model(tokens[:, :12], cache, 0)] + [model(tokens[:, p:p + 1], cache, p) for p in range(12, 20)]
    assert (torch.cat(steps, 1) - full).abs().max().item() <= 1e-5


@pytest.mark.parametrize("form", ["absorbed", "expanded"])
def test_shared_prefix_decode_equals_recompute(form):
    """A system prompt held once for 2 conversations (batch-1 latents) and each conversation's
    own tokens after it: the logits of the whole sequences recomputed."""
    model = mla_decoder(mla_decode=form)
    system = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(2))
    user = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(torch.cat([system.expand(2, -1), user], 1))[:, 12:]
        cache = shared_cache_for(model, "static", 2, 12, 30)
        model(system, cache, 0)
        out = [model(user[:, :3], cache, 12)] + [model(user[:, i:i + 1], cache, 12 + i) for i in range(3, 6)]
    assert (torch.cat(out, 1) - full).abs().max().item() <= 1e-5


def test_absorbed_and_expanded_forms_agree_to_float32_rounding():
    """The record's fidelity metric: the absorbed decode's logits against the expanded one's on
    the same tokens; and the absorbed form really is another computation (not the expanded one)."""
    model = mla_decoder()
    prompt = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(4))
    m = form_fidelity(model, prompt, 8, model.layouts.decode_forms())
    assert m["mla_forms_max_abs_logit_diff"] <= 1e-5 and m["mla_forms_top1_agreement"] == 1.0
    calls = []
    attn = model.blocks[0].attn
    for name in ("_absorbed", "_expanded"):
        original = getattr(attn, name)
        setattr(attn, name, lambda *a, _n=name, _f=original: calls.append(_n) or _f(*a))
    with torch.no_grad(), decode_form(model, "absorbed"):
        cache = cache_for(model, "static", 2, 11)
        model(prompt, cache, 0)
        model(prompt[:, :1], cache, 10)
    assert calls == ["_expanded", "_absorbed"]  # prefill expanded, a decode step absorbed


@pytest.mark.parametrize("cache_dtype", ["auto", "int8", "float8_e4m3fn"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_latent_cache_allocates_exactly_the_formula(cache_dtype, dtype):
    """layers x (r + d_rope) x bytes per element x tokens x batch (quantized: 1-byte codes + a
    4-byte scale per token), as allocated, for a static cache and a shared prefix + history."""
    model = mla_decoder().to(dtype)
    size = dtype.itemsize
    per_token = (32 + 4) * size if cache_dtype == "auto" else 32 + 4 + 4
    cache = cache_for(model, "static", 3, 20, cache_dtype)
    assert cache.nbytes == 2 * per_token * 20 * 3 == kv_cache_bytes(2, 1, 36, 20, 3, size, cache_dtype, latent=True)
    shared = shared_cache_for(model, "static", 3, 8, 20, cache_dtype)
    assert shared.nbytes == 2 * per_token * (8 + 12 * 3)
    if cache_dtype != "auto":  # a quantized latent cache decodes close to the unquantized one
        tokens = torch.randint(0, VOCAB, (3, 20), generator=torch.Generator().manual_seed(5))
        with torch.no_grad():
            exact = model(tokens).float()
            cache.reset()
            steps = [model(tokens[:, :12], cache, 0)] + [model(tokens[:, p:p + 1], cache, p) for p in range(12, 20)]
        diff = (torch.cat(steps, 1).float() - exact).abs().max().item()
        assert 0 < diff < 0.1


@pytest.mark.e2e
def test_deepseek_v3_inspect_prints_70272_bytes_per_token_in_bf16_and_mha_for_comparison(tmp_path):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = to_bench_config(compose("config", overrides=["model=deepseek_v3", "task=inspect"]))
    assert cfg.attention.type == "mla" and build_layouts(cfg.model, cfg.attention)[0].stored == (1, (576,))
    text = describe(cfg)
    bf16 = next(line for line in text.splitlines() if line.startswith("bfloat16"))
    assert "(70,272)" in bf16 and 61 * (512 + 64) * 2 == 70_272
    mha = 61 * 128 * (128 + 64 + 128) * 2  # K 192 + V 128 per head: ~5 MB per token
    assert f"bfloat16 4.77 MiB ({mha:,})" in text
    out = kvbench("task=inspect", "model=deepseek_v3", cwd=tmp_path).stdout
    assert "(70,272)" in out


@pytest.mark.parametrize("family,overrides", [
    ("deepseek_v3", {}),  # q_lora, rope_interleave (its default)
    ("deepseek_v3", {"rope_interleave": False, "q_lora_rank": None}),
    ("deepseek_v2", {}),  # complex (interleaved) rope
    ("deepseek_v3", rope({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 20,
                          "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1})),
], ids=["v3", "v3-plain-rope-full-q", "v2", "v3-yarn"])
@pytest.mark.parametrize("form", ["absorbed", "expanded"])
def test_deepseek_checkpoints_match_transformers_over_prefill_and_cached_decode(tmp_path, family, overrides, form):
    """Max logit difference <= 1e-5 (float32) against transformers' DeepSeek class over a 64-token
    prompt and 16 cached decode steps, in each decode form."""
    path, hf = deepseek_dir(tmp_path, family, max_position_embeddings=PROMPT + STEPS, **overrides)
    model, _ = load_llama_dir(path, torch.float32)
    assert model.layouts[0].stored == (1, (16 + 4,))
    tokens = torch.randint(0, VOCAB, (2, PROMPT + STEPS), generator=torch.Generator().manual_seed(1))
    with decode_form(model, form):
        ours, theirs = logits_with_cache(model, hf, tokens)
    assert (ours - theirs).abs().max().item() <= 1e-5
    if "rope_parameters" in overrides or "rope_scaling" in overrides:  # yarn: its scale is exercised
        assert model.blocks[0].attn.scale == pytest.approx((6 + 4) ** -0.5 * (0.1 * math.log(4) + 1) ** 2)
        for block in model.blocks:
            block.attn.scale = (6 + 4) ** -0.5
        with torch.no_grad():
            assert (model(tokens) - hf(tokens).logits).abs().max().item() > 1e-4


def test_an_odd_query_head_width_is_read_as_transformers_reads_it(tmp_path):
    """qk_nope_head_dim 7 + qk_rope_head_dim 4: a latent layer rotates its 4 rope dimensions only, so
    the odd head width of 11 is built, and matches transformers; K/V heads of that width, which
    rotary embeddings would turn whole, are refused naming it."""
    path, hf = deepseek_dir(tmp_path, qk_nope_head_dim=7, max_position_embeddings=PROMPT + STEPS)
    model, _ = load_llama_dir(path, torch.float32)
    assert model.config.head_dim == 11 and model.layouts.rotary_dim() == 4
    tokens = torch.randint(0, VOCAB, (2, PROMPT + STEPS), generator=torch.Generator().manual_seed(1))
    ours, theirs = logits_with_cache(model, hf, tokens)
    assert (ours - theirs).abs().max().item() <= 1e-5
    with pytest.raises(ConfigError, match=r"^model.head_dim=11: must be even and >= 2 \(rotary embeddings rotate "
                                          r"pairs of dimensions\)$"):
        AttentionConfig(type="gqa", num_kv_heads=2).resolved(model.config)


def test_yarn_frequencies_and_attention_factor_are_transformers():
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
              "mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1}
    hf = DeepseekV3Config(rope_parameters=params, max_position_embeddings=163840)
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](hf)
    ours = ModelConfig(name="y", num_heads=128, d_model=7168, head_dim=192, max_seq_len=64, rope_type="yarn",
                       rope_factor=40.0, rope_original_max_seq_len=4096, rope_mscale=1.0, rope_mscale_all_dim=0.8)
    torch.testing.assert_close(rope_inv_freq(ours, 64).float(), inv_freq, rtol=1e-6, atol=0)
    assert rope_attention_factor(ours) == pytest.approx(factor)


def test_eval_perplexity_is_transformers_on_the_same_slices(tmp_path, corpus):
    """task=eval of a DeepSeek-V3 directory: transformers' perplexity over the same slices, 1e-4
    relative; attention=gqa on it is refused naming the key."""
    path, hf = deepseek_dir(tmp_path / "ds", vocab_size=256, max_position_embeddings=64)
    cfg = eval_job(MODEL, AttentionConfig(type="mla"), corpus, path)
    m = run_eval(cfg, torch.device("cpu"))
    assert m["perplexity"] == pytest.approx(transformers_perplexity(hf, cfg), rel=1e-4)
    cfg.attention = AttentionConfig(type="gqa")
    with pytest.raises(CheckpointError, match=r"^attention.type='gqa': the checkpoint is multi-head latent"):
        run_eval(cfg, torch.device("cpu"))


def test_a_deepseek_with_mixture_of_experts_layers_loads_as_transformers_builds_it(tmp_path):
    """Once refused in one line, a DeepSeek checkpoint whose layers from first_k_dense_replace on
    are a mixture of experts now loads: layer 0 dense, layer 1 its experts (tests/test_moe.py
    checks the routing against transformers in depth)."""
    from kvbench.mlp.dense import MLP
    from kvbench.mlp.experts import MoE

    path, hf = deepseek_dir(tmp_path, first_k_dense_replace=1)
    model, _ = load_llama_dir(path)
    assert model.config.moe.dense_layers == [0]
    assert isinstance(model.blocks[0].mlp, MLP) and isinstance(model.blocks[1].mlp, MoE)
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (model(tokens) - hf(tokens).logits).abs().max().item() <= 1e-5


@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3", "deepseek_v32"])
def test_a_sliding_window_in_a_deepseek_config_json_changes_nothing_as_in_transformers(tmp_path, family):
    """transformers' DeepSeek classes have no sliding window: a ``sliding_window`` in their config.json
    masks nothing there, so it masks nothing here either (it once windowed every layer: logits off
    by 0.1; on V3.2 a refusal naming attention.window, a key nobody set)."""
    dsa = dict(index_topk=8, index_n_heads=8, index_head_dim=8) if family == "deepseek_v32" else {}
    path, hf = deepseek_dir(tmp_path, family, max_position_embeddings=PROMPT, **dsa)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "sliding_window": 4, "use_sliding_window": True}))
    model, _ = load_llama_dir(path)
    assert list(model.layouts.windows) == [None, None]
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (model(tokens) - hf(tokens).logits).abs().max().item() <= 1e-5


def test_refusals_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"^attention.kv_lora_rank=32: .*attention=mla"):
        AttentionConfig(type="gqa", kv_lora_rank=32)
    with pytest.raises(ConfigError, match=r"^attention.num_kv_heads=2: "):
        AttentionConfig(type="mla", num_kv_heads=2).resolved(MODEL)
    with pytest.raises(ConfigError, match=r"^attention.qk_rope_head_dim=3: must be even"):
        AttentionConfig(type="mla", qk_rope_head_dim=3).resolved(MODEL)
    with pytest.raises(ConfigError, match=r"^compare.variants=.*'mla:r0'"):
        CompareConfig(variants=["mha", "mla:r0"])
    llama, _ = llama_dir(tmp_path / "llama", 2)
    with pytest.raises(CheckpointError, match=r"^attention.type='mla': the checkpoint has 2 K/V heads"):
        to_layout(load_llama_dir(llama)[0], AttentionConfig(type="mla").resolved(MODEL))
    ds, _ = deepseek_dir(tmp_path / "ds")
    model = load_llama_dir(ds)[0]
    with pytest.raises(CheckpointError, match=r"^attention.kv_lora_rank=8: the checkpoint's is 16"):
        to_layout(model, AttentionConfig(type="mla", kv_lora_rank=8).resolved(model.config))


@pytest.mark.e2e
def test_cli_run_of_mla_is_an_ok_record_with_its_bytes_and_fidelity(tmp_path):
    out = tmp_path / "run"
    kvbench(*TINY, "attention=mla", "workload.batch_size=2", f"hydra.run.dir={out}", cwd=tmp_path)
    rec = json.loads((out / "results.json").read_text())
    assert rec["status"] == "ok", rec["error"]
    m = rec["metrics"]
    # tiny: 2 layers, head_dim 8 -> r 32 + d_rope 4; 12 + 6 positions; batch 2; float32
    assert m["kv_cache_bytes"] == m["kv_cache_bytes_formula"] == 2 * (32 + 4) * 4 * 18 * 2
    assert m["fidelity_max_abs_logit_diff"] <= 1e-5 and m["mla_forms_max_abs_logit_diff"] <= 1e-5
    assert rec["config"]["attention"]["type"] == "mla" and rec["config"]["attention"]["kv_lora_rank"] == 32


def test_capacity_judges_mla_by_the_latent_formula():
    """task=capacity takes attention=mla: its KV prediction for DeepSeek-V3 is the inspect figure
    (70,272 B per token in bf16), and a shared chat's latent cache allocates what it predicts."""
    from kvbench.tasks import capacity
    from kvbench.tasks.common import build_model
    from kvbench.workloads.multiturn import ChatSession, chat_prompts

    def config(*overrides):
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            return to_bench_config(compose("config", overrides=["task=capacity", "runtime.memory_budget_gb=1",
                                                                 *overrides]))

    cfg = config("model=deepseek_v3", "runtime.dtype=bfloat16", "workload.gen_len=96", "capacity.context_lens=[4000]")
    assert capacity.kv_bytes(cfg, 4000, 8) == 70_272 * 4096 * 8
    cfg = config("model=tiny", "attention=mla", "workload=multiturn", "workload.system_len=16", "workload.turns=2",
                 "workload.user_len=4", "workload.reply_len=3", "cache.shared=true", "workload.batch_size=3")
    model = build_model(cfg, torch.device("cpu"))
    system, users = chat_prompts(cfg.workload, cfg.model.vocab_size, 0)
    (context,) = capacity.contexts(cfg)
    session = ChatSession(model, system, 3, True, "static", context)
    for user in users:
        session.ask(user, cfg.workload.reply_len)
    assert session.cache.nbytes == capacity.kv_bytes(cfg, context, 3)
