"""Careless and hostile input to ``workload=serving`` and to what reads its records (round 4): sizes
a run or its record cannot hold, arrivals days away, traces that break a parser, a budget refused
late, records of another shape, markdown in a config value. Each is one line naming the key, the
file or the row, before the work it would waste, or a record left out with a line saying so."""

import json
import math
from dataclasses import replace

import pytest
from conftest import compose

from kvbench.config.serving import MAX_RECORD_BYTES as SERVING_RECORD_LIMIT
from kvbench.config.serving import MAX_SPAN_S, RECORD_BYTES_PER_REQUEST, RECORD_BYTES_PER_TOKEN
from kvbench.core.errors import ConfigError
from kvbench.footprint import check_fits, job_footprint
from kvbench.jobs.job_config import to_bench_config
from kvbench.jobs.runner import run_job
from kvbench.results import MAX_RECORD_BYTES, RunResult
from kvbench.serving import arrivals, scheduler
from kvbench.serving.arrivals import check_drawn, read_trace
from kvbench.sinks import console
from kvbench.sinks.choose import choices
from kvbench.sinks.report import MD_FILE, write_report
from kvbench.sinks.serving import curves, malformed, max_rates
from kvbench.tasks import bench
from kvbench.workloads.serving import arrival_note

SERVING = ["workload=serving", "model=tiny", "runtime.isolate=false", "wandb=disabled", "runtime.threads=1"]
SMALL = [*SERVING, "model.max_seq_len=256", "workload.num_requests=4", "workload.rate=50", "workload.prompt.mean=24",
         "workload.prompt.lo=8", "workload.prompt.hi=48", "workload.output.lo=2", "workload.output.hi=8"]


def refusal(*overrides):
    with pytest.raises(ConfigError) as err:
        to_bench_config(compose(*SERVING, *overrides))
    assert "\n" not in str(err.value)
    return str(err.value)


# ---- sizes a run or its record cannot hold: invalid naming the key, not oom ---------------------

@pytest.mark.parametrize("overrides, start", [
    (["workload.num_requests=10000000000"], "workload.num_requests=10000000000: "),
    (["workload.num_requests=null", "workload.duration_s=1e12"], "workload.duration_s=1000000000000.0: "),
    (["workload.num_requests=null", "workload.duration_s=3600"], "workload.duration_s=3600.0: at workload.rate=4"),
    (["workload.num_requests=20000"], "workload.num_requests=20000: "),
    (["workload.rate=1e-9"], "workload.rate=1e-09: 32 requests (workload.num_requests) at this rate arrive over"),
    (["workload.search.enabled=true", "slo.ttft_ms=100", "workload.search.lo=1e-6"], "workload.search.lo=1e-06: "),
    (["workload.prompt.cv=1e200"], "workload.prompt.cv=1e+200: must be <= 100"),
    (["workload.output.dist=lognormal", "workload.output.cv=1e200"], "workload.output.cv=1e+200: must be <= 100"),
])
def test_a_run_too_large_or_too_long_is_refused_naming_the_key(overrides, start):
    line = refusal(*overrides)
    assert line.startswith(start), line


def test_the_record_bound_is_what_results_json_is_read_back_at_and_a_real_record_fits_it(tmp_path):
    """The estimate (bytes per request and per output token) is what a record of the tiny model
    takes, one scheduler iteration per token (a CPU run): a record the check lets through can be
    read back."""
    assert SERVING_RECORD_LIMIT == MAX_RECORD_BYTES
    record = run_job(compose(*SMALL, "workload.rate=1000", "workload.kv_budget_mb=1"), tmp_path)
    assert record.status == "ok", record.error
    size = len(json.dumps(record.to_dict(), indent=2))
    tokens, requests = record.metrics["output_tokens"], record.metrics["requests"]
    assert size <= requests * RECORD_BYTES_PER_REQUEST + tokens * RECORD_BYTES_PER_TOKEN + 64_000  # + config, env


def test_a_sane_serving_config_passes():
    to_bench_config(compose(*SERVING))  # the defaults: 32 requests at 4 req/s
    to_bench_config(compose(*SERVING, "workload.num_requests=null", "workload.duration_s=600"))


@pytest.mark.parametrize("overrides, key", [
    (["workload.kv_budget_mb=1e9"], "workload.kv_budget_mb=1000000000.0"),
    (["workload.kv_budget_mb=null", "workload.kv_budget_blocks=1000000000000000"],
     "workload.kv_budget_blocks=1000000000000000 of cache.block_size=16 tokens"),
    (["workload.store=slots", "workload.kv_budget_mb=null", "workload.kv_budget_blocks=1000000000000"],
     "workload.kv_budget_blocks=1000000000000 slots"),
])
def test_a_kv_budget_larger_than_the_machine_is_invalid_before_anything_is_built(tmp_path, monkeypatch, overrides,
                                                                                  key):
    cfg = to_bench_config(compose(*SERVING, *overrides))
    assert job_footprint(cfg).kv_cache >= 1e15  # the store the budget asks for, allocated whole
    with pytest.raises(ConfigError, match="nothing was built") as err:
        check_fits(cfg, __import__("torch").device("cpu"))
    assert key in str(err.value)

    def never(*args, **kwargs):
        raise AssertionError("the model was built")

    monkeypatch.setattr(bench, "build_model", never)
    record = run_job(compose(*SERVING, *overrides), tmp_path)
    assert record.status == "invalid" and key in record.error  # it was oom (exit 3) after torch tried


# ---- arrivals days away, gaps that overflow: refused, never slept on -----------------------------

def _trace(tmp_path, text, name="trace.jsonl", encoding="utf-8"):
    path = tmp_path / name
    path.write_text(text, encoding=encoding)
    return str(path)


@pytest.mark.parametrize("arrival", ["1e300", "259200", "86400.5"])
def test_a_trace_arrival_past_a_day_is_one_line_naming_the_row(tmp_path, arrival):
    path = _trace(tmp_path, '{"arrival_s": 0, "prompt_len": 4, "output_len": 2}\n'
                            f'{{"arrival_s": {arrival}, "prompt_len": 4, "output_len": 2}}\n')
    with pytest.raises(ConfigError) as err:
        read_trace(path)
    line = str(err.value)
    assert line.startswith(f"workload.trace={path!r}: line 2: arrival_s=") and "a serving run may span" in line
    assert "\n" not in line  # it was an OverflowError (1e300), or days of silence


def test_drawn_arrivals_past_a_day_or_overflowing_are_refused_naming_the_key():
    w = to_bench_config(compose(*SERVING, "workload.arrival=gamma", "workload.burstiness=0.001")).workload
    for last in (1e6, math.inf, math.nan):
        with pytest.raises(ConfigError, match=r"^workload.burstiness=0.001: the drawn arrivals span"):
            check_drawn(w, last, 32, 1000)
    check_drawn(w, MAX_SPAN_S, 32, 1000)


def test_a_long_wait_is_said_as_the_run_starts_and_never_slept(tmp_path, monkeypatch):
    """Arrivals spread over minutes: the progress label says so (a run that waits is not silent);
    the scheduler's wall clock is replaced by the scripted one, so the test waits for nothing."""
    path = _trace(tmp_path, "arrival_s,prompt_len,output_len\n0,8,2\n7200,8,2\n", "trace.csv")
    assert arrival_note(read_trace(path)) == " (arrivals over ~2 h)"
    labels = []

    def progress(label, total):
        labels.append((label, total))
        return console.nullcontext(None)

    monkeypatch.setattr(scheduler, "WallClock", scheduler.FakeClock)
    record = run_job(compose(*SMALL, "workload.arrival=trace", f"workload.trace={path}"), tmp_path / "run",
                     progress=progress)
    assert record.status == "ok", record.error
    assert labels == [("mha kv=8 paged trace (arrivals over ~2 h)", 2)]


# ---- trace files that break a parser: one line naming the file and the row -----------------------

@pytest.mark.parametrize("text, name, needle", [
    ('{"a": ' * 100_000 + "1" + "}" * 100_000 + "\n", "deep.jsonl", "line 1: nested too deeply to parse"),
    ('{"arrival_s": 0, "prompt_len": 4, "output_len": 2}\n{"x": ' + "[" * 100_000 + "]" * 100_000 + "}\n",
     "deep2.jsonl", "line 2: nested too deeply to parse"),
    ("[" * 200_000 + "\n", "array.jsonl", "line 1: not CSV (field larger than field limit"),
    ('{"arrival_s": true, "prompt_len": 4, "output_len": 2}\n', "flag.jsonl", "line 1: arrival_s=True is not a number"),
    ("arrival_s,prompt_len,output_len\n0,4," + "9" * 5000 + "\n", "long.csv", "line 2: output_len='9999"),
    ('{"arrival_s": 0, "prompt_len": 4, "output_len": 100000000}\n', "huge.jsonl", "a results.json may hold"),
])
def test_a_trace_that_breaks_a_parser_is_one_short_line(tmp_path, text, name, needle):
    path = _trace(tmp_path, text, name)
    with pytest.raises(ConfigError) as err:
        read_trace(path)
    line = str(err.value)
    assert line.startswith(f"workload.trace={path!r}: ") and needle in line, line
    assert "\n" not in line and len(line) < 600  # a 5000-digit value is not repeated whole


def test_a_csv_trace_with_a_byte_order_mark_or_spaced_header_is_read(tmp_path):
    """Spreadsheets save UTF-8 with a BOM: it was read as part of the first column's name."""
    bom = _trace(tmp_path, "arrival_s,prompt_len,output_len\n0,4,2\n0.5,6,3\n", "bom.csv", encoding="utf-8-sig")
    spaced = _trace(tmp_path, "arrival_s, prompt_len, output_len\n0, 4, 2\n0.5, 6, 3\n", "spaced.csv")
    for path in (bom, spaced):
        assert [(r.arrival_s, r.prompt_len, r.output_len) for r in read_trace(path)] == [(0.0, 4, 2), (0.5, 6, 3)]


# ---- a budget too small: refused before the model is built or any progress shown -----------------

def test_a_budget_too_small_is_refused_before_the_build_and_any_progress(tmp_path, monkeypatch):
    shown, built = [], []
    monkeypatch.setattr(bench, "build_model", lambda *a, **k: built.append(1))

    def progress(label, total):
        shown.append(label)
        return console.nullcontext(None)

    record = run_job(compose(*SMALL, "workload.kv_budget_mb=0.01"), tmp_path, progress=progress)
    assert record.status == "invalid" and record.error.startswith("workload.kv_budget_mb=0.01: holds 0 blocks")
    assert shown == [] and built == []  # it was refused after "0/4" and "0/4 in 0.0 s"


# ---- records of another shape: left out with a line, never a traceback ---------------------------

def _serving(job, rate_cell, **metrics):
    rows = [{"rate": rate_cell, "ok": True, "ttft_ms_p99": 30.0, "tpot_ms_p99": 3.0},
            {"rate": 8.0, "ok": False, "ttft_ms_p99": 900.0, "tpot_ms_p99": 9.0}]
    return RunResult("ok", {"task": "bench", "model": {"name": "tiny"},
                            "attention": {"type": "mha", "num_kv_heads": 8},
                            "workload": {"name": "serving", "rate": 4.0}, "slo": {"ttft_ms": 500.0}},
                     metrics={"max_rate_under_slo": 4.0, "max_rate_failed_at": 8.0, "max_rate_probes": 2,
                              "max_rate_bound": "ttft_ms", **metrics},
                     tables={"serving_rate_curve": rows}, overrides=[f"job={job}"])


@pytest.mark.parametrize("plots", [False, True])
def test_serving_records_of_another_shape_are_left_out_with_a_line(tmp_path, plots):
    _serving(0, 4.0).write(tmp_path / "0")
    _serving(1, "fast").write(tmp_path / "1")  # a text rate: sorted against floats
    _serving(2, [1, 2]).write(tmp_path / "2")  # a list rate: hashed as a dict key
    _serving(3, 4.0, max_rate_under_slo="4 req/s").write(tmp_path / "3")  # formatted with :.3g
    _serving(4, True).write(tmp_path / "4")
    report = write_report(tmp_path, plots=plots)  # was a 19-26 line traceback in sinks/serving.py
    text = (tmp_path / MD_FILE).read_text()
    assert "4 serving records left out of the serving tables and plots" in text
    assert [r["job"] for r in max_rates(report.records, [])] == ["0"]
    assert malformed(report.records) == 4 and list(curves(report.records, [])[""]) == ["mha kv=8"]
    choices(report.records)  # the article's column reads the same records


# ---- markdown in a config value: text, never a live link ----------------------------------------

LINK = "[l](javascript:alert(1))"


def test_a_markdown_link_in_a_config_value_is_text_in_summary_md(tmp_path):
    for job, name in ((0, LINK), (1, "![i](https://x/y.png) \\[a](b)")):
        result = _serving(job, 4.0)
        result.config["model"]["name"] = name
        result.error = LINK
        result.write(tmp_path / str(job))
    RunResult("error", {"task": "bench", "model": {"name": LINK}}, error=f"boom {LINK}",
              overrides=[f"model.name={LINK}"]).write(tmp_path / "2")
    write_report(tmp_path, plots=False)
    text = (tmp_path / MD_FILE).read_text()
    assert "### model=[l\\](javascript:alert(1))" in text  # the serving panel's heading
    for line in text.splitlines():
        # every ]( of a value is escaped: no link, no image, and a \ of the value cannot undo it
        assert "](" not in line.replace("\\](", ""), line
    assert "![i\\](https://x/y.png) \\\\[a\\](b)" in text
    # as the docs site renders it (Python-Markdown, mkdocs' own): text, no link, no image
    import markdown

    page = markdown.markdown(text, extensions=["tables"])
    assert "<a " not in page and "<img" not in page and "[l](javascript:alert(1))" in page


def test_the_default_serving_run_warns_once_about_its_quantiles():
    """32 requests: every p99 is short of the 100 samples it needs. One line says so for all of
    them (it was four lines in the run's table)."""
    from kvbench.serving.metrics import timeline_metrics
    from kvbench.serving.trace import Request, RequestTrace, Timeline

    traces = [RequestTrace(Request(i, 0.1 * i, 8, 3), 0.1 * i, [0.1 * i + 0.01, 0.1 * i + 0.02, 0.1 * i + 0.03])
              for i in range(32)]
    m = timeline_metrics(Timeline(traces, [], 4.0, "paged", 16, 8, 8))
    warnings = {k: v for k, v in m.items() if k.endswith("_warning") and v}
    assert list(warnings) == ["quantiles_warning"]
    assert warnings["quantiles_warning"].startswith(
        "p99 of ttft_ms, tpot_ms, itl_ms, e2e_ms, queue_ms from 32/64 samples (a 99% quantile needs 100)")
    table = console.run_table({"status": "ok", "config": {"workload": {"name": "serving"}}, "metrics": m})
    with console.stdout.capture() as captured:
        console.stdout.print(table)
    assert captured.get().count("warning") == 1


def test_a_rate_search_is_checked_at_its_lowest_rate_and_its_highest():
    """A search runs the same requests from search.lo (the longest span) to search.hi (the most
    requests in a duration): both ends are bounded, whatever workload.rate says."""
    ok = to_bench_config(compose(*SERVING, "workload.search.enabled=true", "slo.ttft_ms=100"))
    assert ok.workload.search.lo == 0.5
    line = refusal("workload.search.enabled=true", "slo.ttft_ms=100", "workload.num_requests=null",
                   "workload.duration_s=600", "workload.search.hi=10000")
    assert line.startswith("workload.duration_s=600.0: at workload.search.hi=10000 req/s"), line


def test_drawn_requests_are_checked_as_drawn(monkeypatch):
    """The config's check uses means; the draw is checked again (the realised count and lengths)."""
    w = to_bench_config(compose(*SERVING)).workload
    monkeypatch.setattr(arrivals, "draw_lengths", lambda rng, n, dist: __import__("numpy").full(n, 10**7))
    with pytest.raises(ConfigError, match=r"^workload.num_requests=32: the drawn ~32 requests of ~1e\+07 output"):
        arrivals.make_requests(replace(w))


@pytest.mark.parametrize("attention", ["mha", "gqa", "mqa", "mla"])
def test_the_budget_checked_before_the_build_is_the_built_models(attention):
    """The early check (from the config) and the store (from the built model) size a token alike,
    so a budget the first lets through is never refused after the progress started."""
    import torch

    from kvbench.footprint import kv_bytes_per_token
    from kvbench.serving.paged import bytes_per_token
    from kvbench.tasks.common import build_model

    cfg = to_bench_config(compose(*SMALL, f"attention={attention}"))
    assert kv_bytes_per_token(cfg) == bytes_per_token(build_model(cfg, torch.device("cpu")))
