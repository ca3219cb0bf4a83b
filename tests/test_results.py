"""The record: the only reader and writer of results.json, resume's "done?" check, the claim
that keeps two processes off one job, and the helpers everything downstream reads a record with."""

import json
import os
import signal
import socket
import stat
import subprocess
import sys
from dataclasses import asdict

import pytest
from conftest import call_with_timeout, compose

from kvbench.jobs.claim import CLAIM_FILE, claim_holder, claim_job, completed_record
from kvbench.jobs.job_config import to_bench_config
from kvbench.jsonio import write_json_atomic
from kvbench.results import RecordError, RunResult, flatten, lookup, nonfinite_metrics, objective_value, read_record

TINY = ["model=tiny", "workload.prompt_len=12", "workload.gen_len=6", "runtime.warmup=1",
        "runtime.repeats=2", "wandb.mode=disabled"]


def config_of(*overrides):
    return asdict(to_bench_config(compose(*overrides)))


def test_completed_record_needs_ok_status_and_the_same_config(tmp_path):
    config = config_of(*TINY)
    job = tmp_path / "job"
    # only a temporary file of an interrupted write: the job has not completed
    job.mkdir()
    (job / ".results.json.abc123.tmp").write_text('{"status": "ok", "conf')
    assert completed_record(job, config) is None
    RunResult(status="ok", config=config, metrics={"decode_ms_p50": 1.0}).write(job)
    assert completed_record(job, config).status == "ok"
    # neither rerun nor where the record is logged changes what the job measures
    assert completed_record(job, config_of(*TINY, "rerun=true", "wandb.mode=offline")) is not None
    assert completed_record(job, config_of(*TINY, "workload.batch_size=2")) is None
    # a worse record never replaces the ok one: it is written beside it, and the job stays done
    assert RunResult(status="error", config=config, error="boom").write(job) == job / "results.error.json"
    assert completed_record(job, config) is not None
    (job / "results.json").unlink()
    RunResult(status="error", config=config, error="boom").write(job)
    assert completed_record(job, config) is None
    RunResult(status="interrupted", config=config, error="interrupted by SIGINT").write(job)
    assert completed_record(job, config) is None  # resume runs an interrupted job again
    (job / "results.json").write_text('{"status": "ok", "config": {')  # torn: never trusted
    assert completed_record(job, config) is None


def test_a_record_round_trips_through_its_file(tmp_path):
    rec = RunResult("ok", {"attention": {"type": "gqa", "num_kv_heads": 2}}, metrics={"decode_ms_p50": 1.5},
                    series={"decode_ms": [1.0, 2.0]}, tables={"turns": [{"turn": 1}]}, overrides=["a=b"])
    rec.write(tmp_path)
    back = read_record(tmp_path)
    assert back == rec and back.get("attention.num_kv_heads") == 2
    assert read_record(tmp_path / "results.json") == rec


@pytest.mark.parametrize("content, needle", [
    ('{"status": "ok", "config": {', "Expecting"),  # torn
    ("[1, 2]", "not a kvbench record"),
    ('{"config": {}}', "not a kvbench record"),  # no status
    ('{"status": "ok", "config": 3}', "not a kvbench record"),
    ('{"status": "finished", "config": {}}', "status='finished'"),
    # parses, but a sink indexing into it would crash: not a record
    ('{"status": "ok", "config": {}, "metrics": [1, 2]}', "metrics has type list"),
    ('{"status": "ok", "config": {}, "metrics": {"a": {"b": 1}}}', "not a number"),
    ('{"status": "ok", "config": {}, "overrides": "a=b"}', "overrides has type str"),
    ('{"status": "ok", "config": {}, "tables": {"turns": [1]}}', "tables.turns"),
    ('{"status": "ok", "config": {}, "error": 5}', "error has type int"),
    ('{"status": "ok", "config": {}, "series": {"x": 3}}', "series holds"),
    ("[" * 100000 + "]" * 100000, "nested too deeply"),
    (b"\xff\xfe not utf-8", "decode"),
])
def test_a_malformed_record_is_a_record_error_naming_the_file(tmp_path, content, needle):
    path = tmp_path / "results.json"
    path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content)
    with pytest.raises(RecordError) as err:
        read_record(tmp_path)
    assert str(tmp_path / "results.json") in str(err.value) and needle in str(err.value)
    with pytest.raises(RecordError, match="No such file"):
        read_record(tmp_path / "nope")


@pytest.mark.parametrize("special", ["fifo", "directory"])
def test_a_results_json_that_is_not_a_regular_file_is_a_record_error(tmp_path, special):
    """A FIFO named results.json once blocked the reader (resume, the report) forever."""
    os.mkfifo(tmp_path / "results.json") if special == "fifo" else (tmp_path / "results.json").mkdir()
    with pytest.raises(RecordError, match="results.json"):
        call_with_timeout(lambda: read_record(tmp_path / "results.json"))
    assert call_with_timeout(lambda: completed_record(tmp_path, {})) is None


def test_atomic_write_leaves_the_old_file_when_serialising_fails(tmp_path):
    path = tmp_path / "x.json"
    write_json_atomic(path, {"a": 1})
    with pytest.raises(ValueError):
        write_json_atomic(path, {"a": _Unserialisable()})
    assert json.loads(path.read_text()) == {"a": 1} and [p.name for p in tmp_path.iterdir()] == ["x.json"]


class _Unserialisable:
    def item(self):
        raise ValueError("no plain value")


def test_lookup_and_flatten():
    tree = {"a": {"b": 1, "c": {"d": [1, 2]}}, "e": None}
    assert lookup(tree, "a.c.d") == [1, 2] and lookup(tree, "a.x") is None and lookup(tree, "e.f") is None
    assert flatten(tree) == {"a.b": 1, "a.c.d": [1, 2], "e": None}


def test_a_fifo_or_a_directory_named_results_json_is_unreadable_not_a_hang(tmp_path):
    os.mkfifo(tmp_path / "results.json")  # opening it to read would block until a writer came
    with pytest.raises(RecordError, match="not a regular file"):
        read_record(tmp_path)
    (tmp_path / "job" / "results.json").mkdir(parents=True)
    with pytest.raises(RecordError, match="not a regular file|No such file"):
        read_record(tmp_path / "job" / "results.json")


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600)])
def test_records_are_created_with_the_users_umask(tmp_path, umask, mode):
    """0666 less the umask, as any file the user creates (was always 0600: mkstemp)."""
    old = os.umask(umask)
    try:
        path = RunResult("ok", {}).write(tmp_path)
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == mode


def test_a_claim_is_exclusive_names_its_holder_and_is_released(tmp_path):
    claim = claim_job(tmp_path / "job")
    assert claim is not None
    assert claim_holder(tmp_path / "job").startswith(f"{socket.gethostname()} pid {os.getpid()} since ")
    assert claim_job(tmp_path / "job") is None  # another open file: a second claimer, even in one process
    claim.release()
    assert claim_holder(tmp_path / "job") is None
    with claim_job(tmp_path / "job") as again:
        assert again is not None and claim_holder(tmp_path / "job") is not None


@pytest.mark.e2e
def test_a_claim_of_a_killed_process_expires(tmp_path):
    """A process that dies without releasing (SIGKILL) leaves its name in the file but no claim."""
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from kvbench.jobs.claim import claim_job; "
                               "c = claim_job(sys.argv[1]); print('held', flush=True); time.sleep(600)",
                               str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    assert claim_job(tmp_path) is None and f"pid {holder.pid} " in claim_holder(tmp_path)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert f"pid {holder.pid} " in (tmp_path / CLAIM_FILE).read_text()
    assert claim_holder(tmp_path) is None
    with claim_job(tmp_path) as claim:
        assert claim is not None


def strict_json(path):
    """Parse as a strict JSON reader does: a bare NaN / Infinity is an error, not a number."""
    def reject(token):
        raise ValueError(f"not JSON: {token}")
    return json.loads(path.read_text(), parse_constant=reject)


def test_non_finite_numbers_are_written_as_null_with_a_reason(tmp_path):
    nan, inf = float("nan"), float("inf")
    rec = RunResult("error", {"model": {"rope_theta": 10000.0}},
                    metrics={"val_loss": nan, "perplexity": inf, "delta": -inf, "steps": 3, "ok": 1.5},
                    series={"train_loss": [2.0, nan, nan], "decode_ms": [1.0]},
                    tables={"curve": [{"step": 1, "val_loss": inf}, {"step": 2, "val_loss": 1.0}]})
    rec.write(tmp_path)
    data = strict_json(tmp_path / "results.json")
    assert data["metrics"] == {"val_loss": None, "perplexity": None, "delta": None, "steps": 3, "ok": 1.5}
    assert data["series"] == {"train_loss": [2.0, None, None], "decode_ms": [1.0]}
    assert data["tables"]["curve"] == [{"step": 1, "val_loss": None}, {"step": 2, "val_loss": 1.0}]
    assert data["null_reasons"] == {"val_loss": "nan", "perplexity": "inf", "delta": "-inf",
                                    "series.train_loss": "nan (2 values)", "tables.curve.val_loss": "inf"}
    assert read_record(tmp_path) == rec  # the record in memory is what was written
    with pytest.raises(ValueError):  # and nothing else ever writes a bare NaN
        write_json_atomic(tmp_path / "x.json", {"a": nan})


def test_nonfinite_metrics_names_each_kind():
    import torch

    metrics = {"a": float("nan"), "b": torch.tensor(float("-inf")), "c": 1.0, "d": None, "e": "text"}
    assert nonfinite_metrics(metrics) == {"a": "nan", "b": "-inf"}


def test_the_objective_is_the_records_metric_negated_for_a_minus_and_none_with_the_reason(tmp_path):
    metrics = {"tokens_per_s": 250.0, "decode_ms_p50": 4, "kv_cache_bytes": 1000, "noisy": True,
               "energy_mj_per_token": None, "energy_reason": "no NVML on a CPU", "roofline_bound": "memory"}
    ok = RunResult("ok", {}, metrics=metrics)
    assert objective_value(ok, "tokens_per_s") == (250.0, None)
    assert objective_value(ok, "-decode_ms_p50") == (-4.0, None)
    assert objective_value(ok, "tokens_per_s", {"kv_cache_bytes": 1000}) == (250.0, None)  # at the cap: within
    assert objective_value(ok, "tokens_per_s", {"kv_cache_bytes": 999}) == (
        None, "kv_cache_bytes=1000 is above objective_caps.kv_cache_bytes=999")
    assert objective_value(ok, "tokens_per_s", {"kv_cache_bytes_nvml": 1e9}) == (
        None, "objective_caps.kv_cache_bytes_nvml: cannot be checked, the record has no kv_cache_bytes_nvml")
    assert objective_value(ok, "energy_mj_per_token") == (
        None, "energy_mj_per_token is null in the record (no NVML on a CPU)")
    assert objective_value(ok, "noisy") == (None, "noisy=True is not a finite number")
    assert objective_value(ok, "roofline_bound") == (None, "roofline_bound='memory' is not a finite number")
    assert objective_value(ok, "prefill_ms") == (None, "the record has no prefill_ms")
    # A record whose job did not finish ok has no objective, whatever its metrics say.
    for status in ("invalid", "oom", "error", "interrupted"):
        assert objective_value(RunResult(status, {}, metrics=metrics, error="why"), "tokens_per_s") == (
            None, f"the job is {status}: why")
    # As read back from disk: a NaN is a null, and null_reasons says what it was.
    RunResult("ok", {}, metrics={"tokens_per_s": float("nan")}).write(tmp_path)
    assert objective_value(read_record(tmp_path), "tokens_per_s") == (None, "tokens_per_s is null in the record (nan)")
