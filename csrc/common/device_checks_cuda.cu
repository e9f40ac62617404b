// Check kernels of common/device_checks.h: argument values validated on the device, no host read.
#include "common/cuda_api.h"

#include <algorithm>
#include <cstdio>
#include <cstring>

#include "common/checks.h"
#include "common/cuda_utils.cuh"
#include "common/device_checks.h"

namespace fastattn::device_checks {
namespace {

// The message travels by value in the kernel's parameters (no allocation, no copy to the device,
// and a CUDA graph captures it with the launch).
struct Message {
  char text[224];
};

Message make_message(const std::string& s) {
  Message m{};
  std::memcpy(m.text, s.data(), std::min(s.size(), sizeof(m.text) - 1));
  return m;
}

constexpr int kThreads = 256;

unsigned blocks_for(int64_t n) {
  return static_cast<unsigned>(std::clamp<int64_t>((n + kThreads - 1) / kThreads, 1, 1024));
}

template <typename T>
__global__ void in_range_kernel(const T* __restrict__ values, int64_t n, int64_t lo, int64_t hi,
                                Message msg) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step) {
    const int64_t v = static_cast<int64_t>(values[i]);
    if (v < lo || v > hi) {
      printf("fastattn: %s; got %lld at index %lld\n", msg.text, static_cast<long long>(v),
             static_cast<long long>(i));
      FASTATTN_DEVICE_ASSERT(false && "fastattn: argument check failed (message printed above)");
    }
  }
}

__global__ void prefix_sums_kernel(const int32_t* __restrict__ cu, int64_t B, int64_t total,
                                   int64_t max_len, Message msg) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i <= B; i += step) {
    const int64_t here = cu[i];
    const int64_t next = i < B ? static_cast<int64_t>(cu[i + 1]) : here;
    const bool ok =
        (i > 0 || here == 0) && (i < B || here == total) && next >= here && next - here <= max_len;
    if (!ok) {
      printf("fastattn: %s; got cu[%lld] = %lld, cu[%lld] = %lld (B = %lld)\n", msg.text,
             static_cast<long long>(i), static_cast<long long>(here),
             static_cast<long long>(i < B ? i + 1 : i), static_cast<long long>(next),
             static_cast<long long>(B));
      FASTATTN_DEVICE_ASSERT(false && "fastattn: argument check failed (message printed above)");
    }
  }
}

}  // namespace

void require_in_range(const Tensor& t, int64_t lo, int64_t hi, const std::string& message) {
  FASTATTN_CHECK(t.is_cuda(), "device_checks::require_in_range", "takes CUDA tensors, got ",
                 t.device());
  const auto dtype = t.scalar_type();
  FASTATTN_CHECK(dtype == kInt || dtype == kLong, "device_checks::require_in_range",
                 "takes int32/int64 tensors, got ", dtype);
  const int64_t n = t.numel();
  if (n == 0) return;
  CudaGuard guard(t);
  const Tensor values = t.contiguous();
  const auto stream = current_cuda_stream();
  const Message msg = make_message(message);
  if (dtype == kInt) {
    in_range_kernel<int32_t>
        <<<blocks_for(n), kThreads, 0, stream>>>(values.data_ptr<int32_t>(), n, lo, hi, msg);
  } else {
    in_range_kernel<int64_t>
        <<<blocks_for(n), kThreads, 0, stream>>>(values.data_ptr<int64_t>(), n, lo, hi, msg);
  }
  FASTATTN_CUDA_LAUNCH_CHECK();
}

void require_prefix_sums(const Tensor& cu, int64_t total, int64_t max_len,
                         const std::string& message) {
  FASTATTN_CHECK(cu.is_cuda() && cu.scalar_type() == kInt && cu.dim() == 1 && cu.numel() >= 1,
                 "device_checks::require_prefix_sums", "takes a CUDA int32 (B+1,) tensor, got ",
                 cu.scalar_type(), " ", cu.sizes(), " on ", cu.device());
  CudaGuard guard(cu);
  const Tensor values = cu.contiguous();
  const int64_t B = cu.numel() - 1;
  const auto stream = current_cuda_stream();
  prefix_sums_kernel<<<blocks_for(B + 1), kThreads, 0, stream>>>(
      values.data_ptr<int32_t>(), B, total, max_len, make_message(message));
  FASTATTN_CUDA_LAUNCH_CHECK();
}

}  // namespace fastattn::device_checks
