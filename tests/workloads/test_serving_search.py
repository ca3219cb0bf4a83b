"""workload=serving workload.search.enabled=true: its keys checked where they enter, and the search run
in process on model=tiny (wall clock, a handful of requests, rates high enough not to wait long)."""

import pytest
import torch
from conftest import compose

from kvbench.config import to_bench_config
from kvbench.config_errors import ConfigError
from kvbench.jobs.runner import task_metrics
from kvbench.results import RunResult
from kvbench.tasks.common import build_model
from kvbench.workloads import serving_search

BASE = ("model=tiny", "workload=serving", "workload.num_requests=4", "workload.kv_budget_mb=1",
        "workload.prompt.dist=fixed", "workload.prompt.mean=16", "workload.output.dist=fixed",
        "workload.output.mean=4", "runtime.warmup=0")


def config(*overrides):
    return to_bench_config(compose(*BASE, "workload.search.enabled=true", *overrides))


@pytest.mark.parametrize("overrides, key", [
    (("workload.search.max_rate=0.1",), "workload.search.max_rate=0.1"),
    (("workload.search.growth=1",), "workload.search.growth=1"),
    (("workload.search.max_runs=1",), "workload.search.max_runs=1"),
    ((), "slo.name='none'"),  # no target to search against
    (("slo.ttft_ms=100", "workload.num_requests=null", "workload.duration_s=2"), "workload.num_requests=None"),
    (("slo.ttft_ms=100", "slo.tpot_x_batch1=2"), "slo.tpot_x_batch1=2"),
])
def test_bad_search_keys_are_one_line_naming_the_key(overrides, key):
    with pytest.raises(ConfigError) as err:
        config(*overrides)
    assert str(err.value).startswith(key) and "\n" not in str(err.value)


def test_a_search_outside_serving_and_e2e_in_capacity_are_refused():
    with pytest.raises(ConfigError, match=r"^workload.search.enabled=True: searches the rate of task=bench"):
        to_bench_config(compose("model=tiny", "task=capacity", "slo.ttft_ms=10", "+workload.search.enabled=true"))
    with pytest.raises(ConfigError, match=r"^slo.e2e_ms=5.0: task=capacity judges TTFT and TPOT only"):
        to_bench_config(compose("model=tiny", "task=capacity", "slo.e2e_ms=5"))


def test_every_search_metric_is_declared_for_workload_serving():
    declared = task_metrics("bench", "serving")
    for name in ("max_rate_under_slo", "max_rate_bound", "serving_recorded_rate", "tables.serving_rate_curve",
                 "ttft_ms_p99", "goodput"):
        assert name in declared and declared[name].method


def search(*overrides):
    cfg = config("runtime.threads=1", *overrides)
    torch.set_num_threads(1)
    model = build_model(cfg, torch.device("cpu"))
    result = RunResult(status="ok", config={})
    serving_search.run(cfg, model, torch.device("cpu"), result)
    return result


def test_an_slo_failing_at_the_lowest_rate_records_that_run_and_says_why():
    r = search("slo.ttft_ms=0.000001", "workload.search.min_rate=100", "workload.search.max_rate=400")
    m = r.metrics
    assert m["max_rate_under_slo"] is None and "fails even at the lowest rate" in m["max_rate_under_slo_reason"]
    assert (m["max_rate_probes"], m["max_rate_failed_at"], m["serving_recorded_rate"]) == (1, 100, 100)
    assert m["max_rate_confirmed"] is None and m["slo_met"] is False
    (row,) = r.tables["serving_rate_curve"]
    assert row["rate"] == 100 and row["ok"] is False and row["violated"] == "ttft_ms"
    assert m["requests_finished"] == 4 and len(r.tables["serving_requests"]) == 4  # the recorded run's timeline


def test_an_slo_that_never_binds_is_a_lower_bound_over_the_rates_run():
    r = search("slo.ttft_ms=1000000", "workload.search.min_rate=100", "workload.search.max_rate=300")
    m = r.metrics
    assert m["max_rate_under_slo"] is None and m["max_rate_at_least"] == 300 and "never binds" in \
        m["max_rate_under_slo_reason"]
    assert [row["rate"] for row in r.tables["serving_rate_curve"]] == [100, 200, 300]
    assert all(row["ok"] and row["requests_finished"] == 4 for row in r.tables["serving_rate_curve"])
    assert m["serving_recorded_rate"] == 300 and "max_rate_under_slo" in r.methods
