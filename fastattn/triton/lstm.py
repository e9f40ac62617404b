"""Triton kernels of the LSTM: the launchers of the torch ops fastattn::lstm_cell_triton,
lstm_cell_backward_triton, lstm_layer_triton and lstm_layer_backward_triton (registered by
fastattn/ops/lstm.py), with the signatures and semantics of the op contract in
fastattn/contracts/lstm.py (the CPU backend, csrc/recurrent, is the model). Everything is computed
in float32 ("acc"; float64 is refused) and rounded once to the storage dtype.

The layer ops run on the recurrent engine (fastattn/triton/recurrent.py, generic over the cell;
its docstring describes the LSTM layer's kernels and workspace), with CELL_LSTM.

lstm_cell: one `_cell_fwd_kernel` for the whole step (x W_ih^T + h W_hh^T + biases + cell);
its backward is one `_cell_bwd_kernel` (dgates, grad_cx) plus torch GEMMs for the products.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from .._debug import poison
from ..contracts import unit_last_stride
from . import dot_precision, finish, interpreting, on_device, output_buffer
from ._common import sigmoid as _sigmoid
from ._common import tanh as _tanh
from .recurrent import (
    CELL_LSTM,
    batch_block_size,
    block_size,
    check_acc_dtype,
    dropped_input,
    gate_grads,
    gate_products,
    input_gradient,
    layer_backward,
    layer_forward,
    previous_states,
    seed_arg,
    warps,
)

_F32 = torch.float32

# ---------------------------------------------------------------------------------------------
# Cell kernels


@triton.jit
def _cell_fwd_kernel(
    X,
    Hx,
    Cx,
    W_ih,
    W_hh,
    B_ih,
    B_hh,
    Hy,
    Cy,
    WS,
    s_xb,
    s_hb,
    s_cb,
    s_wir,
    s_whr,
    s_hyb,
    s_cyb,
    B,
    I,
    H,
    HAS_BIAS: tl.constexpr,
    PRECISION: tl.constexpr,
    ACCURATE: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One LSTM step: X (B, I), Hx / Cx (B, H), W_ih (4H, I), W_hh (4H, H), B_ih / B_hh (4H,);
    Hy / Cy (B, H) out; WS (B, 5H) float32 out = [i | f | g | o | tanh(cy)]."""
    pid_h = tl.program_id(0)
    pid_b = tl.program_id(1)
    rows = (pid_b * BLOCK_B + tl.arange(0, BLOCK_B)).to(tl.int64)
    j = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    row_ok = rows < B
    col_ok = j < H
    ok = row_ok[:, None] & col_ok[None, :]
    zero = tl.zeros([BLOCK_B, BLOCK_H], dtype=tl.float32)
    acc_i, acc_f, acc_g, acc_o = gate_products(
        zero,
        zero,
        zero,
        zero,
        X,
        s_xb,
        rows,
        row_ok,
        W_ih,
        s_wir,
        j,
        col_ok,
        H,
        I,
        0,
        4,
        BLOCK_K,
        PRECISION,
    )
    acc_i, acc_f, acc_g, acc_o = gate_products(
        acc_i,
        acc_f,
        acc_g,
        acc_o,
        Hx,
        s_hb,
        rows,
        row_ok,
        W_hh,
        s_whr,
        j,
        col_ok,
        H,
        H,
        0,
        4,
        BLOCK_K,
        PRECISION,
    )
    if HAS_BIAS:
        bi = tl.load(B_ih + j, mask=col_ok, other=0.0).to(tl.float32) + tl.load(
            B_hh + j, mask=col_ok, other=0.0
        ).to(tl.float32)
        bf = tl.load(B_ih + H + j, mask=col_ok, other=0.0).to(tl.float32) + tl.load(
            B_hh + H + j, mask=col_ok, other=0.0
        ).to(tl.float32)
        bg = tl.load(B_ih + 2 * H + j, mask=col_ok, other=0.0).to(tl.float32) + tl.load(
            B_hh + 2 * H + j, mask=col_ok, other=0.0
        ).to(tl.float32)
        bo = tl.load(B_ih + 3 * H + j, mask=col_ok, other=0.0).to(tl.float32) + tl.load(
            B_hh + 3 * H + j, mask=col_ok, other=0.0
        ).to(tl.float32)
        acc_i += bi[None, :]
        acc_f += bf[None, :]
        acc_g += bg[None, :]
        acc_o += bo[None, :]
    gi = _sigmoid(acc_i, ACCURATE)
    gf = _sigmoid(acc_f, ACCURATE)
    gg = _tanh(acc_g, ACCURATE)
    go = _sigmoid(acc_o, ACCURATE)
    c_prev = tl.load(Cx + rows[:, None] * s_cb + j[None, :], mask=ok, other=0.0).to(tl.float32)
    cy = gf * c_prev + gi * gg
    tanh_c = _tanh(cy, ACCURATE)
    tl.store(Cy + rows[:, None] * s_cyb + j[None, :], cy.to(Cy.dtype.element_ty), mask=ok)
    tl.store(
        Hy + rows[:, None] * s_hyb + j[None, :], (go * tanh_c).to(Hy.dtype.element_ty), mask=ok
    )
    ws = WS + rows[:, None] * (5 * H) + j[None, :]
    tl.store(ws, gi, mask=ok)
    tl.store(ws + H, gf, mask=ok)
    tl.store(ws + 2 * H, gg, mask=ok)
    tl.store(ws + 3 * H, go, mask=ok)
    tl.store(ws + 4 * H, tanh_c, mask=ok)


@triton.jit
def _cell_bwd_kernel(
    GHy,
    GCy,
    Cx,
    WS,
    DG,
    GCx,
    s_ghb,
    s_gcb,
    s_cb,
    B,
    H,
    HAS_GH: tl.constexpr,
    HAS_GC: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """DG (B, 4H) float32 = dgates, GCx (B, H) = grad of cx, from GHy / GCy (B, H) (either may
    be missing: zeros), Cx (B, H) and the forward's workspace WS (B, 5H)."""
    rows = (tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)).to(tl.int64)
    j = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = (rows < B)[:, None] & (j < H)[None, :]
    dh = tl.zeros([BLOCK_B, BLOCK_H], dtype=tl.float32)
    dc = tl.zeros([BLOCK_B, BLOCK_H], dtype=tl.float32)
    if HAS_GH:
        dh = tl.load(GHy + rows[:, None] * s_ghb + j[None, :], mask=ok, other=0.0).to(tl.float32)
    if HAS_GC:
        dc = tl.load(GCy + rows[:, None] * s_gcb + j[None, :], mask=ok, other=0.0).to(tl.float32)
    ws = WS + rows[:, None] * (5 * H) + j[None, :]
    gi = tl.load(ws, mask=ok, other=0.0)
    gf = tl.load(ws + H, mask=ok, other=0.0)
    gg = tl.load(ws + 2 * H, mask=ok, other=0.0)
    go = tl.load(ws + 3 * H, mask=ok, other=0.0)
    tanh_c = tl.load(ws + 4 * H, mask=ok, other=0.0)
    c_prev = tl.load(Cx + rows[:, None] * s_cb + j[None, :], mask=ok, other=0.0).to(tl.float32)
    di, df, dg, do, dc_prev = gate_grads(dh, dc, gi, gf, gg, go, tanh_c, c_prev)
    out = DG + rows[:, None] * (4 * H) + j[None, :]
    tl.store(out, di, mask=ok)
    tl.store(out + H, df, mask=ok)
    tl.store(out + 2 * H, dg, mask=ok)
    tl.store(out + 3 * H, do, mask=ok)
    tl.store(GCx + rows[:, None] * H + j[None, :], dc_prev.to(GCx.dtype.element_ty), mask=ok)


# ---------------------------------------------------------------------------------------------
# Launchers of the torch ops fastattn::lstm_*_triton (the schemas of csrc/bindings.cpp's LSTM
# ops), which fastattn/ops/lstm.py registers with the contract of fastattn/contracts/lstm.py.


def lstm_cell_triton(
    input: torch.Tensor,
    hx: torch.Tensor,
    cx: torch.Tensor,
    w_ih: torch.Tensor,
    w_hh: torch.Tensor,
    b_ih: torch.Tensor | None,
    b_hh: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """input (B, I), hx / cx (B, H), w_ih (4H, I), w_hh (4H, H), b_ih / b_hh (4H,) or None ->
    hy, cy (B, H), workspace (B, 5H) float32 = [i | f | g | o | tanh(cy)]."""
    op = "lstm_cell_triton"
    check_acc_dtype(op, input.dtype)
    B, I = input.shape
    H = w_hh.shape[1]
    if (
        tuple(w_ih.shape) != (4 * H, I)
        or tuple(w_hh.shape) != (4 * H, H)
        or tuple(hx.shape) != (B, H)
        or tuple(cx.shape) != (B, H)
    ):
        raise ValueError(
            f"fastattn::{op}: expected input (B, I), hx/cx (B, H), w_ih (4H, I), "
            f"w_hh (4H, H); got {tuple(input.shape)}, {tuple(hx.shape)}, "
            f"{tuple(cx.shape)}, {tuple(w_ih.shape)}, {tuple(w_hh.shape)}"
        )
    if (b_ih is None) != (b_hh is None):
        raise ValueError(f"fastattn::{op}: b_ih and b_hh must be given together")
    interpret = interpreting(input.device)
    x, h, c, wi, wh = (unit_last_stride(t) for t in (input, hx, cx, w_ih, w_hh))
    has_bias = b_ih is not None
    bi = b_ih.contiguous() if has_bias else wi
    bh = b_hh.contiguous() if has_bias else wi
    hy = output_buffer((B, H), input.dtype, input.device)
    cy = output_buffer((B, H), input.dtype, input.device)
    ws = poison(torch.empty((B, 5 * H), dtype=_F32, device=input.device))
    if B > 0:
        block_b = batch_block_size(B, interpret)
        block_h = block_size(H, interpret)
        block_k = block_size(max(I, H), interpret)
        grid = (triton.cdiv(H, block_h), triton.cdiv(B, block_b))
        with on_device(input):
            wrap_triton(_cell_fwd_kernel)[grid](
                x,
                h,
                c,
                wi,
                wh,
                bi,
                bh,
                hy,
                cy,
                ws,
                x.stride(0),
                h.stride(0),
                c.stride(0),
                wi.stride(0),
                wh.stride(0),
                hy.stride(0),
                cy.stride(0),
                B,
                I,
                H,
                HAS_BIAS=has_bias,
                PRECISION=dot_precision(input.dtype),
                ACCURATE=not interpret,
                BLOCK_B=block_b,
                BLOCK_H=block_h,
                BLOCK_K=block_k,
                num_warps=warps(block_b, block_h),
            )
    return finish(hy, input.dtype), finish(cy, input.dtype), ws


def lstm_cell_backward_triton(
    grad_hy: torch.Tensor | None,
    grad_cy: torch.Tensor | None,
    input: torch.Tensor,
    hx: torch.Tensor,
    cx: torch.Tensor,
    w_ih: torch.Tensor,
    w_hh: torch.Tensor,
    workspace: torch.Tensor,
    has_bias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> grad_input (B, I), grad_hx (B, H), grad_cx (B, H), grad_w_ih (4H, I),
    grad_w_hh (4H, H), grad_bias (4H,) or (0,). dgates and grad_cx come from one kernel; the
    four products with dgates are torch GEMMs in float32."""
    op = "lstm_cell_backward_triton"
    check_acc_dtype(op, input.dtype)
    B, I = input.shape
    H = w_hh.shape[1]
    if (
        workspace.dtype != _F32
        or tuple(workspace.shape) != (B, 5 * H)
        or not workspace.is_contiguous()
    ):
        raise ValueError(
            f"fastattn::{op}: workspace must be the contiguous float32 ({B}, "
            f"{5 * H}) tensor of lstm_cell_triton, got {workspace.dtype} "
            f"{tuple(workspace.shape)}"
        )
    dtype, device = input.dtype, input.device
    interpret = interpreting(device)
    dgates = poison(torch.empty((B, 4 * H), dtype=_F32, device=device))
    grad_cx = output_buffer((B, H), dtype, device)
    if B > 0:
        gh = unit_last_stride(grad_hy) if grad_hy is not None else workspace
        gc = unit_last_stride(grad_cy) if grad_cy is not None else workspace
        c = unit_last_stride(cx)
        block_b, block_h = batch_block_size(B, interpret), block_size(H, interpret, lo=1)
        grid = (triton.cdiv(H, block_h), triton.cdiv(B, block_b))
        with on_device(input):
            wrap_triton(_cell_bwd_kernel)[grid](
                gh,
                gc,
                c,
                workspace,
                dgates,
                grad_cx,
                gh.stride(0),
                gc.stride(0),
                c.stride(0),
                B,
                H,
                HAS_GH=grad_hy is not None,
                HAS_GC=grad_cy is not None,
                BLOCK_B=block_b,
                BLOCK_H=block_h,
            )
    grad_input = (dgates @ w_ih.to(_F32)).to(dtype)
    grad_hx = (dgates @ w_hh.to(_F32)).to(dtype)
    grad_w_ih = (dgates.t() @ input.to(_F32)).to(dtype)
    grad_w_hh = (dgates.t() @ hx.to(_F32)).to(dtype)
    grad_bias = dgates.sum(0).to(dtype) if has_bias else input.new_empty((0,))
    return grad_input, grad_hx, finish(grad_cx, dtype), grad_w_ih, grad_w_hh, grad_bias


def lstm_layer_triton(
    input: torch.Tensor,
    h0: torch.Tensor,
    c0: torch.Tensor,
    w_ih: torch.Tensor,
    w_hh: torch.Tensor,
    b_ih: torch.Tensor | None,
    b_hh: torch.Tensor | None,
    w_hr: torch.Tensor | None,
    lengths: torch.Tensor | None,
    dropout_p: float,
    seed: torch.Tensor | None,
    save_workspace: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One layer, D directions: input (T, B, I), h0 (D, B, P), c0 (D, B, H), w_ih (D, 4H, I),
    w_hh (D, 4H, P), b_ih / b_hh (D, 4H), w_hr (D, P, H) or None, lengths (B,) or None ->
    output (T, B, D * P), h_n (D, B, P), c_n (D, B, H), workspace (D, T * B * (5H + P))
    float32 (or (0,) unless save_workspace). See the module docstring for the kernels."""
    return layer_forward(
        CELL_LSTM,
        "lstm_layer_triton",
        input,
        h0,
        c0,
        w_ih,
        w_hh,
        b_ih,
        b_hh,
        w_hr,
        lengths,
        dropout_p,
        seed,
        save_workspace,
    )


def lstm_layer_backward_triton(
    grad_output: torch.Tensor | None,
    grad_h_n: torch.Tensor | None,
    grad_c_n: torch.Tensor | None,
    input: torch.Tensor,
    h0: torch.Tensor,
    c0: torch.Tensor,
    w_ih: torch.Tensor,
    w_hh: torch.Tensor,
    w_hr: torch.Tensor | None,
    lengths: torch.Tensor | None,
    workspace: torch.Tensor,
    dropout_p: float,
    seed: torch.Tensor | None,
    has_bias: bool,
    input_grad: bool,
    weight_grad: bool,
) -> tuple[
    torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor
]:
    """-> grad_input (T, B, I) or (0,), grad_h0 (D, B, P), grad_c0 (D, B, H), grad_w_ih
    (D, 4H, I), grad_w_hh (D, 4H, P), grad_bias (D, 4H), grad_w_hr (D, P, H) (each (0,) when
    not wanted / absent). Missing incoming gradients are zeros."""
    op = "lstm_layer_backward_triton"
    seed = seed_arg(dropout_p, seed, op)
    dgates, dh, dc, dhp = layer_backward(
        CELL_LSTM,
        op,
        grad_output,
        grad_h_n,
        grad_c_n,
        input,
        h0,
        c0,
        w_ih,
        w_hh,
        w_hr,
        lengths,
        workspace,
        dropout_p,
    )
    D, T, B, _ = dgates.shape
    H, P = c0.shape[2], h0.shape[2]
    dtype = input.dtype
    ws = workspace.view(D, T, B, 5 * H + P)

    # Products over all T * B rows at once.
    dg = dgates.view(D, T * B, 4 * H)

    def empty():  # a fresh one per output: a custom op's outputs must not alias each other
        return input.new_empty((0,))

    if input_grad:
        grad_input = input_gradient(dg, w_ih, tuple(input.shape), dropout_p, seed).to(dtype)
    else:
        grad_input = empty()
    grad_w_ih, grad_w_hh, grad_bias, grad_w_hr = empty(), empty(), empty(), empty()
    if weight_grad:
        xd = dropped_input(input, dropout_p, seed)
        grad_w_ih = torch.matmul(dg.transpose(1, 2), xd).to(dtype)
        h_prev = previous_states(ws[..., 5 * H :], h0)
        grad_w_hh = torch.matmul(dg.transpose(1, 2), h_prev).to(dtype)
        if has_bias:
            grad_bias = dg.sum(1).to(dtype)
        if w_hr is not None:
            # o tanh(c) of every step (0 past a row's end, where the saved gates are 0)
            h_raw = (ws[..., 3 * H : 4 * H] * torch.tanh(ws[..., 4 * H : 5 * H])).reshape(
                D, T * B, H
            )
            grad_w_hr = torch.matmul(dhp.view(D, T * B, P).transpose(1, 2), h_raw).to(dtype)
    return (grad_input, dh.to(dtype), dc.to(dtype), grad_w_ih, grad_w_hh, grad_bias, grad_w_hr)
