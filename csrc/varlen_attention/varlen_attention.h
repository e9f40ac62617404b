// Argument checks of the packed variable-length attention ops, shared by the CPU and CUDA op
// bodies (and the CUDA emulator): one check per rule, whatever the device. The values of
// cu_seqlens are checked where they live: on the host by the CPU bodies
// (check_cu_seqlens_on_host), on the device by the CUDA ones (common/device_checks.h).
#pragma once
#include "common/tensor_api.h"

#include <utility>

#include "attention/attention.h"
#include "common/checks.h"

namespace fastattn::varlen_attention {

using std::optional;

// q (total_q, Hq, D), k (total_k, Hkv, D), v (total_k, Hkv, Dv) of one dtype and device with
// unit last strides; cu_seqlens contiguous int32 (B+1,) on q's device; max_seqlen in
// [0, 2^30) and >= 1 when there are rows; alibi_slopes float32 (B, Hq); the dropout seed.
inline void check_varlen(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& cu_q,
                         const Tensor& cu_k, int64_t max_q, int64_t max_k,
                         const optional<Tensor>& alibi, double dropout_p,
                         const optional<Tensor>& seed, const char* op) {
  check_float_dtype(q, op, "q");
  FASTATTN_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, op,
                 "q, k and v must be packed (total, H, D), got ", q.sizes(), ", ", k.sizes(), ", ",
                 v.sizes());
  FASTATTN_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(), op,
                 "q, k and v must have the same dtype, got ", q.scalar_type(), ", ",
                 k.scalar_type(), ", ", v.scalar_type());
  check_same_device(q, k, op, "q", "k");
  check_same_device(q, v, op, "q", "v");
  FASTATTN_CHECK(k.size(1) == v.size(1) && k.size(1) > 0 && q.size(1) % k.size(1) == 0, op,
                 "q's heads must be a multiple of k/v's heads, got ", q.size(1), " and ",
                 k.size(1));
  FASTATTN_CHECK(k.size(2) == q.size(2), op, "q and k must have the same head dim, got ", q.size(2),
                 " and ", k.size(2));
  FASTATTN_CHECK(k.size(0) == v.size(0), op, "k and v must have the same total length, got ",
                 k.size(0), " and ", v.size(0));
  FASTATTN_CHECK(q.size(2) >= 1 && q.size(2) <= attention::kMaxHeadDim && v.size(2) >= 1 &&
                     v.size(2) <= attention::kMaxHeadDim,
                 op, "head dims must be in [1, ", attention::kMaxHeadDim, "], got ", q.size(2),
                 " and ", v.size(2));
  check_unit_last_stride(q, op, "q");
  check_unit_last_stride(k, op, "k");
  check_unit_last_stride(v, op, "v");
  for (const auto& [t, name] : {std::pair<const Tensor*, const char*>{&cu_q, "cu_seqlens_q"},
                                std::pair<const Tensor*, const char*>{&cu_k, "cu_seqlens_k"}}) {
    FASTATTN_CHECK(
        t->scalar_type() == kInt && t->dim() == 1 && t->numel() >= 1 && t->is_contiguous(), op,
        name, " must be a contiguous int32 (B+1,) tensor, got ", t->scalar_type(), " ", t->sizes());
    check_same_device(*t, q, op, name, "q");
  }
  FASTATTN_CHECK(cu_q.numel() == cu_k.numel(), op,
                 "cu_seqlens_q and cu_seqlens_k must have the same length B+1, got ", cu_q.numel(),
                 " and ", cu_k.numel());
  FASTATTN_CHECK(max_q >= 0 && max_k >= 0, op, "max_seqlen_q and max_seqlen_k must be >= 0, got ",
                 max_q, " and ", max_k);
  attention::check_seqlen(max_q, op, "max_seqlen_q");
  attention::check_seqlen(max_k, op, "max_seqlen_k");
  // A non-empty packed tensor has a sequence of length >= 1 (the kernels' grids cover
  // max_seqlen tiles).
  FASTATTN_CHECK((q.size(0) == 0 || max_q >= 1) && (k.size(0) == 0 || max_k >= 1), op,
                 "max_seqlen_q/max_seqlen_k must be >= 1 when q/k have rows, got ", max_q, " and ",
                 max_k);
  if (alibi.has_value() && alibi->defined()) {
    FASTATTN_CHECK(alibi->scalar_type() == kFloat && alibi->dim() == 2 &&
                       alibi->size(0) == cu_q.numel() - 1 && alibi->size(1) == q.size(1),
                   op, "alibi_slopes must be float32 (B, Hq) = (", cu_q.numel() - 1, ", ",
                   q.size(1), "), got ", alibi->scalar_type(), " ", alibi->sizes());
    check_same_device(*alibi, q, op, "alibi_slopes", "q");
  }
  check_seed(seed, dropout_p, q, op);
}

// varlen_attention_backward's arguments: the forward's (check_varlen), then grad_out and out
// (total_q, Hq, Dv) in q's dtype with unit last strides, lse a contiguous (Hq, total_q) tensor
// of lse_dtype, grad_lse (when given) (Hq, total_q); all on q's device.
inline void check_varlen_backward(const Tensor& grad_out, const optional<Tensor>& grad_lse,
                                  const Tensor& q, const Tensor& k, const Tensor& v,
                                  const Tensor& out, const Tensor& lse, const Tensor& cu_q,
                                  const Tensor& cu_k, int64_t max_q, int64_t max_k,
                                  const optional<Tensor>& alibi, double dropout_p,
                                  const optional<Tensor>& seed, const char* op) {
  check_varlen(q, k, v, cu_q, cu_k, max_q, max_k, alibi, dropout_p, seed, op);
  FASTATTN_CHECK(out.dim() == 3 && out.size(0) == q.size(0) && out.size(1) == q.size(1) &&
                     out.size(2) == v.size(2) && grad_out.sizes() == out.sizes(),
                 op, "grad_out and out must be (total_q, Hq, Dv) = (", q.size(0), ", ", q.size(1),
                 ", ", v.size(2), "), got ", grad_out.sizes(), " and ", out.sizes());
  FASTATTN_CHECK(grad_out.scalar_type() == q.scalar_type() && out.scalar_type() == q.scalar_type(),
                 op, "grad_out and out must have q's dtype ", q.scalar_type(), ", got ",
                 grad_out.scalar_type(), " and ", out.scalar_type());
  check_same_device(grad_out, q, op, "grad_out", "q");
  check_same_device(out, q, op, "out", "q");
  check_same_device(lse, q, op, "lse", "q");
  check_unit_last_stride(grad_out, op, "grad_out");
  check_unit_last_stride(out, op, "out");
  const auto lse_type = attention::lse_dtype(q);
  FASTATTN_CHECK(lse.scalar_type() == lse_type && lse.is_contiguous() && lse.dim() == 2 &&
                     lse.size(0) == q.size(1) && lse.size(1) == q.size(0),
                 op, "lse must be a contiguous ", lse_type, " (Hq, total_q) = (", q.size(1), ", ",
                 q.size(0), ") tensor, got ", lse.scalar_type(), " ", lse.sizes());
  if (grad_lse.has_value() && grad_lse->defined()) {
    check_same_device(*grad_lse, q, op, "grad_lse", "q");
    FASTATTN_CHECK(grad_lse->sizes() == lse.sizes(), op, "grad_lse must be (Hq, total_q), got ",
                   grad_lse->sizes());
  }
}

// The values of CPU cu_seqlens (which check_varlen has checked for dtype, shape and device):
// prefix sums from 0 to the packed lengths, each step at most max_seqlen. The CUDA bodies
// check the same rules on the device.
inline void check_cu_seqlens_on_host(const Tensor& q, const Tensor& k, const Tensor& cu_q,
                                     const Tensor& cu_k, int64_t max_q, int64_t max_k,
                                     const char* op) {
  const int32_t* cq = cu_q.data_ptr<int32_t>();
  const int32_t* ck = cu_k.data_ptr<int32_t>();
  const int64_t B = cu_q.numel() - 1;
  FASTATTN_CHECK(cq[0] == 0 && ck[0] == 0, op, "cu_seqlens must start at 0");
  for (int64_t b = 0; b < B; ++b) {
    FASTATTN_CHECK(cq[b + 1] >= cq[b] && ck[b + 1] >= ck[b], op,
                   "cu_seqlens must be non-decreasing");
    FASTATTN_CHECK(cq[b + 1] - cq[b] <= max_q && ck[b + 1] - ck[b] <= max_k, op,
                   "a sequence is longer than max_seqlen_q/max_seqlen_k");
  }
  FASTATTN_CHECK(cq[B] == q.size(0) && ck[B] == k.size(0), op,
                 "cu_seqlens must end at the packed lengths (", q.size(0), ", ", k.size(0),
                 "), got ", cq[B], " and ", ck[B]);
}

}  // namespace fastattn::varlen_attention
