#!/usr/bin/env bash
# The GPU attention kernels' tuning run, sized for one device call (10 minutes at most):
#   bash benchmarks/gpu_tune.sh OUTDIR        (device call: timeout_s 600)
# It is benchmarks/gpu_suite.sh with these stages (each cut off by its share of the budget; a
# stage that runs out is reported and the next one still runs):
#   build   fastattn in place for the visible GPU's arch only
#   tests   a correctness smoke of the attention kernels: the CUDA and Triton cases of the
#           attention test files (GPU_SUITE_TESTS to change them), autotuning off
#   report  tools/kernel_report.py on the built arch (what the kernels that run compile to)
#   ncu     one `ncu --set full` capture of the plain forward tensor-core kernel (stall reasons,
#           tensor-pipe utilisation), when ncu is on the machine
#   bench   the attention rows (forward and forward+backward, every SDPA backend as a peer),
#           Triton autotuning on; its choices in OUTDIR/triton_winners.json
# OUTDIR then holds commit.txt, nvidia-smi.txt, environment.txt, the logs, gpu.csv, plots,
# kernel_report.{txt,json}, ncu_fwd.{ncu-rep,txt} and triton_winners.json: commit it under
# benchmarks/results/gpu-<device>-<date>/, then put each head-dim class's winners first in
# fastattn/triton/attention_tuning.py's tables and update the speed table from gpu.csv.
set -euo pipefail
cd "$(dirname "$0")/.."
export GPU_SUITE_STAGES=${GPU_SUITE_STAGES:-build tests report ncu bench}
export GPU_SUITE_TESTS=${GPU_SUITE_TESTS:-tests/test_attention_cuda.py tests/test_attention.py}
export GPU_SUITE_BENCH_OPS=${GPU_SUITE_BENCH_OPS:-attention}
exec bash benchmarks/gpu_suite.sh "$@"
