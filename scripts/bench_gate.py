#!/usr/bin/env python
"""Performance-regression gate: the head's benchmark suite on the base commit and on the head,
in alternating rounds of one job, compared by pooled median CPU time.

    python scripts/bench_gate.py --base origin/main

Why this shape, for shared and noisy machines:
- Base and head run in the same job on the same machine, so no stored history from other
  hardware is involved (pytest-benchmark files are only comparable within one machine).
- Rounds alternate head/base in ABBA order, so load that drifts during the job (other users'
  jobs starting and stopping) falls on both sides equally.
- Time is CPU time (``time.process_time``), not wall time: while another process holds the
  CPU, ours is not charged, so other users' load stops being measured as our slowness.
  What remains (caches, memory bandwidth and vCPUs shared with neighbours) is smaller.
- The gated statistic is each round's median, pooled as the median over rounds.
  Measured A/A (same code both sides, 3 rounds, 2 shared cores under other developers' load):
  the pooled median CPU time moved at most 16.7% (p95 12.6%, 168 comparisons), hence
  ``median:25%``; wall-clock medians moved up to 99% and wall minima up to 35% (docs/ci-gate.md;
  experiments/results/bench_gate_aa.md).
- The *head's* benchmark files time both sides (the base tree only supplies ``kvbench``), so
  a benchmark that changed in the PR is timed the same way on both; a benchmark whose API
  the base lacks is reported as new and not gated.

Each run is saved with pytest-benchmark's own storage (``--benchmark-save``), as
``<storage>/<machine_id>/NNNN_gate-<tag>-<side>-r<round>.json``. ``--fail`` takes
pytest-benchmark's ``--benchmark-compare-fail`` expressions (``min:25%``, ``median:30%``) and
applies them with its own checks to the pooled statistics (default ``median:25%``).
Exit status: 0 pass, 1 regression (or a head benchmark failed), 2 bad usage (including a
``-k`` that selects no benchmark and a ``--timer`` that is no timer).

``--inject-slowdown 0.4`` makes every head decode step 40% slower (see
``tests/benchmarks/benchkit.py``): the gate's self-test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, Iterator, List, Optional

from pytest_benchmark.utils import PercentageRegressionCheck, get_machine_id, load_timer, parse_compare_fail

HEAD_ROOT = Path(__file__).resolve().parents[1]
SUITE = "tests/benchmarks"
DEFAULT_FAIL = "median:25%"  # 1.5x the worst A/A change measured (docs/ci-gate.md)
STATS = ("min", "max", "mean", "median", "stddev", "iqr")
# pytest's exit codes that mean the gate was asked something that cannot be measured
PYTEST_USAGE_ERROR, PYTEST_NO_TESTS = 4, 5


def parse_timer(text: str) -> str:
    """``--timer``: a dotted name of a function returning seconds as a number (what
    pytest-benchmark needs), checked here so that a typo is a usage error, not a FAIL."""
    try:
        value = load_timer(text).target()
    except Exception as exc:  # noqa: BLE001 — ImportError, AttributeError, TypeError: all a bad name
        raise argparse.ArgumentTypeError(f"{text!r} is not a timer function ({type(exc).__name__}: {exc})") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise argparse.ArgumentTypeError(f"{text!r} returns {value!r}, not a time in seconds")
    return text


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--base", help="git ref of the base (checked out with `git worktree`)")
    where.add_argument("--base-dir", type=Path, help="an existing checkout of the base instead")
    p.add_argument("--rounds", type=int, default=3, help="rounds per side, alternating (default 3)")
    p.add_argument("--fail", action="append", type=parse_compare_fail,
                   help=f"regression check, pytest-benchmark syntax, repeatable (default {DEFAULT_FAIL})")
    p.add_argument("--max-time", type=float, default=0.3, help="seconds per benchmark per round")
    p.add_argument("--min-rounds", type=int, default=15, help="timed calls per benchmark per round")
    p.add_argument("--timer", default="time.process_time", type=parse_timer,
                   help="pytest-benchmark timer (default time.process_time: CPU time, which "
                        "excludes the time other processes hold the CPU; time.perf_counter for wall)")
    p.add_argument("-k", dest="keyword", help="pytest -k expression to select benchmarks")
    p.add_argument("--storage", type=Path, default=HEAD_ROOT / ".benchmarks",
                   help="pytest-benchmark storage folder (default .benchmarks)")
    p.add_argument("--inject-slowdown", type=float, default=0.0,
                   help="make head decode steps this fraction slower (self-test of the gate)")
    p.add_argument("--report", type=Path, help="also write the comparison as JSON here")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds={args.rounds}: must be >= 1")
    if args.inject_slowdown < 0:
        p.error(f"--inject-slowdown={args.inject_slowdown}: must be >= 0")
    args.fail = args.fail or [parse_compare_fail(DEFAULT_FAIL)]
    args.storage = args.storage.resolve()
    return args


def die(message: str) -> None:
    """Bad usage or set-up: one line on stderr, exit status 2 (1 means a regression)."""
    print(f"bench_gate: {message}", file=sys.stderr)
    sys.exit(2)


def git(*cmd: str, cwd: Path = HEAD_ROOT) -> str:
    return subprocess.run(["git", *cmd], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


@contextmanager
def base_tree(args: argparse.Namespace) -> Iterator[Path]:
    """The base checkout: ``--base-dir`` as given, or a detached worktree of ``--base``
    removed afterwards."""
    if args.base_dir is not None:
        if not (args.base_dir / "kvbench").is_dir():
            die(f"--base-dir={str(args.base_dir)!r}: no kvbench/ package there")
        yield args.base_dir.resolve()
        return
    try:
        git("rev-parse", "--verify", f"{args.base}^{{commit}}")
    except subprocess.CalledProcessError:
        die(f"--base={args.base!r}: not a commit in this repository (fetch it, or check out "
            "with fetch-depth: 0 in CI)")
    with tempfile.TemporaryDirectory(prefix="kvbench-gate-") as tmp:
        path = Path(tmp) / "base"
        git("worktree", "add", "--detach", str(path), args.base)
        try:
            yield path
        finally:
            git("worktree", "remove", "--force", str(path))


def side_env(tree: Path, slowdown: float) -> Dict[str, str]:
    # Nothing of a calling pytest leaks in (its addopts; an xdist worker's identity, with which a
    # benchmark run would not time or save anything).
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS" and not k.startswith("PYTEST_XDIST")}
    env.update(PYTHONPATH=str(tree), KVBENCH_BENCH_SLOWDOWN=str(slowdown))
    return env


def check_import(tree: Path) -> None:
    """Refuse to time anything unless ``import kvbench`` in that tree's runs loads its copy
    (an editable install elsewhere must not win)."""
    out = subprocess.run([sys.executable, "-c", "import kvbench; print(kvbench.__file__)"],
                         cwd=tree, env=side_env(tree, 0), capture_output=True, text=True)
    loaded = Path(out.stdout.strip() or "?").resolve()
    if out.returncode or tree not in loaded.parents:
        die(f"running in {tree} imports kvbench from {loaded}, not from that tree: {out.stderr.strip()}")


def run_side(tree: Path, name: str, slowdown: float, args: argparse.Namespace, base: bool) -> tuple[int, Path, str]:
    """One pytest-benchmark run of the head's suite against the kvbench of ``tree``, saved
    under ``name``. Returns the exit code, the saved file and pytest's output."""
    cmd = [sys.executable, "-m", "pytest", str(HEAD_ROOT / SUITE), "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
           "--benchmark-enable", "--benchmark-only", "--benchmark-warmup=on",
           "--benchmark-warmup-iterations=5", f"--benchmark-max-time={args.max_time}",
           f"--benchmark-min-rounds={args.min_rounds}", f"--benchmark-timer={args.timer}",
           "--benchmark-columns=min,median,iqr,rounds",
           f"--benchmark-storage=file://{args.storage}", f"--benchmark-save={name}"]
    if args.keyword:
        cmd += ["-k", args.keyword]
    if base:
        # A benchmark module importing an API the base lacks must not stop the others.
        cmd.append("--continue-on-collection-errors")
    # cwd = the tree: `python -m pytest` puts it first on sys.path, so its kvbench is imported.
    out = subprocess.run(cmd, cwd=tree, env=side_env(tree, slowdown), capture_output=True, text=True)
    saved = sorted((args.storage / get_machine_id()).glob(f"[0-9][0-9][0-9][0-9]_{name}.json"))
    return out.returncode, (saved[-1] if saved else None), out.stdout + out.stderr


def load_run(path: Optional[Path]) -> Dict[str, dict]:
    """name -> stats of one saved pytest-benchmark run (empty if nothing was saved)."""
    if path is None:
        return {}
    data = json.loads(path.read_text())
    return {b["fullname"].split("::", 1)[-1]: b["stats"] for b in data["benchmarks"]}


def pool(runs: List[Dict[str, dict]], name: str) -> Optional[dict]:
    """Each statistic of one benchmark as the median over the rounds that have it; ``spread``
    holds, per statistic, (max - min) / pooled value over those rounds."""
    rounds = [run[name] for run in runs if name in run]
    if not rounds:
        return None
    pooled = {field: statistics.median(r[field] for r in rounds) for field in STATS}
    pooled["spread"] = {field: (max(r[field] for r in rounds) - min(r[field] for r in rounds))
                        / pooled[field] if pooled[field] else 0.0 for field in STATS}
    pooled["rounds"] = len(rounds)
    return pooled


def compare(base_runs: List[Dict[str, dict]], head_runs: List[Dict[str, dict]], checks) -> List[dict]:
    """One row per head benchmark: pooled base and head stats, the relative change of each
    statistic, and the failed checks (pytest-benchmark's ``RegressionCheck.fails``)."""
    names = sorted({name for run in head_runs for name in run})
    rows = []
    for name in names:
        head, base = pool(head_runs, name), pool(base_runs, name)
        row = {"name": name, "head": head, "base": base, "change": None, "failures": []}
        if base is not None:
            row["change"] = {f: head[f] / base[f] - 1 if base[f] else None for f in STATS}
            row["failures"] = [msg for msg in (c.fails(head, base) for c in checks) if msg]
        rows.append(row)
    return rows


def format_rows(rows: List[dict], field: str = "median") -> str:
    """The comparison as a text table: ``field`` (the gated statistic) in ms, its change and
    its round-to-round spread on each side, and the change of the other of min/median."""
    other = "min" if field != "min" else "median"
    lines = [f"{'benchmark':<30} {'base ' + field:>11} {'head ' + field:>11} {'Δ ' + field:>9} "
             f"{'Δ ' + other:>9} {'spread b/h':>15}  verdict"]
    for r in rows:
        h, b = r["head"], r["base"]
        if b is None:
            lines.append(f"{r['name']:<30} {'-':>11} {h[field] * 1e3:>11.3f} {'-':>9} {'-':>9} "
                         f"{'-':>7}/{h['spread'][field]:<7.1%}  new (no baseline, not gated)")
            continue
        verdict = "REGRESSION" if r["failures"] else "ok"
        change = {f: h[f] / b[f] - 1 for f in (field, other)}
        lines.append(f"{r['name']:<30} {b[field] * 1e3:>11.3f} {h[field] * 1e3:>11.3f} "
                     f"{change[field]:>+9.1%} {change[other]:>+9.1%} "
                     f"{b['spread'][field]:>7.1%}/{h['spread'][field]:<7.1%}  {verdict}")
    return "\n".join(lines)


def check_text(check) -> str:
    """A parsed ``--fail`` check as it was written: ``median:25%`` or ``min:0.001`` (seconds)."""
    return f"{check.field}:{check.threshold}" + ("%" if isinstance(check, PercentageRegressionCheck) else "")


def commit_of(tree: Path) -> Optional[Dict[str, object]]:
    """The commit a checkout is at and whether its files differ from it (None outside git)."""
    try:
        return {"commit": git("rev-parse", "HEAD", cwd=tree),
                "dirty": bool(git("status", "--porcelain", "--untracked-files=no", cwd=tree))}
    except (subprocess.CalledProcessError, OSError):
        return None


def report(args: argparse.Namespace, rows: List[dict], failed: List[dict], base_commit) -> dict:
    """``--report``'s JSON: the verdict and what it rests on (commits, checks, timer, rounds,
    units), then one row per benchmark as :func:`compare` made it."""
    checks = [check_text(c) for c in args.fail]
    return {
        "verdict": "fail" if failed else "pass",
        "regressed": [r["name"] for r in failed],
        "base": {"ref": args.base, "dir": str(args.base_dir) if args.base_dir else None, **(base_commit or {})},
        "head": {"dir": str(HEAD_ROOT), **(commit_of(HEAD_ROOT) or {})},
        "fail_on": checks,
        "threshold_why": ("1.5x the largest A/A change of the pooled median CPU time on a loaded 2-core "
                          "machine (docs/ci-gate.md)"
                          if checks == [DEFAULT_FAIL] else "given with --fail"),
        "inject_slowdown": args.inject_slowdown,
        "timer": args.timer,
        "rounds_per_side": args.rounds,
        "units": {**{f: f"s per call as {args.timer} counts it (pooled: median over rounds)" for f in STATS},
                  "spread": "fraction: (max - min) / pooled value over the rounds of one side",
                  "change": "fraction: head / base - 1 of each statistic", "rounds": "count"},
        "benchmarks": rows,
    }


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    tag = time.strftime("%Y%m%d-%H%M%S")
    head_runs, base_runs = [], []
    with base_tree(args) as base:
        for tree in (base, HEAD_ROOT):
            check_import(tree)
        print(f"gate: base {base} vs head {HEAD_ROOT}, {args.rounds} rounds, "
              f"fail on {' '.join(check_text(c) for c in args.fail)}"
              + (f", head slowed by {args.inject_slowdown:.0%} (injected)" if args.inject_slowdown else ""),
              flush=True)
        for r in range(args.rounds):
            # ABBA: the side that goes first alternates, so drift hits both sides alike. The head
            # goes first, so a -k that selects none of its benchmarks is a usage error before
            # anything is timed (pytest's exit 5, no collect-only run of its own).
            order = [("head", HEAD_ROOT), ("base", base)]
            for side, tree in order if r % 2 == 0 else order[::-1]:
                start = time.perf_counter()
                name = f"gate-{tag}-{side}-r{r + 1}"
                rc, saved, output = run_side(tree, name, args.inject_slowdown if side == "head" else 0.0,
                                             args, base=side == "base")
                print(f"  round {r + 1} {side}: exit {rc}, {time.perf_counter() - start:.1f} s, "
                      f"{saved.relative_to(args.storage) if saved else 'nothing saved'}", flush=True)
                if side == "head" and rc == PYTEST_NO_TESTS:
                    die(f"-k {args.keyword!r}: selects no benchmark in {SUITE}")
                if side == "head" and rc == PYTEST_USAGE_ERROR:
                    die("pytest refused the arguments: " + next(
                        (line for line in output.splitlines() if "error" in line.lower()), output.strip()[-300:]))
                if side == "head" and (rc != 0 or saved is None):
                    print(output[-4000:])
                    print("gate: FAIL (the head's benchmarks do not pass)")
                    return 1
                if side == "base" and rc != 0:
                    print(f"  (base run exit {rc}: benchmarks it could not run count as new)")
                (base_runs if side == "base" else head_runs).append(load_run(saved))
        base_commit = commit_of(base)
    rows = compare(base_runs, head_runs, args.fail)
    print(format_rows(rows, args.fail[0].field))
    failed = [r for r in rows if r["failures"]]
    if args.report:
        args.report.write_text(json.dumps(report(args, rows, failed, base_commit), indent=2))
    for r in failed:
        for msg in r["failures"]:
            print(f"  {r['name']}: {msg}")
    print(f"gate: {'FAIL' if failed else 'PASS'} ({len(failed)} of {len(rows)} benchmarks regressed)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
