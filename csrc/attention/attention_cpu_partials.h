// Sums of partial results in a fixed order, so no result depends on the thread count: the
// forward's key splits merged by their lse, the backward's dQ chunks summed in chunk order.
// Inside each ISA copy's namespace.
#pragma once
#include <algorithm>
#include <cmath>
#include <vector>

#include "attention/attention_cpu_scores.h"

#ifndef FASTATTN_ISA
#error "include this header from a kernel compiled through the per-ISA copies (CMakeLists.txt)"
#endif

namespace fastattn::cpu::FASTATTN_ISA {
namespace {

// Merges the kv splits of a forward: out = sum_s exp(lse_s - lse) out_s, lse = log sum_s
// exp(lse_s), from part_o (splits x rows x Dv) and part_lse (splits x rows), rows (b, h, i).
template <typename T, typename acc>
void merge_splits(const AttentionForwardParams& fp, const std::vector<acc>& part_o,
                  const std::vector<acc>& part_lse, int64_t splits, int64_t rows) {
  const AttentionProblem& p = fp.p;
  const int64_t Dv = p.Dv;
  T* O = static_cast<T*>(fp.out);
  acc* LSE = static_cast<acc*>(fp.lse);
  parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<acc> o(Dv);
    for (int64_t row_id = begin; row_id < end; ++row_id) {
      const int64_t i = row_id % p.Lq, bh = row_id / p.Lq, b = bh / p.Hq, h = bh % p.Hq;
      const Geometry g = geometry(p, b);
      if (i >= g.Lq) continue;
      acc mx = neg_inf<acc>();
      for (int64_t sp = 0; sp < splits; ++sp) {
        const acc part = part_lse[sp * rows + row_id];
        mx = std::isnan(part) || part > mx ? part : mx;  // a NaN split's lse makes the row NaN
      }
      std::fill(o.begin(), o.end(), acc(0));
      acc lse = neg_inf<acc>();
      if (mx != neg_inf<acc>()) {
        acc sum = 0;
        for (int64_t sp = 0; sp < splits; ++sp) sum += std::exp(part_lse[sp * rows + row_id] - mx);
        lse = mx + std::log(sum);
        for (int64_t sp = 0; sp < splits; ++sp) {
          const acc w = std::exp(part_lse[sp * rows + row_id] - lse);
          const acc* po = part_o.data() + (sp * rows + row_id) * Dv;
          for (int64_t d = 0; d < Dv; ++d) o[d] += w * po[d];
        }
      }
      LSE[lse_offset(p, g, b, h) + i] = lse;
      store_row<T>(o.data(), O + b * fp.out_s.b + h * fp.out_s.h + (g.q_row0 + i) * fp.out_s.l, Dv);
    }
  });
}

// dQ = sum of the chunks' dQ partials (chunks x rows x D), in chunk order.
template <typename T, typename acc>
void sum_dq_chunks(const AttentionBackwardParams& bp, const std::vector<acc>& dq_acc,
                   int64_t chunks, int64_t rows, int64_t walk) {
  const AttentionProblem& p = bp.p;
  const int64_t D = p.D;
  T* dQ = static_cast<T*>(bp.dq);
  parallel_for(0, walk, 64, [&](int64_t begin, int64_t end) {
    std::vector<acc> sum(D);
    for (int64_t w = begin; w < end; ++w) {
      const int64_t i = w % p.Lq, bh = w / p.Lq, b = bh / p.Hq, h = bh % p.Hq;
      const Geometry g = geometry(p, b);
      if (i >= g.Lq) continue;
      const int64_t r = lse_offset(p, g, b, h) + i;
      std::copy(dq_acc.data() + r * D, dq_acc.data() + (r + 1) * D, sum.begin());
      for (int64_t c = 1; c < chunks; ++c) {
        const acc* part = dq_acc.data() + (c * rows + r) * D;
        for (int64_t d = 0; d < D; ++d) sum[d] += part[d];
      }
      store_row<T>(sum.data(), dQ + b * bp.dq_s.b + h * bp.dq_s.h + (g.q_row0 + i) * bp.dq_s.l, D);
    }
  });
}
}  // namespace
}  // namespace fastattn::cpu::FASTATTN_ISA
