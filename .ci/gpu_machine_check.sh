#!/usr/bin/env bash
# The GPU machine's software, checked here without its GPU. The lent H100/H200 has Python 3.12,
# torch 2.11.0 (CUDA 13.0) and triton 3.6.0 and reaches no package registry: a header, API or
# kernel variant that those versions lack would fail a GPU session at its first step. This
# check installs the same versions in .venv-gpu-env and, into it, the wheel `make wheel` built
# (with Python 3.11 and the dev venv's torch, every source compiled for the stable ABI of torch
# 2.11: WHEEL=path, or the newest dist/*.whl; built first when there is none), unchanged: that
# the file imports and runs under torch 2.11 itself, the target, and another Python (abi3) is
# what this proves. It prints the environment report and runs, against that installation with
# the machine's transformers 5.17.0 and Triton's interpreter off, one call of each native op
# family (attention forward and backward, LSTM, positional) on the CPU kernels; with
# GPU_CHECK_TESTS=1 (.ci/extended.sh torch-2.11) the tests of the build, the backends,
# torch.compile, the transformers integration and the cpu backend's quick attention and LSTM
# tests as well (as there: the CPU, reference and native tests run, the Triton and CUDA ones
# skip). GPU_CHECK_AOT=1 (.ci/extended.sh triton-aot) also compiles every Triton kernel
# variant the launchers would launch on an H100 with triton 3.6 (tests/triton_aot.py: ptxas,
# no GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV=${GPU_ENV_VENV:-.venv-gpu-env}
PY312=""
if python3.12 -c "" 2>/dev/null; then  # a pyenv shim exists even where 3.12 is not selected
  PY312=$(command -v python3.12)
else
  PY312=$(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12 2>/dev/null | head -n 1 || true)
fi
[ -n "$PY312" ] || { echo "gpu machine check: no python3.12 on this machine"; exit 1; }
if [ ! -x "$VENV/bin/python" ]; then
  "$PY312" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --quiet --upgrade pip
"$VENV/bin/python" -m pip install --quiet -c requirements/constraints.txt torch==2.11.0 \
  triton==3.6.0 numpy ninja setuptools wheel pytest pytest-xdist pytest-timeout hypothesis
# The GPU machine's own transformers, not the constraints' pin: this check mirrors that machine.
"$VENV/bin/python" -m pip install --quiet transformers==5.17.0
if [ -z "${WHEEL:-}" ] && ! ls dist/fastattn-*.whl > /dev/null 2>&1; then
  bash .ci/build_wheel.sh
fi
WHEEL=$(realpath "${WHEEL:-$(ls -t dist/fastattn-*.whl | head -n 1)}")
echo "gpu machine check: installing $WHEEL ($(date -r "$WHEEL" '+%F %T'))"
"$VENV/bin/python" -m pip install --quiet --no-deps --force-reinstall "$WHEEL"
work=$(mktemp -d)
cp -r tests examples benchmarks tools README.md pyproject.toml LICENSE "$work/"
cd "$work"  # import the installed package, not the source tree (built for another torch)
"$ROOT/$VENV/bin/python" -m fastattn
"$ROOT/$VENV/bin/python" -c "import fastattn, sys; info = fastattn.build_info(); print(info); sys.exit(not info.get('cuda'))"
TRITON_INTERPRET=0 "$ROOT/$VENV/bin/python" - <<'SMOKE'
import torch, fastattn
q, k, v = (torch.randn(2, 4, 33, 64, requires_grad=True) for _ in range(3))
out = fastattn.attention(q, k, v, causal=True, backend="cpu")
ref = fastattn.attention(q, k, v, causal=True, backend="reference")
torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
assert all(torch.isfinite(g).all() for g in torch.autograd.grad(out.sum(), (q, k, v)))
x = torch.randn(7, 3, 16)
layer = fastattn.nn.LSTM(16, 32)
torch.testing.assert_close(layer(x)[0], torch.nn.LSTM.forward(layer, x)[0], rtol=1e-4, atol=1e-5)
fastattn.add_sinusoidal(torch.randn(2, 5, 8), backend="cpu")
print("native ops under this torch: ok")
SMOKE
if [ "${GPU_CHECK_AOT:-0}" = 1 ]; then
  start=$(date +%s)
  "$ROOT/$VENV/bin/python" tests/triton_aot.py --jobs "$(nproc)" > aot.log 2>&1 || {
    grep -v "^ok " aot.log | head -n 200; exit 1; }
  tail -n 1 aot.log
  echo "triton 3.6 sm_90 compile of every kernel variant: $(( $(date +%s) - start )) s"
fi
if [ "${GPU_CHECK_TESTS:-0}" = 1 ]; then
  start=$(date +%s)
  opts=(-q -n "$(nproc)" -p no:cacheprovider --timeout=900 -m "not slow")
  TRITON_INTERPRET=0 "$ROOT/$VENV/bin/python" -m pytest "${opts[@]}" tests/test_stable_abi.py \
    tests/test_build_config.py tests/test_backends.py tests/test_dynamic_shapes.py \
    tests/test_transformers_integration.py
  TRITON_INTERPRET=0 "$ROOT/$VENV/bin/python" -m pytest "${opts[@]}" tests/test_attention.py \
    tests/test_lstm.py -k cpu
  echo "tests with torch 2.11.0: $(( $(date +%s) - start )) s"
fi
cd "$ROOT"
rm -rf "$work"
