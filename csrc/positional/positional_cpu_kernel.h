// Positional-encoding loops on raw pointers (no ATen), compiled once per x86 ISA.
// positional_cpu.cpp checks the arguments, allocates, and calls these through cpu_isa.h.
#pragma once
#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Half.h>
#include <cstdint>

namespace fastattn::cpu {

// Sinusoid rows PE[pos] (interleaved sin/cos) for `count` positions; out is (count, dim).
struct SinusoidTableParams {
  const int64_t* positions;  // (count,)
  void* out;                 // (count, dim) contiguous
  int64_t count, dim;
  double base;
};

// out[n, l, :] = dropout(x[n, l, :] * scale + PE[offset + offsets[n] + l])   (add_pe)
// out[n, l, :] = dropout(x[n, l, :] * scale)                                  (!add_pe: backward)
struct AddSinusoidalParams {
  const void* x;
  void* out;
  int64_t N, L, D;
  int64_t x_stride_n, x_stride_l, out_stride_n, out_stride_l;
  int64_t offset;
  const int64_t* offsets;  // (N,) or nullptr
  double scale, base, dropout_p;
  uint64_t seed, stream;
  bool add_pe;
};

// out[n, l, :] = dropout(weight[tokens[n, l]] * scale + P[offset + offsets[n] + l]), P a learned
// table (table != nullptr) or the sinusoid. tokens are in range (checked by the caller).
struct EmbedParams {
  const int64_t* tokens;  // (N, L) contiguous
  const void* weight;     // (V, D), row stride weight_stride
  const void* table;      // (P, D) or nullptr, row stride table_stride
  void* out;              // (N, L, D) contiguous
  int64_t N, L, D, weight_stride, table_stride;
  int64_t offset;
  const int64_t* offsets;
  double scale, base, dropout_p;
  uint64_t seed, stream;
};

// grad_weight[v] = scale * sum over (n, l) with tokens == v, v != padding_idx, of dropped(grad);
// grad_table[p] = sum over (n, l) at position p of dropped(grad). Deterministic (sorted sums).
struct EmbedBackwardParams {
  const void* grad;       // (N, L, D) contiguous
  const int64_t* tokens;  // (N, L) contiguous
  void* grad_weight;      // (V, D) contiguous, written entirely
  void* grad_table;       // (P, D) contiguous or nullptr, written entirely
  int64_t N, L, D, V, P;
  int64_t padding_idx;  // -1: none
  int64_t offset;
  const int64_t* offsets;
  double scale, dropout_p;
  uint64_t seed, stream;
};

// Rotary embedding of x (B, H, L, D) into out (may alias x). cos/sin: (P, rotary_dim / 2) in the
// compute type (float, double for double x), or nullptr to compute angles from `base`.
struct RotaryParams {
  const void* x;
  void* out;
  int64_t B, H, L, D, rotary_dim;
  int64_t x_stride_b, x_stride_h, x_stride_l, out_stride_b, out_stride_h, out_stride_l;
  const void* cos;
  const void* sin;
  int64_t table_stride;
  double base;
  int64_t offset;
  const int64_t* offsets;       // (B,) or nullptr
  const int64_t* position_ids;  // (B, L) contiguous or nullptr
  bool interleaved, conjugate, copy_tail;
};

#define FASTATTN_DECLARE_POSITIONAL_KERNELS(ISA)                  \
  namespace ISA {                                                 \
  template <typename T>                                           \
  void sinusoidal_table(const SinusoidTableParams&);              \
  template <typename T>                                           \
  void add_sinusoidal(const AddSinusoidalParams&);                \
  template <typename T>                                           \
  void embed_with_positions(const EmbedParams&);                  \
  template <typename T>                                           \
  void embed_with_positions_backward(const EmbedBackwardParams&); \
  template <typename T>                                           \
  void apply_rotary(const RotaryParams&);                         \
  }

FASTATTN_DECLARE_POSITIONAL_KERNELS(avx512bf16)
FASTATTN_DECLARE_POSITIONAL_KERNELS(avx512)
FASTATTN_DECLARE_POSITIONAL_KERNELS(avx2)
FASTATTN_DECLARE_POSITIONAL_KERNELS(base)

}  // namespace fastattn::cpu
