#!/usr/bin/env bash
# The whole GPU run in one command, for a GPU machine with its own python3 (torch, triton,
# pytest; no package registry, no venv):
#   bash benchmarks/gpu_suite.sh OUTDIR
# Builds fastattn in place for the visible GPU's arch, prints the environment report, runs the
# whole test suite (CUDA tests and the slow grids included), runs the full benchmark profile on
# the GPU and plots it. Logs, CSVs and plots go to OUTDIR; a summary is printed last.
# Exit status: non-zero when the build or any test fails (benchmarks still run after a test
# failure, so one bad kernel does not hide the rest).
set -uo pipefail
OUT=${1:?usage: gpu_suite.sh OUTDIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TESTS=${GPU_SUITE_TESTS:-tests}
ARCH=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n 1)
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-${ARCH:-9.0}}
export FASTATTN_CUDA=1 MAX_JOBS=${MAX_JOBS:-$(nproc)} FASTATTN_SLOW=1
export CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(command -v nvcc)")")}
status=0

nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
start=$(date +%s)
if ! $PY setup.py build_ext --inplace > "$OUT/build.log" 2>&1; then
  echo "BUILD FAILED (last lines of $OUT/build.log):"; tail -n 40 "$OUT/build.log"; exit 1
fi
echo "build: $(( $(date +%s) - start )) s for arch $TORCH_CUDA_ARCH_LIST"
$PY -m fastattn | tee "$OUT/environment.txt"

start=$(date +%s)
$PY -m pytest $TESTS -q -rfEs --timeout=900 --junitxml="$OUT/tests.xml" \
  -p no:cacheprovider > "$OUT/tests.log" 2>&1 || status=1
echo "tests: $(( $(date +%s) - start )) s: $(tail -n 1 "$OUT/tests.log")"
grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -n 30

start=$(date +%s)
$PY benchmarks/run.py --profile "${GPU_SUITE_PROFILE:-full}" --device cuda --csv "$OUT/gpu.csv" \
  > "$OUT/bench.log" 2>&1 || status=1
echo "benchmarks: $(( $(date +%s) - start )) s"
$PY benchmarks/plot.py "$OUT/gpu.csv" "$OUT" > "$OUT/plot.log" 2>&1 || true
grep -E "speedup|fastattn:|FAIL|ERROR" "$OUT/bench.log" | head -n 60
exit $status
