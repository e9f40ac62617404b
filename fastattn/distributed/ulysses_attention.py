"""Ulysses attention (context parallelism by all-to-all, DeepSpeed-Ulysses): an all-to-all
turns the sequence shards of all heads into whole sequences of a 1/W share of the heads, one
ordinary fastattn.attention call runs on them with every keyword, and a second all-to-all
turns the result back into sequence shards. Communication: 4 all-to-alls of a shard's q, k, v
and out (each moves (W-1)/W of the shard), independent of W per token; heads limit W."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..ops.attention import attention
from ._group import (
    check_local_length,
    check_same_sequence,
    check_shards,
    num_chunks,
    rank_chunks,
)


def _seq_to_heads(x: torch.Tensor, group, layout: str, world: int) -> torch.Tensor:
    """(B, H, L_local, D) sequence shards -> (B, H/W, L, D) this rank's head group, in global
    sequence order."""
    B, H, Ll, D = x.shape
    hw = H // world
    # Block g (heads of rank g) first, so that all_to_all_single splits dimension 0 by rank.
    send = x.reshape(B, world, hw, Ll, D).permute(1, 0, 2, 3, 4).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    # recv[r] = rank r's rows of my heads; put its chunks at their global places.
    per_rank = 2 if layout == "zigzag" else 1
    c = Ll // per_rank
    chunks: list = [None] * num_chunks(layout, world)
    for r in range(world):
        for slot, i in enumerate(rank_chunks(layout, world, r)):
            chunks[i] = recv[r].narrow(2, slot * c, c)
    return torch.cat(chunks, dim=2)


def _heads_to_seq(y: torch.Tensor, group, layout: str, world: int) -> torch.Tensor:
    """(B, H/W, L, D) -> (B, H, L_local, D): the inverse of _seq_to_heads."""
    B, hw, L, D = y.shape
    c = L // num_chunks(layout, world)
    send = torch.stack(
        [
            torch.cat([y.narrow(2, i * c, c) for i in rank_chunks(layout, world, r)], dim=2)
            for r in range(world)
        ]
    ).contiguous()
    recv = torch.empty_like(send)  # (W, B, hw, L_local, D); recv[g] = head group g
    dist.all_to_all_single(recv, send, group=group)
    return recv.permute(1, 0, 2, 3, 4).reshape(B, hw * world, recv.shape[3], D)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, layout, world):
        ctx.meta = (group, layout, world)
        return _seq_to_heads(x, group, layout, world)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_seq(grad.contiguous(), *ctx.meta), None, None, None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, group, layout, world):
        ctx.meta = (group, layout, world)
        return _heads_to_seq(y, group, layout, world)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_heads(grad.contiguous(), *ctx.meta), None, None, None


def _head_slice(op, name, t, rank, world, Hq, B):
    """This rank's heads of a per-head tensor argument."""
    if t is None:
        return None
    hw = Hq // world
    if name == "alibi_slopes":
        return t.narrow(-1, rank * hw, hw)
    # attn_mask broadcastable to (B, Hq, L, L): slice its head dimension when it has one.
    if t.dim() >= 3 and t.shape[-3] == Hq and Hq > 1:
        return t.narrow(t.dim() - 3, rank * hw, hw)
    return t


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group=None,
    layout: str = "zigzag",
    **attention_kwargs,
):
    """Self-attention over a sequence sharded across the ranks of a group, by all-to-all.

    Two all-to-alls turn sequence shards into head shards and back. Collective: every rank of the
    group must call it with the same shapes and arguments.

    Args:
        q: (B, Hq, L_local, D), this rank's shard (layout as `shard_sequence`), the same shape on
            every rank.
        k: (B, Hkv, L_local, D); Hq and Hkv must be divisible by W.
        v: (B, Hkv, L_local, Dv).
        group: The process group; default: the default group (its size is W).
        layout: "zigzag" or "contiguous", as the shards were made.
        **attention_kwargs: Every keyword of `fastattn.attention`, on the full sequence: causal,
            window, alibi_slopes ((Hq,) or (B, Hq)), softcap, scale, attn_mask (broadcastable to
            (B, Hq, L, L)), key_padding_mask ((B, L) bool), dropout_p, return_lse, deterministic,
            backend. Per-head arguments are sliced to this rank's heads. Dropout draws a valid
            mask (each rank its own Philox seed for its heads), not the one-process call's bit for
            bit.

    Returns:
        This rank's shard (B, Hq, L_local, Dv) of the full-sequence attention; with return_lse,
        also lse (B, Hq, L_local). Differentiable in q, k, v and the tensors the attention call
        differentiates (a float attn_mask: each rank's share of its gradient).

    Raises:
        ValueError: Heads not divisible by W, or shapes that differ across ranks.
    """
    op = "ulysses_attention"
    rank, world = check_shards(op, group, layout, q, k, v)
    B, Hq, Ll, _ = q.shape
    Hkv = k.shape[1]
    if Hq % world or Hkv % world:
        raise ValueError(
            f"{op}: the heads of q ({Hq}) and of k/v ({Hkv}) must be divisible "
            f"by the group's world size ({world}): each rank attends to 1/W of "
            f"them"
        )
    check_same_sequence(op, q, k, v)
    check_local_length(op, "L_local (q.shape[2])", Ll, layout, world)
    return_lse = attention_kwargs.pop("return_lse", False)
    kwargs = dict(attention_kwargs)
    for name in ("attn_mask", "alibi_slopes"):
        if kwargs.get(name) is not None:
            kwargs[name] = _head_slice(op, name, kwargs[name], rank, world, Hq, B)
    qh, kh, vh = (_SeqToHeads.apply(t, group, layout, world) for t in (q, k, v))
    out, lse = attention(qh, kh, vh, return_lse=True, **kwargs)
    out = _HeadsToSeq.apply(out, group, layout, world)
    if not return_lse:
        return out
    return out, _HeadsToSeq.apply(lse.unsqueeze(-1), group, layout, world).squeeze(-1)
