#!/usr/bin/env bash
# Refresh .ci/constraints.txt: install the latest releases that pyproject.toml admits into a fresh
# virtualenv, run the README's test command there, and only if it passes write their versions as
# the new constraints (review the diff, commit it). Exit non-zero, constraints untouched, when the
# latest releases break the suite: that is the news the weekly check (.github/workflows/
# latest-deps.yml) exists to bring before a fresh install brings it to main.
#
#   scripts/refresh_constraints.sh [VENV_DIR]      # default: a temporary directory, removed after
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-$(mktemp -d)/venv}
python -m venv "$venv"
# shellcheck disable=SC1091
. "$venv/bin/activate"
python -m pip install --quiet torch==2.13.0
python -m pip install --quiet -e ".[dev]"
WANDB_MODE=disabled WANDB_SILENT=true MPLBACKEND=Agg python -m pytest -n 3 --dist loadgroup -q
new=$(mktemp)
{
  sed -n '/^#/p' .ci/constraints.txt
  python -m pip freeze --exclude-editable | grep -v '^kvbench' | sed -E 's/^torch==([0-9.]+)\+.*/torch==\1/'
} > "$new"
mv "$new" .ci/constraints.txt
git --no-pager diff --stat -- .ci/constraints.txt
