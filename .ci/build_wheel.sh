#!/usr/bin/env bash
# `make wheel`: builds dist/fastattn-<version>-<tags>.whl from a clean copy of the tree (the
# files git tracks) against torch 2.11.0, the stable ABI's target (docs/stable_abi.md), so the
# one wheel runs under every torch from 2.11 on. CUDA kernels (the second library _C_cuda.so)
# for archs 8.0, 9.0 and 10.0 with the CUDA 13.0 toolkit; FASTATTN_CUDA=0 builds a CPU-only
# wheel. The CPU kernels carry the ISA dispatch as always. Prints the wheel's size and the
# build time. WHEEL_VENV: the build venv (Python 3.11, torch 2.11.0; created when absent).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV=${WHEEL_VENV:-.venv-wheel}
PYTHON_BOOTSTRAP=$(command -v python3.11 || command -v python3)
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON_BOOTSTRAP" -m venv "$VENV"
fi
VENV=$(cd "$VENV" && pwd)
"$VENV/bin/python" -m pip install --quiet --upgrade pip
"$VENV/bin/python" -m pip install --quiet -c requirements/constraints.txt torch==2.11.0 numpy \
  ninja "cmake>=3.21,<4" "setuptools>=77" wheel
src=$(mktemp -d)
git ls-files -z | xargs -0 -I{} cp --parents {} "$src/"  # a clean tree: no build/, no _C*.so
mkdir -p dist
start=$(date +%s)
(
  cd "$src"
  FASTATTN_CUDA=${FASTATTN_CUDA:-1} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-8.0;9.0;10.0} \
    CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} MAX_JOBS=${MAX_JOBS:-$(nproc)} \
    flock ${BUILD_LOCK:-/tmp/fastattn-build.lock} \
    "$VENV/bin/python" -m pip wheel --quiet --no-build-isolation --no-deps -w "$ROOT/dist" .
)
rm -rf "$src"
wheel=$(ls -t dist/fastattn-*.whl | head -n 1)
echo "wheel: $wheel ($(du -h "$wheel" | cut -f1)), built in $(( $(date +%s) - start )) s"
"$VENV/bin/python" -m zipfile -l "$wheel" | grep -E "\.so" || true
