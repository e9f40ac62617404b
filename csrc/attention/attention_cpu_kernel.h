// Tiled attention loops on raw pointers (no ATen), compiled once per x86 ISA.
// attention_cpu.cpp checks arguments, allocates outputs and calls these through cpu_isa.h.
#pragma once
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cstdint>

namespace fastattn::cpu {

enum class MaskKind : int { none = 0, boolean = 1, float32 = 2, float64 = 3, float16 = 4, bfloat16 = 5 };

// Strides of a (B, H, L, D) tensor (elements); the last stride is 1.
struct Strides4 {
  int64_t b, h, l;
};

struct AttentionProblem {
  const void *q, *k, *v;
  Strides4 q_s, k_s, v_s;
  int64_t B, Hq, Hkv, Lq, Lk, D, Dv;
  const void* mask;  // (B, Hq, Lq, Lk) view, any strides
  MaskKind mask_kind;
  int64_t mask_sb, mask_sh, mask_sq, mask_sk;
  const bool* key_padding;  // (B, Lk) contiguous, true = ignore
  const float* alibi;       // (B, Hq) view
  int64_t alibi_sb, alibi_sh;
  double scale, softcap;
  int64_t window_lo, window_hi;  // key j visible to query i iff i+lo <= j <= i+hi
  double dropout_p;
  uint64_t seed, stream;
};

struct AttentionForwardParams {
  AttentionProblem p;
  void* out;
  Strides4 out_s;
  void* lse;  // (B, Hq, Lq) contiguous, float (double for double inputs)
};

struct AttentionBackwardParams {
  AttentionProblem p;
  const void* out;
  Strides4 out_s;
  const void* grad_out;
  Strides4 grad_out_s;
  const void* lse;       // (B, Hq, Lq) contiguous, compute type
  const void* grad_lse;  // (B, Hq, Lq) contiguous or nullptr, compute type
  void *dq, *dk, *dv;    // contiguous (B, H, L, D) outputs
};

#define FASTATTN_DECLARE_ATTENTION_KERNELS(ISA)                               \
  namespace ISA {                                                             \
  template <typename T> void attention_forward(const AttentionForwardParams&);   \
  template <typename T> void attention_backward(const AttentionBackwardParams&); \
  }

FASTATTN_DECLARE_ATTENTION_KERNELS(avx512bf16)
FASTATTN_DECLARE_ATTENTION_KERNELS(avx512)
FASTATTN_DECLARE_ATTENTION_KERNELS(avx2)
FASTATTN_DECLARE_ATTENTION_KERNELS(base)

}  // namespace fastattn::cpu
