"""Positional-encoding modules: thin wrappers over fastattn.ops.positional."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..ops.positional import (
    Offset,
    add_sinusoidal,
    apply_rotary,
    embed_with_positions,
    learned_positions,
)


class SinusoidalPositionalEncoding(nn.Module):
    """`x * scale + PE`, then dropout, in one fused pass ("Attention Is All You Need").

    Dropout applies in training mode only.

    Args:
        d_model: Features of x.
        dropout: Dropout probability, in [0, 1).
        scale: Multiplies x first.
        base: The sinusoid's wavelength base.
        batch_first: x is (B, L, d_model); otherwise (L, B, d_model).
        inplace: When no gradient is needed (eval under `torch.no_grad` or `inference_mode`, or
            x not requiring grad), write the result into x itself, as `nn.ReLU(inplace=True)`
            does: the caller must not need x afterwards. No output is allocated. With gradients
            the module computes out of place.

    Raises:
        ValueError: A dropout probability outside [0, 1).
    """

    def __init__(
        self,
        d_model: int,
        *,
        dropout: float = 0.0,
        scale: float = 1.0,
        base: float = 10000.0,
        batch_first: bool = True,
        inplace: bool = False,
    ):
        super().__init__()
        if not 0.0 <= dropout < 1.0:
            raise ValueError(
                f"SinusoidalPositionalEncoding: dropout must be in [0, 1), got {dropout}"
            )
        self.d_model, self.dropout, self.scale = d_model, dropout, scale
        self.base, self.batch_first, self.inplace = base, batch_first, inplace

    def forward(self, x: torch.Tensor, offset: Offset = 0) -> torch.Tensor:
        """Add the positions (and drop out, in training).

        Args:
            x: (B, L, d_model) when batch_first, else (L, B, d_model).
            offset: An int or an integer (B,) tensor of start positions (decoding with a cache).

        Returns:
            A tensor shaped like x (x itself when written in place).

        Raises:
            ValueError: x's last dim is not d_model.
        """
        if x.shape[-1] != self.d_model:
            raise ValueError(
                f"SinusoidalPositionalEncoding: expected x with {self.d_model} "
                f"features in the last dim, got shape {tuple(x.shape)}"
            )
        inplace = self.inplace and not (x.requires_grad and torch.is_grad_enabled())
        return add_sinusoidal(
            x,
            offset=offset,
            scale=self.scale,
            base=self.base,
            dropout_p=self.dropout if self.training else 0.0,
            seq_dim=1 if self.batch_first else 0,
            inplace=inplace,
        )

    def extra_repr(self) -> str:
        return (
            f"{self.d_model}, dropout={self.dropout}, scale={self.scale}, base={self.base}, "
            f"batch_first={self.batch_first}" + (", inplace=True" if self.inplace else "")
        )


class LearnedPositionalEmbedding(nn.Module):
    """A learned position table added to batch-first x, then dropout.

    The parameter `weight` (max_len, d_model) is initialised N(0, 0.02) as in BERT and GPT-2.

    Args:
        max_len: The positions the table holds.
        d_model: Features of x.
        dropout: Dropout probability.
    """

    def __init__(self, max_len: int, d_model: int, *, dropout: float = 0.0):
        super().__init__()
        self.max_len, self.d_model, self.dropout = max_len, d_model, dropout
        self.weight = nn.Parameter(torch.empty(max_len, d_model))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: torch.Tensor, offset: Offset = 0) -> torch.Tensor:
        """`x + weight[offset : offset + L]`, then dropout.

        Args:
            x: (B, L, d_model).
            offset: An int or an integer (B,) tensor of per-sequence start positions.

        Returns:
            (B, L, d_model).
        """
        if x.dim() != 3 or x.shape[-1] != self.d_model:
            raise ValueError(
                f"LearnedPositionalEmbedding: expected x (B, L, {self.d_model}), "
                f"got shape {tuple(x.shape)}"
            )
        pos = learned_positions(
            self.weight, offset, x.shape[1], caller="LearnedPositionalEmbedding"
        )
        return nn.functional.dropout(x + pos.to(x.dtype), self.dropout, self.training)

    def extra_repr(self) -> str:
        return f"{self.max_len}, {self.d_model}, dropout={self.dropout}"


class PositionalEmbedding(nn.Module):
    """Token embedding times scale, plus positions (sinusoidal or learned), then dropout, fused.

    Parameters: `weight` (num_embeddings, d_model), initialised N(0, 1) as `nn.Embedding` with
    the padding_idx row zeroed; `position_weight` (max_len, d_model) when positions="learned".

    Args:
        num_embeddings: The vocabulary size.
        d_model: The embedding features.
        positions: "sinusoidal" or "learned".
        max_len: The positions a learned table holds (required with "learned").
        scale: Multiplies the token embeddings.
        dropout: Dropout probability.
        padding_idx: A token id whose row gets no gradient, as in `nn.Embedding`.
    """

    def __init__(
        self,
        num_embeddings: int,
        d_model: int,
        *,
        positions: str = "sinusoidal",
        max_len: int | None = None,
        scale: float = 1.0,
        dropout: float = 0.0,
        padding_idx: int | None = None,
    ):
        super().__init__()
        if positions not in ("sinusoidal", "learned"):
            raise ValueError(
                f"PositionalEmbedding: positions must be 'sinusoidal' or 'learned', "
                f"got {positions!r}"
            )
        if positions == "learned" and (max_len is None or max_len < 1):
            raise ValueError("PositionalEmbedding: positions='learned' needs max_len >= 1")
        self.num_embeddings, self.d_model, self.positions = num_embeddings, d_model, positions
        self.max_len, self.scale, self.dropout, self.padding_idx = (
            max_len,
            scale,
            dropout,
            padding_idx,
        )
        self.weight = nn.Parameter(torch.empty(num_embeddings, d_model))
        nn.init.normal_(self.weight)
        if padding_idx is not None:
            with torch.no_grad():
                self.weight[padding_idx].zero_()
        if positions == "learned":
            assert max_len is not None  # (checked above)
            self.position_weight = nn.Parameter(torch.empty(max_len, d_model))
            nn.init.normal_(self.position_weight, std=0.02)
        else:
            self.register_parameter("position_weight", None)

    def forward(self, tokens: torch.Tensor, offset: Offset = 0) -> torch.Tensor:
        """Embed the tokens with their positions.

        Args:
            tokens: (B, L) or (L,) integer ids.
            offset: An int or an integer (B,) tensor of start positions.

        Returns:
            (B, L, d_model), or (L, d_model) for (L,) tokens.
        """
        return embed_with_positions(
            tokens,
            self.weight,
            positions=self.position_weight if self.positions == "learned" else "sinusoidal",
            scale=self.scale,
            offset=offset,
            padding_idx=self.padding_idx,
            dropout_p=self.dropout if self.training else 0.0,
        )

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.d_model}, positions={self.positions!r}, "
            f"max_len={self.max_len}, scale={self.scale}, dropout={self.dropout}, "
            f"padding_idx={self.padding_idx}"
        )


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (RoPE) of queries and keys, angles computed in the kernel.

    The angles are `pos * base^(-2i / dim)`.

    Args:
        dim: The features rotated (rotary_dim: even, at most the head dim).
        base: The wavelength base.
        interleaved: GPT-J pairs (2i, 2i + 1) instead of GPT-NeoX halves.
    """

    def __init__(self, dim: int, *, base: float = 10000.0, interleaved: bool = False):
        super().__init__()
        if dim < 2 or dim % 2:
            raise ValueError(f"RotaryEmbedding: dim must be even and >= 2, got {dim}")
        self.dim, self.base, self.interleaved = dim, base, interleaved

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, offset: Offset = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate queries and keys by their positions.

        Args:
            q: (B, Hq, L, D).
            k: (B, Hk, L, D).
            offset: An int or an integer (B,) tensor of start positions.

        Returns:
            The rotated (q, k), shaped as given.
        """
        kwargs: dict[str, Any] = dict(
            base=self.base, interleaved=self.interleaved, offset=offset, rotary_dim=self.dim
        )
        return apply_rotary(q, **kwargs), apply_rotary(k, **kwargs)

    def extra_repr(self) -> str:
        return f"{self.dim}, base={self.base}, interleaved={self.interleaved}"
