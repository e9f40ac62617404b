// Device code shared by every CUDA attention kernel (tensor-core and SIMT): the score pipeline,
// dropout decisions and the tile ranges the window band leaves visible. Same definitions as
// attention_cpu_scores.h (ScoreContext, dropout_tile, visible_key_blocks/visible_query_blocks).
#pragma once
#include <cstdint>
#include <type_traits>

#include "attention/attention_cuda_params.h"
#include "attention/attention_cuda_prims.cuh"
#include "common/philox.h"

namespace fastattn::cuda::attn {

// Half-open range [first, last) of tiles.
struct TileRange {
  int first, last;
};

// The key tiles of size block_n that queries [i0, i0 + rows) (clipped to Lq) can see.
__device__ __forceinline__ TileRange visible_key_tiles(const Problem& p, int i0, int rows,
                                                       int block_n) {
  const int i_last = min(i0 + rows, p.Lq) - 1;
  const int j_lo = max(0, i0 + p.window_lo);
  const int j_hi = min(p.Lk - 1, i_last + p.window_hi);
  if (i_last < i0 || j_lo > j_hi) return {0, 0};
  return {j_lo / block_n, j_hi / block_n + 1};
}

// Split s of num_splits (split-K): an equal share of the tiles of r, possibly empty.
__device__ __forceinline__ TileRange split_range(TileRange r, int s, int num_splits) {
  if (num_splits <= 1) return r;
  const int per = (r.last - r.first + num_splits - 1) / num_splits;
  const int first = min(r.last, r.first + s * per);
  return {first, min(r.last, first + per)};
}

// The query tiles of size block_m that see some key of [j0, j0 + cols) (clipped to Lk).
__device__ __forceinline__ TileRange visible_query_tiles(const Problem& p, int j0, int cols,
                                                         int block_m) {
  const int j_last = min(j0 + cols, p.Lk) - 1;
  const int i_lo = max(0, j0 - p.window_hi);
  const int i_hi = min(p.Lq - 1, j_last - p.window_lo);
  if (j_last < j0 || i_lo > i_hi) return {0, 0};
  return {i_lo / block_m, i_hi / block_m + 1};
}

// Hot-path tests read the kernel parameters directly (constant bank): the Scores object below
// is used by the non-inlined element-wise path and therefore lives in local memory.

// Some feature needs every element: softcap, ALiBi, a mask or key padding.
__host__ __device__ __forceinline__ bool has_elementwise(const Problem& p) {
  return p.softcap > 0.0 || p.alibi != nullptr || p.mask_kind != kMaskNone || p.padding != nullptr;
}

// The tensor-core kernels' instantiation with the feature code (kFeatures): element-wise
// features, dropout, or a scale that is not positive (the plain path folds the scale into the
// exponent, so its running max of q.k must be the max of the scaled scores).
__host__ __device__ __forceinline__ bool needs_features(const Problem& p) {
  return has_elementwise(p) || p.dropout || !(p.scale > 0.0);
}

// Key j is visible to query i by the window band and exists.
__device__ __forceinline__ bool in_band(const Problem& p, int i, int j) {
  return j >= i + p.window_lo && j <= i + p.window_hi && j < p.Lk;
}

// Every key of [j0, j0 + N) exists and is inside the band of every query of [i0, i0 + M): then,
// without element-wise features, the score is scale * q.k exactly.
__device__ __forceinline__ bool tile_interior(const Problem& p, int i0, int M, int j0, int N) {
  return j0 + N <= p.Lk && i0 + M - 1 + p.window_lo <= j0 && j0 + N - 1 <= i0 + p.window_hi;
}

// The score without element-wise features: scale * q.k inside the band, else -inf.
template <typename acc>
__device__ __forceinline__ acc band_score(const Problem& p, acc scale, acc dot, int i, int j) {
  return in_band(p, i, j) ? dot * scale : -prim::inf_of<acc>();
}

// The score pipeline of one (batch, query head): s = scale * q.k; softcap; - ALiBi; + float
// mask; then the bool mask, key padding, window band and the end of the keys set -inf.
template <typename acc>
struct Scores {
  acc scale, cap, slope;
  int lo, hi, shift, Lq, Lk;
  int mask_kind;
  const void* mask;
  int64_t mask_off, msq, msk;  // element offset of (b, h) and the strides of i and j
  const uint8_t* pad;          // key_padding_mask row of batch b, or null
  bool has_cap, has_alibi;

  __device__ __forceinline__ void init(const Problem& p, int b, int h) {
    scale = static_cast<acc>(p.scale);
    cap = static_cast<acc>(p.softcap);
    has_cap = p.softcap > 0.0;
    has_alibi = p.alibi != nullptr;
    slope =
        has_alibi ? static_cast<acc>(prim::ldg(p.alibi + b * p.alibi_sb + h * p.alibi_sh)) : acc(0);
    lo = p.window_lo;
    hi = p.window_hi;
    shift = p.shift;
    Lq = p.Lq;
    Lk = p.Lk;
    mask_kind = p.mask_kind;
    mask = p.mask;
    mask_off = b * p.mask_sb + h * p.mask_sh;
    msq = p.mask_sq;
    msk = p.mask_sk;
    pad = p.padding != nullptr ? p.padding + static_cast<int64_t>(b) * p.Lk : nullptr;
  }

  __device__ __forceinline__ bool in_band(int i, int j) const {
    return j >= i + lo && j <= i + hi && j < Lk;
  }

  // The masked score of raw product `dot` at (i, j). t receives tanh(s / softcap) when softcap
  // is on (its derivative is needed by the backward). Rows i >= Lq read no mask.
  __device__ FASTATTN_NOINLINE acc operator()(acc dot, int i, int j, acc& t) const {
    acc s = dot * scale;
    if (has_cap) {
      t = prim::acc_tanh(s / cap);
      s = cap * t;
    }
    if (has_alibi) {
      const int dist = i + shift - j;
      s -= slope * static_cast<acc>(dist < 0 ? -dist : dist);
    }
    const bool exists = i < Lq && j < Lk;
    if (mask_kind != kMaskNone && exists) {
      const int64_t e = mask_off + static_cast<int64_t>(i) * msq + static_cast<int64_t>(j) * msk;
      switch (mask_kind) {
        case kMaskBool:
          if (prim::ldg(static_cast<const uint8_t*>(mask) + e) == 0) s = -prim::inf_of<acc>();
          break;
        case kMaskF32:
          s += static_cast<acc>(prim::ldg(static_cast<const float*>(mask) + e));
          break;
        case kMaskF64:
          s += static_cast<acc>(prim::ldg(static_cast<const double*>(mask) + e));
          break;
        case kMaskF16:
          s += static_cast<acc>(
              prim::to_float<prim::F16>(prim::ldg(static_cast<const uint16_t*>(mask) + e)));
          break;
        case kMaskBF16:
          s += static_cast<acc>(
              prim::to_float<prim::BF16>(prim::ldg(static_cast<const uint16_t*>(mask) + e)));
          break;
        default:
          break;
      }
    }
    if (pad != nullptr && j < Lk && prim::ldg(pad + j) != 0) s = -prim::inf_of<acc>();
    if (!in_band(i, j)) s = -prim::inf_of<acc>();
    return s;
  }
};

// Dropout decisions from the shared Philox stream (common/philox.h).
struct Dropout {
  uint64_t seed, stream;
  float threshold;

  __device__ __forceinline__ void init(const Problem& p) {
    seed = 0;
    stream = 0;
    threshold = p.dropout_threshold;
    if (p.dropout) {
      seed = static_cast<uint64_t>(prim::ldg(p.seed));
      stream = static_cast<uint64_t>(prim::ldg(p.seed + 1));
    }
  }

  // Word w (0..3) of a Philox block, selected without indexing an array by a run-time value
  // (which would put the block in local memory).
  static __device__ __forceinline__ uint32_t word(const Philox4& r, int w) {
    return w == 0 ? r.v[0] : w == 1 ? r.v[1] : w == 2 ? r.v[2] : r.v[3];
  }

  __device__ FASTATTN_NOINLINE bool keep(uint64_t e) const {
    const Philox4 r = philox_block(seed, stream, e >> 2);
    return philox_uniform(word(r, static_cast<int>(e & 3))) >= threshold;
  }

  // Keep bits of elements e (bit 0) and e + 1 (bit 1): one Philox block, or two when the pair
  // straddles a block boundary.
  __device__ FASTATTN_NOINLINE uint32_t keep2(uint64_t e) const {
    const Philox4 r = philox_block(seed, stream, e >> 2);
    const int w = static_cast<int>(e & 3);
    const bool k0 = philox_uniform(word(r, w)) >= threshold;
    uint32_t w1;
    if (w < 3) {
      w1 = word(r, w + 1);
    } else {
      w1 = philox_block(seed, stream, (e >> 2) + 1).v[0];
    }
    const bool k1 = philox_uniform(w1) >= threshold;
    return (k0 ? 1u : 0u) | (k1 ? 2u : 0u);
  }
};

// Logical dropout element of (row i, key j) of slice bh = b * Hq + h: dense
// ((b * Hq + h) * Lq + i) * Lk + j; varlen ((cu_q[b] + i) * Hq + h) * max_seqlen_k + j (the CPU
// varlen kernel's numbering; p is the sequence's view, whose Lk is then its own length).
__device__ __forceinline__ uint64_t dropout_element(const Problem& p, int bh, int i, int j) {
  if (p.cu_q != nullptr) {
    const int h = bh % p.Hq;
    return (static_cast<uint64_t>(p.q_row0 + i) * static_cast<uint64_t>(p.Hq) +
            static_cast<uint64_t>(h)) *
               static_cast<uint64_t>(p.drop_lk) +
           static_cast<uint64_t>(j);
  }
  return (static_cast<uint64_t>(bh) * static_cast<uint64_t>(p.Lq) + static_cast<uint64_t>(i)) *
             static_cast<uint64_t>(p.Lk) +
         static_cast<uint64_t>(j);
}

// Index of the lse (and Delta) entry of row i of (b, h): (B, Hq, Lq) dense and KV cache,
// (Hq, total_q) varlen.
__device__ __forceinline__ int64_t lse_index(const Problem& p, int b, int h, int i) {
  if (p.cu_q != nullptr) return static_cast<int64_t>(h) * p.total_q + p.q_row0 + i;
  return (static_cast<int64_t>(b) * p.Hq + h) * p.Lq + i;
}

// Adds v to d attn_mask at (b, h, i, j) (i < Lq, j < Lk) as BwdParams::dbias_mode says.
template <typename acc>
__device__ __forceinline__ void dbias_add(const BwdParams& params, int b, int h, int i, int j,
                                          acc v) {
  acc* ptr = static_cast<acc*>(params.dbias) + b * params.dbias_sb + h * params.dbias_sh +
             static_cast<int64_t>(i) * params.dbias_sq + static_cast<int64_t>(j) * params.dbias_sk;
  if (params.dbias_mode == kDBiasStore) {
    prim::stg(ptr, v);
  } else if (params.dbias_mode == kDBiasAdd) {  // only this thread adds here: plain load/store
    prim::stg(ptr, prim::ldg(ptr) + v);
  } else {
    prim::atomic_add(ptr, v);
  }
}

// The (batch, kv head) pairs of dK/dV block `blk` (blockIdx.x / key tiles): one, or with
// loop_b / loop_h > 1 (a deterministic d attn_mask broadcast over batches / kv heads) every
// batch and/or kv head in a fixed order, b outer. r-th pair of the block.
__device__ __forceinline__ void dkdv_pair(const BwdParams& params, int blk, int r, int& b,
                                          int& hk) {
  const int nh = params.p.Hkv / params.loop_h;
  b = (blk / nh) * params.loop_b + r / params.loop_h;
  hk = (blk % nh) * params.loop_h + r % params.loop_h;
}

__device__ __forceinline__ int elem_bytes(Dtype dt) {
  return dt == Dtype::f64 ? 8 : dt == Dtype::f32 ? 4 : 2;
}

template <typename T>
__device__ __forceinline__ T* advance(T* ptr, int64_t elems, int bytes) {
  using Byte = typename std::conditional<std::is_const<T>::value, const char, char>::type;
  return reinterpret_cast<T*>(reinterpret_cast<Byte*>(ptr) + elems * bytes);
}

// Turns a kernel's copy of the problem into the dense problem of sequence b (no-op for dense
// problems): its lengths, band and ALiBi shift, and q/k/v moved to its first packed rows
// (varlen). Returns the packed row offsets through q_row/k_row (0 when not varlen).
__device__ __forceinline__ void select_sequence(Problem& p, int b, int64_t& q_row, int64_t& k_row) {
  q_row = 0;
  k_row = 0;
  if (p.cu_q == nullptr && p.k_lengths == nullptr) return;
  int Lq = p.Lq, Lk, shift;
  if (p.cu_q != nullptr) {
    const int q0 = prim::ldg(p.cu_q + b), k0 = prim::ldg(p.cu_k + b);
    Lq = prim::ldg(p.cu_q + b + 1) - q0;
    Lk = prim::ldg(p.cu_k + b + 1) - k0;
    FASTATTN_DEVICE_CHECK(q0 >= 0 && k0 >= 0 && Lq >= 0 && Lk >= 0 && Lq <= p.Lq && Lk <= p.Lk &&
                          q0 + Lq <= p.total_q && k0 + Lk <= p.total_k);
    shift = Lk - Lq;
    q_row = q0;
    k_row = k0;
    p.q_row0 = q0;
    const int es = elem_bytes(p.dtype);
    p.q = advance(p.q, q_row * p.q_sl, es);
    p.k = advance(p.k, k_row * p.k_sl, es);
    p.v = advance(p.v, k_row * p.v_sl, es);
  } else {
    Lk = prim::ldg(p.k_lengths + b);
    shift = prim::ldg(p.q_positions + b);
    FASTATTN_DEVICE_CHECK(Lk >= 0 && Lk <= p.Lk && shift >= 0);
  }
  constexpr int64_t kUnbounded = int64_t{1} << 30;
  int64_t lo = p.window_left >= 0 ? int64_t{shift} - p.window_left : -kUnbounded;
  int64_t hi = p.window_right >= 0 ? int64_t{shift} + p.window_right : kUnbounded;
  if (p.causal_mode != 0) hi = min(hi, p.causal_mode == 1 ? int64_t{0} : int64_t{shift});
  // Same visibility with bounds in [-Lq, Lk] (as make_problem does for dense problems).
  p.window_lo = static_cast<int>(max(int64_t{-Lq}, min(int64_t{Lk}, lo)));
  p.window_hi = static_cast<int>(max(int64_t{-Lq}, min(int64_t{Lk}, hi)));
  p.shift = shift;
  p.Lq = Lq;
  p.Lk = Lk;
}

__device__ __forceinline__ void select_sequence(FwdParams& fp, int b) {
  int64_t q_row, k_row;
  select_sequence(fp.p, b, q_row, k_row);
  if (q_row != 0) fp.out = advance(fp.out, q_row * fp.o_sl, elem_bytes(fp.p.dtype));
}

__device__ __forceinline__ void select_sequence(BwdParams& bp, int b) {
  int64_t q_row, k_row;
  select_sequence(bp.p, b, q_row, k_row);
  const int es = elem_bytes(bp.p.dtype);
  bp.out = advance(bp.out, q_row * bp.o_sl, es);
  bp.dout = advance(bp.dout, q_row * bp.do_sl, es);
  bp.dq = advance(bp.dq, q_row * bp.dq_sl, es);
  bp.dk = advance(bp.dk, k_row * bp.dk_sl, es);
  bp.dv = advance(bp.dv, k_row * bp.dv_sl, es);
}

}  // namespace fastattn::cuda::attn
