// Forward kernel of fp16/bf16 attention on tensor cores (FlashAttention-2).
//
// One block of kWarps warps per (batch, query head, tile of kBlockM queries); warp w owns query
// rows [16 kMT w, 16 kMT (w + 1)) of the tile. The block walks the key tiles its queries can see
// (the window band bounds the loop, so causal attention skips the tiles above the diagonal):
//   S = Q K^T (mma_ss_nt) -> score pipeline -> online softmax in registers (row max and sum over
//   the 4 lanes of a row with shuffles) -> dropout -> O += P V (mma_rs_nn).
// Shared memory holds Q (once), one K tile and one V tile; the V copy overlaps S = Q K^T and
// the next K copy overlaps P V (cp.async groups, one barrier before each product).
// Same math as attention_forward_cpu_kernel.cpp: rows with no visible key give out 0 and lse -inf.
#pragma once
#include "attention/attention_cuda_common.cuh"
#include "attention/attention_cuda_mma.cuh"

namespace fastattn::cuda::attn {

template <int kHD_, int kMT_, int kWarps_, int kBlockN_>
struct FwdConfig {
  static constexpr int kHD = kHD_;  // head-dim bucket (>= max(D, Dv))
  static constexpr int kMT = kMT_;  // m16 tiles per warp
  static constexpr int kWarps = kWarps_;
  static constexpr int kBlockN = kBlockN_;  // keys per tile
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kBlockM = 16 * kMT * kWarps;
  static constexpr int kStride = SmemTile<kHD>::kStride;
  static constexpr int kNT = kBlockN / 8;  // n8 tiles of S
  static constexpr int kNTO = kHD / 8;     // n8 tiles of O
  static constexpr int kSmemBytes = (kBlockM + 2 * kBlockN) * kStride * 2;
};

// kFeatures = false is the plain path: no element-wise feature (mask, padding, ALiBi, softcap)
// and no dropout, compiled without their code, so the main loop holds no call of the
// out-of-line element-wise paths (FASTATTN_NOINLINE) and the kernel no stack frame for them.
// It also keeps the scores unscaled and folds the scale into the exponent (one FFMA per score,
// the running max in units of q.k): the launcher takes it only for a scale > 0.
template <typename Elem, typename Cfg, bool kFeatures>
__global__ void __launch_bounds__(Cfg::kThreads) attention_fwd_mma_kernel(const FwdParams args) {
  constexpr int kMT = Cfg::kMT, kNT = Cfg::kNT, kNTO = Cfg::kNTO, kHD = Cfg::kHD;
  constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN, kStride = Cfg::kStride;
  constexpr float kLog2e = 1.4426950408889634f;
  FwdParams params = args;  // select_sequence rewrites it for varlen / KV-cache problems
  const Problem& p = params.p;

  uint16_t* sQ = reinterpret_cast<uint16_t*>(prim::shared_base());
  uint16_t* sK = sQ + kBlockM * kStride;
  uint16_t* sV = sK + kBlockN * kStride;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  // Block -> (split, slice bh = b * Hq + h, query tile). The heaviest tiles of a causal
  // problem (the last ones) start first. Varlen grids cover the longest sequence: tiles past
  // the end of theirs leave at once.
  const int m_tiles = (p.Lq + kBlockM - 1) / kBlockM;
  const int64_t per_split = static_cast<int64_t>(m_tiles) * p.B * p.Hq;
  const int split = static_cast<int>(blockIdx.x / per_split);
  const int64_t block = blockIdx.x % per_split;
  const int bh = static_cast<int>(block / m_tiles);
  const int m_tile = m_tiles - 1 - static_cast<int>(block % m_tiles);
  const int b = bh / p.Hq, h = bh % p.Hq, hk = h / p.group;
  const int i0 = m_tile * kBlockM;
  const int warp_row0 = warp * 16 * kMT;  // first tile row of this warp
  FASTATTN_DEVICE_CHECK(b < p.B && split < max(params.num_splits, 1));
  FASTATTN_DEVICE_CHECK(kFeatures || !needs_features(p));
  select_sequence(params, b);
  if (i0 >= p.Lq) return;  // the whole block: past the end of a shorter sequence

  const uint16_t* Qg = static_cast<const uint16_t*>(p.q) + b * p.q_sb + h * p.q_sh;
  // A paged KV cache's tiles are read through the sequence's row of the block table.
  const bool paged = p.block_table != nullptr;
  const int32_t* table = paged ? p.block_table + b * p.block_table_stride : nullptr;
  const RowMap k_rows{table, p.page_size, p.k_sb}, v_rows{table, p.page_size, p.v_sb};
  const uint16_t* Kg = static_cast<const uint16_t*>(p.k) + (paged ? 0 : b * p.k_sb) + hk * p.k_sh;
  const uint16_t* Vg = static_cast<const uint16_t*>(p.v) + (paged ? 0 : b * p.v_sb) + hk * p.v_sh;

  Scores<float> sc;  // element-wise path only (local memory)
  Dropout drop;
  if constexpr (kFeatures) {
    sc.init(p, b, h);
    drop.init(p);
  }
  const float scale = static_cast<float>(p.scale);
  // The exponent's factor of a score: log2(e) on scaled scores, scale * log2(e) on plain ones.
  const float exp_factor = kFeatures ? kLog2e : scale * kLog2e;
  const bool elementwise = kFeatures && has_elementwise(p);
  const float keep_scale = static_cast<float>(p.keep_scale);
  const int ksteps_qk = (p.D + 15) / 16;   // k-steps of Q K^T that touch real columns
  const int npairs_pv = (p.Dv + 15) / 16;  // 16-column groups of O that hold real columns

  float o[kMT][kNTO][4];
  zero(o);
  float m_run[kMT][2], l_run[kMT][2];  // running max (log domain) and lane-partial row sums
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      m_run[mt][r] = -prim::inf_of<float>();
      l_run[mt][r] = 0.0f;
    }

  const TileRange kt =
      split_range(visible_key_tiles(p, i0, kBlockM, kBlockN), split, params.num_splits);
  FASTATTN_DEVICE_CHECK(kt.first >= 0 && (kt.first == kt.last || (kt.last - 1) * kBlockN < p.Lk));
  if (kt.first < kt.last) {
    load_tile<kBlockM, kHD, Cfg::kThreads>(sQ, Qg, p.q_sl, i0, p.Lq, p.D, p.q_aligned, tid);
    load_tile<kBlockN, kHD, Cfg::kThreads>(sK, Kg, p.k_sl, kt.first * kBlockN, p.Lk, p.D,
                                           p.k_aligned, tid, k_rows);
    prim::cp_async_commit();
  }

  for (int n_tile = kt.first; n_tile < kt.last; ++n_tile) {
    const int j0 = n_tile * kBlockN;
    // K[n_tile] (and Q) have landed; every warp is done with V[n_tile - 1].
    prim::cp_async_wait<0>();
    prim::block_sync();
    load_tile<kBlockN, kHD, Cfg::kThreads>(sV, Vg, p.v_sl, j0, p.Lk, p.Dv, p.v_aligned, tid,
                                           v_rows);
    prim::cp_async_commit();

    float s[kMT][kNT][4];
    zero(s);
    mma_ss_nt<Elem, kMT, kNT, kHD>(s, sQ, warp_row0, sK, 0, ksteps_qk, lane);

    // Score pipeline; tiles inside the band without element-wise features only scale.
    const bool full = !elementwise && tile_interior(p, i0 + warp_row0, 16 * kMT, j0, kBlockN);
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = i0 + warp_row0 + mt * 16 + g + (e >> 1) * 8;
          const int j = j0 + nt * 8 + 2 * t + (e & 1);
          if constexpr (!kFeatures) {  // unscaled: q.k inside the band, else -inf
            if (!full && !in_band(p, i, j)) s[mt][nt][e] = -prim::inf_of<float>();
          } else if (full) {
            s[mt][nt][e] *= scale;
          } else if (!elementwise) {
            s[mt][nt][e] = band_score(p, scale, s[mt][nt][e], i, j);
          } else {
            float unused;
            s[mt][nt][e] = sc(s[mt][nt][e], i, j, unused);
          }
        }

    // Online softmax. Row (mt, r) of this lane is tile row warp_row0 + 16 mt + g + 8 r; its
    // values live in the 4 lanes 4g .. 4g+3 (xor 1, 2).
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float mx = -prim::inf_of<float>();
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt)
          mx = fmaxf(mx, fmaxf(s[mt][nt][2 * r], s[mt][nt][2 * r + 1]));
        mx = fmaxf(mx, prim::shfl_xor(mx, 1));
        mx = fmaxf(mx, prim::shfl_xor(mx, 2));
        const float m_new = fmaxf(m_run[mt][r], mx);
        // No visible key so far in this row: use 0 as the shift, so that exp(-inf - 0) = 0
        // instead of exp(-inf + inf) = NaN.
        const float m_use = m_new == -prim::inf_of<float>() ? 0.0f : m_new;
        const float shift = m_use * exp_factor;
        const float alpha = prim::fast_exp2(m_run[mt][r] * exp_factor - shift);  // 0 when m = -inf
        float sum = 0.0f;
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const float pv = prim::fast_exp2(s[mt][nt][2 * r + c] * exp_factor - shift);
            s[mt][nt][2 * r + c] = pv;
            sum += pv;
          }
        l_run[mt][r] = l_run[mt][r] * alpha + sum;
        m_run[mt][r] = m_new;
#pragma unroll
        for (int nt = 0; nt < kNTO; ++nt) {
          o[mt][nt][2 * r] *= alpha;
          o[mt][nt][2 * r + 1] *= alpha;
        }
      }

    // Dropout multiplies the probabilities that reach P V (the row sums keep every term).
    if (kFeatures && p.dropout) {
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int i = i0 + warp_row0 + mt * 16 + g + 8 * r;
          if (i >= p.Lq) continue;  // rows past Lq are never stored
#pragma unroll
          for (int nt = 0; nt < kNT; ++nt) {
            const int j = j0 + nt * 8 + 2 * t;
            const uint32_t bits = drop.keep2(dropout_element(p, bh, i, j));
            s[mt][nt][2 * r] *= (bits & 1u) ? keep_scale : 0.0f;
            s[mt][nt][2 * r + 1] *= (bits & 2u) ? keep_scale : 0.0f;
          }
        }
    }

    uint32_t pa[kMT][kNT / 2][4];
    to_a_frags<Elem, kMT, kNT>(s, pa);

    // V[n_tile] has landed; every warp is done with K[n_tile].
    prim::cp_async_wait<0>();
    prim::block_sync();
    if (n_tile + 1 < kt.last) {
      load_tile<kBlockN, kHD, Cfg::kThreads>(sK, Kg, p.k_sl, j0 + kBlockN, p.Lk, p.D, p.k_aligned,
                                             tid, k_rows);
    }
    prim::cp_async_commit();
    mma_rs_nn<Elem, kMT, kNT / 2, kNTO, kHD>(o, pa, sV, 0, npairs_pv, lane);
  }

  // Normalise, write out (rows < Lq, cols < Dv) and lse = m + log(l); split-K blocks write
  // their float32 partials instead.
  const bool partial = params.num_splits > 1;
  float* lse = partial ? params.part_lse + (static_cast<int64_t>(split) * p.B * p.Hq + bh) * p.Lq
                       : static_cast<float*>(params.lse) + lse_index(p, b, h, 0);
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float l = l_run[mt][r];
      l += prim::shfl_xor(l, 1);
      l += prim::shfl_xor(l, 2);
      const bool empty = l == 0.0f;  // no visible key: out 0, lse -inf (a NaN l stays NaN)
      const float inv = empty ? 0.0f : 1.0f / l;
#pragma unroll
      for (int nt = 0; nt < kNTO; ++nt) {  // a select for empty rows: o may hold 0 * NaN
        o[mt][nt][2 * r] = empty ? 0.0f : o[mt][nt][2 * r] * inv;
        o[mt][nt][2 * r + 1] = empty ? 0.0f : o[mt][nt][2 * r + 1] * inv;
      }
      const int i = i0 + warp_row0 + mt * 16 + g + 8 * r;
      if (t == 0 && i < p.Lq) {
        const float m = kFeatures ? m_run[mt][r] : m_run[mt][r] * scale;  // scaled units
        prim::stg(lse + i, empty ? -prim::inf_of<float>() : m + prim::acc_log(l));
      }
    }
  if (partial) {
    float* Pg = params.part_out + ((static_cast<int64_t>(split) * p.B * p.Hq + bh) * p.Lq) * p.Dv;
    store_rows_f32<kMT, kNTO>(o, Pg, p.Dv, i0 + warp_row0, p.Lq, p.Dv, lane);
    return;
  }
  uint16_t* Og = static_cast<uint16_t*>(params.out) + b * params.o_sb + h * params.o_sh;
  const bool pair_aligned = (reinterpret_cast<uintptr_t>(params.out) % 4 == 0) &&
                            params.o_sb % 2 == 0 && params.o_sh % 2 == 0 && params.o_sl % 2 == 0;
  store_rows<Elem, kMT, kNTO>(o, Og, params.o_sl, i0 + warp_row0, p.Lq, p.Dv, pair_aligned, lane);
}

}  // namespace fastattn::cuda::attn
