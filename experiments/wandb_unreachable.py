"""What ``wandb=online`` costs a job when the W&B server does not answer (issue 29, item 3).

A job's record is tracked as the CLI tracks it after a job (``kvbench.sinks.tracking.track``),
in a fresh interpreter each time: ``offline`` (the baseline), ``offline+silent`` (offline, with
``WANDB_BASE_URL`` at the silent server: a network that drops packets to W&B's host), ``online``
against a ``silent`` server (a local socket that accepts and never replies) and against a
``refused`` port (nothing listens). Per case: the seconds ``track()`` takes, and the seconds from
its return to the interpreter's exit (what W&B's exit hooks add after the result is printed).
Rounds alternate the cases and the trees, so load drifts hit all alike; medians over rounds.

    python experiments/wandb_unreachable.py                                   # this tree
    git archive 9a405b5 | tar -x -C /tmp/kvbench-before                       # an older tree beside it
    python experiments/wandb_unreachable.py --tree before=/tmp/kvbench-before --tree after=. \\
        --out experiments/results/wandb_unreachable

Writes ``--out`` + ``.md`` (default ``outputs/experiments/wandb_unreachable.md``).
"""

from __future__ import annotations

import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from _common import Parser, named_dir, out_path, positive_float, positive_int, run_main, say, write_report

ROOT = Path(__file__).resolve().parents[1]
CASES = ("offline", "offline+silent", "silent", "refused")
CHILD = """
import sys, time
import kvbench
assert kvbench.__file__.startswith(sys.argv[4]), (kvbench.__file__, sys.argv[4])
from pathlib import Path
from kvbench.results import RunResult
from kvbench.sinks.tracking import track
job = Path(sys.argv[1])
result = RunResult("ok", {"attention": {"type": "gqa", "num_kv_heads": 2}, "workload": {"name": "decode"}},
                   metrics={"prefill_ms": 3.5})
result.write(job)
start = time.monotonic()
track(result, {"mode": sys.argv[2], "init_timeout_s": float(sys.argv[3])}, job)
print(f"{time.monotonic() - start:.3f}", flush=True)
"""


def silent_server() -> str:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(256)
    held = []  # never answered, never closed while the experiment runs

    def accept() -> None:
        while True:
            held.append(sock.accept()[0])

    threading.Thread(target=accept, daemon=True).start()
    return f"http://127.0.0.1:{sock.getsockname()[1]}"


def refused_url() -> str:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return f"http://127.0.0.1:{port}"


def one(tree: Path, case: str, urls: dict, timeout_s: float, home: Path) -> tuple[float, float]:
    """(seconds in track(), seconds from its return to the exit) of one fresh interpreter."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(PYTHONPATH=str(tree), WANDB_API_KEY="k" * 40, WANDB_BASE_URL=urls[case],
               WANDB_CONFIG_DIR=str(home / "config"), WANDB_CACHE_DIR=str(home / "cache"),
               WANDB_DATA_DIR=str(home / "data"))
    mode = "offline" if case.startswith("offline") else "online"
    with tempfile.TemporaryDirectory() as job:
        # cwd: the job's, so that ``import kvbench`` finds the tree on PYTHONPATH, not the one in
        # the current directory (``-c`` puts the cwd first on sys.path)
        proc = subprocess.Popen([sys.executable, "-c", CHILD, job, mode, str(timeout_s), str(tree)], env=env, cwd=job,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        tracked = float(proc.stdout.readline())
        returned = time.monotonic()
        proc.wait(timeout=300)
        return tracked, time.monotonic() - returned


def main(argv=None) -> None:
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", type=named_dir, action="append",
                        help="NAME=PATH of a kvbench tree (default: this one)")
    parser.add_argument("--rounds", type=positive_int, default=3)
    parser.add_argument("--init-timeout", type=positive_float, default=5.0, help="wandb.init_timeout_s of every run")
    parser.add_argument("--out", type=out_path, default="outputs/experiments/wandb_unreachable")
    args = parser.parse_args(argv)
    trees = dict(args.tree) if args.tree else {"this": str(ROOT)}
    trees = {name: Path(path).resolve() for name, path in trees.items()}
    silent = silent_server()
    urls = {"offline": refused_url(), "offline+silent": silent, "silent": silent, "refused": refused_url()}
    got: dict = {(t, c): [] for t in trees for c in CASES}
    with tempfile.TemporaryDirectory() as home:
        for r in range(args.rounds):
            for name, tree in trees.items() if r % 2 == 0 else reversed(trees.items()):
                for case in CASES:
                    got[(name, case)].append(one(tree, case, urls, args.init_timeout, Path(home)))
                    say(name, case, *got[(name, case)][-1])
    lines = [f"# wandb=online against a server that does not answer (wandb.init_timeout_s={args.init_timeout:g})", "",
             f"`{' '.join(['python', *sys.argv])}` on {os.cpu_count()} CPUs; medians of {args.rounds} rounds "
             "(each a fresh interpreter), seconds.", "",
             "| tree | case | track() s | exit after it s | per round (track, exit) |", "|---|---|---|---|---|"]
    for (name, case), runs in got.items():
        lines.append(f"| {name} | {case} | {statistics.median(a for a, _ in runs):.2f} | "
                     f"{statistics.median(b for _, b in runs):.2f} | "
                     + ", ".join(f"({a:.1f}, {b:.1f})" for a, b in runs) + " |")
    out = Path(args.out).with_suffix(".md")
    out.parent.mkdir(parents=True, exist_ok=True)
    write_report(out, "\n".join(lines) + "\n")


if __name__ == "__main__":
    run_main(main)
