// Tiled attention loops on raw pointers (no ATen), compiled once per x86 ISA.
// attention_cpu.cpp checks arguments, allocates outputs and calls these through cpu_isa.h.
#pragma once
#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Half.h>
#include <cstdint>

namespace fastattn::cpu {

enum class MaskKind : int {
  none = 0,
  boolean = 1,
  float32 = 2,
  float64 = 3,
  float16 = 4,
  bfloat16 = 5
};

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
  // Per-sequence geometry (optional; attn_mask and key_padding are then unused).
  //  - varlen (cu_q != nullptr): q/k/v/out are packed (total, H, D) viewed with batch stride 0;
  //    sequence b owns query rows [cu_q[b], cu_q[b+1]) and key rows [cu_k[b], cu_k[b+1]);
  //    Lq, Lk are the largest lengths; lse is (Hq, total_q).
  //  - KV cache (k_lengths != nullptr): sequence b sees keys [0, k_lengths[b]) and its query i
  //    sits at position q_positions[b] + i.
  // The band then follows the rule (causal_mode 0 off, 1 top-left, 2 at the query position;
  // window_left/right -1 = unbounded), computed per sequence from its own lengths.
  const int32_t* cu_q = nullptr;
  const int32_t* cu_k = nullptr;
  const int32_t* k_lengths = nullptr;
  const int32_t* q_positions = nullptr;
  //  - paged KV cache (block_table != nullptr, with k_lengths): k and v are pools of blocks of
  //    page_size rows, k_s.b / v_s.b the stride of one block; key j of sequence b is row
  //    j % page_size of block block_table[b * block_table_stride + j / page_size]. Lk is the
  //    table's capacity. Forward only.
  const int32_t* block_table = nullptr;
  int64_t block_table_stride = 0;
  int64_t page_size = 0;
  int64_t total_q = 0;
  int causal_mode = 0;
  int64_t window_left = -1, window_right = -1;
  // Forward only: split each row's keys into this many parts computed in parallel and merged
  // (flash-decoding, for few queries and long caches). 1 = no split.
  int64_t kv_splits = 1;
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
  void *dq, *dk, *dv;    // contiguous outputs shaped like q, k, v
  Strides4 dq_s, dk_s, dv_s;
  // d attn_mask (a float mask's gradient), or nullptr: a zeroed accumulator in the compute type
  // shaped like the mask, addressed as (B, Hq, Lq, Lk) through these strides (0 along the
  // mask's broadcast dims, whose contributions it sums).
  void* dmask = nullptr;
  int64_t dmask_sb = 0, dmask_sh = 0, dmask_sq = 0, dmask_sk = 0;
};

#define FASTATTN_DECLARE_ATTENTION_KERNELS(ISA)            \
  namespace ISA {                                          \
  template <typename T>                                    \
  void attention_forward(const AttentionForwardParams&);   \
  template <typename T>                                    \
  void attention_backward(const AttentionBackwardParams&); \
  }

FASTATTN_DECLARE_ATTENTION_KERNELS(avx512bf16)
FASTATTN_DECLARE_ATTENTION_KERNELS(avx512)
FASTATTN_DECLARE_ATTENTION_KERNELS(avx2)
FASTATTN_DECLARE_ATTENTION_KERNELS(base)

}  // namespace fastattn::cpu
