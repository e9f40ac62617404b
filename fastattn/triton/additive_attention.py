"""Triton kernels of the additive-attention scores (same math as csrc/additive_attention):
S[b, i, j] = sum_a v[a] tanh(qp[b, i, a] + kp[b, j, a]), computed in float32 a BLOCK_A slice
of features at a time, so no (B, Lq, Lk, A) tensor is formed. The backward kernels recompute
tanh; dv is summed from per-row partials by torch (a fixed-order reduction). Grids are 1-D
(batch and tile indices folded into the first axis, which holds 2**31 - 1 programs; the
others hold only 65535)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from .. import _debug
from . import grid_x, interpreting, on_device, on_gpu
from ._common import tanh


@triton.jit
def _scores_kernel(
    qp_ptr,
    kp_ptr,
    v_ptr,
    s_ptr,
    Lq,
    Lk,
    A,
    LIBDEVICE: tl.constexpr,
    BLOCK_I: tl.constexpr,
    BLOCK_J: tl.constexpr,
    BLOCK_A: tl.constexpr,
):
    # program (b * tiles_i + tile_i) * tiles_j + tile_j
    tiles_i = tl.cdiv(Lq, BLOCK_I)
    tiles_j = tl.cdiv(Lk, BLOCK_J)
    pid = tl.program_id(0).to(tl.int64)
    b = pid // tiles_j // tiles_i
    i = ((pid // tiles_j) % tiles_i).to(tl.int32) * BLOCK_I + tl.arange(0, BLOCK_I)
    j = (pid % tiles_j).to(tl.int32) * BLOCK_J + tl.arange(0, BLOCK_J)
    acc = tl.zeros([BLOCK_I, BLOCK_J], dtype=tl.float32)
    for a0 in range(0, A, BLOCK_A):
        a = a0 + tl.arange(0, BLOCK_A)
        am = a < A
        q = tl.load(
            qp_ptr + (b * Lq + i[:, None]) * A + a[None, :],
            mask=(i[:, None] < Lq) & am[None, :],
            other=0.0,
        ).to(tl.float32)
        k = tl.load(
            kp_ptr + (b * Lk + j[:, None]) * A + a[None, :],
            mask=(j[:, None] < Lk) & am[None, :],
            other=0.0,
        ).to(tl.float32)
        v = tl.load(v_ptr + a, mask=am, other=0.0).to(tl.float32)
        t = tanh(q[:, None, :] + k[None, :, :], LIBDEVICE)
        acc += tl.sum(t * v[None, None, :], axis=2)
    tl.store(
        s_ptr + (b * Lq + i[:, None]) * Lk + j[None, :],
        acc,
        mask=(i[:, None] < Lq) & (j[None, :] < Lk),
    )


@triton.jit
def _row_grad_kernel(
    x_ptr,
    y_ptr,
    v_ptr,
    g_ptr,
    dx_ptr,
    dvp_ptr,
    rows,
    n,
    A,
    g_row_stride,
    g_col_stride,
    g_batch_stride,
    WRITE_DV: tl.constexpr,
    LIBDEVICE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_A: tl.constexpr,
):
    """Rows r of X (batch b) against the n rows of Y: dx[r, a] = v[a] sum_j g (1 - t^2),
    dv_part[r, a] = sum_j g t, t = tanh(x[r, a] + y[j, a])."""
    # program (b * tiles_r + tile_r) * tiles_a + tile_a
    tiles_r = tl.cdiv(rows, BLOCK_R)
    tiles_a = tl.cdiv(A, BLOCK_A)
    pid = tl.program_id(0).to(tl.int64)
    b = pid // tiles_a // tiles_r
    r = ((pid // tiles_a) % tiles_r).to(tl.int32) * BLOCK_R + tl.arange(0, BLOCK_R)
    a = (pid % tiles_a).to(tl.int32) * BLOCK_A + tl.arange(0, BLOCK_A)
    rm = r < rows
    am = a < A
    x = tl.load(
        x_ptr + (b * rows + r[:, None]) * A + a[None, :], mask=rm[:, None] & am[None, :], other=0.0
    ).to(tl.float32)
    dx = tl.zeros([BLOCK_R, BLOCK_A], dtype=tl.float32)
    dv = tl.zeros([BLOCK_R, BLOCK_A], dtype=tl.float32)
    for j0 in range(0, n, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        jm = j < n
        y = tl.load(
            y_ptr + (b * n + j[:, None]) * A + a[None, :], mask=jm[:, None] & am[None, :], other=0.0
        ).to(tl.float32)
        g = tl.load(
            g_ptr + b * g_batch_stride + r[:, None] * g_row_stride + j[None, :] * g_col_stride,
            mask=rm[:, None] & jm[None, :],
            other=0.0,
        )
        t = tanh(x[:, None, :] + y[None, :, :], LIBDEVICE)
        dx += tl.sum(g[:, :, None] * (1.0 - t * t), axis=1)
        if WRITE_DV:
            dv += tl.sum(g[:, :, None] * t, axis=1)
    v = tl.load(v_ptr + a, mask=am, other=0.0).to(tl.float32)
    out = (b * rows + r[:, None]) * A + a[None, :]
    tl.store(
        dx_ptr + out, (dx * v[None, :]).to(dx_ptr.dtype.element_ty), mask=rm[:, None] & am[None, :]
    )
    if WRITE_DV:
        tl.store(dvp_ptr + out, dv, mask=rm[:, None] & am[None, :])


def _blocks(device: torch.device):
    # Under the interpreter bigger blocks are faster (numpy); on GPU keep the 3-D tile small.
    return (16, 16, 16) if on_gpu(device) else (32, 32, 32)


# Launchers of the torch ops fastattn::additive_scores_triton / additive_scores_backward_triton
# (fastattn/ops/additive_attention.py registers them with the contract of
# fastattn/contracts/additive_attention.py).


def additive_scores(qp: torch.Tensor, kp: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """qp (B, Lq, A), kp (B, Lk, A), v (A,) -> scores (B, Lq, Lk) float32."""
    qp, kp, v = qp.contiguous(), kp.contiguous(), v.contiguous()
    B, Lq, A = qp.shape
    Lk = kp.shape[1]
    scores = _debug.poison(torch.empty((B, Lq, Lk), dtype=torch.float32, device=qp.device))
    if scores.numel() == 0:
        return scores
    bi, bj, ba = _blocks(qp.device)
    grid = (
        grid_x(
            "additive_scores",
            "B * ceil(Lq / BLOCK_I) * ceil(Lk / BLOCK_J)",
            B * triton.cdiv(Lq, bi) * triton.cdiv(Lk, bj),
        ),
    )
    with on_device(qp):
        wrap_triton(_scores_kernel)[grid](
            qp,
            kp,
            v,
            scores,
            Lq,
            Lk,
            A,
            LIBDEVICE=not interpreting(qp.device),
            BLOCK_I=bi,
            BLOCK_J=bj,
            BLOCK_A=ba,
        )
    return scores


def additive_scores_backward(
    grad: torch.Tensor, qp: torch.Tensor, kp: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """grad (B, Lq, Lk) of the scores -> (grad_qp, grad_kp, grad_v), contiguous, in the
    inputs' dtype."""
    op = "additive_scores_backward"
    qp, kp, v = qp.contiguous(), kp.contiguous(), v.contiguous()
    grad = grad.to(torch.float32).contiguous()
    B, Lq, A = qp.shape
    Lk = kp.shape[1]
    # bfloat16 results go through float32 buffers under the interpreter (see __init__.py).
    wide = (
        qp.dtype if not (qp.dtype == torch.bfloat16 and interpreting(qp.device)) else torch.float32
    )
    dqp = _debug.poison(torch.empty(qp.shape, dtype=wide, device=qp.device))
    dkp = _debug.poison(torch.empty(kp.shape, dtype=wide, device=qp.device))
    dv_part = torch.zeros((B, Lq, A), dtype=torch.float32, device=qp.device)
    br, bn, ba = _blocks(qp.device)
    libdevice_on = not interpreting(qp.device)
    with on_device(qp):
        if B * Lq * A > 0:
            grid = (
                grid_x(
                    op,
                    "B * ceil(Lq / BLOCK_R) * ceil(A / BLOCK_A)",
                    B * triton.cdiv(Lq, br) * triton.cdiv(A, ba),
                ),
            )
            wrap_triton(_row_grad_kernel)[grid](
                qp,
                kp,
                v,
                grad,
                dqp,
                dv_part,
                Lq,
                Lk,
                A,
                Lk,
                1,
                Lq * Lk,
                WRITE_DV=True,
                LIBDEVICE=libdevice_on,
                BLOCK_R=br,
                BLOCK_N=bn,
                BLOCK_A=ba,
            )
        if B * Lk * A > 0:
            grid = (
                grid_x(
                    op,
                    "B * ceil(Lk / BLOCK_R) * ceil(A / BLOCK_A)",
                    B * triton.cdiv(Lk, br) * triton.cdiv(A, ba),
                ),
            )
            wrap_triton(_row_grad_kernel)[grid](
                kp,
                qp,
                v,
                grad,
                dkp,
                dv_part,
                Lk,
                Lq,
                A,
                1,
                Lk,
                Lq * Lk,
                WRITE_DV=False,
                LIBDEVICE=libdevice_on,
                BLOCK_R=br,
                BLOCK_N=bn,
                BLOCK_A=ba,
            )
    dv = dv_part.reshape(-1, A).sum(dim=0)
    return dqp.to(qp.dtype), dkp.to(qp.dtype), dv.to(v.dtype)
