"""A W&B workspace (dashboard) for a sweep, built from its records with ``wandb-workspaces``.

The workspace shows the sweep's runs only (its W&B group), grouped by attention variant, in
:data:`SECTIONS` after a parallel-coordinates overview. Panels are chosen from what the records
hold: a numeric swept axis is a scatter plot's x, the variant and other categorical axes group bar
plots, and a chart's metrics share one unit (from the records' registry), which its title names.

Keys are written the way :mod:`tracking` records a run (config keys as ``wr.Config("a.b")``, which
W&B stores as ``a.value.b`` for the nested run config). Offline (the default) the spec is written
beside the report as ``workspace.json`` and ``workspace.md``; :func:`publish` saves it to W&B.
``wandb_workspaces`` is imported only when a workspace is built.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from kvbench.core.errors import one_line
from kvbench.jsonio import write_json_atomic, write_text_atomic
from kvbench.sinks.tables import VARIANT_KEYS, Axis, determined_by, swept_axes
from kvbench.sinks.tracking import STEP_AXIS, TABLE_STEPS, UNREACHABLE_MARKER, resolve_mode, sweep_group
from kvbench.sinks.views import views

WORKSPACE_JSON, WORKSPACE_MD = "workspace.json", "workspace.md"
# Section -> its charts, each a family of metrics in one unit and scale (a bar chart's bars), the
# headline first. The first HEADLINE families a sweep has get panels; a family's first
# SCATTERED metrics each get a scatter plot per numeric axis.
SECTIONS: Dict[str, Tuple[Tuple[str, ...], ...]] = {
    "Latency": (("decode_ms_p50", "decode_ms_p99"), ("prefill_ms",), ("turn1_ttft_ms", "mean_ttft_ms_turns_2_n"),
                ("decode_ms_p50_longest",), ("decode_us_per_1k_ctx",)),
    "Memory": (("kv_cache_bytes", "kv_cache_bytes_formula", "kv_cache_bytes_torch", "kv_cache_bytes_nvml"),
               ("peak_rss_bytes",), ("nvml_peak_used_bytes", "torch_peak_allocated_bytes"),
               # beside the bytes a token adds, what a sequence holds whatever its length (a Gated DeltaNet state)
               ("kv_bytes_per_token", "kv_state_bytes_per_sequence")),
    "Throughput": (("tokens_per_s",), ("tokens_per_s_longest",), ("max_batch_longest",), ("achieved_gb_per_s",),
                   ("percent_of_peak",)),
    "Quality": (("perplexity", "ppl_before_uptrain"), ("val_loss",), ("bits_per_byte",),
                ("fidelity_max_abs_logit_diff", "dtype_max_abs_logit_diff"), ("dtype_top1_agreement",)),
}
HEADLINE, SCATTERED = 3, 2
STEPPED = {"Latency": ("decode_ms",)}  # per-step series drawn against STEP_AXIS, per section
FORMULA_VS_MEASURED = ("kv_cache_bytes_formula", "kv_cache_bytes")
TURNS = "turns"


@dataclass
class Dashboard:
    """A sweep's workspace, the axes its panels use and (after :func:`write_dashboard`) its files."""

    workspace: Any
    axes: List[Axis]
    group: Optional[str]
    files: List[Path] = field(default_factory=list)

    def panels(self) -> List[Tuple[str, Any]]:
        """(section name, panel) for every panel, in order."""
        return [(s.name, p) for s in self.workspace.sections for p in s.panels]


def _numbers(records: Sequence[Any], key: str) -> bool:
    return any(r.number(key) is not None for r in views(records))


def _numeric_axis(records: Sequence[Any], key: str) -> bool:
    values = [r.get(key) for r in views(records)]
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values if v is not None)


def unit_of(records: Sequence[Any], metric: str) -> Optional[str]:
    """The unit of ``metric`` in the first record that declares one."""
    return next((u for r in views(records) if (u := r.unit(metric)) is not None), None)


def _in(unit: Optional[str]) -> str:
    return f" ({unit})" if unit else ""


def by_unit(records: Sequence[Any], family: Sequence[str]) -> List[Tuple[Optional[str], List[str]]]:
    """A family of metrics split into charts of one unit each: (unit, metrics), in the family's order."""
    out: Dict[Optional[str], List[str]] = {}
    for metric in family:
        out.setdefault(unit_of(records, metric), []).append(metric)
    return list(out.items())


def _finest(records: Sequence[Dict[str, Any]], axes: Sequence[Axis]) -> List[Axis]:
    """The variant axes that group the runs differently: the first of two that determine each other
    (``attention.type`` and ``num_kv_heads`` for mha vs mqa), else the finer (gqa kv=2 and kv=4)."""
    def redundant(a: Axis) -> bool:
        return any(determined_by(records, a[0], b[0]) and (not determined_by(records, b[0], a[0]) or i < axes.index(a))
                   for i, b in enumerate(axes) if b != a)
    return [a for a in axes if not redundant(a)]


def _wandb_settings(records: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """The sweep's ``wandb`` config (its first record that has one)."""
    for rec in views(records):
        cfg = rec.config.get("wandb")
        if isinstance(cfg, dict):
            return cfg
    return {}


def build(records: Sequence[Dict[str, Any]], sweep_dir: Optional[Path | str] = None,
          entity: Optional[str] = None) -> Dashboard:
    """The workspace of a sweep's records; ``entity`` defaults to the records' ``wandb.entity``."""
    import wandb_workspaces.reports.v2 as wr
    import wandb_workspaces.workspaces as ws

    settings = _wandb_settings(records)
    group = settings.get("group") or sweep_group(sweep_dir)
    axes = swept_axes(records)
    variant_axes = [a for a in axes if a[0] in VARIANT_KEYS]
    x_axes = [a for a in axes if a[0] not in VARIANT_KEYS and _numeric_axis(records, a[0])]
    bar_axes = _finest(records, variant_axes) + [a for a in axes if a not in variant_axes and a not in x_axes]
    present = {name: [kept for family in families if (kept := [m for m in family if _numbers(records, m)])]
               [:HEADLINE] for name, families in SECTIONS.items()}
    present = {name: [ms for family in families for _, ms in by_unit(records, family)]
               for name, families in present.items()}

    def titled(metrics: Sequence[str]) -> str:
        return ", ".join(metrics) + _in(unit_of(records, metrics[0]))

    def scatter(metric: str, axis: Axis):
        return wr.ScatterPlot(title=f"{titled([metric])} vs {axis[1]}", x=wr.Config(axis[0]),
                              y=wr.SummaryMetric(metric))

    def bars(metrics: Sequence[str], axis: Axis):
        return wr.BarPlot(title=f"{titled(metrics)} by {axis[1]}", metrics=list(metrics), groupby=wr.Config(axis[0]),
                          groupby_aggfunc="mean", groupby_rangefunc="minmax")

    headline = [families[0][0] for families in present.values() if families]
    sections = [ws.Section(name="Sweep", is_open=True, panels=[wr.ParallelCoordinatesPlot(
        title="swept axes and headline metrics",
        columns=[wr.ParallelCoordinatesPlotColumn(metric=wr.Config(k), display_name=t) for k, t in axes]
        + [wr.ParallelCoordinatesPlotColumn(metric=wr.SummaryMetric(m)) for m in headline])])]
    for name, families in present.items():
        metrics = [m for family in families for m in family]
        panels = [scatter(m, axis) for axis in x_axes for family in families for m in family[:SCATTERED]]
        panels += [bars(family, axis) for axis in bar_axes for family in families]
        if name == "Memory" and all(m in metrics for m in FORMULA_VS_MEASURED):
            kv_unit = _in(unit_of(records, "kv_cache_bytes"))
            panels.append(wr.ScatterPlot(title=f"KV bytes: formula vs measured{kv_unit}",
                                         x=wr.SummaryMetric(FORMULA_VS_MEASURED[0]),
                                         y=wr.SummaryMetric(FORMULA_VS_MEASURED[1])))
        stepped = [s for s in STEPPED.get(name, ()) if any(r.series(s) for r in views(records))]
        panels += [wr.LinePlot(title=f"{s}{_in(unit_of(records, f'series.{s}'))} per {STEP_AXIS}", x=STEP_AXIS,
                               y=[s]) for s in stepped]
        if panels:
            sections.append(ws.Section(name=name, panels=panels, is_open=name == "Latency"))
    turn_rows = [row for r in views(records) for row in r.table(TURNS)]
    if turn_rows:
        columns = sorted({c for row in turn_rows for c, v in row.items() if c != TABLE_STEPS[TURNS]
                          and isinstance(v, (int, float)) and not isinstance(v, bool)})
        per_turn = [c for c in ("ttft_ms", "decode_ms_p50", "kv_cache_bytes") if c in columns]
        sections.append(ws.Section(name="Multi-turn", panels=[
            wr.LinePlot(title=f"{c} per turn", x=TABLE_STEPS[TURNS], y=[f"{TURNS}/{c}"]) for c in per_turn]
            + [wr.WeavePanelSummaryTable(table_name=TURNS)]))
    groupby = [ws.Config(k) for k, _ in variant_axes] or [
        ws.Config(k) for k in VARIANT_KEYS[:2] if any(r.get(k) is not None for r in views(records))]
    workspace = ws.Workspace(
        entity=entity if entity is not None else (settings.get("entity") or ""),
        project=settings.get("project") or "kvbench", name=f"kvbench {group or 'sweep'}", sections=sections,
        # W&B draws 10 runs per panel by default: every job of the sweep
        settings=ws.WorkspaceSettings(max_runs=max(10, len(records))),
        runset_settings=ws.RunsetSettings(filters=ws.And(ws.Metric("Group") == group) if group else "",
                                          groupby=groupby))
    return Dashboard(workspace, axes, group)


def spec(dashboard: Dashboard) -> Dict[str, Any]:
    """The workspace as the library's model (``internal.View``) serialises it for W&B."""
    return dashboard.workspace._to_model().model_dump(mode="json", by_alias=True, exclude_none=True)


def describe(dashboard: Dashboard) -> str:
    """``workspace.md``: the runs shown and every panel, section by section."""
    w = dashboard.workspace
    lines = [f"# W&B workspace: {w.name}", "",
             f"Project `{w.project}`" + (f", entity `{w.entity}`" if w.entity else ", your default entity")
             + f"; runs of group `{dashboard.group}`" + "; grouped by "
             + (", ".join(f"`{g.name}`" for g in w.runset_settings.groupby) or "nothing") + ".",
             "Swept axes: " + (", ".join(f"`{k}`" for k, _ in dashboard.axes) or "none") + ".", ""]
    for section in w.sections:
        lines += [f"## {section.name}", ""]
        lines += [f"- {_panel_text(p)}" for p in section.panels] + [""]
    return "\n".join(lines)


def _key(metric: Any) -> str:
    name = getattr(metric, "name", metric)
    return f"config `{name}`" if type(metric).__name__ == "Config" else f"`{name}`"


def _panel_text(panel: Any) -> str:
    kind = type(panel).__name__
    if kind == "ScatterPlot":
        return f"scatter: {_key(panel.y)} against {_key(panel.x)}"
    if kind == "BarPlot":
        return f"bars: {', '.join(map(_key, panel.metrics))} grouped by {_key(panel.groupby)} (mean, min-max)"
    if kind == "LinePlot":
        return f"line: {', '.join(map(_key, panel.y))} against `{panel.x}`"
    if kind == "ParallelCoordinatesPlot":
        return "parallel coordinates: " + ", ".join(_key(c.metric) for c in panel.columns)
    if kind == "WeavePanelSummaryTable":
        return f"table: each run's `{panel.table_name}` table"
    return kind


def publish_commands(sweep_dir: Path | str, runs_online: bool = False) -> List[str]:
    """The commands that put an offline sweep on W&B (only the workspace when the runs went online)."""
    sync = [] if runs_online else [f"wandb sync {Path(sweep_dir)}/*/wandb/offline-run-*"]
    return sync + [f"kvbench-dashboard {Path(sweep_dir)}"]


def tracked(records: Sequence[Dict[str, Any]]) -> bool:
    """Whether the sweep's jobs made W&B runs (its ``wandb.mode`` is not ``disabled``, here)."""
    try:
        return resolve_mode(_wandb_settings(records).get("mode", "offline")) != "disabled"
    except ValueError:
        return False


def write_dashboard(sweep_dir: Path | str, records: Sequence[Dict[str, Any]],
                    entity: Optional[str] = None) -> Dashboard:
    """Build the workspace and write ``workspace.json`` and ``workspace.md`` into ``sweep_dir``."""
    dashboard = build(records, sweep_dir, entity)
    out = Path(sweep_dir)
    write_json_atomic(out / WORKSPACE_JSON, spec(dashboard))
    write_text_atomic(out / WORKSPACE_MD, describe(dashboard))
    dashboard.files = [out / WORKSPACE_JSON, out / WORKSPACE_MD]
    return dashboard


def online(records: Sequence[Dict[str, Any]], sweep_dir: Path | str) -> bool:
    """Whether the sweep logged to W&B online (and reached it): then its end creates the workspace."""
    try:
        mode = resolve_mode(_wandb_settings(records).get("mode", "offline"))
    except ValueError:
        return False
    return mode == "online" and not (Path(sweep_dir) / UNREACHABLE_MARKER).exists()


class PublishError(RuntimeError):
    """The workspace could not be saved to W&B (no credentials, no network, a refusal)."""


def publish(dashboard: Dashboard, timeout_s: float = 30.0) -> str:
    """Save the workspace to W&B; its URL. Bounded by ``timeout_s``: W&B's client retries for minutes
    without a network."""
    import wandb

    outcome: Dict[str, Any] = {}

    def save() -> None:
        try:
            # no key: raises at once, never prompts; a server that never answers: the join below
            api = wandb.Api(timeout=max(1, math.ceil(timeout_s)))
            if not dashboard.workspace.entity:
                dashboard.workspace.entity = api.default_entity or ""
            outcome["url"] = dashboard.workspace.save().url
        except Exception as exc:  # noqa: BLE001 — reported by the caller's thread
            outcome["error"] = exc

    worker = threading.Thread(target=save, daemon=True)  # left behind if W&B never answers
    worker.start()
    worker.join(timeout_s)
    if "url" in outcome:
        return outcome["url"]
    if "error" in outcome:
        raise PublishError(_why(outcome["error"]))
    raise PublishError(f"W&B did not answer within {timeout_s:g} s")


def _why(exc: BaseException) -> str:
    return one_line(f"{type(exc).__name__}: {exc}")
