// Checks of argument values that live in device memory (token ids, positions, cache lengths,
// cu_seqlens) made without reading them on the host: a host read (.item()) would synchronise
// the stream on every call and make the op impossible to capture in a CUDA graph. Each check is
// one small kernel on the current stream; a value that breaks the rule prints the message (op,
// argument, rule) with the value and its index, then fails a device-side assert, so the op's
// kernels queued after it on the stream never run (the CUDA context is left in error, as after
// an out-of-range index in torch's own kernels). CPU bodies check the same rules on the host.
// Defined in device_checks_cuda.cu: CUDA builds only (FASTATTN_WITH_CUDA).
#pragma once
#include "common/tensor_api.h"

#include <string>

namespace fastattn::device_checks {

// Every value v of t (int32 or int64, any shape) satisfies lo <= v <= hi.
void require_in_range(const Tensor& t, int64_t lo, int64_t hi, const std::string& message);

// cu: int32 (B+1,) prefix sums: cu[0] == 0, cu[B] == total, 0 <= cu[b+1] - cu[b] <= max_len.
void require_prefix_sums(const Tensor& cu, int64_t total, int64_t max_len,
                         const std::string& message);

}  // namespace fastattn::device_checks
