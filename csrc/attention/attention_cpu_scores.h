// The CPU attention kernels' tile geometry and score pipeline, shared by the forward, the
// backward and the bfloat16 path (attention_*_cpu_kernel.cpp): block sizes, a sequence's
// geometry (lengths, band, row offsets), S = scale * Q K^T's pipeline (softcap, ALiBi, masks,
// band), dropout, the key and query blocks a tile can see, per-head packed operand blocks, the
// exponential of a score row, a finished forward row's normalisation and the backward's row
// terms. Inside each ISA copy's namespace.
#pragma once
#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "attention/attention_cpu_kernel.h"
#include "common/cpu_convert.h"
#include "common/cpu_dropout.h"
#include "common/cpu_math.h"
#include "common/parallel.h"

#ifndef FASTATTN_ISA
#error "include this header from a kernel compiled through the per-ISA copies (CMakeLists.txt)"
#endif

namespace fastattn::cpu::FASTATTN_ISA {
namespace {

constexpr int64_t kBlockQ = 64;
constexpr int64_t kBlockK = 64;
// Backward work is split into at least this many tasks (independent of the thread count, so
// the summation order and hence the bits of dQ do not depend on it).
constexpr int64_t kMinBackwardTasks = 8;

template <typename acc>
constexpr acc neg_inf() {
  return -std::numeric_limits<acc>::infinity();
}

constexpr int64_t kUnbounded = int64_t(1) << 30;

// Where sequence b lives and which keys its queries see (dense, varlen or KV-cache layouts).
struct Geometry {
  int64_t q_row0, k_row0;  // first query / key row of the sequence (varlen), else 0
  int64_t Lq, Lk;          // its lengths
  int64_t lo, hi;          // key j visible to query i iff i + lo <= j <= i + hi
  int64_t shift;           // query i sits at key position i + shift (ALiBi distance)
};

inline Geometry geometry(const AttentionProblem& p, int64_t b) {
  if (p.cu_q == nullptr && p.k_lengths == nullptr) {
    return {0, 0, p.Lq, p.Lk, p.window_lo, p.window_hi, p.Lk - p.Lq};
  }
  Geometry g{0, 0, p.Lq, p.Lk, 0, 0, 0};
  if (p.cu_q != nullptr) {
    g.q_row0 = p.cu_q[b];
    g.k_row0 = p.cu_k[b];
    g.Lq = p.cu_q[b + 1] - p.cu_q[b];
    g.Lk = p.cu_k[b + 1] - p.cu_k[b];
    g.shift = g.Lk - g.Lq;
  } else {
    g.Lk = p.k_lengths[b];
    g.shift = p.q_positions[b];
  }
  g.lo = p.window_left >= 0 ? g.shift - p.window_left : -kUnbounded;
  g.hi = p.window_right >= 0 ? g.shift + p.window_right : kUnbounded;
  if (p.causal_mode != 0) g.hi = std::min(g.hi, p.causal_mode == 1 ? int64_t(0) : g.shift);
  return g;
}

// Philox element index of probability (b, h, i, j) is row_index(...) + j.
inline uint64_t dropout_row(const AttentionProblem& p, const Geometry& g, int64_t b, int64_t h,
                            int64_t i) {
  if (p.cu_q != nullptr) return static_cast<uint64_t>(((g.q_row0 + i) * p.Hq + h) * p.Lk);
  return static_cast<uint64_t>(((b * p.Hq + h) * p.Lq + i) * p.Lk);
}

// Offset of the lse row of (b, h): (B, Hq, Lq) dense, (Hq, total_q) varlen.
inline int64_t lse_offset(const AttentionProblem& p, const Geometry& g, int64_t b, int64_t h) {
  if (p.cu_q != nullptr) return h * p.total_q + g.q_row0;
  return (b * p.Hq + h) * p.Lq;
}

// Rows [r0, r0 + rows) of one (b, h) slice of a (B, H, L, D) tensor as a row-major tile of the
// compute type: the tensor itself when it already is (float storage), else converted into buf.
// Returns the tile; ld receives its row stride.
template <typename T>
const acc_t<T>* rows_view(const T* base, int64_t stride_l, int64_t r0, int64_t rows, int64_t D,
                          acc_t<T>* buf, int64_t& ld) {
  if constexpr (std::is_same_v<T, acc_t<T>>) {
    ld = stride_l;
    return base + r0 * stride_l;
  } else {
    for (int64_t r = 0; r < rows; ++r) load_row<T>(base + (r0 + r) * stride_l, buf + r * D, D);
    ld = D;
    return buf;
  }
}

// Transposed tile: tile[d * ld_out + r] = X[r0 + r, d] (the B operand of Q K^T and dO V^T).
template <typename T>
void load_tile_transposed(const T* base, int64_t stride_l, int64_t r0, int64_t rows, int64_t D,
                          acc_t<T>* buf, acc_t<T>* tile, int64_t ld_out) {
  int64_t ld;
  const acc_t<T>* src = rows_view<T>(base, stride_l, r0, rows, D, buf, ld);
  transpose(src, ld, tile, ld_out, rows, D);
}

// Everything about one (b, h) slice of the score pipeline that does not depend on the tile.
template <typename acc>
struct ScoreContext {
  const AttentionProblem& p;
  const Geometry& g;
  int64_t b, h;
  acc slope;  // ALiBi slope of (b, h), 0 without ALiBi
  const char* mask_base;
  const bool* padding;  // (Lk,) of batch b or nullptr

  ScoreContext(const AttentionProblem& prob, const Geometry& geo, int64_t b_, int64_t h_)
      : p(prob), g(geo), b(b_), h(h_), slope(0), mask_base(nullptr), padding(nullptr) {
    if (p.alibi != nullptr) slope = static_cast<acc>(p.alibi[b * p.alibi_sb + h * p.alibi_sh]);
    if (p.mask_kind != MaskKind::none) {
      const int64_t elem = mask_element_size(p.mask_kind);
      mask_base = static_cast<const char*>(p.mask) + (b * p.mask_sb + h * p.mask_sh) * elem;
    }
    if (p.key_padding != nullptr) padding = p.key_padding + b * p.Lk;
  }

  static int64_t mask_element_size(MaskKind kind) {
    switch (kind) {
      case MaskKind::boolean:
        return 1;
      case MaskKind::float16:
      case MaskKind::bfloat16:
        return 2;
      case MaskKind::float32:
        return 4;
      case MaskKind::float64:
        return 8;
      default:
        return 0;
    }
  }

  // Turns raw products s = scale * q.k of rows [i0, i0+M) x keys [j0, j0+N) (row stride ld)
  // into masked scores. tanh_out (optional, same layout) receives tanh(s/softcap) for the
  // softcap backward.
  void apply(acc* s, int64_t ld, int64_t i0, int64_t M, int64_t j0, int64_t N, acc* tanh_out,
             acc* row_tmp) const {
    const acc cap = static_cast<acc>(p.softcap);
    const int64_t shift = g.shift;
    for (int64_t r = 0; r < M; ++r) {
      acc* row = s + r * ld;
      const int64_t i = i0 + r;
      if (cap > 0) {
        acc* t = tanh_out != nullptr ? tanh_out + r * ld : row_tmp;
        for (int64_t n = 0; n < N; ++n) t[n] = tanh_approx(row[n] / cap);
        for (int64_t n = 0; n < N; ++n) row[n] = cap * t[n];
      }
      if (p.alibi != nullptr) {
        for (int64_t n = 0; n < N; ++n) {
          const int64_t dist = i + shift - (j0 + n);
          row[n] -= slope * static_cast<acc>(dist < 0 ? -dist : dist);
        }
      }
      if (p.mask_kind != MaskKind::none) apply_mask_row(row, i, j0, N, row_tmp);
      if (padding != nullptr) {
        for (int64_t n = 0; n < N; ++n) row[n] = padding[j0 + n] ? neg_inf<acc>() : row[n];
      }
      // The window band: keys [i + lo, i + hi] are visible.
      const int64_t lo = std::clamp<int64_t>(i + g.lo - j0, 0, N);
      const int64_t hi = std::clamp<int64_t>(i + g.hi - j0 + 1, 0, N);
      for (int64_t n = 0; n < lo; ++n) row[n] = neg_inf<acc>();
      for (int64_t n = hi; n < N; ++n) row[n] = neg_inf<acc>();
    }
  }

  void apply_mask_row(acc* row, int64_t i, int64_t j0, int64_t N, acc* tmp) const {
    const int64_t elem = mask_element_size(p.mask_kind);
    const char* base = mask_base + (i * p.mask_sq + j0 * p.mask_sk) * elem;
    const int64_t sk = p.mask_sk;
    switch (p.mask_kind) {
      case MaskKind::boolean: {
        const bool* m = reinterpret_cast<const bool*>(base);
        for (int64_t n = 0; n < N; ++n) row[n] = m[n * sk] ? row[n] : neg_inf<acc>();
        return;
      }
      case MaskKind::float32: {
        const float* m = reinterpret_cast<const float*>(base);
        for (int64_t n = 0; n < N; ++n) row[n] += static_cast<acc>(m[n * sk]);
        return;
      }
      case MaskKind::float64: {
        const double* m = reinterpret_cast<const double*>(base);
        for (int64_t n = 0; n < N; ++n) row[n] += static_cast<acc>(m[n * sk]);
        return;
      }
      case MaskKind::float16: {
        const c10::Half* m = reinterpret_cast<const c10::Half*>(base);
        for (int64_t n = 0; n < N; ++n) row[n] += static_cast<acc>(static_cast<float>(m[n * sk]));
        return;
      }
      case MaskKind::bfloat16: {
        const c10::BFloat16* m = reinterpret_cast<const c10::BFloat16*>(base);
        for (int64_t n = 0; n < N; ++n) row[n] += static_cast<acc>(static_cast<float>(m[n * sk]));
        return;
      }
      default:
        (void)tmp;
        return;
    }
  }
};

// Dropout multipliers (0 or 1/(1-p)) of the tile rows [i0, i0+M) x keys [j0, j0+N) of (b, h).
template <typename acc>
void dropout_tile(const AttentionProblem& p, const Geometry& g, int64_t b, int64_t h, int64_t i0,
                  int64_t M, int64_t j0, int64_t N, acc* mult, int64_t ld, float* scratch) {
  for (int64_t r = 0; r < M; ++r) {
    const uint64_t e0 = dropout_row(p, g, b, h, i0 + r) + static_cast<uint64_t>(j0);
    dropout_multipliers<acc>(p.seed, p.stream, e0, N, p.dropout_p, scratch, mult + r * ld);
  }
}

// The key blocks [first, last) that queries [i0, i0 + M) can see.
inline std::pair<int64_t, int64_t> visible_key_blocks(const Geometry& g, int64_t i0, int64_t M) {
  const int64_t j_lo = std::max<int64_t>(0, i0 + g.lo);
  const int64_t j_hi = std::min<int64_t>(g.Lk - 1, i0 + M - 1 + g.hi);
  if (M <= 0 || j_lo > j_hi) return {0, 0};
  return {j_lo / kBlockK, j_hi / kBlockK + 1};
}

// The query blocks [first, last) that see some key of [j0, j0 + N).
inline std::pair<int64_t, int64_t> visible_query_blocks(const Geometry& g, int64_t j0, int64_t N) {
  const int64_t i_lo = std::max<int64_t>(0, j0 - g.hi);
  const int64_t i_hi = std::min<int64_t>(g.Lq - 1, j0 + N - 1 - g.lo);
  if (N <= 0 || i_lo > i_hi) return {0, 0};
  return {i_lo / kBlockQ, i_hi / kBlockQ + 1};
}

// Packed operand blocks of one head, kept across the tasks of a thread: the forward tasks of a
// head walk the same key blocks, so each block is packed on first use instead of once per
// query block.
struct PackedBlocks {
  const void* head = nullptr;  // base pointer of the head the blocks belong to
  int64_t block_words = 0;
  std::vector<uint32_t> words;
  std::vector<bool> ready;
  // The slot of block kb, or nullptr when caching would hold too much (long sequences).
  uint32_t* slot(const void* base, int64_t kb, bool& fresh) {
    static constexpr int64_t kMaxBlocks = 256;  // 16K keys
    if (kb >= kMaxBlocks) return nullptr;
    if (base != head) {
      head = base;
      ready.assign(ready.size(), false);
    }
    if (kb >= static_cast<int64_t>(ready.size())) {
      ready.resize(kb + 1, false);
      words.resize((kb + 1) * block_words);
    }
    fresh = !ready[kb];
    ready[kb] = true;
    return words.data() + kb * block_words;
  }
};

// exp(x - shift) over a score row, summed: the bfloat16 tiles, whose products take P rounded to
// bfloat16, use the shorter exponential of cpu_math.h.
template <typename Tiles, typename acc>
acc exp_row(acc* x, int64_t n, acc shift) {
#if defined(__AVX512F__)
  if constexpr (Tiles::kProbabilitiesInBf16) return exp_shift_sum_for_bf16(x, n, shift);
#endif
  return exp_shift_sum(x, n, shift);
}

// A forward output row o (n values) divided by its softmax sum l; a row with no visible key
// (l = 0) becomes 0 and the call returns false, its lse then being -inf. A NaN l (from a NaN
// score: q or k) keeps the row NaN, as in torch.
template <typename acc>
bool normalize_row(acc* o, int64_t n, acc l) {
  if (l == acc(0)) {
    std::fill(o, o + n, acc(0));
    return false;
  }
  const acc inv = acc(1) / l;
  for (int64_t d = 0; d < n; ++d) o[d] *= inv;
  return true;
}

// Row terms Delta_i = rowsum(dO_i * O_i) - dlse_i (d lse_i / d s_ij = P_ij), numbered like lse.
template <typename T, typename acc>
std::vector<acc> row_deltas(const AttentionBackwardParams& bp, int64_t rows, int64_t walk) {
  const AttentionProblem& p = bp.p;
  const int64_t Dv = p.Dv;
  const T* O = static_cast<const T*>(bp.out);
  const T* dO = static_cast<const T*>(bp.grad_out);
  const acc* dLSE = static_cast<const acc*>(bp.grad_lse);
  std::vector<acc> delta(rows);
  parallel_for(0, walk, 64, [&](int64_t begin, int64_t end) {
    std::vector<acc> o(Dv), g_row(Dv);
    for (int64_t w = begin; w < end; ++w) {
      const int64_t i = w % p.Lq, bh = w / p.Lq, b = bh / p.Hq, h = bh % p.Hq;
      const Geometry g = geometry(p, b);
      if (i >= g.Lq) continue;
      const int64_t qi = g.q_row0 + i;
      load_row<T>(O + b * bp.out_s.b + h * bp.out_s.h + qi * bp.out_s.l, o.data(), Dv);
      load_row<T>(dO + b * bp.grad_out_s.b + h * bp.grad_out_s.h + qi * bp.grad_out_s.l,
                  g_row.data(), Dv);
      acc sum = 0;
#pragma omp simd reduction(+ : sum)
      for (int64_t d = 0; d < Dv; ++d) sum += o[d] * g_row[d];
      const int64_t r = lse_offset(p, g, b, h) + i;
      delta[r] = sum - (dLSE != nullptr ? dLSE[r] : acc(0));
    }
  });
  return delta;
}
}  // namespace
}  // namespace fastattn::cpu::FASTATTN_ISA
