// LSTM loops on raw pointers (no ATen), compiled once per x86 ISA.
// lstm_cpu.cpp checks arguments, sorts the batch by length, packs the weights, runs the large
// GEMMs (input projection, weight gradients) with ATen, and calls these for the recurrence.
//
// Conventions shared by every kernel here ("acc" is float, double for double storage):
//
// * Rows are ordered by time, then by length: the batch is sorted by length, longest first
//   (stable), and sorted row j is batch entry perm[j]. At time t the active rows are the first
//   batch_sizes[t] = #{j : len_j > t} sorted rows (PackedSequence's batch_sizes), the same set
//   for both directions. "Packed" buffers hold those rows only: time t occupies packed rows
//   [offsets[t], offsets[t] + batch_sizes[t]); offsets[T] = total = sum of the lengths. Without
//   lengths perm is the identity, batch_sizes[t] = B and the packed rows are the (T * B) rows of
//   a time-major tensor.
// * Direction 0 runs t = 0 .. T-1; direction 1 (reverse) runs t = T-1 .. 0, and its row j
//   starts from h0/c0 at t = len_j - 1. Both directions advance together, step s running
//   t = s (direction 0) and t = T-1-s (direction 1).
// * Gate columns in the forward workspace are blocked: hidden units are grouped in blocks of
//   kUnitBlock (the last block may be shorter, hb units), and block k, starting at unit
//   u0 = k * kUnitBlock, holds columns [4 * u0, 4 * u0 + 4 * hb) = [i(hb) f(hb) g(hb) o(hb)].
//   So the per-step GEMM of one block produces all four gates of its units and the pointwise
//   cell runs right after it on the tile it just wrote (the fused epilogue).
#pragma once
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cstdint>

namespace fastattn::cpu {

constexpr int64_t kLstmUnitBlock = 32;  // hidden units per gate block (4 x 32 gate columns)

// The sorted, packed view of a (T, B) batch with per-sequence lengths.
struct LstmPacking {
  int64_t T, B;
  const int64_t* perm;         // (B,) sorted row -> batch index
  const int64_t* lengths;      // (B,) length of sorted row j (non-increasing)
  const int64_t* batch_sizes;  // (T,) active rows at time t
  const int64_t* offsets;      // (T + 1,) first packed row of time t; offsets[T] = total
};

// Xp[offsets[t] + j, :] = dropout(input[t, perm[j], :]) in acc, for every active (t, j).
// Dropout element numbering: (t * B + perm[j]) * I + i (row-major over the (T, B, I) input).
struct LstmGatherParams {
  LstmPacking pk;
  const void* input;  // (T, B, I) storage type, strides below, unit last stride
  int64_t I, stride_t, stride_b;
  void* xp;           // (total, I) acc, contiguous
  double dropout_p;
  uint64_t seed, stream;
};

// grad_input[t, b, :] = dropout_mask * dX[packed row of (t, b)], 0 where t >= len_b.
struct LstmScatterParams {
  LstmPacking pk;
  const void* dx;     // (total, I) acc
  void* grad_input;   // (T, B, I) storage type, contiguous
  int64_t I;
  double dropout_p;
  uint64_t seed, stream;
};

// One layer, D directions: the weights in acc, in their natural (torch) layout; the kernels
// pack them into the panels their GEMMs stream (one pass each, once per call).
struct LstmLayerWeights {
  int64_t D, H, P;        // P = projection size (H without projection)
  const void* w_hh;       // (D, 4H, P) contiguous
  const void* w_hr;       // (D, P, H) contiguous, or nullptr without projection
};

// Natural gate row (i, f, g, o blocks of H) of column n of the blocked gate order.
inline int64_t lstm_natural_gate_row(int64_t n, int64_t H) {
  const int64_t u0 = (n / (4 * kLstmUnitBlock)) * kLstmUnitBlock;
  const int64_t hb = H - u0 < kLstmUnitBlock ? H - u0 : kLstmUnitBlock;
  const int64_t within = n - 4 * u0;
  return (within / hb) * H + u0 + within % hb;
}

// Forward workspace of direction d (acc), rows are packed rows, Bt = T * B rows reserved:
//   gates (Bt, 4H): on entry x W_ih^T + b_ih + b_hh (blocked columns) for every packed row;
//                   on exit the activated gates i, f, g, o (blocked columns)
//   cells (Bt, H):  c_t
//   hidden (Bt, P): h_t (after the projection)
// and the direction's block starts at workspace + d * (Bt * (5H + P)).
struct LstmForwardParams {
  LstmPacking pk;
  LstmLayerWeights w;
  const void* h0;      // (D, B, P) storage type, contiguous
  const void* c0;      // (D, B, H) storage type, contiguous
  void* workspace;     // acc, see above
  void* output;        // (T, B, D * P) storage type, contiguous; inactive rows left untouched
  void* h_n;           // (D, B, P) storage type
  void* c_n;           // (D, B, H) storage type
};

// Backward through time. Reads the forward workspace; writes, per direction d:
//   dgates (D, total, 4H) acc, natural gate order (i, f, g, o), for the weight-gradient GEMMs
//   dh (D, total, P) acc and r (D, total, H) acc (projection only: dW_hr = dh^T r)
//   hprev (D, total, P) acc: the h each packed row read (h_{t-1}, or h0 where it started)
//   grad_h0 (D, B, P), grad_c0 (D, B, H) in the storage type
struct LstmBackwardParams {
  LstmPacking pk;
  LstmLayerWeights w;
  const void* h0;
  const void* c0;
  const void* workspace;
  const void* grad_output;  // (T, B, D * P) storage type, contiguous, or nullptr (zeros)
  const void* grad_h_n;     // (D, B, P) storage type or nullptr
  const void* grad_c_n;     // (D, B, H) storage type or nullptr
  void* dgates;
  void* dh;                 // nullptr without projection
  void* r;                  // nullptr without projection
  void* hprev;
  void* grad_h0;
  void* grad_c0;
};

// One LSTM cell step for a batch of B rows (torch gate order i, f, g, o in every buffer).
// With pre == nullptr the kernel computes the gate pre-activations itself, fused with the cell:
// each task takes a block of hidden units, forms the dot products of their 4 gate rows of W_ih
// and W_hh with every batch row (one pass over the weights: the small-batch path) and applies
// the cell to them. Otherwise pre holds the pre-activations (lstm_cpu.cpp ran a GEMM).
struct LstmCellParams {
  int64_t B, I, H;
  const void* pre;       // (B, 4H) acc, or nullptr (fused)
  const void* x;         // (B, I) acc (converted by the caller), contiguous (fused only)
  const void* h;         // (B, H) acc (fused only)
  const void* c;         // (B, H) storage type, contiguous
  const void* w_ih;      // (4H, I) acc, contiguous (fused only)
  const void* w_hh;      // (4H, H) acc (fused only)
  const void* bias;      // (4H,) acc = b_ih + b_hh, or nullptr (fused only)
  void* workspace;       // (B, 5H) acc: activated i, f, g, o and tanh(c')
  void* hy;              // (B, H) storage type
  void* cy;              // (B, H) storage type
};

// dgates (B, 4H) acc (torch order) and grad_cx (B, H) from the cell's workspace.
struct LstmCellBackwardParams {
  int64_t B, H;
  const void* grad_hy;   // (B, H) storage, or nullptr
  const void* grad_cy;   // (B, H) storage, or nullptr
  const void* cx;        // (B, H) storage
  const void* workspace; // (B, 5H) acc
  void* dgates;          // (B, 4H) acc
  void* grad_cx;         // (B, H) storage
};

// C (M x N, row-major, leading dimension ldc) = A B (+ bias on every row) (+ C if accumulate),
// A(m, k) = A[m * a_m + k * a_k], B(k, n) = B[k * b_k + n * b_n]: float, any strides. The large
// GEMMs of a layer (input projection, weight and input gradients over all time steps) run
// through this packed, cache-blocked, parallel driver of common/cpu_gemm.h's AVX-512
// micro-kernel; lstm_cpu.cpp uses it where that micro-kernel exists (the avx512 copy) and
// ATen's GEMM otherwise.
struct LstmGemmParams {
  int64_t M, N, K;
  const float* A;
  int64_t a_m, a_k;
  const float* B;
  int64_t b_k, b_n;
  const int64_t* b_cols;  // (N,) column n of the product reads column b_cols[n] of B, or nullptr
  float* C;
  int64_t ldc;
  const float* bias;  // (N,) or nullptr
  bool accumulate;
};

#define FASTATTN_DECLARE_LSTM_KERNELS(ISA)                                      \
  namespace ISA {                                                               \
  template <typename T> void lstm_gather_input(const LstmGatherParams&);        \
  template <typename T> void lstm_scatter_grad_input(const LstmScatterParams&); \
  template <typename T> void lstm_layer_forward(const LstmForwardParams&);      \
  template <typename T> void lstm_layer_backward(const LstmBackwardParams&);    \
  template <typename T> void lstm_cell_forward(const LstmCellParams&);          \
  template <typename T> void lstm_cell_backward(const LstmCellBackwardParams&); \
  void lstm_gemm(const LstmGemmParams&);                                        \
  }

FASTATTN_DECLARE_LSTM_KERNELS(avx512bf16)
FASTATTN_DECLARE_LSTM_KERNELS(avx512)
FASTATTN_DECLARE_LSTM_KERNELS(avx2)
FASTATTN_DECLARE_LSTM_KERNELS(base)

}  // namespace fastattn::cpu
