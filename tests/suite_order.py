"""How ``-n N --dist loadgroup`` (the README's command) spreads the suite over its workers.

A work unit is what one worker runs in one go: every test of a file, so that a module-scoped
fixture is built once, by one worker (as --dist loadfile would); or one e2e test (seconds to a
minute each) that shares no such fixture, which goes to whichever worker is free. A worker gets one
unit, and another when it runs low; the suite ends when the last worker ends, so the units go out
longest first (a minute-long unit handed out last would leave the other workers idle for that
minute). How long a unit takes is read from ``tests/durations.json``, measured on the development
VM; a test it does not list (new, or under a second) is estimated from its file's other tests, or
from DEFAULT where the file is new.

pytest-xdist's own loadgroup scheduler learns a test's group from a suffix that its worker writes
into the test's nodeid, and pytest 9.2 keeps a nodeid where that write no longer reaches
(pytest-dev/pytest-xdist#1386): every test became its own unit and a module fixture was built
again on each worker that ran a test of its file. So the scheduler here (xdist's loadscope one,
with the units the workers decided) takes its place for --dist loadgroup; the workers hand the
units over in a file whose path the controller gives them.

Refresh the table after a change that moves a test's time by seconds:

    python -m pytest -n 3 --dist loadgroup --junitxml=full.xml
    python tests/suite_order.py full.xml
"""

import json
import shutil
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

import pytest

from kvbench.jsonio import read_json, write_text_atomic

TABLE = Path(__file__).with_name("durations.json")
ROOT = TABLE.parents[1]  # where a nodeid's path starts
# A test listed by its own time: at or above this, seconds; the rest as their file's mean.
LISTED = 1.0
# A test of a file the table has never seen (seconds): an e2e test starts an interpreter (~3 s of
# imports) and usually runs a command or two; a unit test is milliseconds to a second.
DEFAULT = {True: 10.0, False: 0.1}
UNITS = "kvbench_units"  # the workers' input naming the file of units
_unit = pytest.StashKey[str]()
_units_dir = pytest.StashKey[str]()


def load(path: Path = TABLE) -> dict:
    """The table: {"tests": {nodeid: s}, "files": {path: mean s of its other tests}}; empty if absent."""
    try:
        table = json.loads(path.read_text())
    except FileNotFoundError:
        return {"tests": {}, "files": {}}
    return {"tests": table.get("tests", {}), "files": table.get("files", {})}


def estimate(nodeid: str, e2e: bool, table: dict) -> float:
    """Seconds ``nodeid`` is expected to take (setup, call and teardown) on the development VM."""
    if nodeid in table["tests"]:
        return table["tests"][nodeid]
    return table["files"].get(nodeid.split("::")[0], DEFAULT[e2e])


def _is_e2e(item) -> bool:
    return item.get_closest_marker("e2e") is not None


def _shares_a_module_fixture(item) -> bool:
    return any(d.scope in ("module", "package") for defs in item._fixtureinfo.name2fixturedefs.values() for d in defs)


def unit_of(item) -> str:
    """The work unit of ``item``: an xdist_group mark's name where a test sets one, the test
    itself for an e2e test that shares no module fixture, else its file."""
    group = item.get_closest_marker("xdist_group")
    if group is not None:
        return "group " + str(group.args[0] if group.args else group.kwargs.get("name", "default"))
    if _is_e2e(item) and not _shares_a_module_fixture(item):
        return item.nodeid
    return item.nodeid.split("::")[0]


def longest_first(items, table: dict):
    """``items`` reordered so that their work units come longest first; a unit's tests stay
    together and in their order (a module fixture is built once, by its first test)."""
    units, cost = defaultdict(list), defaultdict(float)
    for item in items:
        unit = item.stash[_unit] = unit_of(item)
        units[unit].append(item)
        cost[unit] += estimate(item.nodeid, _is_e2e(item), table)
    order = sorted(units, key=lambda unit: -cost[unit])  # stable: ties keep collection order
    return [item for unit in order for item in units[unit]]


@pytest.hookimpl(tryfirst=True)  # before pytest's -m and -k deselect (they keep the order)
def pytest_collection_modifyitems(config, items):
    items[:] = longest_first(items, load())


# ---- the controller's side (pytest-xdist's hooks; absent without -n) and the workers' ----

try:
    from xdist.scheduler import LoadScopeScheduling
except ImportError:  # pytest-xdist is a dev dependency: without it there is nothing to spread
    LoadScopeScheduling = object


class UnitScheduling(LoadScopeScheduling):
    """xdist's loadscope scheduling over the units the workers wrote, in their order."""

    def __init__(self, config, log, path: Path):
        super().__init__(config, log)
        self.path, self.units = path, None
        config.option.loadscopereorder = False  # its reorder is by number of tests; ours is by time

    def _split_scope(self, nodeid: str) -> str:
        if self.units is None:  # written by every worker before it reports its collection
            self.units = read_json(self.path) if self.path.exists() else {}
        return self.units.get(nodeid) or nodeid.split("::")[0]  # no unit known: its file's


def _units_file(config) -> Path:
    if _units_dir not in config.stash:
        config.stash[_units_dir] = tempfile.mkdtemp(prefix="kvbench-units-")
    return Path(config.stash[_units_dir]) / "units.json"


@pytest.hookimpl(optionalhook=True, tryfirst=True)  # before xdist's own, which answers for every --dist
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") == "loadgroup":
        return UnitScheduling(config, log, _units_file(config))
    return None


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    if node.config.getvalue("dist") == "loadgroup":
        node.workerinput[UNITS] = str(_units_file(node.config))


@pytest.hookimpl(tryfirst=True)  # before the worker reports its collection, on which the controller reads it
def pytest_collection_finish(session):
    path = getattr(session.config, "workerinput", {}).get(UNITS)
    if path:  # a worker: the units by their final nodeids (each worker writes the same file)
        units = {item.nodeid: item.stash.get(_unit, None) or unit_of(item) for item in session.items}
        write_text_atomic(path, json.dumps(units))


def pytest_unconfigure(config):
    if _units_dir in config.stash:
        shutil.rmtree(config.stash[_units_dir], ignore_errors=True)


# ---- the table, from a run's junit report ----

def from_junit(paths) -> dict:
    """The table from pytest ``--junitxml`` reports: per-test seconds (setup + call + teardown)."""
    seconds = {}
    for path in paths:
        for case in ET.parse(path).iter("testcase"):
            if case.find("skipped") is not None:
                continue
            # junit writes "tests.sinks.test_x" (and ".Class" for a method): back to the nodeid's path
            parts, name = case.get("classname", "").split("."), case.get("name")
            for cut in range(len(parts), 0, -1):
                if (ROOT / ("/".join(parts[:cut]) + ".py")).exists():
                    seconds["::".join(["/".join(parts[:cut]) + ".py", *parts[cut:], name])] = float(case.get("time", 0))
                    break
    tests = {nodeid: round(s, 1) for nodeid, s in sorted(seconds.items()) if s >= LISTED}
    rest = defaultdict(list)
    for nodeid, s in seconds.items():
        if nodeid not in tests:
            rest[nodeid.split("::")[0]].append(s)
    files = {path: round(sum(times) / len(times), 3) for path, times in sorted(rest.items())}
    return {"tests": tests, "files": files}


if __name__ == "__main__":  # python tests/suite_order.py REPORT.xml ...
    if len(sys.argv) < 2:
        sys.exit("usage: python tests/suite_order.py REPORT.xml [REPORT.xml ...]")
    write_text_atomic(TABLE, json.dumps(from_junit(sys.argv[1:]), indent=1) + "\n")
    print(f"{TABLE}: written")
