// common/parallel.h on the stable API (compiled once, for the base ISA).
#include "common/parallel.h"

#include "common/tensor_api.h"

namespace fastattn {

void parallel_for_chunks(int64_t begin, int64_t end, int64_t grain_size,
                         void (*fn)(int64_t, int64_t, void*), void* ctx) {
  if (begin >= end) return;
  TORCH_ERROR_CODE_CHECK(torch_parallel_for(begin, end, grain_size, fn, ctx));
}

int64_t get_num_threads() { return static_cast<int64_t>(torch::stable::get_num_threads()); }

}  // namespace fastattn
