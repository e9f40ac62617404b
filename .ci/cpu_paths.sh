#!/usr/bin/env bash
# The CPU paths `make test` does not reach by default, run against the same build (.venv):
# 1. every CPU ISA copy below the one this host runs by default (FASTATTN_CPU_ISA forces each:
#    avx512bf16 -> avx512, avx2, base; avx512 -> avx2, base; avx2 -> base), on the cpu
#    backend's quick tests of attention (dense, biased, varlen, KV cache), the recurrent layers
#    and positional encodings, the checks' teeth and the fuzz properties;
# 2. every case of the CUDA attention emulator (tools/cuda_emu/run.py; make test runs its
#    learned-bias cases), alone, so that its threads do not compete with test workers;
# 3. a seeded stratified quarter of the slow grids on the cpu backend (tests/conftest.py:
#    FASTATTN_SLOW=0.25 with FASTATTN_SLOW_SEED, 0 unless CI_SLOW_SEED says otherwise: a fixed
#    seed, so that a red CI is reproducible; other seeds run the other quarters).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
PYTEST_OPTS=(-q -p no:cacheprovider -n 2 --timeout=1200)
default=$("$PY" -c "import fastattn; print(fastattn.build_info()['cpu_isa'])")
case "$default" in
  avx512bf16) lower="avx512 avx2 base" ;;
  avx512) lower="avx2 base" ;;
  avx2) lower="base" ;;
  *) lower="" ;;
esac
ISA_TESTS=(tests/test_attention.py tests/test_attention_bias_grad.py tests/test_varlen_attention.py
  tests/test_attention_with_kvcache.py tests/test_lstm.py tests/test_gru_rnn.py
  tests/test_positional.py tests/test_check_teeth.py tests/test_fuzz.py)
for isa in $lower; do
  start=$(date +%s)
  echo "cpu paths: the $isa copy (this host's default: $default)"
  FASTATTN_CPU_ISA=$isa "$PY" -c "import fastattn, sys; isa = fastattn.build_info()['cpu_isa']; \
print('forced:', isa); sys.exit(isa != '$isa')"
  FASTATTN_CPU_ISA=$isa "$PY" -m pytest "${ISA_TESTS[@]}" -k cpu -m "not slow" "${PYTEST_OPTS[@]}"
  echo "cpu paths: $isa copy: $(( $(date +%s) - start )) s"
done
start=$(date +%s)
echo "cpu paths: every CUDA attention emulator case"
PYTHONPATH=. "$PY" tools/cuda_emu/run.py > /tmp/fastattn-emulator.log 2>&1 || {
  grep -v "^ok " /tmp/fastattn-emulator.log | tail -n 60; exit 1; }
tail -n 1 /tmp/fastattn-emulator.log
echo "cpu paths: emulator: $(( $(date +%s) - start )) s"
start=$(date +%s)
seed=${CI_SLOW_SEED:-0}
echo "cpu paths: a quarter of the slow grids on the cpu backend, FASTATTN_SLOW_SEED=$seed"
FASTATTN_SLOW=0.25 FASTATTN_SLOW_SEED=$seed "$PY" -m pytest tests/test_attention.py \
  tests/test_lstm.py tests/test_gru_rnn.py -m slow -k cpu "${PYTEST_OPTS[@]}"
echo "cpu paths: slow quarter: $(( $(date +%s) - start )) s"
