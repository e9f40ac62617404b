// How the CPU attention kernels read K and V: dense heads and paged caches as runs of rows,
// read in place, and the streaming reads (prefetched lines, P V over row runs, transposes that
// stream paged rows) that keep a long cache from being copied. Inside each ISA copy's
// namespace.
#pragma once
#include <algorithm>
#include <cstdint>
#if defined(__unix__)
#include <unistd.h>  // sysconf
#endif

#include "attention/attention_cpu_scores.h"
#include "common/cpu_gemm.h"

#ifndef FASTATTN_ISA
#error "include this header from a kernel compiled through the per-ISA copies (CMakeLists.txt)"
#endif

namespace fastattn::cpu::FASTATTN_ISA {
namespace {

// Rows [j0, j0 + N) of a paged head as runs of consecutive rows, one per cache block touched
// (a tile of kBlockK rows touches at most kBlockK / 16 + 1 blocks: block sizes are multiples of
// 16).
template <typename T>
struct RowRuns {
  static constexpr int64_t kMax = kBlockK / 16 + 1;
  const T* rows[kMax];
  int64_t n[kMax];
  int64_t count = 0, stride = 0;
};

// Rows [j0, j0 + N) of a dense head (row 0 at `head`, row stride `stride`) as one RowRuns run.
template <typename T>
RowRuns<T> dense_runs(const T* head, int64_t stride, int64_t j0, int64_t N) {
  RowRuns<T> runs;
  runs.stride = stride;
  runs.rows[0] = head + j0 * stride;
  runs.n[0] = N;
  runs.count = 1;
  return runs;
}

// The cache lines of the next key tile, prefetched a few at a time while the current tile
// computes: its K transposes and P V products issue one prefetch per cache line they read
// (`issue`). On this project's Zen 5 CPU a tile's lines requested at once (the 512-1024
// prefetches of a decoding tile) stall the loads queued behind them, and a paged cache's block
// jumps then cost most of a memory latency each; spread out, the same prefetches hide them (a
// scratch read loop over 8 KiB blocks in random order with a decoder's work per line: 1220 us
// with the prefetches at each tile's start, 720 us spread out, 980 us reading the blocks in
// order with no prefetch at all).
class LineStream {
 public:
  void clear() {
    spans_.clear();
    span_ = 0;
    cur_ = end_ = nullptr;
  }
  // Appends rows [0, runs.count) of `runs`, each row `row_bytes` long, to the lines to fetch.
  template <typename T>
  void add(const RowRuns<T>& runs, int64_t row_bytes) {
    const int64_t stride = runs.stride * static_cast<int64_t>(sizeof(T));
    for (int64_t r = 0; r < runs.count; ++r) {
      const char* first = reinterpret_cast<const char*>(runs.rows[r]);
      if (stride == row_bytes) {  // back-to-back rows: one span of lines
        add_span(first, runs.n[r] * row_bytes);
      } else {
        for (int64_t i = 0; i < runs.n[r]; ++i) add_span(first + i * stride, row_bytes);
      }
    }
  }
  // Prefetches the next `lines` cache lines of the stream (none once it is exhausted). Called
  // once or twice per row a tile reads, so the common case is a few instructions: lines left
  // in the current span.
  void issue(int64_t lines) {
    while (lines > 0) {
      if (cur_ == end_ && !next_span()) return;
      const int64_t n = std::min<int64_t>(lines, (end_ - cur_) / 64);
      for (int64_t i = 0; i < n; ++i) __builtin_prefetch(cur_ + 64 * i);
      cur_ += 64 * n;
      lines -= n;
    }
  }

 private:
  struct Span {
    const char* first;  // 64-byte aligned
    const char* end;    // past its last line
  };
  void add_span(const char* begin, int64_t bytes) {
    const auto lo = reinterpret_cast<uintptr_t>(begin) & ~uintptr_t(63);
    const auto hi =
        (reinterpret_cast<uintptr_t>(begin) + static_cast<uintptr_t>(bytes) + 63) & ~uintptr_t(63);
    spans_.push_back({reinterpret_cast<const char*>(lo), reinterpret_cast<const char*>(hi)});
  }
  bool next_span() {
    if (span_ == spans_.size()) return false;
    cur_ = spans_[span_].first;
    end_ = spans_[span_].end;
    ++span_;
    return true;
  }
  std::vector<Span> spans_;
  size_t span_ = 0;                             // the next span to start
  const char *cur_ = nullptr, *end_ = nullptr;  // lines left in the current span
};

// The L2 cache of one core (the system's answer, else 1 MiB).
inline int64_t l2_cache_bytes() {
#if defined(_SC_LEVEL2_CACHE_SIZE)
  static const int64_t bytes = [] {
    const long n = sysconf(_SC_LEVEL2_CACHE_SIZE);
    return n > 0 ? static_cast<int64_t>(n) : int64_t(1) << 20;
  }();
  return bytes;
#else
  return int64_t(1) << 20;
#endif
}

// Cache lines a row of `bytes` bytes reads (at least; one more where it straddles a line).
inline int64_t lines_of(int64_t bytes) { return (bytes + 63) / 64; }

#if defined(FASTATTN_CPU_VEC)
// An MR x (NV kWidth) block of pv_runs_vec from column c (kFull: all its columns inside Dv,
// plain loads; masked ones, even with every lane set, cost more on Zen 5).
template <int MR, int NV, bool kFull>
void pv_runs_block(int64_t Dv, int64_t c, const float* a, int64_t a_k, const float* const* rows,
                   const int64_t* n, int64_t count, int64_t stride, float* o, LineStream* next) {
  constexpr int W = VecF::kWidth;
  constexpr int64_t kLines = (NV * W * sizeof(float) + 63) / 64;  // lines a V row's block reads
  // tail masks built where used (common/cpu_gemm.h's gemm_block_vec says why)
  VecF acc[MR][NV];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      const float* orow = o + r * Dv + c + W * v;
      acc[r][v] = kFull ? VecF::load(orow) : VecF::load(orow, VecF::tail(Dv - c - W * v));
    }
  }
  const float* ak = a;
  for (int64_t run = 0; run < count; ++run) {
    const float* b = rows[run] + c;
    for (int64_t k = 0; k < n[run]; ++k, b += stride, ak += a_k) {
      if (next != nullptr) next->issue(kLines);
      VecF bv[NV];
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v)
        bv[v] = kFull ? VecF::load(b + W * v) : VecF::load(b + W * v, VecF::tail(Dv - c - W * v));
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        const VecF ar = VecF::set1(ak[r]);
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) acc[r][v] = fma(ar, bv[v], acc[r][v]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v)
      detail::store_or_add<kFull>(o + r * Dv + c + W * v, acc[r][v], false, Dv - c - W * v);
  }
}

// O (MR x Dv, ld Dv) += P V over a tile's block runs of V rows (row stride `stride`), P k-major
// (a[k * a_k + m]), two vectors of columns at a time: each block of O stays in registers
// across the runs, one load and one store per tile instead of one per run.
template <int MR>
void pv_runs_vec(int64_t Dv, const float* a, int64_t a_k, const float* const* rows,
                 const int64_t* n, int64_t count, int64_t stride, float* o, LineStream* next) {
  constexpr int W = VecF::kWidth;
  int64_t c = 0;
  for (; c + 2 * W <= Dv; c += 2 * W) {
    pv_runs_block<MR, 2, true>(Dv, c, a, a_k, rows, n, count, stride, o, next);
  }
  if (c + W < Dv) {
    pv_runs_block<MR, 2, false>(Dv, c, a, a_k, rows, n, count, stride, o, next);
  } else if (c < Dv) {
    pv_runs_block<MR, 1, false>(Dv, c, a, a_k, rows, n, count, stride, o, next);
  }
}

// pv_runs_vec for M rows (1 <= M <= MR).
template <int MR>
void pv_runs_vec_rows(int64_t M, int64_t Dv, const float* a, int64_t a_k, const float* const* rows,
                      const int64_t* n, int64_t count, int64_t stride, float* o, LineStream* next) {
  if constexpr (MR > 0) {
    if (M == MR) {
      pv_runs_vec<MR>(Dv, a, a_k, rows, n, count, stride, o, next);
    } else {
      pv_runs_vec_rows<MR - 1>(M, Dv, a, a_k, rows, n, count, stride, o, next);
    }
  }
}
#endif

#if defined(FASTATTN_CPU_VEC)
// transpose() (dst (cols x rows, ld ldd) = src^T) that prefetches a line of `next` per source
// line it reads, after each register block.
inline void transpose_streaming(const float* src, int64_t lds, float* dst, int64_t ldd,
                                int64_t rows, int64_t cols, LineStream* next) {
  transpose_blocks(src, lds, dst, ldd, rows, cols, [next](int rows_here) {
    if (next != nullptr) next->issue((rows_here * VecF::kWidth * sizeof(float) + 63) / 64);
  });
}
#endif

// Rows [j0, j0 + N) of a paged head as runs of consecutive rows, one per cache block touched.
template <typename T>
RowRuns<T> paged_runs(const AttentionProblem& p, const T* pool, const Strides4& s, int64_t b,
                      int64_t hk, int64_t j0, int64_t N) {
  const int32_t* table = p.block_table + b * p.block_table_stride;
  const int64_t ps = p.page_size;
  RowRuns<T> runs;
  runs.stride = s.l;
  for (int64_t j = j0; j < j0 + N; ++runs.count) {
    const int64_t page = j / ps, row = j - page * ps, run = std::min(ps - row, j0 + N - j);
    runs.rows[runs.count] = pool + table[page] * s.b + hk * s.h + row * s.l;
    runs.n[runs.count] = run;
    j += run;
  }
  return runs;
}

// Rows [j0, j0 + N) of a paged head as one strided block of rows for a Tiles::load_k/load_v
// call (returns row j0; `stride` receives the row stride). Rows that lie in one block are read
// in place from the pool; a tile that straddles blocks is copied run by run into `stage`
// (kBlockK x W, row stride W), the only copy the tiles without RowRuns make (one L1-sized
// tile, never the cache).
template <typename T>
const T* paged_rows(const AttentionProblem& p, const T* pool, const Strides4& s, int64_t b,
                    int64_t hk, int64_t j0, int64_t N, int64_t W, T* stage, int64_t& stride) {
  const RowRuns<T> runs = paged_runs<T>(p, pool, s, b, hk, j0, N);
  stride = s.l;
  if (runs.count == 1) return runs.rows[0];
  for (int64_t r = 0, off = 0; r < runs.count; off += runs.n[r], ++r) {
    const T* from = runs.rows[r];
    T* to = stage + off * W;
    if (s.l == W) {
      std::copy(from, from + runs.n[r] * W, to);
    } else {
      for (int64_t i = 0; i < runs.n[r]; ++i) {
        std::copy(from + i * s.l, from + i * s.l + W, to + i * W);
      }
    }
  }
  stride = W;
  return stage;
}
}  // namespace
}  // namespace fastattn::cpu::FASTATTN_ISA
