// The few device primitives the attention kernels are built from: shared/global accesses,
// cp.async, ldmatrix, mma.sync m16n8k16, warp shuffles, barriers, fast exp2, packing.
//
// Every shared-memory and global-memory access of the kernels goes through these functions
// (lds/sts/ldg/stg, cp_async_16, ldmatrix_*), never through a raw dereference. That lets
// tools/cuda_emu compile the same kernel bodies for the CPU (FASTATTN_CUDA_EMULATION), with
// one fiber per CUDA thread, the PTX semantics of mma/ldmatrix/cp.async written out from the
// PTX ISA, and checks of every access: shared-memory races between barriers, reads of
// uninitialised or in-flight shared memory, global reads and writes outside the tensors.
//
// Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16", 16-bit A/B, f32 C/D), with
// g = lane / 4 ("groupID") and t = lane % 4 ("threadID_in_group"):
//   A (16x16, row): a[0] = (row g,   cols 2t, 2t+1)    a[1] = (row g+8, cols 2t, 2t+1)
//                   a[2] = (row g,   cols 2t+8, 2t+9)  a[3] = (row g+8, cols 2t+8, 2t+9)
//   B (16x8, col):  b[0] = (rows 2t, 2t+1, col g)      b[1] = (rows 2t+8, 2t+9, col g)
//   C/D (16x8 f32): c[0], c[1] = (row g, cols 2t, 2t+1); c[2], c[3] = (row g+8, cols 2t, 2t+1)
// Each 32-bit register holds two 16-bit values, the lower column (or row for B) in the low half.
// ldmatrix.x4: lanes 8i..8i+7 give the row addresses of 8x8 matrix i; lane l receives in
// register i the elements (row l/4, cols 2(l%4), 2(l%4)+1) of matrix i, or with .trans the
// elements (rows 2(l%4), 2(l%4)+1, col l/4).
#pragma once
#include <cstdint>

#if defined(FASTATTN_CUDA_EMULATION)
#include "cuda_emu.h"  // tools/cuda_emu: the CPU definitions of everything below
#else
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common/cuda_utils.cuh"  // FASTATTN_DEVICE_CHECK, FASTATTN_CUDA_LAUNCH_CHECK

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
// The tensor-core kernels use cp.async and bf16 mma (sm_80+); the host refuses older devices
// before launching, so on older targets these bodies only need to compile.
#define FASTATTN_SM80_OR_TRAP(...) __trap()
#else
#define FASTATTN_SM80_OR_TRAP(...) __VA_ARGS__
#endif

namespace fastattn::cuda::prim {

// Element tags of the tensor-core kernels: 16-bit storage (uint16_t) in global and shared memory.
struct F16 {};
struct BF16 {};

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Dynamic shared memory of the block (16-byte aligned).
__device__ __forceinline__ char* shared_base() {
  extern __shared__ __align__(16) char fastattn_smem[];
  return fastattn_smem;
}

template <typename T>
__device__ __forceinline__ T ldg(const T* p) {
  return *p;
}
template <typename T>
__device__ __forceinline__ void stg(T* p, T v) {
  *p = v;
}
template <typename T>
__device__ __forceinline__ T lds(const T* p) {
  return *p;
}
template <typename T>
__device__ __forceinline__ void sts(T* p, T v) {
  *p = v;
}

// Global float / double add from several blocks (d attn_mask of a non-deterministic backward).
template <typename T>
__device__ __forceinline__ void atomic_add(T* p, T v) {
  atomicAdd(p, v);
}

__device__ __forceinline__ void block_sync() { __syncthreads(); }
__device__ __forceinline__ void warp_sync() { __syncwarp(); }

template <typename T>
__device__ __forceinline__ T shfl_xor(T v, int lane_mask) {
  return __shfl_xor_sync(0xffffffffu, v, lane_mask);
}

// 16-byte asynchronous copy global -> shared; bytes [src_bytes, 16) of dst are zero-filled
// (src_bytes = 0 writes 16 zero bytes and reads nothing). dst and src are 16-byte aligned.
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, int src_bytes) {
  FASTATTN_SM80_OR_TRAP(
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)),
                   "l"(src), "r"(src_bytes) : "memory"));
}
__device__ __forceinline__ void cp_async_commit() {
  FASTATTN_SM80_OR_TRAP(asm volatile("cp.async.commit_group;\n" :: : "memory"));
}
// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  FASTATTN_SM80_OR_TRAP(asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* row_addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(row_addr))
               : "memory");
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row_addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(row_addr))
               : "memory");
}

// d += a * b, m16n8k16, f32 accumulators.
template <typename Elem>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                          uint32_t b1);
template <>
__device__ __forceinline__ void mma_16816<F16>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                               uint32_t b1) {
  FASTATTN_SM80_OR_TRAP(asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n" : "+f"(d[0]),
      "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0),
      "r"(b1)));
}
template <>
__device__ __forceinline__ void mma_16816<BF16>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                                uint32_t b1) {
  FASTATTN_SM80_OR_TRAP(asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n" : "+f"(d[0]),
      "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0),
      "r"(b1)));
}

// Two floats rounded (to nearest even) into one register, lo in the low half.
template <typename Elem>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t pack2<F16>(float lo, float hi) {
  const __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}
template <>
__device__ __forceinline__ uint32_t pack2<BF16>(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

template <typename Elem>
__device__ __forceinline__ float to_float(uint16_t bits);
template <>
__device__ __forceinline__ float to_float<F16>(uint16_t bits) {
  return __half2float(__ushort_as_half(bits));
}
template <>
__device__ __forceinline__ float to_float<BF16>(uint16_t bits) {
  return __bfloat162float(__ushort_as_bfloat16(bits));
}

template <typename Elem>
__device__ __forceinline__ uint16_t from_float(float v);
template <>
__device__ __forceinline__ uint16_t from_float<F16>(float v) {
  return __half_as_ushort(__float2half_rn(v));
}
template <>
__device__ __forceinline__ uint16_t from_float<BF16>(float v) {
  return __bfloat16_as_ushort(__float2bfloat16_rn(v));
}

// 2^x with one MUFU instruction (relative error ~2^-22; 2^-inf = +0; subnormal results -> 0).
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Accurate math of the compute type (the SIMT kernels, lse, softcap).
__device__ __forceinline__ float acc_exp(float x) { return expf(x); }
__device__ __forceinline__ double acc_exp(double x) { return exp(x); }
__device__ __forceinline__ float acc_log(float x) { return logf(x); }
__device__ __forceinline__ double acc_log(double x) { return log(x); }
__device__ __forceinline__ float acc_tanh(float x) { return tanhf(x); }
__device__ __forceinline__ double acc_tanh(double x) { return tanh(x); }
__device__ __forceinline__ float acc_fma(float a, float b, float c) { return fmaf(a, b, c); }
__device__ __forceinline__ double acc_fma(double a, double b, double c) { return fma(a, b, c); }
__device__ __forceinline__ float acc_max(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ double acc_max(double a, double b) { return fmax(a, b); }

// Rarely taken element-wise paths (masks, ALiBi, softcap, dropout) are calls rather than inlined
// copies in every unrolled accumulator loop: a fraction of the code and of the compile time.
#define FASTATTN_NOINLINE __noinline__

// Kernel launch: the launchers are shared with the emulator, which runs `kernel` on fibers.
#define FASTATTN_LAUNCH_KERNEL(kernel, grid, block, smem, stream, ...) \
  kernel<<<(grid), (block), (smem), static_cast<cudaStream_t>(stream)>>>(__VA_ARGS__)

}  // namespace fastattn::cuda::prim
#endif  // FASTATTN_CUDA_EMULATION

namespace fastattn::cuda::prim {
template <typename T>
__device__ __forceinline__ T inf_of() {
  return static_cast<T>(INFINITY);
}
}  // namespace fastattn::cuda::prim

namespace fastattn::cuda::attn {
// Where row `row` of a K or V tile starts, relative to the head's base pointer. Dense (table
// null): row * ld. Paged KV cache: row j is row j % page of block table[j / page] of the pool,
// blocks block_stride elements apart (table: the sequence's row of the block table; its
// entries were checked before the launch).
struct RowMap {
  const int32_t* table = nullptr;
  int page = 1;
  int64_t block_stride = 0;
  __device__ __forceinline__ int64_t offset(int row, int64_t ld) const {
    if (table == nullptr) return static_cast<int64_t>(row) * ld;
    const int32_t block = prim::ldg(table + row / page);
    return static_cast<int64_t>(block) * block_stride + static_cast<int64_t>(row % page) * ld;
  }
};
}  // namespace fastattn::cuda::attn
