// The CUDA half of fastattn's tensor vocabulary (common/tensor_api.h) for the .cu op bodies, on
// libtorch's stable ABI: a device guard, torch's current stream of a device, CUDA error checks.
// USE_CUDA (set by CMakeLists.txt for CUDA builds) declares the shim's CUDA functions.
#pragma once
#include <cuda_runtime_api.h>
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/accelerator.h>

#include "common/tensor_api.h"

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

namespace fastattn {

// Makes t's device current for the scope (c10::cuda::CUDAGuard's role).
class CudaGuard {
 public:
  explicit CudaGuard(const Tensor& t) : guard_(t.get_device_index()) {}

 private:
  torch::stable::accelerator::DeviceGuard guard_;
};

// torch's current stream on device `device_index` (kernels queue there, as torch's own do).
inline cudaStream_t current_cuda_stream(int32_t device_index) {
  void* stream = nullptr;
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_current_cuda_stream(device_index, &stream));
  return static_cast<cudaStream_t>(stream);
}
inline cudaStream_t current_cuda_stream(const Tensor& t) {
  return current_cuda_stream(static_cast<int32_t>(t.get_device_index()));
}

}  // namespace fastattn
