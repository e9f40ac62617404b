// Runtime choice among the copies of each *_cpu_kernel.cpp compiled for several x86 ISAs
// (CMakeLists.txt compiles each kernel file once per ISA into namespace fastattn::cpu::<isa>).
#pragma once
#include <cstdlib>
#include <cstring>

namespace fastattn::cpu {

enum class Isa { base, avx2, avx512, avx512bf16 };

inline Isa detect_isa() {
  // FASTATTN_CPU_ISA=base|avx2|avx512 caps the choice (for tests of the other copies).
  // avx512bf16 adds AVX512-BF16 dot products (bfloat16 attention) to avx512; the cap
  // avx512bf16 keeps that copy but turns off its AMX tile products (cpu_amx.h).
  const char* cap = std::getenv("FASTATTN_CPU_ISA");
#if defined(__x86_64__)
  __builtin_cpu_init();
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("f16c") && __builtin_cpu_supports("bmi2");
  const bool bf16 = avx512 && __builtin_cpu_supports("avx512bf16");
  Isa best =
      avx512 && avx2 ? (bf16 ? Isa::avx512bf16 : Isa::avx512) : (avx2 ? Isa::avx2 : Isa::base);
#else
  Isa best = Isa::base;
#endif
  if (cap != nullptr) {
    if (std::strcmp(cap, "base") == 0) return Isa::base;
    if (std::strcmp(cap, "avx2") == 0 && best != Isa::base) return Isa::avx2;
    if (std::strcmp(cap, "avx512") == 0 && best == Isa::avx512bf16) return Isa::avx512;
  }
  return best;
}

inline Isa cpu_isa() {
  static const Isa isa = detect_isa();
  return isa;
}

inline const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::avx512bf16:
      return "avx512bf16";
    case Isa::avx512:
      return "avx512";
    case Isa::avx2:
      return "avx2";
    default:
      return "base";
  }
}

}  // namespace fastattn::cpu

// Calls fastattn::cpu::<isa>::FN<TEMPLATE_ARGS>(ARGS...) for the ISA chosen at run time.
#define FASTATTN_CPU_ISA_CALL(FN, ...)                \
  do {                                                \
    switch (::fastattn::cpu::cpu_isa()) {             \
      case ::fastattn::cpu::Isa::avx512bf16:          \
        ::fastattn::cpu::avx512bf16::FN(__VA_ARGS__); \
        break;                                        \
      case ::fastattn::cpu::Isa::avx512:              \
        ::fastattn::cpu::avx512::FN(__VA_ARGS__);     \
        break;                                        \
      case ::fastattn::cpu::Isa::avx2:                \
        ::fastattn::cpu::avx2::FN(__VA_ARGS__);       \
        break;                                        \
      default:                                        \
        ::fastattn::cpu::base::FN(__VA_ARGS__);       \
        break;                                        \
    }                                                 \
  } while (0)
