// The CUDA half of fastattn's tensor vocabulary (common/tensor_api.h) for the .cu op bodies, on
// libtorch's stable ABI: a device guard, torch's current stream of a device, CUDA error checks.
// USE_CUDA (set by CMakeLists.txt for CUDA builds) declares the shim's CUDA functions.
#pragma once
#include <cuda_runtime_api.h>
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/accelerator.h>

#include "common/cuda_utils.cuh"  // FASTATTN_CUDA_CHECK, FASTATTN_CUDA_LAUNCH_CHECK
#include "common/tensor_api.h"

namespace fastattn {

// Makes t's device current for the scope (c10::cuda::CUDAGuard's role).
class CudaGuard {
 public:
  explicit CudaGuard(const Tensor& t) : guard_(t.get_device_index()) {}

 private:
  torch::stable::accelerator::DeviceGuard guard_;
};

// torch's current stream on device `device_index` (-1: the current device; kernels queue there,
// as torch's own do).
inline cudaStream_t current_cuda_stream(int32_t device_index = -1) {
  void* stream = nullptr;
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_current_cuda_stream(device_index, &stream));
  return static_cast<cudaStream_t>(stream);
}
inline cudaStream_t current_cuda_stream(const Tensor& t) {
  return current_cuda_stream(static_cast<int32_t>(t.get_device_index()));
}

}  // namespace fastattn
