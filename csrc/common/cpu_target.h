// The inline namespace of the CPU helper headers (cpu_gemm.h, cpu_math.h, ...), named after
// the instruction set the including file is compiled for. Each *_cpu_kernel.cpp is compiled
// once per ISA (CMakeLists.txt) and its helpers are inline functions: without a namespace per
// ISA, the linker keeps one copy of each (the first it meets) for every copy of the kernels,
// so a baseline or AVX2 kernel could call a helper compiled with AVX-512 (an illegal
// instruction on a CPU without it) and an AVX-512 kernel the baseline helper (slow).
// tests/test_isa_dispatch.py checks the built library: AVX-512 code only in AVX-512 namespaces.
#pragma once

#if defined(__AVX512BF16__)
#define FASTATTN_TARGET_NAMESPACE target_avx512bf16
#elif defined(__AVX512F__)
#define FASTATTN_TARGET_NAMESPACE target_avx512
#elif defined(__AVX2__)
#define FASTATTN_TARGET_NAMESPACE target_avx2
#else
#define FASTATTN_TARGET_NAMESPACE target_base
#endif
