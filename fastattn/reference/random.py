"""The dropout random numbers of fastattn, in plain PyTorch.

Every backend draws dropout decisions from Philox-4x32-10 keyed by a per-call seed, with the
logical element index as the counter (see csrc/common/philox.h for the exact definition):

    counter = (e // 4, stream), key = seed,  u = (philox(counter, key)[e % 4] >> 8) / 2**24
    keep    = u >= p

This file computes the same numbers with int64 tensor arithmetic, so the reference backend
drops exactly the elements the kernels drop and tests can compare dropout outputs exactly.
"""

from __future__ import annotations

import torch

_M0, _M1 = 0xD2511F53, 0xCD9E8D57
_W0, _W1 = 0x9E3779B9, 0xBB67AE85
_MASK32 = 0xFFFFFFFF


def _mulhilo(m: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit halves of m * b for a 32-bit constant m and uint32 values in int64 b.

    The product can reach 2**64, beyond int64, so b is split into 16-bit halves.
    """
    t_lo = m * (b & 0xFFFF)  # < 2**48
    t_hi = m * (b >> 16)  # < 2**48
    partial = t_lo + ((t_hi & 0xFFFF) << 16)
    return (t_hi >> 16) + (partial >> 32), partial & _MASK32


def philox4x32_10(c0, c1, c2, c3, k0, k1) -> list[torch.Tensor]:
    """Philox-4x32-10 on int64 tensors holding uint32 values; returns the four output words.

    The key words k0, k1 may be ints or int64 tensors (0-dim tensors keep the seed on the
    device, so no host synchronisation or graph break happens).
    """
    for _ in range(10):
        hi0, lo0 = _mulhilo(_M0, c0)
        hi1, lo1 = _mulhilo(_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = (k0 + _W0) & _MASK32
        k1 = (k1 + _W1) & _MASK32
    return [c0, c1, c2, c3]


def dropout_uniform(seed: torch.Tensor, element: torch.Tensor) -> torch.Tensor:
    """Uniform [0, 1) float32 numbers for logical element indices `element` (int64, any shape).

    seed: int64 tensor (2,) = (seed, stream), as drawn by fastattn's ops.
    """
    seed = seed.to(device=element.device, dtype=torch.int64)
    seed_value, stream = seed[0], seed[1]
    block = element >> 2
    lane = element & 3
    zeros = torch.zeros_like(block)
    words = philox4x32_10(
        block & _MASK32,
        (block >> 32) & _MASK32,
        zeros + (stream & _MASK32),
        zeros + ((stream >> 32) & _MASK32),
        seed_value & _MASK32,
        (seed_value >> 32) & _MASK32,
    )
    bits = torch.where(
        lane == 0,
        words[0],
        torch.where(lane == 1, words[1], torch.where(lane == 2, words[2], words[3])),
    )
    return (bits >> 8).to(torch.float32) * (1.0 / 16777216.0)


def dropout_keep_mask(
    seed: torch.Tensor, shape: tuple[int, ...], p: float, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Bool keep-mask for a tensor of `shape` whose elements are numbered in row-major order."""
    numel = 1
    for size in shape:
        numel *= size
    element = torch.arange(numel, dtype=torch.int64, device=device).reshape(shape)
    return dropout_uniform(seed.to(device), element) >= p
