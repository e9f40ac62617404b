"""fastattn.nn.AdditiveAttention: Bahdanau attention with fused scores."""
from __future__ import annotations

import math

import torch
from torch import nn

from ..ops.additive_attention import additive_attention


class AdditiveAttention(nn.Module):
    """score(q_i, k_j) = v . tanh(W_q q_i + W_k k_j + b); context_i = sum_j softmax_j(score) values_j.

    Parameters: query_proj.weight (attn_dim, query_dim), key_proj.weight (attn_dim, key_dim),
    key_proj.bias (attn_dim,) — the b of the formula — and v (attn_dim,).
    forward(query, keys, values=None, key_padding_mask=None, need_weights=False):
    query (B, Lq, query_dim) or (B, query_dim) (one decoder step), keys (B, Lk, key_dim),
    values (B, Lk, value_dim) (default keys), key_padding_mask (B, Lk) bool (True = ignore),
    projected_keys: project_keys(keys), reused across decoder steps.
    Returns the context, or (context, weights) with need_weights.
    """

    def __init__(self, query_dim: int, key_dim: int, attn_dim: int, *,
                 value_dim: int | None = None):
        super().__init__()
        self.query_dim, self.key_dim, self.attn_dim = query_dim, key_dim, attn_dim
        self.value_dim = key_dim if value_dim is None else value_dim
        self.query_proj = nn.Linear(query_dim, attn_dim, bias=False)
        self.key_proj = nn.Linear(key_dim, attn_dim, bias=True)
        self.v = nn.Parameter(torch.empty(attn_dim))
        nn.init.uniform_(self.v, -1.0 / math.sqrt(attn_dim), 1.0 / math.sqrt(attn_dim))

    def project_keys(self, keys: torch.Tensor) -> torch.Tensor:
        """keys W_k^T + b (B, Lk, attn_dim): compute once per source sequence and pass as
        forward(..., projected_keys=...) at every decoder step."""
        return self.key_proj(keys)

    def forward(self, query: torch.Tensor, keys: torch.Tensor,
                values: torch.Tensor | None = None,
                key_padding_mask: torch.Tensor | None = None, need_weights: bool = False,
                projected_keys: torch.Tensor | None = None):
        if values is not None and values.shape[-1] != self.value_dim:
            raise ValueError(f"AdditiveAttention: values must have {self.value_dim} features, "
                             f"got shape {tuple(values.shape)}")
        return additive_attention(query, keys, values, w_query=self.query_proj.weight,
                                  w_keys=self.key_proj.weight, v=self.v, bias=self.key_proj.bias,
                                  key_padding_mask=key_padding_mask, return_weights=need_weights,
                                  projected_keys=projected_keys)

    def extra_repr(self) -> str:
        return (f"query_dim={self.query_dim}, key_dim={self.key_dim}, attn_dim={self.attn_dim}, "
                f"value_dim={self.value_dim}")
