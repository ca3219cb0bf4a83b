"""Local side-by-side report of a run or a sweep: ``summary.csv``, ``summary.md`` and PNG plots.

Reads only the results.json records (and, for a job that left none, the ``.hydra/`` files Hydra
wrote when the job started), so it works on any directory, with or without W&B, during or after a
sweep. Every job is a row, whatever its status (``running``, ``missing`` and ``unreadable`` included).
"""

from __future__ import annotations

import csv
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import yaml

from kvbench.jobs.claim import claim_holder
from kvbench.jsonio import atomic_write, write_text_atomic
from kvbench.measure.stats import kv_cost_fit
from kvbench.results import RESULTS_FILE, RecordError, find_results, read_record
from kvbench.sinks import capacity as capacity_sink
from kvbench.sinks import per_gpu as per_gpu_sink
from kvbench.sinks import recall as recall_sink
from kvbench.sinks import serving as serving_sink
from kvbench.sinks import serving_plots
from kvbench.sinks.choose import RULES, choices
from kvbench.sinks.comparison import UNTESTED, comparisons
from kvbench.sinks.interleaved import interleaved_notes, interleaved_table
from kvbench.sinks.markdown import md_text
from kvbench.sinks.plots import draw_all  # matplotlib is imported only when drawing
from kvbench.sinks.tables import (
    AXES,
    COLUMNS,
    KIND_TITLES,
    VARIANT_AXES,
    VARIANT_KEYS,
    Axis,
    by_kind,
    job_cells,
    job_columns,
    natural,
    swept_axes,
    table_axes,
    viewed,
)
from kvbench.sinks.views import Variant, views
from kvbench.units import count

CSV_FILE, MD_FILE = "summary.csv", "summary.md"


@dataclass
class Report:
    """What :func:`write_report` wrote and what it found."""

    root: Path
    records: List[Dict[str, Any]]
    axes: List[Axis]
    files: List[Path] = field(default_factory=list)
    skipped_plots: Dict[str, str] = field(default_factory=dict)
    plots_note: str = ""  # why no plot was tried at all

    def counts(self) -> Dict[str, int]:
        out: Dict[str, int] = {}
        for rec in views(self.records):
            out[rec.status] = out.get(rec.status, 0) + 1
        return out


def _rel(path: Path, root: Path) -> str:
    return str(path.relative_to(root))


def _hidden(path: Path, root: Path) -> bool:
    # W&B run directories and dot-directories never hold a job's own record.
    return any(p == "wandb" or p.startswith(".") for p in path.relative_to(root).parts[:-1])


def _read_yaml(path: Path) -> Any:
    if not path.is_file():  # a FIFO would block the read
        return None
    try:
        return yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return None


def collect(root: Path | str) -> List[Dict[str, Any]]:
    """One record per job under ``root`` (a job directory or a sweep), each with ``job`` (its
    path relative to ``root``) and ``status``; jobs without results.json come from ``.hydra/``."""
    root = Path(root)
    records: Dict[str, Dict[str, Any]] = {}
    unlisted: List[Tuple[Path, OSError]] = []
    for path in find_results(root, unlisted):
        if _hidden(path, root):
            continue
        job = _rel(path.parent, root)
        try:
            rec = read_record(path).to_dict()
        except RecordError as exc:
            config, overrides = (_read_yaml(path.parent / ".hydra" / name) for name in ("config.yaml",
                                                                                       "overrides.yaml"))
            rec = {"status": "unreadable", "error": f"{path.name}: {str(exc).removeprefix(str(path) + ': ')}",
                   "config": config if isinstance(config, dict) else {}, "metrics": {},
                   "overrides": overrides if isinstance(overrides, list) else []}
        rec["job"] = job
        records[job] = rec
    for directory, exc in unlisted:  # a job directory kvbench may not read: a row saying so
        if not _hidden(directory / RESULTS_FILE, root):
            records[_rel(directory, root)] = {"job": _rel(directory, root), "status": "unreadable", "config": {},
                                              "metrics": {}, "overrides": [],
                                              "error": f"{directory}: cannot be listed ({exc.strerror or exc})"}
    for overrides_file in root.rglob(".hydra/overrides.yaml"):
        job_dir = overrides_file.parent.parent
        job = _rel(job_dir, root)
        if job in records or _hidden(overrides_file.parent, root):
            continue
        config = _read_yaml(job_dir / ".hydra" / "config.yaml") or {}
        if isinstance(config, dict) and config.get("task") == "inspect":
            continue  # inspect jobs print a table and write no record by design
        holder = claim_holder(job_dir)
        overrides = _read_yaml(overrides_file)
        records[job] = {"job": job, "status": "running" if holder else "missing",
                        "config": config if isinstance(config, dict) else {},
                        "overrides": overrides if isinstance(overrides, list) else [], "metrics": {},
                        "error": f"claimed by {holder}" if holder else
                        "no results.json: the job was killed or has not finished"}
    return [viewed(records[k]) for k in sorted(records, key=natural)]  # job 10 after job 9


def metric_columns(records: Sequence[Dict[str, Any]]) -> List[str]:
    """Every scalar metric any record has: the tables' columns first, then alphabetical."""
    keys = {k for r in views(records) for k, v in r.metrics.items()
            if isinstance(v, (int, float, str, bool)) or v is None}
    head = [c.key for columns in COLUMNS.values() for c in columns if c.key in keys]
    head = list(dict.fromkeys(head))  # a column several kinds share, once
    return head + sorted(keys - set(head))


def write_csv(path: Path, records, axes) -> None:
    csv_axes = axes + [a for a in AXES if a[0] not in {k for k, _ in axes}]
    metrics = metric_columns(records)

    def write(f) -> None:
        writer = csv.writer(f)
        writer.writerow(["job", "status", *[k for k, _ in csv_axes], *metrics, "error", "overrides"])
        for rec in views(records):
            writer.writerow([rec.job, rec.status, *[_cell(rec.get(k)) for k, _ in csv_axes],
                             *[_cell(rec.metric(k)) for k in metrics],
                             _cell(rec.error), _cell(" ".join(rec.overrides))])

    atomic_write(path, write, newline="")


# A spreadsheet runs a cell that starts with one of these as a formula (CSV injection, OWASP):
# text from a config or an error message that starts so is written behind a quote.
_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def _cell(value: Any) -> Any:
    if value is None:
        return ""
    if isinstance(value, str) and value.startswith(_FORMULA_START):
        return "'" + value
    return value


def _md_escape(text: Any) -> str:
    """A table cell's text as Markdown shows it literally: no raw HTML, no live link, no column breaks."""
    return md_text(text)


def _md_table(header: Sequence[str], rows: Sequence[Sequence[str]], right: int = 0) -> List[str]:
    """A markdown table; the last ``right`` columns right-aligned."""
    align = ["---"] * (len(header) - right) + ["---:"] * right
    return (["| " + " | ".join(_md_escape(h) for h in header) + " |", "|" + "|".join(align) + "|"]
            + ["| " + " | ".join(_md_escape(c) for c in row) + " |" for row in rows])


def _comparison_md(records, axes) -> List[str]:
    lines: List[str] = []
    for comparison in comparisons(records, axes):
        header, rows, _ = comparison.table()
        lines += [f"### {_md_escape(comparison.title())}", "", *_md_table(header, rows, len(comparison.variants)), ""]
        notes = comparison.legend() + comparison.notes
        lines += [f"- {_md_escape(note)}" for note in notes] + ([""] if notes else [])
    if lines:
        lines = ["## Attention variants side by side", "",
                 "Each metric of a variant with its ratio to MHA of the same row: one job's value, or the median "
                 "of a config's repeated jobs (`runtime.seed` repeats a config). Separate jobs run at different "
                 "moments of the machine's load, which their own intervals leave out: a ratio of timed figures is "
                 f"*{UNTESTED}* unless each config ran as 4 or more jobs interleaved in time with the baseline's, "
                 "and is then tested on the spread between jobs. For ratios paired in one process use "
                 "`task=compare`.", ""] + lines
    return lines


def kv_cost_across_prompts(records: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Per variant and cell of the other swept axes, the Theil-Sen fit of ``decode_ms_p50`` against
    the mean context the decode steps attended (``prompt_len + (gen_len + 1) / 2``), with ratios to
    the cell's first variant; the KV bytes are compared at a prompt length both ran."""
    decode = [r for r in views(records) if r.ok and r.kind == "decode" and r.number("decode_ms_p50") is not None]
    others = [k for k, _ in swept_axes(decode) if k != "workload.prompt_len" and k not in VARIANT_KEYS]
    groups: Dict[tuple, Dict[str, list]] = {}
    variants: Dict[str, Variant] = {}
    for rec in decode:
        prompt, gen = rec.prompt_len, rec.gen_len
        if prompt is None or gen is None:
            continue
        cell = tuple((k, rec.get(k)) for k in others)
        variants[rec.variant.label] = rec.variant
        points = groups.setdefault(cell, {}).setdefault(rec.variant.label, [])
        points.append((prompt + (gen + 1) / 2, rec.number("decode_ms_p50"), prompt,
                       rec.metric("kv_cache_bytes_formula")))
    rows: List[Dict[str, Any]] = []
    for cell in sorted(groups, key=repr):
        base = None
        for label in sorted(groups[cell], key=lambda label: variants[label].order):
            points = groups[cell][label]
            fit = kv_cost_fit([p[0] for p in points], [p[1] for p in points])
            if fit["us_per_1k_ctx"] is None:
                continue
            row = {**dict(cell), "variant": label, "prompts": len({p[2] for p in points}), **fit,
                   "kv_bytes": {p[2]: p[3] for p in points}, "slope_ratio": None, "kv_bytes_ratio": None}
            if base is None:
                base = row
            else:
                if base["us_per_1k_ctx"]:
                    row["slope_ratio"] = row["us_per_1k_ctx"] / base["us_per_1k_ctx"]
                shared = [q for q in row["kv_bytes"] if row["kv_bytes"][q] and base["kv_bytes"].get(q)]
                if shared:
                    row["kv_bytes_ratio"] = row["kv_bytes"][shared[0]] / base["kv_bytes"][shared[0]]
            row["baseline"] = base["variant"]
            rows.append(row)
    return rows


def _kv_cost_md(records) -> List[str]:
    rows = kv_cost_across_prompts(records)
    if not rows:
        return []
    cells = [k for k in rows[0] if "." in k]  # the other swept axes (config keys are dotted)
    num = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    table = [[*(str(r[k]) for k in cells), r["variant"], str(r["prompts"]), num(r["at_ctx0_ms"], ".3f"),
              num(r["us_per_1k_ctx"], ".1f") + (f" [{num(r['us_per_1k_ctx_ci_low'], '.1f')}, "
                                                f"{num(r['us_per_1k_ctx_ci_high'], '.1f')}]"
                                                if r["us_per_1k_ctx_ci_low"] is not None else ", no interval"),
              num(r["slope_ratio"], ".3f"), num(r["kv_bytes_ratio"], ".3f")] for r in rows]
    return ["## KV cost across prompt lengths", "",
            "Per variant, the jobs' decode p50 against the mean context their steps attended, fitted by "
            "Theil-Sen (one job per prompt length: the interval is over jobs, not trials). Ratios are to the "
            "first variant of the same cell; if the context cost were only the K/V bytes read, the slope "
            "ratio would equal the KV bytes ratio. A fit of fewer than 6 jobs has no interval "
            "(docs/statistics.md).", "",
            *_md_table([*cells, "variant", "prompts", "ms at context 0", "µs per 1k context [95%]",
                        "slope ratio", "KV bytes ratio"], table, 4), ""]


def _interleaved_md(records) -> List[str]:
    lines: List[str] = []
    for rec in views(records):
        header, rows = interleaved_table(rec)
        if rows:
            lines += [f"### job {_md_escape(rec.job)}: {_md_escape(rec.metric('rounds'))} rounds", "",
                      *_md_table(header, rows, len(header) - 1), ""]
            notes = interleaved_notes(rec)  # why a ratio has no interval, why a figure is negative
            lines += [f"- {_md_escape(note)}" for note in notes] + ([""] if notes else [])
    if lines:
        lines = ["## Interleaved comparisons (task=compare)", "",
                 "Variants of one model timed in one process, alternating trial by trial. Step times: median "
                 "over rounds [95% bootstrap interval]; the KV cost is the Theil-Sen slope of step time against "
                 "context; ratios are to the first variant, paired over rounds, *not significant* where their "
                 "interval holds 1. The KV bytes ratio is what the slope ratio would be if the context cost "
                 "were only the K/V bytes read.", ""] + lines
    return lines


def _recall_md(records) -> List[str]:
    """``task=recall``: accuracy per condition per variant, the gaps and the variants' costs."""
    lines: List[str] = []
    for group in recall_sink.groups(records):
        header, rows = recall_sink.recall_table(group)
        lines += [f"## {_md_escape(recall_sink.title(group))}", "", *_md_table(header, rows, len(header) - 1), "",
                  _md_escape(recall_sink.COPY_NOTE) + ".", ""]
    left_out = recall_sink.malformed(records)
    if left_out:
        lines += [f"{left_out} recall record{'s' if left_out > 1 else ''} left out: its accuracy table is malformed "
                  "(a row without a condition or with per-seed accuracies outside [0, 1]).", ""]
    return lines


def _choose_md(records, plots: Sequence[Path] = ()) -> List[str]:
    """The article's table per cell of the capacity jobs, and the recommendations it supports;
    ``plots``: those drawn (a plot not drawn is not named)."""
    found = choices(records)
    if not found:
        return []
    lines = ["## Which attention to deploy", "",
             "Max batch under the memory budget and the SLOs at the longest context (`task=capacity`); decode "
             "ms at batch 1 there; one job per variant (no confidence interval). Recommendations follow these "
             "rules:", ""] + [f"- {scenario}: {rule}" for scenario, rule in RULES.items()] + [""]
    for choice in found:
        if choice.cell:
            lines += [f"### {_md_escape(choice.cell)}", ""]
        lines += [*_md_table(choice.header, choice.rows, len(choice.header) - 1), ""]
        if choice.context_rows:
            drawn = any(p.name == "capacity_vs_context.png" for p in plots)
            lines += ["Max batch at every context searched (what stopped it): the capacity as a function of the "
                      "context" + (" (`capacity_vs_context.png` plots it)" if drawn else "") + ":", "",
                      *_md_table(choice.context_header, choice.context_rows, len(choice.context_header) - 1), ""]
        if choice.chat_rows:
            lines += ["Multi-turn (`task=capacity workload=multiturn`): the most concurrent conversations of the "
                      "chat under the same budget and SLOs, with and without the shared cache:", "",
                      *_md_table(choice.chat_header, choice.chat_rows, len(choice.chat_header) - 1), ""]
        lines += [f"- **{_md_escape(scenario)}**: {_md_escape(line)}" for scenario, line in choice.recommendations]
        lines += [f"- note: {_md_escape(note)}" for note in choice.notes] + [""]
    return lines


def _flags_md(records) -> List[str]:
    """Figures that break a physical bound and runs whose KV layout is not the named model's own."""
    rows = [[rec.job, f"`{item.get('metric')}`", _cell(item.get("value")), item.get("bound") or "",
             item.get("reason") or ""] for rec in views(records) for item in rec.implausible]
    conversions = [[rec.job, rec.kv_conversion.get("text", "")] for rec in views(records) if rec.kv_conversion]
    lines: List[str] = []
    if rows:
        lines += ["## Implausible figures", "",
                  "Figures that break a physical bound of the machine they were measured on (the bandwidth "
                  "probed, the roofline, NVML's power limit, an allocation, their own interval): kept, not "
                  "to be read as true.", "", *_md_table(["job", "metric", "value", "bound", "why"], rows), ""]
    if conversions:
        lines += ["## KV layouts that are not the model's own", "",
                  *_md_table(["job", "conversion"], conversions), ""]
    return lines


def markdown(report: Report, plots: Sequence[Path]) -> str:
    """The report as markdown."""
    records, axes = report.records, report.axes or VARIANT_AXES
    counts = ", ".join(f"{n} {s}" for s, n in report.counts().items())
    lines = [f"# kvbench report: {_md_escape(report.root)}", "", f"{count(len(records), 'job')}: {counts}.", ""]
    lines += _choose_md(records, plots) + _recall_md(records) + serving_sink.markdown(records, axes)
    lines += capacity_sink.markdown(records) + per_gpu_sink.markdown(records)
    lines += _interleaved_md(records) + _comparison_md(records, axes) + _kv_cost_md(records)
    groups = by_kind(records)
    for kind_name, group in groups.items():
        job_axes_ = table_axes(group, axes, kind_name)
        columns = job_columns(group, kind_name)
        rows = [[rec.job, *values, rec.status_text, *metrics]
                for rec in views(group) for values, metrics in [job_cells(rec, job_axes_, columns)]]
        title = "Results" + (f": {KIND_TITLES.get(kind_name, kind_name)}" if len(groups) > 1 else "")
        lines += [f"## {title}", "",
                  *_md_table(["job", *[t for _, t in job_axes_], "status", *[c.title for c in columns]], rows,
                             len(columns)), ""]
    lines += _flags_md(records)
    failed = [r for r in views(records) if not r.ok]
    if failed:
        lines += ["## Jobs that are not ok", ""]
        overrides = [" ".join(rec.overrides) or "(defaults)" for rec in failed]
        lines += _md_table(["job", "status", "overrides", "error"],
                           [[rec.job, rec.status_text, "`" + o.replace("`", "'") + "`", rec.error or ""]
                            for rec, o in zip(failed, overrides)])
        lines.append("")
    lines += ["## Plots", ""]
    for png in plots:
        lines += [f"![{png.stem}]({png.name})", ""]
    if report.plots_note:
        lines.append(f"Not drawn: {report.plots_note}.")
    for name, why in report.skipped_plots.items():
        lines.append(f"- `{name}.png` not drawn: {why}")
    lines.append(f"\nAll columns, every metric and the overrides: `{CSV_FILE}`.")
    return "\n".join(lines) + "\n"


def write_report(root: Path | str, out_dir: Optional[Path | str] = None, plots: bool = True,
                 records: Optional[List[Dict[str, Any]]] = None) -> Report:
    """Every job under ``root`` (or the given ``records``: the sweep that just ended) into
    ``summary.csv``, ``summary.md`` and plots in ``out_dir`` (default ``root``)."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"no such directory: {root}")
    records = collect(root) if records is None else [viewed(r) for r in records]
    if not records:
        raise ValueError(f"no {RESULTS_FILE} and no Hydra job directory (.hydra/overrides.yaml) under {root}")
    out = Path(out_dir) if out_dir is not None else root
    out.mkdir(parents=True, exist_ok=True)
    report = Report(root, records, swept_axes(records))
    # The tables first, then the plots (slow on a large sweep): an interruption or a plot that
    # fails never costs summary.csv and summary.md, which are rewritten with the plots after.
    report.plots_note = ("plots were turned off (`kvbench-report DIR` draws them)" if not plots
                         else "the plots were not drawn (interrupted; `kvbench-report DIR` draws them)")
    write_csv(out / CSV_FILE, records, report.axes)
    write_text_atomic(out / MD_FILE, markdown(report, []))
    pngs: List[Path] = []
    if plots:
        pngs, report.skipped_plots = draw_all(records, report.axes, out)
        serving_pngs, serving_skipped = serving_plots.draw(records, report.axes, out)
        pngs, report.skipped_plots = pngs + serving_pngs, {**report.skipped_plots, **serving_skipped}
        report.plots_note = ""
        write_text_atomic(out / MD_FILE, markdown(report, pngs))
    report.files = [out / CSV_FILE, out / MD_FILE, *pngs]
    return report
