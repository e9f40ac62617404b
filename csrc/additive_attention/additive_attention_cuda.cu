// CUDA bodies of the additive-attention score ops (same math as the CPU kernels).
// Forward: a 16 x 16 block of (query, key) scores per thread block, query/key rows staged in
// shared memory 64 features at a time; the (batch, query tile, key tile) of a block are folded
// into grid x (y and z hold only 65535). Backward: one block per query row for dQp (each thread
// owns features a, looping over keys; per-row dv partials), one per key row for dKp, and a
// final in-order sum of the dv partials: no atomics, deterministic.
#include "common/cuda_api.h"

#include "additive_attention/additive_attention.h"
#include "common/cuda_utils.cuh"
#include "common/debug.h"

namespace fastattn::additive_attention {
namespace {

using fastattn::cuda::acc_t;
using fastattn::cuda::ceil_div;
using fastattn::cuda::from_acc;
using fastattn::cuda::grid_x;
using fastattn::cuda::to_acc;

constexpr int kTile = 16;
constexpr int kChunk = 64;

template <typename T>
__global__ void scores_kernel(const T* __restrict__ qp, const T* __restrict__ kp,
                              const T* __restrict__ v, acc_t<T>* __restrict__ scores, int64_t Lq,
                              int64_t Lk, int64_t A, int64_t lq_tiles, int64_t lk_tiles) {
  using acc = acc_t<T>;
  __shared__ acc q_s[kTile][kChunk + 1], k_s[kTile][kChunk + 1], v_s[kChunk];
  // blockIdx.x = (b * lq_tiles + query tile) * lk_tiles + key tile
  const int64_t block = blockIdx.x;
  const int64_t key_tile = block % lk_tiles;
  const int64_t query_tile = (block / lk_tiles) % lq_tiles;
  const int64_t b = block / lk_tiles / lq_tiles;
  const int64_t i = query_tile * kTile + threadIdx.y;
  const int64_t j = key_tile * kTile + threadIdx.x;
  const int tid = threadIdx.y * kTile + threadIdx.x;
  acc sum = 0;
  for (int64_t a0 = 0; a0 < A; a0 += kChunk) {
    for (int e = tid; e < kTile * kChunk; e += kTile * kTile) {
      const int r = e / kChunk, c = e % kChunk;
      const int64_t a = a0 + c;
      const int64_t qi = query_tile * kTile + r;
      const int64_t kj = key_tile * kTile + r;
      q_s[r][c] = (qi < Lq && a < A) ? to_acc(qp[(b * Lq + qi) * A + a]) : acc(0);
      k_s[r][c] = (kj < Lk && a < A) ? to_acc(kp[(b * Lk + kj) * A + a]) : acc(0);
      if (r == 0) v_s[c] = a < A ? to_acc(v[a]) : acc(0);
    }
    __syncthreads();
    const int64_t n = A - a0 < kChunk ? A - a0 : kChunk;
    for (int c = 0; c < n; ++c) sum += v_s[c] * tanh(q_s[threadIdx.y][c] + k_s[threadIdx.x][c]);
    __syncthreads();
  }
  if (i < Lq && j < Lk) scores[(b * Lq + i) * Lk + j] = sum;
}

// Row x of X (rows of length A) against all n rows of Y: for each feature a owned by the thread,
//   dx[a] = v[a] * sum_j g[j * g_stride] (1 - t^2),  dv_part[a] = sum_j g t  (optional)
template <typename T>
__global__ void row_grad_kernel(const T* __restrict__ X, const T* __restrict__ Y,
                                const T* __restrict__ v, const acc_t<T>* __restrict__ G,
                                int64_t rows_per_batch, int64_t n, int64_t A, int64_t g_row_stride,
                                int64_t g_col_stride, int64_t g_batch_stride, T* __restrict__ dx,
                                acc_t<T>* __restrict__ dv_part) {
  using acc = acc_t<T>;
  const int64_t row = blockIdx.x;  // b * rows_per_batch + r
  const int64_t b = row / rows_per_batch, r = row % rows_per_batch;
  const T* y = Y + b * n * A;
  const acc* g = G + b * g_batch_stride + r * g_row_stride;
  for (int64_t a = threadIdx.x; a < A; a += blockDim.x) {
    const acc xa = to_acc(X[row * A + a]);
    acc sx = 0, sv = 0;
    for (int64_t j = 0; j < n; ++j) {
      const acc gj = g[j * g_col_stride];
      const acc t = tanh(xa + to_acc(y[j * A + a]));
      sx += gj * (acc(1) - t * t);
      sv += gj * t;
    }
    dx[row * A + a] = from_acc<T>(sx * to_acc(v[a]));
    if (dv_part != nullptr) dv_part[row * A + a] = sv;
  }
}

template <typename T>
__global__ void sum_rows_kernel(const acc_t<T>* __restrict__ parts, int64_t rows, int64_t A,
                                T* __restrict__ out) {
  const int64_t a = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (a >= A) return;
  acc_t<T> sum = 0;
  for (int64_t r = 0; r < rows; ++r) sum += parts[r * A + a];
  out[a] = from_acc<T>(sum);
}

#define FASTATTN_DISPATCH_ADDITIVE(TYPE, ...) \
  FASTATTN_DISPATCH_FLOATING(TYPE, "additive_cuda", __VA_ARGS__)

Tensor additive_scores_cuda(const Tensor& qp_in, const Tensor& kp_in, const Tensor& v_in) {
  check_scores_args(qp_in, kp_in, v_in, "additive_scores");
  CudaGuard guard(qp_in);
  Tensor qp = qp_in.contiguous(), kp = kp_in.contiguous(), v = v_in.contiguous();
  const int64_t B = qp.size(0), Lq = qp.size(1), Lk = kp.size(1), A = qp.size(2);
  Tensor scores = empty({B, Lq, Lk}, qp.options().dtype(compute_dtype(qp)));
  poison(scores);
  if (scores.numel() == 0) return scores;
  auto stream = current_cuda_stream();
  const int64_t lq_tiles = ceil_div(Lq, kTile), lk_tiles = ceil_div(Lk, kTile);
  // (no int64 overflow: the product is at most scores.numel())
  const unsigned blocks =
      grid_x(B * lq_tiles * lk_tiles, "additive_scores", "B * ceil(Lq / 16) * ceil(Lk / 16)");
  FASTATTN_DISPATCH_ADDITIVE(qp.scalar_type(), [&] {
    scores_kernel<scalar_t><<<blocks, dim3(kTile, kTile), 0, stream>>>(
        qp.data_ptr<scalar_t>(), kp.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
        scores.data_ptr<acc_t<scalar_t>>(), Lq, Lk, A, lq_tiles, lk_tiles);
    FASTATTN_CUDA_LAUNCH_CHECK();
  });
  return scores;
}

std::tuple<Tensor, Tensor, Tensor> additive_scores_backward_cuda(const Tensor& grad_in,
                                                                 const Tensor& qp_in,
                                                                 const Tensor& kp_in,
                                                                 const Tensor& v_in) {
  constexpr const char* op = "additive_scores_backward";
  check_scores_args(qp_in, kp_in, v_in, op);
  FASTATTN_CHECK(grad_in.dim() == 3 && grad_in.size(0) == qp_in.size(0) &&
                     grad_in.size(1) == qp_in.size(1) && grad_in.size(2) == kp_in.size(1),
                 op, "grad must be (B, Lq, Lk), got ", grad_in.sizes());
  CudaGuard guard(qp_in);
  Tensor qp = qp_in.contiguous(), kp = kp_in.contiguous(), v = v_in.contiguous();
  Tensor grad = grad_in.to(compute_dtype(qp)).contiguous();
  const int64_t B = qp.size(0), Lq = qp.size(1), Lk = kp.size(1), A = qp.size(2);
  Tensor dqp = empty(qp.sizes(), qp.options());
  Tensor dkp = empty(kp.sizes(), kp.options());
  Tensor dv = empty(v.sizes(), v.options());
  Tensor dv_part = empty({std::max<int64_t>(B * Lq, 1), A}, grad.options());
  poison(dqp);
  poison(dkp);
  poison(dv);
  auto stream = current_cuda_stream();
  const int threads =
      static_cast<int>(std::min<int64_t>(256, ceil_div(std::max<int64_t>(A, 1), 32) * 32));
  FASTATTN_DISPATCH_ADDITIVE(qp.scalar_type(), [&] {
    using acc = acc_t<scalar_t>;
    if (B * Lq > 0) {
      row_grad_kernel<scalar_t><<<grid_x(B * Lq, op, "B * Lq"), threads, 0, stream>>>(
          qp.data_ptr<scalar_t>(), kp.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
          grad.data_ptr<acc>(), Lq, Lk, A, Lk, 1, Lq * Lk, dqp.data_ptr<scalar_t>(),
          dv_part.data_ptr<acc>());
      FASTATTN_CUDA_LAUNCH_CHECK();
    }
    if (B * Lk > 0) {
      row_grad_kernel<scalar_t><<<grid_x(B * Lk, op, "B * Lk"), threads, 0, stream>>>(
          kp.data_ptr<scalar_t>(), qp.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
          grad.data_ptr<acc>(), Lk, Lq, A, 1, Lk, Lq * Lk, dkp.data_ptr<scalar_t>(), nullptr);
      FASTATTN_CUDA_LAUNCH_CHECK();
    }
    if (A > 0) {
      sum_rows_kernel<scalar_t><<<static_cast<unsigned>(ceil_div(A, 256)), 256, 0, stream>>>(
          dv_part.data_ptr<acc>(), B * Lq, A, dv.data_ptr<scalar_t>());
      FASTATTN_CUDA_LAUNCH_CHECK();
    }
  });
  return {dqp, dkp, dv};
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(fastattn, CUDA, m) {
  m.impl("additive_scores", TORCH_BOX(&additive_scores_cuda));
  m.impl("additive_scores_backward", TORCH_BOX(&additive_scores_backward_cuda));
}

}  // namespace fastattn::additive_attention
