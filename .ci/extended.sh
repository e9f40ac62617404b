#!/usr/bin/env bash
# The checks `make test` leaves out, run against the same build (.venv), by part:
#   bash .ci/extended.sh PART...      PART: isa, emulator-attention, emulator-recurrent,
#                                     slow-grids, triton-aot, torch-2.11, or all
#                                     (`make test-extended`)
# isa                 every CPU ISA copy below the one this host runs by default
#                     (FASTATTN_CPU_ISA forces each: avx512bf16 -> avx512, avx2, base;
#                     avx512 -> avx2, base; avx2 -> base) on the cpu backend's quick tests of
#                     attention (dense, biased, varlen, KV cache), the recurrent layers and
#                     positional encodings, the checks' teeth, the fuzz properties and NaN
#                     inputs;
# emulator-attention  every case of the CUDA attention emulator (tools/cuda_emu/run.py), alone,
#                     so that its threads do not compete with test workers, then the NaN
#                     input tests on it (tools/cuda_emu/emu_route.py);
# emulator-recurrent  the CUDA recurrent kernels and the attention backward's learned-bias
#                     gradient on the emulators (tests/test_cuda_emulator.py);
# slow-grids          a seeded stratified sixteenth of the slow grids on the cpu backend
#                     (tests/conftest.py: FASTATTN_SLOW=0.0625, FASTATTN_SLOW_SEED from
#                     CI_SLOW_SEED, else this commit's count: each commit runs a fixed
#                     sixteenth, so a red run is reproducible, and successive commits go
#                     round the others);
# triton-aot          every Triton kernel variant compiled for sm_90 with the GPU machine's
#                     triton (.ci/gpu_machine_check.sh with GPU_CHECK_AOT=1);
# torch-2.11          the wheel under the GPU machine's torch 2.11.0 and Python 3.12: the build,
#                     backend, compile and transformers tests and the cpu backend's quick
#                     attention and LSTM tests (.ci/gpu_machine_check.sh, GPU_CHECK_TESTS=1).
# CI runs one part per commit, in turn (.ci/run); each takes 3-7 minutes on a 2-core machine.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
PYTEST_OPTS=(-q -p no:cacheprovider -n 2 --timeout=1200)
PARTS=(isa emulator-attention emulator-recurrent slow-grids triton-aot torch-2.11)
[ $# -gt 0 ] || { echo "usage: extended.sh PART... (${PARTS[*]} or all)"; exit 2; }
[ "$1" = all ] && set -- "${PARTS[@]}"

isa_copies() {
  local default lower isa start
  default=$("$PY" -c "import fastattn; print(fastattn.build_info()['cpu_isa'])")
  case "$default" in
    avx512bf16) lower="avx512 avx2 base" ;;
    avx512) lower="avx2 base" ;;
    avx2) lower="base" ;;
    *) lower="" ;;
  esac
  local tests=(tests/test_attention.py tests/test_attention_bias_grad.py
    tests/test_varlen_attention.py tests/test_attention_with_kvcache.py tests/test_lstm.py
    tests/test_gru_rnn.py tests/test_positional.py tests/test_check_teeth.py tests/test_fuzz.py
    tests/test_nan_inputs.py)
  for isa in $lower; do
    start=$(date +%s)
    echo "extended: the $isa copy (this host's default: $default)"
    FASTATTN_CPU_ISA=$isa "$PY" -c "import fastattn, sys; isa = fastattn.build_info()['cpu_isa']; \
print('forced:', isa); sys.exit(isa != '$isa')"
    FASTATTN_CPU_ISA=$isa "$PY" -m pytest "${tests[@]}" -k cpu -m "not slow" "${PYTEST_OPTS[@]}"
    echo "extended: $isa copy: $(( $(date +%s) - start )) s"
  done
}

emulator_attention() {
  PYTHONPATH=. "$PY" tools/cuda_emu/run.py > /tmp/fastattn-emulator.log 2>&1 || {
    grep -v "^ok " /tmp/fastattn-emulator.log | tail -n 60; exit 1; }
  tail -n 1 /tmp/fastattn-emulator.log
  PYTHONPATH=.:tools/cuda_emu "$PY" -m pytest -p emu_route tests/test_nan_inputs.py \
    -k "cpu and attention_nan" -q -p no:cacheprovider --timeout=1600
}

emulator_recurrent() {
  "$PY" -m pytest tests/test_cuda_emulator.py -m slow -q -p no:cacheprovider --timeout=1600
}

slow_grids() {
  local seed=${CI_SLOW_SEED:-$(git rev-list --count HEAD 2>/dev/null || echo 0)}
  echo "extended: FASTATTN_SLOW=0.0625 FASTATTN_SLOW_SEED=$seed"
  FASTATTN_SLOW=0.0625 FASTATTN_SLOW_SEED=$seed "$PY" -m pytest tests/test_attention.py \
    tests/test_lstm.py tests/test_gru_rnn.py -m slow -k cpu "${PYTEST_OPTS[@]}"
}

for part in "$@"; do
  start=$(date +%s)
  echo "extended: $part"
  case "$part" in
    isa) isa_copies ;;
    emulator-attention) emulator_attention ;;
    emulator-recurrent) emulator_recurrent ;;
    slow-grids) slow_grids ;;
    triton-aot) GPU_CHECK_AOT=1 bash .ci/gpu_machine_check.sh ;;
    torch-2.11) GPU_CHECK_TESTS=1 bash .ci/gpu_machine_check.sh ;;
    *) echo "extended: no part $part (${PARTS[*]})"; exit 2 ;;
  esac
  echo "extended: $part: $(( $(date +%s) - start )) s"
done
