#!/usr/bin/env bash
# The README's "Install with your own torch", run as a user runs it: the commands of its bash
# block, verbatim, from the checkout, in the venv `make venv` just created (a fresh venv that
# has torch, as the section assumes), with none of the build variables set. Then checks that
# the CUDA kernels were built for every arch of setup.py's default list and that the report
# `python -m fastattn` (the block's last command) lists them and the toolkit.
# `make test` afterwards reuses this build (same folder under build/, same configuration).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
block=$(awk '/^## Install with your own torch/ {in_section = 1; next}
             in_section && /^## / {exit}
             in_section && /^```bash/ {in_block = 1; next}
             in_block && /^```/ {exit}
             in_block {print}' README.md)
echo "$block" | grep -q "pip install --no-build-isolation \." || {
  echo "README: no 'pip install --no-build-isolation .' in the install section"; exit 1; }
defaults=$(sed -nE 's/^DEFAULT_CUDA_ARCHS = "(.*)"$/\1/p' setup.py)
[ -n "$defaults" ] || { echo "setup.py: DEFAULT_CUDA_ARCHS not found"; exit 1; }
echo "README install block:"
echo "$block"
report=$(env -u FASTATTN_CUDA -u TORCH_CUDA_ARCH_LIST -u CUDA_HOME -u CUDA_PATH -u MAX_JOBS \
           -u CMAKE_ARGS -u FASTATTN_DEBUG_CHECKS -u CMAKE_POLICY_VERSION_MINIMUM \
           bash -c "set -euo pipefail; source '$VENV/bin/activate'; $block")
echo "$report"
build=$(echo "$report" | grep "^build ")
echo "$build" | grep -q "CUDA not built" && { echo "expected the CUDA kernels to be built"; exit 1; }
echo "$build" | grep -qF "archs $defaults;" || {
  echo "expected the report to list the default archs $defaults"; exit 1; }
echo "$build" | grep -q "toolkit /" || { echo "expected the report to name the toolkit"; exit 1; }
echo "README install: built for $defaults"
