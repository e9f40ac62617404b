"""Process-group helpers and the layouts' chunk arithmetic, shared by the distributed ops."""

from __future__ import annotations

import torch
import torch.distributed as dist

LAYOUTS = ("zigzag", "contiguous")


def group_info(op: str, group) -> tuple[int, int]:
    """(rank in group, world size of group); a clear error without an initialised group."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"{op}: torch.distributed is not initialised; call "
            f"torch.distributed.init_process_group first (torchrun sets the "
            f"environment for it)"
        )
    return dist.get_rank(group), dist.get_world_size(group)


def global_rank(group, rank: int) -> int:
    """The global rank of `rank` in `group` (point-to-point ops address global ranks)."""
    return rank if group is None else dist.get_global_rank(group, rank)


def check_layout(op: str, layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"{op}: layout must be 'zigzag' or 'contiguous', got {layout!r}")


def num_chunks(layout: str, world: int) -> int:
    """How many equal chunks the full sequence is cut into: 2W (zigzag) or W (contiguous)."""
    return 2 * world if layout == "zigzag" else world


def rank_chunks(layout: str, world: int, rank: int) -> list[int]:
    """The chunk indices rank `rank` holds, in the order its shard stores them."""
    return [rank, 2 * world - 1 - rank] if layout == "zigzag" else [rank]


def check_full_length(op: str, name: str, length: int, layout: str, world: int) -> int:
    """The chunk size of a full sequence of `length`; a clear error when it does not divide."""
    n = num_chunks(layout, world)
    if length % n != 0 or length == 0:
        rule = (
            f"2 * world_size = {n} equal chunks (layout 'zigzag')"
            if layout == "zigzag"
            else f"world_size = {n} equal chunks (layout 'contiguous')"
        )
        raise ValueError(
            f"{op}: {name} must be a positive multiple of {n}: the sequence is "
            f"split into {rule}, got {length}"
        )
    return length // n


def check_local_length(op: str, name: str, length: int, layout: str, world: int) -> int:
    """The chunk size of a local shard of `length` (2 chunks for zigzag, 1 for contiguous)."""
    per_rank = 2 if layout == "zigzag" else 1
    if length % per_rank != 0 or length == 0:
        rule = (
            f"a positive even number with layout 'zigzag' (each rank holds 2 of the "
            f"2 * world_size = {2 * world} chunks)"
            if per_rank == 2
            else "positive"
        )
        raise ValueError(f"{op}: {name} must be {rule}, got {length}")
    return length // per_rank


_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


def check_same_across_ranks(op: str, group, device: torch.device, **shapes) -> None:
    """All-gathers the given shapes (tuples of ints; a torch.dtype is encoded) and raises the
    same clear error on every rank when they differ, so a mismatch fails instead of hanging
    in the point-to-point transfers that would follow. One small collective per call."""
    names = list(shapes)
    flat: list[int] = []
    width = 9  # fixed per value, so that every rank contributes a tensor of the same size
    for name in names:
        value = shapes[name]
        if isinstance(value, torch.dtype):
            value = (_DTYPES.index(value) if value in _DTYPES else -1,)
        value = tuple(int(x) for x in value)[: width - 1]
        flat.extend((len(value),) + value + (-1,) * (width - 1 - len(value)))
    widths = [width] * len(names)
    mine = torch.tensor(flat, dtype=torch.int64, device=device)
    world = dist.get_world_size(group)
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine, group=group)
    rows = [t.tolist() for t in everyone]
    if all(row == rows[0] for row in rows):
        return
    offset = 0
    for name, width in zip(names, widths):
        per_rank = [tuple(row[offset + 1 : offset + 1 + row[offset]]) for row in rows]
        offset += width
        if len(set(per_rank)) > 1:
            shown: list = per_rank
            if isinstance(shapes[name], torch.dtype):
                shown = [str(_DTYPES[v[0]]) if v[0] >= 0 else "other" for v in per_rank]
            raise ValueError(
                f"{op}: {name} must be the same on every rank of the group, got "
                f"{', '.join(f'rank {r}: {v}' for r, v in enumerate(shown))}"
            )


def check_shards(op: str, group, layout: str, q, k, v) -> tuple[int, int]:
    """The checks every context-parallel attention starts with: an initialised group, a known
    layout, tensors q, k, v with the same shapes and q's dtype on every rank, 4-D each.
    Returns (rank in group, world size of group)."""
    rank, world = group_info(op, group)
    check_layout(op, layout)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    # First, before any check that could fail on some ranks only: the shapes of every rank
    # (a rank that raised alone would leave the others waiting in the collectives).
    check_same_across_ranks(
        op,
        group,
        q.device,
        **{
            "q's shape": tuple(q.shape),
            "k's shape": tuple(k.shape),
            "v's shape": tuple(v.shape),
            "q's dtype": q.dtype,
        },
    )
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(
                f"{op}: {name} must be 4-D (B, H, L_local, D), got shape {tuple(t.shape)}"
            )
    return rank, world


def check_same_sequence(op: str, q, k, v) -> None:
    """q, k and v must be shards of one sequence (self-attention): the same local length."""
    if q.shape[2] != k.shape[2] or k.shape[2] != v.shape[2]:
        raise ValueError(
            f"{op}: q, k and v must be shards of the same sequence "
            f"(self-attention), got lengths {q.shape[2]}, {k.shape[2]} and "
            f"{v.shape[2]}"
        )
