// Backward kernels of fp16/bf16 attention on tensor cores. Deterministic by construction: no
// atomics, every output element is written by one thread that sums in a fixed order. The one
// exception is d attn_mask (mask_grad) of a mask broadcast over batches or kv heads with
// deterministic=False, added atomically by the dK/dV kernel (BwdParams::dbias_mode).
//
//   delta kernel   Delta_i = rowsum(dO_i * O_i) - grad_lse_i (d lse_i / d s_ij = P_ij)
//   dK/dV kernel   one block per (batch, kv head, tile of 64 keys); warp w owns keys
//                  [16 w, 16 w + 16). It loops over the query heads of the group and the query
//                  tiles that see its keys, recomputes S^T = K Q^T and P^T = exp(S^T - lse),
//                  dP^T = V dO^T, dS^T = P^T (dP^T * dropout - Delta) (* softcap' ) * scale, and
//                  accumulates dV += (P^T * dropout) dO and dK += dS^T Q in registers.
//   dQ kernel      one block per (batch, query head, tile of 64 queries); loops over the key
//                  tiles its queries see: S = Q K^T, dP = dO V^T, dS as above, dQ += dS K.
// dP is computed before S so that dS is formed right where P is (no register array has to
// carry P or tanh across a product). Q/dO (dK/dV kernel) or K/V (dQ kernel) tiles are double
// buffered with cp.async when shared memory allows (kStages = 2).
#pragma once
#include "attention/attention_cuda_common.cuh"
#include "attention/attention_cuda_mma.cuh"

namespace fastattn::cuda::attn {

// Which gradients a dK/dV launch accumulates (head dim 256 runs one launch per gradient so that
// the accumulators of both never share the register file).
enum : int { kOutDV = 1, kOutDK = 2, kOutBoth = 3 };

template <typename Elem>
__device__ __forceinline__ float load_elem(const uint16_t* p) {
  return prim::to_float<Elem>(prim::ldg(p));
}

// Delta_i = sum_d dO[i, d] O[i, d] - grad_lse_i in the compute type, one warp per row; lanes sum
// columns lane, lane + 32, ... and a fixed xor tree adds the lanes (deterministic).
template <typename Elem, typename acc, typename Storage>
__global__ void __launch_bounds__(256) attention_bwd_delta_kernel(const BwdParams params) {
  const Problem& p = params.p;
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * 8 + (threadIdx.x >> 5);
  // Rows are numbered like lse: (B, Hq, Lq), or (Hq, total_q) for varlen (b = 0, i = the packed
  // row: out and grad_out are packed with batch stride 0).
  const int L = p.cu_q != nullptr ? p.total_q : p.Lq;
  const int64_t rows = static_cast<int64_t>(p.cu_q != nullptr ? 1 : p.B) * p.Hq * L;
  if (row >= rows) return;  // whole warps leave together
  const int i = static_cast<int>(row % L);
  const int bh = static_cast<int>(row / L);
  const int b = bh / p.Hq, h = bh % p.Hq;
  const Storage* O = static_cast<const Storage*>(params.out) + b * params.o_sb + h * params.o_sh +
                     static_cast<int64_t>(i) * params.o_sl;
  const Storage* dO = static_cast<const Storage*>(params.dout) + b * params.do_sb +
                      h * params.do_sh + static_cast<int64_t>(i) * params.do_sl;
  acc sum = 0;
  for (int d = lane; d < p.Dv; d += 32) {
    if constexpr (sizeof(Storage) == 2) {
      sum += static_cast<acc>(load_elem<Elem>(O + d)) * static_cast<acc>(load_elem<Elem>(dO + d));
    } else {
      sum += prim::ldg(O + d) * prim::ldg(dO + d);
    }
  }
#pragma unroll
  for (int m = 16; m >= 1; m >>= 1) sum += prim::shfl_xor(sum, m);
  if (lane == 0) {
    const acc* dlse = static_cast<const acc*>(params.dlse);
    prim::stg(static_cast<acc*>(params.delta) + row,
              sum - (dlse != nullptr ? prim::ldg(dlse + row) : acc(0)));
  }
}

// ---------------------------------------------------------------------------------------------
// dK / dV

template <int kHD_, int kStages_, int kOut_, int kBlockM_ = 64>
struct BwdKVConfig {
  static constexpr int kHD = kHD_;
  static constexpr int kStages = kStages_;  // buffers of the Q/dO tiles
  static constexpr int kOut = kOut_;
  static constexpr int kWarps = 4;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kBlockN = 16 * kWarps;  // keys per block
  static constexpr int kBlockM = kBlockM_;     // queries per step
  // The query columns of S^T / dP^T become the k16 steps of dV and dK (to_a_frags), and the
  // stage selection below only knows one or two buffers.
  static_assert(kBlockM % 16 == 0 && kBlockM >= 16, "queries per step: a multiple of 16");
  static_assert(kStages == 1 || kStages == 2, "one or two Q/dO buffers");
  static_assert(kOut == kOutDV || kOut == kOutDK || kOut == kOutBoth, "which gradients");
  static constexpr int kStride = SmemTile<kHD>::kStride;
  static constexpr int kNT = kBlockM / 8;  // n8 tiles of S^T (query columns)
  static constexpr int kNTO = kHD / 8;     // n8 tiles of dK/dV
  static constexpr int kTileElems = kBlockM * kStride;
  // sK, sV, then per stage sQ, sdO; then per stage lse[kBlockM], delta[kBlockM] (float).
  static constexpr int kSmemBytes =
      (2 * kBlockN * kStride + kStages * 2 * kTileElems) * 2 + kStages * 2 * kBlockM * 4;
};

// Step `it` of the (query head, query tile) loop of a dK/dV block -> its head and first query.
struct KVStep {
  int h, i0;
};

__device__ __forceinline__ KVStep kv_step(int it, int hk, int group, int q_first, int q_count,
                                          int block_m) {
  return {hk * group + it / q_count, (q_first + it % q_count) * block_m};
}

// Issues the copies of step `it` into stage buffers: Q and dO tiles (cp.async or scalar) and
// the lse/Delta of its rows (plain shared stores; lse -inf, the rows without a visible key,
// and rows past Lq become +inf so that exp(s - lse) = 0 there).
template <typename Elem, typename Cfg>
__device__ __forceinline__ void kv_issue(const BwdParams& params, int b, KVStep step, uint16_t* sQ,
                                         uint16_t* sdO, float* s_lse, float* s_delta, int tid) {
  const Problem& p = params.p;
  const uint16_t* Qg = static_cast<const uint16_t*>(p.q) + b * p.q_sb + step.h * p.q_sh;
  const uint16_t* dOg =
      static_cast<const uint16_t*>(params.dout) + b * params.do_sb + step.h * params.do_sh;
  load_tile<Cfg::kBlockM, Cfg::kHD, Cfg::kThreads>(sQ, Qg, p.q_sl, step.i0, p.Lq, p.D, p.q_aligned,
                                                   tid);
  load_tile<Cfg::kBlockM, Cfg::kHD, Cfg::kThreads>(sdO, dOg, params.do_sl, step.i0, p.Lq, p.Dv,
                                                   params.do_aligned, tid);
  const int64_t row0 = lse_index(p, b, step.h, 0);
  for (int r = tid; r < Cfg::kBlockM; r += Cfg::kThreads) {
    const int i = step.i0 + r;
    float lse = prim::inf_of<float>(), delta = 0.0f;
    if (i < p.Lq) {
      lse = prim::ldg(static_cast<const float*>(params.lse) + row0 + i);
      if (lse == -prim::inf_of<float>()) lse = prim::inf_of<float>();
      delta = prim::ldg(static_cast<const float*>(params.delta) + row0 + i);
    }
    prim::sts(s_lse + r, lse);
    prim::sts(s_delta + r, delta);
  }
}

// The work of a dK/dV block for one (batch b, kv head hk) and key tile n_tile.
// kFeatures = false: the plain path (attention_fwd_mma_kernel's), without the code of the
// element-wise features and dropout, the scale folded into the exponent. kDBias (with kFeatures):
// also add dS to d attn_mask (a separate instantiation, so that the kernels of a backward without
// it keep their registers: the dS adds cost some spills at head dims 128/256).
template <typename Elem, typename Cfg, bool kFeatures, bool kDBias>
__device__ __forceinline__ void attention_bwd_dkdv_mma_block(const BwdParams& args, int b, int hk,
                                                             int n_tile) {
  constexpr int kHD = Cfg::kHD, kNT = Cfg::kNT, kNTO = Cfg::kNTO, kStride = Cfg::kStride;
  constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN, kStages = Cfg::kStages;
  constexpr bool kDV = (Cfg::kOut & kOutDV) != 0, kDK = (Cfg::kOut & kOutDK) != 0;
  constexpr float kLog2e = 1.4426950408889634f;
  BwdParams params = args;  // select_sequence rewrites it for varlen problems
  const Problem& p = params.p;

  uint16_t* sK = reinterpret_cast<uint16_t*>(prim::shared_base());
  uint16_t* sV = sK + kBlockN * kStride;
  uint16_t* sQ0 = sV + kBlockN * kStride;  // stage s: sQ0 + 2 s kTileElems, its dO right after
  float* s_lse0 = reinterpret_cast<float*>(sQ0 + kStages * 2 * Cfg::kTileElems);
  float* s_delta0 = s_lse0 + kStages * kBlockM;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int j0 = n_tile * kBlockN;
  const int warp_row0 = warp * 16;  // this warp's keys within the tile
  FASTATTN_DEVICE_CHECK(b < p.B);
  select_sequence(params, b);
  if (j0 >= p.Lk) return;  // the whole block: past the end of a shorter sequence

  const TileRange qt = visible_query_tiles(p, j0, kBlockN, kBlockM);
  const int q_count = qt.last - qt.first;
  const int steps = p.group * q_count;

  float dv_acc[1][kDV ? kNTO : 2][4];
  float dk_acc[1][kDK ? kNTO : 2][4];
  zero(dv_acc);
  zero(dk_acc);

  if (steps > 0) {
    const uint16_t* Kg = static_cast<const uint16_t*>(p.k) + b * p.k_sb + hk * p.k_sh;
    const uint16_t* Vg = static_cast<const uint16_t*>(p.v) + b * p.v_sb + hk * p.v_sh;
    load_tile<kBlockN, kHD, Cfg::kThreads>(sK, Kg, p.k_sl, j0, p.Lk, p.D, p.k_aligned, tid);
    if constexpr (kDK) {
      load_tile<kBlockN, kHD, Cfg::kThreads>(sV, Vg, p.v_sl, j0, p.Lk, p.Dv, p.v_aligned, tid);
    }
    if (kStages == 2) {
      kv_issue<Elem, Cfg>(params, b, kv_step(0, hk, p.group, qt.first, q_count, kBlockM), sQ0,
                          sQ0 + Cfg::kTileElems, s_lse0, s_delta0, tid);
    }
    prim::cp_async_commit();
  }

  Dropout drop;
  if constexpr (kFeatures) drop.init(p);
  const float keep_scale = static_cast<float>(p.keep_scale);
  const float scale = static_cast<float>(p.scale);
  const bool elementwise = kFeatures && has_elementwise(p);
  const bool has_cap = kFeatures && p.softcap > 0.0, dropout = kFeatures && p.dropout;
  const float scale_log2 = scale * kLog2e;
  const int ksteps_d = (p.D + 15) / 16, ksteps_dv = (p.Dv + 15) / 16;
  const int npairs_d = ksteps_d, npairs_dv = ksteps_dv;
  // d attn_mask: computed with dS, so by the launch that accumulates dK.
  constexpr bool dbias = kDK && kDBias;

  for (int it = 0; it < steps; ++it) {
    const int st = kStages == 2 ? (it & 1) : 0;
    const KVStep step = kv_step(it, hk, p.group, qt.first, q_count, kBlockM);
    FASTATTN_DEVICE_CHECK(step.h < p.Hq && step.h / p.group == hk && step.i0 < p.Lq);
    uint16_t* sQ = sQ0 + st * 2 * Cfg::kTileElems;
    uint16_t* sdO = sQ + Cfg::kTileElems;
    float* s_lse = s_lse0 + st * kBlockM;
    float* s_delta = s_delta0 + st * kBlockM;
    if (kStages == 1) {
      prim::block_sync();  // every warp is done with the previous step's tiles
      kv_issue<Elem, Cfg>(params, b, step, sQ, sdO, s_lse, s_delta, tid);
      prim::cp_async_commit();
    }
    prim::cp_async_wait<0>();
    prim::block_sync();  // this step's tiles have landed; the other stage is free
    if (kStages == 2) {
      if (it + 1 < steps) {
        const int nst = (it + 1) & 1;
        uint16_t* nQ = sQ0 + nst * 2 * Cfg::kTileElems;
        kv_issue<Elem, Cfg>(params, b, kv_step(it + 1, hk, p.group, qt.first, q_count, kBlockM), nQ,
                            nQ + Cfg::kTileElems, s_lse0 + nst * kBlockM, s_delta0 + nst * kBlockM,
                            tid);
      }
      prim::cp_async_commit();
    }

    Scores<float> sc;  // element-wise path only (local memory)
    if constexpr (kFeatures) sc.init(p, b, step.h);
    const int bh = b * p.Hq + step.h;

    // dP^T = V dO^T (only for dK), then S^T = K Q^T; rows = this warp's 16 keys, columns =
    // the step's kBlockM queries.
    float dpt[1][kNT][4];
    zero(dpt);
    if constexpr (kDK) mma_ss_nt<Elem, 1, kNT, kHD>(dpt, sV, warp_row0, sdO, 0, ksteps_dv, lane);
    float sst[1][kNT][4];
    zero(sst);
    mma_ss_nt<Elem, 1, kNT, kHD>(sst, sK, warp_row0, sQ, 0, ksteps_d, lane);

    const bool full = !elementwise && tile_interior(p, step.i0, kBlockM, j0 + warp_row0, 16);
    float qsum[2] = {0.0f, 0.0f};  // d attn_mask summed over the step's queries (dbias_sum_q)
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int j = j0 + warp_row0 + g + (e >> 1) * 8;  // key (row)
        const int ic = nt * 8 + 2 * t + (e & 1);          // query column in the step
        const int i = step.i0 + ic;
        float th = 0.0f;
        float pval;
        if constexpr (kFeatures) {
          float s = full ? sst[0][nt][e] * scale : band_score(p, scale, sst[0][nt][e], i, j);
          if (elementwise) s = sc(sst[0][nt][e], i, j, th);
          pval = prim::fast_exp2((s - prim::lds(s_lse + ic)) * kLog2e);
        } else {  // the scale folded into the exponent (scale > 0)
          const float raw = full || in_band(p, i, j) ? sst[0][nt][e] : -prim::inf_of<float>();
          pval = prim::fast_exp2(raw * scale_log2 - prim::lds(s_lse + ic) * kLog2e);
        }
        float mult = 1.0f;
        if (dropout && i < p.Lq && j < p.Lk) {
          mult = drop.keep(dropout_element(p, bh, i, j)) ? keep_scale : 0.0f;
        }
        sst[0][nt][e] = pval * mult;  // P^T with dropout: the A operand of dV
        if constexpr (kDK) {
          float ds = pval * (dpt[0][nt][e] * mult - prim::lds(s_delta + ic));
          if constexpr (dbias) {  // the masked score's gradient (after softcap)
            if (i < p.Lq && j < p.Lk) {
              if (params.dbias_sum_q) {
                qsum[e >> 1] += ds;
              } else {
                dbias_add<float>(params, b, step.h, i, j, ds);
              }
            }
          }
          if (has_cap) ds *= 1.0f - th * th;
          dpt[0][nt][e] = ds * scale;  // dS^T: the A operand of dK
        }
      }
    if constexpr (dbias) {
      if (params.dbias_sum_q) {
        // Rows g and g + 8: the four lanes t of a row hold its columns; a fixed xor tree.
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          qsum[r] += prim::shfl_xor(qsum[r], 1);
          qsum[r] += prim::shfl_xor(qsum[r], 2);
          const int j = j0 + warp_row0 + g + 8 * r;
          if (t == 0 && j < p.Lk) dbias_add<float>(params, b, step.h, 0, j, qsum[r]);
        }
      }
    }

    if constexpr (kDV) {
      uint32_t a[1][kNT / 2][4];
      to_a_frags<Elem, 1, kNT>(sst, a);
      mma_rs_nn<Elem, 1, kNT / 2, kNTO, kHD>(dv_acc, a, sdO, 0, npairs_dv, lane);
    }
    if constexpr (kDK) {
      uint32_t a[1][kNT / 2][4];
      to_a_frags<Elem, 1, kNT>(dpt, a);
      mma_rs_nn<Elem, 1, kNT / 2, kNTO, kHD>(dk_acc, a, sQ, 0, npairs_d, lane);
    }
  }
  prim::cp_async_wait<0>();  // nothing may land after the block exits

  // Rows j0 + warp_row0 + (g, g+8) of dK (B, Hkv, Lk, D) and dV (B, Hkv, Lk, Dv) (varlen:
  // packed); every stride is a multiple of the row length.
  if constexpr (kDV) {
    store_rows<Elem, 1, kNTO>(
        dv_acc, static_cast<uint16_t*>(params.dv) + b * params.dv_sb + hk * params.dv_sh,
        params.dv_sl, j0 + warp_row0, p.Lk, p.Dv, p.Dv % 2 == 0, lane);
  }
  if constexpr (kDK) {
    store_rows<Elem, 1, kNTO>(
        dk_acc, static_cast<uint16_t*>(params.dk) + b * params.dk_sb + hk * params.dk_sh,
        params.dk_sl, j0 + warp_row0, p.Lk, p.D, p.D % 2 == 0, lane);
  }
}

// One block per (key tile, batch, kv head); with kDBias per (key tile, dkdv_pair group): the
// pairs' work one after another.
template <typename Elem, typename Cfg, bool kFeatures, bool kDBias>
__global__ void __launch_bounds__(Cfg::kThreads)
    attention_bwd_dkdv_mma_kernel(const BwdParams args) {
  static_assert(kFeatures || !kDBias, "d attn_mask comes with a mask, an element-wise feature");
  const int n_tiles = (args.p.Lk + Cfg::kBlockN - 1) / Cfg::kBlockN;
  const int blk = static_cast<int>(blockIdx.x / n_tiles);  // b * Hkv + hk without kDBias
  const int n_tile = static_cast<int>(blockIdx.x % n_tiles);
  if constexpr (!kDBias) {
    attention_bwd_dkdv_mma_block<Elem, Cfg, kFeatures, false>(args, blk / args.p.Hkv,
                                                              blk % args.p.Hkv, n_tile);
  } else {
    for (int r = 0; r < args.loop_b * args.loop_h; ++r) {
      int b, hk;
      dkdv_pair(args, blk, r, b, hk);
      if (r > 0) prim::block_sync();  // every warp is done with the previous pair's tiles
      attention_bwd_dkdv_mma_block<Elem, Cfg, true, true>(args, b, hk, n_tile);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// dQ

template <int kHD_, int kStages_, int kBlockN_>
struct BwdQConfig {
  static constexpr int kHD = kHD_;
  static constexpr int kStages = kStages_;  // buffers of the K/V tiles
  static constexpr int kWarps = 4;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kBlockM = 16 * kWarps;  // queries per block
  static constexpr int kBlockN = kBlockN_;     // keys per step
  // The key columns of S / dP become the k16 steps of dQ (to_a_frags).
  static_assert(kBlockN % 16 == 0 && kBlockN >= 16, "keys per step: a multiple of 16");
  static_assert(kStages == 1 || kStages == 2, "one or two K/V buffers");
  static constexpr int kStride = SmemTile<kHD>::kStride;
  static constexpr int kNT = kBlockN / 8;
  static constexpr int kNTO = kHD / 8;
  static constexpr int kQElems = kBlockM * kStride;
  static constexpr int kKVElems = kBlockN * kStride;
  // sQ, sdO, then per stage sK, sV.
  static constexpr int kSmemBytes = (2 * kQElems + kStages * 2 * kKVElems) * 2;
};

// kFeatures = false: the plain path (attention_fwd_mma_kernel's, the scale folded into the
// exponent as there).
template <typename Elem, typename Cfg, bool kFeatures>
__global__ void __launch_bounds__(Cfg::kThreads) attention_bwd_dq_mma_kernel(const BwdParams args) {
  constexpr int kHD = Cfg::kHD, kNT = Cfg::kNT, kNTO = Cfg::kNTO;
  constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN, kStages = Cfg::kStages;
  constexpr float kLog2e = 1.4426950408889634f;
  BwdParams params = args;  // select_sequence rewrites it for varlen problems
  const Problem& p = params.p;

  uint16_t* sQ = reinterpret_cast<uint16_t*>(prim::shared_base());
  uint16_t* sdO = sQ + Cfg::kQElems;
  uint16_t* sK0 = sdO + Cfg::kQElems;  // stage s: sK0 + 2 s kKVElems, its V right after

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int m_tiles = (p.Lq + kBlockM - 1) / kBlockM;
  const int bh = blockIdx.x / m_tiles;
  const int m_tile = m_tiles - 1 - static_cast<int>(blockIdx.x % m_tiles);
  const int b = bh / p.Hq, h = bh % p.Hq, hk = h / p.group;
  const int i0 = m_tile * kBlockM;
  const int warp_row0 = warp * 16;
  FASTATTN_DEVICE_CHECK(b < p.B);
  select_sequence(params, b);
  if (i0 >= p.Lq) return;  // the whole block: past the end of a shorter sequence

  const uint16_t* Kg = static_cast<const uint16_t*>(p.k) + b * p.k_sb + hk * p.k_sh;
  const uint16_t* Vg = static_cast<const uint16_t*>(p.v) + b * p.v_sb + hk * p.v_sh;
  const TileRange kt = visible_key_tiles(p, i0, kBlockM, kBlockN);
  const int steps = kt.last - kt.first;
  FASTATTN_DEVICE_CHECK(steps == 0 || (kt.last - 1) * kBlockN < p.Lk);

  // lse and Delta of this lane's rows g and g + 8 (lse +inf: no visible key or past Lq).
  float lse_r[2], delta_r[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int i = i0 + warp_row0 + g + 8 * r;
    lse_r[r] = prim::inf_of<float>();
    delta_r[r] = 0.0f;
    if (i < p.Lq) {
      const int64_t row = lse_index(p, b, h, i);
      const float l = prim::ldg(static_cast<const float*>(params.lse) + row);
      lse_r[r] = l == -prim::inf_of<float>() ? prim::inf_of<float>() : l;
      delta_r[r] = prim::ldg(static_cast<const float*>(params.delta) + row);
    }
  }

  if (steps > 0) {
    const uint16_t* Qg = static_cast<const uint16_t*>(p.q) + b * p.q_sb + h * p.q_sh;
    const uint16_t* dOg =
        static_cast<const uint16_t*>(params.dout) + b * params.do_sb + h * params.do_sh;
    load_tile<kBlockM, kHD, Cfg::kThreads>(sQ, Qg, p.q_sl, i0, p.Lq, p.D, p.q_aligned, tid);
    load_tile<kBlockM, kHD, Cfg::kThreads>(sdO, dOg, params.do_sl, i0, p.Lq, p.Dv,
                                           params.do_aligned, tid);
    if (kStages == 2) {
      const int j = kt.first * kBlockN;
      load_tile<kBlockN, kHD, Cfg::kThreads>(sK0, Kg, p.k_sl, j, p.Lk, p.D, p.k_aligned, tid);
      load_tile<kBlockN, kHD, Cfg::kThreads>(sK0 + Cfg::kKVElems, Vg, p.v_sl, j, p.Lk, p.Dv,
                                             p.v_aligned, tid);
    }
    prim::cp_async_commit();
  }

  Scores<float> sc;  // element-wise path only (local memory)
  Dropout drop;
  if constexpr (kFeatures) {
    sc.init(p, b, h);
    drop.init(p);
  }
  const float keep_scale = static_cast<float>(p.keep_scale);
  const float scale = static_cast<float>(p.scale);
  const bool elementwise = kFeatures && has_elementwise(p);
  const bool has_cap = kFeatures && p.softcap > 0.0, dropout = kFeatures && p.dropout;
  const float scale_log2 = scale * kLog2e;
  const float lse_log2[2] = {lse_r[0] * kLog2e, lse_r[1] * kLog2e};  // +inf stays +inf
  const int ksteps_d = (p.D + 15) / 16, ksteps_dv = (p.Dv + 15) / 16;

  float dq_acc[1][kNTO][4];
  zero(dq_acc);

  for (int it = 0; it < steps; ++it) {
    const int st = kStages == 2 ? (it & 1) : 0;
    const int j0 = (kt.first + it) * kBlockN;
    uint16_t* sK = sK0 + st * 2 * Cfg::kKVElems;
    uint16_t* sV = sK + Cfg::kKVElems;
    if (kStages == 1) {
      prim::block_sync();  // every warp is done with the previous step's K/V
      load_tile<kBlockN, kHD, Cfg::kThreads>(sK, Kg, p.k_sl, j0, p.Lk, p.D, p.k_aligned, tid);
      load_tile<kBlockN, kHD, Cfg::kThreads>(sV, Vg, p.v_sl, j0, p.Lk, p.Dv, p.v_aligned, tid);
      prim::cp_async_commit();
    }
    prim::cp_async_wait<0>();
    prim::block_sync();  // this step's K/V have landed; the other stage is free
    if (kStages == 2) {
      if (it + 1 < steps) {
        uint16_t* nK = sK0 + ((it + 1) & 1) * 2 * Cfg::kKVElems;
        load_tile<kBlockN, kHD, Cfg::kThreads>(nK, Kg, p.k_sl, j0 + kBlockN, p.Lk, p.D, p.k_aligned,
                                               tid);
        load_tile<kBlockN, kHD, Cfg::kThreads>(nK + Cfg::kKVElems, Vg, p.v_sl, j0 + kBlockN, p.Lk,
                                               p.Dv, p.v_aligned, tid);
      }
      prim::cp_async_commit();
    }

    float dp[1][kNT][4];
    zero(dp);
    mma_ss_nt<Elem, 1, kNT, kHD>(dp, sdO, warp_row0, sV, 0, ksteps_dv, lane);
    float s[1][kNT][4];
    zero(s);
    mma_ss_nt<Elem, 1, kNT, kHD>(s, sQ, warp_row0, sK, 0, ksteps_d, lane);

    const bool full = !elementwise && tile_interior(p, i0 + warp_row0, 16, j0, kBlockN);
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int i = i0 + warp_row0 + g + 8 * r;
        const int j = j0 + nt * 8 + 2 * t;
        uint32_t bits = 3u;
        if (dropout && i < p.Lq) bits = drop.keep2(dropout_element(p, bh, i, j));
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int e = 2 * r + c;
          float th = 0.0f;
          float pval;
          if constexpr (kFeatures) {
            float sv = full ? s[0][nt][e] * scale : band_score(p, scale, s[0][nt][e], i, j + c);
            if (elementwise) sv = sc(s[0][nt][e], i, j + c, th);
            pval = prim::fast_exp2((sv - lse_r[r]) * kLog2e);
          } else {  // the scale folded into the exponent (scale > 0)
            const float raw = full || in_band(p, i, j + c) ? s[0][nt][e] : -prim::inf_of<float>();
            pval = prim::fast_exp2(raw * scale_log2 - lse_log2[r]);
          }
          const float mult = dropout ? (((bits >> c) & 1u) ? keep_scale : 0.0f) : 1.0f;
          float ds = pval * (dp[0][nt][e] * mult - delta_r[r]);
          if (has_cap) ds *= 1.0f - th * th;
          s[0][nt][e] = ds * scale;
        }
      }

    uint32_t a[1][kNT / 2][4];
    to_a_frags<Elem, 1, kNT>(s, a);
    mma_rs_nn<Elem, 1, kNT / 2, kNTO, kHD>(dq_acc, a, sK, 0, ksteps_d, lane);
  }
  prim::cp_async_wait<0>();

  store_rows<Elem, 1, kNTO>(dq_acc,
                            static_cast<uint16_t*>(params.dq) + b * params.dq_sb + h * params.dq_sh,
                            params.dq_sl, i0 + warp_row0, p.Lq, p.D, p.D % 2 == 0, lane);
}

}  // namespace fastattn::cuda::attn
