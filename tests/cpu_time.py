"""CPU seconds per test, per file and per fixture: what a test costs, nearly whatever the machine's load.

Wall time on the shared 2-core machine moves with the other work on it (a suite took 139 s at load 2
and 1,600 s at load 12); the CPU time a process spends (``time.process_time``: every thread of it)
moves far less. With ``--cpu-times DIR`` each pytest process (the controller, each xdist worker)
writes DIR/<worker>.json at its end: every test's CPU seconds (setup, call and teardown, so a module
fixture counts in its first test), every fixture setup's, and the process's total (collection and
imports included). Compare two trees by their totals, measured in the same window:

    python -m pytest -m "not e2e" -n 2 --dist loadgroup --cpu-times /tmp/cpu
    python tests/cpu_time.py /tmp/cpu          # totals, the costliest files, fixtures and tests
"""

import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

_tests: dict = {}
_fixtures: list = []


def pytest_addoption(parser):
    parser.addoption("--cpu-times", metavar="DIR", default=None,
                     help="write each process's CPU seconds per test and per fixture to DIR (tests/cpu_time.py)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    start = time.process_time()
    yield
    _tests[item.nodeid] = time.process_time() - start


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef, request):
    start = time.process_time()
    yield
    _fixtures.append([fixturedef.argname, fixturedef.scope, time.process_time() - start])


def pytest_sessionfinish(session):
    out = session.config.getoption("cpu_times")
    if not out:
        return
    worker = getattr(session.config, "workerinput", {}).get("workerid", "controller")
    os.makedirs(out, exist_ok=True)
    Path(out, f"{worker}.json").write_text(json.dumps({"tests": _tests, "fixtures": _fixtures,
                                                       "total": time.process_time()}))


def summary(directory, top: int = 25) -> str:
    """The processes' total CPU seconds, then the ``top`` costliest files, fixtures (by name and
    scope, all their setups) and tests, from the DIR a run with --cpu-times wrote."""
    tests, fixtures, total = {}, Counter(), 0.0
    for path in sorted(Path(directory).glob("*.json")):
        run = json.loads(path.read_text())
        tests.update(run["tests"])
        for name, scope, seconds in run["fixtures"]:
            fixtures[f"{name} ({scope})"] += seconds
        total += run["total"]
    files, counts = Counter(), Counter()
    for nodeid, seconds in tests.items():
        files[nodeid.split("::")[0]] += seconds
        counts[nodeid.split("::")[0]] += 1
    lines = [f"{total:.1f} s of CPU in all processes; {sum(tests.values()):.1f} s in {len(tests)} tests "
             f"({1000 * sum(tests.values()) / max(1, len(tests)):.0f} ms a test)", "", "files:"]
    lines += [f"{s:8.1f} s {counts[f]:5d} tests  {f}" for f, s in files.most_common(top)]
    lines += ["", "fixtures (setup):"] + [f"{s:8.1f} s  {f}" for f, s in fixtures.most_common(top)]
    lines += ["", "tests:"] + [f"{s:8.2f} s  {t}" for t, s in sorted(tests.items(), key=lambda kv: -kv[1])[:top]]
    return "\n".join(lines)


if __name__ == "__main__":  # python tests/cpu_time.py DIR [TOP]
    if len(sys.argv) not in (2, 3):
        sys.exit("usage: python tests/cpu_time.py DIR [TOP]")
    print(summary(sys.argv[1], *(int(a) for a in sys.argv[2:])))
