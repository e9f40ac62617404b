// The recurrent engine's loops on raw pointers (no ATen), compiled once per x86 ISA: one
// layer driver generic over the cell (LSTM, GRU with the reset gate after or before W_hn,
// tanh / relu Elman RNN; RecurrentCell below), and the LSTM cell op's loops.
// recurrent_cpu.cpp checks arguments, sorts the batch by length, runs the large GEMMs (input
// projection, weight gradients) and calls these for the recurrence.
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
// * A cell has G gate blocks of H rows in W_ih / W_hh (LSTM 4: i, f, g, o; GRU 3: r, z, n;
//   RNN 1). Gate columns in the forward workspace are blocked: hidden units are grouped in
//   blocks of kRecurrentUnitBlock (the last block may be shorter, hb units), and block k,
//   starting at unit u0 = k * kRecurrentUnitBlock, holds columns [G * u0, G * u0 + G * hb) =
//   the G gates of its units side by side. So the per-step GEMM of one block produces every
//   gate of its units and the pointwise cell runs right after it on the tile it just wrote
//   (the fused epilogue).
#pragma once
#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Half.h>
#include <cstdint>

namespace fastattn::cpu {

constexpr int64_t kRecurrentUnitBlock = 32;  // hidden units per gate block (G x 32 columns)

// The cell a layer runs. Per cell: G gate blocks, E extra state columns per unit saved in the
// workspace (LSTM: c_t; GRU reset-after: W_hn h + b_hn; GRU reset-before: r * h_{t-1}).
enum class RecurrentCell : int {
  lstm = 0,
  gru = 1,
  gru_reset_before = 2,
  rnn_tanh = 3,
  rnn_relu = 4
};

inline int64_t cell_gates(RecurrentCell c) {
  switch (c) {
    case RecurrentCell::lstm:
      return 4;
    case RecurrentCell::gru:
    case RecurrentCell::gru_reset_before:
      return 3;
    default:
      return 1;
  }
}
inline int64_t cell_extra(RecurrentCell c) {
  return c == RecurrentCell::rnn_tanh || c == RecurrentCell::rnn_relu ? 0 : 1;
}

// The sorted, packed view of a (T, B) batch with per-sequence lengths.
struct RecurrentPacking {
  int64_t T, B;
  const int64_t* perm;         // (B,) sorted row -> batch index
  const int64_t* lengths;      // (B,) length of sorted row j (non-increasing)
  const int64_t* batch_sizes;  // (T,) active rows at time t
  const int64_t* offsets;      // (T + 1,) first packed row of time t; offsets[T] = total
};

// Xp[offsets[t] + j, :] = dropout(input[t, perm[j], :]) in acc, for every active (t, j).
// Dropout element numbering: (t * B + perm[j]) * I + i (row-major over the (T, B, I) input).
struct RecurrentGatherParams {
  RecurrentPacking pk;
  const void* input;  // (T, B, I) storage type, strides below, unit last stride
  int64_t I, stride_t, stride_b;
  void* xp;  // (total, I) acc, contiguous
  double dropout_p;
  uint64_t seed, stream;
};

// grad_input[t, b, :] = dropout_mask * dX[packed row of (t, b)], 0 where t >= len_b.
struct RecurrentScatterParams {
  RecurrentPacking pk;
  const void* dx;    // (total, I) acc
  void* grad_input;  // (T, B, I) storage type, contiguous
  int64_t I;
  double dropout_p;
  uint64_t seed, stream;
};

// One layer, D directions: the weights in acc, in their natural (torch) layout; the kernels
// pack them into the panels their GEMMs stream (one pass each, once per call).
struct RecurrentWeights {
  RecurrentCell cell;
  int64_t D, H, P;        // P = projection size (H without projection; LSTM only)
  const void* w_hh;       // (D, G H, P) contiguous; in the forward of a bfloat16 layer on the
                          // avx512bf16 copy only for the reset-before GRU (else nullptr)
  const void* w_hh_bf16;  // the same in bfloat16 there (its per-step products), else nullptr
  const void* w_hr;       // (D, P, H) contiguous, or nullptr without projection
  const void* b_hn;       // (D, H) contiguous: the GRU's reset-after b_hn, or nullptr (zero)
};

// Natural gate row (G blocks of H) of column n of the blocked order of G gates.
inline int64_t natural_gate_row(int64_t n, int64_t H, int64_t G) {
  const int64_t u0 = (n / (G * kRecurrentUnitBlock)) * kRecurrentUnitBlock;
  const int64_t hb = H - u0 < kRecurrentUnitBlock ? H - u0 : kRecurrentUnitBlock;
  const int64_t within = n - G * u0;
  return (within / hb) * H + u0 + within % hb;
}

// Forward workspace of direction d (acc), rows are packed rows, Bt = T * B rows reserved:
//   gates (Bt, G H): on entry x W_ih^T + b_ih + b_hh (blocked columns) for every packed row
//                    (the GRU's reset-after n gate: b_in only, b_hn is added inside r * (.));
//                    on exit the activated gates (blocked columns)
//   extra (Bt, E H): c_t (LSTM), W_hn h + b_hn (GRU reset-after), r * h_{t-1} (reset-before)
//   hidden (Bt, P):  h_t (after the projection)
// and the direction's block starts at workspace + d * recurrent_workspace_per_row(...) * Bt.
inline int64_t recurrent_workspace_per_row(RecurrentCell c, int64_t H, int64_t P) {
  return (cell_gates(c) + cell_extra(c)) * H + P;
}

struct RecurrentForwardParams {
  RecurrentPacking pk;
  RecurrentWeights w;
  const void* h0;   // (D, B, P) storage type, contiguous
  const void* c0;   // (D, B, H) storage type, contiguous (LSTM only, else nullptr)
  void* workspace;  // acc, see above
  // false (inference): the extra and hidden parts of the workspace hold the last two steps
  // only, row (s & 1) * B + j at step s (the backward cannot run from it)
  bool save_states;
  void* output;  // (T, B, D * P) storage type, contiguous; inactive rows left untouched
  void* h_n;     // (D, B, P) storage type
  void* c_n;     // (D, B, H) storage type (LSTM only)
};

// Backward through time. Reads the forward workspace; writes, per direction d:
//   dgates (D, total, G H) acc, natural gate order: the gradients of the input-side
//          pre-activations x W_ih^T + b_ih, for the weight-gradient GEMMs
//   aux (D, total, H) acc, GRU reset-after only: the gradient of W_hn h + b_hn (r * d_n)
//   dh (D, total, P) acc and r (D, total, H) acc (projection only: dW_hr = dh^T r)
//   hprev (D, total, P) acc: the h each packed row read (h_{t-1}, or h0 where it started)
//   grad_h0 (D, B, P), grad_c0 (D, B, H) (LSTM only) in the storage type
struct RecurrentBackwardParams {
  RecurrentPacking pk;
  RecurrentWeights w;
  const void* h0;
  const void* c0;
  const void* workspace;
  const void* grad_output;  // (T, B, D * P) storage type, contiguous, or nullptr (zeros)
  const void* grad_h_n;     // (D, B, P) storage type or nullptr
  const void* grad_c_n;     // (D, B, H) storage type or nullptr (LSTM only)
  void* dgates;
  void* aux;  // nullptr unless GRU reset-after
  void* dh;   // nullptr without projection
  void* r;    // nullptr without projection
  void* hprev;
  void* grad_h0;
  void* grad_c0;
};

// One LSTM cell step for a batch of B rows (torch gate order i, f, g, o in every buffer).
// With pre == nullptr the kernel computes the gate pre-activations itself, fused with the cell:
// each task takes a block of hidden units, forms the dot products of their 4 gate rows of W_ih
// and W_hh with every batch row (one pass over the weights: the small-batch path) and applies
// the cell to them. Otherwise pre holds the pre-activations (lstm_cpu.cpp ran a GEMM).
// bf16_operands (bfloat16 storage on the avx512bf16 copy): x, h, w_ih and w_hh are the
// bfloat16 tensors themselves, multiplied in bfloat16 dot products (exact products, float sums).
struct LstmCellParams {
  int64_t B, I, H;
  const void* pre;   // (B, 4H) acc, or nullptr (fused)
  const void* x;     // (B, I) acc (converted by the caller), contiguous (fused only)
  const void* h;     // (B, H) acc, contiguous (fused only)
  const void* c;     // (B, H) storage type, contiguous
  const void* w_ih;  // (4H, I) acc, contiguous (fused only)
  const void* w_hh;  // (4H, H) acc, contiguous (fused only)
  const void* bias;  // (4H,) acc = b_ih + b_hh, or nullptr (fused only)
  void* workspace;   // (B, 5H) acc: activated i, f, g, o and tanh(c')
  void* hy;          // (B, H) storage type
  void* cy;          // (B, H) storage type
  bool bf16_operands = false;
};

// dgates (B, 4H) acc (torch order) and grad_cx (B, H) from the cell's workspace.
struct LstmCellBackwardParams {
  int64_t B, H;
  const void* grad_hy;    // (B, H) storage, or nullptr
  const void* grad_cy;    // (B, H) storage, or nullptr
  const void* cx;         // (B, H) storage
  const void* workspace;  // (B, 5H) acc
  void* dgates;           // (B, 4H) acc
  void* grad_cx;          // (B, H) storage
};

#define FASTATTN_DECLARE_LSTM_KERNELS(ISA)                          \
  namespace ISA {                                                   \
  template <typename T>                                             \
  void recurrent_gather_input(const RecurrentGatherParams&);        \
  template <typename T>                                             \
  void recurrent_scatter_grad_input(const RecurrentScatterParams&); \
  template <typename T>                                             \
  void recurrent_layer_forward(const RecurrentForwardParams&);      \
  template <typename T>                                             \
  void recurrent_layer_backward(const RecurrentBackwardParams&);    \
  template <typename T>                                             \
  void lstm_cell_forward(const LstmCellParams&);                    \
  template <typename T>                                             \
  void lstm_cell_backward(const LstmCellBackwardParams&);           \
  }

FASTATTN_DECLARE_LSTM_KERNELS(avx512bf16)
FASTATTN_DECLARE_LSTM_KERNELS(avx512)
FASTATTN_DECLARE_LSTM_KERNELS(avx2)
FASTATTN_DECLARE_LSTM_KERNELS(base)

}  // namespace fastattn::cpu
