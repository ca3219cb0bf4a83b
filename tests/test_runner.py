"""The runner's tasks: train then eval writing the loss curve, checkpoint and perplexity; a Llama
checkpoint benchmarked like a preset; invalid inputs recorded as invalid; a job stopped from
outside recorded as interrupted, never ok; what a job ran with is its own."""

import json
import math
import os
import re
from contextlib import contextmanager

import pytest
import torch
from conftest import byte_decoder, call_with_timeout, compose, llama_dir
from kv_formula import kv_cache_bytes
from safetensors.torch import load_file, save_file

from kvbench.checkpoint import save_checkpoint
from kvbench.core.errors import MAX_ERROR_CHARS, ConfigError
from kvbench.jobs import runner
from kvbench.jobs.runner import run_job
from kvbench.results import read_record

TINY = ["model=tiny", "workload.prompt_len=12", "workload.gen_len=6", "runtime.warmup=0", "runtime.repeats=4",
        "runtime.threads=1"]


def job(tmp_path, *overrides):
    return run_job(compose("wandb.mode=disabled", "runtime.peak_gb_per_s=10", *overrides), tmp_path)


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


@pytest.mark.parametrize("attention, kv, how", [("gqa", 2, "none"), ("mqa", 1, "mean-pool"), ("mha", 4, "repeat")])
def test_benchmark_a_llama_checkpoint_like_a_preset(tmp_path, attention, kv, how):
    """model=llama_dir: the shape comes from config.json, the weights from safetensors; fewer KV
    heads than the checkpoint's own mean-pool them, more repeat them (the README's
    ``attention=mha`` on a GQA checkpoint)."""
    from conftest import llama_dir

    directory, hf = llama_dir(tmp_path / "ckpt", num_kv_heads=2)
    result = job(tmp_path / "run", "model=llama_dir", f"model.path={directory}", f"attention={attention}",
                 "workload.prompt_len=16", "workload.gen_len=8", "workload.batch_size=2", "runtime.repeats=1")
    assert result.status == "ok", result.error
    m, model_cfg = result.metrics, result.config["model"]
    assert (model_cfg["num_layers"], model_cfg["d_model"], model_cfg["num_heads"]) == (2, 32, 4)
    assert result.config["attention"] == {"type": attention, "num_kv_heads": kv}
    assert model_cfg["preset_kv_heads"] == 2 and m["kv_heads_conversion"] == how
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
    cfg = compose("wandb.mode=disabled", *TINY)
    with pytest.raises(type(exc)) as raised:
        run_job(cfg, tmp_path, progress=stop_at_trial(2, exc))
    rec = read_record(tmp_path)
    assert raised.value.record == rec
    assert rec.status == "interrupted" and rec.error.startswith(why), rec.error
    # complete before the trials: kept; the trials' latencies: not made up from 2 of 4 trials
    assert rec.metrics["kv_cache_bytes_formula"] == kv_cache_bytes(2, 8, 8, 18, 1, 4)  # tiny in its own layout (MHA)
    assert rec.metrics["weight_bytes"] > 0 and "decode_ms_p50" not in rec.metrics


def test_in_process_jobs_do_not_inherit_threads_or_peak_rss(tmp_path, monkeypatch):
    """runtime.isolate=false: a job with threads=null runs with torch's default count, not the
    previous job's, records that count, and does not pass the process's peak RSS off as its own.
    (The default is set to 2 here so that it differs from the first job's 1 on any machine;
    runtime.threads itself may not exceed the CPUs.)"""
    monkeypatch.setattr(runner, "DEFAULT_THREADS", 2)
    first = job(tmp_path / "a", *TINY[:-1], "runtime.threads=1")
    second = job(tmp_path / "b", *TINY[:-1], "runtime.threads=null")
    assert first.env["torch_num_threads"] == 1
    assert second.env["torch_num_threads"] == 2 and second.env["device"] == "cpu"
    assert second.metrics["peak_rss_bytes"] is None
    assert "runtime.isolate=false" in second.metrics["peak_rss_reason"]


# ---- bad input is the user's: invalid, one line naming the key or the file -----------------------

@pytest.mark.parametrize("overrides, needle", [
    (["model=llama_dir"], "model.path=???"),  # once: a random 2-layer model, "ok"
    (["+workload.promt_len=5"], "workload.promt_len=5: unknown key"),  # once: silently ignored
    (["workload.prompt_len=abc"], "workload.prompt_len='abc'"),  # once: Hydra's traceback
    (["workload.prompt_len=${nope}"], "workload.prompt_len='${nope}'"),
    (["runtime.threads=-1"], "runtime.threads=-1"),  # once: "error", RuntimeError from torch
    (["runtime.device=cuda:abc"], "runtime.device='cuda:abc'"),  # once: "error"
    (["runtime.seed=-1"], "runtime.seed=-1"),  # once: "ok", seeded as 2**64 - 1
    (["model.rope_theta=nan"], "model.rope_theta=nan"),  # once: "ok" with NaN metrics
    (["task=train", "train.steps=2", "train.lr=inf"], "train.lr=inf"),
    (["task=train", "train.steps=2", "data.max_bytes=0"], "data.max_bytes=0"),  # once: no cap, silently
    (["task=capacity"], "runtime.memory_budget_gb=None: task=capacity on cpu needs a memory budget"),
    (["objective=tokens_per_sec"], "objective='tokens_per_sec': task=bench workload=decode records no metric "
                                   "'tokens_per_sec' (did you mean tokens_per_s"),
    (["task=train", "train.steps=2", "objective=-decode_ms_p50"], "objective='-decode_ms_p50': task=train records "
                                                                  "no metric 'decode_ms_p50'"),
    (["objective_caps.kv_cache_byte=1"], "objective_caps.kv_cache_byte=1.0: task=bench workload=decode records no "
                                         "metric 'kv_cache_byte' (did you mean kv_cache_bytes"),
])
def test_a_bad_value_is_an_invalid_record_naming_the_key(tmp_path, overrides, needle):
    result = job(tmp_path, "model=tiny", "workload.prompt_len=8", "workload.gen_len=4", "runtime.repeats=1",
                 *overrides)
    assert result.status == "invalid" and needle in result.error, (result.status, result.error)
    assert "\n" not in result.error and read_record(tmp_path).status == "invalid"


def broken_llama_dir(root, what):
    """A tiny Llama-format directory with one file broken as a user's download might be."""
    directory, _ = llama_dir(root, num_kv_heads=2)
    weights = next(directory.glob("*.safetensors"))
    if what == "truncated safetensors":
        weights.write_bytes(weights.read_bytes()[:100])
        return directory, weights.name
    if what == "config.json of wrong types":
        hf = json.loads((directory / "config.json").read_text())
        (directory / "config.json").write_text(json.dumps({**hf, "num_hidden_layers": "two"}))
        return directory, "num_hidden_layers='two': must be an integer"
    if what == "config.json cut short":
        (directory / "config.json").write_text((directory / "config.json").read_text()[:40])
        return directory, "config.json"
    if what == "NaN weights":
        tensors = load_file(str(weights))
        tensors["model.norm.weight"][0] = float("nan")
        save_file(tensors, str(weights), metadata={"format": "pt"})
        return directory, "norm.weight holds NaN or infinite values"
    if what in ("config.json is a FIFO", "weights are a FIFO"):
        victim = directory / "config.json" if what.startswith("config") else weights
        victim.unlink()
        os.mkfifo(victim)  # opening it for reading blocks until a writer comes: forever
        return directory, "not a regular file"
    if what == "unreadable tokenizer.json":
        (directory / "tokenizer.json").write_text('{"version": "1.0", "model": ')
        return directory, "tokenizer.json"
    raise ValueError(what)


@pytest.mark.parametrize("what", ["truncated safetensors", "config.json of wrong types", "config.json cut short",
                                  "NaN weights", "unreadable tokenizer.json", "config.json is a FIFO",
                                  "weights are a FIFO"])
def test_a_broken_checkpoint_directory_is_invalid_naming_the_file(tmp_path, what):
    directory, needle = broken_llama_dir(tmp_path / "ckpt", what)
    task = ["task=eval", f"train.checkpoint={directory}", "train.seq_len=8", "train.eval_batches=1",
            "train.batch_size=1"] if "tokenizer" in what else ["model=llama_dir", f"model.path={directory}"]
    result = call_with_timeout(lambda: job(tmp_path / "run", *task, "workload.prompt_len=8", "workload.gen_len=4",
                                           "runtime.repeats=1"))
    assert result.status == "invalid" and needle in result.error and str(directory) in result.error, result.error


@pytest.mark.parametrize("what", ["truncated", "not a state dict", "20,000 wrong tensors"])
def test_a_broken_kvbench_checkpoint_is_invalid_in_one_short_line(tmp_path, what):
    """A malformed checkpoint once made a 28 MB error message (every missing and unexpected key),
    copied into results.json, error.txt and the report."""
    path = save_checkpoint(tmp_path / "model.pt", byte_decoder(num_kv_heads=2))
    payload = torch.load(path, weights_only=True)
    if what == "truncated":
        path.write_bytes(path.read_bytes()[:1000])
    elif what == "not a state dict":
        torch.save({**payload, "state_dict": [1, 2, 3]}, path)
    elif what == "20,000 wrong tensors":
        torch.save({**payload, "state_dict": {f"layer.{i}.weight": torch.zeros(1) for i in range(20_000)}}, path)
    # (a KV-head count the checkpoint cannot be converted to: tests/test_checkpoint.py, and eval below)
    result = job(tmp_path / "run", "task=train", "model=train_small", "model.num_heads=4", "model.d_model=32",
                 "model.preset_kv_heads=4", "attention=mqa",
                 f"train.init_from={path}", "train.steps=0")
    assert result.status == "invalid", (result.status, result.error)
    assert str(path) in result.error
    assert len(result.error) <= MAX_ERROR_CHARS + 100 and not (tmp_path / "run" / "error.txt").exists()


def test_metrics_that_are_not_finite_are_an_error_not_ok(tmp_path):
    """float16 overflows where float32 does not: the logits become inf, their differences NaN.
    The record says error and names the metrics, which are null in strict JSON."""
    directory, _ = llama_dir(tmp_path / "ckpt", num_kv_heads=2)
    weights = next(directory.glob("*.safetensors"))
    tensors = load_file(str(weights))
    tensors["model.norm.weight"].fill_(30_000.0)  # finite in float16 (max 65504); the logits are not
    tensors["lm_head.weight"].mul_(100)
    save_file(tensors, str(weights), metadata={"format": "pt"})
    result = job(tmp_path / "run", "model=llama_dir", f"model.path={directory}", "runtime.dtype=float16",
                 "workload.prompt_len=8", "workload.gen_len=4", "runtime.repeats=1")
    assert result.status == "error" and "fidelity_max_abs_logit_diff=nan" in result.error, result.error
    rec = json.loads((tmp_path / "run" / "results.json").read_text(), parse_constant=pytest.fail)
    assert rec["metrics"]["fidelity_max_abs_logit_diff"] is None
    assert rec["null_reasons"]["fidelity_max_abs_logit_diff"] == "nan"
    assert rec["metrics"]["fidelity_top1_agreement"] == 0.0  # once 1.0: NaN argmaxes "agreed"
    assert rec["metrics"]["decode_ms_p50"] > 0  # what was measured is kept


def test_an_internal_error_message_is_bounded_everywhere(tmp_path, monkeypatch):
    """An exception with a huge message: one bounded line in the record, the head and the tail
    of the traceback in error.txt."""
    from kvbench.jobs import runner
    from kvbench.tasks import bench

    def boom(*args, **kwargs):
        raise RuntimeError("x" * 5_000_000 + " the end")

    monkeypatch.setattr(bench, "build_model", boom)
    result = job(tmp_path, "model=tiny", "workload.prompt_len=8", "workload.gen_len=4")
    assert result.status == "error" and result.error.startswith("RuntimeError: xxx")
    assert len(result.error) <= MAX_ERROR_CHARS + 100 and len(read_record(tmp_path).error) == len(result.error)
    trace = (tmp_path / "error.txt").read_text()
    assert len(trace) <= runner.MAX_TRACEBACK_CHARS + 100 and "Traceback" in trace and trace.endswith("the end\n")


def test_eval_records_the_shape_it_measured_not_the_preset(tmp_path):
    """task=eval on a GQA checkpoint: attention=mha repeats its 2 KV heads to 4 (the same
    function: the same perplexity) and the record says mha/4 with the checkpoint's shape, not
    model=small's; a count neither pooled nor repeated is invalid, naming the key."""
    from kvbench.checkpoint import save_checkpoint
    from kvbench.config.model import AttentionConfig, ModelConfig
    from kvbench.model import Decoder

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    shape = ModelConfig(name="train_small", num_layers=1, d_model=32, num_heads=4, preset_kv_heads=4, ffn_dim=64,
                        vocab_size=256, max_seq_len=64)  # the preset's count (4), trained with 2
    checkpoint = save_checkpoint(tmp_path / "ckpt.pt", Decoder(shape, AttentionConfig("gqa", 2)))
    common = ["task=eval", f"train.checkpoint={checkpoint}", f"data.path={corpus}", "train.batch_size=2",
              "train.seq_len=32", "train.eval_batches=2"]
    as_saved = job(tmp_path / "gqa", *common)  # model=small, attention=gqa: the defaults
    as_mha = job(tmp_path / "mha", *common, "attention=mha")
    for result, attention, how in ((as_saved, {"type": "gqa", "num_kv_heads": 2}, "none"),
                                   (as_mha, {"type": "mha", "num_kv_heads": 4}, "repeat")):
        assert result.status == "ok", result.error
        model = result.config["model"]
        assert (model["name"], model["num_layers"], model["d_model"], model["num_heads"]) == ("train_small", 1, 32, 4)
        assert model["preset_kv_heads"] == 2  # the checkpoint's own count, which attention=gqa keeps
        assert result.config["attention"] == attention
        assert result.metrics["num_kv_heads"] == attention["num_kv_heads"]
        assert result.metrics["checkpoint_num_kv_heads"] == 2 and result.metrics["kv_heads_conversion"] == how
        assert "workload" not in result.config and result.config["cache"] == {"dtype": "auto"}  # no cache.impl
    assert as_mha.metrics["perplexity"] == pytest.approx(as_saved.metrics["perplexity"], rel=1e-6)
    # through an int8 KV cache: the quantization moves the perplexity, a little, and the record says which cache
    as_int8 = job(tmp_path / "int8", *common, "cache.dtype=int8")
    assert as_int8.status == "ok" and as_int8.config["cache"] == {"dtype": "int8"}
    assert 0 < abs(as_int8.metrics["perplexity"] / as_saved.metrics["perplexity"] - 1) < 0.01
    bad = job(tmp_path / "bad", *common, "attention=gqa", "attention.num_kv_heads=3")
    assert bad.status == "invalid" and bad.error.startswith("attention.num_kv_heads=3: must divide model.num_heads=4")


def test_eval_of_a_llama_directory_records_its_shape(tmp_path):
    from conftest import TEXT, llama_dir
    from tokenizers import ByteLevelBPETokenizer

    directory, _ = llama_dir(tmp_path / "llama", num_kv_heads=2, vocab_size=300)
    tokenizer = ByteLevelBPETokenizer()
    tokenizer.train_from_iterator([TEXT.decode()], vocab_size=300, min_frequency=1, show_progress=False)
    tokenizer.save(str(directory / "tokenizer.json"))
    (tmp_path / "text.txt").write_bytes(TEXT)
    result = job(tmp_path / "run", "task=eval", f"train.checkpoint={directory}", f"data.path={tmp_path / 'text.txt'}",
                 "train.batch_size=2", "train.seq_len=16", "train.eval_batches=2")
    assert result.status == "ok", result.error
    model = result.config["model"]
    assert (model["num_layers"], model["d_model"], model["num_heads"], model["vocab_size"]) == (2, 32, 4, 300)
    assert result.config["attention"] == {"type": "gqa", "num_kv_heads": 2}  # not model=small's 16 heads


def test_uptraining_from_a_checkpoint_of_another_shape_is_invalid(tmp_path):
    from kvbench.checkpoint import save_checkpoint
    from kvbench.config.model import AttentionConfig, ModelConfig
    from kvbench.model import Decoder

    saved = ModelConfig(name="train_small", num_layers=1, d_model=32, num_heads=8, preset_kv_heads=8, ffn_dim=64,
                        vocab_size=256, max_seq_len=64)
    save_checkpoint(tmp_path / "ckpt.pt", Decoder(saved, AttentionConfig("mha")))
    result = job(tmp_path / "run", "task=train", "model=tiny", f"train.init_from={tmp_path / 'ckpt.pt'}",
                 "train.steps=0")
    assert result.status == "invalid"
    assert "the checkpoint has model.num_layers=1, model=tiny has 2" in result.error
    assert result.error.startswith(f"train.init_from='{tmp_path / 'ckpt.pt'}'")


def test_every_metric_of_every_kind_of_record_has_a_unit_a_method_and_a_readme_row(tmp_path):
    """Real records of each task and workload (decode in float32 and bfloat16, with each cache,
    a multi-turn chat, training from scratch and from a checkpoint, evaluation, a Llama
    directory): every metric, series and table they carry is in ``methods``, and every metric
    is named in the generated metrics reference (docs/reference/metrics.md)."""
    from pathlib import Path

    from conftest import llama_dir

    from kvbench.workloads.decode import METHODS as DECODE

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    tiny = ["model=tiny", "workload.prompt_len=8", "workload.gen_len=3", "runtime.warmup=0", "runtime.repeats=1"]
    small_train = ["model=tiny", f"data.path={corpus}", "train.steps=2", "train.batch_size=2", "train.seq_len=16",
                   "train.eval_batches=1", "train.log_every=1", "train.eval_every=2"]
    directory, _ = llama_dir(tmp_path / "llama", num_kv_heads=2)
    runs = {
        "decode": tiny,
        "decode bf16 concat": [*tiny, "runtime.dtype=bfloat16", "cache.impl=concat"],
        "multiturn": ["model=tiny", "workload=multiturn", "workload.system_len=8", "workload.turns=2",
                      "workload.user_len=4", "workload.reply_len=3", "cache.shared=true", "runtime.warmup=0",
                      "runtime.repeats=1"],
        "train": ["task=train", "attention=mha", *small_train],
        "llama_dir": ["model=llama_dir", f"model.path={directory}", "attention=mha", "workload.prompt_len=8",
                      "workload.gen_len=3", "runtime.repeats=1"],
        "capacity": ["task=capacity", "model=tiny", "capacity.context_lens=[8,16]", "capacity.max_batch=4",
                     "workload.gen_len=3", "runtime.warmup=0", "runtime.repeats=1", "runtime.memory_budget_gb=64"],
        "capacity chat": ["task=capacity", "model=tiny", "workload=multiturn", "workload.system_len=8",
                          "workload.turns=2", "workload.user_len=4", "workload.reply_len=2", "cache.shared=true",
                          "capacity.max_batch=2", "runtime.warmup=0", "runtime.repeats=1",
                          "runtime.memory_budget_gb=64", "slo.tpot_x_batch1=3"],
    }
    records = {name: job(tmp_path / name.replace(" ", "_"), *overrides) for name, overrides in runs.items()}
    checkpoint = tmp_path / "train" / "checkpoint.pt"
    records["uptrain"] = job(tmp_path / "uptrain", "task=train", "attention=gqa", f"train.init_from={checkpoint}",
                             *small_train)
    records["eval"] = job(tmp_path / "eval", "task=eval", f"train.checkpoint={checkpoint}", f"data.path={corpus}",
                          "train.batch_size=2", "train.seq_len=16", "train.eval_batches=1", "attention=mha")
    root = Path(__file__).resolve().parents[1]
    # the user-facing text: the README, the docs pages (docs/metrics-notes.md names the newer fields)
    # and the generated metrics reference
    readme = "\n".join(p.read_text() for p in [root / "README.md", *sorted((root / "docs").rglob("*.md"))])
    without_method, not_in_readme = {}, set()
    for name, result in records.items():
        assert result.status == "ok", (name, result.error)
        carried = set(result.metrics) | {f"series.{k}" for k in result.series} | {f"tables.{k}" for k in result.tables}
        if carried - set(result.methods):
            without_method[name] = sorted(carried - set(result.methods))
        # the reference names turn k's TTFT once, as a pattern
        named = {k: re.sub(r"^turn[0-9]+_ttft_ms$", "turn<k>_ttft_ms", k) for k in result.metrics}
        not_in_readme |= {k for k, row in named.items() if f"`{row}`" not in readme}
    assert without_method == {}
    assert not not_in_readme, f"metrics the metrics reference does not name: {sorted(not_in_readme)}"
    # Every number a record carries may be a search's objective (and a cap); check_objective
    # reads the *_METHODS tables, these are the metrics the jobs wrote.
    for result in records.values():
        task, workload = result.config["task"], result.config.get("workload", {}).get("name", "decode")
        for metric, value in result.metrics.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                runner.check_objective(f"-{metric}", {metric: 1.0}, task, workload)
    assert {"dtype_max_abs_logit_diff", "kv_cache_bytes_alloc_reason", "turn2_ttft_ms", "ppl_before_uptrain",
            "kv_heads_conversion", "checkpoint_num_kv_heads", "roofline_bound", "max_batch_longest",
            "kv_pool_kl_nats"} <= \
        {k for r in records.values() for k in r.metrics}
    # compile_s needs a compiler toolchain: its method is there
    assert DECODE["compile_s"].startswith("s;") and "`compile_s`" in readme


@pytest.mark.parametrize("loads, flag", [((5.0, 6.0), True), ((0.4, 1.2), False), ((None, None), None)])
def test_every_job_records_the_load_around_it_and_whether_it_was_noisy(tmp_path, monkeypatch, loads, flag):
    """Load averages injected (before, after) on 2 usable CPUs: noisy above 2.5."""
    seen = iter(loads)
    monkeypatch.setattr(runner, "load_average", lambda: next(seen))
    monkeypatch.setattr(runner, "usable_cpus", lambda: 2)
    result = job(tmp_path, *TINY, "runtime.fidelity=false")
    m = result.metrics
    assert result.status == "ok", result.error
    assert (m["load_avg_before"], m["load_avg_after"], m["usable_cpus"]) == (*loads, 2)
    assert m["noisy"] is flag
    assert (m["noisy_reason"] is not None) == bool(flag)
    if flag:
        assert "load average 6.00 on 2 usable CPUs" in m["noisy_reason"]
    assert set(runner.LOAD_METHODS) <= set(result.methods)


def test_a_job_that_never_started_its_task_records_no_load(tmp_path):
    result = job(tmp_path, *TINY, "runtime.min_time_s=-1")
    assert result.status == "invalid" and result.error.startswith("runtime.min_time_s=-1")
    assert "noisy" not in result.metrics


def test_an_objective_is_checked_against_the_metrics_of_the_jobs_task():
    """task=compare and a chat name some metrics per variant / per turn: patterns match them."""
    runner.check_objective("gqa_step_ms_ctx1024", {"mqa_kv_bytes_ratio": 1.0}, "compare")
    runner.check_objective("-turn3_ttft_ms", {}, "bench", "multiturn")
    runner.check_objective(None, {}, "bench")  # no objective: nothing to check
    for objective, task, needle in [
            ("gqa_step_ms_ctx", "compare", "objective='gqa_step_ms_ctx': task=compare records no metric"),
            ("turn3_ttft_ms", "bench", "objective='turn3_ttft_ms': task=bench workload=decode records no metric"),
            ("energy_reason", "bench", "records no metric 'energy_reason'"),  # text, not a number
            ("perplexity", "capacity", "objective='perplexity': task=capacity records no metric")]:
        with pytest.raises(ConfigError, match=re.escape(needle)):
            runner.check_objective(objective, {}, task)
    assert "tokens_per_s" in runner.objective_metrics("bench") and "perplexity" in runner.objective_metrics("eval")
