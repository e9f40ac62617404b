// The CPU body of fastattn::apply_rotary, for other CPU op bodies to call directly: through
// the dispatcher the op's autograd kernel is fastattn's Python one, which costs more than a
// decoding step's rotation (attention_with_kvcache_cpu.cpp).
#pragma once
#include "common/tensor_api.h"

#include <optional>

namespace fastattn::positional {

// x (B, H, L, D) with its first rotary_dim features rotated (a new tensor): the arguments and
// checks of fastattn::apply_rotary (fastattn/ops/positional.py).
Tensor apply_rotary_cpu(const Tensor& x, const std::optional<Tensor>& cos,
                        const std::optional<Tensor>& sin, int64_t offset,
                        const std::optional<Tensor>& offsets,
                        const std::optional<Tensor>& position_ids, int64_t rotary_dim, double base,
                        bool interleaved, bool conjugate);

}  // namespace fastattn::positional
