// The machine's measured float32 multiply-add peak, for the benchmarks' "of peak" column
// (`make bench` prints it beside the CPU rows; docs/design/cpu_kernels.md).
#pragma once
#include <cstdint>

namespace fastattn::cpu {

#define FASTATTN_DECLARE_FMA_PEAK(ISA)                               \
  namespace ISA {                                                    \
  /* *gflops = GFLOP/s of independent multiply-add chains on torch's \
     intra-op threads, the best of `repeats` timed passes (an out    \
     argument: FASTATTN_CPU_ISA_CALL calls it, common/cpu_isa.h) */  \
  void fma_peak_gflops(int64_t repeats, double* gflops);             \
  }

FASTATTN_DECLARE_FMA_PEAK(avx512bf16)
FASTATTN_DECLARE_FMA_PEAK(avx512)
FASTATTN_DECLARE_FMA_PEAK(avx2)
FASTATTN_DECLARE_FMA_PEAK(base)

}  // namespace fastattn::cpu
