"""The package's map: every module sits on one layer and imports only from layers below it
(imports inside functions count), so the import graph has no cycles and nothing reaches back
up. Sinks read records; they import no code that runs a model.

    python -m pytest tests/test_layers.py -s    # also prints the graph's size
"""

import ast
import functools
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "kvbench"

# Bottom to top. A module may import modules of lower layers only.
LAYERS = [
    ["core.errors", "core.task", "core.hooks", "jsonio", "units", "units_v1", "metrics", "measure.host",
     "jobs.interrupts", "jobs.outcome", "jobs.forkserver", "serving.trace", "progress", "core.dtypes", "norm",
     "serving.pool", "measure.plausibility", "layouts.sharding", "parallel.vocab"],
    ["hf_weights", "blocks.hyper_connection", "config.quant", "serving.record", "layouts.base", "layouts.registry",
     "layouts.pages",
     "core.moe", "config.multipliers", "config.residual", "blocks.residual", "config.hyper", "core.hf_keys",
     "core.hf_read", "config.hf_agree", "mlp.dense", "mlp.router"],
    # what a kind's home builds on: chunked attention, NoPE layers and Llama 4's config.json
    ["layouts.chunked", "layouts.nope", "layouts.nope_attention", "layouts.llama4", "config.nope"],
    # the layer kinds' homes (each with its config block), then the registry of them all, which
    # every config module that asks about a kind sits above
    ["layouts.kv_heads", "layouts.recurrent", "layouts.latent_config", "quant_weights", "layouts.global_heads_hf",
     "layouts.mamba2_shard"],
    ["layouts.latent", "layouts.gated_deltanet", "layouts.mamba2", "layouts.compressed_layout", "layouts.kda",
     "layouts.kv_sharing", "layouts.global_heads"],
    ["layouts.compressed"],
    ["layouts.kinds"],
    ["layouts.build", "config.layer_options", "config.hf", "config.serving"],
    ["config.layer_pattern", "config.conversations", "serving.table_files", "serving.allocator", "serving.tokenize"],
    ["config.model", "config.recall", "config.capacity", "config.train", "config.record"],
    ["config.conversion", "config.workload", "config.compare", "rope", "quant4"],
    ["config.bench", "serving.arrivals", "kv_store", "state_cache", "shared_kv", "serving.conversation_traces",
     "parallel.plan"],
    ["cache", "serving.conversations", "jobs.job_config"],
    ["shared_prefix", "layouts.latent_indexer", "serving.batch"],
    ["layouts.kv_heads_attention", "layouts.latent_attention", "layouts.gated_deltanet_attention",
     "layouts.mamba2_mixer", "layouts.compressed_attention", "layouts.kda_mixer", "serving.managers"],
    ["layouts.attention", "mlp.experts", "layouts.global_heads_attention", "layouts.compressed_pages",
     "serving.pool_manager"],
    ["blocks.hyper_block", "mlp.beside"],
    ["model", "results", "measure.timing", "measure.memory", "measure.stats"],
    ["footprint", "sinks.views", "serving.metrics", "serving.paged", "serving.turn_metrics", "mlp.weights",
     "parallel.tensor"],
    ["checkpoint", "generate", "jobs.device", "measure.env", "measure.roofline", "jobs.claim", "serving.rate_search",
     "serving.scheduler", "parallel.per_gpu"],
    ["quality.data", "quality.fidelity", "quality.recall", "tasks.inspect", "tasks.capacity_search",
     "workloads.serving"],
    ["quality.train", "workloads.decode", "workloads.multiturn", "workloads.conversations", "tasks.common"],
    ["tasks.capacity_quality", "tasks.capacity_plan", "tasks.capacity_latency"],
    ["tasks.bench", "tasks.train", "tasks.eval", "tasks.capacity", "tasks.compare", "tasks.recall",
     "parallel.launch"],
    ["jobs.runner"],
    ["jobs.isolation", "jobs.sweep"],
    ["sinks.grid", "sinks.tables", "sinks.tracking", "sinks.markdown"],
    ["sinks.serving", "sinks.comparison"],
    ["sinks.choose", "sinks.dashboard", "sinks.recall", "sinks.interleaved", "sinks.capacity", "sinks.per_gpu"],
    ["sinks.console", "sinks.plots"],
    ["sinks.serving_plots"],
    ["sinks.report"],
    ["cli_job", "cli_tools", "cli_help"],
    ["cli_sweep"],
    ["cli"],
    ["entry"],
]
# What a sink may import: the record, how numbers are written, the statistics over them (no
# measuring), what a metric is, file I/O, who holds a job (its claim), and other sinks.
SINK_ALLOWED = ("results", "units", "metrics", "config.", "core.", "measure.stats", "jsonio", "jobs.claim",
                "sinks.")


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def kvbench_imports(path: Path):
    """(line, imported module) for every import of a kvbench module anywhere in the file."""
    tree = ast.parse(path.read_text())
    here = module_name(path).split(".")
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = here[: len(here) - node.level + (1 if path.name == "__init__.py" else 0)]
                module = ".".join(["kvbench", *base, *(node.module.split(".") if node.module else [])])
            else:
                module = node.module or ""
            # `from kvbench.workloads import decode` imports the submodule kvbench.workloads.decode
            names = [f"{module}.{a.name}" for a in node.names] + [module]
        else:
            continue
        for name in names:
            if name == "kvbench" or name.startswith("kvbench."):
                yield node.lineno, name


@functools.cache  # parsed once for the six tests that read it (the package's 145 files: ~0.5 s a pass)
def graph():
    """module -> {imported module}, over the package's real modules (packages resolved); the tests
    only read it."""
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    edges = {}
    for mod, path in files.items():
        targets = set()
        for _, name in kvbench_imports(path):
            name = name.removeprefix("kvbench").lstrip(".")
            # the longest prefix that is a module of the package (drops imported names)
            while name and name not in files:
                name = name.rpartition(".")[0]
            # A package's __init__ (imported on the way to its modules) is checked on its own.
            if name and name != mod and files[name].name != "__init__.py":
                targets.add(name)
        edges[mod] = targets
    return files, edges


def layer_of():
    return {mod: i for i, layer in enumerate(LAYERS) for mod in layer}


def test_every_module_has_a_layer():
    files, _ = graph()
    modules = {m for m, p in files.items() if p.name != "__init__.py"}
    assert modules == set(layer_of()), (
        f"place new modules in LAYERS: missing {sorted(modules - set(layer_of()))}, "
        f"gone {sorted(set(layer_of()) - modules)}")


def test_package_inits_import_nothing():
    files, edges = graph()
    assert {m: sorted(t) for m, t in edges.items() if files[m].name == "__init__.py" and t} == {}


def test_imports_only_run_down_the_layers():
    layer = layer_of()
    files, edges = graph()
    upward = [f"{m} (layer {layer[m]}) imports {t} (layer {layer[t]})"
              for m, targets in edges.items() if m in layer for t in sorted(targets) if layer[t] >= layer[m]]
    assert upward == []


def test_no_import_cycles():
    _, edges = graph()
    state = {}

    def visit(node, stack):
        state[node] = "open"
        for nxt in edges.get(node, ()):
            if state.get(nxt) == "open":
                pytest.fail("import cycle: " + " -> ".join(stack[stack.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for node in edges:
        if node not in state:
            visit(node, [node])


def test_sinks_read_records_and_run_nothing():
    _, edges = graph()
    bad = [f"{m} imports {t}" for m, targets in edges.items() if m.startswith("sinks.")
           for t in sorted(targets) if not t.startswith(SINK_ALLOWED)]
    assert bad == []


def test_graph_size(capsys):
    files, edges = graph()
    n_edges = sum(len(t) for t in edges.values())
    with capsys.disabled():
        print(f"\nkvbench import graph: {len(files)} files ({sum(p.name != '__init__.py' for p in files.values())}"
              f" modules), {len(LAYERS)} layers, {n_edges} import edges between kvbench modules")
    assert n_edges > 0


MAX_MODULE_LINES = 450
LAYOUT_PAGE = PACKAGE.parent / "docs" / "layout.md"


def test_no_module_is_over_450_lines():
    """A module past 450 lines has grown a second owner: split it along its owners."""
    files, _ = graph()
    long = {m: n for m, p in files.items() if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}


def test_the_docs_layout_page_lists_the_layers():
    """docs/layout.md's table is LAYERS: every module, on its layer, in this order."""
    rows = re.findall(r"^\| (\d+) \| `([\w.]+)` \|", LAYOUT_PAGE.read_text(), re.M)
    assert [(int(layer), mod) for layer, mod in rows] == [(i, m) for i, layer in enumerate(LAYERS) for m in layer]


def test_every_package_ships_in_the_wheel():
    """pyproject lists the packages a wheel holds (setuptools does not find them itself there): a
    package missing from the list works in an editable install and is absent from a real one."""
    import tomllib

    listed = set(tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {module_name(p) for p in PACKAGE.rglob("__init__.py")}
    assert {f"kvbench.{name}" if name else "kvbench" for name in found} <= listed


# Outside its home under kvbench/layouts/ nothing names a layer kind (issue 54): the rest asks the
# registry (kvbench.layouts.kinds). What still does, and why: config.hf (the one reader of config.json:
# its architectures' attention switches, rope and window keys), config.hf_agree (keys of a config.json
# that say one thing twice, below the registry) and config.model (the attention group's Hydra schema,
# whose fields, keys users override and records keep, are the kinds' own).
KIND_WORDS = {"gated_deltanet|gdn|linear_attention": {"config.hf", "config.hf_agree", "config.model"},
              "latent|index_topk": {"config.hf", "config.hf_agree", "config.model"}}


@pytest.mark.parametrize("words", KIND_WORDS)
def test_no_module_outside_the_layouts_names_a_kind(words):
    files, _ = graph()
    naming = {m for m, p in files.items() if m.split(".")[0] != "layouts" and re.search(words, p.read_text(), re.I)}
    assert naming <= KIND_WORDS[words], f"name a kind; ask kvbench.layouts.kinds: {sorted(naming - KIND_WORDS[words])}"
