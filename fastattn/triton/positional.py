"""Triton kernels of the positional-encoding ops: the launchers of the torch ops
fastattn::<op>_triton (in place: <op>_triton_), which fastattn/ops/positional.py registers with
the contract of fastattn/contracts/positional.py; each launcher has the native op's name.

Same math as the C++ and CUDA kernels: angles pos * inv_freq with inv_freq = base^(-2i/dim)
computed in float64 and rounded to float32 once (a cached (dim/2,) vector per device), the
sine and cosine from libdevice on GPU (tl.sin is approximate there), compute in float32, and
dropout from the shared Philox stream. Each program owns a BLOCK_R x BLOCK_D tile of rows.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton
from triton.language.extra import libdevice

from . import finish, interpreting, on_device, output_buffer, output_buffer_like
from .random import dropout_multiplier

# ---------------------------------------------------------------------------------------------
# Shared pieces


@triton.jit
def _sin(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        return libdevice.sin(x)
    else:
        return tl.sin(x)


@triton.jit
def _cos(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        return libdevice.cos(x)
    else:
        return tl.cos(x)


@triton.jit
def _sinusoid_tile(pos, cols, inv_ptr, cmask, LIBDEVICE: tl.constexpr):
    """PE[pos, cols] for int64 pos (R,) and cols (C,): sin at even columns, cos at odd."""
    inv = tl.load(inv_ptr + cols // 2, mask=cmask, other=0.0)
    angle = pos.to(tl.float32)[:, None] * inv[None, :]
    return tl.where((cols % 2 == 0)[None, :], _sin(angle, LIBDEVICE), _cos(angle, LIBDEVICE))


_inv_freq_cache: dict[tuple[int, float, str], torch.Tensor] = {}


def inverse_frequencies(dim: int, base: float, like: torch.Tensor) -> torch.Tensor:
    """(ceil(dim/2),) float32 base^(-2i/dim), from float64, on like's device.

    Cached per (dim, base, device) for eager calls, so a GPU call launches no extra kernels;
    while torch.compile traces (fake or functional tensors) it is computed in the graph.
    """

    def compute() -> torch.Tensor:
        i2 = torch.arange(0, dim, 2, dtype=torch.float64, device=like.device)
        return torch.exp2(-(i2 / dim) * math.log2(base)).to(torch.float32)

    if torch.compiler.is_compiling() or type(like) not in (torch.Tensor, torch.nn.Parameter):
        return compute()
    key = (dim, float(base), str(like.device))
    inv = _inv_freq_cache.get(key)
    if inv is None:
        inv = _inv_freq_cache[key] = compute()
    return inv


def _launch_shape(rows: int, D: int):
    """Grid and (BLOCK_R, BLOCK_D) tile for a rows x D problem: about 4K elements a program."""
    block_d = min(triton.next_power_of_2(max(D, 1)), 256)
    block_r = max(1, min(4096 // block_d, triton.next_power_of_2(max(rows, 1))))
    grid = (triton.cdiv(rows, block_r), triton.cdiv(D, block_d))
    return grid, block_r, block_d


def _dropout_args(dropout_p: float, seed: torch.Tensor | None, like: torch.Tensor):
    """(seed tensor, threshold, keep_scale). Triton passes float arguments as float32, which
    rounds p and 1/(1-p) exactly as the other backends do."""
    if dropout_p > 0.0:
        return seed, dropout_p, 1.0 / (1.0 - dropout_p)
    return like, 0.0, 1.0  # the seed pointer is unused without dropout


# ---------------------------------------------------------------------------------------------
# Kernels


@triton.jit
def _sinusoidal_table_kernel(
    pos_ptr,
    out_ptr,
    inv_ptr,
    count,
    D,
    LIBDEVICE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    rmask = rows < count
    cmask = cols < D
    pos = tl.load(pos_ptr + rows, mask=rmask, other=0)
    pe = _sinusoid_tile(pos, cols, inv_ptr, cmask, LIBDEVICE)
    tl.store(
        out_ptr + rows[:, None] * D + cols[None, :],
        pe.to(out_ptr.dtype.element_ty),
        mask=rmask[:, None] & cmask[None, :],
    )


@triton.jit
def _add_sinusoidal_kernel(
    x_ptr,
    out_ptr,
    offsets_ptr,
    seed_ptr,
    inv_ptr,
    N,
    L,
    D,
    x_sn,
    x_sl,
    o_sn,
    o_sl,
    offset,
    scale,
    threshold,
    keep_scale,
    HAS_OFFSETS: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    ADD_PE: tl.constexpr,
    LIBDEVICE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    rmask = rows < N * L
    cmask = cols < D
    mask = rmask[:, None] & cmask[None, :]
    n = rows // L
    l = rows % L
    x = tl.load(x_ptr + (n * x_sn + l * x_sl)[:, None] + cols[None, :], mask=mask, other=0.0)
    y = x.to(tl.float32) * scale
    if ADD_PE:
        pos = l + offset
        if HAS_OFFSETS:
            pos += tl.load(offsets_ptr + n, mask=rmask, other=0)
        y = y + _sinusoid_tile(pos, cols, inv_ptr, cmask, LIBDEVICE)
    if HAS_DROPOUT:
        y = y * dropout_multiplier(
            seed_ptr, rows[:, None] * D + cols[None, :], threshold, keep_scale
        )
    tl.store(
        out_ptr + (n * o_sn + l * o_sl)[:, None] + cols[None, :],
        y.to(out_ptr.dtype.element_ty),
        mask=mask,
    )


@triton.jit
def _embed_kernel(
    tokens_ptr,
    weight_ptr,
    table_ptr,
    out_ptr,
    offsets_ptr,
    seed_ptr,
    inv_ptr,
    N,
    L,
    D,
    V,
    P,
    w_s0,
    t_s0,
    offset,
    scale,
    threshold,
    keep_scale,
    HAS_TABLE: tl.constexpr,
    HAS_OFFSETS: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    LIBDEVICE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    rmask = rows < N * L
    cmask = cols < D
    mask = rmask[:, None] & cmask[None, :]
    n = rows // L
    l = rows % L
    token = tl.load(tokens_ptr + rows, mask=rmask, other=0)
    tl.device_assert((token >= 0) & (token < V), "token id out of range")
    # fastattn.embed_with_positions checks token ids and positions before the launch (on the
    # device for CUDA tensors); the masks keep a direct call with bad ones inside the tables.
    w = tl.load(
        weight_ptr + (token * w_s0)[:, None] + cols[None, :],
        mask=mask & ((token >= 0) & (token < V))[:, None],
        other=0.0,
    )
    pos = l + offset
    if HAS_OFFSETS:
        pos += tl.load(offsets_ptr + n, mask=rmask, other=0)
    if HAS_TABLE:
        pe = tl.load(
            table_ptr + (pos * t_s0)[:, None] + cols[None, :],
            mask=mask & ((pos >= 0) & (pos < P))[:, None],
            other=0.0,
        ).to(tl.float32)
    else:
        pe = _sinusoid_tile(pos, cols, inv_ptr, cmask, LIBDEVICE)
    y = w.to(tl.float32) * scale + pe
    if HAS_DROPOUT:
        y = y * dropout_multiplier(
            seed_ptr, rows[:, None] * D + cols[None, :], threshold, keep_scale
        )
    tl.store(out_ptr + rows[:, None] * D + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _embed_backward_atomic_kernel(
    grad_ptr,
    tokens_ptr,
    gw_ptr,
    gt_ptr,
    offsets_ptr,
    seed_ptr,
    N,
    L,
    D,
    padding_idx,
    offset,
    scale,
    threshold,
    keep_scale,
    HAS_TABLE: tl.constexpr,
    HAS_OFFSETS: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Adds every row's dropped-out gradient into float32 accumulators with atomics."""
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    rmask = rows < N * L
    cmask = cols < D
    mask = rmask[:, None] & cmask[None, :]
    g = tl.load(grad_ptr + rows[:, None] * D + cols[None, :], mask=mask, other=0.0)
    g = g.to(tl.float32)
    if HAS_DROPOUT:
        g = g * dropout_multiplier(
            seed_ptr, rows[:, None] * D + cols[None, :], threshold, keep_scale
        )
    token = tl.load(tokens_ptr + rows, mask=rmask, other=0)
    wmask = mask & (token != padding_idx)[:, None]
    tl.atomic_add(gw_ptr + token[:, None] * D + cols[None, :], g * scale, mask=wmask)
    if HAS_TABLE:
        pos = rows % L + offset
        if HAS_OFFSETS:
            pos += tl.load(offsets_ptr + rows // L, mask=rmask, other=0)
        tl.atomic_add(gt_ptr + pos[:, None] * D + cols[None, :], g, mask=mask)


@triton.jit
def _segment_sum_kernel(
    grad_ptr,
    keys_ptr,
    order_ptr,
    out_ptr,
    seed_ptr,
    rows,
    D,
    factor,
    threshold,
    keep_scale,
    HAS_DROPOUT: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Deterministic backward: program i sums the run of equal sorted keys starting at i (if
    i starts a run) in stable order and writes its key's row once."""
    i = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    cmask = cols < D
    key = tl.load(keys_ptr + i)
    prev = tl.load(keys_ptr + i - 1, mask=i > 0, other=-1)
    if (key >= 0) & ((i == 0) | (prev != key)):
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        j = i
        current = key
        while current == key:
            row = tl.load(order_ptr + j)
            g = tl.load(grad_ptr + row * D + cols, mask=cmask, other=0.0).to(tl.float32)
            if HAS_DROPOUT:
                g = g * dropout_multiplier(seed_ptr, row * D + cols, threshold, keep_scale)
            acc += g
            j += 1
            current = tl.load(keys_ptr + j, mask=j < rows, other=-2)
        tl.store(out_ptr + key * D + cols, acc * factor, mask=cmask)


@triton.jit
def _rotary_kernel(
    x_ptr,
    out_ptr,
    cos_ptr,
    sin_ptr,
    inv_ptr,
    offsets_ptr,
    pos_ids_ptr,
    B,
    H,
    L,
    D,
    rotary_dim,
    x_sb,
    x_sh,
    x_sl,
    o_sb,
    o_sh,
    o_sl,
    P,
    t_s0,
    offset,
    HAS_TABLE: tl.constexpr,
    HAS_OFFSETS: tl.constexpr,
    HAS_POS_IDS: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    CONJUGATE: tl.constexpr,
    COPY_TAIL: tl.constexpr,
    LIBDEVICE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_TAIL: tl.constexpr,
):
    """Program (b*L + l, head block): rotates BLOCK_H heads of one (b, l); x may alias out."""
    bl = tl.program_id(0).to(tl.int64)
    b = bl // L
    l = bl % L
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    half = rotary_dim // 2
    i = tl.arange(0, BLOCK_HALF)
    imask = i < half
    if HAS_POS_IDS:
        pos = tl.load(pos_ids_ptr + bl)
    else:
        pos = l + offset
        if HAS_OFFSETS:
            pos += tl.load(offsets_ptr + b)
    if HAS_TABLE:
        # The public op checks positions before the launch; a direct call with one outside the
        # P table rows reads nothing outside them.
        tmask = imask & (pos >= 0) & (pos < P)
        c = tl.load(cos_ptr + pos * t_s0 + i, mask=tmask, other=0.0)
        s = tl.load(sin_ptr + pos * t_s0 + i, mask=tmask, other=0.0)
    else:
        inv = tl.load(inv_ptr + i, mask=imask, other=0.0)
        angle = pos.to(tl.float32) * inv
        c = _cos(angle, LIBDEVICE)
        s = _sin(angle, LIBDEVICE)
    if CONJUGATE:
        s = -s
    if INTERLEAVED:
        i1 = 2 * i
        i2 = 2 * i + 1
    else:
        i1 = i
        i2 = i + half
    mask = hmask[:, None] & imask[None, :]
    src = x_ptr + b * x_sb + l * x_sl + heads[:, None] * x_sh
    dst = out_ptr + b * o_sb + l * o_sl + heads[:, None] * o_sh
    x1 = tl.load(src + i1[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + i2[None, :], mask=mask, other=0.0).to(tl.float32)
    y1 = x1 * c[None, :] - x2 * s[None, :]
    y2 = x2 * c[None, :] + x1 * s[None, :]
    tl.store(dst + i1[None, :], y1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + i2[None, :], y2.to(out_ptr.dtype.element_ty), mask=mask)
    if COPY_TAIL:
        for start in range(rotary_dim, D, BLOCK_TAIL):
            t = start + tl.arange(0, BLOCK_TAIL)
            tmask = hmask[:, None] & (t < D)[None, :]
            tail = tl.load(src + t[None, :], mask=tmask, other=0.0)
            tl.store(dst + t[None, :], tail.to(out_ptr.dtype.element_ty), mask=tmask)


# ---------------------------------------------------------------------------------------------
# Launchers (same schemas as the native ops in csrc/bindings.cpp)


def _opt(t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """A pointer argument for an optional tensor (unused by the kernel when absent)."""
    return t if t is not None else like


def sinusoidal_table(
    positions: torch.Tensor, dim: int, base: float, dtype: torch.dtype
) -> torch.Tensor:
    flat = positions.reshape(-1).contiguous()
    out = output_buffer((flat.numel(), dim), dtype, positions.device)
    if flat.numel() > 0:
        grid, block_r, block_d = _launch_shape(flat.numel(), dim)
        with on_device(positions):
            wrap_triton(_sinusoidal_table_kernel)[grid](
                flat,
                out,
                inverse_frequencies(dim, base, positions),
                flat.numel(),
                dim,
                LIBDEVICE=not interpreting(positions.device),
                BLOCK_R=block_r,
                BLOCK_D=block_d,
            )
    return finish(out, dtype).reshape(*positions.shape, dim)


def _add_sinusoidal(x, offset, offsets, scale, base, dropout_p, seed, add_pe):
    out = output_buffer_like(x)
    _add_sinusoidal_into(x, out, offset, offsets, scale, base, dropout_p, seed, add_pe)
    return finish(out, x.dtype)


def _add_sinusoidal_into(x, out, offset, offsets, scale, base, dropout_p, seed, add_pe):
    """out = dropout(x * scale [+ PE]); out may be x (each program reads its tile first)."""
    N, L, D = x.shape
    if x.numel() == 0:
        return
    seed_arg, threshold, keep_scale = _dropout_args(dropout_p, seed, x)
    grid, block_r, block_d = _launch_shape(N * L, D)
    inv = inverse_frequencies(D, base, x) if add_pe else x
    with on_device(x):
        wrap_triton(_add_sinusoidal_kernel)[grid](
            x,
            out,
            _opt(offsets, x),
            seed_arg,
            inv,
            N,
            L,
            D,
            x.stride(0),
            x.stride(1),
            out.stride(0),
            out.stride(1),
            offset,
            scale,
            threshold,
            keep_scale,
            HAS_OFFSETS=offsets is not None,
            HAS_DROPOUT=dropout_p > 0.0,
            ADD_PE=add_pe,
            LIBDEVICE=not interpreting(x.device),
            BLOCK_R=block_r,
            BLOCK_D=block_d,
        )


def add_sinusoidal(
    x: torch.Tensor,
    offset: int,
    offsets: torch.Tensor | None,
    scale: float,
    base: float,
    dropout_p: float,
    seed: torch.Tensor | None,
) -> torch.Tensor:
    return _add_sinusoidal(x, offset, offsets, scale, base, dropout_p, seed, True)


def add_sinusoidal_(
    x: torch.Tensor,
    offset: int,
    offsets: torch.Tensor | None,
    scale: float,
    base: float,
    dropout_p: float,
    seed: torch.Tensor | None,
) -> None:
    if x.dtype == torch.bfloat16 and interpreting(x.device):
        # The interpreter's bfloat16 store truncates: compute in a float32 copy, round with torch.
        wide = x.float()
        _add_sinusoidal_into(wide, wide, offset, offsets, scale, base, dropout_p, seed, True)
        x.copy_(wide)
        return
    _add_sinusoidal_into(x, x, offset, offsets, scale, base, dropout_p, seed, True)


def add_sinusoidal_backward(
    grad: torch.Tensor, scale: float, dropout_p: float, seed: torch.Tensor | None
) -> torch.Tensor:
    return _add_sinusoidal(grad, 0, None, scale, 10000.0, dropout_p, seed, False)


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
    padding_idx: int,
    deterministic: bool,
) -> torch.Tensor:
    N, L = tokens.shape
    D = weight.shape[1]
    out = output_buffer((N, L, D), weight.dtype, weight.device)
    if out.numel() == 0:
        return finish(out, weight.dtype)
    tokens = tokens.contiguous()
    seed_arg, threshold, keep_scale = _dropout_args(dropout_p, seed, weight)
    grid, block_r, block_d = _launch_shape(N * L, D)
    inv = inverse_frequencies(D, base, weight) if table is None else weight
    with on_device(weight):
        wrap_triton(_embed_kernel)[grid](
            tokens,
            weight,
            _opt(table, weight),
            out,
            _opt(offsets, tokens),
            seed_arg,
            inv,
            N,
            L,
            D,
            weight.shape[0],
            table.shape[0] if table is not None else 0,
            weight.stride(0),
            table.stride(0) if table is not None else 0,
            offset,
            scale,
            threshold,
            keep_scale,
            HAS_TABLE=table is not None,
            HAS_OFFSETS=offsets is not None,
            HAS_DROPOUT=dropout_p > 0.0,
            LIBDEVICE=not interpreting(weight.device),
            BLOCK_R=block_r,
            BLOCK_D=block_d,
        )
    return finish(out, weight.dtype)


def embed_with_positions_backward(
    grad: torch.Tensor,
    tokens: torch.Tensor,
    num_weights: int,
    padding_idx: int,
    table_rows: int,
    offset: int,
    offsets: torch.Tensor | None,
    scale: float,
    dropout_p: float,
    seed: torch.Tensor | None,
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    N, L, D = grad.shape
    rows = N * L
    has_table = table_rows >= 0
    grad = grad.contiguous()
    tokens = tokens.contiguous()
    weight_acc = torch.zeros((num_weights, D), dtype=torch.float32, device=grad.device)
    table_acc = torch.zeros((max(table_rows, 0), D), dtype=torch.float32, device=grad.device)
    seed_arg, threshold, keep_scale = _dropout_args(dropout_p, seed, grad)
    if rows > 0 and D > 0:
        with on_device(grad):
            if not deterministic:
                grid, block_r, block_d = _launch_shape(rows, D)
                wrap_triton(_embed_backward_atomic_kernel)[grid](
                    grad,
                    tokens,
                    weight_acc,
                    table_acc if has_table else weight_acc,
                    _opt(offsets, tokens),
                    seed_arg,
                    N,
                    L,
                    D,
                    padding_idx,
                    offset,
                    scale,
                    threshold,
                    keep_scale,
                    HAS_TABLE=has_table,
                    HAS_OFFSETS=offsets is not None,
                    HAS_DROPOUT=dropout_p > 0.0,
                    BLOCK_R=block_r,
                    BLOCK_D=block_d,
                )
            else:
                block_d = min(triton.next_power_of_2(D), 1024)
                grid = (rows, triton.cdiv(D, block_d))
                keys = tokens.reshape(rows)
                if padding_idx >= 0:
                    keys = keys.masked_fill(keys == padding_idx, -1)
                sorted_keys, order = torch.sort(keys, stable=True)
                wrap_triton(_segment_sum_kernel)[grid](
                    grad,
                    sorted_keys,
                    order,
                    weight_acc,
                    seed_arg,
                    rows,
                    D,
                    scale,
                    threshold,
                    keep_scale,
                    HAS_DROPOUT=dropout_p > 0.0,
                    BLOCK_D=block_d,
                )
                if has_table:
                    pos = torch.arange(L, device=grad.device).add(offset).expand(N, L)
                    if offsets is not None:
                        pos = pos + offsets.view(N, 1)
                    sorted_pos, porder = torch.sort(pos.reshape(rows), stable=True)
                    wrap_triton(_segment_sum_kernel)[grid](
                        grad,
                        sorted_pos,
                        porder,
                        table_acc,
                        seed_arg,
                        rows,
                        D,
                        1.0,
                        threshold,
                        keep_scale,
                        HAS_DROPOUT=dropout_p > 0.0,
                        BLOCK_D=block_d,
                    )
    return weight_acc.to(grad.dtype), table_acc.to(grad.dtype)


def _rotary(
    x,
    out,
    cos,
    sin,
    offset,
    offsets,
    position_ids,
    rotary_dim,
    base,
    interleaved,
    conjugate,
    inplace,
):
    B, H, L, D = x.shape
    if x.numel() == 0:
        return
    half = rotary_dim // 2
    block_half = triton.next_power_of_2(max(half, 1))
    block_h = max(1, min(triton.next_power_of_2(H), max(1, 2048 // block_half)))
    grid = (B * L, triton.cdiv(H, block_h))
    inv = inverse_frequencies(rotary_dim, base, x) if cos is None else cos
    with on_device(x):
        wrap_triton(_rotary_kernel)[grid](
            x,
            out,
            _opt(cos, x),
            _opt(sin, x),
            inv,
            _opt(offsets, x),
            _opt(position_ids, x),
            B,
            H,
            L,
            D,
            rotary_dim,
            x.stride(0),
            x.stride(1),
            x.stride(2),
            out.stride(0),
            out.stride(1),
            out.stride(2),
            cos.shape[0] if cos is not None else 0,
            cos.stride(0) if cos is not None else 0,
            offset,
            HAS_TABLE=cos is not None,
            HAS_OFFSETS=offsets is not None,
            HAS_POS_IDS=position_ids is not None,
            INTERLEAVED=interleaved,
            CONJUGATE=conjugate,
            COPY_TAIL=not inplace and rotary_dim < D,
            LIBDEVICE=not interpreting(x.device),
            BLOCK_H=block_h,
            BLOCK_HALF=block_half,
            BLOCK_TAIL=min(triton.next_power_of_2(max(D - rotary_dim, 1)), 256),
        )


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
    conjugate: bool,
) -> torch.Tensor:
    out = output_buffer_like(x)
    _rotary(
        x,
        out,
        cos,
        sin,
        offset,
        offsets,
        position_ids,
        rotary_dim,
        base,
        interleaved,
        conjugate,
        inplace=False,
    )
    return finish(out, x.dtype)


def apply_rotary_(
    x: torch.Tensor,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    offset: int,
    offsets: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    rotary_dim: int,
    base: float,
    interleaved: bool,
    conjugate: bool,
) -> None:
    if x.dtype == torch.bfloat16 and interpreting(x.device):
        # The interpreter's bfloat16 store truncates: rotate a float32 copy, round with torch.
        wide = x.float()
        _rotary(
            wide,
            wide,
            cos,
            sin,
            offset,
            offsets,
            position_ids,
            rotary_dim,
            base,
            interleaved,
            conjugate,
            inplace=True,
        )
        x.copy_(wide)
        return
    _rotary(
        x,
        x,
        cos,
        sin,
        offset,
        offsets,
        position_ids,
        rotary_dim,
        base,
        interleaved,
        conjugate,
        inplace=True,
    )
