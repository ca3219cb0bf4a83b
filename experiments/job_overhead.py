"""What running each job of a sweep in a process of its own costs (``runtime.isolate=true``), before
and after the fork server.

A sweep of ``--jobs`` identical ``model=tiny`` jobs (under a second of measuring each; the swept
axis is ``runtime.seed``) and a sweep of one, run by ``python -m kvbench.cli`` as a user runs
``kvbench -m``, for each tree given with ``--tree``, and in one tree with ``runtime.isolate=false``
(every job in kvbench's own process: the floor). A job's cost is the sweep's marginal one,
``(T_N - T_1) / (N - 1)``: what each further job adds, kvbench's own start and the first job's
process start left out. Its isolation overhead is that minus the in-process job's. Rounds run
every case in turn, so load drifts hit all alike; medians over rounds, and the after/before
ratio of each round's marginal cost.

    git archive 14318db | tar -x -C /tmp/kvbench-before                      # the tree before
    python experiments/job_overhead.py --tree before=/tmp/kvbench-before --tree after=. \\
        --rounds 3 --out experiments/results/job_overhead

Writes ``--out`` + ``.md`` (default ``outputs/experiments/job_overhead.md``).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import Parser, named_dir, out_path, positive_int, run_main, say, write_report

ROOT = Path(__file__).resolve().parents[1]
JOB = ["model=tiny", "workload.prompt_len=16", "workload.gen_len=4", "runtime.warmup=0", "runtime.repeats=2",
       "runtime.threads=1", "runtime.fidelity=false", "wandb.mode=disabled"]


def sweep_seconds(tree: Path, jobs: int, isolate: bool, where: Path) -> float:
    """Wall seconds of one ``kvbench -m`` of ``jobs`` jobs from ``tree``, start to exit."""
    env = dict(os.environ, PYTHONPATH=str(tree), WANDB_MODE="disabled", HYDRA_FULL_ERROR="1")
    seeds = ",".join(str(s) for s in range(jobs)) if jobs > 1 else "0"
    command = [sys.executable, "-m", "kvbench.cli", "-m", *JOB, f"runtime.isolate={str(isolate).lower()}",
               f"runtime.seed={seeds}", f"hydra.sweep.dir={where}"]
    start = time.monotonic()
    proc = subprocess.run(command, cwd=where.parent, env=env, capture_output=True, text=True, timeout=1800)
    seconds = time.monotonic() - start
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(command)} (PYTHONPATH={tree}): exit {proc.returncode}\n{proc.stderr[-2000:]}")
    return seconds


def main(argv=None) -> None:
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--tree", type=named_dir, action="append", default=[],
                   help="NAME=DIR: a checkout of kvbench to time (repeatable; default: this tree as 'this')")
    p.add_argument("--jobs", type=positive_int, default=6, help="jobs in the long sweep (default 6)")
    p.add_argument("--rounds", type=positive_int, default=3)
    p.add_argument("--out", type=out_path, default="outputs/experiments/job_overhead", help="report path without .md")
    args = p.parse_args(argv)
    trees = dict(args.tree) or {"this": ROOT}
    last = list(trees)[-1]
    cases = [(name, tree, True) for name, tree in trees.items()] + [(f"{last}, in-process", trees[last], False)]
    times = {(case, n): [] for case, _, _ in cases for n in (1, args.jobs)}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for c, (case, tree, isolate) in enumerate(cases):
                for n in (1, args.jobs):
                    where = Path(tmp) / f"round{r}-case{c}-jobs{n}"  # a plain name: a comma would be a sweep
                    times[(case, n)].append(sweep_seconds(tree, n, isolate, where))
                    say(f"round {r + 1}: {case}, {n} job(s): {times[(case, n)][-1]:.1f} s")
    marginal = {case: [(long - one) / (args.jobs - 1) for one, long in zip(times[(case, 1)], times[(case, args.jobs)])]
                for case, _, _ in cases}
    floor = statistics.median(marginal[f"{last}, in-process"])
    rows = []
    for case, _, _ in cases:
        m = statistics.median(marginal[case])
        one, long = statistics.median(times[(case, 1)]), statistics.median(times[(case, args.jobs)])
        rows.append(f"| {case} | {one:.1f} | {long:.1f} | {m:.2f} | {m - floor:+.2f} | "
                    + ", ".join(f"{x:.2f}" for x in marginal[case]) + " |")
    names = list(trees)
    ratios = ""
    if len(names) >= 2:
        a, b = names[0], names[-1]
        per_round = [after / before for before, after in zip(marginal[a], marginal[b])]
        ratios = (f"\nMarginal seconds per job, {b} / {a}, per round: " + ", ".join(f"{x:.2f}" for x in per_round)
                  + f" (median {statistics.median(per_round):.2f})\n")
    command = "python experiments/job_overhead.py " + " ".join(
        f"--tree {n}={d}" for n, d in trees.items()) + f" --jobs {args.jobs} --rounds {args.rounds} --out {args.out}"
    text = (f"# Per-job cost of a process per job (runtime.isolate=true)\n\n`{command}` on {os.cpu_count()} CPUs; "
            f"medians of {args.rounds} rounds, wall seconds. Jobs: `{' '.join(JOB)}`, swept over runtime.seed.\n\n"
            f"| case | sweep of 1 s | sweep of {args.jobs} s | s per further job | over in-process | per round |\n"
            "|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n" + ratios)
    write_report(Path(args.out).with_suffix(".md"), text)


if __name__ == "__main__":
    run_main(main)
