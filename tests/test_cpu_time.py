"""--cpu-times (tests/cpu_time.py): a test's CPU seconds are the process's CPU time across its run,
and the summary's totals are the sums of what the processes wrote."""

import json
import time
from types import SimpleNamespace

import cpu_time
import pytest


def _burn(seconds: float) -> float:
    """Spend about ``seconds`` of this process's CPU; returns what process_time saw spent."""
    start = time.process_time()
    while time.process_time() - start < seconds:
        sum(range(1000))
    return time.process_time() - start


def test_a_test_is_charged_the_cpu_time_its_run_spends(monkeypatch):
    monkeypatch.setattr(cpu_time, "_tests", {})
    run = cpu_time.pytest_runtest_protocol(SimpleNamespace(nodeid="tests/x.py::t"), None)
    next(run)
    spent = _burn(0.02)
    time.sleep(0.3)  # waiting costs no CPU: not charged
    with pytest.raises(StopIteration):
        next(run)
    assert spent <= cpu_time._tests["tests/x.py::t"] < spent + 0.15


def test_the_summary_sums_every_processs_tests_files_and_fixtures(tmp_path):
    (tmp_path / "gw0.json").write_text(json.dumps({
        "tests": {"tests/a.py::t1": 1.0, "tests/b.py::t1": 0.25}, "fixtures": [["model", "module", 0.75]],
        "total": 3.0}))
    (tmp_path / "gw1.json").write_text(json.dumps({
        "tests": {"tests/a.py::t2": 2.0}, "fixtures": [["model", "module", 0.5], ["tmp_path", "function", 0.125]],
        "total": 4.5}))
    text = cpu_time.summary(tmp_path)
    assert text.splitlines()[0] == "7.5 s of CPU in all processes; 3.2 s in 3 tests (1083 ms a test)"
    assert "     3.0 s     2 tests  tests/a.py" in text and "     0.2 s     1 tests  tests/b.py" in text
    assert "     1.2 s  model (module)" in text and "     0.1 s  tmp_path (function)" in text
    assert text.index("tests/a.py::t2") < text.index("tests/a.py::t1") < text.index("tests/b.py::t1")
