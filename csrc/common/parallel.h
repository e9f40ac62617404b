// Parallel loops on torch's intra-op thread pool through libtorch's stable ABI, for the kernel
// files too. The kernels are compiled once per x86 ISA (CMakeLists.txt), so this header holds
// declarations and a template only: an inline function shared by those copies would be linked
// once, possibly in its AVX-512 build, and run on CPUs without AVX-512. The two functions are
// defined in common/parallel_cpu.cpp (base ISA).
#pragma once
#include <cstdint>

namespace fastattn {

// fn(begin, end, ctx) on chunks of [begin, end) of at least grain_size, on torch's threads (at::
// parallel_for's semantics: serial inside a parallel region).
void parallel_for_chunks(int64_t begin, int64_t end, int64_t grain_size,
                         void (*fn)(int64_t, int64_t, void*), void* ctx);
// torch's intra-op thread count (torch.get_num_threads()).
int64_t get_num_threads();

template <class F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain_size, const F& f) {
  parallel_for_chunks(
      begin, end, grain_size,
      [](int64_t lo, int64_t hi, void* ctx) { (*static_cast<const F*>(ctx))(lo, hi); },
      const_cast<void*>(static_cast<const void*>(&f)));
}

}  // namespace fastattn
