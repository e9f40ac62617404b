"""Sharding a sequence over the ranks of a group: shard_sequence, gather_sequence,
shard_positions."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ._group import (
    check_full_length,
    check_layout,
    check_local_length,
    check_same_across_ranks,
    group_info,
    num_chunks,
    rank_chunks,
)


def shard_sequence(
    x: torch.Tensor, *, dim: int, group=None, layout: str = "zigzag"
) -> torch.Tensor:
    """This rank's shard of the full sequence x (the same x on every rank). No communication.

    Args:
        x: Any tensor whose dimension `dim` is the sequence, of length L divisible into 2W chunks
            ("zigzag") or W chunks ("contiguous").
        dim: The sequence dimension.
        group: The process group; default: the default group (its size is W).
        layout: "zigzag": rank r gets chunks r and 2W-1-r, concatenated (balances causal work);
            "contiguous": rank r gets chunk r.

    Returns:
        x with dimension `dim` of length L / W: a copy for zigzag, a view for contiguous.
        Differentiable (the gradient lands in this rank's rows of x).

    Raises:
        ValueError: A length that does not divide into the layout's chunks, or an unknown layout.
    """
    op = "shard_sequence"
    rank, world = group_info(op, group)
    check_layout(op, layout)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: x must be a torch.Tensor, got {type(x).__name__}")
    dim = dim % x.dim() if x.dim() else dim
    c = check_full_length(op, f"x.shape[{dim}] (the sequence length)", x.shape[dim], layout, world)
    parts = [x.narrow(dim, i * c, c) for i in rank_chunks(layout, world, rank)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def _gather(x_local: torch.Tensor, dim: int, group, layout: str, world: int) -> torch.Tensor:
    pieces = [torch.empty_like(x_local) for _ in range(world)]
    dist.all_gather(pieces, x_local.contiguous(), group=group)
    per_rank = 2 if layout == "zigzag" else 1
    c = x_local.shape[dim] // per_rank
    chunks: list = [None] * num_chunks(layout, world)  # every slot is filled below
    for r, piece in enumerate(pieces):
        for slot, i in enumerate(rank_chunks(layout, world, r)):
            chunks[i] = piece.narrow(dim, slot * c, c)
    return torch.cat(chunks, dim=dim)


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_local, dim, group, layout, rank, world):
        ctx.meta = (dim, group, layout, rank, world)
        return _gather(x_local, dim, group, layout, world)

    @staticmethod
    def backward(ctx, grad):
        dim, group, layout, rank, world = ctx.meta
        # Every rank's loss may use the whole gathered sequence: this rank's rows receive the
        # sum over ranks of their gradients (all-reduce, then this rank's shard).
        grad = grad.contiguous()
        dist.all_reduce(grad, group=group)
        c = grad.shape[dim] // num_chunks(layout, world)
        parts = [grad.narrow(dim, i * c, c) for i in rank_chunks(layout, world, rank)]
        return (
            (parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)),
            None,
            None,
            None,
            None,
            None,
        )


def gather_sequence(
    x_local: torch.Tensor, *, dim: int, group=None, layout: str = "zigzag"
) -> torch.Tensor:
    """The full sequence from every rank's shard (the inverse of `shard_sequence`).

    Args:
        x_local: This rank's shard, dimension `dim` of length L / W (even for "zigzag"); every
            rank's shard must have the same shape.
        dim: The sequence dimension.
        group: The process group; default: the default group (its size is W).
        layout: "zigzag" or "contiguous", as the shards were made.

    Returns:
        The full tensor, dimension `dim` of length L, the same on every rank. Differentiable: the
        loss is taken as the sum of the ranks' losses, so the gradient of x_local is the sum over
        ranks of the gradients each rank's loss gives this rank's rows (an all-reduce in the
        backward).

    Raises:
        ValueError: Shards of different shapes on different ranks, or an unknown layout.
    """
    op = "gather_sequence"
    rank, world = group_info(op, group)
    check_layout(op, layout)
    if not isinstance(x_local, torch.Tensor):
        raise TypeError(f"{op}: x_local must be a torch.Tensor, got {type(x_local).__name__}")
    # First the shapes of every rank (a rank raising alone would leave the others waiting).
    check_same_across_ranks(
        op,
        group,
        x_local.device,
        **{"x_local's shape": x_local.shape},
        **{"x_local's dtype": x_local.dtype},
    )
    dim = dim % x_local.dim()
    check_local_length(op, f"x_local.shape[{dim}]", x_local.shape[dim], layout, world)
    return _GatherSequence.apply(x_local, dim, group, layout, rank, world)


def shard_positions(
    seq_len: int, *, group=None, layout: str = "zigzag", device: torch.device | str | None = None
) -> torch.Tensor:
    """The global positions of this rank's rows, in the order of its shard.

    What `shard_sequence(torch.arange(seq_len), dim=0)` gives: feed them to positional encodings
    (`apply_rotary`'s position_ids, a learned table's index).

    Args:
        seq_len: The full sequence's length L.
        group: The process group; default: the default group (its size is W).
        layout: "zigzag" or "contiguous".
        device: The result's device.

    Returns:
        Int64 (L / W,).

    Raises:
        ValueError: A length that does not divide into the layout's chunks.
    """
    op = "shard_positions"
    rank, world = group_info(op, group)
    check_layout(op, layout)
    c = check_full_length(op, "seq_len", int(seq_len), layout, world)
    return torch.cat(
        [
            torch.arange(i * c, (i + 1) * c, dtype=torch.int64, device=device)
            for i in rank_chunks(layout, world, rank)
        ]
    )
