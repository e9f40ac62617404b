"""Ring attention (context parallelism by point-to-point): each rank keeps its query shard and
the key/value shards travel around the ring of the group's ranks.

Forward, W steps: at step t rank r holds the K/V shard of rank s = (r - t) mod W. It first
posts the transfer of that shard to rank r+1 (and the receipt of the next one from r-1, with
batch_isend_irecv), then attends its queries to the block it holds, then waits: the transfer
runs while the block computes. Partial results are merged with merge_attention's lse math.

Blocks are chunk pairs: with the "zigzag" layout a shard is 2 chunks of c = L/(2W) rows,
"contiguous" 1 chunk of c = L/W. A (query chunk a, key chunk b) pair sits at a global offset
d = (a - b) * c, so everything defined on global positions becomes a per-block quantity:
- causal masks and windows become a band lo <= j - i <= hi shifted by d (fastattn's kernels
  take any band), and a pair whose band misses the block entirely (a fully masked causal
  block) is skipped, not computed;
- ALiBi's -slope * |i + d - j| is the kernels' own ALiBi on the diagonal (d = 0); off it
  |d| >= c > |i - j|, so the distance has one sign over the block and splits into a per-key
  term (a (B, Hq, 1, c) float mask, read through strides) and a per-row constant that moves
  only the block's lse (added back before merging).

Backward, a second ring: each rank keeps its queries, out, lse and dO and accumulates dQ; K/V
travel as in the forward and dK/dV accumulators travel with them, each rank adding its
contribution (FlashAttention's backward with the row's final out and lse: the block's share
of the merged attention's gradients), so after W hops every accumulator is back at its owner.
The next K/V transfer is posted before the block's backward; an accumulator is sent right
after its block's backward and waited for one step later.

Dropout equals the one-process call's, mask included: fastattn numbers its dropout stream
(Philox, keyed by the call's seed) by element ((b*Hq + h)*L + i)*L + j of the whole (L, L)
score matrix, and the ring numbers each block's elements by their global i and j. The fused
kernels number a call's elements by its own rows and columns, so with dropout_p > 0 the
blocks run fastattn's reference math (plain PyTorch, materialising each block's
(c, c) scores) with the globally numbered keep-mask, in the forward and the backward. The
seed is drawn as `attention` draws it (torch's generator of q's device) on the group's first
rank and broadcast.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..ops.attention import (
    WINDOW_UNBOUNDED,
    AttentionArgs,
    attention_backward_canonical,
    attention_band,
    dropout_keep,
    dropout_seed,
    merge_attention,
    window_bounds,
)
from ._group import (
    check_local_length,
    check_same_sequence,
    check_shards,
    global_rank,
    rank_chunks,
)

# Tests set this to a list to record the order of transfers and block computations.
TRACE: list | None = None


def _trace(*event) -> None:
    if TRACE is not None:
        TRACE.append(event)


class _Plan:
    """Everything about one call that every block needs."""

    chosen: str  # the backend of the blocks, set by the first block's forward

    def __init__(
        self,
        group,
        rank,
        world,
        layout,
        c,
        lo,
        hi,
        scale,
        softcap,
        alibi,
        backend,
        acc_dtype,
        dropout_p: float = 0.0,
        seed: torch.Tensor | None = None,
    ):
        self.group, self.rank, self.world, self.layout, self.c = group, rank, world, layout, c
        self.lo, self.hi, self.scale, self.softcap = lo, hi, scale, softcap
        self.alibi, self.backend, self.acc = alibi, backend, acc_dtype
        self.dropout_p, self.seed = dropout_p, seed
        self.next = global_rank(group, (rank + 1) % world)
        self.prev = global_rank(group, (rank - 1) % world)

    def chunks(self, rank: int) -> list[int]:
        return rank_chunks(self.layout, self.world, rank)

    def block(self, qi: int, ki: int):
        """(band, attn_mask, alibi_slopes, row_term) for query chunk qi against key chunk ki,
        or None when no query of the block sees any of its keys."""
        c, d = self.c, (qi - ki) * self.c
        lo = -WINDOW_UNBOUNDED if self.lo <= -WINDOW_UNBOUNDED else self.lo + d
        hi = WINDOW_UNBOUNDED if self.hi >= WINDOW_UNBOUNDED else self.hi + d
        if lo > c - 1 or hi < -(c - 1) or lo > hi:
            return None
        if self.alibi is None or d == 0:
            return (lo, hi), None, self.alibi, None
        slope = self.alibi.to(self.acc)  # (B, Hq)
        j = torch.arange(c, device=slope.device, dtype=self.acc)
        if d > 0:  # keys before queries: |i + d - j| = (i + d - (c-1)) + ((c-1) - j)
            mask = slope[:, :, None, None] * (j - (c - 1))
            row = -slope[:, :, None] * (j + (d - (c - 1)))
        else:  # keys after queries: |i + d - j| = -(i + d) + j
            mask = -slope[:, :, None, None] * j
            row = slope[:, :, None] * (j + d)
        return (lo, hi), mask, None, row


def _keep(plan: _Plan, q, qi, ki):
    """The dropout keep-mask (B, Hq, c, c) of the block (qi, ki), numbered as the one-process
    call numbers the whole (L, L) matrix; None without dropout."""
    if plan.dropout_p <= 0.0:
        return None
    B, Hq, c = q.shape[0], q.shape[1], plan.c
    L = c * (2 * plan.world if plan.layout == "zigzag" else plan.world)
    i = torch.arange(qi * c, (qi + 1) * c, device=q.device).view(1, 1, c, 1)
    j = torch.arange(ki * c, (ki + 1) * c, device=q.device).view(1, 1, 1, c)
    bh = torch.arange(B * Hq, device=q.device).view(B, Hq, 1, 1)
    assert plan.seed is not None  # drawn for every call with dropout
    return dropout_keep(plan.seed, (bh * L + i) * L + j, plan.dropout_p)


def _block_forward(plan: _Plan, q, k, v, qi, ki):
    spec = plan.block(qi, ki)
    if spec is None:
        return None
    _trace("block", qi, ki)
    band, mask, alibi, row = spec
    out, lse, _, chosen = attention_band(
        q,
        k,
        v,
        attn_mask=mask,
        alibi_slopes=alibi,
        scale=plan.scale,
        softcap=plan.softcap,
        band=band,
        backend=plan.backend,
        dropout_p=plan.dropout_p,
        seed=plan.seed,
        keep=_keep(plan, q, qi, ki),
    )
    plan.chosen = chosen
    if row is not None:
        lse = lse + row.to(lse.dtype)
    return out, lse


def _block_backward(plan: _Plan, q, k, v, out, lse, dout, dlse, qi, ki):
    spec = plan.block(qi, ki)
    if spec is None:
        return None
    (lo, hi), mask, alibi, row = spec
    B, Hq, Lq, _ = q.shape
    if mask is not None:  # the canonical arguments attention_band gave the forward's block
        mask = mask.expand(B, Hq, Lq, k.shape[2])
    if alibi is not None:
        alibi = alibi.expand(B, Hq)
    if row is not None:
        lse = lse - row.to(lse.dtype)
    args = AttentionArgs(
        q, k, v, mask, None, alibi, plan.scale, plan.softcap, lo, hi, plan.dropout_p, plan.seed
    )
    return attention_backward_canonical(
        dout, dlse, out, lse, args, plan.chosen, keep=_keep(plan, q, qi, ki)
    )


def _exchange(plan: _Plan, tensors: list[torch.Tensor], tag: int):
    """Posts the send of `tensors` to the next rank and the receipt of as many from the
    previous one; returns (received buffers, requests)."""
    received = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t, plan.next, plan.group, tag) for t in tensors]
    ops += [dist.P2POp(dist.irecv, t, plan.prev, plan.group, tag) for t in received]
    return received, dist.batch_isend_irecv(ops)


def _wait(requests) -> None:
    for request in requests:
        request.wait()


def _split(x: torch.Tensor, c: int) -> list[torch.Tensor]:
    return [x.narrow(2, slot * c, c) for slot in range(x.shape[2] // c)]


def _ring_forward(plan: _Plan, q, k, v):
    c, my_chunks = plan.c, plan.chunks(plan.rank)
    q_parts = _split(q, c)
    acc_out: list = [None] * len(q_parts)
    acc_lse: list = [None] * len(q_parts)
    kv = [k.contiguous(), v.contiguous()]
    for step in range(plan.world):
        source = (plan.rank - step) % plan.world
        pending = None
        if step + 1 < plan.world:
            _trace("send_kv", step)
            pending = _exchange(plan, kv, tag=1)
        _trace("compute", step)
        for slot, qi in enumerate(my_chunks):
            for k_part, v_part, ki in zip(_split(kv[0], c), _split(kv[1], c), plan.chunks(source)):
                result = _block_forward(plan, q_parts[slot], k_part, v_part, qi, ki)
                if result is None:
                    continue
                out, lse = result
                out = out.to(plan.acc)
                if acc_out[slot] is None:
                    acc_out[slot], acc_lse[slot] = out, lse
                else:
                    acc_out[slot], acc_lse[slot] = merge_attention(
                        [acc_out[slot], out], [acc_lse[slot], lse]
                    )
        if pending is not None:
            kv, requests = pending
            _wait(requests)
            _trace("received_kv", step)
    B, Hq = q.shape[0], q.shape[1]
    for slot in range(len(q_parts)):  # a window always holds the diagonal, but be total
        if acc_out[slot] is None:
            acc_out[slot] = q.new_zeros((B, Hq, c, v.shape[3]), dtype=plan.acc)
            acc_lse[slot] = q.new_full((B, Hq, c), float("-inf"), dtype=plan.acc)
    out = torch.cat(acc_out, dim=2).to(q.dtype)
    lse = torch.cat(acc_lse, dim=2)
    return out, lse


def _ring_backward(plan: _Plan, q, k, v, out, lse, dout, dlse):
    c, my_chunks = plan.c, plan.chunks(plan.rank)
    q_parts, out_parts, lse_parts = _split(q, c), _split(out, c), _split(lse.unsqueeze(-1), c)
    lse_parts = [x.squeeze(-1) for x in lse_parts]
    dout_parts = _split(dout, c)
    dlse_parts = None if dlse is None else [x.squeeze(-1) for x in _split(dlse.unsqueeze(-1), c)]
    dq = torch.zeros(q.shape, dtype=plan.acc, device=q.device)
    dq_parts = _split(dq, c)
    kv = [k.contiguous(), v.contiguous()]
    incoming = None  # (buffers, requests) of the dK/dV accumulator for the next step's block
    for step in range(plan.world):
        source = (plan.rank - step) % plan.world
        pending = None
        if step + 1 < plan.world:
            _trace("send_kv", step)
            pending = _exchange(plan, kv, tag=1)
        _trace("compute", step)
        dk = torch.zeros(k.shape, dtype=plan.acc, device=k.device)
        dv = torch.zeros(v.shape, dtype=plan.acc, device=v.device)
        dk_parts, dv_parts = _split(dk, c), _split(dv, c)
        for slot, qi in enumerate(my_chunks):
            for kslot, (k_part, v_part, ki) in enumerate(
                zip(_split(kv[0], c), _split(kv[1], c), plan.chunks(source))
            ):
                grads = _block_backward(
                    plan,
                    q_parts[slot],
                    k_part,
                    v_part,
                    out_parts[slot],
                    lse_parts[slot],
                    dout_parts[slot],
                    None if dlse_parts is None else dlse_parts[slot],
                    qi,
                    ki,
                )
                if grads is None:
                    continue
                dq_parts[slot] += grads[0]
                dk_parts[kslot] += grads[1]
                dv_parts[kslot] += grads[2]
        if incoming is not None:
            (dk_in, dv_in), requests = incoming
            _wait(requests)
            dk += dk_in
            dv += dv_in
        if plan.world > 1:
            _trace("send_dkv", step)
            incoming = _exchange(plan, [dk, dv], tag=2)
        else:
            incoming = ([dk, dv], [])
        if pending is not None:
            kv, requests = pending
            _wait(requests)
    assert incoming is not None  # set by the loop's last step
    (dk, dv), requests = incoming
    _wait(requests)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan):
        out, lse = _ring_forward(plan, q, k, v)
        ctx.plan = plan
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        if dout is None and dlse is None:
            return None, None, None, None
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv = _ring_backward(ctx.plan, q, k, v, out, lse, dout, dlse)
        return dq, dk, dv, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group=None,
    layout: str = "zigzag",
    causal=False,
    scale: float | None = None,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    window: tuple[int, int] | None = None,
    dropout_p: float = 0.0,
    return_lse: bool = False,
    backend: str | None = None,
):
    """Self-attention over a sequence sharded across the ranks of a group (ring attention).

    K/V shards travel around the ring (each step's transfer posted before the block's attention)
    and the blocks' results merge by their log-sum-exp. Collective: every rank of the group must
    call it with the same shapes and arguments.

    Args:
        q: (B, Hq, L_local, D), this rank's shard (`shard_sequence(..., dim=2, layout=layout)`
            of the full tensor), the same shape on every rank; L = W * L_local.
        k: (B, Hkv, L_local, D); Hq a multiple of Hkv (GQA/MQA).
        v: (B, Hkv, L_local, Dv).
        group: The process group; default: the default group (its size is W).
        layout: "zigzag" (rank r holds chunks r and 2W-1-r of 2W; L_local must be even) or
            "contiguous" (rank r holds chunk r of W).
        causal: False, or True / "top_left" / "bottom_right" (the same for self-attention): the
            query at global position i sees keys at global positions `j <= i`.
        scale: Multiplies `q.k`; default `1 / sqrt(D)`.
        softcap: If > 0, caps the scores: `softcap * tanh(s / softcap)`.
        alibi_slopes: (Hq,) or (B, Hq): adds `-slope * abs(i - j)` on global positions (no
            gradient).
        window: (left, right) on global positions: `i - left <= j <= i + right` (-1 unbounded).
        dropout_p: Dropout on the probabilities with the one-process call's mask (the same
            `torch.manual_seed` state gives the same mask); the blocks then run the reference
            math, so backend must be None or "reference".
        return_lse: Also return the log-sum-exp of each row.
        backend: The fastattn backend for the blocks; None: the usual choice.

    Returns:
        This rank's shard of what `fastattn.attention` gives on the full sequence,
        (B, Hq, L_local, Dv) in q's dtype; with `return_lse`, (out, lse), lse (B, Hq, L_local)
        float32 (float64 for float64 inputs). Differentiable in q, k and v: the gradients are
        this rank's shards of the one-process gradients (a second ring in the backward).

    Raises:
        ValueError: Shapes that differ across ranks or do not fit the layout, or dropout with a
            kernel backend; raised on every rank alike, before any transfer.
    """
    op = "ring_attention"
    rank, world = check_shards(op, group, layout, q, k, v)
    if not isinstance(dropout_p, (int, float)) or not 0.0 <= float(dropout_p) < 1.0:
        raise ValueError(f"{op}: dropout_p must be a float in [0, 1), got {dropout_p!r}")
    dropout_p = float(dropout_p)
    if dropout_p > 0.0 and backend not in (None, "reference"):
        raise ValueError(
            f"{op}: with dropout_p > 0 the blocks run the reference math (the "
            f"fused kernels number their dropout stream by block-local rows and "
            f"columns, not the whole sequence's); backend must be None or "
            f"'reference', got {backend!r}"
        )
    check_same_sequence(op, q, k, v)
    if q.dtype != k.dtype or k.dtype != v.dtype:
        raise TypeError(
            f"{op}: q, k and v must have the same dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    if (
        k.shape[0] != q.shape[0]
        or v.shape[0] != q.shape[0]
        or k.shape[1] != v.shape[1]
        or k.shape[1] == 0
        or q.shape[1] % k.shape[1]
        or k.shape[3] != q.shape[3]
    ):
        raise ValueError(
            f"{op}: shapes must be q (B, Hq, L, D), k (B, Hkv, L, D), v (B, Hkv, "
            f"L, Dv) with Hq a multiple of Hkv, got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    Ll = q.shape[2]
    c = check_local_length(op, "L_local (q.shape[2])", Ll, layout, world)
    if layout == "contiguous":
        c = Ll
    if causal not in (False, True, "top_left", "bottom_right"):
        raise ValueError(
            f"{op}: causal must be False, True, 'top_left' or 'bottom_right', got {causal!r}"
        )
    if window is not None and (
        not isinstance(window, (tuple, list))
        or len(window) != 2
        or not all(isinstance(w, int) and w >= -1 for w in window)
    ):
        raise ValueError(
            f"{op}: window must be None or (left, right) ints >= -1 "
            f"(-1 = unbounded), got {window!r}"
        )
    B, Hq = q.shape[0], q.shape[1]
    alibi = None
    if alibi_slopes is not None:
        if alibi_slopes.requires_grad and torch.is_grad_enabled():
            raise ValueError(
                f"{op}: alibi_slopes gets no gradient here; pass a tensor that "
                f"does not require grad (alibi_slopes.detach())"
            )
        if tuple(alibi_slopes.shape) not in ((Hq,), (B, Hq)):
            raise ValueError(
                f"{op}: alibi_slopes must be (Hq,) = ({Hq},) or (B, Hq) = "
                f"({B}, {Hq}), got {tuple(alibi_slopes.shape)}"
            )
        alibi = alibi_slopes.to(device=q.device, dtype=torch.float32).expand(B, Hq)
    L = Ll * world
    lo, hi = window_bounds(causal, window, L, L)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[3])
    seed = None
    if dropout_p > 0.0:
        # Drawn as attention() draws it, then rank 0's for everyone (one mask for the call).
        seed = dropout_seed(dropout_p, q.device)
        assert seed is not None  # (dropout_p > 0)
        dist.broadcast(seed, src=global_rank(group, 0), group=group)
    plan = _Plan(
        group,
        rank,
        world,
        layout,
        c,
        lo,
        hi,
        float(scale),
        float(softcap),
        alibi,
        backend,
        torch.float64 if q.dtype == torch.float64 else torch.float32,  # accumulators, lse
        dropout_p,
        seed,
    )
    out, lse = _RingAttention.apply(q, k, v, plan)
    return (out, lse) if return_lse else out
