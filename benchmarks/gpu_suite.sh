#!/usr/bin/env bash
# The GPU run, sized for one device call: a lent GPU machine runs a command for 10 minutes at
# most, and a session has 15 minutes of device time in all (start-up included). It uses the
# machine's own python3 (torch, triton, pytest, pytest-xdist; no package registry, no venv):
#   bash benchmarks/gpu_suite.sh OUTDIR        (device call: timeout_s 600)
# Stages, each cut off by its share of GPU_SUITE_SECONDS (default 540; a stage that runs out
# is reported and the next one still runs, so a slow stage never hides the others):
#   build  fastattn in place for the visible GPU's arch (MAX_JOBS = all cores); the checkout
#          goes first on PYTHONPATH so the later stages import this build
#   tests  the GPU-specific tests (CUDA backend, Triton on CUDA tensors), GPU_SUITE_WORKERS (8)
#          pytest workers sharing the GPU, one test file per worker at a time (--dist loadfile:
#          every op's file starts at once, so a cut-off trims each file's tail instead of
#          skipping whole ops); Triton autotuning off (first config); the slow grids only with
#          GPU_SUITE_SLOW=1; one test may take GPU_SUITE_TEST_TIMEOUT (60) seconds
#   report (not run by default) tools/kernel_report.py on the build's arch: registers, spills
#          and main-loop instruction mix of the CUDA attention kernels that ran
#   ncu    (not run by default) one `ncu --set full` capture of the plain forward tensor-core
#          kernel (benchmarks/gpu_one_forward.py), when ncu is on the machine
#   bench  the benchmark suite on the GPU (GPU_SUITE_PROFILE, default quick; about 4 minutes
#          on an H100, Triton autotuning included; GPU_SUITE_BENCH_OPS: a subset of ops) and
#          its plots; the Triton attention autotuner's choices go to OUTDIR/triton_winners.json
#   rest   (not run by default: CI runs them) the tests that are not GPU-specific
# GPU_SUITE_STAGES="build tests bench" picks stages (they run in the order above);
# GPU_SUITE_TESTS (default tests) is what pytest collects. Logs, CSVs, junit XML and plots go to
# OUTDIR with the commit measured (commit.txt); a summary is printed last.
# benchmarks/gpu_tune.sh is this suite for the attention kernels' tuning run.
# Measured on the first run (H100, 2026-11-26): build 77 s; the bench 240 s.
# A stage that runs out of time gets SIGINT and GPU_SUITE_GRACE (30) seconds before SIGKILL:
# pytest then still prints its summary and writes its junit XML, and every test's outcome is
# in the stage's log as it happens (-v), so a cut-off never loses the names of failing tests.
# Exit status: non-zero when the build or a test fails or a stage is cut off.
set -uo pipefail
OUT=${1:?usage: gpu_suite.sh OUTDIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
STAGES=${GPU_SUITE_STAGES:-build tests bench}
BUDGET=${GPU_SUITE_SECONDS:-540}
GRACE=${GPU_SUITE_GRACE:-30}
DEADLINE=$(( $(date +%s) + BUDGET ))
ARCH=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n 1)
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-${ARCH:-9.0}}
export FASTATTN_CUDA=1 MAX_JOBS=${MAX_JOBS:-$(nproc)} PYTHONUNBUFFERED=1
# The in-place build, not an installed fastattn: benchmarks/run.py runs as a script, and its
# directory (not the checkout) is what Python puts first on sys.path.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# The toolkit as setup.py finds it: a wrapper nvcc on PATH (e.g. /usr/local/bin/nvcc running
# /usr/local/cuda-13.0/bin/nvcc) must not make CUDA_HOME /usr/local.
export CUDA_HOME=${CUDA_HOME:-$($PY tools/cuda_toolkit.py)}
# cmake >= 4 refuses cmake_minimum_required < 3.5, still declared in some of torch's files.
export CMAKE_POLICY_VERSION_MINIMUM=${CMAKE_POLICY_VERSION_MINIMUM:-3.5}
status=0

# Seconds kept for the selected stages after `stage` (their usual share: report 30, ncu 100,
# bench 250).
reserve_after() {
  local stage=$1 total=0 later=0 s
  for s in tests rest report ncu bench; do
    if [ "$later" = 1 ] && [[ " $STAGES " == *" $s "* ]]; then
      case $s in report) total=$((total + 30)) ;; ncu) total=$((total + 100)) ;;
        bench) total=$((total + 250)) ;; esac
    fi
    [ "$s" = "$stage" ] && later=1
  done
  echo "$total"
}

# Seconds a stage may use: what is left before the deadline, less `reserve` for later stages,
# at most `cap`.
share() {
  local reserve=$1 cap=$2 left
  left=$(( DEADLINE - $(date +%s) - reserve ))
  [ "$left" -gt "$cap" ] && left=$cap
  [ "$left" -lt 10 ] && left=10
  echo "$left"
}

# run NAME SECONDS LOG CMD...: runs CMD under a timeout, output to LOG; says how it ended.
# When the time is up CMD gets SIGINT (pytest stops as on Ctrl-C: summary and junit written),
# then SIGKILL GRACE seconds later if it is still running.
run() {
  local name=$1 seconds=$2 log=$3 start rc
  shift 3
  start=$(date +%s)
  timeout --signal=INT --kill-after="$GRACE" "$seconds" "$@" > "$log" 2>&1
  rc=$?
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    echo "$name: CUT OFF after $(( $(date +%s) - start )) s (its share was $seconds s)"
  else
    echo "$name: exit $rc after $(( $(date +%s) - start )) s"
  fi
  return "$rc"
}

# outcomes NAME LOG: the tally and the failing tests of a pytest stage, read from its -v log
# (complete even when the stage was cut off before pytest's own summary).
outcomes() {
  local name=$1 log=$2
  echo "$name: $(grep -cE " PASSED( |$)" "$log") passed, $(grep -cE " FAILED( |$)" "$log") failed, \
$(grep -cE " ERROR( |$)" "$log") errors, $(grep -cE " SKIPPED( |$)" "$log") skipped (from $log)"
  grep -oE "[^ ]+::[^ ]+ (FAILED|ERROR)|(FAILED|ERROR) [^ ]+::[^ ]+" "$log" \
    | sed -E 's/^([^ ]+) (FAILED|ERROR)$/\2 \1/' | sort -u | head -n 60
  tail -n 1 "$log"
}

nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
git rev-parse HEAD > "$OUT/commit.txt" 2>/dev/null || echo "no git checkout" > "$OUT/commit.txt"
git status --short >> "$OUT/commit.txt" 2>/dev/null || true

if [[ " $STAGES " == *" build "* ]]; then
  if ! run build "$(share 420 240)" "$OUT/build.log" $PY setup.py build_ext --inplace; then
    echo "BUILD FAILED (last lines of $OUT/build.log):"; tail -n 40 "$OUT/build.log"; exit 1
  fi
fi
$PY -m fastattn | tee "$OUT/environment.txt"

# -v: one line per test as it ends, so the log names every outcome even after a cut-off.
PYTEST=($PY -m pytest ${GPU_SUITE_TESTS:-tests} -v -rfEs -n "${GPU_SUITE_WORKERS:-8}"
        --dist loadfile --timeout="${GPU_SUITE_TEST_TIMEOUT:-60}" -p no:cacheprovider)
export FASTATTN_TRITON_AUTOTUNE=0
[ "${GPU_SUITE_SLOW:-0}" = "1" ] && export FASTATTN_SLOW=1
if [[ " $STAGES " == *" tests "* ]]; then
  # time kept for the later stages (the bench: its ~240 s, its plots)
  run "tests (GPU-specific)" "$(share "$(reserve_after tests)" 400)" "$OUT/tests_gpu.log" "${PYTEST[@]}" \
    -k "cuda or triton" --junitxml="$OUT/tests_gpu.xml" || status=1
  outcomes "tests (GPU-specific)" "$OUT/tests_gpu.log"
fi

if [[ " $STAGES " == *" rest "* ]]; then
  run "tests (the rest)" "$(share "$(reserve_after rest)" 400)" "$OUT/tests_rest.log" "${PYTEST[@]}" \
    -k "not (cuda or triton)" --junitxml="$OUT/tests_rest.xml" || status=1
  outcomes "tests (the rest)" "$OUT/tests_rest.log"
fi
unset FASTATTN_TRITON_AUTOTUNE FASTATTN_SLOW

if [[ " $STAGES " == *" report "* ]]; then
  run "kernel report" "$(share "$(reserve_after report)" 60)" "$OUT/kernel_report.txt" \
    $PY tools/kernel_report.py --arch "sm_$(echo "${ARCH:-9.0}" | tr -d .)" \
    --json "$OUT/kernel_report.json" || status=1
fi

if [[ " $STAGES " == *" ncu "* ]]; then
  if command -v ncu > /dev/null 2>&1; then
    run ncu "$(share "$(reserve_after ncu)" 150)" "$OUT/ncu.log" ncu --set full \
      --kernel-name regex:attention_fwd_mma --launch-skip 1 --launch-count 1 \
      --export "$OUT/ncu_fwd" --force-overwrite $PY benchmarks/gpu_one_forward.py || status=1
    ncu --import "$OUT/ncu_fwd.ncu-rep" --page details > "$OUT/ncu_fwd.txt" 2>&1 || true
  else
    echo "ncu: not on this machine, no capture"
  fi
fi

if [[ " $STAGES " == *" bench "* ]]; then
  ops=()
  [ -n "${GPU_SUITE_BENCH_OPS:-}" ] && ops=(--ops "$GPU_SUITE_BENCH_OPS")
  run bench "$(share 15 600)" "$OUT/bench.log" $PY benchmarks/run.py "${ops[@]}" \
    --profile "${GPU_SUITE_PROFILE:-quick}" --device cuda --csv "$OUT/gpu.csv" \
    --plots "$OUT/plots" --triton-winners "$OUT/triton_winners.json" || status=1
  # run.py plots at its end; a run cut off before then still gets plots of the rows it wrote
  [[ -e "$OUT/plots/summary.png" ]] ||
    timeout 60 $PY benchmarks/plot.py "$OUT/gpu.csv" "$OUT/plots" > "$OUT/plot.log" 2>&1 || true
  grep -E "speedup|fastattn:|FAIL|ERROR" "$OUT/bench.log" | head -n 80
  sed -n '/^summary (/,/^rows appended/p' "$OUT/bench.log"
fi
exit $status
