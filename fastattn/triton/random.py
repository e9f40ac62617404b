"""Philox-4x32-10 dropout numbers in Triton; the same stream as csrc/common/philox.h and
fastattn/reference/random.py (counter = (element // 4, stream), key = seed, word element % 4)."""

import triton
import triton.language as tl


@triton.jit
def philox_uniform(seed_ptr, element):
    """Uniform [0, 1) float32 for int64 logical element indices `element` (any block shape).

    seed_ptr: int64 pointer to (seed, stream), drawn per call from torch's generator.
    """
    seed = tl.load(seed_ptr).to(tl.uint64, bitcast=True)
    stream = tl.load(seed_ptr + 1).to(tl.uint64, bitcast=True)
    k0 = (seed & 0xFFFFFFFF).to(tl.uint32)
    k1 = (seed >> 32).to(tl.uint32)
    block = element >> 2
    c0 = (block & 0xFFFFFFFF).to(tl.uint32)
    c1 = (block >> 32).to(tl.uint32)
    c2 = tl.zeros_like(c0) + (stream & 0xFFFFFFFF).to(tl.uint32)
    c3 = tl.zeros_like(c0) + (stream >> 32).to(tl.uint32)
    for _ in tl.static_range(10):
        hi0 = tl.umulhi(c0, 0xD2511F53)
        lo0 = c0 * 0xD2511F53
        hi1 = tl.umulhi(c2, 0xCD9E8D57)
        lo1 = c2 * 0xCD9E8D57
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = k0 + 0x9E3779B9
        k1 = k1 + 0xBB67AE85
    lane = element & 3
    word = tl.where(lane == 0, c0, tl.where(lane == 1, c1, tl.where(lane == 2, c2, c3)))
    return (word >> 8).to(tl.float32) * (1.0 / 16777216.0)


@triton.jit
def dropout_multiplier(seed_ptr, element, threshold, keep_scale):
    """keep_scale where element is kept (uniform >= threshold), else 0."""
    u = philox_uniform(seed_ptr, element)
    return tl.where(u >= threshold, keep_scale, 0.0)
