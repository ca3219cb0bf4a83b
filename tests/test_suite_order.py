"""The suite's order and spread (tests/suite_order.py): units longest first by the duration table,
a file's tests kept together on one worker under -n N --dist loadgroup, and the table read back
from a junit report."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import suite_order

HERE = Path(__file__).resolve().parent


class Item:
    """What the ordering reads of a collected pytest item."""

    def __init__(self, nodeid, e2e=False, module_fixture=False, group=None):
        self.nodeid, self.stash = nodeid, {}
        self.marks = {"e2e": pytest.mark.e2e.mark} if e2e else {}
        if group:
            self.marks["xdist_group"] = pytest.mark.xdist_group(group).mark
        scope = "module" if module_fixture else "function"
        self._fixtureinfo = type("Info", (), {"name2fixturedefs": {"f": [type("Def", (), {"scope": scope})]}})

    def get_closest_marker(self, name):
        return self.marks.get(name)


def test_units_go_out_longest_first_each_kept_together_in_its_order():
    items = [Item("tests/a.py::t1"), Item("tests/b.py::e1", e2e=True), Item("tests/a.py::t2"),
             Item("tests/b.py::e2", e2e=True, module_fixture=True), Item("tests/b.py::e3", e2e=True),
             Item("tests/c.py::t1", group="g"), Item("tests/d.py::t1", group="g"), Item("tests/new.py::t1")]
    table = {"tests": {"tests/b.py::e1": 3.0, "tests/b.py::e3": 40.0, "tests/a.py::t2": 5.0},
             "files": {"tests/a.py": 0.5, "tests/b.py": 2.0, "tests/c.py": 1.0, "tests/d.py": 1.0}}
    ordered = [item.nodeid for item in suite_order.longest_first(items, table)]
    # e3 alone 40 s; a.py 0.5 + 5 s; e1 alone 3 s; b.py's e2 (its module fixture: with its file) 2 s;
    # group g 1 + 1 s (ties keep collection order); a file the table has never seen: DEFAULT
    assert ordered == ["tests/b.py::e3", "tests/a.py::t1", "tests/a.py::t2", "tests/b.py::e1", "tests/b.py::e2",
                       "tests/c.py::t1", "tests/d.py::t1", "tests/new.py::t1"]
    assert {item.nodeid: item.stash[suite_order._unit] for item in items} == {
        "tests/a.py::t1": "tests/a.py", "tests/a.py::t2": "tests/a.py", "tests/b.py::e1": "tests/b.py::e1",
        "tests/b.py::e2": "tests/b.py", "tests/b.py::e3": "tests/b.py::e3", "tests/c.py::t1": "group g",
        "tests/d.py::t1": "group g", "tests/new.py::t1": "tests/new.py"}
    assert suite_order.estimate("tests/new.py::t1", True, table) == suite_order.DEFAULT[True]


def test_the_table_is_read_from_a_junit_report(tmp_path):
    report = tmp_path / "report.xml"
    report.write_text(
        '<testsuites><testsuite>'
        '<testcase classname="tests.sinks.test_report" name="test_slow[a-b]" time="12.34"/>'
        '<testcase classname="tests.sinks.test_report" name="test_quick" time="0.2"/>'
        '<testcase classname="tests.sinks.test_report" name="test_quicker" time="0.1"/>'
        '<testcase classname="tests.test_suite_order" name="test_skipped" time="5"><skipped/></testcase>'
        '</testsuite></testsuites>')
    assert suite_order.from_junit([report]) == {
        "tests": {"tests/sinks/test_report.py::test_slow[a-b]": 12.3},
        "files": {"tests/sinks/test_report.py": 0.15}}


SUITE = {
    "conftest.py": f"import sys\nsys.path.insert(0, {str(HERE)!r})\npytest_plugins = ['suite_order']\n",
    "test_a.py": """
import os
import pytest

@pytest.fixture(scope="module")
def built(tmp_path_factory):
    with open(os.environ["LOG"], "a") as log:
        log.write("built a\\n")

@pytest.mark.parametrize("i", range(6))
def test_a(built, i):
    with open(os.environ["LOG"], "a") as log:
        log.write(f"a {os.environ['PYTEST_XDIST_WORKER']}\\n")
""",
    "test_b.py": """
import os
import pytest

@pytest.mark.parametrize("i", range(6))
def test_b(i):
    with open(os.environ["LOG"], "a") as log:
        log.write(f"b {os.environ['PYTEST_XDIST_WORKER']}\\n")
""",
}


@pytest.mark.e2e  # a pytest run with two workers
def test_a_files_tests_run_on_one_worker_and_its_module_fixture_is_built_once(tmp_path):
    for name, text in SUITE.items():
        (tmp_path / name).write_text(text)
    log = tmp_path / "log"
    path = os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-q", str(tmp_path)],
                         cwd=tmp_path, env=dict(os.environ, LOG=str(log), PYTHONPATH=path),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = log.read_text().splitlines()
    assert lines.count("built a") == 1
    workers = {file: {line.split()[1] for line in lines if line.startswith(file + " ")} for file in ("a", "b")}
    assert all(len(ran_on) == 1 for ran_on in workers.values()), workers
    assert sum(line.startswith(("a ", "b ")) for line in lines) == 12
