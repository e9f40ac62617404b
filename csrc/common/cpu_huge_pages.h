// Transparent huge pages for large fresh CPU outputs. A fresh multi-MiB tensor comes from mmap,
// and writing it first takes one page fault per 4 KiB page: for a 32 MiB output 8192 faults,
// which cost more than the kernel that fills it. Advising the 2 MiB-aligned part of the buffer
// as MADV_HUGEPAGE (where the system's THP mode is "madvise" or "always") turns them into one
// fault per 2 MiB. PyTorch does the same for every CPU allocation when THP_MEM_ALLOC_ENABLE=1.
#pragma once
#include "common/tensor_api.h"

#include <cstdint>
#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace fastattn::cpu {

// out: a freshly allocated CPU tensor (its whole storage is advised). Advice only: errors (no
// THP support, THP "never") leave the buffer as it was.
inline void advise_huge_pages(const Tensor& out) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t(1) << 21;
  constexpr size_t kMinBytes = size_t(4) << 20;  // smaller buffers: not worth a system call
  if (!out.defined() || !out.is_cpu() || out.storage_offset() != 0) return;
  const size_t bytes = out.nbytes();
  if (bytes < kMinBytes) return;
  const auto begin = reinterpret_cast<uintptr_t>(out.data_ptr());
  const uintptr_t first = (begin + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t last = (begin + static_cast<uintptr_t>(bytes)) & ~(kHuge - 1);
  if (last > first) madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);
#else
  (void)out;
#endif
}

}  // namespace fastattn::cpu
