// Counter-based random numbers shared by every fastattn kernel that drops out.
//
// Philox-4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3"). A dropout
// decision for logical element e of a call is a pure function of (seed, stream, e), so the
// forward and backward regenerate the same mask without storing it, and every backend (C++,
// CUDA, Triton, the PyTorch reference) draws the same mask for the same seed:
//   counter = (e / 4 low, e / 4 high, stream low, stream high), key = (seed low, seed high)
//   u       = (philox(counter, key)[e % 4] >> 8) * 2^-24        in [0, 1), exact in float32
//   keep    = u >= p
// The seed and stream are two int64 values drawn from torch's generator of the tensor's device.
#pragma once
#include <cstdint>

#if defined(__CUDACC__)
#define FASTATTN_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define FASTATTN_HOST_DEVICE inline
#endif

namespace fastattn {

struct Philox4 {
  uint32_t v[4];
};

FASTATTN_HOST_DEVICE void philox_mulhilo(uint32_t a, uint32_t b, uint32_t& hi, uint32_t& lo) {
  const uint64_t product = static_cast<uint64_t>(a) * static_cast<uint64_t>(b);
  hi = static_cast<uint32_t>(product >> 32);
  lo = static_cast<uint32_t>(product);
}

FASTATTN_HOST_DEVICE Philox4 philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3,
                                           uint32_t k0, uint32_t k1) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
  constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
#if defined(__CUDACC__)
#pragma unroll
#endif
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0, lo0, hi1, lo1;
    philox_mulhilo(kM0, c0, hi0, lo0);
    philox_mulhilo(kM1, c2, hi1, lo1);
    const uint32_t n0 = hi1 ^ c1 ^ k0;
    const uint32_t n2 = hi0 ^ c3 ^ k1;
    c0 = n0;
    c1 = lo1;
    c2 = n2;
    c3 = lo0;
    k0 += kW0;
    k1 += kW1;
  }
  return Philox4{{c0, c1, c2, c3}};
}

// The four uniforms of counter block `block` (elements 4*block .. 4*block+3).
FASTATTN_HOST_DEVICE Philox4 philox_block(uint64_t seed, uint64_t stream, uint64_t block) {
  return philox4x32_10(static_cast<uint32_t>(block), static_cast<uint32_t>(block >> 32),
                       static_cast<uint32_t>(stream), static_cast<uint32_t>(stream >> 32),
                       static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
}

FASTATTN_HOST_DEVICE float philox_uniform(uint32_t bits) {
  return static_cast<float>(bits >> 8) * (1.0f / 16777216.0f);
}

// Keep decision for one logical element (scalar path; vector paths use philox_block).
FASTATTN_HOST_DEVICE bool dropout_keep(uint64_t seed, uint64_t stream, uint64_t element, float p) {
  const Philox4 r = philox_block(seed, stream, element >> 2);
  return philox_uniform(r.v[element & 3]) >= p;
}

}  // namespace fastattn
