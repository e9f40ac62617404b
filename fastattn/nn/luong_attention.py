"""fastattn.nn.LuongAttention: the scores of Luong et al. 2015 on fastattn's fused attention."""

from __future__ import annotations

import math

import torch
from torch import nn

from ..ops.additive_attention import additive_attention
from ..ops.attention import attention

_SCORES = ("dot", "general", "concat")


class LuongAttention(nn.Module):
    """Luong et al. (2015) attention between decoder states (queries) and encoder states (keys).

    The scores:

    - "dot": `q_i . k_j` (query_dim == key_dim);
    - "general": `q_i^T W k_j`, W the `linear.weight` (key_dim, query_dim);
    - "concat": `v . tanh(W_a [q_i; k_j])`, the additive form, W_a split into
      `query_proj.weight` (key_dim, query_dim) and `key_proj.weight` (key_dim, key_dim), and
      `v` (key_dim,).

    Then `context_i = sum_j softmax_j(score) values_j`. "dot" and "general" run
    `fastattn.attention` (scale 1; key_dim and value_dim in [1, 256]), "concat" runs
    `fastattn.additive_attention`: no (B, Lq, Lk) scores are formed unless the weights are asked
    for. Luong's attentional state `tanh(W_c [context; h_t])` is left to the model.

    Args:
        query_dim: Features of the decoder states.
        key_dim: Features of the encoder states.
        score: "dot", "general" or "concat".
        value_dim: Features of the values; default key_dim.
    """

    def __init__(
        self, query_dim: int, key_dim: int, *, score: str = "general", value_dim: int | None = None
    ):
        super().__init__()
        if score not in _SCORES:
            raise ValueError(f"LuongAttention: score must be one of {_SCORES}, got {score!r}")
        if score == "dot" and query_dim != key_dim:
            raise ValueError(
                f"LuongAttention: score='dot' needs query_dim == key_dim, got "
                f"{query_dim} and {key_dim}"
            )
        self.query_dim, self.key_dim, self.score = query_dim, key_dim, score
        self.value_dim = key_dim if value_dim is None else value_dim
        if score == "general":
            self.linear = nn.Linear(key_dim, query_dim, bias=False)  # weight (query_dim, key_dim)
        elif score == "concat":
            self.query_proj = nn.Linear(query_dim, key_dim, bias=False)
            self.key_proj = nn.Linear(key_dim, key_dim, bias=False)
            self.v = nn.Parameter(torch.empty(key_dim))
            nn.init.uniform_(self.v, -1.0 / math.sqrt(key_dim), 1.0 / math.sqrt(key_dim))

    def forward(
        self,
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor | None = None,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = False,
    ):
        """Attend from the decoder states over the encoder states.

        Args:
            query: (B, Lq, query_dim), or (B, query_dim) for one decoder step.
            keys: (B, Lk, key_dim).
            values: (B, Lk, value_dim); default: keys.
            key_padding_mask: Bool (B, Lk), True = ignore that key.
            need_weights: Also return the attention weights (recomputed from the attention's
                log-sum-exp).

        Returns:
            The context (B, Lq, value_dim) (or (B, value_dim)); with `need_weights`, the pair
            (context, weights), weights (B, Lq, Lk) (or (B, Lk)). Queries whose keys are all masked
            get a zero context and zero weights.

        Raises:
            ValueError: Inputs whose shapes do not match the module's dims.
        """
        name = "LuongAttention"
        if query.dim() not in (2, 3) or query.shape[-1] != self.query_dim:
            raise ValueError(
                f"{name}: query must be (B, Lq, {self.query_dim}) or "
                f"(B, {self.query_dim}), got shape {tuple(query.shape)}"
            )
        if keys.dim() != 3 or keys.shape[-1] != self.key_dim:
            raise ValueError(
                f"{name}: keys must be (B, Lk, {self.key_dim}), got shape {tuple(keys.shape)}"
            )
        if values is not None and (values.dim() != 3 or values.shape[-1] != self.value_dim):
            raise ValueError(
                f"{name}: values must be (B, Lk, {self.value_dim}), got shape {tuple(values.shape)}"
            )
        if self.score == "concat":
            return additive_attention(
                query,
                keys,
                values,
                w_query=self.query_proj.weight,
                w_keys=self.key_proj.weight,
                v=self.v,
                key_padding_mask=key_padding_mask,
                return_weights=need_weights,
            )
        values = keys if values is None else values
        single_step = query.dim() == 2
        q = query.unsqueeze(1) if single_step else query
        if self.score == "general":
            q = q @ self.linear.weight  # (W^T q) as a row: q^T W
        result = attention(
            q.unsqueeze(1),
            keys.unsqueeze(1),
            values.unsqueeze(1),
            scale=1.0,
            key_padding_mask=key_padding_mask,
            return_lse=need_weights,
        )
        if not need_weights:
            context = result[:, 0]
            return context[:, 0] if single_step else context
        out, lse = result
        context = out[:, 0]
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        scores = q.to(acc) @ keys.to(acc).transpose(1, 2)  # (B, Lq, Lk), asked for
        lse = lse[:, 0].to(acc).unsqueeze(-1)
        weights = torch.exp(scores - lse.clamp_min(torch.finfo(acc).min))
        weights = weights.masked_fill(torch.isinf(lse) & (lse < 0), 0.0)
        if key_padding_mask is not None:
            weights = weights.masked_fill(key_padding_mask[:, None, :], 0.0)
        if single_step:
            return context[:, 0], weights[:, 0]
        return context, weights

    def extra_repr(self) -> str:
        return (
            f"query_dim={self.query_dim}, key_dim={self.key_dim}, score={self.score!r}, "
            f"value_dim={self.value_dim}"
        )
