// float32 / float64 attention on CUDA cores with exact FMA arithmetic (no TF32): the same
// tiling, score pipeline, dropout numbering and deterministic backward as the tensor-core
// kernels and the CPU kernels (attention_*_cpu_kernel.cpp), with run-time head dims (one
// instantiation per dtype).
//
// Blocks have 4 warps. A key tile is 32 keys, one per lane; a warp owns kR rows (queries in the
// forward and dQ kernels, keys in the dK/dV kernel). Each step has two phases:
//   scores   a rolled loop over the warp's rows: sequential-FMA dot products over the head dim
//            from shared tiles (rows padded to an odd length: conflict-free column reads), the
//            score pipeline, softmax terms; results go to a warp-private shared buffer [kR][32];
//   products outer-product accumulation into registers acc[kR][8], lanes owning the output
//            columns lane, lane + 32, ... (head dims up to 256), summing the 32 keys (or
//            queries) in order.
//
// Shared memory grows with the head dims (up to 206 KB for the float64 dK/dV at 256). Two smaller
// variants keep every head dim on 99 KB devices, with the same arithmetic in the same order:
//   forward   fewer rows per warp (kR template parameter; float64 only, above D ~ 252);
//   backward  a D-split (kChunked): the 32-row tiles of the step (Q/dO for dK/dV, K/V for dQ)
//             are loaded 32 columns at a time; the dot products carry their partial sums
//             through the warp's [kR][32] buffers, then the products phase reloads the chunks
//             (the last one is still in place) and accumulates output column c of each lane
//             from chunk c. The sums run over the same elements in the same order as the full
//             tiles, so both variants give bitwise equal results.
#pragma once
#include "attention/attention_cuda_common.cuh"

namespace fastattn::cuda::attn {

template <typename T>
inline constexpr int kSimtR = sizeof(T) == 4 ? 8 : 4;  // rows per warp of the default tiles

template <typename T, int kR_ = kSimtR<T>>
struct SimtConfig {
  static constexpr int kWarps = 4;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kR = kR_;             // rows per warp
  static constexpr int kRows = kWarps * kR;  // rows per block
  static constexpr int kCols = 8;            // output columns per lane (256 / 32)
  static constexpr int kChunk = 32;          // columns per chunk of the D-split (one per lane)
  static_assert(kR >= 1 && kCols * 32 >= 256, "rows per warp; columns up to 256");
};

// Copies rows [r0, r0 + rows) x cols [0, D) of a row-major global matrix (ld) into a shared
// tile with row length ld_s; rows >= L and the columns [D, ld_s) are zero.
template <typename T>
__device__ __forceinline__ void simt_load_tile(T* s, int ld_s, const T* g, int64_t ld, int r0,
                                               int rows, int L, int D, int tid, int threads,
                                               RowMap map = RowMap{}) {
  for (int idx = tid; idx < rows * ld_s; idx += threads) {
    const int r = idx / ld_s, d = idx % ld_s;
    const int row = r0 + r;
    prim::sts(s + idx, (row < L && d < D) ? prim::ldg(g + map.offset(row, ld) + d) : T(0));
  }
}

// Sequential FMA dot product of two shared rows, continuing the running sum `sum` (a D-split
// passes the previous chunks' partial sum, so the order of the additions does not change).
template <typename T>
__device__ __forceinline__ T simt_dot(const T* a, const T* b, int D, T sum = T(0)) {
  for (int d = 0; d < D; ++d) sum = prim::acc_fma(prim::lds(a + d), prim::lds(b + d), sum);
  return sum;
}

template <typename T>
__device__ __forceinline__ T simt_score(const Problem& p, const Scores<T>& sc, bool elementwise,
                                        T scale, T dot, int i, int j, T& th) {
  return elementwise ? sc(dot, i, j, th) : band_score(p, scale, dot, i, j);
}

// acc[r][c] += sum_m coef[r][m] * B[m][lane + 32 c] over m in [0, 32), in order: coef is the
// warp's [kR][32] shared buffer, B a shared tile of row length ldb with `cols` real columns.
template <typename T, int kR, int kCols>
__device__ __forceinline__ void simt_accumulate(T (&acc)[kR][kCols], const T* coef, const T* B,
                                                int ldb, int cols, int lane) {
#pragma unroll 1
  for (int m = 0; m < 32; ++m) {
    T a[kR], bv[kCols];
#pragma unroll
    for (int r = 0; r < kR; ++r) a[r] = prim::lds(coef + r * 32 + m);
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      const int col = lane + 32 * c;
      bv[c] = col < cols ? prim::lds(B + m * ldb + col) : T(0);
    }
#pragma unroll
    for (int r = 0; r < kR; ++r)
#pragma unroll
      for (int c = 0; c < kCols; ++c) acc[r][c] = prim::acc_fma(a[r], bv[c], acc[r][c]);
  }
}

// acc[r][c] += sum_m coef[r][m] * B[m][lane] over m in [0, 32), in order, for the one output
// column c (run time) of the chunk B (a shared tile of row length ldb): the D-split's
// simt_accumulate. Each register column has its own copy of the loop (acc stays in registers)
// while the caller's chunk loop stays rolled (one copy of its loads: fewer live registers).
template <typename T, int kR, int kCols>
__device__ __forceinline__ void simt_accumulate_col(T (&acc)[kR][kCols], int c, const T* coef,
                                                    const T* B, int ldb, bool valid, int lane) {
#pragma unroll
  for (int cc = 0; cc < kCols; ++cc) {
    if (cc == c) {
#pragma unroll 1
      for (int m = 0; m < 32; ++m) {
        const T bv = valid ? prim::lds(B + m * ldb + lane) : T(0);
#pragma unroll
        for (int r = 0; r < kR; ++r) {
          acc[r][cc] = prim::acc_fma(prim::lds(coef + r * 32 + m), bv, acc[r][cc]);
        }
      }
    }
  }
}

// Shared-memory bytes of each SIMT kernel for head dims D, Dv (kR rows per warp; chunked: the
// D-split backward, whose step tiles hold 32 columns).
template <typename T, int kR = kSimtR<T>>
struct SimtSmem {
  using Cfg = SimtConfig<T, kR>;
  static constexpr int fwd(int D, int Dv) {
    const int dmax = D > Dv ? D : Dv;
    return static_cast<int>(sizeof(T)) *
           (Cfg::kRows * (D + 1) + 32 * (dmax + 1) + Cfg::kWarps * Cfg::kR * 32);
  }
  // The two 32-row tiles of a backward step: full rows, or one chunk of each.
  static constexpr int step_tiles(int D, int Dv, bool chunked) {
    return chunked ? 2 * 32 * (Cfg::kChunk + 1) : 32 * (D + 1) + 32 * (Dv + 1);
  }
  static constexpr int dkdv(int D, int Dv, bool chunked) {
    return static_cast<int>(sizeof(T)) *
           (Cfg::kRows * (D + 1) + Cfg::kRows * (Dv + 1) + step_tiles(D, Dv, chunked) +
            2 * Cfg::kWarps * Cfg::kR * 32 + 2 * 32);
  }
  static constexpr int dq(int D, int Dv, bool chunked) {
    return static_cast<int>(sizeof(T)) *
           (Cfg::kRows * (D + 1) + Cfg::kRows * (Dv + 1) + step_tiles(D, Dv, chunked) +
            (chunked ? 2 : 1) * Cfg::kWarps * Cfg::kR * 32 + 2 * Cfg::kRows);
  }
};

template <typename T, int kR_>
__global__ void __launch_bounds__(SimtConfig<T, kR_>::kThreads)
    attention_fwd_simt_kernel(const FwdParams args) {
  using Cfg = SimtConfig<T, kR_>;
  constexpr int kR = Cfg::kR, kRows = Cfg::kRows, kCols = Cfg::kCols;
  FwdParams params = args;  // select_sequence rewrites it for varlen / KV-cache problems
  const Problem& p = params.p;
  const int D = p.D, Dv = p.Dv;
  const int ldq = D + 1, ldkv = (D > Dv ? D : Dv) + 1;
  T* sQ = reinterpret_cast<T*>(prim::shared_base());
  T* sKV = sQ + kRows * ldq;  // K tile, then V tile (row length ldkv)
  T* sP = sKV + 32 * ldkv;    // [warp][kR][32]

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  // Block -> (split, slice bh, query tile), as the tensor-core forward.
  const int m_tiles = (p.Lq + kRows - 1) / kRows;
  const int64_t per_split = static_cast<int64_t>(m_tiles) * p.B * p.Hq;
  const int split = static_cast<int>(blockIdx.x / per_split);
  const int64_t block = blockIdx.x % per_split;
  const int bh = static_cast<int>(block / m_tiles);
  const int m_tile = m_tiles - 1 - static_cast<int>(block % m_tiles);
  const int b = bh / p.Hq, h = bh % p.Hq, hk = h / p.group;
  const int i0 = m_tile * kRows;
  const int row0 = warp * kR;  // this warp's rows within the tile
  FASTATTN_DEVICE_CHECK(b < p.B && split < max(params.num_splits, 1));
  select_sequence(params, b);
  if (i0 >= p.Lq) return;  // the whole block: past the end of a shorter sequence

  const T* Qg = static_cast<const T*>(p.q) + b * p.q_sb + h * p.q_sh;
  // A paged KV cache's tiles are read through the sequence's row of the block table.
  const bool paged = p.block_table != nullptr;
  const int32_t* table = paged ? p.block_table + b * p.block_table_stride : nullptr;
  const RowMap k_rows{table, p.page_size, p.k_sb}, v_rows{table, p.page_size, p.v_sb};
  const T* Kg = static_cast<const T*>(p.k) + (paged ? 0 : b * p.k_sb) + hk * p.k_sh;
  const T* Vg = static_cast<const T*>(p.v) + (paged ? 0 : b * p.v_sb) + hk * p.v_sh;
  T* myP = sP + warp * kR * 32;

  Scores<T> sc;  // element-wise path only (local memory)
  sc.init(p, b, h);
  const T scale = static_cast<T>(p.scale);
  const bool elementwise = has_elementwise(p);
  Dropout drop;
  drop.init(p);
  const T keep_scale = static_cast<T>(p.keep_scale);

  T o[kR][kCols];
  T m_run[kR], l_run[kR];  // running max; lane-partial sums of exp(s - m)
#pragma unroll
  for (int r = 0; r < kR; ++r) {
    m_run[r] = -prim::inf_of<T>();
    l_run[r] = 0;
#pragma unroll
    for (int c = 0; c < kCols; ++c) o[r][c] = 0;
  }

  simt_load_tile(sQ, ldq, Qg, p.q_sl, i0, kRows, p.Lq, D, tid, Cfg::kThreads);
  const TileRange kt = split_range(visible_key_tiles(p, i0, kRows, 32), split, params.num_splits);
  for (int n_tile = kt.first; n_tile < kt.last; ++n_tile) {
    const int j0 = n_tile * 32;
    const int j = j0 + lane;
    prim::block_sync();  // the previous V tile is no longer read (and Q has landed)
    simt_load_tile(sKV, ldkv, Kg, p.k_sl, j0, 32, p.Lk, D, tid, Cfg::kThreads, k_rows);
    prim::block_sync();
    // Scores of the warp's rows against key j.
#pragma unroll 1
    for (int r = 0; r < kR; ++r) {
      T th = 0;
      const T dot = simt_dot(sQ + (row0 + r) * ldq, sKV + lane * ldkv, D);
      prim::sts(myP + r * 32 + lane,
                simt_score(p, sc, elementwise, scale, dot, i0 + row0 + r, j, th));
    }
    // Online softmax; the probabilities (times dropout) replace the scores.
#pragma unroll
    for (int r = 0; r < kR; ++r) {
      const int i = i0 + row0 + r;
      const T s = prim::lds(myP + r * 32 + lane);
      T mx = s;
#pragma unroll
      for (int m = 16; m >= 1; m >>= 1) mx = prim::acc_max(mx, prim::shfl_xor(mx, m));
      const T m_new = prim::acc_max(m_run[r], mx);
      // No visible key so far in this row: shift by 0 (exp(-inf) = 0, never -inf + inf).
      const T m_use = m_new == -prim::inf_of<T>() ? T(0) : m_new;
      const T alpha = prim::acc_exp(m_run[r] - m_use);  // 0 while the row was empty
      T pv = prim::acc_exp(s - m_use);
      l_run[r] = l_run[r] * alpha + pv;
      m_run[r] = m_new;
#pragma unroll
      for (int c = 0; c < kCols; ++c) o[r][c] *= alpha;
      if (p.dropout && i < p.Lq && j < p.Lk) {
        pv *= drop.keep(dropout_element(p, bh, i, j)) ? keep_scale : T(0);
      }
      prim::sts(myP + r * 32 + lane, pv);
    }
    prim::block_sync();  // every warp is done with K
    simt_load_tile(sKV, ldkv, Vg, p.v_sl, j0, 32, p.Lk, Dv, tid, Cfg::kThreads, v_rows);
    prim::block_sync();
    simt_accumulate<T, kR, kCols>(o, myP, sKV, ldkv, Dv, lane);
  }

  // Split-K blocks (float32 only) write their float32 partials instead of out and lse.
  const bool partial = params.num_splits > 1;
  T* Og = static_cast<T*>(params.out) + b * params.o_sb + h * params.o_sh;
  T* lse = static_cast<T*>(params.lse) + lse_index(p, b, h, 0);
  const int64_t part_row0 = (static_cast<int64_t>(split) * p.B * p.Hq + bh) * p.Lq;
#pragma unroll
  for (int r = 0; r < kR; ++r) {
    T l = l_run[r];
#pragma unroll
    for (int m = 16; m >= 1; m >>= 1) l += prim::shfl_xor(l, m);
    const bool empty = l == T(0);  // no visible key: out 0, lse -inf (a NaN l stays NaN)
    const int i = i0 + row0 + r;
    if (i < p.Lq) {
      const T inv = empty ? T(0) : T(1) / l;
      const T lse_i = empty ? -prim::inf_of<T>() : m_run[r] + prim::acc_log(l);
      if (partial) {
        float* Pg = params.part_out + (part_row0 + i) * p.Dv;
#pragma unroll
        for (int c = 0; c < kCols; ++c) {
          const int col = lane + 32 * c;
          if (col < Dv) prim::stg(Pg + col, empty ? 0.0f : static_cast<float>(o[r][c] * inv));
        }
        if (lane == 0) prim::stg(params.part_lse + part_row0 + i, static_cast<float>(lse_i));
        continue;
      }
#pragma unroll
      for (int c = 0; c < kCols; ++c) {
        const int col = lane + 32 * c;
        // a select, not 0 * o: a masked key's NaN value can be in o (0 * NaN)
        if (col < Dv) {
          prim::stg(Og + static_cast<int64_t>(i) * params.o_sl + col, empty ? T(0) : o[r][c] * inv);
        }
      }
      if (lane == 0) prim::stg(lse + i, lse_i);
    }
  }
}

// dK/dV: a block owns kRows keys (kR per warp) of one (batch, kv head); lanes are the 32
// queries of a step, which walks the query heads of the group and the visible query tiles.
// kChunked: the D-split (see the top of the file).
// The work of a dK/dV block for one (batch b, kv head hk) and key tile n_tile.
template <typename T, bool kChunked>
__device__ __forceinline__ void attention_bwd_dkdv_simt_block(const BwdParams& args, int b, int hk,
                                                              int n_tile) {
  using Cfg = SimtConfig<T>;
  constexpr int kR = Cfg::kR, kRows = Cfg::kRows, kCols = Cfg::kCols, kChunk = Cfg::kChunk;
  BwdParams params = args;  // select_sequence rewrites it for varlen problems
  const Problem& p = params.p;
  const int D = p.D, Dv = p.Dv;
  const int ldd = D + 1, lddv = Dv + 1;
  // Row lengths of the step's Q and dO tiles: whole rows, or one chunk.
  const int ldq = kChunked ? kChunk + 1 : ldd, lddo = kChunked ? kChunk + 1 : lddv;
  T* sK = reinterpret_cast<T*>(prim::shared_base());
  T* sV = sK + kRows * ldd;
  T* sQ = sV + kRows * lddv;  // 32 query rows
  T* sdO = sQ + 32 * ldq;
  T* sP = sdO + 32 * lddo;  // [warp][kR][32]: P^T * dropout (chunked: first the partial S^T)
  T* sdS = sP + Cfg::kWarps * kR * 32;  // (chunked: first the partial dP^T)
  T* s_lse = sdS + Cfg::kWarps * kR * 32;
  T* s_delta = s_lse + 32;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int j0 = n_tile * kRows;
  const int row0 = warp * kR;
  FASTATTN_DEVICE_CHECK(b < p.B);
  select_sequence(params, b);
  if (j0 >= p.Lk) return;  // the whole block: past the end of a shorter sequence
  T* myP = sP + warp * kR * 32;
  T* mydS = sdS + warp * kR * 32;
  const int n_chunks = ((D > Dv ? D : Dv) + kChunk - 1) / kChunk;

  const T* Kg = static_cast<const T*>(p.k) + b * p.k_sb + hk * p.k_sh;
  const T* Vg = static_cast<const T*>(p.v) + b * p.v_sb + hk * p.v_sh;
  simt_load_tile(sK, ldd, Kg, p.k_sl, j0, kRows, p.Lk, D, tid, Cfg::kThreads);
  simt_load_tile(sV, lddv, Vg, p.v_sl, j0, kRows, p.Lk, Dv, tid, Cfg::kThreads);

  Dropout drop;
  drop.init(p);
  const T keep_scale = static_cast<T>(p.keep_scale);

  T dk[kR][kCols], dv[kR][kCols];
#pragma unroll
  for (int r = 0; r < kR; ++r)
#pragma unroll
    for (int c = 0; c < kCols; ++c) dk[r][c] = dv[r][c] = 0;

  const TileRange qt = visible_query_tiles(p, j0, kRows, 32);
  const int q_count = qt.last - qt.first;
  for (int it = 0; it < p.group * q_count; ++it) {
    const int h = hk * p.group + it / q_count;
    const int i0 = (qt.first + it % q_count) * 32;
    const int bh = b * p.Hq + h;
    const int i = i0 + lane;
    const T* Qg = static_cast<const T*>(p.q) + b * p.q_sb + h * p.q_sh;
    const T* dOg = static_cast<const T*>(params.dout) + b * params.do_sb + h * params.do_sh;
    // Chunk c of the step's Q and dO tiles (columns [32 c, 32 c + 32), zero past D / Dv).
    auto load_chunk = [&](int c) {
      const int c0 = c * kChunk;
      simt_load_tile(sQ, ldq, Qg + c0, p.q_sl, i0, 32, p.Lq, D - c0, tid, Cfg::kThreads);
      simt_load_tile(sdO, lddo, dOg + c0, params.do_sl, i0, 32, p.Lq, Dv - c0, tid, Cfg::kThreads);
    };
    prim::block_sync();  // the previous step's tiles are no longer read
    if constexpr (!kChunked) {
      simt_load_tile(sQ, ldd, Qg, p.q_sl, i0, 32, p.Lq, D, tid, Cfg::kThreads);
      simt_load_tile(sdO, lddv, dOg, params.do_sl, i0, 32, p.Lq, Dv, tid, Cfg::kThreads);
    }
    if (tid < 32) {
      T lse = prim::inf_of<T>(), delta = 0;
      if (i < p.Lq) {
        const int64_t row = lse_index(p, b, h, i);
        lse = prim::ldg(static_cast<const T*>(params.lse) + row);
        if (lse == -prim::inf_of<T>()) lse = prim::inf_of<T>();  // no visible key: P = 0
        delta = prim::ldg(static_cast<const T*>(params.delta) + row);
      }
      prim::sts(s_lse + tid, lse);
      prim::sts(s_delta + tid, delta);
    }
    if constexpr (kChunked) {
      // Partial S^T and dP^T of the warp's rows, chunk by chunk, in the warp's buffers.
      for (int c = 0; c < n_chunks; ++c) {
        const int c0 = c * kChunk;
        if (c > 0) prim::block_sync();  // every warp is done with the previous chunk
        load_chunk(c);
        prim::block_sync();
#pragma unroll 1
        for (int r = 0; r < kR; ++r) {
          const T s0 = c == 0 ? T(0) : prim::lds(myP + r * 32 + lane);
          const T dp0 = c == 0 ? T(0) : prim::lds(mydS + r * 32 + lane);
          prim::sts(myP + r * 32 + lane,
                    simt_dot(sK + (row0 + r) * ldd + c0, sQ + lane * ldq, min(kChunk, D - c0), s0));
          prim::sts(mydS + r * 32 + lane, simt_dot(sV + (row0 + r) * lddv + c0, sdO + lane * lddo,
                                                   min(kChunk, Dv - c0), dp0));
        }
      }
    } else {
      prim::block_sync();
    }

    Scores<T> sc;  // element-wise path only (local memory)
    sc.init(p, b, h);
    const T scale = static_cast<T>(p.scale);
    const bool elementwise = has_elementwise(p);
    const T lse_i = prim::lds(s_lse + lane), delta_i = prim::lds(s_delta + lane);
#pragma unroll 1
    for (int r = 0; r < kR; ++r) {
      const int j = j0 + row0 + r;
      T th = 0;
      const T dot = kChunked ? prim::lds(myP + r * 32 + lane)
                             : simt_dot(sK + (row0 + r) * ldd, sQ + lane * ldd, D);
      const T s = simt_score(p, sc, elementwise, scale, dot, i, j, th);
      const T pv = prim::acc_exp(s - lse_i);
      T mult = 1;
      if (p.dropout && i < p.Lq && j < p.Lk) {
        mult = drop.keep(dropout_element(p, bh, i, j)) ? keep_scale : T(0);
      }
      const T dp = kChunked ? prim::lds(mydS + r * 32 + lane)
                            : simt_dot(sV + (row0 + r) * lddv, sdO + lane * lddv, Dv);
      T ds = pv * (dp * mult - delta_i);
      if (params.dbias_mode != kDBiasNone) {  // the masked score's gradient (after softcap)
        if (params.dbias_sum_q) {             // summed over the step's queries: fixed xor tree
          T sum = i < p.Lq ? ds : T(0);
#pragma unroll
          for (int m = 16; m >= 1; m >>= 1) sum += prim::shfl_xor(sum, m);
          if (lane == 0 && j < p.Lk) dbias_add<T>(params, b, h, 0, j, sum);
        } else if (i < p.Lq && j < p.Lk) {
          dbias_add<T>(params, b, h, i, j, ds);
        }
      }
      if (p.softcap > 0.0) ds *= T(1) - th * th;
      prim::sts(myP + r * 32 + lane, pv * mult);
      prim::sts(mydS + r * 32 + lane, ds * scale);
    }
    prim::warp_sync();
    if constexpr (kChunked) {
      // Output column c of each lane from chunk c; the last chunk is still in place.
#pragma unroll 1
      for (int c = n_chunks - 1; c >= 0; --c) {
        if (c != n_chunks - 1) {
          prim::block_sync();  // every warp is done with the chunk in place
          load_chunk(c);
          prim::block_sync();
        }
        simt_accumulate_col<T, kR, kCols>(dv, c, myP, sdO, lddo, lane + c * kChunk < Dv, lane);
        simt_accumulate_col<T, kR, kCols>(dk, c, mydS, sQ, ldq, lane + c * kChunk < D, lane);
      }
    } else {
      simt_accumulate<T, kR, kCols>(dv, myP, sdO, lddv, Dv, lane);
      simt_accumulate<T, kR, kCols>(dk, mydS, sQ, ldd, D, lane);
    }
  }

  T* dKg = static_cast<T*>(params.dk) + b * params.dk_sb + hk * params.dk_sh;
  T* dVg = static_cast<T*>(params.dv) + b * params.dv_sb + hk * params.dv_sh;
#pragma unroll
  for (int r = 0; r < kR; ++r) {
    const int j = j0 + row0 + r;
    if (j >= p.Lk) continue;
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      const int col = lane + 32 * c;
      if (col < D) prim::stg(dKg + j * params.dk_sl + col, dk[r][c]);
      if (col < Dv) prim::stg(dVg + j * params.dv_sl + col, dv[r][c]);
    }
  }
}

// One block per (key tile, dkdv_pair group): the pairs' work one after another.
template <typename T, bool kChunked>
__global__ void __launch_bounds__(SimtConfig<T>::kThreads)
    attention_bwd_dkdv_simt_kernel(const BwdParams args) {
  constexpr int kRows = SimtConfig<T>::kRows;
  const int n_tiles = (args.p.Lk + kRows - 1) / kRows;
  const int blk = static_cast<int>(blockIdx.x / n_tiles);
  const int n_tile = static_cast<int>(blockIdx.x % n_tiles);
  for (int r = 0; r < args.loop_b * args.loop_h; ++r) {
    int b, hk;
    dkdv_pair(args, blk, r, b, hk);
    if (r > 0) prim::block_sync();  // every warp is done with the previous pair's tiles
    attention_bwd_dkdv_simt_block<T, kChunked>(args, b, hk, n_tile);
  }
}

// dQ: a block owns kRows queries (kR per warp) of one (batch, query head); lanes are the 32
// keys of a step. kChunked: the D-split (see the top of the file).
template <typename T, bool kChunked>
__global__ void __launch_bounds__(SimtConfig<T>::kThreads)
    attention_bwd_dq_simt_kernel(const BwdParams args) {
  using Cfg = SimtConfig<T>;
  constexpr int kR = Cfg::kR, kRows = Cfg::kRows, kCols = Cfg::kCols, kChunk = Cfg::kChunk;
  BwdParams params = args;  // select_sequence rewrites it for varlen problems
  const Problem& p = params.p;
  const int D = p.D, Dv = p.Dv;
  const int ldd = D + 1, lddv = Dv + 1;
  // Row lengths of the step's K and V tiles: whole rows, or one chunk.
  const int ldk = kChunked ? kChunk + 1 : ldd, ldv = kChunked ? kChunk + 1 : lddv;
  T* sQ = reinterpret_cast<T*>(prim::shared_base());
  T* sdO = sQ + kRows * ldd;
  T* sK = sdO + kRows * lddv;  // 32 key rows
  T* sV = sK + 32 * ldk;
  T* sdS = sV + 32 * ldv;               // [warp][kR][32] (chunked: first the partial dP)
  T* sS = sdS + Cfg::kWarps * kR * 32;  // chunked only: the partial S
  T* s_lse = sS + (kChunked ? Cfg::kWarps * kR * 32 : 0);
  T* s_delta = s_lse + kRows;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int m_tiles = (p.Lq + kRows - 1) / kRows;
  const int bh = blockIdx.x / m_tiles;
  const int m_tile = m_tiles - 1 - static_cast<int>(blockIdx.x % m_tiles);
  const int b = bh / p.Hq, h = bh % p.Hq, hk = h / p.group;
  const int i0 = m_tile * kRows;
  const int row0 = warp * kR;
  FASTATTN_DEVICE_CHECK(b < p.B);
  select_sequence(params, b);
  if (i0 >= p.Lq) return;  // the whole block: past the end of a shorter sequence
  T* mydS = sdS + warp * kR * 32;
  T* myS = sS + warp * kR * 32;
  const int n_chunks = ((D > Dv ? D : Dv) + kChunk - 1) / kChunk;

  const T* Qg = static_cast<const T*>(p.q) + b * p.q_sb + h * p.q_sh;
  const T* dOg = static_cast<const T*>(params.dout) + b * params.do_sb + h * params.do_sh;
  const T* Kg = static_cast<const T*>(p.k) + b * p.k_sb + hk * p.k_sh;
  const T* Vg = static_cast<const T*>(p.v) + b * p.v_sb + hk * p.v_sh;
  simt_load_tile(sQ, ldd, Qg, p.q_sl, i0, kRows, p.Lq, D, tid, Cfg::kThreads);
  simt_load_tile(sdO, lddv, dOg, params.do_sl, i0, kRows, p.Lq, Dv, tid, Cfg::kThreads);
  for (int r = tid; r < kRows; r += Cfg::kThreads) {
    const int i = i0 + r;
    T lse = prim::inf_of<T>(), delta = 0;  // lse +inf: no visible key or past Lq (P = 0)
    if (i < p.Lq) {
      const int64_t row = lse_index(p, b, h, i);
      lse = prim::ldg(static_cast<const T*>(params.lse) + row);
      if (lse == -prim::inf_of<T>()) lse = prim::inf_of<T>();
      delta = prim::ldg(static_cast<const T*>(params.delta) + row);
    }
    prim::sts(s_lse + r, lse);
    prim::sts(s_delta + r, delta);
  }

  Scores<T> sc;  // element-wise path only (local memory)
  sc.init(p, b, h);
  const T scale = static_cast<T>(p.scale);
  const bool elementwise = has_elementwise(p);
  Dropout drop;
  drop.init(p);
  const T keep_scale = static_cast<T>(p.keep_scale);

  T dq[kR][kCols];
#pragma unroll
  for (int r = 0; r < kR; ++r)
#pragma unroll
    for (int c = 0; c < kCols; ++c) dq[r][c] = 0;

  const TileRange kt = visible_key_tiles(p, i0, kRows, 32);
  for (int n_tile = kt.first; n_tile < kt.last; ++n_tile) {
    const int j0 = n_tile * 32;
    const int j = j0 + lane;
    prim::block_sync();  // the previous step's tiles are no longer read (and Q, dO have landed)
    if constexpr (kChunked) {
      // Partial S and dP of the warp's rows, chunk by chunk, in the warp's buffers.
      for (int c = 0; c < n_chunks; ++c) {
        const int c0 = c * kChunk;
        if (c > 0) prim::block_sync();  // every warp is done with the previous chunk
        simt_load_tile(sK, ldk, Kg + c0, p.k_sl, j0, 32, p.Lk, D - c0, tid, Cfg::kThreads);
        simt_load_tile(sV, ldv, Vg + c0, p.v_sl, j0, 32, p.Lk, Dv - c0, tid, Cfg::kThreads);
        prim::block_sync();
#pragma unroll 1
        for (int r = 0; r < kR; ++r) {
          const T s0 = c == 0 ? T(0) : prim::lds(myS + r * 32 + lane);
          const T dp0 = c == 0 ? T(0) : prim::lds(mydS + r * 32 + lane);
          prim::sts(myS + r * 32 + lane,
                    simt_dot(sQ + (row0 + r) * ldd + c0, sK + lane * ldk, min(kChunk, D - c0), s0));
          prim::sts(mydS + r * 32 + lane, simt_dot(sdO + (row0 + r) * lddv + c0, sV + lane * ldv,
                                                   min(kChunk, Dv - c0), dp0));
        }
      }
    } else {
      simt_load_tile(sK, ldd, Kg, p.k_sl, j0, 32, p.Lk, D, tid, Cfg::kThreads);
      simt_load_tile(sV, lddv, Vg, p.v_sl, j0, 32, p.Lk, Dv, tid, Cfg::kThreads);
      prim::block_sync();
    }
#pragma unroll 1
    for (int r = 0; r < kR; ++r) {
      const int i = i0 + row0 + r;
      T th = 0;
      const T dot = kChunked ? prim::lds(myS + r * 32 + lane)
                             : simt_dot(sQ + (row0 + r) * ldd, sK + lane * ldd, D);
      const T s = simt_score(p, sc, elementwise, scale, dot, i, j, th);
      const T pv = prim::acc_exp(s - prim::lds(s_lse + row0 + r));
      T mult = 1;
      if (p.dropout && i < p.Lq && j < p.Lk) {
        mult = drop.keep(dropout_element(p, bh, i, j)) ? keep_scale : T(0);
      }
      const T dp = kChunked ? prim::lds(mydS + r * 32 + lane)
                            : simt_dot(sdO + (row0 + r) * lddv, sV + lane * lddv, Dv);
      T ds = pv * (dp * mult - prim::lds(s_delta + row0 + r));
      if (p.softcap > 0.0) ds *= T(1) - th * th;
      prim::sts(mydS + r * 32 + lane, ds * scale);
    }
    prim::warp_sync();
    if constexpr (kChunked) {
      // Output column c of each lane from K chunk c; the last chunk is still in place.
#pragma unroll 1
      for (int c = n_chunks - 1; c >= 0; --c) {
        if (c * kChunk < D) {
          if (c != n_chunks - 1) {
            prim::block_sync();  // every warp is done with the chunk in place
            simt_load_tile(sK, ldk, Kg + c * kChunk, p.k_sl, j0, 32, p.Lk, D - c * kChunk, tid,
                           Cfg::kThreads);
            prim::block_sync();
          }
          simt_accumulate_col<T, kR, kCols>(dq, c, mydS, sK, ldk, lane + c * kChunk < D, lane);
        }
      }
    } else {
      simt_accumulate<T, kR, kCols>(dq, mydS, sK, ldd, D, lane);
    }
  }

  T* dQg = static_cast<T*>(params.dq) + b * params.dq_sb + h * params.dq_sh;
#pragma unroll
  for (int r = 0; r < kR; ++r) {
    const int i = i0 + row0 + r;
    if (i >= p.Lq) continue;
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      const int col = lane + 32 * c;
      if (col < D) prim::stg(dQg + i * params.dq_sl + col, dq[r][c]);
    }
  }
}

// Merges the float32 split-K partials of a forward (FwdParams::num_splits > 1) into out and lse,
// merge_attention's math: lse = log sum_s exp(lse_s), out = sum_s exp(lse_s - lse) out_s, in
// split order; rows where every split is empty get out 0 and lse -inf. One warp per row of
// (B, Hq, Lq) (dense layout: KV-cache problems); lanes own columns lane, lane + 32, ...
template <typename Elem, typename Storage>
__global__ void __launch_bounds__(256) attention_combine_kernel(const FwdParams params) {
  const Problem& p = params.p;
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * 8 + (threadIdx.x >> 5);
  const int64_t rows = static_cast<int64_t>(p.B) * p.Hq * p.Lq;
  if (row >= rows) return;  // whole warps leave together
  const int splits = params.num_splits;
  const int i = static_cast<int>(row % p.Lq);
  const int bh = static_cast<int>(row / p.Lq);
  const int b = bh / p.Hq, h = bh % p.Hq;
  float mx = -prim::inf_of<float>();
  for (int s = 0; s < splits; ++s) {
    const float ls = prim::ldg(params.part_lse + s * rows + row);
    mx = isnan(ls) || ls > mx ? ls : mx;  // fmaxf would drop a NaN split's lse: keep the row NaN
  }
  const bool empty = mx == -prim::inf_of<float>();
  float sum = 0.0f;
  if (!empty) {
    for (int s = 0; s < splits; ++s)
      sum += prim::acc_exp(prim::ldg(params.part_lse + s * rows + row) - mx);
  }
  const float lse = empty ? -prim::inf_of<float>() : mx + prim::acc_log(sum);
  Storage* O = static_cast<Storage*>(params.out) + b * params.o_sb + h * params.o_sh +
               static_cast<int64_t>(i) * params.o_sl;
  for (int d = lane; d < p.Dv; d += 32) {
    float acc = 0.0f;
    if (!empty) {
      for (int s = 0; s < splits; ++s) {
        const float ls = prim::ldg(params.part_lse + s * rows + row);
        if (ls == -prim::inf_of<float>()) continue;  // an empty split adds nothing
        acc += prim::acc_exp(ls - lse) * prim::ldg(params.part_out + (s * rows + row) * p.Dv + d);
      }
    }
    if constexpr (sizeof(Storage) == 2) {
      prim::stg(O + d, prim::from_float<Elem>(acc));
    } else {
      prim::stg(O + d, static_cast<Storage>(acc));
    }
  }
  if (lane == 0) prim::stg(static_cast<float*>(params.lse) + row, lse);
}

}  // namespace fastattn::cuda::attn
