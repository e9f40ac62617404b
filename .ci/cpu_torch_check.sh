#!/usr/bin/env bash
# Builds fastattn from its sdist against the CPU-only torch 2.13.0 in .venv-cpu (no CUDA sources
# compiled) and checks it: `python -m fastattn` must report cuda "not built" and cpu, reference
# and (under TRITON_INTERPRET=1) triton available; then the stable-ABI and backend tests run
# against that installation (from a copy of tests/, so the source tree's CUDA build is not
# imported instead).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV=${CPU_VENV:-.venv-cpu}
PYTHON_BOOTSTRAP=$(command -v python3.11 || command -v python3)
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON_BOOTSTRAP" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --quiet --upgrade pip
"$VENV/bin/python" -m pip install --quiet -c requirements/constraints.txt torch==2.13.0 \
  triton==3.8.0 numpy ninja "cmake>=3.21,<4" setuptools wheel pytest pytest-timeout \
  hypothesis expecttest
# From the sdist (`make sdist`), unpacked as a user unpacks it, and installed with the README's
# source-install command. Its build/compile-cache is the checkout's: the CPU kernels' objects
# (no torch header in them) come from the first build.
make sdist
sdist=$(ls -t dist/fastattn-*.tar.gz | head -n 1)
unpacked="$ROOT/build/sdist-check"
rm -rf "$unpacked" && mkdir -p "$unpacked"
tar -xzf "$sdist" -C "$unpacked"
source_dir="$unpacked/$(basename "$sdist" .tar.gz)"
mkdir -p "$source_dir/build" "$ROOT/build/compile-cache"
ln -s "$ROOT/build/compile-cache" "$source_dir/build/compile-cache"
(cd "$source_dir" && FASTATTN_CUDA=auto "$ROOT/$VENV/bin/python" -m pip install --quiet \
  --no-build-isolation --no-deps --force-reinstall .)
work=$(mktemp -d)
cp -r tests "$work/tests"
cd "$work"
report=$(TRITON_INTERPRET=1 "$ROOT/$VENV/bin/python" -m fastattn)
echo "$report"
echo "$report" | grep -q "^build .*CUDA not built" || { echo "expected a build without CUDA"; exit 1; }
echo "$report" | grep -qE "^  cuda +not built" || { echo "expected cuda: not built"; exit 1; }
for b in cpu reference triton; do
  echo "$report" | grep -qE "^  $b +available" || { echo "expected $b available"; exit 1; }
done
# The build is what this check adds; the wheel check runs the fast tests under this torch.
"$ROOT/$VENV/bin/python" -m pytest tests/test_stable_abi.py tests/test_backends.py -q -x \
  -p no:cacheprovider --timeout=900
rm -rf "$work"
