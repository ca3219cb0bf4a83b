"""W&B tracking without a server: a real sweep in offline mode is read back from its
transaction log (``wandb leet inspect``) and compared with results.json; disabled mode never
imports wandb; failures injected into W&B leave results.json untouched and only warn."""

import base64
import csv
import hashlib
import json
import logging
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kvbench.results import RunResult, flatten, lookup, read_record
from kvbench.sinks import tracking
from kvbench.sinks.tracking import (
    UNREACHABLE_MARKER,
    new_sweep,
    run_config,
    run_name,
    short_name,
    sweep_group,
    swept_keys,
    track,
)
from kvbench.sinks.views import RecordView

TINY = ["model=tiny", "workload.prompt_len=12", "workload.gen_len=5", "runtime.warmup=0",
        "runtime.repeats=1"]


def wandb_env(tmp_path: Path) -> dict:
    """W&B's own files (settings, artifact staging, cache) under tmp_path; no WANDB_MODE."""
    env = {k: v for k, v in os.environ.items() if k not in ("WANDB_MODE", "WANDB_API_KEY")}
    for var, sub in (("WANDB_CONFIG_DIR", "config"), ("WANDB_CACHE_DIR", "cache"), ("WANDB_DATA_DIR", "data")):
        env[var] = str(tmp_path / "wandb-home" / sub)
    return env


@pytest.fixture
def in_process_wandb(tmp_path, monkeypatch):
    for var, value in wandb_env(tmp_path).items():
        if var.startswith("WANDB_"):
            monkeypatch.setenv(var, value)
    monkeypatch.delenv("WANDB_MODE", raising=False)


def leet(run_dir: Path, summary: bool):
    """The offline run as W&B's own reader prints it: one summary object, or every record."""
    args = ["--summary", "--json"] if summary else ["--json"]
    proc = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", *args, str(run_dir)],
                          capture_output=True, text=True, timeout=120, check=True)
    if summary:
        return json.loads(proc.stdout)
    return [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]


def only_run_dir(job_dir: Path) -> Path:
    runs = list((job_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs
    return runs[0]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """One offline sweep through the CLI: job 0 ok (2 KV heads), job 1 invalid (3 KV heads)."""
    tmp = tmp_path_factory.mktemp("tracking")
    sweep_dir = tmp / "multirun" / "2026-01-01" / "10-00-00"
    proc = subprocess.run([sys.executable, "-m", "kvbench.cli", "-m", *TINY, "wandb.mode=offline",
                           "wandb.tags=[ci]", "attention=gqa", "attention.num_kv_heads=2,3",
                           f"hydra.sweep.dir={sweep_dir}"],
                          cwd=tmp, env=wandb_env(tmp), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return sweep_dir, proc


@pytest.mark.e2e
def test_offline_run_holds_the_config_and_metrics_of_results_json(sweep):
    sweep_dir, _ = sweep
    rec = json.loads((sweep_dir / "0" / "results.json").read_text())
    assert rec["status"] == "ok", rec["error"]
    run = leet(only_run_dir(sweep_dir / "0"), summary=True)
    assert run["state"] == "finished" and run["project"] == "kvbench" and run["tags"] == ["ci"]
    # named by the swept key only; the other overrides (model=tiny, ...) are the same in every job
    assert run["name"] == "attention.num_kv_heads=2" == run_name(rec["overrides"], swept_keys(sweep_dir))
    config = run["config"]
    for key, value in flatten(rec["config"]).items():  # every resolved key, nested as in results.json
        assert lookup(config, key) == value, key
        assert "." not in key or key not in config, f"{key}: a flat dotted key"
    assert config["attention"] == {"type": "gqa", "num_kv_heads": 2} and config["model"]["head_dim"] == 8
    assert config["overrides"] == rec["overrides"]
    assert config["env"]["torch"] == rec["env"]["torch"] and config["env"]["device_type"] == "cpu"
    scalars = {k: v for k, v in rec["metrics"].items() if isinstance(v, (int, float, str)) and v is not None}
    assert {"decode_ms_p50", "tokens_per_s", "kv_cache_bytes", "prefill_ms"} <= set(scalars)
    for key, value in scalars.items():
        assert run["summary"][key] == value, key
    assert run["summary"]["status"] == "ok"


@pytest.mark.e2e
def test_offline_run_records_group_series_and_results_artifact(sweep):
    sweep_dir, _ = sweep
    rec = json.loads((sweep_dir / "0" / "results.json").read_text())
    records = leet(only_run_dir(sweep_dir / "0"), summary=False)
    run = next(r["run"] for r in records if r["type"] == "run")
    assert run["run_group"] == "2026-01-01_10-00-00" == sweep_group(sweep_dir)
    assert run["job_type"] == "decode"
    metrics = {r["metric"]["name"]: r["metric"] for r in records if r["type"] == "metric"}
    assert metrics["decode_ms"]["step_metric"] == "step"
    # summary goals: lower is better for times and KV bytes, higher for throughput; the summary
    # values themselves are the record's (test above)
    for key in ("decode_ms_p50", "decode_ms_p99", "prefill_ms", "kv_cache_bytes", "peak_rss_bytes"):
        assert metrics[key]["summary"] == {"min": True}, key
    assert metrics["tokens_per_s"]["summary"] == {"max": True}
    assert "decode_ms_p50_ci_low" not in metrics and "num_params" not in metrics
    history = [r["history"]["item"] for r in records if r["type"] == "history"]
    steps = [(h["step"], h["decode_ms"]) for h in history if "decode_ms" in h]
    assert steps == list(enumerate(rec["series"]["decode_ms"])) and len(steps) == 5
    artifact = next(r["artifact"] for r in records if r["type"] == "artifact")
    assert artifact["type"] == "results"
    (entry,) = artifact["manifest"]["contents"]
    body = (sweep_dir / "0" / "results.json").read_bytes()
    assert entry["path"] == "results.json"
    assert entry["digest"] == base64.b64encode(hashlib.md5(body).digest()).decode()


@pytest.mark.e2e
def test_invalid_job_is_tracked_with_its_status_and_the_sweep_report_lists_it(sweep):
    sweep_dir, proc = sweep
    run = leet(only_run_dir(sweep_dir / "1"), summary=True)
    assert run["summary"]["status"] == "invalid" and "attention.num_kv_heads=3" in run["summary"]["error"]
    rows = list(csv.DictReader((sweep_dir / "summary.csv").open()))
    assert [(r["job"], r["status"], r["attention.num_kv_heads"]) for r in rows] == \
        [("0", "ok", "2"), ("1", "invalid", "3")]
    ok = json.loads((sweep_dir / "0" / "results.json").read_text())
    assert float(rows[0]["decode_ms_p50"]) == ok["metrics"]["decode_ms_p50"]
    assert f"report: {sweep_dir / 'summary.md'}" in proc.stdout
    assert "W&B tracking failed" not in proc.stdout + proc.stderr


def make_result(job_dir: Path) -> RunResult:
    result = RunResult("ok", {"attention": {"type": "gqa", "num_kv_heads": 2}, "workload": {"name": "multiturn"}},
                       metrics={"prefill_ms": 3.5, "kv_cache_bytes": 4096, "nvml_reason": "device is cpu"},
                       series={"decode_ms": [1.0, 2.0]}, overrides=["cache.shared=true"],
                       tables={"turns": [{"turn": 0, "ttft_ms": 9.5},
                                         {"turn": 1, "ttft_ms": 1.25, "context_len": 40}]})
    result.write(job_dir)
    return result


@pytest.mark.e2e
def test_per_turn_table_is_a_wandb_table(tmp_path, in_process_wandb):
    result = make_result(tmp_path)
    run_dir = track(result, {"mode": "offline", "project": "kvbench", "group": "mine"}, tmp_path)
    assert run_dir is not None and run_dir.parent == tmp_path / "wandb"
    (table_file,) = (run_dir / "files" / "media" / "table").glob("turns_*.table.json")
    table = json.loads(table_file.read_text())
    assert table["columns"] == ["turn", "ttft_ms", "context_len"]
    assert table["data"] == [[0, 9.5, None], [1, 1.25, 40]]
    records = leet(run_dir, summary=False)
    run = next(r["run"] for r in records if r["type"] == "run")
    assert run["run_group"] == "mine" and run["job_type"] == "multiturn"
    assert run["display_name"] == "gqa kv=2 multiturn"  # a single run: its choices, not its overrides
    # the table's rows are also history against the turn index
    metrics = {r["metric"]["name"]: r["metric"] for r in records if r["type"] == "metric"}
    assert metrics["turns/ttft_ms"]["step_metric"] == "turn" and metrics["turns/context_len"]["step_metric"] == "turn"
    history = [r["history"]["item"] for r in records if r["type"] == "history"]
    assert [(h["turn"], h["turns/ttft_ms"]) for h in history if "turns/ttft_ms" in h] == [(0, 9.5), (1, 1.25)]
    assert [(h["turn"], h["turns/context_len"]) for h in history if "turns/context_len" in h] == [(1, 40)]


@pytest.mark.e2e
def test_serving_series_are_against_time_and_the_rate_curve_against_rate(tmp_path, in_process_wandb):
    result = RunResult("ok", {"attention": {"type": "mqa", "num_kv_heads": 1}, "workload": {"name": "serving"}},
                       metrics={"max_rate_under_slo": 5.5, "goodput": 4.0, "ttft_ms_p99": 120.0},
                       series={"serving_t_s": [0.0, 0.25, 0.5], "serving_running": [1, 3, 2]},
                       tables={"serving_rate_curve": [{"rate": 2.0, "ttft_ms_p99": 50.0, "ok": True},
                                                      {"rate": 5.5, "ttft_ms_p99": 240.0, "ok": True}]})
    result.write(tmp_path)
    run_dir = track(result, {"mode": "offline", "project": "kvbench"}, tmp_path)
    records = leet(run_dir, summary=False)
    metrics = {r["metric"]["name"]: r["metric"] for r in records if r["type"] == "metric"}
    assert metrics["serving_running"]["step_metric"] == "serving_t_s"
    assert metrics["serving_rate_curve/ttft_ms_p99"]["step_metric"] == "rate"
    history = [r["history"]["item"] for r in records if r["type"] == "history"]
    assert [(h["serving_t_s"], h["serving_running"]) for h in history if "serving_running" in h] == [
        (0.0, 1), (0.25, 3), (0.5, 2)]
    assert [(h["rate"], h["serving_rate_curve/ttft_ms_p99"]) for h in history
            if "serving_rate_curve/ttft_ms_p99" in h] == [(2.0, 50.0), (5.5, 240.0)]
    assert leet(run_dir, summary=True)["summary"]["max_rate_under_slo"] == 5.5


@pytest.mark.e2e
@pytest.mark.parametrize("where", ["init", "log"])
def test_a_wandb_failure_only_warns(where, tmp_path, in_process_wandb, monkeypatch, caplog):
    import wandb
    from wandb.sdk.wandb_run import Run

    result = make_result(tmp_path)
    before = (tmp_path / "results.json").read_bytes()

    def boom(*args, **kwargs):
        raise RuntimeError(f"injected at {where}")

    monkeypatch.setattr(wandb, "init", boom) if where == "init" else monkeypatch.setattr(Run, "log", boom)
    with caplog.at_level(logging.WARNING, logger="kvbench.tracking"):
        assert track(result, {"mode": "offline"}, tmp_path) is None
    assert f"W&B tracking failed at {where}: RuntimeError: injected at {where}" in caplog.text
    assert (tmp_path / "results.json").read_bytes() == before
    assert read_record(tmp_path).status == "ok"
    assert wandb.run is None  # the run was finished, nothing leaks into the next job
    if where == "log":
        assert leet(only_run_dir(tmp_path), summary=True)["exit_code"] == 1


def test_online_without_credentials_warns_and_keeps_the_run_offline(tmp_path, in_process_wandb, monkeypatch,
                                                                     caplog):
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    with caplog.at_level(logging.WARNING, logger="kvbench.tracking"):
        run_dir = track(make_result(tmp_path), {"mode": "online"}, tmp_path)
    assert "W&B online failed (RuntimeError: no credentials" in caplog.text and "wandb login" in caplog.text
    assert run_dir is not None and run_dir.parent == tmp_path / "wandb" and run_dir.name.startswith("offline-run-")
    assert f"the run is kept offline; upload later with `wandb sync {run_dir}`" in caplog.text


class SilentServer:
    """A W&B "server" that accepts connections and never answers (a network that drops packets
    looks the same to wandb.init); ``connections`` counts them."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.connections = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                self.connections.append(self.sock.accept()[0])
            except OSError:  # closed at the end of the test
                return

    def close(self):
        self.sock.close()
        for conn in self.connections:
            conn.close()


@pytest.fixture
def unreachable_server(monkeypatch):
    """A :class:`SilentServer` W&B is pointed at, with a key that needs no login; its connections."""
    server = SilentServer()
    monkeypatch.setenv("WANDB_BASE_URL", server.url)
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    yield server.connections
    server.close()


def test_online_reads_the_environment_of_now_not_of_an_earlier_wandb_setup(tmp_path, in_process_wandb, monkeypatch):
    """W&B set up earlier in the process (by another library, another test) keeps the settings of
    that moment: the online attempt must still try the server WANDB_BASE_URL names now."""
    import wandb

    monkeypatch.delenv("WANDB_BASE_URL", raising=False)
    wandb.setup()  # its base URL: W&B's default
    server = SilentServer()
    monkeypatch.setenv("WANDB_BASE_URL", server.url)
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    try:
        run_dir = track(make_result(tmp_path / "0"), {"mode": "online", "init_timeout_s": 2.0}, tmp_path / "0",
                        tmp_path)
        assert server.connections, "wandb tried another server than WANDB_BASE_URL's"
        assert run_dir is not None and run_dir.name.startswith("offline-run-")
    finally:
        server.close()
        wandb.teardown()


def test_online_without_a_network_waits_init_timeout_once_per_sweep(tmp_path, in_process_wandb,
                                                                     unreachable_server, caplog, monkeypatch):
    """W&B's own wait is 90 s per job. The first job waits wandb.init_timeout_s, writes its run
    offline and says so; the sweep's later jobs go offline at once, without a word; a new
    sweep into the same directory tries again."""
    sweep = tmp_path / "sweep"
    cfg = {"mode": "online", "init_timeout_s": 2.0}
    with caplog.at_level(logging.WARNING, logger="kvbench.tracking"):
        first = track(make_result(sweep / "0"), cfg, sweep / "0", sweep)
    assert unreachable_server, "wandb never tried the server"
    assert "W&B online failed (CommError" in caplog.text and "every later run of this sweep" in caplog.text
    assert first is not None and first.parent == sweep / "0" / "wandb" and first.name.startswith("offline-run-")
    assert (sweep / UNREACHABLE_MARKER).is_file()
    assert read_record(sweep / "0").status == "ok"

    caplog.clear()
    # The later job is pointed at a server of its own, so a late retry of the first job's (its
    # service may still be closing under load) cannot be counted as the second one's.
    later = SilentServer()
    monkeypatch.setenv("WANDB_BASE_URL", later.url)
    try:
        with caplog.at_level(logging.WARNING, logger="kvbench.tracking"):
            second = track(make_result(sweep / "1"), cfg, sweep / "1", sweep)
    finally:
        later.close()
    assert second is not None and second.name.startswith("offline-run-") and second.parent == sweep / "1" / "wandb"
    assert later.connections == [] and caplog.text == ""
    new_sweep(sweep)
    assert not (sweep / UNREACHABLE_MARKER).exists()


@pytest.mark.e2e
def test_disabled_mode_writes_nothing_and_never_imports_wandb(tmp_path):
    code = ("import sys; from pathlib import Path; from kvbench.results import read_record; "
            "from kvbench.sinks.tracking import track; "
            f"r = read_record({str(tmp_path)!r}); "
            f"assert track(r, {{'mode': 'disabled'}}, Path({str(tmp_path)!r})) is None; "
            "assert 'wandb' not in sys.modules, 'wandb imported'")
    make_result(tmp_path)
    proc = subprocess.run([sys.executable, "-c", code], env=wandb_env(tmp_path), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json"]


def test_sweep_group_and_run_name():
    assert sweep_group("multirun/2026-11-29/08-50-00") == "2026-11-29_08-50-00"
    assert sweep_group("/data/sweeps/kv_study") == "kv_study" and sweep_group(None) is None
    overrides = ["model=tiny", "attention=mqa", "workload.batch_size=2", "wandb.mode=offline"]
    assert run_name(overrides, ["attention", "workload.batch_size"]) == "attention=mqa workload.batch_size=2"
    config = {"model": {"name": "tiny"}, "attention": {"type": "mqa", "num_kv_heads": 1},
              "workload": {"name": "decode"}}
    assert run_name(overrides, [], config) == "tiny mqa kv=1 decode" == short_name(config)
    assert short_name({"task": "train", "model": {"name": "tiny"}}) == "tiny train"
    assert run_name([]) == "defaults" and swept_keys(None) == [] and swept_keys("/no/such/dir") == []


@pytest.mark.e2e
def test_swept_keys_are_the_sweep_overrides_hydra_saved(sweep):
    sweep_dir, _ = sweep
    assert swept_keys(sweep_dir) == ["attention.num_kv_heads"]  # not model=tiny, attention=gqa, ...


def registry_units() -> RecordView:
    """A view whose units are the registry's, every task's (patterns too: ``turn<k>_ttft_ms``)."""
    from kvbench.jobs.runner import task_metrics

    declared = {}
    for task, workload in [("bench", "decode"), ("bench", "multiturn"), ("capacity", "decode"), ("train", "decode"),
                           ("eval", "decode"), ("compare", "decode"), ("recall", "decode"), ("bench", "serving")]:
        declared.update(task_metrics(task, workload))
    return RecordView({"schema_version": 2, "units": {name: m.unit for name, m in declared.items()}})


def test_metric_goal():
    units = registry_units()

    def metric_goal(key):  # the goal of a metric of the registry's unit
        return tracking.metric_goal(key, units.unit(key))

    lower = ("decode_ms_p50", "prefill_ms", "turn1_ttft_ms", "decode_us_per_1k_ctx", "kv_cache_bytes_formula",
             "peak_rss_bytes", "energy_mj", "perplexity")
    assert [metric_goal(k) for k in lower] == ["min"] * len(lower)
    assert [metric_goal(k) for k in ("tokens_per_s", "tokens_per_s_longest", "max_batch_longest")] == ["max"] * 3
    assert [metric_goal(k) for k in ("max_rate_under_slo", "goodput", "output_throughput")] == ["max"] * 3
    assert [metric_goal(k) for k in ("ttft_ms_p99", "tpot_ms_mean", "max_rate_under_slo_reason")] == [
        "min", "min", None]
    assert [metric_goal(k) for k in ("decode_ms_p50_ci_low", "tokens_per_s_n", "num_params", "weight_bytes",
                                     "percent_of_peak")] == [None] * 5
    # the unit decides, not the name: a metric named like a time but counted in tokens has no goal
    assert tracking.metric_goal("prefill_ms", "tokens") is None and tracking.metric_goal("x", "ms") == "min"


def test_the_run_config_holds_each_metrics_unit_from_the_record():
    result = RunResult(status="ok", config={"attention": {"type": "mqa", "num_kv_heads": 1}},
                       metrics={"decode_ms_p50": 1.0, "kv_cache_bytes": 64, "noisy": False, "gone": None},
                       units={"decode_ms_p50": "ms", "kv_cache_bytes": "bytes", "noisy": "bool", "gone": "ms"})
    config = run_config(result)
    assert config["units"] == {"decode_ms_p50": "ms", "kv_cache_bytes": "bytes", "noisy": "bool"}  # null: unsummarised
    assert config["attention"] == {"type": "mqa", "num_kv_heads": 1}
    # a schema-1 record: the unit is its methods line's head
    old = RunResult(status="ok", config={}, metrics={"prefill_ms": 2.0}, methods={"prefill_ms": "ms; prefill"},
                    schema_version=1)
    assert run_config(old)["units"] == {"prefill_ms": "ms"}
