// Device code of the CUDA recurrent backend (recurrent_cuda.cu holds the driver,
// csrc/{lstm,gru,rnn}/*_cuda.cu the op bodies): the LSTM, GRU and Elman RNN layers on one engine,
// the cell a template parameter (Cell below).
//
// Layout conventions (private to this backend; only the workspace's shape is in the contract):
// * Rows are time-major and unpacked: row t * B + b of every (T * B, .) buffer is batch entry b
//   at time t. Variable lengths are handled by per-row masking, not by sorting: at time t row b
//   is active when t < len_b. An inactive row keeps its state unchanged (so the reverse
//   direction, which visits t = T-1 .. 0, starts every row from h0/c0 at t = len_b - 1 without a
//   special case), writes zeros to its output and workspace rows and gets zero gradients.
// * Workspace of direction d (acc), Bt = T * B rows: gates (Bt, G H) in natural torch order
//   (LSTM i, f, g, o; GRU r, z, n; on entry the input projection, on exit the activated gates),
//   the cell's E extra columns (Bt, E H) (LSTM c_t; GRU W_hn h + b_hn or, reset before, r * h;
//   none for the RNN), h_t (Bt, P), so the backward reads what it needs and recomputes no GEMM
//   (as the CPU backend does).
// * Direction 0 visits t = s at step s, direction 1 visits t = T - 1 - s.
//
// The cell's math is the CPU kernel's (recurrent_cpu_kernel.cpp: cell_forward / cell_backward), in
// acc (float, double for double storage), rounded once to the storage type.
//
// tools/cuda_emu/emu_lstm.cpp compiles this file and the recurrent .cu files for the CPU
// (FASTATTN_CUDA_EMULATION: every CUDA thread an OS thread, __syncthreads / grid.sync / warp
// shuffles as barriers) so the whole op bodies run and are compared there with the CPU backend.
#pragma once
#include <cstdint>

#if !defined(FASTATTN_CUDA_EMULATION)
#include <cooperative_groups.h>

#include "common/cuda_utils.cuh"
#define FASTATTN_LSTM_DYNAMIC_SMEM(name) extern __shared__ unsigned char name[]
#define FASTATTN_LSTM_LDCG(p) __ldcg(p)
#endif
#include "common/philox.h"

namespace fastattn::recurrent::cuda_kernels {

using fastattn::cuda::acc_t;
using fastattn::cuda::from_acc;
using fastattn::cuda::to_acc;

template <typename acc>
__host__ __device__ __forceinline__ acc sigmoid(acc x) {
  return acc(1) / (acc(1) + exp(-x));
}

template <typename acc>
__host__ __device__ __forceinline__ acc tanh_(acc x) {
  return tanh(x);
}

// One forward cell: pre-activations in, activations out (in place), c_{t-1} in; returns c_t and
// writes h = o * tanh(c_t).
template <typename acc>
__host__ __device__ __forceinline__ acc cell_forward(acc& gi, acc& gf, acc& gg, acc& go, acc cp,
                                                     acc& h) {
  gi = sigmoid(gi);
  gf = sigmoid(gf);
  gg = tanh_(gg);
  go = sigmoid(go);
  const acc c = gf * cp + gi * gg;
  h = go * tanh_(c);
  return c;
}

// The cell's derivative: activations, c_t, c_{t-1}, dL/dh_t; dc holds dL/dc_t from later steps
// and receives dL/dc_{t-1}; writes the pre-activation gradients and r = o * tanh(c_t).
template <typename acc>
__host__ __device__ __forceinline__ void cell_backward(acc i, acc f, acc g, acc o, acc c, acc cp,
                                                       acc dh, acc& dc, acc& d_i, acc& d_f,
                                                       acc& d_g, acc& d_o, acc& r) {
  const acc tc = tanh_(c);
  const acc dct = dc + dh * o * (acc(1) - tc * tc);
  d_o = dh * tc * o * (acc(1) - o);
  d_i = dct * g * i * (acc(1) - i);
  d_f = dct * cp * f * (acc(1) - f);
  d_g = dct * i * (acc(1) - g * g);
  dc = dct * f;
  r = o * tc;
}

// Length of batch row b. The Python API checks 0 <= len <= T on the host; a direct op call
// with a value outside is clamped into [0, T] (so no kernel indexes past the workspace) and
// trips a device check in debug builds (the CPU op raises instead).
__device__ __forceinline__ int64_t row_length(const int64_t* lengths, int64_t b, int64_t T) {
  if (lengths == nullptr) return T;
  const int64_t len = lengths[b];
  FASTATTN_DEVICE_CHECK(len >= 0 && len <= T);
  return len < 0 ? 0 : (len > T ? T : len);
}

// Dropout multiplier of logical element e (philox.h): 1/(1-p) kept, 0 dropped, 1 without dropout.
template <typename acc>
__device__ __forceinline__ acc dropout_mult(const int64_t* seed, float threshold, acc scale,
                                            uint64_t e) {
  if (seed == nullptr) return acc(1);
  return dropout_keep(static_cast<uint64_t>(seed[0]), static_cast<uint64_t>(seed[1]), e, threshold)
             ? scale
             : acc(0);
}

// ---------------------------------------------------------------------------------------------
// Input gather / gradient scatter

// xp[(t * B + b) * I + i] = acc(input[t, b, i]) * dropout multiplier of element (t*B + b)*I + i.
template <typename scalar_t>
__global__ void gather_input_kernel(const scalar_t* __restrict__ input, int64_t T, int64_t B,
                                    int64_t I, int64_t stride_t, int64_t stride_b,
                                    acc_t<scalar_t>* __restrict__ xp, const int64_t* seed,
                                    float threshold, acc_t<scalar_t> scale) {
  const int64_t n = T * B * I;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < n;
       e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = e % I, tb = e / I, b = tb % B, t = tb / B;
    xp[e] = to_acc(input[t * stride_t + b * stride_b + i]) *
            dropout_mult(seed, threshold, scale, static_cast<uint64_t>(e));
  }
}

// grad_input[t, b, i] = dx[(t * B + b) * I + i] * the forward's multiplier; 0 past a sequence.
template <typename scalar_t>
__global__ void scatter_grad_input_kernel(const acc_t<scalar_t>* __restrict__ dx, int64_t T,
                                          int64_t B, int64_t I, const int64_t* lengths,
                                          scalar_t* __restrict__ grad_input, const int64_t* seed,
                                          float threshold, acc_t<scalar_t> scale) {
  using acc = acc_t<scalar_t>;
  const int64_t n = T * B * I;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < n;
       e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t tb = e / I, b = tb % B, t = tb / B;
    const bool active = t < row_length(lengths, b, T);
    grad_input[e] = from_acc<scalar_t>(
        active ? dx[e] * dropout_mult(seed, threshold, scale, static_cast<uint64_t>(e)) : acc(0));
  }
}

// ---------------------------------------------------------------------------------------------
// The cells. One engine runs every cell; the cell is a template parameter of the recurrence
// kernels (as cpu::RecurrentCell is of the CPU engine, recurrent_cpu_kernel.cpp):
//   lstm              4 gates i, f, g, o; extra = c_t; one product h W_hh^T per step;
//   gru               reset after W_hn h (torch, cuDNN): 3 gates r, z, n; the input projection
//                     holds b_hr, b_hz but not b_hn, which sits inside r * (W_hn h + b_hn);
//                     extra = W_hn h + b_hn (its derivative needs it); one product per step;
//   gru_reset_before  the textbook form (Cho et al. 2014): n = tanh(W_in x + b_in + W_hn (r * h)
//                     + b_hn) needs r of every unit before its product, so a step is two
//                     phases, each a product and a pointwise part (two grid.sync() on the
//                     persistent path, two GEMMs per step on the per-step path); extra = r * h;
//   rnn_tanh/relu     1 gate; no extra.
// Backward: the gradient buffer `dgates` (D, T*B, G H) holds the gradients that multiply W_hh
// (the recurrent side: dh_{t-1} = dgates W_hh, grad_w_hh = dgates^T h): for the reset-after
// GRU that is d(W_hn h + b_hn) = r * d_n in the n columns, and d_n itself (the input side) goes
// to `aux` (D, T*B, H). What reaches h_{t-1} outside W_hh (the GRU's z * dh, + r * d(r h) for
// the reset-before form) is carried per unit in the buffer the LSTM uses for dc.
enum class Cell : int { lstm = 0, gru = 1, gru_reset_before = 2, rnn_tanh = 3, rnn_relu = 4 };

template <Cell C>
struct CellInfo {
  static constexpr bool kGru = C == Cell::gru || C == Cell::gru_reset_before;
  static constexpr bool kRnn = C == Cell::rnn_tanh || C == Cell::rnn_relu;
  static constexpr int G = C == Cell::lstm ? 4 : (kGru ? 3 : 1);  // gate blocks
  static constexpr int E = C == Cell::lstm || kGru ? 1 : 0;       // extra saved columns
  static constexpr bool kTwoPhase = C == Cell::gru_reset_before;
  static constexpr int G1 = kTwoPhase ? 2 : G;  // gates of the first (or only) product
  static constexpr bool kCarryH = kGru;         // dh_{t-1} gets a term outside W_hh
};

// Forward of hidden unit u of an active row. g: the row's gates (gate q of unit u at
// g[q * H + u]; in: the input projection, out: the activations); rec: the unit's recurrent
// products of this phase's gates; x: the unit's extra value (out); c: the LSTM's c_{t-1} in, c_t
// out; hprev: h_{t-1} of the unit; bhn: the reset-after GRU's b_hn of the unit (0 without bias).
// Returns h_t; phase 0 of the reset-before GRU returns r * h_{t-1} (its second product's input)
// and phase 1 reads rec[0] = (r * h) W_hn^T of the unit.
template <Cell C, typename acc>
__device__ __forceinline__ acc unit_forward(acc* g, int64_t H, int64_t u, const acc* rec, acc* x,
                                            acc& c, acc hprev, acc bhn, int phase) {
  if constexpr (C == Cell::lstm) {
    acc gi = g[u] + rec[0], gf = g[H + u] + rec[1];
    acc gg = g[2 * H + u] + rec[2], go = g[3 * H + u] + rec[3];
    acc h;
    c = cell_forward(gi, gf, gg, go, c, h);
    g[u] = gi;
    g[H + u] = gf;
    g[2 * H + u] = gg;
    g[3 * H + u] = go;
    *x = c;
    return h;
  } else if constexpr (C == Cell::gru) {
    const acc r = sigmoid(g[u] + rec[0]), z = sigmoid(g[H + u] + rec[1]);
    const acc a = rec[2] + bhn;
    const acc n = tanh_(g[2 * H + u] + r * a);
    g[u] = r;
    g[H + u] = z;
    g[2 * H + u] = n;
    *x = a;
    return (acc(1) - z) * n + z * hprev;
  } else if constexpr (C == Cell::gru_reset_before) {
    if (phase == 0) {
      const acc r = sigmoid(g[u] + rec[0]), z = sigmoid(g[H + u] + rec[1]);
      g[u] = r;
      g[H + u] = z;
      *x = r * hprev;
      return r * hprev;
    }
    const acc z = g[H + u], n = tanh_(g[2 * H + u] + rec[0]);
    g[2 * H + u] = n;
    return (acc(1) - z) * n + z * hprev;
  } else {
    const acc v = g[u] + rec[0];
    const acc y = C == Cell::rnn_relu ? (v < acc(0) ? acc(0) : v) : tanh_(v);  // NaN stays NaN
    g[u] = y;
    return y;
  }
}

// Derivative of unit u of an active row. g: the row's activations; x: the row's extra values
// (c_t for the LSTM); cp: the LSTM's c_{t-1}; hprev: h_{t-1} of the unit; dh: dL/dh_t (for the
// GRU including what it carries past W_hh); carry: the LSTM's dc (in dL/dc_t, out dL/dc_{t-1}),
// the GRU's direct dL/dh_{t-1} part (out; phase 1 of the reset-before GRU adds to it); dg: the
// unit's recurrent-side gradients by gate, dg[q] (out, this phase's gates); aux: the reset-after
// GRU's d_n (out); dq: phase 1 of the reset-before GRU, dL/d(r * h) = d_n W_hn of the unit; r_out:
// the LSTM's o * tanh(c_t) (the projection's input).
template <Cell C, typename acc>
__device__ __forceinline__ void unit_backward(const acc* g, const acc* x, int64_t H, int64_t u,
                                              acc cp, acc hprev, acc dh, acc& carry, acc* dg,
                                              acc* aux, acc dq, acc& r_out, int phase) {
  if constexpr (C == Cell::lstm) {
    acc di, df, dgg, dgo;
    cell_backward(g[u], g[H + u], g[2 * H + u], g[3 * H + u], x[u], cp, dh, carry, di, df, dgg, dgo,
                  r_out);
    dg[0] = di;
    dg[1] = df;
    dg[2] = dgg;
    dg[3] = dgo;
  } else if constexpr (C == Cell::gru) {
    const acc r = g[u], z = g[H + u], n = g[2 * H + u];
    const acc dn = dh * (acc(1) - z) * (acc(1) - n * n);
    dg[0] = dn * x[u] * r * (acc(1) - r);
    dg[1] = dh * (hprev - n) * z * (acc(1) - z);
    dg[2] = dn * r;
    *aux = dn;
    carry = dh * z;
  } else if constexpr (C == Cell::gru_reset_before) {
    if (phase == 0) {
      const acc z = g[H + u], n = g[2 * H + u];
      dg[1] = dh * (hprev - n) * z * (acc(1) - z);
      dg[2] = dh * (acc(1) - z) * (acc(1) - n * n);
      carry = dh * z;
    } else {
      const acc r = g[u];
      dg[0] = dq * hprev * r * (acc(1) - r);
      carry += dq * r;
    }
  } else {
    const acc y = g[u];
    dg[0] = C == Cell::rnn_relu ? (y <= acc(0) ? acc(0) : dh) : dh * (acc(1) - y * y);
  }
}

// ---------------------------------------------------------------------------------------------
// Forward recurrence

struct ForwardStep {
  int64_t T, B, H, P, D;
  int64_t ws_dir;          // elements per direction of the workspace
  const int64_t* lengths;  // (B,) or nullptr
  bool proj;
};

// Per-step path, the cell of step s (phase `phase`) for every (d, b, u): hw (D, B, Gp H) = the
// phase's recurrent product (cuBLAS), Gp its gate count; c_state (D, B, H) the LSTM's cell
// (else unused) and, without projection, h_state (D, B, P = H) carried in acc. With a projection
// (LSTM) r = o * tanh(c_t) goes to r_buf (D, B, H) for the step's h = r W_hr^T GEMM; phase 0 of
// the reset-before GRU writes r * h_{t-1} to r_buf (its second GEMM's input). b_hn (D, H): the
// reset-after GRU's b_hn or nullptr.
template <typename scalar_t, Cell C>
__global__ void forward_step_cell_kernel(ForwardStep p, int64_t s, int phase, acc_t<scalar_t>* ws,
                                         const acc_t<scalar_t>* __restrict__ hw,
                                         acc_t<scalar_t>* c_state, acc_t<scalar_t>* h_state,
                                         acc_t<scalar_t>* r_buf, scalar_t* output,
                                         const acc_t<scalar_t>* __restrict__ b_hn) {
  using acc = acc_t<scalar_t>;
  using CI = CellInfo<C>;
  constexpr int G = CI::G;
  const int Gp = CI::kTwoPhase && phase == 1 ? 1 : CI::G1;
  const int64_t n = p.D * p.B * p.H;
  const int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (idx >= n) return;
  const int64_t u = idx % p.H, db = idx / p.H, b = db % p.B, d = db / p.B;
  const int64_t t = d == 0 ? s : p.T - 1 - s;
  const int64_t Bt = p.T * p.B;
  const bool active = t < row_length(p.lengths, b, p.T);
  acc* w = ws + d * p.ws_dir;
  acc* gates = w + (t * p.B + b) * G * p.H;
  acc* extra = w + Bt * G * p.H + (t * p.B + b) * p.H;  // unused (E = 0) for the RNN
  acc* hidden = w + Bt * (G + CI::E) * p.H + (t * p.B + b) * p.P;
  scalar_t* out = output + (t * p.B + b) * p.D * p.P + d * p.P;
  FASTATTN_DEVICE_CHECK(t >= 0 && t < p.T);
  if (!active) {
    if (phase == 0) {
      for (int k = 0; k < G; ++k) gates[k * p.H + u] = acc(0);
      if (CI::E > 0) extra[u] = acc(0);
      if (CI::kTwoPhase) r_buf[idx] = acc(0);  // read by the second GEMM
    }
    if (!p.proj && (!CI::kTwoPhase || phase == 1)) {
      hidden[u] = acc(0);
      out[u] = from_acc<scalar_t>(acc(0));
    }
    return;
  }
  const acc* hwr = hw + db * Gp * p.H;
  acc rec[G];
#pragma unroll
  for (int k = 0; k < G; ++k) rec[k] = k < Gp ? hwr[k * p.H + u] : acc(0);
  acc c = C == Cell::lstm ? c_state[idx] : acc(0);
  acc ex = acc(0);
  const acc hprev = C == Cell::lstm ? acc(0) : h_state[idx];
  const acc bhn = C == Cell::gru && b_hn != nullptr ? b_hn[d * p.H + u] : acc(0);
  const acc h = unit_forward<C>(gates, p.H, u, rec, &ex, c, hprev, bhn, phase);
  if (CI::kTwoPhase && phase == 0) {
    extra[u] = ex;
    r_buf[idx] = h;
    return;
  }
  if (CI::E > 0 && !CI::kTwoPhase) extra[u] = ex;
  if (C == Cell::lstm) c_state[idx] = c;
  if (p.proj) {
    r_buf[idx] = h;
  } else {
    h_state[idx] = h;
    hidden[u] = h;
    out[u] = from_acc<scalar_t>(h);
  }
}

// Per-step path with a projection (LSTM): hp (D, B, P) = r W_hr^T; stores h_t for the active
// rows.
template <typename scalar_t>
__global__ void forward_step_proj_kernel(ForwardStep p, int64_t s, acc_t<scalar_t>* ws,
                                         const acc_t<scalar_t>* __restrict__ hp,
                                         acc_t<scalar_t>* h_state, scalar_t* output) {
  using acc = acc_t<scalar_t>;
  const int64_t n = p.D * p.B * p.P;
  const int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (idx >= n) return;
  const int64_t j = idx % p.P, db = idx / p.P, b = db % p.B, d = db / p.B;
  const int64_t t = d == 0 ? s : p.T - 1 - s;
  const bool active = t < row_length(p.lengths, b, p.T);
  acc* hidden = ws + d * p.ws_dir + p.T * p.B * 5 * p.H + (t * p.B + b) * p.P;
  scalar_t* out = output + (t * p.B + b) * p.D * p.P + d * p.P;
  const acc h = active ? hp[idx] : acc(0);
  if (active) h_state[idx] = h;
  hidden[j] = h;
  out[j] = from_acc<scalar_t>(h);
}

// Persistent path (no projection): one cooperative launch runs every step of every direction.
// Block k of direction d owns hidden units [k * U, k * U + U): it keeps their G U rows of W_hh
// (transposed, (H, G U)) in shared memory for the whole sequence, and per step computes
// h_{t-1} W_hh^T for its G U gate columns and all B rows (persistent_block_product below),
// applies the cell, publishes h_t to the ping-pong state h_state (2, D, B, H) in global memory
// and waits at grid.sync() before the next step. The LSTM's cell state of its units stays in
// c_state (only this block touches it). The reset-before GRU runs two such phases per step:
// r, z from h_{t-1} W_{hr,hz}^T, r * h_{t-1} published to rh_state (D, B, H), grid.sync(), then
// n from (r * h) W_hn^T and h_t, grid.sync().
constexpr int kPersistThreads = 256;
constexpr int kPersistMaxOut = 16;

// How a persistent block splits its product (B, K) x (K, N) over its threads: `splits` groups
// of kPersistThreads / splits threads each take a slice of K (split-K), so the serial chain per
// thread is K / splits long, not K (one thread per column running all of K was the first GPU
// run's bottleneck: docs/design/lstm_cuda.md). The input streams through shared memory in
// chunks of `chunk` columns (a multiple of `splits`; the whole of K when it fits, so a step
// costs two barriers, not two per 32 columns).
struct PersistentSplit {
  int splits = 0;
  int chunk = 0;
};

template <typename acc>
__host__ __device__ inline size_t persistent_block_smem_bytes(int64_t K, int64_t B, int N,
                                                              PersistentSplit split) {
  return (static_cast<size_t>(K) * N + static_cast<size_t>(B) * (split.chunk + 1) +
          static_cast<size_t>(split.splits) * B * N) *
         sizeof(acc);
}

// The host's choice: the most K splits (a power of two) whose thread groups still cover all
// B x N outputs (kPersistMaxOut rows per thread), at most K of them; the widest chunk the shared
// memory holds beside the (K, N) weight slice and the (splits, B, N) partial sums. False when
// the block cannot hold its slice at all. N need not divide a group (GRU: N = 3U): the group's
// last N-incomplete threads idle (persistent_block_product).
template <typename acc>
inline bool choose_persistent_split(int64_t K, int64_t B, int N, size_t smem_limit,
                                    PersistentSplit& out) {
  if (N < 1 || N > kPersistThreads || B < 1 || K < 1) return false;
  int most = 1;
  while (most * 2 * N <= kPersistThreads) most *= 2;
  int splits = 0;
  for (int s = most; s >= 1; s /= 2) {
    if (static_cast<int64_t>(kPersistMaxOut) * (kPersistThreads / s / N) >= B) {
      splits = s;
      break;
    }
  }
  if (splits == 0) return false;
  while (splits > 1 && splits > K) splits /= 2;
  const size_t fixed =
      (static_cast<size_t>(K) * N + static_cast<size_t>(splits) * B * N) * sizeof(acc);
  if (fixed >= smem_limit) return false;
  const int64_t widest = static_cast<int64_t>((smem_limit - fixed) / (B * sizeof(acc))) - 1;
  int64_t chunk = (K + splits - 1) / splits * splits;
  if (chunk > widest) chunk = widest / splits * splits;
  if (chunk < splits) return false;
  out.splits = splits;
  out.chunk = static_cast<int>(chunk);
  return true;
}

// The device-side form of the host's guarantee for a product of N columns under `split`.
__device__ __forceinline__ bool persistent_split_covers(PersistentSplit split, int N, int64_t B) {
  return split.splits >= 1 && kPersistThreads % split.splits == 0 &&
         kPersistThreads / split.splits >= N &&
         kPersistMaxOut * (kPersistThreads / split.splits / N) >= B &&
         split.chunk % split.splits == 0;
}

// out (B, N) = in (B, K) x w_s (K, N) for one block, every thread of the block calling it. `in`
// lives in global memory, written by other blocks before the last grid.sync(): read through L2
// (__ldcg), never a stale L1 line; row stride `in_stride`. Thread mapping: group ks =
// tid / (kPersistThreads / splits) sums k over its slice [ks * c, ks * c + c) of each chunk (c =
// chunk / splits); in the group, thread l < (group / N) * N owns column n = l % N and rows b =
// l / N + j * (group / N), j < kPersistMaxOut (one shared load of W serves every row); the
// group's remaining threads (when N does not divide it) idle. The groups' partial sums meet in
// red_s (splits, B, N), added in group order (deterministic); the result is red_s[b * N + n]
// when the call returns (after a barrier).
template <typename acc>
__device__ __forceinline__ void persistent_block_product(const acc* in, int64_t in_stride,
                                                         int64_t B, int64_t K, int N,
                                                         const acc* w_s, acc* in_s, acc* red_s,
                                                         PersistentSplit split, int tid) {
  const int group = kPersistThreads / split.splits;
  const int ks = tid / group, l = tid % group;
  const int b_step = group / N;
  const bool busy = l < b_step * N;
  const int n = l % N, b_first = busy ? l / N : static_cast<int>(B);
  const int chunk = split.chunk, slice = chunk / split.splits;
  acc sum[kPersistMaxOut];
#pragma unroll
  for (int j = 0; j < kPersistMaxOut; ++j) sum[j] = acc(0);
  for (int64_t k0 = 0; k0 < K; k0 += chunk) {
    const int kc = static_cast<int>(K - k0 < chunk ? K - k0 : chunk);
    __syncthreads();  // the previous chunk (or the weight load, or the last use of red_s) is done
    for (int64_t e = tid; e < B * chunk; e += kPersistThreads) {
      const int64_t b = e / chunk;
      const int kk = static_cast<int>(e % chunk);
      in_s[b * (chunk + 1) + kk] =
          kk < kc ? FASTATTN_LSTM_LDCG(in + b * in_stride + k0 + kk) : acc(0);
    }
    __syncthreads();
    const int kb = ks * slice;
    const int ke = kb + slice < kc ? kb + slice : kc;
    if (busy) {
      for (int kk = kb; kk < ke; ++kk) {
        const acc w = w_s[(k0 + kk) * N + n];
#pragma unroll
        for (int j = 0; j < kPersistMaxOut; ++j) {
          const int b = b_first + j * b_step;
          if (b < B) sum[j] += w * in_s[b * (chunk + 1) + kk];
        }
      }
    }
  }
  if (busy) {
#pragma unroll
    for (int j = 0; j < kPersistMaxOut; ++j) {
      const int b = b_first + j * b_step;
      if (b < B) red_s[(ks * B + b) * N + n] = sum[j];
    }
  }
  __syncthreads();
  const int64_t outputs = B * N;
  for (int64_t e = tid; e < outputs; e += kPersistThreads) {
    acc v = red_s[e];
    for (int g = 1; g < split.splits; ++g) v += red_s[g * outputs + e];
    red_s[e] = v;  // only this thread reads or writes index e of any slot in this phase
  }
  __syncthreads();
}

struct PersistentParams {
  ForwardStep p;
  int U;  // units per block (a power of two, G U <= 256)
  int blocks_per_dir;
  PersistentSplit split;
};

// b_hn (D, H): the reset-after GRU's b_hn or nullptr; rh_state (D, B, H): the reset-before
// GRU's r * h_{t-1} (else unused); c_state: the LSTM's (else unused).
template <typename scalar_t, Cell C>
__global__ void __launch_bounds__(kPersistThreads)
    forward_persistent_kernel(PersistentParams pp, acc_t<scalar_t>* ws,
                              const acc_t<scalar_t>* __restrict__ w_hh, acc_t<scalar_t>* h_state,
                              acc_t<scalar_t>* c_state, scalar_t* output,
                              const acc_t<scalar_t>* __restrict__ b_hn, acc_t<scalar_t>* rh_state) {
  using acc = acc_t<scalar_t>;
  using CI = CellInfo<C>;
  constexpr int G = CI::G, G1 = CI::G1;
  namespace cg = cooperative_groups;
  cg::grid_group grid = cg::this_grid();
  const ForwardStep& p = pp.p;
  const int U = pp.U, R = G * U, R1 = G1 * U;
  const int64_t H = p.H, B = p.B, Bt = p.T * p.B;
  const int d = blockIdx.x / pp.blocks_per_dir;
  const int64_t u0 = static_cast<int64_t>(blockIdx.x % pp.blocks_per_dir) * U;
  const int ub = static_cast<int>(H - u0 < U ? H - u0 : U);
  FASTATTN_LSTM_DYNAMIC_SMEM(smem_raw);
  // (H, G1 U): w_s[k * R1 + g * U + uu] = W[g H + u0 + uu, k] for the first product's gates;
  // then (H, U) of the reset-before GRU's n rows: w_s[H R1 + k * U + uu] = W[2H + u0 + uu, k]
  acc* w_s = reinterpret_cast<acc*>(smem_raw);
  acc* h_s = w_s + H * R;                     // (B, chunk + 1): a chunk of the product's input
  acc* g_s = h_s + B * (pp.split.chunk + 1);  // (splits, B, G1 U); (B, G1 U) = the product after
  const int tid = threadIdx.x;

  for (int64_t e = tid; e < H * R1; e += kPersistThreads) {
    const int64_t k = e / R1;
    const int r = static_cast<int>(e % R1), g = r / U, uu = r % U;
    w_s[e] = uu < ub ? w_hh[(static_cast<int64_t>(d) * G * H + g * H + u0 + uu) * H + k] : acc(0);
  }
  if (CI::kTwoPhase) {
    for (int64_t e = tid; e < H * U; e += kPersistThreads) {
      const int64_t k = e / U;
      const int uu = static_cast<int>(e % U);
      w_s[H * R1 + e] =
          uu < ub ? w_hh[(static_cast<int64_t>(d) * G * H + 2 * H + u0 + uu) * H + k] : acc(0);
    }
  }
  // the host's choice guarantees: G U fits a thread group, kMaxOut rows cover every row
  FASTATTN_DEVICE_CHECK(persistent_split_covers(pp.split, R, B));
  FASTATTN_DEVICE_CHECK(d < p.D && ub >= 1);
  const int64_t state = static_cast<int64_t>(p.D) * B * H;  // one ping-pong half

  for (int64_t s = 0; s < p.T; ++s) {
    const acc* h_in = h_state + (s & 1) * state + d * B * H;
    acc* h_out = h_state + ((s + 1) & 1) * state + d * B * H;
    persistent_block_product(h_in, H, B, H, R1, w_s, h_s, g_s, pp.split, tid);
    const int64_t t = d == 0 ? s : p.T - 1 - s;
    acc* w = ws + d * p.ws_dir;
    for (int e = tid; e < B * U; e += kPersistThreads) {
      const int64_t b = e / U;
      const int uu = e % U;
      if (uu >= ub) continue;
      const int64_t u = u0 + uu;
      acc* gates = w + (t * B + b) * G * H;
      acc* extra = w + Bt * G * H + (t * B + b) * H;
      acc* hidden = w + Bt * (G + CI::E) * H + (t * B + b) * H;
      scalar_t* out = output + (t * B + b) * p.D * H + d * H;
      const acc hprev = FASTATTN_LSTM_LDCG(h_in + b * H + u);
      if (t < row_length(p.lengths, b, p.T)) {
        const acc* gr = g_s + b * R1;
        acc rec[G];
#pragma unroll
        for (int k = 0; k < G; ++k) rec[k] = k < G1 ? gr[k * U + uu] : acc(0);
        acc* c_st = c_state + (d * B + b) * H + u;
        acc c = C == Cell::lstm ? *c_st : acc(0);
        acc ex = acc(0);
        const acc bhn = C == Cell::gru && b_hn != nullptr ? b_hn[d * H + u] : acc(0);
        const acc h = unit_forward<C>(gates, H, u, rec, &ex, c, hprev, bhn, 0);
        if (CI::E > 0) extra[u] = ex;
        if (CI::kTwoPhase) {
          rh_state[(d * B + b) * H + u] = h;
          continue;
        }
        if (C == Cell::lstm) *c_st = c;
        hidden[u] = h;
        out[u] = from_acc<scalar_t>(h);
        h_out[b * H + u] = h;
      } else {
        for (int g = 0; g < G; ++g) gates[g * H + u] = acc(0);
        if (CI::E > 0) extra[u] = acc(0);
        if (CI::kTwoPhase) rh_state[(d * B + b) * H + u] = acc(0);
        hidden[u] = acc(0);
        out[u] = from_acc<scalar_t>(acc(0));
        h_out[b * H + u] = hprev;  // the state passes through unchanged
      }
    }
    grid.sync();  // h_t (r * h_{t-1}: the reset-before GRU) of every block is visible
    if constexpr (CI::kTwoPhase) {
      persistent_block_product(rh_state + d * B * H, H, B, H, U, w_s + H * R1, h_s, g_s, pp.split,
                               tid);
      for (int e = tid; e < B * U; e += kPersistThreads) {
        const int64_t b = e / U;
        const int uu = e % U;
        if (uu >= ub || t >= row_length(p.lengths, b, p.T)) continue;
        const int64_t u = u0 + uu;
        acc* gates = w + (t * B + b) * G * H;
        acc* hidden = w + Bt * (G + CI::E) * H + (t * B + b) * H;
        scalar_t* out = output + (t * B + b) * p.D * H + d * H;
        const acc hprev = FASTATTN_LSTM_LDCG(h_in + b * H + u);
        acc rec[G] = {g_s[b * U + uu]};
        acc c = acc(0), ex = acc(0);
        const acc h = unit_forward<C>(gates, H, u, rec, &ex, c, hprev, acc(0), 1);
        hidden[u] = h;
        out[u] = from_acc<scalar_t>(h);
        h_out[b * H + u] = h;
      }
      grid.sync();  // h_t of every block is visible
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Backward recurrence (per step, reverse time: step s = T-1 .. 0)

struct BackwardStep {
  int64_t T, B, H, P, D;
  int64_t ws_dir;
  const int64_t* lengths;
  bool proj;
};

// Projection only, before the step's dr = dh W_hr GEMM: dh_all row (t, b) of direction d and
// dh_step (D, B, P) = dh_state + grad_output[t, b, d] for active rows, 0 otherwise.
template <typename scalar_t>
__global__ void backward_step_dh_kernel(BackwardStep p, int64_t s,
                                        const acc_t<scalar_t>* __restrict__ dh_state,
                                        const scalar_t* __restrict__ grad_output,
                                        acc_t<scalar_t>* dh_all, acc_t<scalar_t>* dh_step) {
  using acc = acc_t<scalar_t>;
  const int64_t n = p.D * p.B * p.P;
  const int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (idx >= n) return;
  const int64_t j = idx % p.P, db = idx / p.P, b = db % p.B, d = db / p.B;
  const int64_t t = d == 0 ? s : p.T - 1 - s;
  const bool active = t < row_length(p.lengths, b, p.T);
  acc v = acc(0);
  if (active) {
    v = dh_state[idx];
    if (grad_output != nullptr) v += to_acc(grad_output[(t * p.B + b) * p.D * p.P + d * p.P + j]);
  }
  dh_all[d * p.T * p.B * p.P + (t * p.B + b) * p.P + j] = v;
  dh_step[idx] = v;
}

// The cell's derivative at step s (phase `phase`) for every (d, b, u). dh comes from dr
// (D, B, H) with a projection, else dh_state + grad_output. Phase 0 writes the row's dgates
// (D, T*B, G H) (the recurrent side, see Cell) and the step's copy dg_step (D, B, G H) (input of
// dh_{t-1} = dgates W_hh), hprev (D, T*B, P), r_all (D, T*B, H) (projection), aux (D, T*B, H)
// (reset-after GRU: d_n), and updates carry (D, B, H) (LSTM: dc; GRU: the direct dh_{t-1} part)
// for the active rows; phase 1 (reset-before GRU) reads dq (D, B, H) = d_n W_hn and writes d_r.
template <typename scalar_t, Cell C>
__global__ void backward_step_cell_kernel(
    BackwardStep p, int64_t s, int phase, const acc_t<scalar_t>* __restrict__ ws,
    const acc_t<scalar_t>* __restrict__ h0, const acc_t<scalar_t>* __restrict__ c0,
    const acc_t<scalar_t>* __restrict__ dr, const acc_t<scalar_t>* __restrict__ dh_state,
    const scalar_t* __restrict__ grad_output, acc_t<scalar_t>* carry_state, acc_t<scalar_t>* dgates,
    acc_t<scalar_t>* dg_step, acc_t<scalar_t>* hprev, acc_t<scalar_t>* r_all, acc_t<scalar_t>* aux,
    const acc_t<scalar_t>* __restrict__ dq) {
  using acc = acc_t<scalar_t>;
  using CI = CellInfo<C>;
  constexpr int G = CI::G;
  const int64_t n = p.D * p.B * p.H;
  const int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (idx >= n) return;
  const int64_t u = idx % p.H, db = idx / p.H, b = db % p.B, d = db / p.B;
  const int64_t t = d == 0 ? s : p.T - 1 - s;
  const int64_t len = row_length(p.lengths, b, p.T);
  const int64_t Bt = p.T * p.B, row = t * p.B + b;
  acc* dg = dgates + d * Bt * G * p.H + row * G * p.H;
  acc* dgs = dg_step + db * G * p.H;
  acc* hp = hprev + d * Bt * p.P + row * p.P;
  if (t >= len) {
    if (phase == 0) {
      for (int k = 0; k < G; ++k) dg[k * p.H + u] = dgs[k * p.H + u] = acc(0);
      if (u < p.P) hp[u] = acc(0);
      if (p.proj) r_all[d * Bt * p.H + row * p.H + u] = acc(0);
      if (C == Cell::gru) aux[d * Bt * p.H + row * p.H + u] = acc(0);
    }
    return;
  }
  const acc* w = ws + d * p.ws_dir;
  const acc* gates = w + row * G * p.H;
  const acc* extra = w + Bt * G * p.H + row * p.H;
  const acc* hidden = w + Bt * (G + CI::E) * p.H;
  const bool first = d == 0 ? t == 0 : t == len - 1;
  const int64_t prev = (d == 0 ? t - 1 : t + 1) * p.B + b;
  FASTATTN_DEVICE_CHECK(first || (prev >= 0 && prev < Bt));
  const acc cp = C == Cell::lstm ? (first ? c0[idx] : w[Bt * G * p.H + prev * p.H + u]) : acc(0);
  const acc h_prev = u < p.P ? (first ? h0[db * p.P + u] : hidden[prev * p.P + u]) : acc(0);
  if (phase == 0 && u < p.P) hp[u] = h_prev;
  acc dh = acc(0);
  if (phase == 0) {
    if (p.proj) {
      dh = dr[idx];
    } else {
      dh = dh_state[idx];
      if (grad_output != nullptr) dh += to_acc(grad_output[row * p.D * p.P + d * p.P + u]);
    }
  }
  acc carry = C == Cell::lstm || phase == 1 ? carry_state[idx] : acc(0);
  acc r = acc(0), a = acc(0);
  acc dgv[G];
#pragma unroll
  for (int k = 0; k < G; ++k) dgv[k] = acc(0);
  unit_backward<C>(gates, extra, p.H, u, cp, h_prev, dh, carry, dgv, &a,
                   phase == 1 ? dq[idx] : acc(0), r, phase);
  carry_state[idx] = carry;
  const int k0 = CI::kTwoPhase ? (phase == 0 ? 1 : 0) : 0;
  const int k1 = CI::kTwoPhase ? (phase == 0 ? G : 1) : G;
  for (int k = k0; k < k1; ++k) dg[k * p.H + u] = dgs[k * p.H + u] = dgv[k];
  if (p.proj) r_all[d * Bt * p.H + row * p.H + u] = r;
  if (C == Cell::gru) aux[d * Bt * p.H + row * p.H + u] = a;
}

// dh_state (D, B, P) = dhp (= dgates W_hh of the step) (+ the carried direct part, GRU) for the
// rows active at step s.
template <typename acc, bool kCarryH>
__global__ void backward_step_update_kernel(BackwardStep p, int64_t s, const acc* __restrict__ dhp,
                                            const acc* __restrict__ carry, acc* dh_state) {
  const int64_t n = p.D * p.B * p.P;
  const int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (idx >= n) return;
  const int64_t b = (idx / p.P) % p.B, d = idx / (p.P * p.B);
  const int64_t t = d == 0 ? s : p.T - 1 - s;
  if (t < row_length(p.lengths, b, p.T)) dh_state[idx] = dhp[idx] + (kCarryH ? carry[idx] : acc(0));
}

// Persistent backward (no projection): one cooperative launch for every step of both
// directions. Block k of direction d owns hidden units [kU, kU + U) and keeps the (G H, U)
// column slice of W_hh (rows: all G H gate rows, columns: its units of h) in shared memory. Per
// step i (reverse time, t_i):
//   A. (i > 0) dL/dh_{t_i} of its units = dgates of step i-1 (the first product's G1 H columns,
//      published by every block before the last grid.sync(), streamed through shared memory in
//      chunks) x its W slice (+ the carried direct part, GRU), for the rows active at step i-1;
//      other rows keep their carried dh;
//   B. the cell derivative of its units at t_i (dh + grad_output, the carried dc), writing the
//      dgates of its units' gate columns (dgates buffer = the weight GEMMs' input) and hprev;
//      grid.sync(). The reset-before GRU then has a phase B1: dq = d_n W_hn (its units' columns
//      of W_hn, the n columns of every block's dgates), d_r and the carry's r * dq; grid.sync().
// After the last step, phase A once more gives grad_h0. dh/dc carries stay in global slices that
// only the owning block touches. Phase A is persistent_block_product with K = G1 H, N = U.
struct PersistentBackwardParams {
  BackwardStep p;
  int U;
  int blocks_per_dir;
  PersistentSplit split;
};

template <typename scalar_t, Cell C>
__global__ void __launch_bounds__(kPersistThreads)
    backward_persistent_kernel(PersistentBackwardParams pp, const acc_t<scalar_t>* ws,
                               const acc_t<scalar_t>* __restrict__ w_hh,
                               const acc_t<scalar_t>* __restrict__ h0,
                               const acc_t<scalar_t>* __restrict__ c0,
                               const scalar_t* __restrict__ grad_output, acc_t<scalar_t>* dh_state,
                               acc_t<scalar_t>* dc_state, acc_t<scalar_t>* dgates,
                               acc_t<scalar_t>* hprev, acc_t<scalar_t>* aux) {
  using acc = acc_t<scalar_t>;
  using CI = CellInfo<C>;
  constexpr int G = CI::G;
  namespace cg = cooperative_groups;
  cg::grid_group grid = cg::this_grid();
  const BackwardStep& p = pp.p;
  const int U = pp.U;
  const int64_t H = p.H, B = p.B, GH = G * H, G1H = CI::G1 * H, Bt = p.T * p.B;
  const int d = blockIdx.x / pp.blocks_per_dir;
  const int64_t u0 = static_cast<int64_t>(blockIdx.x % pp.blocks_per_dir) * U;
  const int ub = static_cast<int>(H - u0 < U ? H - u0 : U);
  FASTATTN_LSTM_DYNAMIC_SMEM(smem_raw);
  acc* w_s = reinterpret_cast<acc*>(smem_raw);  // (G H, U): w_s[j * U + uu] = W[j, u0+uu]
  acc* g_s = w_s + GH * U;                      // (B, chunk + 1): a chunk of the dgates
  acc* red_s = g_s + B * (pp.split.chunk + 1);  // (splits, B, U); (B, U) = dh after
  const int tid = threadIdx.x;
  FASTATTN_DEVICE_CHECK(persistent_split_covers(pp.split, U, B));
  FASTATTN_DEVICE_CHECK(d < p.D && ub >= 1 && !p.proj);

  for (int64_t e = tid; e < GH * U; e += kPersistThreads) {
    const int64_t j = e / U;
    const int uu = static_cast<int>(e % U);
    w_s[e] = uu < ub ? w_hh[(static_cast<int64_t>(d) * GH + j) * H + u0 + uu] : acc(0);
  }
  const acc* w = ws + d * p.ws_dir;
  acc* dg_dir = dgates + d * Bt * GH;

  for (int64_t i = 0; i <= p.T; ++i) {
    // A. dh of the rows active at the previous step (i - 1) from its dgates.
    if (i > 0) {
      const int64_t s_prev = p.T - i;  // forward step index of step i - 1
      const int64_t t_prev = d == 0 ? s_prev : p.T - 1 - s_prev;
      const acc* dg_prev = dg_dir + t_prev * B * GH;
      persistent_block_product(dg_prev, GH, B, G1H, U, w_s, g_s, red_s, pp.split, tid);
      for (int64_t e = tid; e < B * U; e += kPersistThreads) {
        const int64_t b = e / U;
        const int uu = static_cast<int>(e % U);
        if (uu < ub && t_prev < row_length(p.lengths, b, p.T)) {
          const int64_t st = (d * B + b) * H + u0 + uu;
          dh_state[st] = red_s[e] + (CI::kCarryH ? dc_state[st] : acc(0));
        }
      }
    }
    if (i == p.T) break;
    __syncthreads();  // dh_state of this block's units is complete
    // B. the cell derivative at t_i for this block's units.
    const int64_t s = p.T - 1 - i;
    const int64_t t = d == 0 ? s : p.T - 1 - s;
    for (int e = tid; e < B * U; e += kPersistThreads) {
      const int64_t b = e / U;
      const int uu = e % U;
      if (uu >= ub) continue;
      const int64_t u = u0 + uu, row = t * B + b, st = (d * B + b) * H + u;
      acc* dg = dg_dir + row * GH;
      acc* hp = hprev + d * Bt * H + row * H;
      const int64_t len = row_length(p.lengths, b, p.T);
      if (t >= len) {
        for (int g = 0; g < G; ++g) dg[g * H + u] = acc(0);
        hp[u] = acc(0);
        if (C == Cell::gru) aux[d * Bt * H + row * H + u] = acc(0);
        continue;
      }
      const acc* gates = w + row * GH;
      const acc* extra = w + Bt * GH + row * H;
      const acc* hidden = w + Bt * (G + CI::E) * H;
      const bool first = d == 0 ? t == 0 : t == len - 1;
      const int64_t prev = (d == 0 ? t - 1 : t + 1) * B + b;
      FASTATTN_DEVICE_CHECK(first || (prev >= 0 && prev < Bt));
      const acc cp = C == Cell::lstm ? (first ? c0[st] : w[Bt * GH + prev * H + u]) : acc(0);
      const acc h_prev = first ? h0[st] : hidden[prev * H + u];
      hp[u] = h_prev;
      acc dh = dh_state[st];
      if (grad_output != nullptr) dh += to_acc(grad_output[row * p.D * H + d * H + u]);
      acc carry = C == Cell::lstm ? dc_state[st] : acc(0);
      acc dgv[G], a = acc(0), r = acc(0);
      unit_backward<C>(gates, extra, H, u, cp, h_prev, dh, carry, dgv, &a, acc(0), r, 0);
      if (C != Cell::rnn_tanh && C != Cell::rnn_relu) dc_state[st] = carry;
      for (int g = CI::kTwoPhase ? 1 : 0; g < G; ++g) dg[g * H + u] = dgv[g];
      if (C == Cell::gru) aux[d * Bt * H + row * H + u] = a;
    }
    grid.sync();  // every block's dgates of step i are visible
    if constexpr (CI::kTwoPhase) {
      // B1. dq = d_n W_hn for this block's units, then d_r and the carry's r * dq.
      persistent_block_product(dg_dir + t * B * GH + 2 * H, GH, B, H, U, w_s + 2 * H * U, g_s,
                               red_s, pp.split, tid);
      for (int e = tid; e < B * U; e += kPersistThreads) {
        const int64_t b = e / U;
        const int uu = e % U;
        const int64_t len = row_length(p.lengths, b, p.T);
        if (uu >= ub || t >= len) continue;
        const int64_t u = u0 + uu, row = t * B + b, st = (d * B + b) * H + u;
        const acc* gates = w + row * GH;
        const bool first = d == 0 ? t == 0 : t == len - 1;
        const int64_t prev = (d == 0 ? t - 1 : t + 1) * B + b;
        const acc h_prev = first ? h0[st] : w[Bt * (G + CI::E) * H + prev * H + u];
        acc carry = dc_state[st];
        acc dgv[G], a = acc(0), r = acc(0);
        unit_backward<C>(gates, gates, H, u, acc(0), h_prev, acc(0), carry, dgv, &a, red_s[e], r,
                         1);
        dc_state[st] = carry;
        dg_dir[row * GH + u] = dgv[0];
      }
      grid.sync();  // every block's d_r of step i is visible
    }
  }
}

// ---------------------------------------------------------------------------------------------
// lstm_cell

// Small batches (B <= kCellFusedMaxBatch): one kernel for the whole step. A warp per hidden unit
// u forms the dot products of its 4 gate rows of W_ih and W_hh with every batch row (one pass
// over the weights, lanes striding over the reduction dimension), reduces them across the warp
// and lane 0 applies the cell.
constexpr int kCellFusedMaxBatch = 8;
constexpr int kCellWarps = 4;

template <typename scalar_t>
__global__ void __launch_bounds__(kCellWarps * 32)
    cell_fused_kernel(int64_t B, int64_t I, int64_t H, const acc_t<scalar_t>* __restrict__ x,
                      const acc_t<scalar_t>* __restrict__ h, const scalar_t* __restrict__ c,
                      const acc_t<scalar_t>* __restrict__ w_ih,
                      const acc_t<scalar_t>* __restrict__ w_hh,
                      const acc_t<scalar_t>* __restrict__ bias, acc_t<scalar_t>* workspace,
                      scalar_t* hy, scalar_t* cy) {
  using acc = acc_t<scalar_t>;
  const int lane = threadIdx.x % 32;
  const int64_t u = blockIdx.x * int64_t(kCellWarps) + threadIdx.x / 32;
  if (u >= H) return;
  acc sum[4][kCellFusedMaxBatch];
#pragma unroll
  for (int g = 0; g < 4; ++g)
#pragma unroll
    for (int b = 0; b < kCellFusedMaxBatch; ++b) sum[g][b] = acc(0);
  for (int64_t k = lane; k < I; k += 32) {
#pragma unroll
    for (int g = 0; g < 4; ++g) {
      const acc wv = w_ih[(g * H + u) * I + k];
#pragma unroll
      for (int b = 0; b < kCellFusedMaxBatch; ++b)
        if (b < B) sum[g][b] += wv * x[b * I + k];
    }
  }
  for (int64_t k = lane; k < H; k += 32) {
#pragma unroll
    for (int g = 0; g < 4; ++g) {
      const acc wv = w_hh[(g * H + u) * H + k];
#pragma unroll
      for (int b = 0; b < kCellFusedMaxBatch; ++b)
        if (b < B) sum[g][b] += wv * h[b * H + k];
    }
  }
#pragma unroll
  for (int g = 0; g < 4; ++g)
#pragma unroll
    for (int b = 0; b < kCellFusedMaxBatch; ++b)
#pragma unroll
      for (int off = 16; off > 0; off >>= 1)
        sum[g][b] += __shfl_xor_sync(0xffffffffu, sum[g][b], off);
  if (lane != 0) return;
#pragma unroll
  for (int b = 0; b < kCellFusedMaxBatch; ++b) {
    if (b >= B) break;
    acc gi = sum[0][b], gf = sum[1][b], gg = sum[2][b], go = sum[3][b];
    if (bias != nullptr) {
      gi += bias[u];
      gf += bias[H + u];
      gg += bias[2 * H + u];
      go += bias[3 * H + u];
    }
    acc hn;
    const acc cn = cell_forward(gi, gf, gg, go, to_acc(c[b * H + u]), hn);
    acc* w = workspace + b * 5 * H;
    w[u] = gi;
    w[H + u] = gf;
    w[2 * H + u] = gg;
    w[3 * H + u] = go;
    w[4 * H + u] = tanh_(cn);
    cy[b * H + u] = from_acc<scalar_t>(cn);
    hy[b * H + u] = from_acc<scalar_t>(hn);
  }
}

// Larger batches: pre (B, 4H) = x W_ih^T + b + h W_hh^T from cuBLAS, then this pointwise cell.
template <typename scalar_t>
__global__ void cell_pointwise_kernel(int64_t B, int64_t H, const acc_t<scalar_t>* __restrict__ pre,
                                      const scalar_t* __restrict__ c, acc_t<scalar_t>* workspace,
                                      scalar_t* hy, scalar_t* cy) {
  using acc = acc_t<scalar_t>;
  const int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (idx >= B * H) return;
  const int64_t u = idx % H, b = idx / H;
  const acc* pr = pre + b * 4 * H;
  acc gi = pr[u], gf = pr[H + u], gg = pr[2 * H + u], go = pr[3 * H + u];
  acc hn;
  const acc cn = cell_forward(gi, gf, gg, go, to_acc(c[idx]), hn);
  acc* w = workspace + b * 5 * H;
  w[u] = gi;
  w[H + u] = gf;
  w[2 * H + u] = gg;
  w[3 * H + u] = go;
  w[4 * H + u] = tanh_(cn);
  cy[idx] = from_acc<scalar_t>(cn);
  hy[idx] = from_acc<scalar_t>(hn);
}

// lstm_cell_backward: dgates (B, 4H) acc and grad_cx from the workspace (cell_op_backward of the
// CPU kernel).
template <typename scalar_t>
__global__ void cell_backward_kernel(int64_t B, int64_t H, const scalar_t* __restrict__ grad_hy,
                                     const scalar_t* __restrict__ grad_cy,
                                     const scalar_t* __restrict__ cx,
                                     const acc_t<scalar_t>* __restrict__ workspace,
                                     acc_t<scalar_t>* dgates, scalar_t* grad_cx) {
  using acc = acc_t<scalar_t>;
  const int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (idx >= B * H) return;
  const int64_t u = idx % H, b = idx / H;
  const acc* w = workspace + b * 5 * H;
  const acc i = w[u], f = w[H + u], g = w[2 * H + u], o = w[3 * H + u], tc = w[4 * H + u];
  const acc dh = grad_hy != nullptr ? to_acc(grad_hy[idx]) : acc(0);
  const acc dc = grad_cy != nullptr ? to_acc(grad_cy[idx]) : acc(0);
  const acc dct = dc + dh * o * (acc(1) - tc * tc);
  acc* dg = dgates + b * 4 * H;
  dg[u] = dct * g * i * (acc(1) - i);
  dg[H + u] = dct * to_acc(cx[idx]) * f * (acc(1) - f);
  dg[2 * H + u] = dct * i * (acc(1) - g * g);
  dg[3 * H + u] = dh * tc * o * (acc(1) - o);
  grad_cx[idx] = from_acc<scalar_t>(dct * f);
}

}  // namespace fastattn::recurrent::cuda_kernels
