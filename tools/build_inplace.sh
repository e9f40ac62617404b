#!/usr/bin/env bash
# Builds fastattn._C in place in this checkout (e.g. a git worktree) with the main venv's
# python, under the machine-wide build lock. Run tests of this checkout with
#   PYTHONPATH=$(pwd) /work/main/.venv/bin/python -m pytest tests/...
# (PYTHONPATH puts this checkout's fastattn before the editable install of /work/main).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-/work/main/.venv/bin/python}
export FASTATTN_CUDA=${FASTATTN_CUDA:-1} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} MAX_JOBS=${MAX_JOBS:-2}
flock /tmp/fastattn-build.lock "$PY" setup.py build_ext --inplace
