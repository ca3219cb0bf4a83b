"""task=compare: variants alternate trial by trial (the order is recorded), share the MHA weights,
and the slope, intervals and paired ratios are what the stats module computes from the trials."""

import os
import signal
from contextlib import contextmanager
from dataclasses import replace

import numpy as np
import pytest
import torch
from conftest import LiveKvbench, compose

from kvbench.cache import cache_for
from kvbench.config.model import AttentionConfig
from kvbench.core.errors import ConfigError
from kvbench.generate import decode_step, prefill
from kvbench.jobs.job_config import to_bench_config
from kvbench.jobs.runner import run_job
from kvbench.results import distrust, read_record
from kvbench.tasks.common import build_model
from kvbench.tasks.compare import round_order, summarize, variants

TINY = ["wandb.mode=disabled", "task=compare", "model=tiny", "model.max_seq_len=64", "runtime.threads=1"]


def config(*overrides):
    return compose(*TINY, *overrides)


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    cfg = config("compare.variants=[mha,2,mqa]", "compare.contexts=[8,4,16]", "compare.steps=3",
                 "runtime.warmup=1", "runtime.repeats=4")
    return run_job(cfg, tmp_path_factory.mktemp("compare"))


def test_rounds_alternate_the_variants_and_record_the_order(record):
    assert record.status == "ok", record.error
    trials = record.tables["trials"]
    # warm-up round left out; 4 rounds x 3 variants x 3 contexts, in the order run
    assert len(trials) == 4 * 3 * 3
    forward = ["mha_kv8", "gqa_kv2", "mqa_kv1"]
    for r in range(4):
        rows = [t for t in trials if t["round"] == r]
        turns = [rows[i]["variant"] for i in range(0, 9, 3)]
        assert turns == (forward if r % 2 == 0 else forward[::-1])
        assert [t["turn"] for t in rows] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
        assert [t["context"] for t in rows] == [4, 8, 16] * 3  # contexts sorted within a trial
        assert all(len(t["steps_ms"]) == 3 and t["step_ms"] == np.median(t["steps_ms"]) for t in rows)
    assert [row["variant"] for row in record.tables["compare"]] == forward
    # many variants, none of them the record's attention
    assert "attention" not in record.config and record.config["compare"]["variants"] == ["mha", "2", "mqa"]


def test_a_compare_record_is_trusted_on_resume(record):
    """Its figures pass the checks resume makes again (kvbench.results.distrust): a
    ``<v>_step_ms_ctx<C>_ci_reason`` is words, though the pattern of the step in ms matches its name."""
    assert isinstance(record.metrics["mha_kv8_step_ms_ctx16_ci_reason"], str)
    assert distrust(read_record(record.written_to)) is None


def test_paired_ratios_and_intervals_match_a_recompute_from_the_trials(record):
    trials, m = record.tables["trials"], record.metrics

    def rounds(variant, ctx):  # per-round medians of the raw steps, in round order
        rows = sorted((t for t in trials if t["variant"] == variant and t["context"] == ctx), key=lambda t: t["round"])
        return np.array([np.median(t["steps_ms"]) for t in rows])

    base, gqa = rounds("mha_kv8", 16), rounds("gqa_kv2", 16)
    assert m["gqa_kv2_step_ratio_ctx16"] == pytest.approx(np.median(gqa) / np.median(base))
    assert m["gqa_kv2_step_ms_ctx16"] == pytest.approx(np.median(gqa))
    # 4 rounds: too few for a 95% interval (6), so none and the reason, for steps and ratios alike
    assert m["gqa_kv2_step_ms_ctx16_ci_low"] is None and "4 rounds" in m["gqa_kv2_step_ms_ctx16_ci_reason"]
    assert m["gqa_kv2_step_ratio_ctx16_ci_low"] is None and "4 rounds" in m["gqa_kv2_step_ratio_ctx16_ci_reason"]
    assert m["mha_kv8_step_ratio_ctx16"] == 1.0 and m["mha_kv8_slope_ratio"] == 1.0
    # the bytes a position's K and V take: 2 * layers * kv_heads * head_dim * 4 bytes
    assert m["gqa_kv2_kv_bytes_per_token"] == 2 * 2 * 2 * 8 * 4 and m["gqa_kv2_kv_bytes_ratio"] == 0.25
    # the shorter contexts are in the table, not among the metrics
    assert "gqa_kv2_step_ms_ctx4" not in m and record.tables["compare"][1]["step_ms_ctx4"] == pytest.approx(
        np.median(rounds("gqa_kv2", 4)))
    assert record.methods["<v>_slope_ratio"] and record.methods["paired_ratio"]


def test_the_slope_and_its_ratio_on_synthetic_trials():
    """Steps that cost exactly a + slope x context: the fit returns the slope, the ratio theirs."""
    contexts, slope_ms_per_pos = [256, 512, 1024, 2048], {"a": 4e-3, "b": 1e-3}
    rng = np.random.default_rng(1)
    trials = []
    for r in range(6):
        drift = 1 + 0.1 * rng.random()  # the machine slows a whole round: pairing cancels it
        for v, slope in slope_ms_per_pos.items():
            trials += [{"round": r, "variant": v, "context": c, "step_ms": drift * (5.0 + slope * c)} for c in contexts]
    rows = summarize(trials, ["a", "b"], contexts, {"a": {"kv_bytes_per_token": 64}, "b": {"kv_bytes_per_token": 16}})
    a, b = rows
    drift_median = np.median([t["step_ms"] / (5.0 + 4e-3 * t["context"]) for t in trials if t["variant"] == "a"])
    assert a["decode_us_per_1k_ctx_ci_low"] <= a["decode_us_per_1k_ctx"] <= a["decode_us_per_1k_ctx_ci_high"]
    assert a["decode_us_per_1k_ctx"] == pytest.approx(4e-3 * 1e6, rel=0.11)  # within the drift
    assert b["slope_ratio"] == pytest.approx(0.25) and b["slope_ratio_ci_low"] == pytest.approx(0.25)
    assert b["kv_bytes_ratio"] == 0.25
    assert b["step_ratio_ctx2048"] == pytest.approx((5.0 + 2.048) / (5.0 + 8.192))
    assert a["step_ms_ctx256"] == pytest.approx(drift_median * (5.0 + 4e-3 * 256), rel=0.05)


def test_variants_share_the_mha_weights_and_differ_only_in_k_and_v():
    cfg = to_bench_config(config("compare.variants=[mha,gqa,mqa]", "compare.contexts=[4,8,16]"))
    base = build_model(replace(cfg, attention=AttentionConfig("mha")), torch.device("cpu"))
    runs = variants(cfg, base)
    assert [(v.label, v.num_kv_heads) for v in runs] == [("mha_kv8", 8), ("gqa_kv2", 2), ("mqa_kv1", 1)]
    assert runs[0].model is base
    D, C = base.config.head_dim, base.config.d_model
    base_state = base.state_dict()
    for v in runs[1:]:
        state = v.model.state_dict()
        for name, tensor in base_state.items():
            if name.endswith((".attn.wk.weight", ".attn.wv.weight")):
                # independent recompute: KV head j is the mean of MHA heads j*G .. (j+1)*G - 1
                pooled = tensor.view(8, D, C).view(v.num_kv_heads, 8 // v.num_kv_heads, D, C).mean(1)
                torch.testing.assert_close(state[name], pooled.reshape(-1, C))
            else:
                assert torch.equal(state[name], tensor), name


def test_round_order_alternates():
    assert [round_order(3, r) for r in range(3)] == [[0, 1, 2], [2, 1, 0], [0, 1, 2]]


@pytest.mark.parametrize("override, key", [
    ("compare.variants=[mha,3]", "compare.variants"),
    ("compare.variants=[mha]", "compare.variants"),
    ("compare.variants=[mha,8]", "compare.variants"),
    ("compare.variants=[mha,fast]", "compare.variants"),
    ("compare.contexts=[8,64]", "compare.contexts"),
    ("cache.impl=concat", "cache.impl"),
])
def test_bad_compare_values_name_their_key(override, key):
    with pytest.raises(ConfigError) as err:
        to_bench_config(config("compare.contexts=[4,8,16]", override))
    assert str(err.value).startswith(key) and "\n" not in str(err.value)


def interrupting_progress(after: int, shown: list):
    """A progress callback that records what it is shown and sends this process SIGINT at tick ``after``
    (as Ctrl-C would, mid-job)."""

    @contextmanager
    def progress(label, total):
        shown.append((label, total))

        def tick(description=None):
            shown.append(description)
            if len(shown) - 1 == after:
                signal.raise_signal(signal.SIGINT)
        yield tick
    return progress


INTERRUPTED = ("compare.variants=[mha,2,mqa]", "compare.contexts=[8,4,16]", "compare.steps=2", "runtime.warmup=1",
               "runtime.repeats=4")


def test_an_interrupted_compare_keeps_its_complete_rounds_marked_partial(tmp_path):
    """Ctrl-C in the third timed round: the record is interrupted, and keeps the comparison of the two
    rounds complete by then (every figure recomputed from their trials), marked partial with its rounds;
    the third round's trial is kept in tables.trials, out of every figure. Progress is shown per
    prefill and per trial, each tick saying which."""
    shown = []
    with pytest.raises(KeyboardInterrupt) as stopped:  # 3 prefills, 3 warm-up trials, 2 rounds, 1 trial
        run_job(config(*INTERRUPTED), tmp_path, progress=interrupting_progress(3 + 3 + 2 * 3 + 1, shown))
    record = read_record(tmp_path)
    assert stopped.value.record.to_dict() == record.to_dict()
    assert record.status == "interrupted" and record.metrics["partial"] is True and record.metrics["rounds"] == 2
    assert record.error == ("interrupted by SIGINT; partial: interrupted after 2 of 4 timed rounds: every figure is "
                            "over those 2 rounds only (tables.trials keeps every trial measured)")
    assert shown[0] == ("compare mha,2,mqa", (1 + 1 + 4) * 3)
    assert shown[1:4] == [f"compare: prefill {n}/3 ({v}, 16 positions)"
                          for n, v in enumerate(["mha_kv8", "gqa_kv2", "mqa_kv1"], 1)]
    assert shown[4:] == ["compare: warm-up 1/1"] * 3 + ["compare: round 1/4"] * 3 + ["compare: round 2/4"] * 3 + [
        "compare: round 3/4"]
    trials = record.tables["trials"]
    assert len(trials) == 2 * 3 * 3 + 3 and {t["round"] for t in trials} == {0, 1, 2}
    for variant in ("mha_kv8", "gqa_kv2", "mqa_kv1"):
        for ctx in (4, 8, 16):
            medians = [np.median(t["steps_ms"]) for t in trials
                       if t["variant"] == variant and t["context"] == ctx and t["round"] < 2]
            row = next(r for r in record.tables["compare"] if r["variant"] == variant)
            assert len(medians) == 2 and row[f"step_ms_ctx{ctx}"] == pytest.approx(np.median(medians))
        assert record.metrics[f"{variant}_step_ms_ctx16"] == pytest.approx(
            next(r for r in record.tables["compare"] if r["variant"] == variant)["step_ms_ctx16"])
    assert record.units["partial"] == "bool" and record.units["rounds"] == "count"


def test_a_compare_interrupted_before_a_complete_round_keeps_only_its_trials(tmp_path):
    """Ctrl-C in the first timed round (after the prefills and the warm-up): no figure, nothing
    marked partial; the trials measured are kept."""
    shown = []
    with pytest.raises(KeyboardInterrupt):
        run_job(config(*INTERRUPTED), tmp_path, progress=interrupting_progress(3 + 3 + 1, shown))
    record = read_record(tmp_path)
    assert record.status == "interrupted" and record.error == "interrupted by SIGINT"
    assert "partial" not in record.metrics and "rounds" not in record.metrics and "compare" not in record.tables
    assert len(record.tables["trials"]) == 3  # one trial: three contexts


def test_a_prefill_in_chunks_fills_every_layouts_cache_as_one_call_does():
    """compare fills each variant's cache in PREFILL_CHUNK-position calls (so that a Ctrl-C is handled
    within seconds): for every kind of layer the next decode step reads what one call would have left."""
    cfg = to_bench_config(config("model.num_layers=6", "model.max_seq_len=128",
                                 "compare.variants=[mha,gqa,mla,mha:w16:g6,mha:d3,mla:k16,mha:s2]",
                                 "compare.contexts=[8,100]"))
    h = cfg.model.num_heads
    base = build_model(replace(cfg, attention=AttentionConfig.for_heads(h, h).without_pattern()), torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    vocab = cfg.model.vocab_size
    prompt, token = torch.randint(vocab, (2, 100), generator=gen), torch.randint(vocab, (2, 1), generator=gen)
    with torch.inference_mode():
        for v in variants(cfg, base):
            whole, chunked = (cache_for(v.model, "static", 2, 101) for _ in range(2))
            prefill(v.model, prompt, whole)
            for start in range(0, 100, 32):  # chunks across the window of 16 and DSA's k of 16
                prefill(v.model, prompt[:, start:start + 32], chunked, start)
            assert chunked.length == whole.length == 100
            torch.testing.assert_close(decode_step(v.model, token, chunked, 100),
                                       decode_step(v.model, token, whole, 100), rtol=1e-5, atol=1e-5)


@pytest.mark.e2e
def test_ctrl_c_mid_compare_keeps_its_complete_rounds_from_the_command_line(tmp_path):
    """``kvbench task=compare`` with its job in its own process, Ctrl-C (SIGINT to the process group, as
    a terminal sends it) once the log says round 3 is done: exit 130, one line saying partial with its
    rounds, and the record keeps the comparison of the rounds complete by then."""
    run = LiveKvbench("task=compare", "model=tiny", "compare.variants=[mha,mqa]", "compare.contexts=[16,64]",
                      "compare.steps=100", "runtime.warmup=0", "runtime.repeats=40", "runtime.threads=1",
                      "wandb.mode=disabled", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path,
                      start_new_session=True)
    # (1 prefill + 40 rounds) x 2 variants = 82 ticks, a line every 8: prefills, rounds 1 and 2, round 3
    run.wait_for(r": 8/82 compare: round 3/40 \(")
    os.killpg(run.pid, signal.SIGINT)
    assert run.finish() == 130, run.output
    record = read_record(tmp_path / "run")
    rounds = record.metrics["rounds"]
    assert record.status == "interrupted" and record.metrics["partial"] is True and 3 <= rounds < 40
    assert f"interrupted by SIGINT; partial: interrupted after {rounds} of 40 timed rounds" in run.stderr
    assert [row["variant"] for row in record.tables["compare"]] == ["mha_kv8", "mqa_kv1"]
    assert max(t["round"] for t in record.tables["trials"]) in (rounds - 1, rounds)
