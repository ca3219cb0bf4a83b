"""What evicting a conversation's history costs its next turn, per KV budget and layout.

workload=conversations serves multi-turn chats: each turn's prompt is the whole history, sent a
think time after the previous answer. Between turns a history's blocks stay in the prefix cache
until other requests need them; a returning turn whose history was evicted prefills it again.
This serves the default conversations (model=tiny, 16 conversations of 2-6 turns, seed 0: the
same turns, lengths and think times in every job) at each KV budget and layout, and reports the
returning turns whose history was still cached against those whose history was evicted, with the
p50 TTFT of each, and each turn index's TTFT and prefix hit rate for the first job.

    python experiments/conversations_eviction.py                  # budgets 2 and 16 MB, MHA and MQA
    python experiments/conversations_eviction.py --budgets 2 --attention mha --out /tmp/conv.md
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import List

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    Parser,
    compose_config,
    conf_option,
    list_of,
    ok_record,
    out_file,
    positive_float,
    run_main,
    write_report,
)

from kvbench.jobs.runner import run_job  # noqa: E402
from kvbench.results import read_record  # noqa: E402

OUT = Path(__file__).resolve().parent / "results" / "conversations_eviction.md"


def cell(value, fmt: str = "{:.1f}") -> str:
    return "-" if value is None else fmt.format(value)


def main(argv: List[str] = None) -> None:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", type=list_of(positive_float), default="2,16",
                        help="workload.kv_budget_mb values, comma-separated")
    parser.add_argument("--attention", type=list_of(conf_option("attention")), default="mha,mqa",
                        help="attention= options, comma-separated")
    parser.add_argument("--out", type=out_file, default=OUT)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows, first = [], None
    with tempfile.TemporaryDirectory() as tmp:
        for budget in args.budgets.split(","):
            for attention in args.attention.split(","):
                overrides = ["model=tiny", "workload=conversations", f"attention={attention}",
                             f"workload.kv_budget_mb={budget}", "runtime.isolate=false", "runtime.threads=1",
                             "wandb=disabled"]
                out = Path(tmp) / f"{attention}_{budget}"
                run_job(compose_config(overrides), out)
                record = ok_record(read_record(out / "results.json"), ' '.join(overrides))
                m = record.metrics
                rows.append(f"| {budget} | {attention} | {m['kv_blocks_total']} | {m['returning_turns']} | "
                            f"{m['returning_cached']} | {m['returning_evicted']} | "
                            f"{cell(m['returning_cached_ttft_ms_p50'])} | {cell(m['returning_evicted_ttft_ms_p50'])} | "
                            f"{m['history_recomputed_tokens']:,} | {cell(m['prefix_hit_rate'], '{:.0%}')} | "
                            f"{cell(m['ttft_ms_p50'])} | {m['preemptions']} | {m.get('noisy')} |")
                first = first or (overrides, record.tables["conversation_turns"])
    overrides, turns = first
    lines = [
        "# Conversations: the TTFT of a returning turn, history cached or evicted", "",
        "Made by `python experiments/conversations_eviction.py` (model=tiny, the default `workload=conversations`: "
        "16 conversations at 1/s, 2-6 turns, messages lognormal mean 64 tokens, answers 16-48, think times "
        "exponential of mean 2 s, seed 0), one torch thread on a shared 2-core CPU: read the TTFTs as a ratio, "
        "not as a speed. `noisy`: other work competed for the cores.", "",
        "| KV budget MB | attention | blocks | returning turns | cached | evicted | p50 TTFT cached ms | "
        "p50 TTFT evicted ms | history recomputed (tokens) | prefix hit rate | p50 TTFT all ms | preempted | noisy |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|", *rows, "",
        f"Per turn index, `{' '.join(overrides[:4])}`:", "",
        "| turn | turns | p50 TTFT ms | p90 TTFT ms | prefix hit rate | cached | evicted | p50 TTFT cached | "
        "p50 TTFT evicted |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        *(f"| {t['turn']} | {t['turns']} | {cell(t['ttft_ms_p50'])} | {cell(t['ttft_ms_p90'])} | "
          f"{cell(t['prefix_hit_rate'], '{:.0%}')} | {t['cached']} | {t['evicted']} | "
          f"{cell(t['ttft_ms_p50_cached'])} | {cell(t['ttft_ms_p50_evicted'])} |" for t in turns), ""]
    write_report(args.out, "\n".join(lines))


if __name__ == "__main__":
    run_main(main)
