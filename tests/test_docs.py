"""The documentation site: it builds with ``mkdocs build --strict`` (a broken link, a missing
anchor, a page left out of the nav or a nav entry without its page fails), the generated reference
pages match the code they are generated from, and the README stays a front door."""

import dataclasses
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def gen_reference():
    spec = importlib.util.spec_from_file_location("gen_reference", ROOT / "docs" / "gen_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_generated_reference_pages_match_the_code():
    gen = gen_reference()
    assert gen.stale() == [], "run: python docs/gen_reference.py"


def test_the_configuration_reference_lists_every_key_with_its_default_and_check():
    gen = gen_reference()
    page = gen.configuration_page()
    from kvbench.config.bench import BenchConfig, RuntimeConfig
    from kvbench.config.workload import WORKLOADS

    # every key of a group's dataclass is a row, with the dataclass's own default
    assert "| `workload.prompt_len` | int | `512` |" in page
    assert f"| `runtime.repeats` | int | `{RuntimeConfig().repeats}` |" in page
    assert all(f"`workload.{f.name}`" in page for option in WORKLOADS.values() for f in dataclasses.fields(option))
    assert all(f"`{name}`" in page for name in BenchConfig.__dataclass_fields__)
    # the bound comes from the validation code, the options from conf/
    assert "must be in [0, 2**63 - 1]" in page  # runtime.seed
    assert "`small` (default)" in page and "`llama3_8b`" in page


def test_the_metrics_reference_has_each_task_metric_with_its_unit():
    gen = gen_reference()
    rows = {name: (unit, method) for name, unit, method in gen.metric_table("bench", "decode")}
    assert rows["decode_ms_p50"][0] == "ms" and rows["tokens_per_s"][0] == "tokens/s"
    assert rows["kv_cache_bytes"][0] == "bytes"
    page = gen.metrics_page()
    for task, workload, heading in gen.task_sections():
        assert f"## {heading}" in page
        assert all(f"`{gen.cell(name)}`" in page for name, _, _ in gen.metric_table(task, workload))


@pytest.mark.e2e
def test_the_site_builds_strictly(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
                           "-d", str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    site = tmp_path / "site"
    for page in ("index.html", "getting-started/index.html", "reference/configuration/index.html",
                 "reference/metrics/index.html", "experiments/results/ab_small_quiet/index.html"):
        assert (site / page).is_file(), page


def test_the_readme_is_a_front_door():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    for link in ("docs/getting-started.md", "docs/reference/configuration.md", "docs/reference/metrics.md",
                 "experiments/results/ab_small_quiet.md"):
        assert f"]({link}" in readme and (ROOT / link).is_file(), link


def test_every_file_the_pages_name_exists():
    """A module, script or result a page names in backticks (`kvbench/config/bench.py`,
    `sinks/choose.py`, `experiments/kv_precision.py`) is there: a moved file fails here."""
    missing = []
    for page in [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]:
        for name in re.findall(r"`([\w./-]+\.(?:py|sh))`", page.read_text()):
            if name.split("/")[0] in ("kvbench", "scripts", "experiments", "tests", "docs"):
                places = [name]
            else:  # a module of the package (`sinks/choose.py`) or a script by its name
                places = [f"kvbench/{name}", f"scripts/{name}", f"experiments/{name}"]
            if not any((ROOT / path).is_file() for path in places):
                missing.append(f"{page.relative_to(ROOT)}: {name}")
    assert missing == []
