// Device code of the CUDA LSTM backend (csrc/lstm/lstm_cuda.cu holds the op bodies).
//
// Layout conventions (private to this backend; only the workspace's shape is in the contract):
// * Rows are time-major and unpacked: row t * B + b of every (T * B, .) buffer is batch entry b
//   at time t. Variable lengths are handled by per-row masking, not by sorting: at time t row b
//   is active when t < len_b. An inactive row keeps its state unchanged (so the reverse
//   direction, which visits t = T-1 .. 0, starts every row from h0/c0 at t = len_b - 1 without a
//   special case), writes zeros to its output and workspace rows and gets zero gradients.
// * Workspace of direction d (acc), Bt = T * B rows: gates (Bt, 4H) natural torch order i, f, g,
//   o (on entry x W_ih^T + b_ih + b_hh, on exit the activated gates), c_t (Bt, H), h_t (Bt, P),
//   so the backward reads what it needs and recomputes no GEMM (as the CPU backend does).
// * Direction 0 visits t = s at step s, direction 1 visits t = T - 1 - s.
//
// The cell's math is the CPU kernel's (lstm_cpu_kernel.cpp: cell_forward / cell_backward), in
// acc (float, double for double storage), rounded once to the storage type.
//
// tools/cuda_emu/emu_lstm.cpp compiles this file and lstm_cuda.cu for the CPU
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

namespace fastattn::lstm::cuda_kernels {

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
// Forward recurrence

struct ForwardStep {
  int64_t T, B, H, P, D;
  int64_t ws_dir;          // elements per direction of the workspace
  const int64_t* lengths;  // (B,) or nullptr
  bool proj;
};

// Per-step path, the cell of step s for every (d, b, u): hw (D, B, 4H) = h_{t-1} W_hh^T (cuBLAS);
// c_state (D, B, H) and, without projection, h_state (D, B, P = H) carried in acc. With a
// projection r = o * tanh(c_t) goes to r_buf (D, B, H) for the step's h = r W_hr^T GEMM.
template <typename scalar_t>
__global__ void forward_step_cell_kernel(ForwardStep p, int64_t s, acc_t<scalar_t>* ws,
                                         const acc_t<scalar_t>* __restrict__ hw,
                                         acc_t<scalar_t>* c_state, acc_t<scalar_t>* h_state,
                                         acc_t<scalar_t>* r_buf, scalar_t* output) {
  using acc = acc_t<scalar_t>;
  const int64_t n = p.D * p.B * p.H;
  const int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (idx >= n) return;
  const int64_t u = idx % p.H, db = idx / p.H, b = db % p.B, d = db / p.B;
  const int64_t t = d == 0 ? s : p.T - 1 - s;
  const bool active = t < row_length(p.lengths, b, p.T);
  acc* w = ws + d * p.ws_dir;
  acc* gates = w + (t * p.B + b) * 4 * p.H;
  acc* cells = w + p.T * p.B * 4 * p.H + (t * p.B + b) * p.H;
  acc* hidden = w + p.T * p.B * 5 * p.H + (t * p.B + b) * p.P;
  scalar_t* out = output + (t * p.B + b) * p.D * p.P + d * p.P;
  FASTATTN_DEVICE_CHECK(t >= 0 && t < p.T);
  if (!active) {
    for (int k = 0; k < 4; ++k) gates[k * p.H + u] = acc(0);
    cells[u] = acc(0);
    if (!p.proj) {
      hidden[u] = acc(0);
      out[u] = from_acc<scalar_t>(acc(0));
    }
    return;
  }
  const acc* hwr = hw + db * 4 * p.H;
  acc gi = gates[u] + hwr[u], gf = gates[p.H + u] + hwr[p.H + u];
  acc gg = gates[2 * p.H + u] + hwr[2 * p.H + u], go = gates[3 * p.H + u] + hwr[3 * p.H + u];
  acc h;
  const acc c = cell_forward(gi, gf, gg, go, c_state[idx], h);
  gates[u] = gi;
  gates[p.H + u] = gf;
  gates[2 * p.H + u] = gg;
  gates[3 * p.H + u] = go;
  cells[u] = c;
  c_state[idx] = c;
  if (p.proj) {
    r_buf[idx] = h;
  } else {
    h_state[idx] = h;
    hidden[u] = h;
    out[u] = from_acc<scalar_t>(h);
  }
}

// Per-step path with a projection: hp (D, B, P) = r W_hr^T; stores h_t for the active rows.
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
// Block k of direction d owns hidden units [k * U, k * U + U): it keeps their 4U rows of W_hh
// (transposed, (H, 4U)) in shared memory for the whole sequence, and per step computes
// h_{t-1} W_hh^T for its 4U gate columns and all B rows (persistent_block_product below),
// applies the cell, publishes h_t to the ping-pong state h_state (2, D, B, H) in global memory
// and waits at grid.sync() before the next step. The cell state of its units stays in c_state
// (only this block touches it).
constexpr int kPersistThreads = 256;
constexpr int kPersistMaxOut = 16;

// How a persistent block splits its product (B, K) x (K, N) over its threads: `splits` groups
// of kPersistThreads / splits threads each take a slice of K (split-K), so the serial chain per
// thread is K / splits long, not K (the first H100 run measured ~150 us per step at H = 512
// with one thread per column running all of K). The input streams through shared memory in
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

// The host's choice: the most K splits whose thread groups still cover all B x N outputs
// (kPersistMaxOut rows per thread), at most K of them; the widest chunk the shared memory
// holds beside the (K, N) weight slice and the (splits, B, N) partial sums. False when the
// block cannot hold its slice at all.
template <typename acc>
inline bool choose_persistent_split(int64_t K, int64_t B, int N, size_t smem_limit,
                                    PersistentSplit& out) {
  if (N < 1 || N > kPersistThreads || B < 1 || K < 1) return false;
  int splits = 0;
  for (int s = kPersistThreads / N; s >= 1; s /= 2) {
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

// out (B, N) = in (B, K) x w_s (K, N) for one block, every thread of the block calling it. `in`
// lives in global memory, written by other blocks before the last grid.sync(): read through L2
// (__ldcg), never a stale L1 line; row stride `in_stride`. Thread mapping: group ks =
// tid / (kPersistThreads / splits) sums k over its slice [ks * c, ks * c + c) of each chunk (c =
// chunk / splits); in the group, thread l owns column n = l % N and rows b = l / N + j * (group /
// N), j < kPersistMaxOut (N divides the group, so one shared load of W serves every row). The
// groups' partial sums meet in red_s (splits, B, N), added in group order (deterministic); the
// result is red_s[b * N + n] when the call returns (after a barrier).
template <typename acc>
__device__ __forceinline__ void persistent_block_product(const acc* in, int64_t in_stride,
                                                         int64_t B, int64_t K, int N,
                                                         const acc* w_s, acc* in_s, acc* red_s,
                                                         PersistentSplit split, int tid) {
  const int group = kPersistThreads / split.splits;
  const int ks = tid / group, l = tid % group;
  const int n = l % N, b_first = l / N, b_step = group / N;
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
    for (int kk = kb; kk < ke; ++kk) {
      const acc w = w_s[(k0 + kk) * N + n];
#pragma unroll
      for (int j = 0; j < kPersistMaxOut; ++j) {
        const int b = b_first + j * b_step;
        if (b < B) sum[j] += w * in_s[b * (chunk + 1) + kk];
      }
    }
  }
#pragma unroll
  for (int j = 0; j < kPersistMaxOut; ++j) {
    const int b = b_first + j * b_step;
    if (b < B) red_s[(ks * B + b) * N + n] = sum[j];
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
  int U;  // units per block (a power of two, 4U <= 256)
  int blocks_per_dir;
  PersistentSplit split;
};

template <typename scalar_t>
__global__ void __launch_bounds__(kPersistThreads)
    forward_persistent_kernel(PersistentParams pp, acc_t<scalar_t>* ws,
                              const acc_t<scalar_t>* __restrict__ w_hh, acc_t<scalar_t>* h_state,
                              acc_t<scalar_t>* c_state, scalar_t* output) {
  using acc = acc_t<scalar_t>;
  namespace cg = cooperative_groups;
  cg::grid_group grid = cg::this_grid();
  const ForwardStep& p = pp.p;
  const int U = pp.U, R = 4 * U;
  const int64_t H = p.H, B = p.B;
  const int d = blockIdx.x / pp.blocks_per_dir;
  const int64_t u0 = static_cast<int64_t>(blockIdx.x % pp.blocks_per_dir) * U;
  const int ub = static_cast<int>(H - u0 < U ? H - u0 : U);
  FASTATTN_LSTM_DYNAMIC_SMEM(smem_raw);
  acc* w_s = reinterpret_cast<acc*>(smem_raw);  // (H, 4U): w_s[k * R + g * U + uu]
  acc* h_s = w_s + H * R;                       // (B, chunk + 1): a chunk of h_{t-1}
  acc* g_s = h_s + B * (pp.split.chunk + 1);    // (splits, B, 4U); (B, 4U) = h W_hh^T after
  const int tid = threadIdx.x;

  for (int64_t e = tid; e < H * R; e += kPersistThreads) {
    const int64_t k = e / R;
    const int r = static_cast<int>(e % R), g = r / U, uu = r % U;
    w_s[e] = uu < ub ? w_hh[(static_cast<int64_t>(d) * 4 * H + g * H + u0 + uu) * H + k] : acc(0);
  }
  // the host's choice guarantees: 4U divides each thread group, kMaxOut rows cover every row
  FASTATTN_DEVICE_CHECK(pp.split.splits >= 1 && kPersistThreads % pp.split.splits == 0 &&
                        (kPersistThreads / pp.split.splits) % R == 0 &&
                        kPersistMaxOut * (kPersistThreads / pp.split.splits / R) >= B &&
                        pp.split.chunk % pp.split.splits == 0);
  FASTATTN_DEVICE_CHECK(d < p.D && ub >= 1);
  const int64_t state = static_cast<int64_t>(p.D) * B * H;  // one ping-pong half

  for (int64_t s = 0; s < p.T; ++s) {
    const acc* h_in = h_state + (s & 1) * state + d * B * H;
    acc* h_out = h_state + ((s + 1) & 1) * state + d * B * H;
    persistent_block_product(h_in, H, B, H, R, w_s, h_s, g_s, pp.split, tid);
    const int64_t t = d == 0 ? s : p.T - 1 - s;
    acc* w = ws + d * p.ws_dir;
    for (int e = tid; e < B * U; e += kPersistThreads) {
      const int64_t b = e / U;
      const int uu = e % U;
      if (uu >= ub) continue;
      const int64_t u = u0 + uu;
      acc* gates = w + (t * B + b) * 4 * H;
      acc* cells = w + p.T * B * 4 * H + (t * B + b) * H;
      acc* hidden = w + p.T * B * 5 * H + (t * B + b) * H;
      scalar_t* out = output + (t * B + b) * p.D * H + d * H;
      acc* c_st = c_state + (d * B + b) * H + u;
      if (t < row_length(p.lengths, b, p.T)) {
        const acc* gr = g_s + b * R;
        acc gi = gates[u] + gr[uu], gf = gates[H + u] + gr[U + uu];
        acc gg = gates[2 * H + u] + gr[2 * U + uu], go = gates[3 * H + u] + gr[3 * U + uu];
        acc h;
        const acc c = cell_forward(gi, gf, gg, go, *c_st, h);
        gates[u] = gi;
        gates[H + u] = gf;
        gates[2 * H + u] = gg;
        gates[3 * H + u] = go;
        cells[u] = c;
        *c_st = c;
        hidden[u] = h;
        out[u] = from_acc<scalar_t>(h);
        h_out[b * H + u] = h;
      } else {
        for (int g = 0; g < 4; ++g) gates[g * H + u] = acc(0);
        cells[u] = acc(0);
        hidden[u] = acc(0);
        out[u] = from_acc<scalar_t>(acc(0));
        h_out[b * H + u] =
            FASTATTN_LSTM_LDCG(h_in + b * H + u);  // the state passes through unchanged
      }
    }
    grid.sync();  // h_t of every block is visible before anyone reads it
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

// The cell's derivative at step s for every (d, b, u). dh comes from dr (D, B, H) with a
// projection, else dh_state + grad_output. Writes dgates (D, T*B, 4H) and the step's copy
// dg_step (D, B, 4H) (input of dh_{t-1} = dgates W_hh), hprev (D, T*B, P), r_all (D, T*B, H)
// (projection), and updates dc_state for the active rows.
template <typename scalar_t>
__global__ void backward_step_cell_kernel(
    BackwardStep p, int64_t s, const acc_t<scalar_t>* __restrict__ ws,
    const acc_t<scalar_t>* __restrict__ h0, const acc_t<scalar_t>* __restrict__ c0,
    const acc_t<scalar_t>* __restrict__ dr, const acc_t<scalar_t>* __restrict__ dh_state,
    const scalar_t* __restrict__ grad_output, acc_t<scalar_t>* dc_state, acc_t<scalar_t>* dgates,
    acc_t<scalar_t>* dg_step, acc_t<scalar_t>* hprev, acc_t<scalar_t>* r_all) {
  using acc = acc_t<scalar_t>;
  const int64_t n = p.D * p.B * p.H;
  const int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (idx >= n) return;
  const int64_t u = idx % p.H, db = idx / p.H, b = db % p.B, d = db / p.B;
  const int64_t t = d == 0 ? s : p.T - 1 - s;
  const int64_t len = row_length(p.lengths, b, p.T);
  const int64_t Bt = p.T * p.B, row = t * p.B + b;
  acc* dg = dgates + d * Bt * 4 * p.H + row * 4 * p.H;
  acc* dgs = dg_step + db * 4 * p.H;
  acc* hp = hprev + d * Bt * p.P + row * p.P;
  if (t >= len) {
    for (int k = 0; k < 4; ++k) dg[k * p.H + u] = dgs[k * p.H + u] = acc(0);
    if (u < p.P) hp[u] = acc(0);
    if (p.proj) r_all[d * Bt * p.H + row * p.H + u] = acc(0);
    return;
  }
  const acc* w = ws + d * p.ws_dir;
  const acc* gates = w + row * 4 * p.H;
  const acc* cells = w + Bt * 4 * p.H;
  const acc* hidden = w + Bt * 5 * p.H;
  const bool first = d == 0 ? t == 0 : t == len - 1;
  const int64_t prev = (d == 0 ? t - 1 : t + 1) * p.B + b;
  FASTATTN_DEVICE_CHECK(first || (prev >= 0 && prev < Bt));
  const acc cp = first ? c0[idx] : cells[prev * p.H + u];
  if (u < p.P) hp[u] = first ? h0[db * p.P + u] : hidden[prev * p.P + u];
  acc dh;
  if (p.proj) {
    dh = dr[idx];
  } else {
    dh = dh_state[idx];
    if (grad_output != nullptr) dh += to_acc(grad_output[row * p.D * p.P + d * p.P + u]);
  }
  acc dc = dc_state[idx], di, df, dgg, dgo, r;
  cell_backward(gates[u], gates[p.H + u], gates[2 * p.H + u], gates[3 * p.H + u],
                cells[row * p.H + u], cp, dh, dc, di, df, dgg, dgo, r);
  dc_state[idx] = dc;
  dg[u] = dgs[u] = di;
  dg[p.H + u] = dgs[p.H + u] = df;
  dg[2 * p.H + u] = dgs[2 * p.H + u] = dgg;
  dg[3 * p.H + u] = dgs[3 * p.H + u] = dgo;
  if (p.proj) r_all[d * Bt * p.H + row * p.H + u] = r;
}

// dh_state (D, B, P) = dhp (= dgates W_hh of the step) for the rows active at step s.
template <typename acc>
__global__ void backward_step_update_kernel(BackwardStep p, int64_t s, const acc* __restrict__ dhp,
                                            acc* dh_state) {
  const int64_t n = p.D * p.B * p.P;
  const int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (idx >= n) return;
  const int64_t b = (idx / p.P) % p.B, d = idx / (p.P * p.B);
  const int64_t t = d == 0 ? s : p.T - 1 - s;
  if (t < row_length(p.lengths, b, p.T)) dh_state[idx] = dhp[idx];
}

// Persistent backward (no projection): one cooperative launch for every step of both
// directions. Block k of direction d owns hidden units [kU, kU + U) and keeps the (4H, U)
// column slice of W_hh (rows: all 4H gate rows, columns: its units of h) in shared memory. Per
// step i (reverse time, t_i):
//   A. (i > 0) dL/dh_{t_i} of its units = dgates of step i-1 (all 4H columns, published by every
//      block before the last grid.sync(), streamed through shared memory in chunks) x its W
//      slice, for the rows active at step i-1; other rows keep their carried dh;
//   B. the cell derivative of its units at t_i (dh + grad_output, the carried dc), writing the
//      dgates of its units' 4 gate columns (dgates buffer = the weight GEMMs' input) and hprev;
//   grid.sync().
// After the last step, phase A once more gives grad_h0. dh/dc carries stay in global slices that
// only the owning block touches. Phase A is persistent_block_product with K = 4H, N = U.
struct PersistentBackwardParams {
  BackwardStep p;
  int U;
  int blocks_per_dir;
  PersistentSplit split;
};

template <typename scalar_t>
__global__ void __launch_bounds__(kPersistThreads)
    backward_persistent_kernel(PersistentBackwardParams pp, const acc_t<scalar_t>* ws,
                               const acc_t<scalar_t>* __restrict__ w_hh,
                               const acc_t<scalar_t>* __restrict__ h0,
                               const acc_t<scalar_t>* __restrict__ c0,
                               const scalar_t* __restrict__ grad_output, acc_t<scalar_t>* dh_state,
                               acc_t<scalar_t>* dc_state, acc_t<scalar_t>* dgates,
                               acc_t<scalar_t>* hprev) {
  using acc = acc_t<scalar_t>;
  namespace cg = cooperative_groups;
  cg::grid_group grid = cg::this_grid();
  const BackwardStep& p = pp.p;
  const int U = pp.U;
  const int64_t H = p.H, B = p.B, G = 4 * H, Bt = p.T * p.B;
  const int d = blockIdx.x / pp.blocks_per_dir;
  const int64_t u0 = static_cast<int64_t>(blockIdx.x % pp.blocks_per_dir) * U;
  const int ub = static_cast<int>(H - u0 < U ? H - u0 : U);
  FASTATTN_LSTM_DYNAMIC_SMEM(smem_raw);
  acc* w_s = reinterpret_cast<acc*>(smem_raw);  // (4H, U): w_s[j * U + uu] = W[j, u0+uu]
  acc* g_s = w_s + G * U;                       // (B, chunk + 1): a chunk of the dgates
  acc* red_s = g_s + B * (pp.split.chunk + 1);  // (splits, B, U); (B, U) = dh after
  const int tid = threadIdx.x;
  FASTATTN_DEVICE_CHECK(pp.split.splits >= 1 && kPersistThreads % pp.split.splits == 0 &&
                        (kPersistThreads / pp.split.splits) % U == 0 &&
                        kPersistMaxOut * (kPersistThreads / pp.split.splits / U) >= B &&
                        pp.split.chunk % pp.split.splits == 0);
  FASTATTN_DEVICE_CHECK(d < p.D && ub >= 1 && !p.proj);

  for (int64_t e = tid; e < G * U; e += kPersistThreads) {
    const int64_t j = e / U;
    const int uu = static_cast<int>(e % U);
    w_s[e] = uu < ub ? w_hh[(static_cast<int64_t>(d) * G + j) * H + u0 + uu] : acc(0);
  }
  const acc* w = ws + d * p.ws_dir;
  acc* dg_dir = dgates + d * Bt * G;

  for (int64_t i = 0; i <= p.T; ++i) {
    // A. dh of the rows active at the previous step (i - 1) from its dgates.
    if (i > 0) {
      const int64_t s_prev = p.T - i;  // forward step index of step i - 1
      const int64_t t_prev = d == 0 ? s_prev : p.T - 1 - s_prev;
      const acc* dg_prev = dg_dir + t_prev * B * G;
      persistent_block_product(dg_prev, G, B, G, U, w_s, g_s, red_s, pp.split, tid);
      for (int64_t e = tid; e < B * U; e += kPersistThreads) {
        const int64_t b = e / U;
        const int uu = static_cast<int>(e % U);
        if (uu < ub && t_prev < row_length(p.lengths, b, p.T)) {
          dh_state[(d * B + b) * H + u0 + uu] = red_s[e];
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
      acc* dg = dg_dir + row * G;
      acc* hp = hprev + d * Bt * H + row * H;
      const int64_t len = row_length(p.lengths, b, p.T);
      if (t >= len) {
        for (int g = 0; g < 4; ++g) dg[g * H + u] = acc(0);
        hp[u] = acc(0);
        continue;
      }
      const acc* gates = w + row * G;
      const acc* cells = w + Bt * G;
      const acc* hidden = w + Bt * 5 * H;
      const bool first = d == 0 ? t == 0 : t == len - 1;
      const int64_t prev = (d == 0 ? t - 1 : t + 1) * B + b;
      FASTATTN_DEVICE_CHECK(first || (prev >= 0 && prev < Bt));
      const acc cp = first ? c0[st] : cells[prev * H + u];
      hp[u] = first ? h0[st] : hidden[prev * H + u];
      acc dh = dh_state[st];
      if (grad_output != nullptr) dh += to_acc(grad_output[row * p.D * H + d * H + u]);
      acc dc = dc_state[st], di, df, dgg, dgo, r;
      cell_backward(gates[u], gates[H + u], gates[2 * H + u], gates[3 * H + u], cells[row * H + u],
                    cp, dh, dc, di, df, dgg, dgo, r);
      dc_state[st] = dc;
      dg[u] = di;
      dg[H + u] = df;
      dg[2 * H + u] = dgg;
      dg[3 * H + u] = dgo;
    }
    grid.sync();  // every block's dgates of step i are visible
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

}  // namespace fastattn::lstm::cuda_kernels
