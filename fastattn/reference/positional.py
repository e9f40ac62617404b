"""Plain-PyTorch definition of the positional-encoding ops (the "reference" backend).

All functions take the canonical shapes the public ops (fastattn/ops/positional.py) build:
x (N, L, D), tokens (N, L), rotary x (B, H, L, D). Arithmetic happens in the compute type
(float32 for half/bfloat16/float32 inputs, float64 for float64), rounded once at the end, and
angles are pos * inv_freq with inv_freq = base^(-2i/dim) computed in float64 and rounded once
to the compute type: the kernels do the same, so their results agree to the last bits.
"""

from __future__ import annotations

import math

import torch

from ..contracts import compute_dtype
from .random import dropout_keep_mask


def inverse_frequencies(
    dim: int, base: float, dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """(ceil(dim/2),) inv_freq[i] = base^(-2i/dim), computed in float64, rounded to dtype."""
    i2 = torch.arange(0, dim, 2, dtype=torch.float64, device=device)
    return torch.exp2(-(i2 / dim) * math.log2(base)).to(dtype)


def sinusoid(positions: torch.Tensor, dim: int, base: float, dtype: torch.dtype) -> torch.Tensor:
    """(*positions.shape, dim) interleaved table: [2i] = sin(p w_i), [2i+1] = cos(p w_i).

    dtype: the compute type (float32 or float64).
    """
    inv = inverse_frequencies(dim, base, dtype, positions.device)
    angle = positions.to(dtype).unsqueeze(-1) * inv
    table = torch.stack((torch.sin(angle), torch.cos(angle)), dim=-1).flatten(-2)
    return table[..., :dim]


def sinusoidal_table(
    positions: torch.Tensor, dim: int, base: float, dtype: torch.dtype
) -> torch.Tensor:
    return sinusoid(positions, dim, base, compute_dtype(dtype)).to(dtype)


def apply_dropout(y: torch.Tensor, p: float, seed: torch.Tensor | None) -> torch.Tensor:
    """Drop elements of y (numbered row-major) with fastattn's Philox stream; scale by 1/(1-p)."""
    if p <= 0.0:
        return y
    assert seed is not None, "dropout_p > 0 needs a seed"
    keep = dropout_keep_mask(seed, tuple(y.shape), p, y.device)
    return y * keep * (1.0 / (1.0 - p))


def positions_of(
    N: int, L: int, offset: int, offsets: torch.Tensor | None, device: torch.device
) -> torch.Tensor:
    """(N, L) int64 positions offset + offsets[n] + l."""
    pos = torch.arange(L, dtype=torch.int64, device=device).add(offset).expand(N, L)
    if offsets is not None:
        pos = pos + offsets.to(torch.int64).view(N, 1)
    return pos


def add_sinusoidal(
    x: torch.Tensor,
    offset: int,
    offsets: torch.Tensor | None,
    scale: float,
    base: float,
    dropout_p: float,
    seed: torch.Tensor | None,
) -> torch.Tensor:
    """dropout(x * scale + PE[offset + offsets[n] + l]) for x (N, L, D)."""
    N, L, D = x.shape
    acc = compute_dtype(x.dtype)
    pe = sinusoid(positions_of(N, L, offset, offsets, x.device), D, base, acc)
    y = x.to(acc) * scale + pe
    return apply_dropout(y, dropout_p, seed).to(x.dtype)


def embed_with_positions(
    tokens: torch.Tensor,
    weight: torch.Tensor,
    table: torch.Tensor | None,
    offset: int,
    offsets: torch.Tensor | None,
    scale: float,
    base: float,
    dropout_p: float,
    seed: torch.Tensor | None,
    padding_idx: int = -1,
    deterministic: bool = False,
) -> torch.Tensor:
    """dropout(weight[tokens] * scale + P[pos]) for tokens (N, L); P learned (table) or sinusoid.

    padding_idx: rows of that token get no gradient (as F.embedding), positions still added.
    deterministic: accepted for signature parity (PyTorch's own embedding backward decides).
    """
    N, L = tokens.shape
    acc = compute_dtype(weight.dtype)
    pos = positions_of(N, L, offset, offsets, weight.device)
    emb = torch.nn.functional.embedding(
        tokens, weight, padding_idx=padding_idx if padding_idx >= 0 else None
    )
    if table is None:
        pe = sinusoid(pos, weight.shape[1], base, acc)
    else:
        pe = table[pos].to(acc)
    y = emb.to(acc) * scale + pe
    return apply_dropout(y, dropout_p, seed).to(weight.dtype)


def rotary_cos_sin(
    positions: torch.Tensor, rotary_dim: int, base: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of pos * base^(-2i/rotary_dim), each (*positions.shape, rotary_dim / 2)."""
    inv = inverse_frequencies(rotary_dim, base, dtype, positions.device)
    angle = positions.to(dtype).unsqueeze(-1) * inv
    return torch.cos(angle), torch.sin(angle)


def apply_rotary(
    x: torch.Tensor,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    offset: int,
    offsets: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    rotary_dim: int,
    base: float,
    interleaved: bool,
    conjugate: bool = False,
) -> torch.Tensor:
    """Rotate the first rotary_dim features of x (B, H, L, D) by position-dependent angles.

    NeoX layout (interleaved=False) pairs features i and i + rotary_dim/2; GPT-J layout
    (interleaved=True) pairs 2i and 2i+1. cos/sin (P, rotary_dim/2) are indexed by position;
    without them the angles are pos * base^(-2i/rotary_dim). conjugate rotates backwards.
    """
    B, H, L, D = x.shape
    acc = compute_dtype(x.dtype)
    if position_ids is None:
        position_ids = positions_of(B, L, offset, offsets, x.device)
    if cos is None:
        c, s = rotary_cos_sin(position_ids, rotary_dim, base, acc)
    else:
        assert sin is not None, "cos and sin are given together"
        c, s = cos.to(acc)[position_ids], sin.to(acc)[position_ids]
    c, s = c.unsqueeze(1), s.unsqueeze(1)  # (B, 1, L, rotary_dim/2)
    if conjugate:
        s = -s
    rot = x[..., :rotary_dim].to(acc)
    half = rotary_dim // 2
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    else:
        x1, x2 = rot[..., :half], rot[..., half:]
        out = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    return torch.cat((out.to(x.dtype), x[..., rotary_dim:]), dim=-1)
