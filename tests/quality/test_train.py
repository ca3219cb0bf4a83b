"""Perplexity, the learning-rate schedule, training, and the train/eval entries (MHA→GQA uptraining,
a Llama directory with its tokenizer)."""

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import TEXT, byte_decoder, hf_dir

from kvbench.cache import cache_for
from kvbench.checkpoint import load_checkpoint, read_checkpoint
from kvbench.config.bench import BenchConfig, CacheConfig, RuntimeConfig, WandbConfig
from kvbench.config.model import AttentionConfig, ModelConfig
from kvbench.config.train import DataConfig, TrainConfig
from kvbench.config.workload import DecodeWorkload
from kvbench.core.errors import ConfigError
from kvbench.jobs.job_config import check_job
from kvbench.quality.data import TokenData, byte_data, eval_starts
from kvbench.quality.train import evaluate, lr_factor, run_eval, run_train, sequence_nll, train

CPU = torch.device("cpu")

def test_perplexity_is_exp_mean_cross_entropy():
    model = byte_decoder().eval()
    T, n = 16, 4
    val = torch.randint(0, 256, (n * T + 1,), generator=torch.Generator().manual_seed(0))
    data = TokenData(train=val, val=val)
    metrics = evaluate(model, data, seq_len=T, batches=2, batch_size=2)  # 4 slices tile val
    with torch.no_grad():
        logits = model(val[:-1].view(n, T))
    ce = F.cross_entropy(logits.reshape(-1, 256), val[1:]).item()
    assert metrics["val_loss"] == pytest.approx(ce, rel=1e-5)
    assert metrics["perplexity"] == pytest.approx(math.exp(ce), rel=1e-5)
    assert metrics["bits_per_byte"] == pytest.approx(ce / math.log(2), rel=1e-5)
    # each slice's own summed cross-entropy, in order: what a paired comparison of two caches reads
    per_slice = F.cross_entropy(logits.transpose(1, 2), val[1:].view(n, T), reduction="none").sum(1)
    torch.testing.assert_close(sequence_nll(model, data, T, 2, 2), per_slice.double(), rtol=1e-6, atol=1e-5)


def test_lr_schedule_warms_up_then_decays():
    cfg = TrainConfig(steps=100, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_factor(0, cfg) == pytest.approx(0.1)
    assert lr_factor(10, cfg) == pytest.approx(1.0)
    assert lr_factor(100, cfg) == pytest.approx(0.1)


def test_training_lowers_loss():
    ids = torch.tensor(list(TEXT))
    data = TokenData(train=ids[:2400], val=ids[2400:])
    model = byte_decoder()
    before = evaluate(model, data, 32, 2, 4)["val_loss"]
    logged = []
    cfg = TrainConfig(steps=20, batch_size=8, seq_len=32, lr=1e-2, warmup_steps=3, eval_every=10,
                      eval_batches=2, log_every=5)
    result = train(model, cfg, data, on_log=lambda s, m: logged.append((s, m)))
    assert result["val_loss"] < before - 1.0
    assert [s for s, m in logged if "val_loss" in m] == [10, 20]
    assert [s for s, _ in logged] == [5, 10, 15, 20]
    assert result["tokens_seen"] == 20 * 8 * 32


def bench(tmp_path, corpus, **train):
    model = ModelConfig(num_layers=1, d_model=32, num_heads=4, preset_kv_heads=4, ffn_dim=64,
                        vocab_size=1000, max_seq_len=64)
    kv = {"mha": 4, "gqa": 2, "mqa": 1}[train.pop("attention", "mha")]
    return check_job(BenchConfig(task="train", model=model,
                                 attention=AttentionConfig.for_heads(4, kv),
                                 workload=DecodeWorkload(prompt_len=8, gen_len=8), cache=CacheConfig(),
                                 runtime=RuntimeConfig(device="cpu"), wandb=WandbConfig(mode="disabled"),
                                 data=DataConfig(path=str(corpus), val_fraction=0.2),
                                 train=TrainConfig(batch_size=4, seq_len=32, eval_batches=2, warmup_steps=2,
                                                   **train)))


def test_run_train_then_convert_and_eval(tmp_path, corpus):
    out = tmp_path / "mha"
    metrics = run_train(bench(tmp_path, corpus, steps=5), CPU, out)
    assert metrics["num_kv_heads"] == 4 and metrics["tokens_seen"] == 5 * 4 * 32
    saved = load_checkpoint(out / "checkpoint.pt")
    assert saved.config.vocab_size == 256  # forced to the byte vocabulary
    assert read_checkpoint(out / "checkpoint.pt")["metrics"]["perplexity"] == metrics["perplexity"]

    # mean-pool to MQA without uptraining: before == after; with uptraining the loss moves
    cfg = bench(tmp_path, corpus, steps=0, attention="mqa", init_from=str(out / "checkpoint.pt"))
    pooled = run_train(cfg, CPU, tmp_path / "mqa0")
    assert pooled["num_kv_heads"] == 1 and pooled["ppl_before_uptrain"] == pooled["perplexity"]
    cfg = bench(tmp_path, corpus, steps=3, attention="gqa", init_from=str(out / "checkpoint.pt"))
    uptrained = run_train(cfg, CPU, tmp_path / "gqa")
    assert uptrained["num_kv_heads"] == 2 and uptrained["perplexity"] != uptrained["ppl_before_uptrain"]

    evaluated = run_eval(bench(tmp_path, corpus, checkpoint=str(out / "checkpoint.pt")), CPU)
    assert evaluated["perplexity"] == pytest.approx(metrics["perplexity"], rel=1e-5)
    with pytest.raises(ConfigError, match="train.checkpoint"):
        run_eval(bench(tmp_path, corpus), CPU)


def test_eval_llama_dir_with_its_tokenizer(tmp_path, corpus):
    from tokenizers import ByteLevelBPETokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator([TEXT.decode()], vocab_size=300, min_frequency=1, show_progress=False)
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=48, vocab_size=300,
                                      max_position_embeddings=64))
    hf.save_pretrained(tmp_path / "llama")
    tok.save(str(tmp_path / "llama" / "tokenizer.json"))
    m = run_eval(bench(tmp_path, corpus, attention="gqa", checkpoint=str(tmp_path / "llama")), CPU)
    assert m["num_kv_heads"] == 2 and m["kv_heads_conversion"] == "none"
    assert m["bytes_per_token"] > 1.2  # BPE merges bytes into tokens
    assert m["bits_per_byte"] == pytest.approx(m["val_loss"] / math.log(2) / m["bytes_per_token"])
    assert 100 < m["perplexity"] < 1000  # an untrained model is near-uniform over 300 tokens


@pytest.mark.parametrize("family,overrides", [
    ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 16}}),
    ("mistral", {}), ("qwen2", {}), ("qwen3", {})])
def test_eval_of_each_family_is_transformers_perplexity_on_the_same_slices(tmp_path, corpus, family, overrides):
    """task=eval on a directory of each accepted family: the perplexity transformers' own model
    gives over the same validation slices, within 1e-4 relative."""
    path, hf = hf_dir(tmp_path / family, 2, family=family, vocab_size=256, **overrides)
    cfg = bench(tmp_path, corpus, attention="gqa", checkpoint=str(path))
    m = run_eval(cfg, CPU)
    assert m["num_kv_heads"] == 2 and m["kv_heads_conversion"] == "none"
    val, T = byte_data(cfg.data).val, cfg.train.seq_len
    slices = val[eval_starts(len(val), T, cfg.train.eval_batches * cfg.train.batch_size)[:, None]
                  + torch.arange(T + 1)]
    with torch.no_grad():
        logits = hf(slices[:, :-1]).logits
    ce = F.cross_entropy(logits.flatten(0, 1), slices[:, 1:].flatten()).item()
    assert m["perplexity"] == pytest.approx(math.exp(ce), rel=1e-4)


@pytest.mark.parametrize("cache_dtype", ["int8", "float8_e4m3fn"])
def test_eval_through_a_quantized_cache_is_a_decode_through_it(cache_dtype):
    """Independent reference: the same slices fed token by token through a static cache of
    ``cache_dtype`` (what a decode reads); one pass through the cache must give that loss, and it
    must differ from the unquantized loss (the quantization is exercised), boundedly."""
    model = byte_decoder(2).eval()
    T, n = 12, 2
    val = torch.randint(0, 256, (n * T + 1,), generator=torch.Generator().manual_seed(0))
    data = TokenData(train=val, val=val)
    got = evaluate(model, data, seq_len=T, batches=1, batch_size=n, cache_dtype=cache_dtype)["val_loss"]
    plain = evaluate(model, data, seq_len=T, batches=1, batch_size=n)["val_loss"]
    slices = val[:-1].view(n, T)  # the 2 slices tile val, as in the perplexity test above
    cache = cache_for(model, "static", n, T, cache_dtype)
    with torch.no_grad():
        logits = torch.cat([model(slices[:, t:t + 1], cache, t) for t in range(T)], dim=1)
    decoded = F.cross_entropy(logits.reshape(-1, 256), val[1:]).item()
    assert got == pytest.approx(decoded, rel=1e-5)
    assert 0 < abs(got - plain) < 0.01 * plain
