// Test support: when poisoning is on (fastattn._C._set_poison, used by the test suite), every
// op fills the outputs it allocates with NaN before its kernel runs, so an element a kernel
// forgets to write shows up as NaN instead of stale memory that happens to look right.
#pragma once
#include "common/tensor_api.h"

#include <atomic>
#include <limits>

namespace fastattn {

std::atomic<bool>& poison_flag();  // defined in csrc/bindings.cpp

inline void poison(const Tensor& t) {
  if (poison_flag().load(std::memory_order_relaxed) && t.defined() && t.numel() > 0 &&
      t.is_floating_point()) {
    t.fill_(std::numeric_limits<double>::quiet_NaN());
  }
}

}  // namespace fastattn
