// Tensor-core building blocks of the fp16/bf16 attention kernels (FlashAttention-2 structure,
// mma.sync m16n8k16 with f32 accumulators; layouts in attention_cuda_prims.cuh):
//   load_tile      global rows -> a padded shared tile, cp.async (aligned) or scalar loads
//   mma_ss_nt      acc += A B^T with A [rows][k] and B [n][k] both in shared memory
//   mma_rs_nn      acc += A B with A in registers (C-layout floats packed by to_a_frags) and
//                  B [k][n] in shared memory (ldmatrix.trans)
// Shared tiles are [rows][kHD + 8] 16-bit elements: the 16-byte pad shifts consecutive rows by
// 4 banks, so the 8 row addresses of every ldmatrix hit 8 distinct 16-byte bank groups.
#pragma once
#include <cstdint>

#include "attention/attention_cuda_prims.cuh"

namespace fastattn::cuda::attn {

template <int kHD>
struct SmemTile {
  static constexpr int kStride = kHD + 8;  // elements per shared row
  static_assert(kHD % 16 == 0, "head-dim bucket must be a multiple of 16");
};

// Copies rows [r0, r0 + kRows) x cols [0, kHD) of a row-major global matrix (row stride
// `ld` elements; rows >= L and cols >= D read as zero) into the shared tile s[kRows][kHD + 8].
// Each thread copies 16-byte chunks tid, tid + kThreads, ... With `aligned` (the base pointer
// and ld are multiples of 8 elements) the chunks are cp.async copies, zero-filled past D and
// past L (src_bytes < 16); the caller commits and waits. Otherwise scalar loads and a 16-byte
// shared store. Padding columns [kHD, kHD + 8) are never written (and never read).
// rows: the row mapping (attention_cuda_prims.cuh: RowMap; default dense, row * ld): a paged KV
// cache's keys and values are read through its block table.
template <int kRows, int kHD, int kThreads>
__device__ __forceinline__ void load_tile(uint16_t* s, const uint16_t* g, int64_t ld, int r0, int L,
                                          int D, bool aligned, int tid, RowMap rows = RowMap{}) {
  constexpr int kStride = SmemTile<kHD>::kStride;
  constexpr int kChunksPerRow = kHD / 8;
  constexpr int kChunks = kRows * kChunksPerRow;
  static_assert(kChunks % kThreads == 0, "tile chunks must divide evenly among the threads");
#pragma unroll
  for (int it = 0; it < kChunks / kThreads; ++it) {
    const int c = it * kThreads + tid;
    const int r = c / kChunksPerRow;
    const int d0 = (c % kChunksPerRow) * 8;
    const int row = r0 + r;
    // Number of real elements in this chunk (0 past the last row or column).
    const int n = row < L ? max(0, min(8, D - d0)) : 0;
    FASTATTN_DEVICE_CHECK(r < kRows && d0 + 8 <= kHD && (n == 0 || (row < L && d0 < D)));
    uint16_t* dst = s + r * kStride + d0;
    const uint16_t* src = n > 0 ? g + rows.offset(row, ld) + d0 : g;
    if (aligned) {
      prim::cp_async_16(dst, src, n * 2);
    } else {
      uint32_t w[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const uint32_t lo = 2 * e < n ? prim::ldg(src + 2 * e) : 0u;
        const uint32_t hi = 2 * e + 1 < n ? prim::ldg(src + 2 * e + 1) : 0u;
        w[e] = lo | (hi << 16);
      }
      prim::sts(reinterpret_cast<uint4*>(dst), make_uint4(w[0], w[1], w[2], w[3]));
    }
  }
}

// acc[mt][nt] += sum_k A[a_row0 + 16 mt + r][k] * B[b_row0 + 8 nt + c][k] over k in
// [0, 16 * ksteps): A and B are shared tiles [rows][kHD + 8] read with ldmatrix (no transpose).
// The warp owns rows a_row0 .. a_row0 + 16 kMT - 1; B rows b_row0 .. b_row0 + 8 kNT - 1.
// ksteps (run time, <= kHD / 16) skips the zero columns past the real head dim.
template <typename Elem, int kMT, int kNT, int kHD>
__device__ __forceinline__ void mma_ss_nt(float (&acc)[kMT][kNT][4], const uint16_t* sA, int a_row0,
                                          const uint16_t* sB, int b_row0, int ksteps, int lane) {
  constexpr int kStride = SmemTile<kHD>::kStride;
  static_assert(kNT % 2 == 0, "B is loaded two n8 tiles at a time");
  // ldmatrix.x4 row addresses. A: matrices (rows 0-7, k 0-7), (rows 8-15, k 0-7),
  // (rows 0-7, k 8-15), (rows 8-15, k 8-15) = a[0..3]. B: (n 0-7, k 0-7), (n 0-7, k 8-15),
  // (n 8-15, k 0-7), (n 8-15, k 8-15) = b[0], b[1] of n-tile 2np and of n-tile 2np+1.
  const int a_r = lane & 15, a_c = (lane >> 4) * 8;
  const int b_r = (lane & 7) + ((lane >> 4) << 3), b_c = ((lane >> 3) & 1) * 8;
#pragma unroll
  for (int ks = 0; ks < kHD / 16; ++ks) {
    if (ks < ksteps) {
      uint32_t a[kMT][4];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        prim::ldmatrix_x4(a[mt], sA + (a_row0 + mt * 16 + a_r) * kStride + ks * 16 + a_c);
      }
#pragma unroll
      for (int np = 0; np < kNT / 2; ++np) {
        uint32_t b[4];
        prim::ldmatrix_x4(b, sB + (b_row0 + np * 16 + b_r) * kStride + ks * 16 + b_c);
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          prim::mma_16816<Elem>(acc[mt][2 * np], a[mt], b[0], b[1]);
          prim::mma_16816<Elem>(acc[mt][2 * np + 1], a[mt], b[2], b[3]);
        }
      }
    }
  }
}

// C-layout accumulators (16 x 8 kNT per m tile) -> A fragments of the next product, whose k is
// the accumulators' n: k-step kk takes n-tiles 2kk (a[0], a[1]) and 2kk+1 (a[2], a[3]).
template <typename Elem, int kMT, int kNT>
__device__ __forceinline__ void to_a_frags(const float (&c)[kMT][kNT][4],
                                           uint32_t (&a)[kMT][kNT / 2][4]) {
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
    for (int kk = 0; kk < kNT / 2; ++kk) {
      a[mt][kk][0] = prim::pack2<Elem>(c[mt][2 * kk][0], c[mt][2 * kk][1]);
      a[mt][kk][1] = prim::pack2<Elem>(c[mt][2 * kk][2], c[mt][2 * kk][3]);
      a[mt][kk][2] = prim::pack2<Elem>(c[mt][2 * kk + 1][0], c[mt][2 * kk + 1][1]);
      a[mt][kk][3] = prim::pack2<Elem>(c[mt][2 * kk + 1][2], c[mt][2 * kk + 1][3]);
    }
  }
}

// acc[mt][nt] += sum_k A[mt](k) * B[b_row0 + k][8 nt + c] over k in [0, 16 kKSteps): A from
// registers (to_a_frags), B a shared tile [k rows][kHD + 8] read with ldmatrix.trans. npairs
// (run time, <= kNT / 2) skips the output columns past the real head dim (16 at a time).
template <typename Elem, int kMT, int kKSteps, int kNT, int kHD>
__device__ __forceinline__ void mma_rs_nn(float (&acc)[kMT][kNT][4],
                                          const uint32_t (&a)[kMT][kKSteps][4], const uint16_t* sB,
                                          int b_row0, int npairs, int lane) {
  constexpr int kStride = SmemTile<kHD>::kStride;
  static_assert(kNT % 2 == 0, "B is loaded two n8 tiles at a time");
  // ldmatrix.x4.trans matrices: (k 0-7, n 0-7), (k 8-15, n 0-7), (k 0-7, n 8-15),
  // (k 8-15, n 8-15) = b[0], b[1] of n-tile 2np and of n-tile 2np+1.
  const int r = lane & 15, c = (lane >> 4) * 8;
#pragma unroll
  for (int kk = 0; kk < kKSteps; ++kk) {
#pragma unroll
    for (int np = 0; np < kNT / 2; ++np) {
      if (np < npairs) {
        uint32_t b[4];
        prim::ldmatrix_x4_trans(b, sB + (b_row0 + kk * 16 + r) * kStride + np * 16 + c);
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          prim::mma_16816<Elem>(acc[mt][2 * np], a[mt][kk], b[0], b[1]);
          prim::mma_16816<Elem>(acc[mt][2 * np + 1], a[mt][kk], b[2], b[3]);
        }
      }
    }
  }
}

template <int kMT, int kNT>
__device__ __forceinline__ void zero(float (&acc)[kMT][kNT][4]) {
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mt][nt][e] = 0.0f;
}

// Stores C-layout accumulators of rows row0 + 16 mt + (g, g+8), cols 8 nt + 2t (+1) into a
// row-major (ld) 16-bit matrix, keeping rows < L and cols < D; `pair_aligned` (base and ld
// even) allows one 32-bit store for two columns.
template <typename Elem, int kMT, int kNT>
__device__ __forceinline__ void store_rows(const float (&acc)[kMT][kNT][4], uint16_t* g, int64_t ld,
                                           int row0, int L, int D, bool pair_aligned, int lane) {
  const int gr = lane >> 2, t = lane & 3;
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = row0 + mt * 16 + gr + 8 * half;
      if (row >= L) continue;
      uint16_t* dst = g + static_cast<int64_t>(row) * ld;
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt) {
        const int col = nt * 8 + 2 * t;
        const float v0 = acc[mt][nt][2 * half], v1 = acc[mt][nt][2 * half + 1];
        if (col + 1 < D && pair_aligned) {
          prim::stg(reinterpret_cast<uint32_t*>(dst + col), prim::pack2<Elem>(v0, v1));
        } else {
          if (col < D) prim::stg(dst + col, prim::from_float<Elem>(v0));
          if (col + 1 < D) prim::stg(dst + col + 1, prim::from_float<Elem>(v1));
        }
      }
    }
  }
}

// Float32 variant of store_rows (split-K partial outputs, contiguous rows of length ld).
template <int kMT, int kNT>
__device__ __forceinline__ void store_rows_f32(const float (&acc)[kMT][kNT][4], float* g,
                                               int64_t ld, int row0, int L, int D, int lane) {
  const int gr = lane >> 2, t = lane & 3;
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = row0 + mt * 16 + gr + 8 * half;
      if (row >= L) continue;
      float* dst = g + static_cast<int64_t>(row) * ld;
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt) {
        const int col = nt * 8 + 2 * t;
        if (col < D) prim::stg(dst + col, acc[mt][nt][2 * half]);
        if (col + 1 < D) prim::stg(dst + col + 1, acc[mt][nt][2 * half + 1]);
      }
    }
  }
}

}  // namespace fastattn::cuda::attn
