#!/usr/bin/env bash
# One wheel for every torch: installs the wheel `make wheel` built (the newest dist/*.whl, or
# WHEEL=path) as from an index (pip install fastattn --no-index --find-links dist/, no rebuild)
# into a venv with the CPU-only torch 2.13.0 and one with torch 2.14.1 (CUDA 13.0 build), and
# runs the environment report and the fast tests in each, from a copy of tests/ (so the
# installed package is imported, not the source tree). Under the CPU-only torch the CUDA
# kernels' library must report "not loaded: torch has no CUDA". Venvs: .venv-wheel-213cpu and
# .venv-wheel-2141, or WHEEL_VENV_213CPU and WHEEL_VENV_2141 (created when absent).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
WHEEL=${WHEEL:-$(ls -t dist/fastattn-*.whl | head -n 1)}
WHEEL=$(realpath "$WHEEL")
PYTHON_BOOTSTRAP=$(command -v python3.11 || command -v python3)
FAST_TESTS="tests/test_stable_abi.py tests/test_backends.py tests/test_positional.py
  tests/test_additive_attention.py tests/test_paged_kvcache.py tests/test_attention_with_kvcache.py"
# WHEEL_CHECK_TORCH: the venvs to check (default both). WHEEL_TORCH_2141_FROM=VENV (CI: .venv,
# the dev venv, whose torch is the pinned 2.14.1) makes the 2141 venv see that venv's packages
# through a .pth file instead of installing a second 2.14.1 with its CUDA libraries; the wheel
# goes into the new venv itself and is what the tests import (the dev venv's editable install
# is not active there: its finder is a .pth of the dev venv's own site-packages).
for spec in "213cpu torch==2.13.0+cpu" "2141 torch==2.14.1"; do
  case " ${WHEEL_CHECK_TORCH:-213cpu 2141} " in *" ${spec%% *} "*) ;; *) continue ;; esac
  name=${spec%% *}
  torch_req=${spec#* }
  if [ "$name" = 213cpu ]; then venv=${WHEEL_VENV_213CPU:-$ROOT/.venv-wheel-$name}; else
    venv=${WHEEL_VENV_2141:-$ROOT/.venv-wheel-$name}; fi
  [ -x "$venv/bin/python" ] || "$PYTHON_BOOTSTRAP" -m venv "$venv"
  # pip counts what a shared .pth shows (torch, the dev venv's fastattn) as outside this venv:
  # the wheel then goes in with --no-deps --force-reinstall.
  install_flags=""
  if [ "$name" = 2141 ] && [ -n "${WHEEL_TORCH_2141_FROM:-}" ]; then
    install_flags="--no-deps --force-reinstall"
    shared=$(realpath "$WHEEL_TORCH_2141_FROM")/lib/python3*/site-packages
    own=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_path('purelib'))")
    echo $shared > "$own/shared_torch.pth"
  else
    "$venv/bin/python" -m pip install --quiet --upgrade pip
    "$venv/bin/python" -m pip install --quiet "$torch_req" triton==3.8.0 numpy pytest \
      pytest-xdist pytest-timeout hypothesis expecttest
  fi
  "$venv/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '${torch_req#torch==}'.split('+')[0])" ||
    { echo "$name: expected $torch_req"; exit 1; }
  # As a user installs from an index, next to the torch already there: by name, from the
  # folder that holds the wheel.
  "$venv/bin/python" -m pip uninstall --quiet --yes fastattn 2>/dev/null || true
  # shellcheck disable=SC2086
  "$venv/bin/python" -m pip install --quiet $install_flags --no-index \
    --find-links "$(dirname "$WHEEL")" "fastattn==$(basename "$WHEEL" | cut -d- -f2)"
  work=$(mktemp -d)
  cp -r tests "$work/tests"
  (
    cd "$work"
    report=$(TRITON_INTERPRET=1 "$venv/bin/python" -m fastattn)
    echo "$report"
    echo "$report" | grep -q "stable ABI, built against torch .* (target 2.11" ||
      { echo "$name: expected a stable-ABI build targeting torch 2.11"; exit 1; }
    if [ "$name" = 213cpu ]; then
      if "$venv/bin/python" -c "import fastattn, sys; sys.exit(not fastattn.build_info()['cuda'])"; then
        echo "$report" | grep -qE "^  cuda +not loaded: torch has no CUDA" ||
          { echo "$name: expected cuda 'not loaded: torch has no CUDA'"; exit 1; }
      fi
      for b in cpu reference triton; do
        echo "$report" | grep -qE "^  $b +available" || { echo "$name: expected $b available"; exit 1; }
      done
    fi
    # shellcheck disable=SC2086
    # Triton is pure Python (the interpreter here): the native build under this torch is what counts.
    "$venv/bin/python" -m pytest $FAST_TESTS -q -x -n 2 -p no:cacheprovider --timeout=900 -k "not triton"
  )
  rm -rf "$work"
  echo "wheel under $torch_req: ok"
done
