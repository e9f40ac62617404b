// Small helpers shared by the CUDA kernels: dtype conversion, debug bounds checks, launch checks.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>
#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Half.h>

#include <cassert>

#include "common/check.h"

// A device-side assert that holds in release builds too (assert() is gone under NDEBUG): a
// failure stops the kernel and leaves the CUDA context in error, as torch's CUDA_KERNEL_ASSERT.
#define FASTATTN_DEVICE_ASSERT(cond)                                                        \
  do {                                                                                      \
    if (!(cond)) __assert_fail(#cond, __FILE__, static_cast<unsigned>(__LINE__), __func__); \
  } while (0)

// Bounds checks inside kernels, compiled in with FASTATTN_DEBUG_CHECKS=1 (setup.py).
#if defined(FASTATTN_DEBUG_CHECKS)
#define FASTATTN_DEVICE_CHECK(cond) FASTATTN_DEVICE_ASSERT(cond)
#else
#define FASTATTN_DEVICE_CHECK(cond) ((void)0)
#endif

// A failed CUDA runtime call raises RuntimeError naming the call and CUDA's error.
#define FASTATTN_CUDA_CHECK(expr)                                                             \
  do {                                                                                        \
    const cudaError_t fastattn_cuda_err_ = (expr);                                            \
    if (fastattn_cuda_err_ != cudaSuccess) {                                                  \
      throw std::runtime_error(                                                               \
          ::fastattn::detail::message("CUDA error: ", cudaGetErrorString(fastattn_cuda_err_), \
                                      " (", #expr, " at ", __FILE__, ":", __LINE__, ")"));    \
    }                                                                                         \
  } while (0)

// Every launch is followed by this: a bad configuration fails at the call, not later.
#define FASTATTN_CUDA_LAUNCH_CHECK()                                                            \
  do {                                                                                          \
    const cudaError_t fastattn_launch_err_ = cudaGetLastError();                                \
    if (fastattn_launch_err_ != cudaSuccess) {                                                  \
      throw std::runtime_error(                                                                 \
          ::fastattn::detail::message("CUDA error: ", cudaGetErrorString(fastattn_launch_err_), \
                                      " (kernel launch at ", __FILE__, ":", __LINE__, ")"));    \
    }                                                                                           \
  } while (0)

namespace fastattn::cuda {

template <typename T>
struct AccType {
  using type = float;
};
template <>
struct AccType<double> {
  using type = double;
};
template <typename T>
using acc_t = typename AccType<T>::type;

template <typename T>
__device__ __forceinline__ acc_t<T> to_acc(T v) {
  return static_cast<acc_t<T>>(v);
}
template <>
__device__ __forceinline__ float to_acc<c10::Half>(c10::Half v) {
  return __half2float(*reinterpret_cast<const __half*>(&v));
}
template <>
__device__ __forceinline__ float to_acc<c10::BFloat16>(c10::BFloat16 v) {
  return __bfloat162float(*reinterpret_cast<const __nv_bfloat16*>(&v));
}

template <typename T>
__device__ __forceinline__ T from_acc(acc_t<T> v) {
  return static_cast<T>(v);
}
template <>
__device__ __forceinline__ c10::Half from_acc<c10::Half>(float v) {
  const __half h = __float2half_rn(v);
  return *reinterpret_cast<const c10::Half*>(&h);
}
template <>
__device__ __forceinline__ c10::BFloat16 from_acc<c10::BFloat16>(float v) {
  const __nv_bfloat16 h = __float2bfloat16_rn(v);
  return *reinterpret_cast<const c10::BFloat16*>(&h);
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Blocks of a 1-D grid. Grid x holds up to 2^31 - 1 blocks but y and z only 65535, so launches
// whose batch or tile counts can grow fold them into x and decode them in the kernel; beyond
// x's limit the call is refused, naming the op and the product of sizes that `blocks` is.
constexpr int64_t kMaxGridX = 2147483647;

inline unsigned grid_x(int64_t blocks, const char* op, const char* what) {
  FASTATTN_CHECK(blocks >= 1 && blocks <= kMaxGridX, op, what, " = ", blocks,
                 " CUDA blocks, outside a grid's [1, 2^31 - 1]");
  return static_cast<unsigned>(blocks);
}

}  // namespace fastattn::cuda
