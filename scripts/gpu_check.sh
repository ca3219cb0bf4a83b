#!/usr/bin/env bash
# The GPU check (docs/gpu-check.md): proves kvbench's CUDA paths on a real GPU in a few minutes and
# writes at most 8 small files into $OUT (default ./gpu_check_out).
#
#   scripts/gpu_check.sh                 # on a CUDA machine, from the repository root
#   scripts/gpu_check.sh --dry-run       # the same script on the CPU with the tiny model (< 2 min);
#                                        # GPU_CHECK_DEVICE=cpu does the same
#   scripts/gpu_check.sh --fetch-wheels  # on a machine that reaches PyPI: the wheels a bare GPU image
#                                        # lacks (hydra-core, omegaconf, antlr4, wandb and its needs)
#                                        # into .whl/ (git-ignored); carry .whl/ to the GPU machine
#
# Where hydra/omegaconf/wandb do not import and .whl/*.whl is present, the wheels are installed (no
# index, no deps) into a private folder first on PYTHONPATH; kvbench itself runs from this
# checkout (no install needed). PYTHON picks the
# interpreter (default python3: on the GPU image, the one with CUDA torch).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"

if [[ "${1:-}" == "--fetch-wheels" ]]; then
    # For CPython 3.12 on x86-64 Linux (the GPU image); pure-Python wheels work anywhere.
    mkdir -p .whl
    plat=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
          --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
    "$PYTHON" -m pip download -q --no-deps "${plat[@]}" -d .whl hydra-core==1.3.8 omegaconf==2.3.1
    # antlr4-python3-runtime 4.9.3 (what omegaconf 2.3 needs) is published as a source archive
    # only: build its pure-Python wheel here.
    "$PYTHON" -m pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3
    # wandb and wandb-workspaces (the sweep workspace) with everything they need (pure Python or
    # cp312 manylinux); ~28 MB in all.
    "$PYTHON" -m pip download -q "${plat[@]}" -d .whl wandb==0.31.0 wandb-workspaces==0.4.13
    ls -l .whl
    exit 0
fi

# The wheels only where kvbench's own needs are missing (a bare GPU image), never over an install.
if ! "$PYTHON" -c "import hydra, omegaconf, wandb" 2>/dev/null && compgen -G ".whl/*.whl" > /dev/null; then
    site="${TMPDIR:-/tmp}/kvbench-gpu-check-site"
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" .whl/*.whl
    export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1 MPLBACKEND=Agg
exec "$PYTHON" scripts/gpu_check.py "$@"
