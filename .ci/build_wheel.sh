#!/usr/bin/env bash
# `make wheel`: builds dist/fastattn-<version>-cp310-abi3-manylinux_2_28_x86_64.whl from this
# checkout with the torch of the dev venv (.venv, `make venv`: the pinned torch 2.14.1, a CUDA
# 13.0 build), through the same CMake build folder as `make build` and the README's `pip install
# .`: after those, only the packaging runs. Every source is compiled under TORCH_TARGET_VERSION
# = 2.11 (the stable ABI's target, docs/design/stable_abi.md), so the wheel runs under every
# torch from 2.11 on whichever torch's headers built it; CI installs it into torch 2.11.0
# (.ci/gpu_machine_check.sh), 2.13.0 CPU-only and 2.14.1 (.ci/wheel_check.sh). CUDA archs:
# setup.py's (TORCH_CUDA_ARCH_LIST, by default DEFAULT_CUDA_ARCHS); FASTATTN_CUDA=0 builds a
# CPU-only wheel. The CPU kernels carry the ISA dispatch as always. Prints the wheel's size and
# the time it took.
# The package's files are what git tracks: a file under fastattn/ that git does not know stops
# the build (it would be packaged), and setuptools' staging folders are cleared first.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV=${WHEEL_VENV:-.venv}
[ -x "$VENV/bin/python" ] || make venv VENV="$VENV"
untracked=$(git ls-files --others --exclude-standard -- fastattn)
if [ -n "$untracked" ]; then
  echo "make wheel: files under fastattn/ that git does not track would be packaged:"
  echo "$untracked"
  exit 1
fi
rm -rf build/lib build/lib.* build/bdist.* ./*.egg-info
mkdir -p dist
start=$(date +%s)
FASTATTN_CUDA=${FASTATTN_CUDA:-auto} MAX_JOBS=${MAX_JOBS:-$(nproc)} \
  flock ${BUILD_LOCK:-/tmp/fastattn-build.lock} \
  "$VENV/bin/python" -m pip wheel --quiet --no-build-isolation --no-deps -w "$ROOT/dist" .
built=$(ls -t dist/fastattn-*-linux_x86_64.whl | head -n 1)
# The platform tag an index accepts: auditwheel checks every symbol version the libraries need
# against manylinux_2_28's (torch's own floor; csrc/common/manylinux_compat.h makes a build on
# a newer Linux fit) and refuses the tag if one is newer. torch's and CUDA's libraries are not
# copied in: they come with the torch the wheel is installed beside (Requires-Dist: torch).
PATH="$(realpath "$VENV")/bin:$PATH" "$VENV/bin/auditwheel" repair --plat manylinux_2_28_x86_64 \
  --only-plat -w dist \
  --exclude 'libtorch*.so' --exclude 'libc10*.so' --exclude 'libgomp*.so*' \
  --exclude 'libcudart.so.*' --exclude 'libcupti.so.*' --exclude 'libnv*.so*' \
  --exclude 'libcu*.so*' "$built"
rm -f "$built"
wheel=$(ls -t dist/fastattn-*-manylinux_2_28_x86_64.whl | head -n 1)
# repair refuses a tag the libraries do not fit; show names the oldest one they would fit.
"$VENV/bin/auditwheel" show "$wheel" | tr '\n' ' ' | grep -oE 'constrains the platform tag to "[^"]+"'
"$VENV/bin/twine" check --strict "$wheel"
echo "wheel: $wheel ($(du -h "$wheel" | cut -f1)), built in $(( $(date +%s) - start )) s"
"$VENV/bin/python" -m zipfile -l "$wheel" | grep -E "\.so" || true
