"""Plain-PyTorch additive (Bahdanau) attention, the "reference" backend. It materialises the
(B, Lq, Lk, A) tensor of tanh arguments that the fused kernels avoid."""

from __future__ import annotations

import torch

from ..contracts import compute_dtype


def additive_scores(qp: torch.Tensor, kp: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """S[b, i, j] = sum_a v[a] tanh(qp[b, i, a] + kp[b, j, a]) in the compute type.

    qp (B, Lq, A), kp (B, Lk, A), v (A,) -> (B, Lq, Lk) float32 (float64 for float64).
    """
    acc = compute_dtype(qp.dtype)
    t = torch.tanh(qp.to(acc).unsqueeze(2) + kp.to(acc).unsqueeze(1))
    return torch.matmul(t, v.to(acc))
