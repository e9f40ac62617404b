// The CPU attention kernels' operand policies: how the five tile products are computed.
// Operand policies: how the five tile products are computed. FloatTiles runs them on float
// (double) tiles with the FMA micro-kernel; Bf16Tiles, for bfloat16 storage on CPUs with
// AVX512-BF16, keeps Q, K, V, dO in bfloat16 pair layouts and rounds P and dS to bfloat16
// before their products (as the GPU kernels do), accumulating in float.
// AmxTiles runs bfloat16 tiles on AMX where the CPU has it. TilesFor picks the policy of a
// storage type. Inside each ISA copy's namespace.
#pragma once
#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "attention/attention_cpu_reads.h"
#include "attention/attention_cpu_scores.h"
#include "common/cpu_amx.h"
#include "common/cpu_convert.h"
#include "common/cpu_gemm.h"
#include "common/cpu_gemm_bf16.h"
#include "common/cpu_math.h"

#ifndef FASTATTN_ISA
#error "include this header from a kernel compiled through the per-ISA copies (CMakeLists.txt)"
#endif

namespace fastattn::cpu::FASTATTN_ISA {
namespace {

template <typename T>
struct FloatTiles {
  using acc = acc_t<T>;
  static constexpr bool kProbabilitiesInBf16 = false;
  // Reads paged K/V tiles block run by block run in place (load_k_runs /
  // pv_runs) when the rows need no conversion; the other tiles stage a straddling tile.
  static constexpr bool kRowRuns = std::is_same_v<T, acc>;
  // load_q_rows / scores_rows: the forward's tiles hold several heads' rows (forward_impl)
  static constexpr bool kRowOffsets = true;
  int64_t D, Dv;
  std::vector<acc> q_buf, qT, k_buf, kt, v_buf, vt, do_buf, pt;
  const acc *q_rows = nullptr, *k_rows = nullptr, *v_rows = nullptr, *do_rows = nullptr;
  int64_t ldq = 0, ldk = 0, ldv = 0, lddo = 0;

  FloatTiles(int64_t D_, int64_t Dv_)
      : D(D_),
        Dv(Dv_),
        q_buf(kBlockQ * D_),
        qT(D_ * kBlockQ),
        k_buf(kBlockK * D_),
        kt(D_ * kBlockK),
        v_buf(kBlockK * Dv_),
        vt(Dv_ * kBlockK),
        do_buf(kBlockQ * Dv_),
        pt(kBlockK * kBlockQ) {}

  // The forward loads Q once per task and transposes it to the k-major layout the
  // micro-kernel broadcasts from; the backward uses Q rows in place.
  void load_q(const T* base, int64_t stride, int64_t i0, int64_t M, bool backward) {
    q_rows = rows_view<T>(base, stride, i0, M, D, q_buf.data(), ldq);
    if (!backward) transpose(q_rows, ldq, qT.data(), kBlockQ, M, D);
  }
  // The forward's Q of rows [r0, r0 + M) of the tiles (several heads in one task: kRowRuns).
  void load_q_rows(const T* base, int64_t stride, int64_t M, int64_t r0) {
    const acc* rows = rows_view<T>(base, stride, 0, M, D, q_buf.data(), ldq);
    transpose(rows, ldq, qT.data() + r0, kBlockQ, M, D);
  }
  // S rows [r0, r0 + M) (ld kBlockK, from s) = scale * Q K^T of those rows (forward).
  void scores_rows(int64_t r0, int64_t M, int64_t N, acc scale, acc* s) {
    gemm(M, N, D, scale, qT.data() + r0, 1, kBlockQ, kt.data(), kBlockK, s + r0 * kBlockK, kBlockK,
         false);
  }
  void load_k(const T* base, int64_t stride, int64_t j0, int64_t N, bool /*backward*/) {
    k_rows = rows_view<T>(base, stride, j0, N, D, k_buf.data(), ldk);
    transpose(k_rows, ldk, kt.data(), kBlockK, N, D);
  }
  void load_v(const T* base, int64_t stride, int64_t j0, int64_t N, bool backward) {
    v_rows = rows_view<T>(base, stride, j0, N, Dv, v_buf.data(), ldv);
    if (backward) transpose(v_rows, ldv, vt.data(), kBlockK, N, Dv);
  }
  void load_do(const T* base, int64_t stride, int64_t i0, int64_t M) {
    do_rows = rows_view<T>(base, stride, i0, M, Dv, do_buf.data(), lddo);
  }
  // S (M x N, ld kBlockK) = scale * Q K^T.
  void scores(int64_t M, int64_t N, acc scale, bool backward, acc* s) {
    if (!backward) {
      gemm(M, N, D, scale, qT.data(), 1, kBlockQ, kt.data(), kBlockK, s, kBlockK, false);
    } else {
      gemm(M, N, D, scale, q_rows, ldq, 1, kt.data(), kBlockK, s, kBlockK, false);
    }
  }
  // O (M x Dv) += P V with P (M x N, ld kBlockK).
  void pv(int64_t M, int64_t N, const acc* p, acc* o) {
    gemm(M, Dv, N, acc(1), p, kBlockK, 1, v_rows, ldv, o, Dv, true);
  }
  // A tile as runs of rows (RowRuns: one per cache block a paged tile touches, one for a dense
  // tile; rows of one stride): K transposed run by run into kt, V's runs read in place by
  // pv_runs. `next` (or nullptr): the next tile's lines, one prefetched per line these read.
  void load_k_runs(const RowRuns<T>& runs, LineStream* next) {
    for (int64_t r = 0, off = 0; r < runs.count; off += runs.n[r], ++r) {
#if defined(FASTATTN_CPU_VEC)
      if constexpr (std::is_same_v<acc, float>) {
        transpose_streaming(runs.rows[r], runs.stride, kt.data() + off, kBlockK, runs.n[r], D,
                            next);
        continue;
      }
#endif
      transpose(runs.rows[r], runs.stride, kt.data() + off, kBlockK, runs.n[r], D);
      if (next != nullptr) next->issue(runs.n[r] * lines_of(D * sizeof(acc)));
    }
  }
  void pv_runs(int64_t M, const RowRuns<T>& runs, const acc* p, acc* o, LineStream* next) {
    // P k-major once for the tile (pt[n * M + m]): handed row-major, each run's gemm would
    // transpose its columns of P again (measured: docs/design/cpu_kernels.md, "Measurements
    // moved out of the code")
    int64_t N = 0;
    for (int64_t r = 0; r < runs.count; ++r) N += runs.n[r];
    transpose(p, kBlockK, pt.data(), M, M, N);
#if defined(FASTATTN_CPU_VEC)
    if constexpr (std::is_same_v<acc, float>) {
      for (int64_t m0 = 0; m0 < M; m0 += kGemmRowsVec) {
        pv_runs_vec_rows<kGemmRowsVec>(std::min<int64_t>(M - m0, kGemmRowsVec), Dv, pt.data() + m0,
                                       M, runs.rows, runs.n, runs.count, runs.stride, o + m0 * Dv,
                                       next);
      }
      return;
    }
#endif
    for (int64_t r = 0, off = 0; r < runs.count; off += runs.n[r], ++r) {
      gemm(M, Dv, runs.n[r], acc(1), pt.data() + off * M, 1, M, runs.rows[r], runs.stride, o, Dv,
           true);
      if (next != nullptr) next->issue(runs.n[r] * lines_of(Dv * sizeof(acc)));
    }
  }
  // dV (N x Dv) += P^T dO.
  void dv(int64_t M, int64_t N, const acc* p, acc* dv_acc) {
    gemm(N, Dv, M, acc(1), p, 1, kBlockK, do_rows, lddo, dv_acc, Dv, true);
  }
  // dP (M x N) = dO V^T.
  void dp(int64_t M, int64_t N, acc* out) {
    gemm(M, N, Dv, acc(1), do_rows, lddo, 1, vt.data(), kBlockK, out, kBlockK, false);
  }
  // dK (N x D) += dS^T Q and dQ (M x D, ld D) += dS K.
  void dk_dq(int64_t M, int64_t N, const acc* ds, acc* dk_acc, acc* dq) {
    gemm(N, D, M, acc(1), ds, 1, kBlockK, q_rows, ldq, dk_acc, D, true);
    gemm(M, D, N, acc(1), ds, kBlockK, 1, k_rows, ldk, dq, D, true);
  }
  void finish_key_block(int64_t, acc*, acc*) {}
};

#if defined(__AVX512BF16__)
struct Bf16Tiles {
  using acc = float;
  static constexpr bool kProbabilitiesInBf16 = true;
  static constexpr bool kRowRuns = false;
  static constexpr bool kRowOffsets = true;
  int64_t D, Dv, D2, Dv2;
  // k-major pair matrices (A operands) and VNNI pair matrices (B operands), see cpu_gemm_bf16.h
  std::vector<uint32_t> pairs, qA, qB, kA, kB, vA, vB, doA, doB, pA;
  std::vector<uint16_t> rounded;  // P or dS rounded to bfloat16, (kBlockQ x kBlockK)

  Bf16Tiles(int64_t D_, int64_t Dv_)
      : D(D_),
        Dv(Dv_),
        D2((D_ + 1) / 2),
        Dv2((Dv_ + 1) / 2),
        // pair scratch: rows x (cols / 2) for Q, K, V, dO tiles and for P and dS tiles
        pairs(std::max(kBlockQ, kBlockK) *
              std::max({(D_ + 1) / 2, (Dv_ + 1) / 2, kBlockQ / 2 + 1, kBlockK / 2 + 1})),
        qA(D2 * kBlockQ),
        qB((kBlockQ / 2 + 1) * D_),
        kA((kBlockK / 2 + 1) * D_),
        kB(D2 * kBlockK),
        vA((kBlockK / 2 + 1) * Dv_),
        vB(Dv2 * kBlockK),
        doA(Dv2 * kBlockQ),
        doB((kBlockQ / 2 + 1) * Dv_),
        pA((std::max(kBlockQ, kBlockK) / 2 + 1) * std::max(kBlockQ, kBlockK)),
        rounded(kBlockQ * kBlockK) {}

  static const uint16_t* bits(const c10::BFloat16* p) {
    return reinterpret_cast<const uint16_t*>(p);
  }
  // rows x cols bfloat16 rows -> k-major pairs along cols: out[kk * ld_out + r].
  void pairs_transposed(const uint16_t* x, int64_t ld, int64_t rows, int64_t cols, uint32_t* out,
                        int64_t ld_out) {
    const int64_t cols2 = (cols + 1) / 2;
    pair_columns(x, ld, rows, cols, pairs.data(), cols2);
    transpose_words(pairs.data(), cols2, out, ld_out, rows, cols2);
  }

  void load_q(const c10::BFloat16* base, int64_t stride, int64_t i0, int64_t M, bool backward) {
    const uint16_t* x = bits(base + i0 * stride);
    pairs_transposed(x, stride, M, D, qA.data(), kBlockQ);   // A of Q K^T
    if (backward) pair_rows(x, stride, M, D, qB.data(), D);  // B of dS^T Q
  }
  void load_k(const c10::BFloat16* base, int64_t stride, int64_t j0, int64_t N, bool backward) {
    const uint16_t* x = bits(base + j0 * stride);
    pairs_transposed(x, stride, N, D, kB.data(), kBlockK);   // B of Q K^T
    if (backward) pair_rows(x, stride, N, D, kA.data(), D);  // B of dS K
  }
  void load_v(const c10::BFloat16* base, int64_t stride, int64_t j0, int64_t N, bool backward) {
    const uint16_t* x = bits(base + j0 * stride);
    if (backward) {
      pairs_transposed(x, stride, N, Dv, vB.data(), kBlockK);  // B of dO V^T
    } else {
      pair_rows(x, stride, N, Dv, vA.data(), Dv);  // B of P V
    }
  }
  void load_do(const c10::BFloat16* base, int64_t stride, int64_t i0, int64_t M) {
    const uint16_t* x = bits(base + i0 * stride);
    pairs_transposed(x, stride, M, Dv, doA.data(), kBlockQ);  // A of dO V^T
    pair_rows(x, stride, M, Dv, doB.data(), Dv);              // B of P^T dO
  }
  void scores(int64_t M, int64_t N, float scale, bool /*backward*/, float* s) {
    gemm_bf16(M, N, D2, scale, qA.data(), kBlockQ, kB.data(), kBlockK, s, kBlockK, false);
  }
  // The forward's Q of rows [r0, r0 + M) of the tiles, and their scores (several heads in one
  // task: kRowOffsets).
  void load_q_rows(const c10::BFloat16* base, int64_t stride, int64_t M, int64_t r0) {
    pairs_transposed(bits(base), stride, M, D, qA.data() + r0, kBlockQ);
  }
  void scores_rows(int64_t r0, int64_t M, int64_t N, float scale, float* s) {
    gemm_bf16(M, N, D2, scale, qA.data() + r0, kBlockQ, kB.data(), kBlockK, s + r0 * kBlockK,
              kBlockK, false);
  }
  // x (M x N float, ld kBlockK) rounded; as A of x @ B: pairs along N, k-major.
  const uint32_t* round_as_a(int64_t M, int64_t N, const float* x) {
    round_to_bf16(x, kBlockK, M, N, rounded.data(), kBlockK);
    pairs_transposed(rounded.data(), kBlockK, M, N, pA.data(), kBlockQ);
    return pA.data();
  }
  // x (M x N float) rounded; as A of x^T @ B: pairs along M, k-major over n.
  const uint32_t* round_as_a_transposed(int64_t M, int64_t N, const float* x) {
    round_to_bf16(x, kBlockK, M, N, rounded.data(), kBlockK);
    pair_rows(rounded.data(), kBlockK, M, N, pA.data(), kBlockK);
    return pA.data();
  }
  void pv(int64_t M, int64_t N, const float* p, float* o) {
    const uint32_t* a = round_as_a(M, N, p);
    gemm_bf16(M, Dv, (N + 1) / 2, 1.0f, a, kBlockQ, vA.data(), Dv, o, Dv, true);
  }
  void dv(int64_t M, int64_t N, const float* p, float* dv_acc) {
    const uint32_t* a = round_as_a_transposed(M, N, p);
    gemm_bf16(N, Dv, (M + 1) / 2, 1.0f, a, kBlockK, doB.data(), Dv, dv_acc, Dv, true);
  }
  void dp(int64_t M, int64_t N, float* out) {
    gemm_bf16(M, N, Dv2, 1.0f, doA.data(), kBlockQ, vB.data(), kBlockK, out, kBlockK, false);
  }
  void dk_dq(int64_t M, int64_t N, const float* ds, float* dk_acc, float* dq) {
    const uint32_t* at = round_as_a_transposed(M, N, ds);
    gemm_bf16(N, D, (M + 1) / 2, 1.0f, at, kBlockK, qB.data(), D, dk_acc, D, true);
    const uint32_t* a = round_as_a(M, N, ds);
    gemm_bf16(M, D, (N + 1) / 2, 1.0f, a, kBlockQ, kA.data(), D, dq, D, true);
  }
  void finish_key_block(int64_t, float*, float*) {}
};
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
inline int64_t round_up32(int64_t x) { return (x + 31) & ~int64_t(31); }

// x (M x N float, row stride ldx) rounded to bfloat16 rows out (row stride ld_out), padded with
// zeros to rows_out x cols_out (multiples of 16) so that tile products may read whole blocks.
inline void round_rows_padded(const float* x, int64_t ldx, int64_t M, int64_t N, int64_t rows_out,
                              int64_t cols_out, uint16_t* out, int64_t ld_out) {
  for (int64_t r = 0; r < rows_out; ++r) {
    uint16_t* o = out + r * ld_out;
    for (int64_t c = 0; c < cols_out; c += 16) {
      const __mmask16 m = r < M ? detail::tail_mask(N - c) : __mmask16(0);
      const __m256bh h = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, x + r * ldx + c));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + c), (__m256i)h);
    }
  }
}

// x (M x N float, row stride ldx) rounded to bfloat16 as VNNI pairs of rows, out[kk * ld_out +
// n] = (x[2kk][n], x[2kk+1][n]), zero past M and N, up to rows_out / 2 pair rows of cols_out.
inline void round_pair_rows_padded(const float* x, int64_t ldx, int64_t M, int64_t N,
                                   int64_t rows_out, int64_t cols_out, uint32_t* out,
                                   int64_t ld_out) {
  // cvtne2ps puts row 2kk in the low 16 bfloat16 and row 2kk+1 in the high 16: interleave.
  alignas(64) static constexpr uint16_t kInterleave[32] = {
      0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
      8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i interleave = _mm512_load_si512(kInterleave);
  for (int64_t kk = 0; kk < rows_out / 2; ++kk) {
    const int64_t r0 = 2 * kk, r1 = 2 * kk + 1;
    for (int64_t c = 0; c < cols_out; c += 16) {
      const __mmask16 m0 = r0 < M ? detail::tail_mask(N - c) : __mmask16(0);
      const __mmask16 m1 = r1 < M ? detail::tail_mask(N - c) : __mmask16(0);
      const __m512 a = _mm512_maskz_loadu_ps(m0, x + r0 * ldx + c);
      const __m512 b = _mm512_maskz_loadu_ps(m1, x + r1 * ldx + c);
      const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(b, a);
      _mm512_storeu_si512(out + kk * ld_out + c, _mm512_permutexvar_epi16(interleave, both));
    }
  }
}

// Bfloat16 tiles on the AMX tile unit, for head dims that are multiples of 32 (the tile
// products run on 32 x 32 blocks). Same operand rounding as Bf16Tiles (P and dS to bfloat16,
// float accumulation); A operands are plain bfloat16 rows, so Q and dO feed the products
// straight from the tensor when a block is full. Rows and columns past M or N are zero in
// every padded operand, and the products only touch whole blocks of buffers sized for them.
// The backward accumulates dK^T += Q^T dS and dV^T += dO^T P, whose B operands (dS and P in
// pairs of rows) come straight from rounding, and transposes dK and dV once per key block; Q^T
// and dO^T are packed once per query block and head.
struct AmxTiles {
  using acc = float;
  static constexpr bool kProbabilitiesInBf16 = true;
  static constexpr bool kRowRuns = false;
  static constexpr bool kRowOffsets = false;
  int64_t D, Dv;
  AmxTileScope tile_scope;
  std::vector<uint32_t> pairs, kA, kB, vA, vB, b_pairs;  // VNNI pair layouts (B operands)
  std::vector<uint16_t> q_pad, do_pad, a_rows;           // bfloat16 rows (A operands)
  std::vector<uint32_t> qT, doT;                         // Q^T, dO^T rows as words
  std::vector<float> dq_tile, dkT, dvT;
  const uint16_t *q_rows = nullptr, *do_rows = nullptr;
  int64_t ldq = 0, lddo = 0;
  // The forward tasks of one head walk the same key blocks: each block's packed K^T and V are
  // kept (packed on first use) instead of being packed again for every query block.
  PackedBlocks k_blocks, v_blocks, qT_blocks, doT_blocks;
  const uint32_t *kB_cur = nullptr, *vA_cur = nullptr, *qT_cur = nullptr, *doT_cur = nullptr;

  AmxTiles(int64_t D_, int64_t Dv_)
      : D(D_),
        Dv(Dv_),
        pairs(std::max(kBlockQ, kBlockK) * std::max(D_, Dv_) / 2),
        kA(kBlockK / 2 * D_),
        kB(D_ / 2 * kBlockK),
        vA(kBlockK / 2 * Dv_),
        vB(Dv_ / 2 * kBlockK),
        b_pairs(kBlockQ / 2 * kBlockK),
        q_pad(kBlockQ * D_),
        do_pad(kBlockQ * Dv_),
        a_rows(kBlockQ * kBlockK),
        qT(D_ * kBlockQ / 2),
        doT(Dv_ * kBlockQ / 2),
        dq_tile(kBlockQ * D_),
        dkT(D_ * kBlockK),
        dvT(Dv_ * kBlockK) {
    k_blocks.block_words = D_ / 2 * kBlockK;
    v_blocks.block_words = kBlockK / 2 * Dv_;
    qT_blocks.block_words = D_ * kBlockQ / 2;
    doT_blocks.block_words = Dv_ * kBlockQ / 2;
  }

  static bool fits(const AttentionProblem& p) {
    return amx_bf16_usable() && p.D % 32 == 0 && p.Dv % 32 == 0;
  }
  static const uint16_t* bits(const c10::BFloat16* p) {
    return reinterpret_cast<const uint16_t*>(p);
  }
  // rows x cols bfloat16 rows -> VNNI pairs of the transpose, out[kk * ld_out + r], with
  // columns r in [rows, ld_out) zero.
  void pairs_transposed(const uint16_t* x, int64_t ld, int64_t rows, int64_t cols, uint32_t* out,
                        int64_t ld_out) {
    const int64_t cols2 = cols / 2;
    pair_columns(x, ld, rows, cols, pairs.data(), cols2);
    transpose_words(pairs.data(), cols2, out, ld_out, rows, cols2);
    if (rows < ld_out) {
      for (int64_t kk = 0; kk < cols2; ++kk)
        std::fill(out + kk * ld_out + rows, out + (kk + 1) * ld_out, 0u);
    }
  }
  // VNNI pairs of consecutive rows, zero pair rows up to block_rows / 2.
  static void pair_rows_padded(const uint16_t* x, int64_t ld, int64_t rows, int64_t cols,
                               int64_t block_rows, uint32_t* out) {
    pair_rows(x, ld, rows, cols, out, cols);
    const int64_t used = (rows + 1) / 2;
    std::fill(out + used * cols, out + block_rows / 2 * cols, 0u);
  }
  // Rows of a (rows x cols) bfloat16 block as the A operand: the tensor itself when the block
  // is full, else a zero-padded copy.
  static const uint16_t* a_operand(const uint16_t* x, int64_t stride, int64_t rows, int64_t cols,
                                   int64_t block_rows, uint16_t* pad, int64_t& ld) {
    if (rows == block_rows) {
      ld = stride;
      return x;
    }
    for (int64_t r = 0; r < rows; ++r) std::memcpy(pad + r * cols, x + r * stride, cols * 2);
    std::fill(pad + rows * cols, pad + block_rows * cols, uint16_t(0));
    ld = cols;
    return pad;
  }

  // X^T (cols x rows) as bfloat16 rows of kBlockQ (words of two), zero past rows: the pairs
  // of X's rows, transposed as words.
  void rows_of_transpose(const uint16_t* x, int64_t stride, int64_t rows, int64_t cols,
                         uint32_t* out) {
    pair_rows_padded(x, stride, rows, cols, kBlockQ, pairs.data());
    transpose_words(pairs.data(), cols, out, kBlockQ / 2, kBlockQ / 2, cols);
  }
  // The A operand Q^T (or dO^T) of query block i0 / kBlockQ of this head, packed on first use.
  const uint32_t* transposed_block(PackedBlocks& cache, const c10::BFloat16* base, int64_t stride,
                                   int64_t i0, int64_t M, int64_t cols, uint32_t* scratch) {
    bool fresh = true;
    uint32_t* slot = cache.slot(base, i0 / kBlockQ, fresh);
    uint32_t* dst = slot != nullptr ? slot : scratch;
    if (fresh) rows_of_transpose(bits(base + i0 * stride), stride, M, cols, dst);
    return dst;
  }

  void load_q(const c10::BFloat16* base, int64_t stride, int64_t i0, int64_t M, bool backward) {
    const uint16_t* x = bits(base + i0 * stride);
    q_rows = a_operand(x, stride, M, D, kBlockQ, q_pad.data(), ldq);  // A of Q K^T
    if (backward) qT_cur = transposed_block(qT_blocks, base, stride, i0, M, D, qT.data());
  }
  void load_k(const c10::BFloat16* base, int64_t stride, int64_t j0, int64_t N, bool backward) {
    const uint16_t* x = bits(base + j0 * stride);
    bool fresh = true;
    uint32_t* slot = backward ? nullptr : k_blocks.slot(base, j0 / kBlockK, fresh);
    uint32_t* dst = slot != nullptr ? slot : kB.data();
    if (fresh) pairs_transposed(x, stride, N, D, dst, kBlockK);  // B of Q K^T
    kB_cur = dst;
    if (backward) {
      pair_rows_padded(x, stride, N, D, kBlockK, kA.data());  // B of dS K
      std::fill(dkT.begin(), dkT.end(), 0.0f);
      std::fill(dvT.begin(), dvT.end(), 0.0f);
    }
  }
  void load_v(const c10::BFloat16* base, int64_t stride, int64_t j0, int64_t N, bool backward) {
    const uint16_t* x = bits(base + j0 * stride);
    if (backward) {
      pairs_transposed(x, stride, N, Dv, vB.data(), kBlockK);  // B of dO V^T
      return;
    }
    bool fresh = true;
    uint32_t* slot = v_blocks.slot(base, j0 / kBlockK, fresh);
    uint32_t* dst = slot != nullptr ? slot : vA.data();
    if (fresh) pair_rows_padded(x, stride, N, Dv, kBlockK, dst);  // B of P V
    vA_cur = dst;
  }
  void load_do(const c10::BFloat16* base, int64_t stride, int64_t i0, int64_t M) {
    const uint16_t* x = bits(base + i0 * stride);
    do_rows = a_operand(x, stride, M, Dv, kBlockQ, do_pad.data(), lddo);  // A of dO V^T
    doT_cur = transposed_block(doT_blocks, base, stride, i0, M, Dv, doT.data());
  }
  void scores(int64_t M, int64_t N, float scale, bool /*backward*/, float* s) {
    amx_gemm_bf16(round_up32(M), round_up32(N), D, q_rows, ldq, kB_cur, kBlockK, s, kBlockK, false);
    const __m512 vs = _mm512_set1_ps(scale);
    for (int64_t r = 0; r < M; ++r) {
      float* row = s + r * kBlockK;
      for (int64_t c = 0; c < N; c += 16) {
        const __mmask16 m = detail::tail_mask(N - c);
        _mm512_mask_storeu_ps(row + c, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, row + c), vs));
      }
    }
  }
  // x (M x N, ld kBlockK) as A rows, and as B pairs of rows.
  const uint16_t* rows_of(int64_t M, int64_t N, const float* x) {
    round_rows_padded(x, kBlockK, M, N, round_up32(M), round_up32(N), a_rows.data(), kBlockK);
    return a_rows.data();
  }
  const uint32_t* pairs_of(int64_t M, int64_t N, const float* x) {
    round_pair_rows_padded(x, kBlockK, M, N, round_up32(M), round_up32(N), b_pairs.data(), kBlockK);
    return b_pairs.data();
  }
  void pv(int64_t M, int64_t N, const float* p, float* o) {
    amx_gemm_bf16(round_up32(M), Dv, round_up32(N), rows_of(M, N, p), kBlockK, vA_cur, Dv, o, Dv,
                  true);
  }
  // dV^T (Dv x N) += dO^T P; dv_acc receives it in finish_key_block.
  void dv(int64_t M, int64_t N, const float* p, float* /*dv_acc*/) {
    amx_gemm_bf16(Dv, round_up32(N), round_up32(M), reinterpret_cast<const uint16_t*>(doT_cur),
                  kBlockQ, pairs_of(M, N, p), kBlockK, dvT.data(), kBlockK, true);
  }
  void dp(int64_t M, int64_t N, float* out) {
    amx_gemm_bf16(round_up32(M), round_up32(N), Dv, do_rows, lddo, vB.data(), kBlockK, out, kBlockK,
                  false);
  }
  // dK^T (D x N) += Q^T dS (dk_acc receives it in finish_key_block); dQ += dS K.
  void dk_dq(int64_t M, int64_t N, const float* ds, float* /*dk_acc*/, float* dq) {
    amx_gemm_bf16(D, round_up32(N), round_up32(M), reinterpret_cast<const uint16_t*>(qT_cur),
                  kBlockQ, pairs_of(M, N, ds), kBlockK, dkT.data(), kBlockK, true);
    accumulate_rows(M, D, round_up32(N), rows_of(M, N, ds), kBlockK, kA.data(), dq, dq_tile.data());
  }
  // c (M x cols, row stride cols) += A B (A: rows of lda elements, B: pairs of rows, ldb cols).
  // c's rows past M belong to other rows of the caller's buffer: the product, which writes
  // whole 32-row blocks, goes through scratch (32-row blocks of cols) then.
  static void accumulate_rows(int64_t M, int64_t cols, int64_t K, const uint16_t* a, int64_t lda,
                              const uint32_t* b, float* c, float* scratch) {
    const int64_t M32 = round_up32(M);
    if (M32 == M) {
      amx_gemm_bf16(M, cols, K, a, lda, b, cols, c, cols, true);
      return;
    }
    std::copy(c, c + M * cols, scratch);
    amx_gemm_bf16(M32, cols, K, a, lda, b, cols, scratch, cols, true);
    std::copy(scratch, scratch + M * cols, c);
  }
  // dK and dV of the key block (N x D, N x Dv rows) from the transposed accumulators.
  void finish_key_block(int64_t N, float* dk_acc, float* dv_acc) {
    transpose(dkT.data(), kBlockK, dk_acc, D, D, N);
    transpose(dvT.data(), kBlockK, dv_acc, Dv, Dv, N);
  }
};
#endif

template <typename T>
struct TilesFor {
  using type = FloatTiles<T>;
};
#if defined(__AVX512BF16__)
template <>
struct TilesFor<c10::BFloat16> {
  using type = Bf16Tiles;
};
#endif
}  // namespace
}  // namespace fastattn::cpu::FASTATTN_ISA
