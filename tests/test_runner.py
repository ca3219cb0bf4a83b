"""The runner's tasks: train then eval writing the loss curve, checkpoint and perplexity; a Llama
checkpoint benchmarked like a preset; invalid inputs recorded as invalid; a job stopped from
outside recorded as interrupted, never ok; what a job ran with is its own."""

import math
from contextlib import contextmanager

import pytest
from hydra import compose, initialize_config_dir

from kvbench.cache import kv_cache_bytes
from kvbench.config import CONF_DIR
from kvbench.results import read_record
from kvbench.runner import DEFAULT_THREADS, run_job

TINY = ["model=tiny", "workload.prompt_len=12", "workload.gen_len=6", "runtime.warmup=0", "runtime.repeats=4",
        "runtime.threads=1"]


def job(tmp_path, *overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["wandb.mode=disabled", "runtime.peak_gb_per_s=10", *overrides])
    return run_job(cfg, tmp_path)


def test_train_then_eval_through_the_runner(tmp_path, monkeypatch):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    common = ["model=train_small", "model.num_layers=1", "model.d_model=32", "model.num_heads=4",
              "model.preset_kv_heads=4", "model.ffn_dim=64",
              "attention=gqa", "attention.num_kv_heads=2", f"data.path={corpus}", "train.batch_size=4",
              "train.seq_len=32", "train.eval_batches=2", "train.eval_every=10", "train.log_every=5"]
    trained = job(tmp_path / "train", "task=train", "train.steps=20", *common)
    assert trained.status == "ok", trained.error
    curve = trained.tables["curve"]
    assert [p["step"] for p in curve] == [5, 10, 15, 20] == trained.series["train_step"]
    assert curve[-1]["train_loss"] < curve[0]["train_loss"]  # it learned something
    m = trained.metrics
    assert m["perplexity"] == pytest.approx(math.exp(m["val_loss"]))
    assert m["bits_per_byte"] == pytest.approx(m["val_loss"] / math.log(2))
    checkpoint = tmp_path / "train" / "checkpoint.pt"
    assert checkpoint.is_file()
    evaluated = job(tmp_path / "eval", "task=eval", f"train.checkpoint={checkpoint}", *common)
    assert evaluated.status == "ok", evaluated.error
    # the same weights on the same validation windows: the same perplexity
    assert evaluated.metrics["perplexity"] == pytest.approx(m["perplexity"], rel=1e-5)


def test_eval_without_checkpoint_is_invalid_naming_the_key(tmp_path):
    result = job(tmp_path, "task=eval", "model=train_small")
    assert result.status == "invalid" and result.error.startswith("train.checkpoint=None")


@pytest.mark.parametrize("attention, kv", [("gqa", 2), ("mqa", 1)])
def test_benchmark_a_llama_checkpoint_like_a_preset(tmp_path, attention, kv):
    """model=llama_dir: the shape comes from config.json, the weights from safetensors; an
    attention type other than the checkpoint's own mean-pools its KV heads."""
    from conftest import llama_dir

    directory, hf = llama_dir(tmp_path / "ckpt", num_kv_heads=2)
    result = job(tmp_path / "run", "model=llama_dir", f"model.path={directory}", f"attention={attention}",
                 "workload.prompt_len=16", "workload.gen_len=8", "workload.batch_size=2", "runtime.repeats=1")
    assert result.status == "ok", result.error
    m, model_cfg = result.metrics, result.config["model"]
    assert (model_cfg["num_layers"], model_cfg["d_model"], model_cfg["num_heads"]) == (2, 32, 4)
    assert result.config["attention"]["num_kv_heads"] == kv
    # K/V projections shrink with pooling: 2 layers x 2 matrices x (32 x 8 per KV head) fewer
    hf_params = sum(p.numel() for p in hf.parameters())
    assert m["num_params"] == hf_params - 2 * 2 * 32 * 8 * (2 - kv)
    assert m["kv_cache_bytes"] == m["kv_cache_bytes_formula"] == 2 * 2 * kv * 8 * 24 * 2 * 4
    assert m["fidelity_max_abs_logit_diff"] < 1e-4


def test_llama_dir_without_config_is_invalid(tmp_path):
    result = job(tmp_path / "run", "model=llama_dir", f"model.path={tmp_path}")
    assert result.status == "invalid" and result.error.startswith(f"model.path='{tmp_path}'")


def stop_at_trial(trial, exc):
    """A progress factory whose tick raises ``exc`` when trial ``trial`` ends: a Ctrl-C (or a
    launcher's SystemExit) arriving in the middle of the timed trials."""
    @contextmanager
    def progress(label, total):
        done = []

        def tick(description=None):
            done.append(1)
            if len(done) == trial:
                raise exc

        yield tick

    return progress


@pytest.mark.parametrize("exc, why", [(KeyboardInterrupt(), "interrupted by SIGINT"),
                                      (SystemExit(-1), "stopped by SystemExit(-1)")])
def test_a_job_stopped_mid_trials_is_recorded_interrupted_and_the_stop_goes_on(tmp_path, exc, why):
    """Before: ``except Exception`` missed both, and the ``finally`` wrote status ok."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["wandb.mode=disabled", *TINY])
    with pytest.raises(type(exc)) as raised:
        run_job(cfg, tmp_path, progress=stop_at_trial(2, exc))
    rec = read_record(tmp_path)
    assert raised.value.record == rec
    assert rec.status == "interrupted" and rec.error.startswith(why), rec.error
    # complete before the trials: kept; the trials' latencies: not made up from 2 of 4 trials
    assert rec.metrics["kv_cache_bytes_formula"] == kv_cache_bytes(2, 2, 8, 18, 1, 4)
    assert rec.metrics["weight_bytes"] > 0 and "decode_ms_p50" not in rec.metrics


def test_in_process_jobs_do_not_inherit_threads_or_peak_rss(tmp_path):
    """runtime.isolate=false: a job with threads=null runs with torch's default count, not the
    previous job's, records that count, and does not pass the process's peak RSS off as its own."""
    first = job(tmp_path / "a", *TINY[:-1], f"runtime.threads={DEFAULT_THREADS + 1}")
    second = job(tmp_path / "b", *TINY[:-1], "runtime.threads=null")
    assert first.env["torch_num_threads"] == DEFAULT_THREADS + 1
    assert second.env["torch_num_threads"] == DEFAULT_THREADS and second.env["device"] == "cpu"
    assert second.metrics["peak_rss_bytes"] is None
    assert "runtime.isolate=false" in second.metrics["peak_rss_reason"]
