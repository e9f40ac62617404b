// Device code shared by every CUDA attention kernel (tensor-core and SIMT): the score pipeline,
// dropout decisions and the tile ranges the window band leaves visible. Same definitions as
// attention_cpu_kernel.cpp (ScoreContext, dropout_tile, visible_key_blocks/visible_query_blocks).
#pragma once
#include <cstdint>

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
__device__ __forceinline__ bool has_elementwise(const Problem& p) {
  return p.softcap > 0.0 || p.alibi != nullptr || p.mask_kind != kMaskNone || p.padding != nullptr;
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
    slope = has_alibi ? static_cast<acc>(prim::ldg(p.alibi + b * p.alibi_sb + h * p.alibi_sh))
                      : acc(0);
    lo = p.window_lo;
    hi = p.window_hi;
    shift = p.Lk - p.Lq;
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

// Logical dropout element of (row i, key j) of slice bh = b * Hq + h.
__device__ __forceinline__ uint64_t dropout_element(const Problem& p, int bh, int i, int j) {
  return (static_cast<uint64_t>(bh) * static_cast<uint64_t>(p.Lq) + static_cast<uint64_t>(i)) *
             static_cast<uint64_t>(p.Lk) +
         static_cast<uint64_t>(j);
}

}  // namespace fastattn::cuda::attn
