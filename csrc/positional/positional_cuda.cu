// CUDA bodies of the positional-encoding ops. Same math as positional_cpu_kernel.cpp: angles
// pos * inv_freq rounded to the compute type with inv_freq = base^(-2i/dim) computed in double,
// dropout from the shared Philox stream (common/philox.h). Each thread owns 4 consecutive
// columns of one row (one 16-byte load for float32 when the row is aligned).
#include "common/cuda_api.h"

#include "common/cuda_utils.cuh"
#include "common/philox.h"
#include "common/debug.h"
#include "positional/positional.h"

namespace fastattn::positional {
namespace {

using fastattn::cuda::acc_t;
using fastattn::cuda::ceil_div;
using fastattn::cuda::from_acc;
using fastattn::cuda::to_acc;
using std::optional;

constexpr int kColsPerThread = 4;

// The sort keys of embed_with_positions_backward's deterministic path (int64, rows of them):
// keys[i] = tokens[i], or -1 for padding tokens (padding_idx >= 0), when positions is null;
// else positions[n * L + l] = offset + offsets[n] (0 without offsets) + l.
__global__ void sort_keys_kernel(const int64_t* __restrict__ tokens, int64_t padding_idx,
                                 const int64_t* __restrict__ offsets, int64_t offset, int64_t L,
                                 int64_t rows, int64_t* __restrict__ keys,
                                 int64_t* __restrict__ positions) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < rows;
       i += step) {
    if (positions == nullptr) {
      const int64_t t = tokens[i];
      keys[i] = padding_idx >= 0 && t == padding_idx ? -1 : t;
    } else {
      positions[i] = offset + (offsets != nullptr ? offsets[i / L] : 0) + i % L;
    }
  }
}

const int64_t* optional_ptr(const optional<Tensor>& t) {
  return t.has_value() && t->defined() ? t->data_ptr<int64_t>() : nullptr;
}

template <typename acc>
__device__ __forceinline__ acc inv_frequency(int64_t i, int64_t dim, double log2_base) {
  return static_cast<acc>(
      exp2(-((2.0 * static_cast<double>(i)) / static_cast<double>(dim)) * log2_base));
}

// PE[pos, d]: sin for even d, cos for odd d, of pos * inv_frequency(d / 2).
template <typename acc>
__device__ __forceinline__ acc sinusoid_value(int64_t pos, int64_t d, int64_t dim,
                                              double log2_base) {
  const acc angle = static_cast<acc>(pos) * inv_frequency<acc>(d >> 1, dim, log2_base);
  return (d & 1) ? cos(angle) : sin(angle);
}

// Dropout uniforms of logical elements e0 .. e0+3 (one or two Philox blocks).
__device__ __forceinline__ void uniforms4(uint64_t seed, uint64_t stream, uint64_t e0, float u[4]) {
  const Philox4 first = philox_block(seed, stream, e0 >> 2);
  const int skip = static_cast<int>(e0 & 3);
  if (skip == 0) {
#pragma unroll
    for (int k = 0; k < 4; ++k) u[k] = philox_uniform(first.v[k]);
    return;
  }
  const Philox4 second = philox_block(seed, stream, (e0 >> 2) + 1);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int w = skip + k;
    u[k] = philox_uniform(w < 4 ? first.v[w] : second.v[w - 4]);
  }
}

// Per-call dropout constants: threshold p rounded to float, scale 1/(1-p) from double.
template <typename acc>
struct Dropout {
  float threshold;
  acc keep_scale;
  const int64_t* seed;  // device int64 (2,) or nullptr when p == 0
};

template <typename acc>
Dropout<acc> make_dropout(double p, const optional<Tensor>& seed) {
  return Dropout<acc>{static_cast<float>(p), static_cast<acc>(1.0 / (1.0 - p)),
                      p > 0.0 ? seed->data_ptr<int64_t>() : nullptr};
}

// Loads/stores of 4 consecutive elements, vectorised when the caller proved alignment.
template <typename T>
struct alignas(4 * sizeof(T)) Vec4 {
  T v[4];
};

template <typename T, bool kAligned>
__device__ __forceinline__ void load4(const T* src, int64_t d0, int64_t D, acc_t<T> out[4]) {
  if constexpr (kAligned) {
    const Vec4<T> packed = *reinterpret_cast<const Vec4<T>*>(src + d0);
#pragma unroll
    for (int k = 0; k < 4; ++k) out[k] = to_acc(packed.v[k]);
  } else {
#pragma unroll
    for (int k = 0; k < 4; ++k) out[k] = d0 + k < D ? to_acc(src[d0 + k]) : acc_t<T>(0);
  }
}

template <typename T, bool kAligned>
__device__ __forceinline__ void store4(T* dst, int64_t d0, int64_t D, const acc_t<T> in[4]) {
  if constexpr (kAligned) {
    Vec4<T> packed;
#pragma unroll
    for (int k = 0; k < 4; ++k) packed.v[k] = from_acc<T>(in[k]);
    *reinterpret_cast<Vec4<T>*>(dst + d0) = packed;
  } else {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if (d0 + k < D) dst[d0 + k] = from_acc<T>(in[k]);
    }
  }
}

template <typename acc>
__device__ __forceinline__ void apply_dropout4(const Dropout<acc>& drop, uint64_t e0, acc v[4]) {
  if (drop.seed == nullptr) return;
  float u[4];
  uniforms4(static_cast<uint64_t>(drop.seed[0]), static_cast<uint64_t>(drop.seed[1]), e0, u);
#pragma unroll
  for (int k = 0; k < 4; ++k) v[k] *= u[k] >= drop.threshold ? drop.keep_scale : acc(0);
}

// Launch shape: one block row per tensor row, threads over groups of 4 columns.
struct RowLaunch {
  dim3 grid, block;
};

RowLaunch row_launch(int64_t rows, int64_t D) {
  const int64_t groups = ceil_div(D, kColsPerThread);
  const int threads = static_cast<int>(std::min<int64_t>(256, ceil_div(groups, 32) * 32));
  return {dim3(static_cast<unsigned>(rows), static_cast<unsigned>(ceil_div(groups, threads))),
          dim3(threads)};
}

bool aligned4(const void* ptr, int64_t elem_size, std::initializer_list<int64_t> strides,
              int64_t D) {
  if (D % 4 != 0) return false;
  if (reinterpret_cast<uintptr_t>(ptr) % (4 * elem_size) != 0) return false;
  for (int64_t s : strides) {
    if (s % 4 != 0) return false;
  }
  return true;
}

// ---------------------------------------------------------------------------------------------

template <typename T>
__global__ void sinusoidal_table_kernel(const int64_t* __restrict__ positions, T* __restrict__ out,
                                        int64_t D, double log2_base) {
  using acc = acc_t<T>;
  const int64_t row = blockIdx.x;
  const int64_t d0 = (static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x) * 4;
  if (d0 >= D) return;
  const int64_t pos = positions[row];
  acc v[4];
#pragma unroll
  for (int k = 0; k < 4; ++k)
    v[k] = d0 + k < D ? sinusoid_value<acc>(pos, d0 + k, D, log2_base) : acc(0);
  store4<T, false>(out + row * D, d0, D, v);
}

// x and out are not __restrict__: add_sinusoidal_ passes the same tensor as both.
template <typename T, bool kAligned>
__global__ void add_sinusoidal_kernel(const T* x, T* out, int64_t L, int64_t D, int64_t x_sn,
                                      int64_t x_sl, int64_t o_sn, int64_t o_sl, int64_t offset,
                                      const int64_t* __restrict__ offsets, acc_t<T> scale,
                                      double log2_base, Dropout<acc_t<T>> drop, bool add_pe) {
  using acc = acc_t<T>;
  const int64_t row = blockIdx.x;
  const int64_t n = row / L, l = row % L;
  const int64_t d0 = (static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x) * 4;
  if (d0 >= D) return;
  acc v[4];
  load4<T, kAligned>(x + n * x_sn + l * x_sl, d0, D, v);
  const int64_t pos = offset + (offsets != nullptr ? offsets[n] : 0) + l;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    v[k] *= scale;
    if (add_pe && d0 + k < D) v[k] += sinusoid_value<acc>(pos, d0 + k, D, log2_base);
  }
  apply_dropout4(drop, static_cast<uint64_t>(row * D + d0), v);
  store4<T, kAligned>(out + n * o_sn + l * o_sl, d0, D, v);
}

template <typename T, bool kAligned>
__global__ void embed_kernel(const int64_t* __restrict__ tokens, const T* __restrict__ weight,
                             int64_t w_s0, const T* __restrict__ table, int64_t t_s0,
                             T* __restrict__ out, int64_t V, int64_t L, int64_t D, int64_t offset,
                             const int64_t* __restrict__ offsets, acc_t<T> scale, double log2_base,
                             Dropout<acc_t<T>> drop) {
  using acc = acc_t<T>;
  const int64_t row = blockIdx.x;
  const int64_t n = row / L, l = row % L;
  const int64_t d0 = (static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x) * 4;
  if (d0 >= D) return;
  const int64_t token = tokens[row];
  FASTATTN_DEVICE_CHECK(token >= 0 && token < V);
  const int64_t pos = offset + (offsets != nullptr ? offsets[n] : 0) + l;
  acc v[4], pe[4];
  load4<T, kAligned>(weight + token * w_s0, d0, D, v);
  if (table != nullptr) {
    load4<T, kAligned>(table + pos * t_s0, d0, D, pe);
  } else {
#pragma unroll
    for (int k = 0; k < 4; ++k)
      pe[k] = d0 + k < D ? sinusoid_value<acc>(pos, d0 + k, D, log2_base) : acc(0);
  }
#pragma unroll
  for (int k = 0; k < 4; ++k) v[k] = v[k] * scale + pe[k];
  apply_dropout4(drop, static_cast<uint64_t>(row * D + d0), v);
  store4<T, kAligned>(out + row * D, d0, D, v);
}

// Non-deterministic backward: every row adds its dropped-out gradient into its token's row
// (times scale) and its position's row with atomics, in the compute type.
template <typename T>
__global__ void embed_backward_atomic_kernel(const T* __restrict__ grad,
                                             const int64_t* __restrict__ tokens,
                                             acc_t<T>* __restrict__ grad_weight,
                                             acc_t<T>* __restrict__ grad_table, int64_t L,
                                             int64_t D, int64_t padding_idx, int64_t offset,
                                             const int64_t* __restrict__ offsets, acc_t<T> scale,
                                             Dropout<acc_t<T>> drop) {
  using acc = acc_t<T>;
  const int64_t row = blockIdx.x;
  const int64_t n = row / L, l = row % L;
  const int64_t d0 = (static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x) * 4;
  if (d0 >= D) return;
  acc g[4];
  load4<T, false>(grad + row * D, d0, D, g);
  apply_dropout4(drop, static_cast<uint64_t>(row * D + d0), g);
  const int64_t token = tokens[row];
  const int64_t pos = offset + (offsets != nullptr ? offsets[n] : 0) + l;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    if (d0 + k >= D) break;
    if (token != padding_idx) atomicAdd(grad_weight + token * D + d0 + k, g[k] * scale);
    if (grad_table != nullptr) atomicAdd(grad_table + pos * D + d0 + k, g[k]);
  }
}

// Deterministic backward: rows sorted by key; the block at the start of each run of equal keys
// sums that run in sorted (stable, so increasing row) order and writes the key's row once.
template <typename T>
__global__ void embed_backward_sorted_kernel(const T* __restrict__ grad,
                                             const int64_t* __restrict__ sorted_keys,
                                             const int64_t* __restrict__ order, int64_t rows,
                                             int64_t D, acc_t<T> factor, Dropout<acc_t<T>> drop,
                                             acc_t<T>* __restrict__ out) {
  using acc = acc_t<T>;
  const int64_t i = blockIdx.x;
  const int64_t key = sorted_keys[i];
  if (key < 0 || (i > 0 && sorted_keys[i - 1] == key)) return;
  const int64_t d0 = (static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x) * 4;
  if (d0 >= D) return;
  acc sum[4] = {acc(0), acc(0), acc(0), acc(0)};
  for (int64_t j = i; j < rows && sorted_keys[j] == key; ++j) {
    const int64_t row = order[j];
    acc g[4];
    load4<T, false>(grad + row * D, d0, D, g);
    apply_dropout4(drop, static_cast<uint64_t>(row * D + d0), g);
#pragma unroll
    for (int k = 0; k < 4; ++k) sum[k] += g[k];
  }
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    if (d0 + k < D) out[key * D + d0 + k] = sum[k] * factor;
  }
}

template <typename T>
__global__ void cast_kernel(const acc_t<T>* __restrict__ src, T* __restrict__ dst, int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) dst[i] = from_acc<T>(src[i]);
}

template <typename T>
__global__ void rotary_kernel(const T* x, T* out, int64_t H, int64_t L, int64_t D,
                              int64_t rotary_dim, int64_t x_sb, int64_t x_sh, int64_t x_sl,
                              int64_t o_sb, int64_t o_sh, int64_t o_sl,
                              const acc_t<T>* __restrict__ cos_table,
                              const acc_t<T>* __restrict__ sin_table, int64_t table_stride,
                              double log2_base, int64_t offset, const int64_t* __restrict__ offsets,
                              const int64_t* __restrict__ position_ids, bool interleaved,
                              bool conjugate, bool copy_tail) {
  // x and out may alias (in place): each thread reads and writes only its own pair.
  using acc = acc_t<T>;
  const int64_t b = blockIdx.x / L, l = blockIdx.x % L;
  const int64_t pos = position_ids != nullptr ? position_ids[blockIdx.x]
                                              : offset + (offsets != nullptr ? offsets[b] : 0) + l;
  const int64_t half = rotary_dim / 2;
  for (int64_t i = threadIdx.x; i < half; i += blockDim.x) {
    acc c, s;
    if (cos_table != nullptr) {
      c = cos_table[pos * table_stride + i];
      s = sin_table[pos * table_stride + i];
    } else {
      const acc angle = static_cast<acc>(pos) * inv_frequency<acc>(i, rotary_dim, log2_base);
      c = cos(angle);
      s = sin(angle);
    }
    if (conjugate) s = -s;
    const int64_t i1 = interleaved ? 2 * i : i;
    const int64_t i2 = interleaved ? 2 * i + 1 : i + half;
    for (int64_t h = threadIdx.y; h < H; h += blockDim.y) {
      const T* src = x + b * x_sb + h * x_sh + l * x_sl;
      T* dst = out + b * o_sb + h * o_sh + l * o_sl;
      const acc x1 = to_acc(src[i1]), x2 = to_acc(src[i2]);
      dst[i1] = from_acc<T>(x1 * c - x2 * s);
      dst[i2] = from_acc<T>(x2 * c + x1 * s);
    }
  }
  if (copy_tail) {
    for (int64_t h = threadIdx.y; h < H; h += blockDim.y) {
      for (int64_t d = rotary_dim + threadIdx.x; d < D; d += blockDim.x) {
        out[b * o_sb + h * o_sh + l * o_sl + d] = x[b * x_sb + h * x_sh + l * x_sl + d];
      }
    }
  }
}

#define FASTATTN_DISPATCH_FLOATS(TYPE, ...) \
  FASTATTN_DISPATCH_FLOATING(TYPE, "positional_cuda", __VA_ARGS__)

// ---------------------------------------------------------------------------------------------

Tensor sinusoidal_table_cuda(const Tensor& positions, int64_t dim, double base, ScalarType dtype) {
  constexpr const char* op = "sinusoidal_table";
  FASTATTN_CHECK(positions.scalar_type() == kLong, op, "positions must be int64, got ",
                 positions.scalar_type());
  FASTATTN_CHECK(dim >= 1, op, "dim must be >= 1, got ", dim);
  FASTATTN_CHECK(base > 0.0, op, "base must be > 0, got ", base);
  CudaGuard guard(positions);
  auto sizes = positions.sizes().vec();
  sizes.push_back(dim);
  Tensor out = empty(sizes, positions.options().dtype(dtype));
  poison(out);
  if (out.numel() == 0) return out;
  Tensor flat = positions.contiguous();
  const auto launch = row_launch(flat.numel(), dim);
  auto stream = current_cuda_stream();
  FASTATTN_DISPATCH_FLOATS(dtype, [&] {
    sinusoidal_table_kernel<scalar_t><<<launch.grid, launch.block, 0, stream>>>(
        flat.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), dim, std::log2(base));
    FASTATTN_CUDA_LAUNCH_CHECK();
  });
  return out;
}

// out = dropout(x * scale [+ PE]); out is x's layout (a fresh empty_like) or x itself (each
// thread reads its elements before it writes them, so the in-place form is race-free).
void add_sinusoidal_into(const Tensor& x, const Tensor& out, int64_t offset,
                         const optional<Tensor>& offsets, double scale, double base,
                         double dropout_p, const optional<Tensor>& seed, bool add_pe,
                         const char* op) {
  check_add_sinusoidal(x, offsets, base, dropout_p, seed, op);
  CudaGuard guard(x);
  if (x.numel() == 0) return;
  const int64_t N = x.size(0), L = x.size(1), D = x.size(2);
  const auto launch = row_launch(N * L, D);
  auto stream = current_cuda_stream();
  FASTATTN_DISPATCH_FLOATS(x.scalar_type(), [&] {
    using acc = acc_t<scalar_t>;
    const auto drop = make_dropout<acc>(dropout_p, seed);
    const bool aligned =
        aligned4(x.data_ptr(), sizeof(scalar_t), {x.stride(0), x.stride(1)}, D) &&
        aligned4(out.data_ptr(), sizeof(scalar_t), {out.stride(0), out.stride(1)}, D);
    auto kernel =
        aligned ? add_sinusoidal_kernel<scalar_t, true> : add_sinusoidal_kernel<scalar_t, false>;
    kernel<<<launch.grid, launch.block, 0, stream>>>(
        x.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), L, D, x.stride(0), x.stride(1),
        out.stride(0), out.stride(1), offset, optional_ptr(offsets), static_cast<acc>(scale),
        std::log2(base), drop, add_pe);
    FASTATTN_CUDA_LAUNCH_CHECK();
  });
}

Tensor add_sinusoidal_cuda(const Tensor& x, int64_t offset, const optional<Tensor>& offsets,
                           double scale, double base, double dropout_p,
                           const optional<Tensor>& seed) {
  Tensor out = empty_like(x);
  poison(out);
  add_sinusoidal_into(x, out, offset, offsets, scale, base, dropout_p, seed, true,
                      "add_sinusoidal");
  return out;
}

void add_sinusoidal_inplace_cuda(const Tensor& x, int64_t offset, const optional<Tensor>& offsets,
                                 double scale, double base, double dropout_p,
                                 const optional<Tensor>& seed) {
  add_sinusoidal_into(x, x, offset, offsets, scale, base, dropout_p, seed, true, "add_sinusoidal_");
}

Tensor add_sinusoidal_backward_cuda(const Tensor& grad, double scale, double dropout_p,
                                    const optional<Tensor>& seed) {
  Tensor out = empty_like(grad);
  poison(out);
  add_sinusoidal_into(grad, out, 0, std::nullopt, scale, 10000.0, dropout_p, seed, false,
                      "add_sinusoidal_backward");
  return out;
}

Tensor embed_with_positions_cuda(const Tensor& tokens, const Tensor& weight,
                                 const optional<Tensor>& table, int64_t offset,
                                 const optional<Tensor>& offsets, double scale, double base,
                                 double dropout_p, const optional<Tensor>& seed,
                                 int64_t padding_idx, bool deterministic) {
  // padding_idx and deterministic only matter to the backward (they are saved for it).
  (void)padding_idx;
  (void)deterministic;
  constexpr const char* op = "embed_with_positions";
  check_embed(tokens, weight, table, offset, offsets, dropout_p, seed, op);
  CudaGuard guard(weight);
  const int64_t N = tokens.size(0), L = tokens.size(1), D = weight.size(1);
  Tensor out = empty({N, L, D}, weight.options());
  poison(out);
  if (out.numel() == 0) return out;
  Tensor tok = tokens.contiguous();
  const bool has_table = table.has_value() && table->defined();
  const auto launch = row_launch(N * L, D);
  auto stream = current_cuda_stream();
  FASTATTN_DISPATCH_FLOATS(weight.scalar_type(), [&] {
    using acc = acc_t<scalar_t>;
    const auto drop = make_dropout<acc>(dropout_p, seed);
    const bool aligned =
        aligned4(weight.data_ptr(), sizeof(scalar_t), {weight.stride(0)}, D) &&
        (!has_table || aligned4(table->data_ptr(), sizeof(scalar_t), {table->stride(0)}, D)) &&
        aligned4(out.data_ptr(), sizeof(scalar_t), {D}, D);
    auto kernel = aligned ? embed_kernel<scalar_t, true> : embed_kernel<scalar_t, false>;
    kernel<<<launch.grid, launch.block, 0, stream>>>(
        tok.data_ptr<int64_t>(), weight.data_ptr<scalar_t>(), weight.stride(0),
        has_table ? table->data_ptr<scalar_t>() : nullptr, has_table ? table->stride(0) : 0,
        out.data_ptr<scalar_t>(), weight.size(0), L, D, offset, optional_ptr(offsets),
        static_cast<acc>(scale), std::log2(base), drop);
    FASTATTN_CUDA_LAUNCH_CHECK();
  });
  return out;
}

// Converts a compute-type accumulator to the output dtype (no-op when they match).
template <typename T>
Tensor finish_accumulator(const Tensor& accum, const Tensor& like, cudaStream_t stream) {
  if (accum.scalar_type() == like.scalar_type()) return accum;
  Tensor out = empty(accum.sizes(), like.options());
  poison(out);
  const int64_t n = accum.numel();
  if (n > 0) {
    cast_kernel<T><<<static_cast<unsigned>(ceil_div(n, 256)), 256, 0, stream>>>(
        accum.data_ptr<acc_t<T>>(), out.data_ptr<T>(), n);
    FASTATTN_CUDA_LAUNCH_CHECK();
  }
  return out;
}

std::tuple<Tensor, Tensor> embed_with_positions_backward_cuda(
    const Tensor& grad, const Tensor& tokens, int64_t num_weights, int64_t padding_idx,
    int64_t table_rows, int64_t offset, const optional<Tensor>& offsets, double scale,
    double dropout_p, const optional<Tensor>& seed, bool deterministic) {
  constexpr const char* op = "embed_with_positions_backward";
  check_float_dtype(grad, op, "grad");
  FASTATTN_CHECK(grad.dim() == 3 && tokens.dim() == 2 && grad.size(0) == tokens.size(0) &&
                     grad.size(1) == tokens.size(1),
                 op, "grad must be (N, L, D) matching tokens (N, L), got ", grad.sizes(), " and ",
                 tokens.sizes());
  FASTATTN_CHECK(tokens.scalar_type() == kLong, op, "tokens must be int64");
  check_same_device(grad, tokens, op, "grad", "tokens");
  check_offsets(offsets, tokens.size(0), grad, op);
  check_seed(seed, dropout_p, grad, op);
  CudaGuard guard(grad);
  const int64_t N = grad.size(0), L = grad.size(1), D = grad.size(2), rows = N * L;
  const auto acc_dtype = grad.scalar_type() == kDouble ? kDouble : kFloat;
  const bool has_table = table_rows >= 0;
  Tensor weight_acc = zeros({num_weights, D}, grad.options().dtype(acc_dtype));
  Tensor table_acc = zeros({has_table ? table_rows : 0, D}, grad.options().dtype(acc_dtype));
  Tensor g = grad.contiguous();
  Tensor tok = tokens.contiguous();
  auto stream = current_cuda_stream();
  Tensor grad_weight, grad_table;
  FASTATTN_DISPATCH_FLOATS(grad.scalar_type(), [&] {
    using acc = acc_t<scalar_t>;
    const auto drop = make_dropout<acc>(dropout_p, seed);
    if (rows > 0 && D > 0) {
      const auto launch = row_launch(rows, D);
      if (!deterministic) {
        embed_backward_atomic_kernel<scalar_t><<<launch.grid, launch.block, 0, stream>>>(
            g.data_ptr<scalar_t>(), tok.data_ptr<int64_t>(), weight_acc.data_ptr<acc>(),
            has_table ? table_acc.data_ptr<acc>() : nullptr, L, D, padding_idx, offset,
            optional_ptr(offsets), static_cast<acc>(scale), drop);
        FASTATTN_CUDA_LAUNCH_CHECK();
      } else {
        // Weight rows keyed by token (padding rows keyed -1 are skipped).
        const unsigned key_blocks =
            static_cast<unsigned>(std::min<int64_t>((rows + 255) / 256, 4096));
        Tensor keys = tok;
        if (padding_idx >= 0) {
          keys = empty({N, L}, tok.options());
          sort_keys_kernel<<<key_blocks, 256, 0, stream>>>(tok.data_ptr<int64_t>(), padding_idx,
                                                           nullptr, 0, L, rows,
                                                           keys.data_ptr<int64_t>(), nullptr);
          FASTATTN_CUDA_LAUNCH_CHECK();
        }
        auto [sorted, order] = sort(keys.view({rows}), /*stable=*/true, 0, false);
        embed_backward_sorted_kernel<scalar_t><<<launch.grid, launch.block, 0, stream>>>(
            g.data_ptr<scalar_t>(), sorted.data_ptr<int64_t>(), order.data_ptr<int64_t>(), rows, D,
            static_cast<acc>(scale), drop, weight_acc.data_ptr<acc>());
        FASTATTN_CUDA_LAUNCH_CHECK();
        if (has_table) {
          // Position of row (n, l) is offset + offsets[n] + l.
          Tensor pos = empty({N, L}, tok.options());
          sort_keys_kernel<<<key_blocks, 256, 0, stream>>>(nullptr, -1, optional_ptr(offsets),
                                                           offset, L, rows, nullptr,
                                                           pos.data_ptr<int64_t>());
          FASTATTN_CUDA_LAUNCH_CHECK();
          auto [psorted, porder] = sort(pos.view({rows}), /*stable=*/true, 0, false);
          embed_backward_sorted_kernel<scalar_t><<<launch.grid, launch.block, 0, stream>>>(
              g.data_ptr<scalar_t>(), psorted.data_ptr<int64_t>(), porder.data_ptr<int64_t>(), rows,
              D, acc(1), drop, table_acc.data_ptr<acc>());
          FASTATTN_CUDA_LAUNCH_CHECK();
        }
      }
    }
    grad_weight = finish_accumulator<scalar_t>(weight_acc, grad, stream);
    grad_table = finish_accumulator<scalar_t>(table_acc, grad, stream);
  });
  return {grad_weight, grad_table};
}

void apply_rotary_into(const Tensor& x, const Tensor& out, const optional<Tensor>& cos,
                       const optional<Tensor>& sin, int64_t offset, const optional<Tensor>& offsets,
                       const optional<Tensor>& position_ids, int64_t rotary_dim, double base,
                       bool interleaved, bool conjugate, const char* op) {
  check_rotary(x, cos, sin, offset, offsets, position_ids, rotary_dim, base, op);
  if (x.numel() == 0) return;
  CudaGuard guard(x);
  const int64_t B = x.size(0), H = x.size(1), L = x.size(2), D = x.size(3);
  const bool has_table = cos.has_value() && cos->defined();
  const int64_t half = rotary_dim / 2;
  const int threads_x = static_cast<int>(std::min<int64_t>(128, ceil_div(half, 32) * 32));
  const int threads_y =
      static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(H, 256 / threads_x)));
  auto stream = current_cuda_stream();
  FASTATTN_DISPATCH_FLOATS(x.scalar_type(), [&] {
    using acc = acc_t<scalar_t>;
    rotary_kernel<scalar_t>
        <<<static_cast<unsigned>(B * L), dim3(threads_x, threads_y), 0, stream>>>(
            x.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), H, L, D, rotary_dim, x.stride(0),
            x.stride(1), x.stride(2), out.stride(0), out.stride(1), out.stride(2),
            has_table ? cos->data_ptr<acc>() : nullptr, has_table ? sin->data_ptr<acc>() : nullptr,
            has_table ? cos->stride(0) : 0, std::log2(base), offset, optional_ptr(offsets),
            optional_ptr(position_ids), interleaved, conjugate, !out.is_same(x));
    FASTATTN_CUDA_LAUNCH_CHECK();
  });
}

Tensor apply_rotary_cuda(const Tensor& x, const optional<Tensor>& cos, const optional<Tensor>& sin,
                         int64_t offset, const optional<Tensor>& offsets,
                         const optional<Tensor>& position_ids, int64_t rotary_dim, double base,
                         bool interleaved, bool conjugate) {
  Tensor out = empty_like(x);
  poison(out);
  apply_rotary_into(x, out, cos, sin, offset, offsets, position_ids, rotary_dim, base, interleaved,
                    conjugate, "apply_rotary");
  return out;
}

void apply_rotary_inplace_cuda(const Tensor& x, const optional<Tensor>& cos,
                               const optional<Tensor>& sin, int64_t offset,
                               const optional<Tensor>& offsets,
                               const optional<Tensor>& position_ids, int64_t rotary_dim,
                               double base, bool interleaved, bool conjugate) {
  apply_rotary_into(x, x, cos, sin, offset, offsets, position_ids, rotary_dim, base, interleaved,
                    conjugate, "apply_rotary_");
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(fastattn, CUDA, m) {
  m.impl("sinusoidal_table", TORCH_BOX(&sinusoidal_table_cuda));
  m.impl("add_sinusoidal", TORCH_BOX(&add_sinusoidal_cuda));
  m.impl("add_sinusoidal_", TORCH_BOX(&add_sinusoidal_inplace_cuda));
  m.impl("add_sinusoidal_backward", TORCH_BOX(&add_sinusoidal_backward_cuda));
  m.impl("embed_with_positions", TORCH_BOX(&embed_with_positions_cuda));
  m.impl("embed_with_positions_backward", TORCH_BOX(&embed_with_positions_backward_cuda));
  m.impl("apply_rotary", TORCH_BOX(&apply_rotary_cuda));
  m.impl("apply_rotary_", TORCH_BOX(&apply_rotary_inplace_cuda));
}

}  // namespace fastattn::positional
