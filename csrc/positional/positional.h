// Argument checks of the positional-encoding ops, shared by the CPU and CUDA op bodies.
// The Python layer (fastattn/ops/positional.py) checks the same rules first with friendlier
// messages; these guard direct calls of torch.ops.fastattn.*.
#pragma once
#include "common/tensor_api.h"

#include <limits>
#include <string>

#include "common/checks.h"
#if defined(FASTATTN_WITH_CUDA)
#include "common/device_checks.h"
#endif

namespace fastattn::positional {

// offsets: optional int64 (N,) per-sequence start positions.
inline void check_offsets(const std::optional<Tensor>& offsets, int64_t N, const Tensor& like,
                          const char* op) {
  if (!offsets.has_value() || !offsets->defined()) return;
  FASTATTN_CHECK(offsets->scalar_type() == kLong, op, "offsets must be int64, got ",
                 offsets->scalar_type());
  FASTATTN_CHECK(offsets->dim() == 1 && offsets->size(0) == N && offsets->is_contiguous(), op,
                 "offsets must be a contiguous (", N, ",) tensor, got ", offsets->sizes());
  check_same_device(*offsets, like, op, "offsets", "the input");
}

// Values of integer tensors (token ids, offsets, position ids) are read on the host only for
// CPU tensors: there it costs no synchronisation and the error names the values. CUDA tensors
// are checked by a kernel on the device (common/device_checks.h), which keeps the ops free of
// host synchronisation and capturable in CUDA graphs.

// [min, max] of an integer CPU tensor.
inline std::pair<int64_t, int64_t> host_value_range(const Tensor& t) {
  FASTATTN_CHECK(t.is_cpu(), "host_value_range", "reads CPU tensors only");
  auto [lo, hi] = aminmax(t);
  return {lo.item<int64_t>(), hi.item<int64_t>()};
}

// Every value of the non-CPU tensor t lies in [lo, hi], checked on its device.
inline void require_in_range_on_device(const Tensor& t, int64_t lo, int64_t hi, const char* op,
                                       const std::string& rule) {
#if defined(FASTATTN_WITH_CUDA)
  device_checks::require_in_range(t, lo, hi, std::string(op) + ": " + rule);
#else
  // The CPU op bodies (fastattn._C) are built without the device checks, which live in the
  // CUDA kernels' library; they never see a CUDA tensor (the dispatcher routes those there).
  FASTATTN_CHECK(false, op, "cannot check ", rule, " for a tensor on ", t.device(),
                 " (a CPU op body)");
#endif
}

// Every position offset + offsets[n] + l (l < L) must be >= 0, and < rows when rows >= 0.
inline void check_position_range(int64_t offset, const std::optional<Tensor>& offsets, int64_t L,
                                 int64_t rows, const char* op, const char* what) {
  const bool per_sequence = offsets.has_value() && offsets->defined() && offsets->numel() > 0;
  if (per_sequence && !offsets->is_cpu()) {
    FASTATTN_CHECK(rows < 0 || L <= rows, op, "positions reach at least ", L - 1, " but ", what,
                   " has ", rows, " rows");
    const int64_t hi = rows >= 0 ? rows - L - offset : std::numeric_limits<int64_t>::max();
    const std::string rule =
        "positions offset + offsets[b] + l (offset = " + std::to_string(offset) + ", l < " +
        std::to_string(L) + ") must be " +
        (rows >= 0 ? "in [0, " + std::to_string(rows) + ") (the rows of " + what + ")"
                   : std::string(">= 0"));
    require_in_range_on_device(*offsets, -offset, hi, op, rule + "; offsets[b]");
    return;
  }
  int64_t lo = offset, hi = offset;
  if (per_sequence) {
    auto [omin, omax] = host_value_range(*offsets);
    lo += omin;
    hi += omax;
  }
  FASTATTN_CHECK(lo >= 0, op, "positions must be >= 0, got a smallest position of ", lo);
  if (rows >= 0) {
    FASTATTN_CHECK(hi + L <= rows, op, "positions reach ", hi + L - 1, " but ", what, " has ", rows,
                   " rows");
  }
}

inline void check_add_sinusoidal(const Tensor& x, const std::optional<Tensor>& offsets, double base,
                                 double dropout_p, const std::optional<Tensor>& seed,
                                 const char* op) {
  check_float_dtype(x, op, "x");
  FASTATTN_CHECK(x.dim() == 3, op, "x must be 3-D (N, L, D), got ", x.sizes());
  check_unit_last_stride(x, op, "x");
  FASTATTN_CHECK(base > 0.0, op, "base must be > 0, got ", base);
  check_offsets(offsets, x.size(0), x, op);
  check_seed(seed, dropout_p, x, op);
}

inline void check_embed(const Tensor& tokens, const Tensor& weight,
                        const std::optional<Tensor>& table, int64_t offset,
                        const std::optional<Tensor>& offsets, double dropout_p,
                        const std::optional<Tensor>& seed, const char* op) {
  FASTATTN_CHECK(tokens.scalar_type() == kLong, op, "tokens must be int64, got ",
                 tokens.scalar_type());
  FASTATTN_CHECK(tokens.dim() == 2, op, "tokens must be 2-D (N, L), got ", tokens.sizes());
  check_float_dtype(weight, op, "weight");
  FASTATTN_CHECK(weight.dim() == 2, op, "weight must be 2-D (num_embeddings, D), got ",
                 weight.sizes());
  check_unit_last_stride(weight, op, "weight");
  check_same_device(tokens, weight, op, "tokens", "weight");
  if (table.has_value() && table->defined()) {
    FASTATTN_CHECK(table->scalar_type() == weight.scalar_type(), op,
                   "the positions table must have weight's dtype ", weight.scalar_type(), ", got ",
                   table->scalar_type());
    FASTATTN_CHECK(table->dim() == 2 && table->size(1) == weight.size(1), op,
                   "the positions table must be (max_len, ", weight.size(1), "), got ",
                   table->sizes());
    check_unit_last_stride(*table, op, "positions");
    check_same_device(*table, weight, op, "positions", "weight");
  }
  check_offsets(offsets, tokens.size(0), weight, op);
  check_seed(seed, dropout_p, weight, op);
  if (tokens.numel() > 0) {
    if (tokens.is_cpu()) {
      auto [lo, hi] = host_value_range(tokens);
      FASTATTN_CHECK(lo >= 0 && hi < weight.size(0), op, "token ids must be in [0, ",
                     weight.size(0), "), got ids from ", lo, " to ", hi);
    } else {
      require_in_range_on_device(
          tokens, 0, weight.size(0) - 1, op,
          "token ids must be in [0, " + std::to_string(weight.size(0)) + "); tokens");
    }
    check_position_range(offset, offsets, tokens.size(1),
                         table.has_value() && table->defined() ? table->size(0) : -1, op,
                         "the positions table");
  }
}

// cos/sin: (P, rotary_dim / 2) tables in the compute type; position_ids (B, L) int64.
inline void check_rotary(const Tensor& x, const std::optional<Tensor>& cos,
                         const std::optional<Tensor>& sin, int64_t offset,
                         const std::optional<Tensor>& offsets,
                         const std::optional<Tensor>& position_ids, int64_t rotary_dim, double base,
                         const char* op) {
  check_float_dtype(x, op, "x");
  FASTATTN_CHECK(x.dim() == 4, op, "x must be 4-D (B, H, L, D), got ", x.sizes());
  check_unit_last_stride(x, op, "x");
  const int64_t D = x.size(3);
  FASTATTN_CHECK(rotary_dim > 0 && rotary_dim % 2 == 0 && rotary_dim <= D, op,
                 "rotary_dim must be even and in [2, ", D, "], got ", rotary_dim);
  const bool has_cos = cos.has_value() && cos->defined();
  const bool has_sin = sin.has_value() && sin->defined();
  FASTATTN_CHECK(has_cos == has_sin, op, "cos and sin must be given together");
  const auto compute = x.scalar_type() == kDouble ? kDouble : kFloat;
  int64_t rows = -1;
  if (has_cos) {
    for (const auto* t : {&*cos, &*sin}) {
      FASTATTN_CHECK(t->scalar_type() == compute, op, "cos/sin must be ", compute,
                     " here (the op converts them), got ", t->scalar_type());
      FASTATTN_CHECK(t->dim() == 2 && t->size(1) == rotary_dim / 2 && t->is_contiguous(), op,
                     "cos/sin must be contiguous (max_position, rotary_dim / 2 = ", rotary_dim / 2,
                     "), got ", t->sizes());
      check_same_device(*t, x, op, "cos/sin", "x");
    }
    FASTATTN_CHECK(cos->sizes() == sin->sizes(), op, "cos and sin must have the same shape, got ",
                   cos->sizes(), " and ", sin->sizes());
    rows = cos->size(0);
  } else {
    FASTATTN_CHECK(base > 0.0, op, "base must be > 0, got ", base);
  }
  if (position_ids.has_value() && position_ids->defined()) {
    const auto& ids = *position_ids;
    FASTATTN_CHECK(ids.scalar_type() == kLong, op, "position_ids must be int64, got ",
                   ids.scalar_type());
    FASTATTN_CHECK(ids.dim() == 2 && ids.size(0) == x.size(0) && ids.size(1) == x.size(2) &&
                       ids.is_contiguous(),
                   op, "position_ids must be contiguous (B, L) = (", x.size(0), ", ", x.size(2),
                   "), got ", ids.sizes());
    check_same_device(ids, x, op, "position_ids", "x");
    if (ids.numel() > 0 && ids.is_cpu()) {
      auto [lo, hi] = host_value_range(ids);
      FASTATTN_CHECK(lo >= 0, op, "position_ids must be >= 0, got ", lo);
      FASTATTN_CHECK(rows < 0 || hi < rows, op, "position_ids reach ", hi, " but cos/sin have ",
                     rows, " rows");
    } else if (ids.numel() > 0) {
      require_in_range_on_device(
          ids, 0, rows >= 0 ? rows - 1 : std::numeric_limits<int64_t>::max(), op,
          rows >= 0 ? "position_ids must be in [0, " + std::to_string(rows) + ") (cos/sin rows)"
                    : std::string("position_ids must be >= 0"));
    }
  } else {
    check_offsets(offsets, x.size(0), x, op);
    if (x.numel() > 0) check_position_range(offset, offsets, x.size(2), rows, op, "cos/sin");
  }
}

}  // namespace fastattn::positional
