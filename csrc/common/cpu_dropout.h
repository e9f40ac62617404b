// Philox uniforms for a run of consecutive logical elements, 16 counter blocks at a time so that
// the compiler turns the rounds into vector multiplies (vpmuludq) in every ISA copy.
#pragma once
#include "common/cpu_target.h"
#include <cstdint>

#include "common/philox.h"

namespace fastattn::cpu {
inline namespace FASTATTN_TARGET_NAMESPACE {  // common/cpu_target.h

// u[i] = uniform of logical element e0 + i, for i in [0, n).
inline void philox_uniforms(uint64_t seed, uint64_t stream, uint64_t e0, int64_t n, float* u) {
  constexpr int kLanes = 16;
  const uint32_t s0 = static_cast<uint32_t>(stream), s1 = static_cast<uint32_t>(stream >> 32);
  int64_t first = -static_cast<int64_t>(e0 & 3);  // index in u of word 0 of the current chunk
  for (uint64_t block = e0 >> 2; first < n; block += kLanes, first += 4 * kLanes) {
    uint32_t c0[kLanes], c1[kLanes], c2[kLanes], c3[kLanes];
    for (int lane = 0; lane < kLanes; ++lane) {
      const uint64_t b = block + lane;
      c0[lane] = static_cast<uint32_t>(b);
      c1[lane] = static_cast<uint32_t>(b >> 32);
      c2[lane] = s0;
      c3[lane] = s1;
    }
    uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
    for (int round = 0; round < 10; ++round) {
      for (int lane = 0; lane < kLanes; ++lane) {
        const uint64_t p0 = static_cast<uint64_t>(0xD2511F53u) * c0[lane];
        const uint64_t p1 = static_cast<uint64_t>(0xCD9E8D57u) * c2[lane];
        const uint32_t n0 = static_cast<uint32_t>(p1 >> 32) ^ c1[lane] ^ k0;
        const uint32_t n2 = static_cast<uint32_t>(p0 >> 32) ^ c3[lane] ^ k1;
        c1[lane] = static_cast<uint32_t>(p1);
        c3[lane] = static_cast<uint32_t>(p0);
        c0[lane] = n0;
        c2[lane] = n2;
      }
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    for (int lane = 0; lane < kLanes; ++lane) {
      const uint32_t words[4] = {c0[lane], c1[lane], c2[lane], c3[lane]};
      for (int w = 0; w < 4; ++w) {
        const int64_t i = first + 4 * lane + w;
        if (i >= 0 && i < n) u[i] = philox_uniform(words[w]);
      }
    }
  }
}

// mult[i] = 1/(1-p) where element e0+i is kept, else 0 (dropout applied as a multiply).
// The threshold is p rounded to float and the scale 1/(1-p) is computed in double, then rounded
// to the compute type, exactly as the PyTorch reference does.
template <typename acc>
inline void dropout_multipliers(uint64_t seed, uint64_t stream, uint64_t e0, int64_t n, double p,
                                float* scratch, acc* mult) {
  philox_uniforms(seed, stream, e0, n, scratch);
  const float threshold = static_cast<float>(p);
  const acc keep_scale = static_cast<acc>(1.0 / (1.0 - p));
  for (int64_t i = 0; i < n; ++i)
    mult[i] = scratch[i] >= threshold ? keep_scale : static_cast<acc>(0);
}

}  // namespace FASTATTN_TARGET_NAMESPACE
}  // namespace fastattn::cpu
