"""Hostile input, round 5: resume trusts a record only if it passes the checks it was written under.
An ``ok`` record whose figures no run can produce (a latency of ``"fast"`` or -5, ``kv_cache_bytes``
of -1, a schema this kvbench does not know) is measured again, with one line naming the key and
the value; so is one whose ``overrides`` are not its job's, which the sweep's table would list as
missing (a sweep that exits 1 on every resume). One identity for a job."""

import json
import os
import subprocess
import sys
from dataclasses import asdict

import pytest
from conftest import compose

from kvbench.jobs.claim import completed_record, resume_check
from kvbench.jobs.job_config import to_bench_config
from kvbench.jobs.runner import run_job
from kvbench.results import SCHEMA_VERSION, RunResult, distrust, read_record, record_config

TINY = ["model=tiny", "workload.prompt_len=12", "workload.gen_len=6", "runtime.warmup=0", "runtime.repeats=2",
        "runtime.threads=1", "wandb.mode=disabled"]


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """A record the runner wrote (units, methods, plausibility and all), as a dict, with its config."""
    out = tmp_path_factory.mktemp("measured")
    record = run_job(compose(*TINY, "attention=gqa"), out, overrides=["attention=gqa"])
    assert record.status == "ok", record.error
    return json.loads((out / "results.json").read_text()), asdict(to_bench_config(compose(*TINY, "attention=gqa")))


def plant(tmp_path, data):
    (tmp_path / "results.json").write_text(json.dumps(data))
    return tmp_path


# (where, key, value, what the line says): each a figure no run writes
EDITS = [("metrics", "decode_ms_p50", "fast", "metrics.decode_ms_p50='fast': not a number (ms)"),
         # below the step's roofline, and negative; a cache that allocates nothing (plausibility's bounds)
         ("metrics", "decode_ms_p50", -5, "metrics.decode_ms_p50=-5: past a physical bound (>= roofline_ms"),
         ("metrics", "kv_cache_bytes", -1, "metrics.kv_cache_bytes=-1: past a physical bound (> 0"),
         ("metrics", "prefill_ms", -5, "metrics.prefill_ms=-5: negative, which no ms figure is"),
         ("metrics", "kv_bytes_per_token", -1, "metrics.kv_bytes_per_token=-1: negative, which no bytes figure is"),
         ("metrics", "num_params", "many", "metrics.num_params='many': not a number (count)"),
         ("metrics", "noisy", "no", "metrics.noisy='no': not true or false"),
         ("metrics", "tokens_per_s", True, "metrics.tokens_per_s=True: not a number"),
         ("", "schema_version", 999, f"schema_version=999: this kvbench reads 1 to {SCHEMA_VERSION}"),
         ("", "schema_version", 0, "schema_version=0")]


# with the record's units, and without (a record that declares none: the figure's name says its unit,
# decode_ms_*, *_bytes; a name without a unit word is checked against the units declared only)
CASES = [(*e, units) for e in EDITS for units in (True, False) if units or e[1] not in ("num_params", "noisy")]


@pytest.mark.parametrize("where, key, value, line, units", CASES,
                         ids=[f"{c[1]}={c[2]!r}-{'units' if c[4] else 'no-units'}" for c in CASES])
def test_an_ok_record_no_run_can_write_is_measured_again_with_one_line_naming_key_and_value(
        tmp_path, measured, where, key, value, line, units):
    data, config = measured
    assert completed_record(plant(tmp_path, data), config) is not None  # the runner's own: trusted as it is
    hostile = json.loads(json.dumps(data))
    (hostile[where] if where else hostile)[key] = value
    if not units:
        hostile["units"] = {}
    record, why = resume_check(plant(tmp_path, hostile), config)
    assert record is None and why.startswith(line) and "\n" not in why
    # and a negative figure the writer keeps flagged implausible (measure/plausibility.py) stays trusted
    if key == "kv_cache_bytes":
        hostile["implausible"] = [{"metric": key, "value": -1, "bound": "> 0", "reason": "not seen"}]
        assert completed_record(plant(tmp_path, hostile), config) is not None


def test_figures_that_may_be_negative_stay_trusted(tmp_path, measured):
    """A KV cost slope on a drifting machine, its intercept and the ratios made from them are signed:
    a record that holds one is what a run writes, never measured again (it would be on every resume)."""
    data, config = measured
    hostile = json.loads(json.dumps(data))
    hostile["metrics"].update(decode_us_per_1k_ctx=-3.5, decode_ms_at_ctx0=-0.2, decode_ms_at_ctx0_ci_low=-0.9,
                              mha_kv16_slope_ratio=-0.4, mha_kv16_decode_us_per_1k_ctx=-1.0, peak_rss_reason="x")
    hostile["units"].pop("decode_us_per_1k_ctx", None)
    assert distrust(read_record(plant(tmp_path, hostile))) is None
    hostile["metrics"]["mha_kv16_kv_cache_bytes"] = -4096  # a size is never signed, declared or not
    assert "mha_kv16_kv_cache_bytes=-4096" in distrust(read_record(plant(tmp_path, hostile)))


def test_a_record_of_other_overrides_is_not_this_jobs_even_with_its_config(tmp_path, measured):
    """The sweep's table matches a job's record by its overrides: resume must too, or the job is
    skipped as done and listed as missing on every resume."""
    data, config = measured
    job = plant(tmp_path, data)
    assert completed_record(job, config, ["attention=gqa"]) is not None
    # how a job is scheduled or recorded is no part of which job it is
    assert completed_record(job, config, ["attention=gqa", "wandb.mode=offline", "rerun=false"]) is not None
    record, why = resume_check(job, config, ["attention=mqa"])
    assert record is None and why == "its overrides (attention=gqa) are not this job's (attention=mqa)"
    record, why = resume_check(job, asdict(to_bench_config(compose(*TINY, "workload.batch_size=2"))))
    assert record is None and why == "its config is not this job's"
    assert resume_check(tmp_path / "nothing", config) == (None, None)  # no record: nothing to say


def test_a_worse_record_goes_beside_only_a_trusted_ok_one(tmp_path, measured):
    """``results.json`` is kept from a worse record only when it is a record resume would trust."""
    data, config = measured
    hostile = json.loads(json.dumps(data))
    hostile["metrics"]["decode_ms_p50"] = "fast"
    job = plant(tmp_path, hostile)
    assert RunResult("error", record_config(config), error="boom").write(job) == job / "results.json"


@pytest.mark.e2e
def test_a_resumed_sweep_measures_untrusted_records_again_and_exits_zero(tmp_path):
    """A sweep of two jobs; then job 0's latency made ``"fast"`` and job 1's overrides another job's.
    The resume measures both again (one line each, naming why), its table counts 2 ok, exit 0."""
    sweep = tmp_path / "sweep"
    args = [sys.executable, "-m", "kvbench.cli", "-m", *TINY, "runtime.isolate=false", "attention=mha,mqa",
            f"hydra.sweep.dir={sweep}"]
    env = dict(os.environ, WANDB_MODE="disabled", HYDRA_FULL_ERROR="1")
    first = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stdout + first.stderr
    zero, one = (json.loads((sweep / j / "results.json").read_text()) for j in "01")
    zero["metrics"]["decode_ms_p50"] = "fast"
    one["overrides"] = [o.replace("attention=mqa", "attention=gqa") for o in one["overrides"]]
    for job, data in (("0", zero), ("1", one)):
        (sweep / job / "results.json").write_text(json.dumps(data))
    again = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "skipped:" not in again.stderr
    assert "measured again: " in again.stderr and "metrics.decode_ms_p50='fast': not a number (ms)" in again.stderr
    assert "its overrides (" in again.stderr and "attention=gqa" in again.stderr
    assert "2 ok" in again.stdout
    for job in "01":
        record = read_record(sweep / job)
        assert record.status == "ok" and distrust(record) is None
        assert isinstance(record.metrics["decode_ms_p50"], float) and record.metrics["decode_ms_p50"] > 0
