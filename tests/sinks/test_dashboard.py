"""The sweep's W&B workspace, built without a network from a real tiny-model sweep: its panels
name exactly the sweep's varying axes and metrics, in the form W&B stores the runs kvbench
made (read back from the offline runs with ``wandb leet``); publishing without credentials is
one line and loses nothing. Nothing about wandb_workspaces is mocked and nothing is saved."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_tracking import leet, only_run_dir, wandb_env

from kvbench.cli_sweep import _dashboard
from kvbench.cli_tools import dashboard_main
from kvbench.results import RunResult, flatten, lookup
from kvbench.sinks.dashboard import WORKSPACE_JSON, WORKSPACE_MD, build, publish_commands
from kvbench.sinks.report import collect
from kvbench.sinks.tracking import track

TINY = ["model=tiny", "workload.prompt_len=8", "workload.gen_len=3", "runtime.warmup=0", "runtime.repeats=1",
        "runtime.isolate=false", "runtime.fidelity=false"]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """attention x batch size, offline W&B, through the CLI: 4 jobs."""
    tmp = tmp_path_factory.mktemp("dashboard")
    sweep_dir = tmp / "multirun" / "2026-02-02" / "10-00-00"
    proc = subprocess.run([sys.executable, "-m", "kvbench.cli", "-m", *TINY, "wandb.mode=offline",
                           "attention=mha,mqa", "workload.batch_size=1,2", f"hydra.sweep.dir={sweep_dir}"],
                          cwd=tmp, env=wandb_env(tmp), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return sweep_dir, proc


def varying_keys(sweep_dir: Path) -> set:
    """The reference: config keys whose value differs across the sweep's results.json."""
    configs = [flatten(json.loads(p.read_text())["config"]) for p in sorted(sweep_dir.glob("*/results.json"))]
    assert len(configs) == 4
    return {k for k in configs[0] if not k.startswith("wandb.") and len({repr(c.get(k)) for c in configs}) > 1}


def references(view: dict):
    """(config keys, summary metrics, history (x, y)) the saved spec refers to, in W&B's own key
    forms (``config:a.value.b``, ``summary:m``, grouping ``{section, name}``) turned back into
    the run's config paths."""
    config, summary, history = set(), set(), set()

    def from_config(name: str) -> str:
        first, _, rest = name.partition(".value")
        return first + rest

    section = view["spec"]["section"]
    for panel_section in section["panelBankConfig"]["sections"]:
        for panel in panel_section["panels"]:
            cfg = panel["config"]
            accessors = [c["accessor"] for c in cfg.get("columns", [])] + [cfg[a] for a in ("xAxis", "yAxis")
                                                                           if a in cfg and ":" in cfg[a]]
            for accessor in accessors:
                kind, _, name = accessor.partition(":")
                (config.add(from_config(name)) if kind == "config" else summary.add(name))
            if panel["viewType"] == "Bar Chart":
                summary.update(cfg["metrics"])
                config.add(from_config(cfg["groupBy"]))
            if panel["viewType"] == "Run History Line Plot":
                history.update((cfg["xAxis"], y) for y in cfg["metrics"])
    grouping = {from_config(g["name"]) for rs in section["runSets"] for g in rs["grouping"]}
    return config, summary, history, grouping


@pytest.mark.e2e
def test_the_sweep_writes_a_workspace_whose_panels_match_its_runs(sweep):
    sweep_dir, proc = sweep
    assert f"workspace: {sweep_dir / WORKSPACE_MD}" in proc.stdout
    assert "publish it to W&B with:\n" + "".join(f"  {c}\n" for c in publish_commands(sweep_dir)) in proc.stdout
    assert f"wandb sync {sweep_dir}/*/wandb/offline-run-*" in proc.stdout
    view = json.loads((sweep_dir / WORKSPACE_JSON).read_text())
    config, summary, history, grouping = references(view)
    varying = varying_keys(sweep_dir)
    assert varying == {"attention.type", "attention.num_kv_heads", "workload.batch_size"}
    assert config == varying  # every varying axis, and nothing that does not vary
    assert grouping == {"attention.type", "attention.num_kv_heads"}  # runs grouped by variant
    jobs = sorted(p.parent for p in sweep_dir.glob("*/results.json"))
    runs = [leet(only_run_dir(job), summary=True) for job in jobs]
    for job, run in zip(jobs, runs):  # each key as W&B holds it: nested config, summary by metric name
        for key in config | grouping:
            assert lookup(run["config"], key) == lookup(json.loads((job / "results.json").read_text())["config"], key)
    for metric in summary:  # a metric some job has (peak RSS is left out of jobs after the first in-process)
        assert any(isinstance(run["summary"].get(metric), (int, float)) for run in runs), metric
    assert {"decode_ms_p50", "decode_ms_p99", "prefill_ms", "kv_cache_bytes", "kv_cache_bytes_formula",
            "tokens_per_s"} <= summary
    assert history == {("step", "decode_ms")}
    records = leet(only_run_dir(sweep_dir / "0"), summary=False)
    assert {r["metric"]["name"]: r["metric"].get("step_metric") for r in records
            if r["type"] == "metric"}["decode_ms"] == "step"
    group = next(r["run"] for r in records if r["type"] == "run")["run_group"]
    (runset,) = view["spec"]["section"]["runSets"]
    assert runset["filters"]["filters"] == [{"key": {"section": "run", "name": "group"}, "op": "=", "value": group,
                                             "disabled": False}]
    assert view["spec"]["section"]["settings"]["shouldAutoGeneratePanels"] is False
    md = (sweep_dir / WORKSPACE_MD).read_text()
    assert f"runs of group `{group}`" in md and "scatter: `decode_ms_p50` against config `workload.batch_size`" in md


@pytest.mark.e2e
def test_the_spec_is_the_libraries_model_and_loads_back(sweep):
    from wandb_workspaces.workspaces import Workspace, internal

    sweep_dir, _ = sweep
    view = json.loads((sweep_dir / WORKSPACE_JSON).read_text())
    loaded = Workspace._from_model(internal.View.model_validate(view))
    assert [s.name for s in loaded.sections] == ["Sweep", "Latency", "Memory", "Throughput"]
    assert loaded.project == "kvbench" and loaded.settings.max_runs == 10


@pytest.mark.e2e
def test_dashboard_without_credentials_is_one_line_and_loses_nothing(sweep, tmp_path, monkeypatch, capsys):
    sweep_dir, _ = sweep
    for var, value in wandb_env(tmp_path).items():
        if var.startswith("WANDB_"):
            monkeypatch.setenv(var, value)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    before = {p: p.read_bytes() for p in sweep_dir.glob("*/results.json")}
    spec = (sweep_dir / WORKSPACE_JSON).read_text()
    assert dashboard_main([str(sweep_dir)]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("kvbench-dashboard: not created on W&B: UsageError")
    assert f"the spec is in {sweep_dir / WORKSPACE_JSON}" in err
    assert {p: p.read_bytes() for p in before} == before
    rebuilt = json.loads((sweep_dir / WORKSPACE_JSON).read_text())
    assert references(rebuilt) == references(json.loads(spec))  # rebuilt from the records, same panels
    assert dashboard_main([str(tmp_path / "nothing")]) == 2

    # an online sweep's end: one warning, then the command that creates it later (runs are online)
    rows = [{**r, "config": {**r["config"], "wandb": {**r["config"]["wandb"], "mode": "online"}}}
            for r in collect(sweep_dir)]
    capsys.readouterr()
    _dashboard(sweep_dir, rows)
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and "W&B workspace not created: UsageError" in err
    assert f"kvbench-dashboard {sweep_dir}" in out and "wandb sync" not in out


@pytest.mark.e2e  # W&B's own reader (wandb leet) in an interpreter
def test_multiturn_panels_name_the_turn_history_tracking_logs(tmp_path, monkeypatch):
    for var, value in wandb_env(tmp_path).items():
        if var.startswith("WANDB_"):
            monkeypatch.setenv(var, value)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    config = {"model": {"name": "tiny"}, "attention": {"type": "gqa", "num_kv_heads": 2},
              "workload": {"name": "multiturn"}, "wandb": {"mode": "offline", "group": "chat"}}
    result = RunResult("ok", config, metrics={"turn1_ttft_ms": 9.5, "kv_cache_bytes": 4096},
                       tables={"turns": [{"turn": 0, "ttft_ms": 9.5, "kv_cache_bytes": 2048},
                                         {"turn": 1, "ttft_ms": 1.25, "kv_cache_bytes": 4096}]})
    result.write(tmp_path)
    run_dir = track(result, config["wandb"], tmp_path)
    logged = {k for r in leet(run_dir, summary=False) if r["type"] == "history" for k in r["history"]["item"]}
    board = build([result.to_dict()])
    (turns,) = [s for s in board.workspace.sections if s.name == "Multi-turn"]
    lines = [p for p in turns.panels if type(p).__name__ == "LinePlot"]
    assert {(p.x, *p.y) for p in lines} == {("turn", "turns/ttft_ms"), ("turn", "turns/kv_cache_bytes")}
    assert all({p.x, *p.y} <= logged for p in lines)
    assert type(turns.panels[-1]).__name__ == "WeavePanelSummaryTable" and turns.panels[-1].table_name == "turns"
    assert board.group == "chat" and board.axes == []


def test_bars_group_by_the_variant_axis_that_tells_the_variants_apart():
    def rec(kind, kv, batch):
        config = {"attention": {"type": kind, "num_kv_heads": kv}, "workload": {"batch_size": batch},
                  "wandb": {"mode": "offline"}}
        return {"status": "ok", "config": config, "metrics": {"decode_ms_p50": 1.0, "tokens_per_s": 9.0 * kv}}

    def bar_groups(records):
        return {p.groupby.name for _, p in build(records, "multirun/x").panels() if type(p).__name__ == "BarPlot"}

    one_to_one = [rec(k, kv, b) for k, kv in (("mha", 8), ("mqa", 1)) for b in (1, 4)]
    assert bar_groups(one_to_one) == {"attention.type"}  # the same split twice: once, by name
    gqa = [rec(k, kv, 1) for k, kv in (("mha", 8), ("gqa", 4), ("gqa", 2), ("mqa", 1))]
    assert bar_groups(gqa) == {"attention.num_kv_heads"}  # "gqa" would pool kv=4 and kv=2
    board = build(one_to_one, "multirun/x")
    scatters = {(p.x.name, p.y.name) for _, p in board.panels() if type(p).__name__ == "ScatterPlot"}
    assert scatters == {("workload.batch_size", "decode_ms_p50"), ("workload.batch_size", "tokens_per_s")}
    assert board.group == "x" and [s.name for s in board.workspace.sections] == ["Sweep", "Latency", "Throughput"]


def test_a_chart_holds_one_unit_read_from_the_records():
    def rec(kind, kv, p99_unit="ms"):
        return {"status": "ok", "schema_version": 2,
                "config": {"attention": {"type": kind, "num_kv_heads": kv}, "wandb": {"mode": "offline"}},
                "metrics": {"decode_ms_p50": 1.0 * kv, "decode_ms_p99": 2.0 * kv, "kv_cache_bytes": 64 * kv},
                "units": {"decode_ms_p50": "ms", "decode_ms_p99": p99_unit, "kv_cache_bytes": "bytes"}}

    def bars(records):
        return {p.title: list(p.metrics) for _, p in build(records, "multirun/x").panels()
                if type(p).__name__ == "BarPlot"}

    assert bars([rec("mha", 8), rec("mqa", 1)]) == {
        "decode_ms_p50, decode_ms_p99 (ms) by attn": ["decode_ms_p50", "decode_ms_p99"],
        "kv_cache_bytes (bytes) by attn": ["kv_cache_bytes"]}
    # a family whose records give its members two units is two charts, each titled by its unit
    assert bars([rec("mha", 8, "µs"), rec("mqa", 1, "µs")]) == {
        "decode_ms_p50 (ms) by attn": ["decode_ms_p50"], "decode_ms_p99 (µs) by attn": ["decode_ms_p99"],
        "kv_cache_bytes (bytes) by attn": ["kv_cache_bytes"]}


def test_a_hybrids_state_per_sequence_is_charted_beside_the_bytes_per_token():
    """experiment=choose's records: a Gated DeltaNet hybrid's state per sequence is a bar beside
    the bytes per token, in the one bytes chart of the Memory section."""
    def rec(layer_types, state):
        config = {"task": "capacity", "attention": {"type": "gqa", "num_kv_heads": 2, "layer_types": layer_types},
                  "wandb": {"mode": "offline"}}
        return {"status": "ok", "schema_version": 2, "config": config,
                "metrics": {"kv_bytes_per_token": 1536.0 if state else 4096.0, "kv_state_bytes_per_sequence": state,
                            "max_batch_longest": 45 if state else 8},
                "units": {"kv_bytes_per_token": "bytes", "kv_state_bytes_per_sequence": "bytes",
                          "max_batch_longest": "sequences"}}

    board = build([rec(None, 0), rec(["linear_attention"] * 3 + ["full_attention"], 135_168)], "multirun/x")
    memory = [p for section, p in board.panels() if section == "Memory" and type(p).__name__ == "BarPlot"]
    assert [list(p.metrics) for p in memory] == [["kv_bytes_per_token", "kv_state_bytes_per_sequence"]]
    # the two differ only in their layer pattern, GQA's None (every layer full) a value of its own
    assert memory[0].title == "kv_bytes_per_token, kv_state_bytes_per_sequence (bytes) by attention.layer_types"
