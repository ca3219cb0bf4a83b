"""Each seed of every task=recall record under a folder: its accuracy per condition and when its
training loss fell through MQAR's (or passkey's) jump, from the record's ``tables.train_curve``.

    python experiments/recall_curves.py experiments/results/recall

A seed "jumped" at the first logged step whose mean training loss is below JUMP nats per answer
(chance is ln 32 = 3.47 for MQAR's 32 values); a seed that never did prints "never" and its
last logged loss: still falling (a slow learner at this budget) or flat (stuck).
"""

from typing import List, Optional

from _common import Parser, existing_dir, run_main, say

from kvbench.results import find_results, read_record
from kvbench.sinks.tables import variant

JUMP = 0.5


def main(argv: Optional[List[str]] = None) -> None:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=existing_dir, help="a folder of task=recall records (a sweep's, or several)")
    args = parser.parse_args(argv)
    for path in find_results(args.folder):
            rec = read_record(path)
            if rec.config.get("task") != "recall" or rec.status != "ok":
                continue
            rows = rec.tables["accuracy"]
            curve = rec.tables.get("train_curve") or []
            seeds = sorted({p["seed"] for p in curve}) or list(range(len(rows[0]["per_seed"])))
            steps = rec.config["train"]["steps"]
            say(f"{path.parent}  {variant({'config': rec.config})}  {steps} steps")
            for i, seed in enumerate(seeds):
                points = [p for p in curve if p["seed"] == seed and p["stage"] == "train"]
                jump = next((p["step"] for p in points if p["train_loss"] < JUMP), None)
                accs = " ".join(f"{r.get('num_pairs') or r.get('distance')}:{r['per_seed'][i]:.3f}" for r in rows)
                last = f"last loss {points[-1]['train_loss']:.2f} at {points[-1]['step']}" if points else "no curve"
                trend = ""
                if jump is None and len(points) >= 4:  # against the loss half-way through the run
                    half = points[len(points) // 2 - 1]
                    trend = (f" (still falling: {half['train_loss']:.2f} at {half['step']})"
                             if points[-1]["train_loss"] < half["train_loss"] - 0.1 else " (flat since half-way)")
                say(f"  seed {seed}: {accs}  jump at {jump if jump is not None else 'never'}; {last}{trend}")


if __name__ == "__main__":
    run_main(main)
