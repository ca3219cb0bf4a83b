"""The capacity report: per layout and KV precision, at a context and a KV memory budget, the bytes
per token and per sequence by the layouts' formula, the sequences that fit, what each serving
allocator reserves for one sequence and how many its pools hold (its own plan,
kvbench/serving/allocator.py), and the highest request rate within an SLO where the serving
store can run it. Served runs' records hold the same figures; kvbench-report tables them.

Two kinds of rows. Presets (real configurations, nothing run): each layer's own formula
(windows kept whole, Gated DeltaNet states, MLA's latent, 1-byte and 4-bit codes and their scales) against
"bytes per token x context", the figure an estimator that treats every layer as full attention
gives. model=tiny variants: the same figures at a small context and budget, and the highest rate
of workload=serving's rate search (kvbench/serving/rate_search.py) on this CPU; a variant the
serving store refuses says so in the line it refuses with.

The rate searches are what takes time: a run at r requests/s waits n / r seconds for its arrivals,
so the search starts at 2 req/s with 24 requests and serves the cache.dtype=auto row of each tiny
layout only (6 searches, a few minutes on a 2-core CPU); --serve-all-precisions adds the int8 and
float8 rows (18), --serve-requests sets n.

    python experiments/capacity_report.py                     # presets at 8192 tokens / 40 GB; tiny
    python experiments/capacity_report.py --no-serve --out /tmp/capacity.md
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Parser, compose_config, out_file, positive_float, positive_int, run_main, write_report  # noqa: E402
from capacity_per_gpu import MEMORY_FRACTION  # noqa: E402

from kvbench.config.serving import ServingWorkload  # noqa: E402
from kvbench.core.dtypes import DTYPE_BYTES  # noqa: E402
from kvbench.core.errors import ConfigError  # noqa: E402
from kvbench.jobs.job_config import to_bench_config  # noqa: E402
from kvbench.jobs.runner import run_job  # noqa: E402
from kvbench.layouts.build import build_layouts  # noqa: E402
from kvbench.measure.env import load_average  # noqa: E402
from kvbench.parallel.per_gpu import rank_weights  # noqa: E402
from kvbench.parallel.plan import Split, node_splits, per_gpu, rank_kv  # noqa: E402
from kvbench.results import read_record  # noqa: E402
from kvbench.serving.allocator import ALLOCATORS, groups_of, make_plan  # noqa: E402
from kvbench.tasks.common import variant_label  # noqa: E402
from kvbench.units import human_bytes  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "experiments" / "results" / "capacity_report.md"
PLOT = "capacity_report.png"  # beside the report, and copied into docs/
PRESETS = ("llama3_8b", "llama4_scout", "llama4_maverick", "gemma3_27b", "gemma4_31b", "gemma4_e4b", "gpt_oss_120b",
           "qwen3_5_9b", "nemotron3_nano", "kimi_linear_48b", "kimi_k3", "deepseek_v3", "deepseek_v32",
           "deepseek_v4_flash", "deepseek_v4_pro")
TINY = (("mha", []), ("gqa", ["attention.num_kv_heads=2"]), ("mqa", []), ("mla", []),
        ("gqa", ["attention.num_kv_heads=2", "attention.window=64", "attention.global_every=2"]),
        ("gqa", ["attention.num_kv_heads=2", "attention.layer_types=[linear_attention,full_attention]"]))
PRECISIONS = ("auto", "int8", "float8_e4m3fn")
# the presets' heads (64 wide and more) also take the 4-bit caches; model=tiny's of 8 do not (a block is 16 or 32)
PRESET_PRECISIONS = (*PRECISIONS, "nvfp4", "mxfp4")
LOWEST_RATE = 2.0  # req/s: the search's first rate (workload.search.lo)
SERVE = ["workload=serving", "workload.search.enabled=true", "slo.ttft_ms=250", "slo.tpot_ms=40",
         "workload.search.max_probes=6", f"workload.search.lo={LOWEST_RATE:g}", "runtime.isolate=false",
         "runtime.threads=1", "wandb=disabled", "runtime.warmup=1"]
SERVE_REQUESTS = 24  # a run at 2 req/s waits 12 s for its arrivals, the first of the search the longest
# the presets' per-GPU columns: a node of 8 GPUs of 141 GB (H200s), as experiments/capacity_per_gpu.py's
NODE_GPUS, GPU_GB = 8, 141.0


def allocator_figures(layouts, element: int, dtype: str, block_size: int, context: int, budget: int) -> Dict:
    """What each allocator (kvbench/serving/allocator.py, the serving store's own plan) makes of
    ``budget`` for requests of ``context`` positions, prefilled in the serving workload's default
    chunks: the attention block, what one sequence at ``context`` reserves at its worst while it
    decodes (block rounding, a window kept whole, its state page), how many such sequences the
    pools hold at once, and what those reserve."""
    groups = groups_of(layouts, element, dtype)
    out = {}
    for allocator in ALLOCATORS:
        plan = make_plan(groups, allocator, block_size, budget, context, ServingWorkload.max_prefill_tokens)
        fit = plan.sequences_fit(context)
        out[allocator] = {"block": plan.block_size, "per_seq": plan.worst_sequence_bytes(context), "fit": fit,
                          "reserved": fit * plan.worst_sequence_bytes(context), "pools": plan.reserved_bytes}
    return out


def node_figures(cfg, layouts, element: int, context: int, weights: Dict) -> Dict:
    """Per GPU on a node of :data:`NODE_GPUS` (kvbench/parallel/, as task=capacity's tables.per_gpu): the largest
    tensor-parallel split that cuts the model whole (TP), data parallel over the node (DP: a whole copy a GPU),
    and of the expert-parallel splits (EP) the one fitting most sequences; ``weights`` caches a GPU's weights
    by (model, split), the same in every KV precision."""
    gpu_bytes = int(GPU_GB * 1e9 * MEMORY_FRACTION)

    def figures(split: Split) -> Dict:
        key = (cfg.model.name, split)
        if key not in weights:
            weights[key] = rank_weights(cfg.model, cfg.attention, split, cfg.runtime.dtype)
        kv = rank_kv(layouts, split.tp, context, element, cfg.cache.dtype)
        return per_gpu(kv, split, weights[key], gpu_bytes, NODE_GPUS)
    splits = node_splits(cfg.model, layouts, NODE_GPUS)
    tp = max((split for split in splits if split.ep == 1), key=lambda split: split.tp)
    experts = [figures(split) for split in splits if split.ep > 1]
    return {"tp": figures(tp) if tp.tp > 1 else None, "dp": figures(Split(1, NODE_GPUS)),
            "ep": max(experts, key=lambda row: row["sequences_per_node"]) if experts else None}


def formula_row(overrides: List[str], context: int, budget: int, node: Optional[Dict] = None) -> Dict:
    """The formula's figures of one configuration (nothing built) and each allocator's, or the line refusing it;
    with ``node`` (its weights cache), its per-GPU figures on a node too (:func:`node_figures`)."""
    try:
        cfg = to_bench_config(compose_config(overrides))
    except ConfigError as exc:
        return {"refused": str(exc)}
    if context > cfg.model.max_seq_len:  # a sequence the model cannot hold: no figure, rather than a false one
        return {"refused": f"context {context}: more than model.max_seq_len={cfg.model.max_seq_len}"}
    layouts = build_layouts(cfg.model, cfg.attention)
    element, dtype = DTYPE_BYTES[cfg.runtime.dtype], cfg.cache.dtype
    per_token = layouts.bytes_per_token(element, dtype)
    per_seq = layouts.cache_bytes(context, 1, element, dtype)
    row = {"label": variant_label(cfg.attention, num_layers=cfg.model.num_layers), "per_token": per_token,
           "per_seq": per_seq, "naive": per_token * context, "fit": budget // per_seq if per_seq else None,
           "read": layouts.read_bytes(context, 1, element, dtype),
           "node": None if node is None else node_figures(cfg, layouts, element, context, node)}
    try:  # a layer no serving store pages yet (DeepSeek-V4's pool) has no allocator's plan, only the formula
        layouts.check({"workload.store": "paged"})
    except ConfigError as exc:
        return {**row, "allocators": None, "rate_note": f"no allocator: {exc}"}
    return {**row, "allocators": allocator_figures(layouts, element, dtype, cfg.cache.block_size, context, budget)}


def serve_rate(overrides: List[str], budget_mb: float, tmp: Path, requests: int = SERVE_REQUESTS) -> tuple:
    """(highest rate within the SLO, what bound it) of workload=serving's search, or (None, the refusal)."""
    out = tmp / str(len(list(tmp.iterdir())))
    run_job(compose_config([*overrides, *SERVE, f"workload.num_requests={requests}",
                            f"workload.kv_budget_mb={budget_mb}"]), out)
    record = read_record(out / "results.json")
    if record.status != "ok":  # a row of the report: the variant the serving store refuses says so
        return None, f"{record.status}: {record.error}"
    m = record.metrics
    if m.get("max_rate_under_slo") is None and m.get("max_rate_at_least") is not None:
        return m["max_rate_at_least"], "at least: no rate tried failed"
    if m.get("max_rate_under_slo") is None and m.get("max_rate_bound"):  # the lowest rate tried already failed
        return None, f"below {LOWEST_RATE:g} req/s, the lowest tried: {m['max_rate_bound']} missed"
    return m.get("max_rate_under_slo"), m.get("max_rate_bound")


def tiny_rate(overrides: List[str], precision: str, args, tmp: Path) -> Dict:
    """A tiny row's rate and its note: the search's answer, or why it was not run."""
    if args.no_serve:
        return {"rate_note": "not run (--no-serve)"}
    if precision != "auto" and not args.serve_all_precisions:
        return {"rate_note": "not run (auto's row only; --serve-all-precisions)"}
    rate, note = serve_rate(overrides, args.tiny_budget_mb, tmp, args.serve_requests)
    return {"rate": rate, "rate_note": note}


def node_cells(node: Optional[Dict]) -> List[str]:
    """A row's per-GPU cells (:func:`node_figures`); "-" where it has none (model=tiny, a dense model's EP)."""
    if node is None:
        return ["-"] * 6
    tp, ep = node["tp"], node["ep"]
    def seqs(row):
        return f"{row['sequences_per_gpu']:,.4g}"
    return [tp["split"] if tp else "-", f"{tp['kv_bytes_per_token_rank']:,.0f}" if tp else "-",
            f"{tp['kv_replication']:.3g}x" if tp else "-", seqs(tp) if tp else "-", seqs(node["dp"]),
            f"{seqs(ep)} ({ep['split']})" if ep else "-"]


def plot(rows: List[Dict], path: Path) -> bool:
    """Draw the sequences that fit per row to ``path``; False (nothing drawn) when no row fits one."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in rows if r.get("fit")]
    if not shown:  # a budget below one sequence everywhere: a log axis of zeros cannot be drawn
        return False
    fig, ax = plt.subplots(figsize=(10, 0.6 * len(shown) + 1.6))
    names = [f"{r['model']}  {r['label']}  {r['precision']}" for r in shown]
    def fit(allocator: str):  # 0 where no allocator plans the layers (the formula's bar alone)
        return lambda r: (r["allocators"] or {}).get(allocator, {}).get("fit", 0)
    bars = (("formula", lambda r: r["fit"], "#4477aa"), ("per_kind", fit("per_kind"), "#228833"),
            ("unified", fit("unified"), "#ee6677"))
    height = 0.27
    for k, (name, value, colour) in enumerate(bars):
        ys = [i + (k - 1) * height for i in range(len(shown))]
        ax.barh(ys, [max(value(r), 0.5) for r in shown], height=height, color=colour, label=name)
        for y, r in zip(ys, shown):
            note = f" {value(r):,}" + (f"  ({r['rate']:.3g} req/s)" if k == 0 and r.get("rate") else "")
            ax.text(max(value(r), 0.5), y, note, va="center", fontsize=6)
    ax.set_yticks(range(len(shown)), names, fontsize=7)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.legend(fontsize=7, loc="lower right")
    ax.set_xlabel("sequences at the context that fit the KV budget (computed, not measured; log scale)")
    ax.set_title("Capacity per layout and KV precision: by the layouts' formula and by each allocator's plan\n"
                 "presets at their context and budget; model=tiny at its own (in brackets: its highest rate "
                 "in the SLO, measured)", fontsize=8)
    fig.subplots_adjust(left=0.36, right=0.9, top=0.96, bottom=0.04)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: Optional[List[str]] = None) -> None:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=positive_int, default=8192)
    parser.add_argument("--budget-gb", type=positive_float, default=40.0)
    parser.add_argument("--tiny-context", type=positive_int, default=512)
    parser.add_argument("--tiny-budget-mb", type=positive_float, default=2.0)
    parser.add_argument("--no-serve", action="store_true", help="formula only: no rate search")
    parser.add_argument("--serve-all-precisions", action="store_true",
                        help="a rate search for every tiny row, not only cache.dtype=auto's")
    parser.add_argument("--serve-requests", type=positive_int, default=SERVE_REQUESTS,
                        help="requests per run of a rate search")
    parser.add_argument("--presets", nargs="+", default=list(PRESETS), metavar="MODEL",
                        help=f"the model presets of the table's top half (default: {' '.join(PRESETS)})")
    parser.add_argument("--out", type=out_file, default=OUT)
    args = parser.parse_args(argv)
    known = sorted(p.stem for p in (ROOT / "conf" / "model").glob("*.yaml"))
    for name in args.presets:
        if name not in known:
            parser.error(f"argument --presets: {name!r}: not a model preset (one of {', '.join(known)})")
    for option, value, unit in (("--budget-gb", args.budget_gb, 1e9), ("--tiny-budget-mb", args.tiny_budget_mb, 1e6)):
        if int(value * unit) < 1:  # the budgets are whole bytes: less than one is none at all
            parser.error(f"argument {option}: {value!r}: less than one byte")
    torch.set_num_threads(1)
    rows: List[Dict] = []
    budget = int(args.budget_gb * 1e9)
    weights: Dict = {}  # a GPU's weights by (model, split): every precision's row shares them
    for model in args.presets:
        for precision in PRESET_PRECISIONS:
            over = [f"model={model}", "runtime.dtype=bfloat16", f"cache.dtype={precision}"]
            rows.append({"model": model, "precision": precision, "context": args.context, "budget": budget,
                         "rate_note": "not run (formula only)", **formula_row(over, args.context, budget, weights)})
    tiny_budget = int(args.tiny_budget_mb * 1e6)
    load = [load_average()]  # the rate searches are timed: how busy the machine was while they ran
    with tempfile.TemporaryDirectory() as tmp:
        if not args.no_serve:  # one untimed search first: the process's first serving run pays its cold start
            # (lazy imports, first allocations) in its TTFT, which failed the first row's lowest rate (MHA:
            # "below 2 req/s" here, up to 64 in a process of its own)
            serve_rate(["model=tiny", f"attention={TINY[0][0]}", *TINY[0][1]], args.tiny_budget_mb, Path(tmp),
                       args.serve_requests)
        for attention, extra in TINY:
            for precision in PRECISIONS:
                over = ["model=tiny", f"attention={attention}", *extra, f"cache.dtype={precision}"]
                row = {"model": "tiny", "precision": precision, "context": args.tiny_context, "budget": tiny_budget,
                       **formula_row(over, args.tiny_context, tiny_budget)}
                if "refused" not in row:
                    row.update(tiny_rate(over, precision, args, Path(tmp)))
                rows.append(row)
    load.append(load_average())
    command = " ".join(["python experiments/capacity_report.py", *(argv if argv is not None else sys.argv[1:])])
    busy = f" (load average {load[0]:.1f} -> {load[1]:.1f} while they ran)" if None not in load else ""
    rate_how = ("not run (--no-serve)" if args.no_serve else "from workload=serving's rate search on a shared "
                f"2-core CPU{busy} with slo.ttft_ms=250 and slo.tpot_ms=40 at p99, {args.serve_requests} requests a "
                "run, from 2 req/s doubling, at most 6 runs, "
                f"{'every row' if args.serve_all_precisions else 'the cache.dtype=auto rows'}")
    lines = [
        "# Capacity per layout and KV precision", "",
        f"Made by `{command}` (presets in bfloat16 at {args.context} tokens and a {args.budget_gb:g} GB KV budget, "
        f"nothing run; model=tiny in float32 at {args.tiny_context} tokens and {args.tiny_budget_mb:g} MB, its "
        f"highest rate {rate_how}). Every byte figure here is computed, none measured. Formula: the layouts' "
        "(`kvbench/layouts/`): per token, what one more token adds while no window is full; per sequence, every "
        "layer with its own positions (a window's W) and state; `x context` is per token x context, what an "
        "estimator that treats every layer as full attention gives; `fit` is budget // per sequence. Per "
        "allocator: the serving store's own plan (`kvbench/serving/allocator.py`, `workload.allocator`) of the "
        f"budget for requests of the context prefilled in chunks of {ServingWorkload.max_prefill_tokens} (the "
        "serving default, which sets per_kind's split): `block`, its attention block in tokens (unified raises it "
        "until a page holds a state); `/ seq`, what one sequence at the context reserves at its worst while it "
        "decodes (block rounding, a window's blocks kept whole, its state page); `fit`, the sequences at the "
        "context its pools hold at once beside the room one prefill chunk adds to a window's ring (the scarcest "
        "pool decides); `reserved`, what those sequences reserve. "
        "The same figures for a served run are in its record (`kv_sequence_reserved_bytes`, `kv_sequences_fit`, "
        "`kv_reserved_bytes`) and in `kvbench-report`'s serving capacity table (docs/capacity.md). Per GPU (the "
        f"presets), on a node of {NODE_GPUS} GPUs of {GPU_GB:g} GB, {MEMORY_FRACTION:g} of each for weights and KV "
        "(kvbench/parallel/, task=capacity's `tables.per_gpu`; experiments/results/capacity_per_gpu.md has every "
        "split): `TP`, the largest tensor-parallel split that cuts the model into whole heads and widths; its `KV "
        "/ token / GPU`, one rank's part (heads split, a layout of fewer heads than ranks replicated), and "
        "`replication`, what the ranks hold of a sequence together over one copy's; `seqs / GPU`, a GPU's budget "
        "less its weights (heads, widths, experts and vocabulary cut as the ranks run them) // its part of a "
        "sequence, over the node's GPUs, under that TP, under `DP` (a whole copy a GPU: 0 where the weights do not "
        "fit) and under the expert-parallel split that fits most (`EP`, named).", "",
        "| model | variant | KV precision | context | budget | bytes / token | bytes / sequence | x context | fit "
        "(formula) | per_kind / seq | per_kind fit | per_kind reserved | unified block | unified / seq | "
        f"unified fit | unified reserved | TP | KV / token / GPU (TP) | replication (TP) | seqs / GPU (TP) | "
        f"seqs / GPU (DP={NODE_GPUS}) | seqs / GPU (EP) | highest rate in SLO (req/s) | note |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|"
        "---:|---|"]
    for r in rows:
        if "refused" in r:
            lines.append(f"| {r['model']} | | {r['precision']} |{' |' * 20} refused: {r['refused']} |")
            continue
        rate = f"{r['rate']:.3g}" if r.get("rate") else "-"
        note = (r.get("rate_note") or "").replace("|", "/")
        cells = [r["model"], r["label"], r["precision"], str(r["context"]), human_bytes(r["budget"]),
                 f"{r['per_token']:,}", human_bytes(r["per_seq"]), human_bytes(r["naive"]), f"{r['fit']:,}"]
        if r["allocators"] is None:
            cells += ["-"] * 7
        else:
            pk, un = r["allocators"]["per_kind"], r["allocators"]["unified"]
            cells += [human_bytes(pk["per_seq"]), f"{pk['fit']:,}", human_bytes(pk["reserved"]), str(un["block"]),
                      human_bytes(un["per_seq"]), f"{un['fit']:,}", human_bytes(un["reserved"])]
        lines.append("| " + " | ".join(cells + node_cells(r["node"]) + [rate, note]) + " |")
    out = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    drawn = plot(rows, out.parent / PLOT)
    lines += ["", f"![sequences that fit per layout and precision]({PLOT})" if drawn else
              "(no plot: no row's budget holds one sequence at its context)", ""]
    write_report(out, "\n".join(lines), keys=3)  # model, variant, KV precision name a row
    if out == OUT and drawn:
        shutil.copyfile(out.parent / PLOT, ROOT / "docs" / PLOT)


if __name__ == "__main__":
    run_main(main)
