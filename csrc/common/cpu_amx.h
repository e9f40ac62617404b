// AMX-BF16 (Intel Advanced Matrix Extensions) for the bfloat16 attention tiles.
//
// amx_bf16_usable() says, once per process, whether the CPU has AMX-TILE and AMX-BF16, the OS
// enabled the tile state (XCR0 bits 17 and 18), and Linux granted this process the tile data
// permission (arch_prctl ARCH_REQ_XCOMP_PERM; without it the first tile instruction faults).
// FASTATTN_CPU_ISA=avx512bf16 (or any lower cap) turns it off, so the AVX512-BF16 path can be
// tested and compared on an AMX machine.
//
// The products (compiled only where the compiler targets AMX, i.e. the avx512bf16 kernel copy)
// use one tile shape for all eight tile registers, 16 rows x 64 bytes:
//   tiles 0-3: a 32 x 32 float block of C, tiles 4-5: 16 x 32 bfloat16 rows of A,
//   tiles 6-7: 16 pair rows x 16 columns of B in the VNNI layout of cpu_gemm_bf16.h.
#pragma once
#include "common/cpu_target.h"
#include <cstdint>
#include <cstdlib>
#include <cstring>
#if defined(__x86_64__) && defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
#endif

namespace fastattn::cpu {
inline namespace FASTATTN_TARGET_NAMESPACE {  // common/cpu_target.h

inline bool detect_amx_bf16() {
#if defined(__x86_64__) && defined(__linux__)
  const char* cap = std::getenv("FASTATTN_CPU_ISA");
  if (cap != nullptr && std::strcmp(cap, "amx") != 0) return false;  // a cap below AMX
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  const bool amx_bf16 = (edx >> 22) & 1, amx_tile = (edx >> 24) & 1;
  const bool osxsave = __get_cpuid(1, &eax, &ebx, &ecx, &edx) && ((ecx >> 27) & 1);
  if (!amx_bf16 || !amx_tile || !osxsave) return false;
  uint32_t xcr0_lo, xcr0_hi;
  __asm__ volatile("xgetbv" : "=a"(xcr0_lo), "=d"(xcr0_hi) : "c"(0));
  if (((xcr0_lo >> 17) & 3) != 3) return false;  // XTILECFG and XTILEDATA state enabled
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;
#endif
}

inline bool amx_bf16_usable() {
  static const bool usable = detect_amx_bf16();
  return usable;
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)

// Loads the tile configuration (all tiles 16 x 64 bytes) for the calling thread, and releases
// the tile state when it goes out of scope.
class AmxTileScope {
 public:
  AmxTileScope() {
    struct alignas(64) Config {
      uint8_t palette;
      uint8_t start_row;
      uint8_t reserved[14];
      uint16_t colsb[16];
      uint8_t rows[16];
    } cfg;
    std::memset(&cfg, 0, sizeof(cfg));
    cfg.palette = 1;
    for (int t = 0; t < 8; ++t) {
      cfg.colsb[t] = 64;
      cfg.rows[t] = 16;
    }
    _tile_loadconfig(&cfg);
  }
  ~AmxTileScope() { _tile_release(); }
  AmxTileScope(const AmxTileScope&) = delete;
  AmxTileScope& operator=(const AmxTileScope&) = delete;
};

// The products of one 32 x 32 block of C in tiles 0-3 (rows 0-15 / 16-31 by columns 0-15 /
// 16-31), over `steps` steps of 32 k: step s reads A's two 16-row tiles at a0 + s * a_step and
// a1 + s * a_step (bfloat16 elements, rows a_stride bytes apart) and B's two 16-column slices
// at b + s * b_step and b + s * b_step + 16 (pair words, rows b_stride bytes apart). Tiles are
// not renamed (a load waits for the products that read its tile), so each load sits right
// before the first product that needs it and overlaps the products before.
inline void amx_block_products(int64_t steps, const uint16_t* a0, const uint16_t* a1,
                               int64_t a_step, int64_t a_stride, const uint32_t* b, int64_t b_step,
                               int64_t b_stride) {
  for (int64_t s = 0; s < steps; ++s) {
    _tile_loadd(4, a0 + s * a_step, a_stride);
    _tile_loadd(6, b + s * b_step, b_stride);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, b + s * b_step + 16, b_stride);
    _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(5, a1 + s * a_step, a_stride);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
}

// C (rows x cols float, row stride ldc) (+)= A B with A (rows x K bfloat16, row-major, row
// stride lda elements) and B in pair rows (B2[kk * ldb + n] = (B(2kk, n), B(2kk+1, n)), ldb in
// words). rows, cols and K must be multiples of 32; C rows are read (accumulate) and written
// in whole 32 x 32 blocks.
inline void amx_gemm_bf16(int64_t rows, int64_t cols, int64_t K, const uint16_t* A, int64_t lda,
                          const uint32_t* B2, int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  const int64_t a_stride = lda * 2, b_stride = ldb * 4, c_stride = ldc * 4;
  for (int64_t m0 = 0; m0 < rows; m0 += 32) {
    for (int64_t n0 = 0; n0 < cols; n0 += 32) {
      float* c = C + m0 * ldc + n0;
      if (accumulate) {
        _tile_loadd(0, c, c_stride);
        _tile_loadd(1, c + 16, c_stride);
        _tile_loadd(2, c + 16 * ldc, c_stride);
        _tile_loadd(3, c + 16 * ldc + 16, c_stride);
      } else {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
      }
      const uint16_t* a = A + m0 * lda;
      amx_block_products(K / 32, a, a + 16 * lda, 32, a_stride, B2 + n0, 16 * ldb, b_stride);
      _tile_stored(0, c, c_stride);
      _tile_stored(1, c + 16, c_stride);
      _tile_stored(2, c + 16 * ldc, c_stride);
      _tile_stored(3, c + 16 * ldc + 16, c_stride);
    }
  }
}

#endif  // __AMX_TILE__ && __AMX_BF16__

}  // namespace FASTATTN_TARGET_NAMESPACE
}  // namespace fastattn::cpu
