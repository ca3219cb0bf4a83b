"""kvbench-report and kvbench-dashboard start without torch (kvbench/cli_tools.py): they only read
records, and importing torch costs more than a second per call."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e  # a fresh interpreter: what a console script imports


def test_the_report_and_dashboard_scripts_never_import_torch_or_the_jobs_layer():
    code = ("import sys\nfrom kvbench import entry, cli_tools\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] == 'torch' or m in ('kvbench.model',"
            " 'kvbench.jobs.runner') or m.startswith('kvbench.tasks'))\nprint(','.join(bad))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ""
