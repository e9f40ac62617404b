// What fastattn/_C_cuda.so (the CUDA op bodies, csrc/<op>/<op>_cuda.cu) has of its own besides
// its kernels: fastattn._C keeps the op library, the CPU kernels and the build report, and is
// loaded first (fastattn/_native.py); this library is loaded only when torch has CUDA, so a
// CPU-only torch never needs libtorch_cuda.
#include <atomic>

#include "common/debug.h"

namespace fastattn {
std::atomic<bool>& poison_flag() {
  static std::atomic<bool> flag{false};
  return flag;
}
}  // namespace fastattn

// Tests: the poisoning switch of this library's ops (fastattn._native.set_poison).
extern "C" __attribute__((visibility("default"))) void fastattn_cuda_set_poison(bool on) {
  fastattn::poison_flag().store(on);
}
