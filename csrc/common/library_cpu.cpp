// The fastattn op library (STABLE_TORCH_LIBRARY, libtorch's stable ABI) with the schemas of
// op_schemas.h, and the poisoning switch of the CPU op bodies (common/debug.h). CPU bodies
// register themselves in csrc/<op>/<op>_cpu.cpp (STABLE_TORCH_LIBRARY_IMPL); CUDA bodies, in
// csrc/<op>/<op>_cuda.cu, are the second library fastattn/_C_cuda.so
// (common/cuda_library.cu).
#include <atomic>

#include "common/debug.h"
#include "common/tensor_api.h"
#include "op_schemas.h"

STABLE_TORCH_LIBRARY(fastattn, m) { fastattn::schemas::define_all(m); }

namespace fastattn {
std::atomic<bool>& poison_flag() {
  static std::atomic<bool> flag{false};
  return flag;
}
}  // namespace fastattn
