// The forward with key-major score tiles, for the ISA copies with VecF (common/cpu_vec.h).
//
// A task (one query head, one block of kBlockQ queries) holds S^T = scale log2(e) K Q^T: the
// keys of a tile as rows, its queries along the vector lanes. The micro-kernel broadcasts from
// K's rows in place and S^T is already the k-major A operand of P V, so no tile is transposed
// (forward_impl's query-major tiles transpose K and P, every tile). The online softmax runs down
// the columns, elementwise across lanes (no horizontal reductions), in log2 units with the short
// exponential. Plain scores only: softcap, ALiBi, masks, key padding and dropout are row-wise
// stages of the score pipeline and stay with forward_impl; the band (causal, windows) is
// applied here. Measurements: docs/design/cpu_kernels.md ("Key-major forward tiles").
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <type_traits>

#include "attention/attention_cpu_kernel.h"
#include "attention/attention_cpu_scores.h"
#include "common/check.h"
#include "common/cpu_convert.h"
#include "common/cpu_gemm.h"
#include "common/cpu_math.h"
#include "common/cpu_vec.h"
#include "common/parallel.h"

#ifndef FASTATTN_ISA
#error "include this header from a kernel compiled through the per-ISA copies (CMakeLists.txt)"
#endif

namespace fastattn::cpu::FASTATTN_ISA {
namespace {

#if defined(FASTATTN_CPU_VEC)
// Whether key_major_forward computes p: dense K / V, no row-wise score stage, no split keys,
// and at least one full block of queries (fewer would fill a fraction of the lanes: decoding
// and short prompts keep forward_impl's streamed tiles).
inline bool key_major_forward_fits(const AttentionProblem& p) {
  return p.block_table == nullptr && p.mask_kind == MaskKind::none && p.key_padding == nullptr &&
         p.alibi == nullptr && p.softcap <= 0.0 && p.dropout_p <= 0.0 && p.kv_splits <= 1 &&
         p.Lq >= kBlockQ;
}

// A task's tiles, 64-byte aligned (a 32-byte vector never straddles a cache line): Q^T (D x
// kBlockQ), S^T (kBlockK x kBlockQ), the output rows (kBlockQ x Dv), and the float copies of
// 16-bit Q, K, V rows; the per-query softmax state.
struct KeyMajorTiles {
  float *qT, *st, *o, *q_rows, *k_rows, *v_rows;
  alignas(64) float m[kBlockQ], l[kBlockQ], alpha[kBlockQ];
  float* block;

  KeyMajorTiles(int64_t D, int64_t Dv, bool convert) {
    const int64_t sizes[6] = {D * kBlockQ,
                              kBlockK * kBlockQ,
                              kBlockQ * Dv,
                              convert ? kBlockQ * D : 0,
                              convert ? kBlockK * D : 0,
                              convert ? kBlockK * Dv : 0};
    int64_t total = 0;
    for (int64_t n : sizes) total += (n + 15) / 16 * 16;
    block = static_cast<float*>(std::aligned_alloc(64, total * 4));
    FASTATTN_CHECK(block != nullptr, "attention", "out of memory allocating ", total * 4,
                   " bytes of tiles");
    float** parts[6] = {&qT, &st, &o, &q_rows, &k_rows, &v_rows};
    float* next = block;
    for (int i = 0; i < 6; ++i) {
      *parts[i] = next;
      next += (sizes[i] + 15) / 16 * 16;
    }
  }
  ~KeyMajorTiles() { std::free(block); }
  KeyMajorTiles(const KeyMajorTiles&) = delete;
  KeyMajorTiles& operator=(const KeyMajorTiles&) = delete;
};

// Scores of S^T (N key rows x `lanes` queries, ld kBlockQ) outside their query's band become
// -inf: key j is visible to query i iff i + lo <= j <= i + hi, so key row n keeps lanes
// [j - hi - i0, j - lo - i0].
inline void mask_band(const Geometry& g, int64_t i0, int64_t lanes, int64_t j0, int64_t N,
                      float* st) {
  if (j0 >= i0 + lanes - 1 + g.lo && j0 + N - 1 <= i0 + g.hi) return;  // all inside
  const float neg = -std::numeric_limits<float>::infinity();
  for (int64_t n = 0; n < N; ++n) {
    const int64_t j = j0 + n;
    const int64_t first = std::clamp<int64_t>(j - g.hi - i0, 0, lanes);
    const int64_t last = std::clamp<int64_t>(j - g.lo - i0 + 1, first, lanes);
    float* row = st + n * kBlockQ;
    std::fill(row, row + first, neg);
    std::fill(row + last, row + lanes, neg);
  }
}

// The online softmax down the columns of S^T (N key rows x `lanes`, ld kBlockQ, log2 units):
// per query lane, the running maximum m and sum l, and alpha = 2^(m_old - m_new), exactly 1
// where the maximum did not move, for rescaling the lane's output row. S^T becomes P.
inline void softmax_columns(float* st, int64_t N, int64_t lanes, float* m, float* l, float* alpha) {
  constexpr int W = VecF::kWidth;
  const VecF lowest = VecF::set1(std::numeric_limits<float>::lowest());
  for (int64_t c = 0; c < lanes; c += W) {
    float* col = st + c;
    VecF max0 = VecF::load(col), max1 = max0;  // two chains: the max latency, not the loads
    int64_t n = 1;
    for (; n + 1 < N; n += 2) {
      max0 = max(max0, VecF::load(col + n * kBlockQ));
      max1 = max(max1, VecF::load(col + (n + 1) * kBlockQ));
    }
    if (n < N) max0 = max(max0, VecF::load(col + n * kBlockQ));
    const VecF m_old = VecF::load(m + c);
    const VecF m_new = max(m_old, max(max0, max1));
    // a lane with no visible key yet keeps m = -inf: it shifts by 0 (not -inf - -inf = NaN)
    const VecF shift = select_less(m_new, lowest, VecF::zero(), m_new);
    VecF sum0 = VecF::zero(), sum1 = VecF::zero();
    for (n = 0; n + 1 < N; n += 2) {
      const VecF e0 = exp2_nonpositive(VecF::load(col + n * kBlockQ) - shift);
      const VecF e1 = exp2_nonpositive(VecF::load(col + (n + 1) * kBlockQ) - shift);
      e0.store(col + n * kBlockQ);
      e1.store(col + (n + 1) * kBlockQ);
      sum0 = sum0 + e0;
      sum1 = sum1 + e1;
    }
    if (n < N) {
      const VecF e = exp2_nonpositive(VecF::load(col + n * kBlockQ) - shift);
      e.store(col + n * kBlockQ);
      sum0 = sum0 + e;
    }
    const VecF a = select_less(m_old, m_new, exp2_nonpositive(m_old - shift), VecF::set1(1.0f));
    fma(VecF::load(l + c), a, sum0 + sum1).store(l + c);
    m_new.store(m + c);
    a.store(alpha + c);
  }
}

// attention_forward for the problems key_major_forward_fits accepts (acc = float).
template <typename T>
void key_major_forward(const AttentionForwardParams& fp) {
  constexpr int W = VecF::kWidth;
  constexpr bool kConvert = !std::is_same_v<T, float>;
  const AttentionProblem& p = fp.p;
  const int64_t q_blocks = (p.Lq + kBlockQ - 1) / kBlockQ;
  const int64_t group = p.Hq / p.Hkv;
  const int64_t D = p.D, Dv = p.Dv;
  const T* Q = static_cast<const T*>(p.q);
  const T* K = static_cast<const T*>(p.k);
  const T* V = static_cast<const T*>(p.v);
  T* O = static_cast<T*>(fp.out);
  float* LSE = static_cast<float*>(fp.lse);
  const float scale_log2 = static_cast<float>(p.scale * 1.4426950408889634);
  const float ln2 = 0.69314718055994531f;

  parallel_for(0, p.B * p.Hq * q_blocks, 1, [&](int64_t begin, int64_t end) {
    KeyMajorTiles t(D, Dv, kConvert);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t qb = task % q_blocks, bh = task / q_blocks;
      const int64_t b = bh / p.Hq, h = bh % p.Hq, hk = h / group;
      const Geometry g = geometry(p, b);
      const int64_t i0 = qb * kBlockQ;
      const int64_t M = std::min(kBlockQ, g.Lq - i0);
      if (M <= 0) continue;  // a shorter sequence of a varlen batch
      const int64_t lanes = (M + W - 1) / W * W;
      // Q^T, lanes past M zero (their scores are 0 and never read)
      int64_t ldq;
      const float* q = rows_view<T>(Q + b * p.q_s.b + h * p.q_s.h + (g.q_row0 + i0) * p.q_s.l,
                                    p.q_s.l, 0, M, D, t.q_rows, ldq);
      transpose(q, ldq, t.qT, kBlockQ, M, D);
      for (int64_t d = 0; d < D && lanes > M; ++d) {
        std::fill(t.qT + d * kBlockQ + M, t.qT + d * kBlockQ + lanes, 0.0f);
      }
      std::fill(t.o, t.o + M * Dv, 0.0f);
      std::fill(t.m, t.m + lanes, -std::numeric_limits<float>::infinity());
      std::fill(t.l, t.l + lanes, 0.0f);
      const T* k_head = K + b * p.k_s.b + hk * p.k_s.h + g.k_row0 * p.k_s.l;
      const T* v_head = V + b * p.v_s.b + hk * p.v_s.h + g.k_row0 * p.v_s.l;
      const auto [kb_first, kb_last] = visible_key_blocks(g, i0, M);
      for (int64_t kb = kb_first; kb < kb_last; ++kb) {
        const int64_t j0 = kb * kBlockK, N = std::min(kBlockK, g.Lk - j0);
        int64_t ldk, ldv;
        const float* k = rows_view<T>(k_head, p.k_s.l, j0, N, D, t.k_rows, ldk);
        gemm(N, lanes, D, scale_log2, k, ldk, 1, t.qT, kBlockQ, t.st, kBlockQ, false);
        mask_band(g, i0, lanes, j0, N, t.st);
        softmax_columns(t.st, N, lanes, t.m, t.l, t.alpha);
        for (int64_t r = 0; r < M; ++r) {
          if (t.alpha[r] == 1.0f) continue;
          float* o = t.o + r * Dv;
          const float a = t.alpha[r];
          for (int64_t d = 0; d < Dv; ++d) o[d] *= a;
        }
        const float* v = rows_view<T>(v_head, p.v_s.l, j0, N, Dv, t.v_rows, ldv);
        gemm(M, Dv, N, 1.0f, t.st, 1, kBlockQ, v, ldv, t.o, Dv, true);
      }
      for (int64_t r = 0; r < M; ++r) {
        float* o = t.o + r * Dv;
        const float lr = t.l[r];
        const float lse =
            normalize_row(o, Dv, lr) ? (t.m[r] + std::log2(lr)) * ln2 : neg_inf<float>();
        const int64_t i = i0 + r;
        LSE[lse_offset(p, g, b, h) + i] = lse;
        store_row<T>(o, O + b * fp.out_s.b + h * fp.out_s.h + (g.q_row0 + i) * fp.out_s.l, Dv);
      }
    }
  });
}
#endif

}  // namespace
}  // namespace fastattn::cpu::FASTATTN_ISA
