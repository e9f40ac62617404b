"""fastattn.nn.AdditiveAttention: Bahdanau attention with fused scores."""

from __future__ import annotations

import math
import weakref

import torch
from torch import nn

from ..ops.additive_attention import additive_attention


class AdditiveAttention(nn.Module):
    """Bahdanau (additive) attention as a module, fused (`fastattn.additive_attention`).

    `score(q_i, k_j) = v . tanh(W_q q_i + W_k k_j + b)`, `context_i = sum_j softmax_j(score)
    values_j`. Parameters: `query_proj.weight` (attn_dim, query_dim), `key_proj.weight`
    (attn_dim, key_dim), `key_proj.bias` (attn_dim,) (the b of the formula) and `v` (attn_dim,).

    A decoder calls forward once per step with the same keys (the encoder states): without
    `projected_keys`, the key projection of the previous call is reused while it is still valid
    (the keys and the projection's parameters unchanged, the same grad, inference and autocast
    modes), so a decoder written for torch's straightforward module projects its keys once per
    sequence instead of once per step, forward and backward.

    Args:
        query_dim: Features of the queries (decoder states).
        key_dim: Features of the keys (encoder states).
        attn_dim: Features of the projections, A.
        value_dim: Features of the values; default key_dim.
    """

    def __init__(
        self, query_dim: int, key_dim: int, attn_dim: int, *, value_dim: int | None = None
    ):
        super().__init__()
        self.query_dim, self.key_dim, self.attn_dim = query_dim, key_dim, attn_dim
        self.value_dim = key_dim if value_dim is None else value_dim
        self.query_proj = nn.Linear(query_dim, attn_dim, bias=False)
        self.key_proj = nn.Linear(key_dim, attn_dim, bias=True)
        self.v = nn.Parameter(torch.empty(attn_dim))
        nn.init.uniform_(self.v, -1.0 / math.sqrt(attn_dim), 1.0 / math.sqrt(attn_dim))

    def project_keys(self, keys: torch.Tensor) -> torch.Tensor:
        """Project the keys once per source sequence, for `forward(..., projected_keys=...)`.

        Args:
            keys: (B, Lk, key_dim).

        Returns:
            `keys W_k^T + b`, (B, Lk, attn_dim).
        """
        return self.key_proj(keys)

    def forward(
        self,
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor | None = None,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = False,
        projected_keys: torch.Tensor | None = None,
    ):
        """Attend from the queries over the keys.

        Args:
            query: (B, Lq, query_dim), or (B, query_dim) for one decoder step.
            keys: (B, Lk, key_dim).
            values: (B, Lk, value_dim); default: keys.
            key_padding_mask: Bool (B, Lk), True = ignore that key.
            need_weights: Also return the attention weights.
            projected_keys: `project_keys(keys)`, computed once and reused across decoder steps.

        Returns:
            The context (B, Lq, value_dim) (or (B, value_dim)); with `need_weights`, the pair
            (context, weights), weights (B, Lq, Lk) (or (B, Lk)). Queries whose keys are all masked
            get a zero context and zero weights.

        Raises:
            ValueError: Inputs whose shapes do not match the module's dims.
        """
        if values is not None and values.shape[-1] != self.value_dim:
            raise ValueError(
                f"AdditiveAttention: values must have {self.value_dim} features, "
                f"got shape {tuple(values.shape)}"
            )
        if projected_keys is None and not torch.compiler.is_compiling():
            projected_keys = self._reusable_key_projection(keys)
        return additive_attention(
            query,
            keys,
            values,
            w_query=self.query_proj.weight,
            w_keys=self.key_proj.weight,
            v=self.v,
            bias=self.key_proj.bias,
            key_padding_mask=key_padding_mask,
            return_weights=need_weights,
            projected_keys=projected_keys,
        )

    def _reusable_key_projection(self, keys: torch.Tensor) -> torch.Tensor | None:
        """project_keys(keys), reused from this module's previous call when that call had the
        same keys tensor, neither keys nor key_proj's parameters have changed since (same
        tensors, same version counters) and the grad / inference / autocast modes are the
        same. A projection that is part of an autograd graph is held weakly: once the graph
        that saved it is gone (a backward without retain_graph frees it), it is projected
        anew, so a backward after each step still works. None (the op projects) for inputs
        project_keys would refuse."""
        if not isinstance(keys, torch.Tensor) or keys.dim() != 3:
            return None
        weight, bias = self.key_proj.weight, self.key_proj.bias
        state = (
            keys._version,
            id(weight),
            weight._version,
            id(bias),
            None if bias is None else bias._version,
            torch.is_grad_enabled(),
            torch.is_inference_mode_enabled(),
            torch.is_autocast_enabled(keys.device.type),
        )
        entry = _KEY_PROJECTIONS.get(self)
        if entry is not None:
            keys_ref, projection_ref, saved_state = entry
            projection = projection_ref()
            # ids compared while keys (checked first) and the parameters are alive
            if projection is not None and keys_ref() is keys and saved_state == state:
                return projection
        projection = self.project_keys(keys)
        if projection.requires_grad:  # the graph keeps it alive while it can be used
            projection_ref = weakref.ref(projection)
        else:
            projection_ref = _StrongRef(projection)
            # a projection without a graph is held until its keys are freed
            weakref.finalize(keys, _forget_projection, weakref.ref(self), projection_ref)
        _KEY_PROJECTIONS[self] = (weakref.ref(keys), projection_ref, state)
        return projection

    def extra_repr(self) -> str:
        return (
            f"query_dim={self.query_dim}, key_dim={self.key_dim}, attn_dim={self.attn_dim}, "
            f"value_dim={self.value_dim}"
        )


# AdditiveAttention -> (weakref to keys, reference to their projection, the state it was
# made in); outside the modules, so that copying or pickling a module never sees it.
_KEY_PROJECTIONS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class _StrongRef:
    """weakref.ref's interface over a strong reference."""

    def __init__(self, value):
        self.value = value

    def __call__(self):
        return self.value


def _forget_projection(module_ref, projection_ref) -> None:
    module = module_ref()
    entry = _KEY_PROJECTIONS.get(module) if module is not None else None
    if entry is not None and entry[1] is projection_ref:
        del _KEY_PROJECTIONS[module]
