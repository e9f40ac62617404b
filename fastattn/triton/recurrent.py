"""The recurrent engine of fastattn's Triton backend: the layer kernels and their driver
(`layer_forward`, `layer_backward`) that run every layer of the LSTM, the GRU and the Elman RNN
(the launchers in fastattn/triton/lstm.py, gru.py and rnn.py call them), generic over the cell:
a constexpr CELL (CELL_LSTM, CELL_GRU, CELL_GRU_RESET_BEFORE, CELL_RNN_TANH, CELL_RNN_RELU)
selects the gate count of W_hh, the step's epilogue, the workspace layout and the backward's
gate formulas. Everything is computed in float32 ("acc"; float64 is refused) and rounded once
to the storage dtype. The LSTM is described below, the other cells where they differ in their
launchers' modules and in the kernels' docstrings; the launch helpers shared by the per-cell
modules (tile sizes, warps, argument checks) are here too.

One idea in one file of about 1,200 lines: the kernels are private to the driver that launches
them (their names, with a leading underscore, are what tests/triton_aot.py records), and the
driver, the kernels and the workspace layout they share change together.

Layer forward (T steps, D = 1 or 2 directions, every direction in the same launch as the
grid's last axis):
- the input projection of all T steps, xproj = dropout(x) W_ih^T + b_ih + b_hh, is one large
  GEMM done by torch.matmul before the loop (it has no recurrence, so cuBLAS / MKL is the best
  kernel for it); the dropout mask is applied by `_dropout_kernel` (fastattn's Philox stream,
  element (t * B + b) * I + i, the same mask as every other backend);
- per step one `_fwd_step_kernel`: each program owns BLOCK_B rows x BLOCK_H hidden units j and
  computes the four gate columns i, f, g, o of those units with tl.dot over h_{t-1} W_hh^T, so
  the cell update c' = f c + i g, h' = o tanh(c') runs in the GEMM's epilogue; it writes c_t,
  h_t (or, with a projection, the unprojected o tanh(c) into a scratch that a second per-step
  kernel `_fwd_proj_kernel` multiplies by W_hr^T), the output row and the workspace;
- h_{t-1} is read whole by every program while the step writes h_t, so the hidden state is
  double-buffered (ping-pong); c is only read and written by its owner, so it is updated in
  place;
- variable lengths: rows with t >= lengths[b] do no update (state carried, output 0), so the
  final state is each sequence's state at its true end (h0/c0 for a length of 0). Unlike the
  CPU backend no rows are compacted: a GPU step costs the same with a few idle rows.
Workspace (D, T, B, 5H + P) float32 per (direction, time, row): activated gates i|f|g|o
(0 where the row is past its end), c_t and h_t (the carried state past the end).

Layer backward (reverse processing order): per step `_bwd_gates_kernel` computes dgates from
dh, dc and the saved gates (fused pointwise; with a projection it first forms dh W_hr with
tl.dot) and dc_{t-1}, and `_bwd_dh_kernel` computes dh_{t-1} = dgates W_hh (tl.dot). These are
two launches because dh_{t-1} needs the dgates of all 4H gate columns, which different programs
of the first kernel produce (a grid-wide dependency). The weight gradients are then GEMMs over
all T * B rows at once (torch.matmul: dgates^T x, dgates^T h_{t-1}, dh^T (o tanh c)), as is
grad_input = dgates W_ih, multiplied by the dropout mask by `_dropout_kernel`.

Tiles are chosen by rule, not autotuned: on a GPU BLOCK_B in 16..64 from the batch, BLOCK_H 32
and BLOCK_K 32, shrunk until a step has about one program per SM (`_step_tiles`), 8 warps from
1024 tile elements up (no register spills on sm_90, `warps`); under the interpreter the
largest tiles that the sizes use, up to 64 (fewer numpy calls). Known costs on a GPU, not yet
measured (docs/design/lstm_triton.md): one or two launches a step from Python, and
float32 storage at torch's default matmul precision multiplies in IEEE float32 (no tensor
cores, as torch's own float32 GEMMs then).
Inputs may have any strides with a unit last stride (weights with another last stride are
made contiguous). Under the interpreter bfloat16 loads are upcast to float32 at once and
bfloat16 results go through float32 buffers that torch rounds (fastattn/triton/__init__.py).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from .._debug import poison
from ..contracts import unit_last_stride
from . import device_sm_count, dot_precision, finish, interpreting, on_device, on_gpu, output_buffer
from ._common import sigmoid as _sigmoid
from ._common import tanh as _tanh
from .random import dropout_multiplier

_F32 = torch.float32

# ---------------------------------------------------------------------------------------------
# Cells and device functions

# The cell of the generic step kernels (a constexpr): which gates W_hh holds, what the epilogue
# computes and what the workspace keeps. Gate order and math as torch's modules.
CELL_LSTM = 0  # gates i, f, g, o; c and h states
CELL_GRU = 1  # gates r, z, n; reset after the product: n = tanh(x_n + r * (W_hn h + b_hn))
CELL_GRU_RESET_BEFORE = 2  # n = tanh(x_n + W_hn (r * h) + b_hn) (Cho et al. 2014)
CELL_RNN_TANH = 3  # one gate: h' = tanh(x W_ih^T + b_ih + W_hh h + b_hh)
CELL_RNN_RELU = 4  # h' = relu(...)

# Gate blocks of W_hh per cell, and float32 workspace columns per (direction, step, row).
GATES = {CELL_LSTM: 4, CELL_GRU: 3, CELL_GRU_RESET_BEFORE: 3, CELL_RNN_TANH: 1, CELL_RNN_RELU: 1}


def workspace_width(cell: int, H: int, P: int) -> int:
    """Float32 columns per (direction, time, row) of the layer workspace: LSTM i|f|g|o|c|h
    (5H + P); GRU r|z|n|X|h (5H; X = W_hn h + b_hn reset-after, r * h_{t-1} reset-before);
    RNN y|h (2H; y the activation, 0 past a row's end). h is the state carried past the end."""
    if cell == CELL_LSTM:
        return 5 * H + P
    return 5 * H if GATES[cell] == 3 else 2 * H


@triton.jit
def _ws_width(H, P, CELL: tl.constexpr):
    """workspace_width on the device."""
    width = 2 * H
    if CELL == 0:
        width = 5 * H + P
    elif CELL <= 2:
        width = 5 * H
    return width


@triton.jit
def gate_products(
    acc0,
    acc1,
    acc2,
    acc3,
    A,
    s_am,
    rows,
    row_ok,
    W,
    s_wr,
    j,
    col_ok,
    H,
    K,
    FIRST: tl.constexpr,
    NG: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """acc_q += A[rows, :K] @ W[(FIRST + q) * H + j, :K]^T for the NG (1 to 4) gate blocks
    q = 0 .. NG - 1 starting at block FIRST (the accumulators past NG are returned as given).

    A: (rows, K) with row stride s_am and unit column stride; W: (G H, K) with row stride s_wr.
    Returns the four (BLOCK_B, BLOCK_H) float32 accumulators.
    """
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        a = tl.load(
            A + rows[:, None] * s_am + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0
        ).to(tl.float32)
        w_mask = k_ok[:, None] & col_ok[None, :]
        w_col = W + k[:, None]
        w0 = tl.load(w_col + (j[None, :] + FIRST * H) * s_wr, mask=w_mask, other=0.0)
        acc0 += tl.dot(a, w0.to(tl.float32), input_precision=PRECISION)
        if NG > 1:
            w1 = tl.load(w_col + (j[None, :] + (FIRST + 1) * H) * s_wr, mask=w_mask, other=0.0)
            acc1 += tl.dot(a, w1.to(tl.float32), input_precision=PRECISION)
        if NG > 2:
            w2 = tl.load(w_col + (j[None, :] + (FIRST + 2) * H) * s_wr, mask=w_mask, other=0.0)
            acc2 += tl.dot(a, w2.to(tl.float32), input_precision=PRECISION)
        if NG > 3:
            w3 = tl.load(w_col + (j[None, :] + (FIRST + 3) * H) * s_wr, mask=w_mask, other=0.0)
            acc3 += tl.dot(a, w3.to(tl.float32), input_precision=PRECISION)
    return acc0, acc1, acc2, acc3


@triton.jit
def gate_grads(dh, dc, gi, gf, gg, go, tanh_c, c_prev):
    """(di, df, dg, do, dc_prev) of the pre-activation gates from dh (of o tanh c) and dc."""
    dc = dc + dh * go * (1.0 - tanh_c * tanh_c)
    di = dc * gg * gi * (1.0 - gi)
    df = dc * c_prev * gf * (1.0 - gf)
    dg = dc * gi * (1.0 - gg * gg)
    do = dh * tanh_c * go * (1.0 - go)
    return di, df, dg, do, dc * gf


@triton.jit
def _step_time(step, T, d):
    """Time index of processing step `step` for direction d (1 runs backwards in time)."""
    return tl.where(d == 0, step, T - 1 - step)


@triton.jit
def _previous_state(WS, S0, s_0d, s_0b, col, width, d64, rows64, j, ok, step, t, T, B):
    """The state before processing step `step` at units j: column `col` of the previous
    step's workspace row (which keeps the carried state past a row's end), or S0 (D, B, H)
    (strides s_0d, s_0b) at the first step. float32 (BLOCK_B, BLOCK_H)."""
    first = step == 0
    t_prev = tl.where(d64 == 0, t - 1, t + 1)
    saved = tl.load(
        WS + ((d64 * T + t_prev) * B + rows64)[:, None] * width + col + j[None, :],
        mask=ok & (step != 0),
        other=0.0,
    )
    init = tl.load(
        S0 + d64 * s_0d + rows64[:, None] * s_0b + j[None, :], mask=ok & first, other=0.0
    ).to(tl.float32)
    return tl.where(first, init, saved)


@triton.jit
def _keep_h(h_new, h_prev, active, ok, H_out, state, out_ptrs, ws_h, SAVE: tl.constexpr):
    """The end of a step that owns h_t[rows, j]: h_t (h_{t-1} carried past a row's end) into
    H_out and, with SAVE, the workspace; the output row (0 past the end)."""
    h_keep = tl.where(active, h_new, h_prev)
    tl.store(H_out + state, h_keep, mask=ok)
    tl.store(out_ptrs, tl.where(active, h_new, 0.0).to(out_ptrs.dtype.element_ty), mask=ok)
    if SAVE:
        tl.store(ws_h, h_keep, mask=ok)


# ---------------------------------------------------------------------------------------------
# Layer forward kernels


@triton.jit(do_not_specialize=["step"])  # one compiled kernel for every step
def _fwd_step_kernel(
    XP,
    W_hh,
    B_hn,
    H_in,
    H_out,
    C,
    Hraw,
    Out,
    WS,
    Len,
    s_wd,
    s_wr,
    s_bd,
    s_ot,
    s_ob,
    step,
    T,
    B,
    H,
    P,
    CELL: tl.constexpr,
    PHASE: tl.constexpr,
    HAS_BN: tl.constexpr,
    HAS_PROJ: tl.constexpr,
    SAVE: tl.constexpr,
    PRECISION: tl.constexpr,
    ACCURATE: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One time step of one direction for BLOCK_B rows x BLOCK_H hidden units, of the cell
    CELL (CELL_* above; G gate blocks).

    XP (D, T, B, G H) float32 input projection with the biases that add to it; W_hh (D, G H, P);
    B_hn (D, 3H) b_hh of the reset-after GRU (its n block stays inside r * (.), HAS_BN);
    H_in / H_out (D, B, P) float32 state before / after the step; C (D, B, H) float32 LSTM
    cell state, updated in place; Hraw float32 scratch: (D, B, H) o tanh(c) of the projected
    LSTM, (D, B, 2H) z | r * h_{t-1} of the reset-before GRU; Out (T, B, D * P);
    WS (D, T, B, width) float32 (`workspace_width`); Len (B,) int64.
    The reset-before GRU needs r * h_{t-1} of every unit before its n product (a grid-wide
    dependency), so its step is two launches: PHASE 0 computes r and z, PHASE 1 n and h_t.
    """
    pid_h = tl.program_id(0)
    pid_b = tl.program_id(1)
    d = tl.program_id(2)
    t = _step_time(step, T, d)
    rows = pid_b * BLOCK_B + tl.arange(0, BLOCK_B)
    j = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    row_ok = rows < B
    col_ok = j < H
    ok = row_ok[:, None] & col_ok[None, :]
    length = tl.load(Len + rows, mask=row_ok, other=0)
    active = (t < length)[:, None] & ok
    rows64 = rows.to(tl.int64)
    d64 = d.to(tl.int64)

    h_base = d64 * B * P
    zero = tl.zeros([BLOCK_B, BLOCK_H], dtype=tl.float32)
    width = _ws_width(H, P, CELL)
    ws_row = WS + ((d64 * T + t) * B + rows64)[:, None] * width + j[None, :]
    # P == H unless the LSTM projects: then this program owns h_t[rows, j] as well.
    state = h_base + rows64[:, None] * P + j[None, :]
    out_ptrs = Out + t.to(tl.int64) * s_ot + rows64[:, None] * s_ob + d * P + j[None, :]

    if CELL == 0:
        xp_row = XP + ((d64 * T + t) * B + rows64)[:, None] * (4 * H) + j[None, :]
        acc_i, acc_f, acc_g, acc_o = gate_products(
            zero, zero, zero, zero, H_in + h_base, P, rows64, row_ok, W_hh + d * s_wd, s_wr,
            j, col_ok, H, P, 0, 4, BLOCK_K, PRECISION,
        )  # fmt: skip
        gi = _sigmoid(acc_i + tl.load(xp_row, mask=ok, other=0.0), ACCURATE)
        gf = _sigmoid(acc_f + tl.load(xp_row + H, mask=ok, other=0.0), ACCURATE)
        gg = _tanh(acc_g + tl.load(xp_row + 2 * H, mask=ok, other=0.0), ACCURATE)
        go = _sigmoid(acc_o + tl.load(xp_row + 3 * H, mask=ok, other=0.0), ACCURATE)

        c_ptr = C + (d64 * B + rows64)[:, None] * H + j[None, :]
        c_prev = tl.load(c_ptr, mask=ok, other=0.0)
        c_new = gf * c_prev + gi * gg
        h_raw = go * _tanh(c_new, ACCURATE)
        c_keep = tl.where(active, c_new, c_prev)
        tl.store(c_ptr, c_keep, mask=ok)
        if SAVE:
            tl.store(ws_row, tl.where(active, gi, 0.0), mask=ok)
            tl.store(ws_row + H, tl.where(active, gf, 0.0), mask=ok)
            tl.store(ws_row + 2 * H, tl.where(active, gg, 0.0), mask=ok)
            tl.store(ws_row + 3 * H, tl.where(active, go, 0.0), mask=ok)
            tl.store(ws_row + 4 * H, c_keep, mask=ok)
        if HAS_PROJ:
            tl.store(Hraw + (d64 * B + rows64)[:, None] * H + j[None, :], h_raw, mask=ok)
        else:
            h_prev = tl.load(H_in + state, mask=ok, other=0.0)
            _keep_h(h_raw, h_prev, active, ok, H_out, state, out_ptrs, ws_row + 5 * H, SAVE)
    elif CELL == 1:
        xp_row = XP + ((d64 * T + t) * B + rows64)[:, None] * (3 * H) + j[None, :]
        acc_r, acc_z, acc_n, _unused = gate_products(
            zero, zero, zero, zero, H_in + h_base, P, rows64, row_ok, W_hh + d * s_wd, s_wr,
            j, col_ok, H, H, 0, 3, BLOCK_K, PRECISION,
        )  # fmt: skip
        if HAS_BN:
            acc_n += tl.load(B_hn + d * s_bd + 2 * H + j, mask=col_ok, other=0.0).to(tl.float32)[
                None, :
            ]
        r = _sigmoid(acc_r + tl.load(xp_row, mask=ok, other=0.0), ACCURATE)
        z = _sigmoid(acc_z + tl.load(xp_row + H, mask=ok, other=0.0), ACCURATE)
        n = _tanh(tl.load(xp_row + 2 * H, mask=ok, other=0.0) + r * acc_n, ACCURATE)
        h_prev = tl.load(H_in + state, mask=ok, other=0.0)
        h_new = (1.0 - z) * n + z * h_prev
        if SAVE:
            tl.store(ws_row, tl.where(active, r, 0.0), mask=ok)
            tl.store(ws_row + H, tl.where(active, z, 0.0), mask=ok)
            tl.store(ws_row + 2 * H, tl.where(active, n, 0.0), mask=ok)
            tl.store(ws_row + 3 * H, tl.where(active, acc_n, 0.0), mask=ok)
        _keep_h(h_new, h_prev, active, ok, H_out, state, out_ptrs, ws_row + 4 * H, SAVE)
    elif CELL == 2:
        xp_row = XP + ((d64 * T + t) * B + rows64)[:, None] * (3 * H) + j[None, :]
        scratch = Hraw + (d64 * B + rows64)[:, None] * (2 * H) + j[None, :]
        h_prev = tl.load(H_in + state, mask=ok, other=0.0)
        if PHASE == 0:
            acc_r, acc_z, _u2, _u3 = gate_products(
                zero, zero, zero, zero, H_in + h_base, P, rows64, row_ok, W_hh + d * s_wd,
                s_wr, j, col_ok, H, H, 0, 2, BLOCK_K, PRECISION,
            )  # fmt: skip
            r = _sigmoid(acc_r + tl.load(xp_row, mask=ok, other=0.0), ACCURATE)
            z = _sigmoid(acc_z + tl.load(xp_row + H, mask=ok, other=0.0), ACCURATE)
            tl.store(scratch, z, mask=ok)
            tl.store(scratch + H, r * h_prev, mask=ok)
            if SAVE:
                tl.store(ws_row, tl.where(active, r, 0.0), mask=ok)
        else:
            # n's product runs over r * h_{t-1} of every unit, which phase 0 wrote.
            acc_n, _u1, _u2, _u3 = gate_products(
                zero, zero, zero, zero, Hraw + d64 * B * (2 * H) + H, 2 * H, rows64, row_ok,
                W_hh + d * s_wd, s_wr, j, col_ok, H, H, 2, 1, BLOCK_K, PRECISION,
            )  # fmt: skip
            n = _tanh(tl.load(xp_row + 2 * H, mask=ok, other=0.0) + acc_n, ACCURATE)
            z = tl.load(scratch, mask=ok, other=0.0)
            h_new = (1.0 - z) * n + z * h_prev
            if SAVE:
                tl.store(ws_row + H, tl.where(active, z, 0.0), mask=ok)
                tl.store(ws_row + 2 * H, tl.where(active, n, 0.0), mask=ok)
                rh = tl.load(scratch + H, mask=ok, other=0.0)
                tl.store(ws_row + 3 * H, tl.where(active, rh, 0.0), mask=ok)
            _keep_h(h_new, h_prev, active, ok, H_out, state, out_ptrs, ws_row + 4 * H, SAVE)
    else:
        xp_row = XP + ((d64 * T + t) * B + rows64)[:, None] * H + j[None, :]
        acc, _u1, _u2, _u3 = gate_products(
            zero, zero, zero, zero, H_in + h_base, P, rows64, row_ok, W_hh + d * s_wd, s_wr,
            j, col_ok, H, H, 0, 1, BLOCK_K, PRECISION,
        )  # fmt: skip
        pre = acc + tl.load(xp_row, mask=ok, other=0.0)
        if CELL == 3:
            y = _tanh(pre, ACCURATE)
        else:
            y = tl.where(pre < 0.0, 0.0, pre)  # NaN stays NaN, as torch.relu
        h_prev = tl.load(H_in + state, mask=ok, other=0.0)
        if SAVE:
            tl.store(ws_row, tl.where(active, y, 0.0), mask=ok)
        _keep_h(y, h_prev, active, ok, H_out, state, out_ptrs, ws_row + H, SAVE)


@triton.jit(do_not_specialize=["step"])  # one compiled kernel for every step
def _fwd_proj_kernel(
    Hraw,
    W_hr,
    H_in,
    H_out,
    Out,
    WS,
    Len,
    s_rd,
    s_rr,
    s_ot,
    s_ob,
    step,
    T,
    B,
    H,
    P,
    SAVE: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """h_t = (o tanh c_t) W_hr^T for BLOCK_B rows x BLOCK_P projected units (the state is
    carried past a row's end). W_hr (D, P, H); the other tensors as in _fwd_step_kernel."""
    pid_p = tl.program_id(0)
    pid_b = tl.program_id(1)
    d = tl.program_id(2)
    t = _step_time(step, T, d)
    rows = pid_b * BLOCK_B + tl.arange(0, BLOCK_B)
    p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    row_ok = rows < B
    p_ok = p < P
    ok = row_ok[:, None] & p_ok[None, :]
    length = tl.load(Len + rows, mask=row_ok, other=0)
    active = (t < length)[:, None] & ok
    rows64 = rows.to(tl.int64)

    acc = tl.zeros([BLOCK_B, BLOCK_P], dtype=tl.float32)
    raw = Hraw + (d.to(tl.int64) * B + rows64)[:, None] * H
    w = W_hr + d * s_rd + p[None, :] * s_rr
    for k0 in range(0, H, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < H
        a = tl.load(raw + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w + k[:, None], mask=k_ok[:, None] & p_ok[None, :], other=0.0)
        acc += tl.dot(a, b.to(tl.float32), input_precision=PRECISION)

    state = (d.to(tl.int64) * B + rows64)[:, None] * P + p[None, :]
    h_keep = tl.where(active, acc, tl.load(H_in + state, mask=ok, other=0.0))
    tl.store(H_out + state, h_keep, mask=ok)
    tl.store(
        Out + t.to(tl.int64) * s_ot + rows64[:, None] * s_ob + d * P + p[None, :],
        tl.where(active, acc, 0.0).to(Out.dtype.element_ty),
        mask=ok,
    )
    if SAVE:
        width = 5 * H + P
        ws_row = WS + ((d.to(tl.int64) * T + t) * B + rows64)[:, None] * width + 5 * H
        tl.store(ws_row + p[None, :], h_keep, mask=ok)


@triton.jit
def _dropout_kernel(
    Src,
    Dst,
    seed_ptr,
    s_st,
    s_sb,
    B,
    I,
    N_ROWS,
    threshold,
    keep_scale,
    BLOCK_R: tl.constexpr,
    BLOCK_I: tl.constexpr,
):
    """Dst (T * B, I) float32 = Src (T, B, I) * dropout multiplier of element (t * B + b) * I + i
    (row r = t * B + b of Src read through its strides s_st, s_sb)."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    r64 = r.to(tl.int64)
    ok = (r < N_ROWS)[:, None] & (i < I)[None, :]
    src = Src + ((r64 // B) * s_st + (r64 % B) * s_sb)[:, None] + i[None, :]
    x = tl.load(src, mask=ok, other=0.0).to(tl.float32)
    element = r64[:, None] * I + i[None, :]
    x = x * dropout_multiplier(seed_ptr, element, threshold, keep_scale)
    tl.store(Dst + r64[:, None] * I + i[None, :], x, mask=ok)


# ---------------------------------------------------------------------------------------------
# Layer backward kernels


@triton.jit(do_not_specialize=["step"])  # one compiled kernel for every step
def _bwd_gates_kernel(
    GOut,
    DH,
    DC,
    W_hr,
    WS,
    S0,
    Len,
    DG,
    DHP,
    s_got,
    s_gob,
    s_rd,
    s_rr,
    s_0d,
    s_0b,
    step,
    T,
    B,
    H,
    P,
    CELL: tl.constexpr,
    HAS_GOUT: tl.constexpr,
    HAS_PROJ: tl.constexpr,
    PRECISION: tl.constexpr,
    ACCURATE: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """dgates of one step for BLOCK_B rows x BLOCK_H hidden units of the cell CELL.

    GOut (T, B, D * P) gradient of the output; DH (D, B, P) float32 gradient flowing into h_t
    from later steps (and h_n); WS the forward's workspace; S0 (D, B, H) the initial state the
    cell's gradient reads (c0 for the LSTM, h0 for the GRU; strides s_0d, s_0b).
    LSTM: DC (D, B, H) float32 gradient of c_t, updated in place to dc_{t-1}; W_hr (D, P, H);
    DG (D, T, B, 4H) float32 out (i|f|g|o); DHP (D, T, B, P) float32 out (projection only:
    the total gradient of the projected h_t of active rows, for grad_w_hr).
    GRU: DG (D, T, B, 4H) = da_r | da_z | da_n | the gradient of the n block of h W_hh^T + b_hh
    (r * da_n reset-after, da_n reset-before, whose da_r `_bwd_reset_kernel` adds); DH is
    replaced by the direct term dh_t * z of dh_{t-1} (rows past their end keep dh_t).
    RNN: DG (D, T, B, H) = the pre-activation gradient.
    """
    pid_h = tl.program_id(0)
    pid_b = tl.program_id(1)
    d = tl.program_id(2)
    t = _step_time(step, T, d)
    rows = pid_b * BLOCK_B + tl.arange(0, BLOCK_B)
    j = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    row_ok = rows < B
    col_ok = j < H
    ok = row_ok[:, None] & col_ok[None, :]
    length = tl.load(Len + rows, mask=row_ok, other=0)
    row_active = (t < length) & row_ok
    active = row_active[:, None] & col_ok[None, :]
    rows64 = rows.to(tl.int64)
    d64 = d.to(tl.int64)
    gout_rows = GOut + t.to(tl.int64) * s_got + rows64[:, None] * s_gob + d * P
    dh_rows = DH + (d64 * B + rows64)[:, None] * P

    if HAS_PROJ:
        # dh of o tanh(c) = dh_t W_hr, over the P projected units in BLOCK_K chunks.
        dh = tl.zeros([BLOCK_B, BLOCK_H], dtype=tl.float32)
        w = W_hr + d * s_rd + j[None, :]
        for k0 in range(0, P, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < P
            tile_ok = row_ok[:, None] & k_ok[None, :]
            dht = tl.load(dh_rows + k[None, :], mask=tile_ok, other=0.0)
            if HAS_GOUT:
                g = tl.load(
                    gout_rows + k[None, :], mask=row_active[:, None] & k_ok[None, :], other=0.0
                )
                dht += g.to(tl.float32)
            dht = tl.where(row_active[:, None], dht, 0.0)
            if pid_h == 0:
                tl.store(
                    DHP + ((d64 * T + t) * B + rows64)[:, None] * P + k[None, :], dht, mask=tile_ok
                )
            wt = tl.load(w + k[:, None] * s_rr, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            dh += tl.dot(dht, wt.to(tl.float32), input_precision=PRECISION)
    else:
        dh = tl.load(dh_rows + j[None, :], mask=ok, other=0.0)
        if HAS_GOUT:
            g = tl.load(gout_rows + j[None, :], mask=active, other=0.0)
            dh += g.to(tl.float32)

    width = _ws_width(H, P, CELL)
    ws_row = WS + ((d64 * T + t) * B + rows64)[:, None] * width + j[None, :]
    if CELL == 0:
        gi = tl.load(ws_row, mask=ok, other=0.0)
        gf = tl.load(ws_row + H, mask=ok, other=0.0)
        gg = tl.load(ws_row + 2 * H, mask=ok, other=0.0)
        go = tl.load(ws_row + 3 * H, mask=ok, other=0.0)
        tanh_c = _tanh(tl.load(ws_row + 4 * H, mask=ok, other=0.0), ACCURATE)
        # c_{t-1}: the previous processing step's c, or c0 at the first step.
        c_prev = _previous_state(
            WS, S0, s_0d, s_0b, 4 * H, width, d64, rows64, j, ok, step, t, T, B
        )
        dc_ptr = DC + (d64 * B + rows64)[:, None] * H + j[None, :]
        dc = tl.load(dc_ptr, mask=ok, other=0.0)
        di, df, dg, do, dc_prev = gate_grads(dh, dc, gi, gf, gg, go, tanh_c, c_prev)
        tl.store(dc_ptr, tl.where(active, dc_prev, dc), mask=ok)
        dg_row = DG + ((d64 * T + t) * B + rows64)[:, None] * (4 * H) + j[None, :]
        tl.store(dg_row, tl.where(active, di, 0.0), mask=ok)
        tl.store(dg_row + H, tl.where(active, df, 0.0), mask=ok)
        tl.store(dg_row + 2 * H, tl.where(active, dg, 0.0), mask=ok)
        tl.store(dg_row + 3 * H, tl.where(active, do, 0.0), mask=ok)
    elif CELL <= 2:
        r = tl.load(ws_row, mask=ok, other=0.0)
        z = tl.load(ws_row + H, mask=ok, other=0.0)
        n = tl.load(ws_row + 2 * H, mask=ok, other=0.0)
        h_prev = _previous_state(
            WS, S0, s_0d, s_0b, 4 * H, width, d64, rows64, j, ok, step, t, T, B
        )
        da_n = dh * (1.0 - z) * (1.0 - n * n)
        da_z = dh * (h_prev - n) * z * (1.0 - z)
        dg_row = DG + ((d64 * T + t) * B + rows64)[:, None] * (4 * H) + j[None, :]
        if CELL == 1:
            hn = tl.load(ws_row + 3 * H, mask=ok, other=0.0)  # W_hn h_{t-1} + b_hn
            tl.store(dg_row, tl.where(active, da_n * hn * r * (1.0 - r), 0.0), mask=ok)
            tl.store(dg_row + 3 * H, tl.where(active, da_n * r, 0.0), mask=ok)
        else:
            tl.store(dg_row + 3 * H, tl.where(active, da_n, 0.0), mask=ok)
        tl.store(dg_row + H, tl.where(active, da_z, 0.0), mask=ok)
        tl.store(dg_row + 2 * H, tl.where(active, da_n, 0.0), mask=ok)
        tl.store(dh_rows + j[None, :], tl.where(active, dh * z, dh), mask=ok)
    else:
        y = tl.load(ws_row, mask=ok, other=0.0)
        if CELL == 3:
            da = dh * (1.0 - y * y)
        else:
            da = tl.where(y <= 0.0, 0.0, dh)
        dg_row = DG + ((d64 * T + t) * B + rows64)[:, None] * H + j[None, :]
        tl.store(dg_row, tl.where(active, da, 0.0), mask=ok)


@triton.jit(do_not_specialize=["step"])  # one compiled kernel for every step
def _bwd_reset_kernel(
    DG,
    W_hh,
    WS,
    S0,
    DH,
    Len,
    s_wd,
    s_wr,
    s_0d,
    s_0b,
    step,
    T,
    B,
    H,
    PRECISION: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """The reset-before GRU's gradient through r * h_{t-1} (BLOCK_B rows x BLOCK_H units k):
    g = da_n W_hn (over every unit j of n: a grid-wide dependency on _bwd_gates_kernel),
    da_r = g * h_{t-1} * r (1 - r) into DG's r block, and g * r added to DH (dh_{t-1})."""
    pid_k = tl.program_id(0)
    pid_b = tl.program_id(1)
    d = tl.program_id(2)
    t = _step_time(step, T, d)
    rows = pid_b * BLOCK_B + tl.arange(0, BLOCK_B)
    k = pid_k * BLOCK_H + tl.arange(0, BLOCK_H)
    row_ok = rows < B
    k_ok = k < H
    ok = row_ok[:, None] & k_ok[None, :]
    length = tl.load(Len + rows, mask=row_ok, other=0)
    active = (t < length)[:, None] & ok
    rows64 = rows.to(tl.int64)
    d64 = d.to(tl.int64)

    dg_rows = DG + ((d64 * T + t) * B + rows64)[:, None] * (4 * H)
    w = W_hh + d * s_wd + k[None, :]
    acc = tl.zeros([BLOCK_B, BLOCK_H], dtype=tl.float32)
    for j0 in range(0, H, BLOCK_K):
        jj = j0 + tl.arange(0, BLOCK_K)
        j_ok = jj < H
        a = tl.load(dg_rows + 2 * H + jj[None, :], mask=row_ok[:, None] & j_ok[None, :], other=0.0)
        b = tl.load(w + (2 * H + jj[:, None]) * s_wr, mask=j_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.dot(a, b.to(tl.float32), input_precision=PRECISION)
    width = 5 * H
    ws_row = WS + ((d64 * T + t) * B + rows64)[:, None] * width + k[None, :]
    r = tl.load(ws_row, mask=ok, other=0.0)
    h_prev = _previous_state(WS, S0, s_0d, s_0b, 4 * H, width, d64, rows64, k, ok, step, t, T, B)
    tl.store(dg_rows + k[None, :], tl.where(active, acc * h_prev * r * (1.0 - r), 0.0), mask=ok)
    dh_ptr = DH + (d64 * B + rows64)[:, None] * H + k[None, :]
    dh = tl.load(dh_ptr, mask=ok, other=0.0)
    tl.store(dh_ptr, tl.where(active, dh + acc * r, dh), mask=ok)


@triton.jit(do_not_specialize=["step"])  # one compiled kernel for every step
def _bwd_dh_kernel(
    DG,
    W_hh,
    DH,
    Len,
    s_wd,
    s_wr,
    step,
    T,
    B,
    H,
    P,
    CELL: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """dh_{t-1} = dgates_t W_hh (BLOCK_B rows x BLOCK_P units), written over DH in place (each
    program reads and writes only its own block). Past a row's end h is carried, so there
    dh_{t-1} = dh_t, which is DH itself: the output gradient is 0 there (the output is a
    constant 0). The GRU's DH holds the direct term already (dh_t * z, plus g * r
    reset-before), which is added; its product runs over the gate blocks of h: r, z and
    (reset-after) n, whose gradient is DG's fourth block."""
    pid_p = tl.program_id(0)
    pid_b = tl.program_id(1)
    d = tl.program_id(2)
    t = _step_time(step, T, d)
    rows = pid_b * BLOCK_B + tl.arange(0, BLOCK_B)
    p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    row_ok = rows < B
    p_ok = p < P
    ok = row_ok[:, None] & p_ok[None, :]
    length = tl.load(Len + rows, mask=row_ok, other=0)
    active = (t < length)[:, None] & ok
    rows64 = rows.to(tl.int64)
    d64 = d.to(tl.int64)

    # K: the rows of W_hh in the product; DGW: DG's row width.
    K = H
    DGW = H
    if CELL == 0:
        K = 4 * H
        DGW = 4 * H
    elif CELL == 1:
        K = 3 * H
        DGW = 4 * H
    elif CELL == 2:
        K = 2 * H
        DGW = 4 * H
    acc = tl.zeros([BLOCK_B, BLOCK_P], dtype=tl.float32)
    dg_rows = DG + ((d64 * T + t) * B + rows64)[:, None] * DGW
    w = W_hh + d * s_wd + p[None, :]
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        col = k
        if CELL == 1:
            col = tl.where(k < 2 * H, k, k + H)  # n's gradient sits in DG's fourth block
        a = tl.load(dg_rows + col[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w + k[:, None] * s_wr, mask=k_ok[:, None] & p_ok[None, :], other=0.0)
        acc += tl.dot(a, b.to(tl.float32), input_precision=PRECISION)
    dh_ptr = DH + (d64 * B + rows64)[:, None] * P + p[None, :]
    carried = tl.load(dh_ptr, mask=ok, other=0.0)
    if CELL == 1:
        acc += carried
    elif CELL == 2:
        acc += carried
    tl.store(dh_ptr, tl.where(active, acc, carried), mask=ok)


# ---------------------------------------------------------------------------------------------
# Launch helpers


# Largest tile under the interpreter; tests lower it to 16 to run several tiles per dimension
# on small sizes.
INTERPRETER_MAX_BLOCK = 64


def block_size(n: int, interpret: bool, lo: int = 16, gpu: int = 32, cap: int | None = None) -> int:
    """Tile size for a dimension of size n: tl.dot needs >= 16; under the interpreter the
    largest useful tile (every tile op is one numpy call), on a GPU at most `gpu`."""
    size = max(lo, triton.next_power_of_2(max(n, 1)))
    if interpret:
        return min(size, cap or INTERPRETER_MAX_BLOCK)
    return min(size, gpu)


def batch_block_size(B: int, interpret: bool) -> int:
    # Small batches waste no rows; 64 rows a program keeps W_hh reuse high for large ones.
    return block_size(B, interpret, gpu=64)


def warps(block_b: int, block_n: int) -> int:
    """Warps for a (block_b x block_n) tile of the GEMM kernels: four float32 gate
    accumulators plus the fused epilogue spill registers on sm_90 at 32 x 32 with 4 warps
    (255 registers and a stack), not with 8 (222 at 64 x 32; cuobjdump -res-usage of the
    cubins, tests/triton_lstm_aot.py)."""
    return 8 if block_b * block_n >= 1024 else 4


def _step_tiles(
    B: int, H: int, P: int, D: int, device: torch.device, interpret: bool
) -> tuple[int, int, int]:
    """(BLOCK_B, BLOCK_H, BLOCK_P) of the per-step kernels. A step is a small GEMM
    (B x 4H x P), and every program of it must run at once to hide its latency: on a GPU the
    tiles shrink (rows first, then units) until the step has about one program per SM, since a
    few large tiles would leave most SMs idle for the whole sequence. W_hh stays in L2, so the
    extra reads of smaller row tiles are cheap. Under the interpreter: the largest tiles."""
    if interpret or not on_gpu(device):
        return batch_block_size(B, interpret), block_size(H, interpret), block_size(P, interpret)
    sms = device_sm_count(device)
    block_b, block_h = batch_block_size(B, False), block_size(H, False)
    for bb, bh in ((block_b, block_h), (min(block_b, 32), block_h), (16, block_h), (16, 16)):
        block_b, block_h = bb, bh
        if triton.cdiv(B, bb) * triton.cdiv(H, bh) * D >= sms:
            break
    return block_b, block_h, min(block_size(P, False), block_h)


def check_acc_dtype(op: str, dtype: torch.dtype) -> None:
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(
            f"fastattn::{op}: the triton backend takes float32, float16 or bfloat16, got {dtype}"
        )


def _dropout(x: torch.Tensor, p: float, seed: torch.Tensor) -> torch.Tensor:
    """(T * B, I) float32 = x (T, B, I) with fastattn's dropout mask (element (t*B + b)*I + i)
    applied and kept elements scaled by 1/(1 - p)."""
    T, B, I = x.shape
    out = torch.empty((T * B, I), dtype=_F32, device=x.device)
    if out.numel() == 0:
        return out
    interpret = interpreting(x.device)
    # On a GPU 1024 elements a program (8 a thread): Philox's 10 rounds on more spill.
    block_r = block_size(T * B, interpret, lo=1, gpu=16, cap=128)
    block_i = block_size(I, interpret, lo=1, gpu=64, cap=128)
    grid = (triton.cdiv(T * B, block_r), triton.cdiv(I, block_i))
    with on_device(x):
        wrap_triton(_dropout_kernel)[grid](
            x,
            out,
            seed,
            x.stride(0),
            x.stride(1),
            B,
            I,
            T * B,
            float(p),
            1.0 / (1.0 - p),
            BLOCK_R=block_r,
            BLOCK_I=block_i,
        )
    return out


def seed_arg(dropout_p: float, seed: torch.Tensor | None, op: str) -> torch.Tensor | None:
    if dropout_p > 0.0:
        if seed is None or seed.numel() != 2:
            raise ValueError(
                f"fastattn::{op}: dropout_p > 0 needs seed, an int64 (2,) tensor (seed, stream)"
            )
        return seed.to(torch.int64).contiguous()
    return None


def _lengths_arg(lengths: torch.Tensor | None, T: int, B: int, device, op: str) -> torch.Tensor:
    if lengths is None:
        return torch.full((B,), T, dtype=torch.int64, device=device)
    if lengths.shape != (B,):
        raise ValueError(
            f"fastattn::{op}: lengths must have shape ({B},), got {tuple(lengths.shape)}"
        )
    lengths = lengths.to(device=device, dtype=torch.int64).contiguous()
    # Read on the host only for CPU tensors (the interpreter) or with FASTATTN_HOST_CHECKS=1
    # (as fastattn/ops/_common.py's host_checks_enabled): on CUDA a read would synchronise every
    # call. There fastattn.lstm checks the values on the device, and the kernels treat rows as
    # active while t < length, which clamps a length into [0, T] (no access outside the
    # tensors), as the reference's masks do.
    on_host = lengths.device.type == "cpu" or os.environ.get("FASTATTN_HOST_CHECKS") == "1"
    if (
        B > 0
        and on_host
        and not torch.compiler.is_compiling()
        and not isinstance(lengths, torch._subclasses.FakeTensor)
    ):
        lo, hi = (int(v) for v in torch.aminmax(lengths))
        if lo < 0 or hi > T:
            raise ValueError(
                f"fastattn::{op}: lengths must be in [0, T] = [0, {T}], got "
                f"values from {lo} to {hi}"
            )
    return lengths


def _check_layer_shapes(op, input, h0, c0, w_ih, w_hh, b_ih, b_hh, w_hr, gates=4):
    """Shapes, dtypes and devices of a layer's tensors: W_hh (D, gates * H, P); c0 and w_hr
    are the LSTM's (None for the others). Returns (T, B, I, D, H, P)."""
    if input.dim() != 3 or w_hh.dim() != 3 or w_hh.shape[1] % gates or w_hh.shape[1] == 0:
        raise ValueError(
            f"fastattn::{op}: input must be (T, B, I) and w_hh (D, {gates}H, P), got "
            f"{tuple(input.shape)} and {tuple(w_hh.shape)}"
        )
    T, B, I = input.shape
    D, G, P = w_hh.shape
    H = G // gates
    if D not in (1, 2):
        raise ValueError(f"fastattn::{op}: w_hh must have D = 1 or 2 directions, got {D}")
    expected = {
        "h0": (h0, (D, B, P)),
        "c0": (c0, (D, B, H)),
        "w_ih": (w_ih, (D, G, I)),
        "b_ih": (b_ih, (D, G)),
        "b_hh": (b_hh, (D, G)),
        "w_hr": (w_hr, (D, P, H)),
    }
    if (b_ih is None) != (b_hh is None):
        raise ValueError(f"fastattn::{op}: b_ih and b_hh must be given together")
    if w_hr is None and P != H:
        raise ValueError(
            f"fastattn::{op}: w_hh must be (D, {gates}H, H) without w_hr, got {tuple(w_hh.shape)}"
        )
    for name, (t, shape) in expected.items():
        if t is None:
            continue
        if tuple(t.shape) != shape:
            raise ValueError(
                f"fastattn::{op}: {name} must have shape {shape}, got {tuple(t.shape)}"
            )
        if t.dtype != input.dtype or t.device != input.device:
            raise ValueError(
                f"fastattn::{op}: {name} must have the input's dtype and device "
                f"({input.dtype}, {input.device}), got {t.dtype}, {t.device}"
            )
    return T, B, I, D, H, P


# ---------------------------------------------------------------------------------------------
# The layer driver, generic over the cell: the launchers of fastattn/triton/lstm.py, gru.py and
# rnn.py run every layer through these two functions.


def layer_forward(
    cell: int,
    op: str,
    input: torch.Tensor,
    h0: torch.Tensor,
    c0: torch.Tensor | None,
    w_ih: torch.Tensor,
    w_hh: torch.Tensor,
    b_ih: torch.Tensor | None,
    b_hh: torch.Tensor | None,
    w_hr: torch.Tensor | None,
    lengths: torch.Tensor | None,
    dropout_p: float,
    seed: torch.Tensor | None,
    save_workspace: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """One layer of `cell` (CELL_*), D directions: input (T, B, I), h0 (D, B, P), c0 (D, B, H)
    (LSTM only, else None), w_ih (D, G H, I), w_hh (D, G H, P), b_ih / b_hh (D, G H) or None,
    w_hr (D, P, H) (LSTM only) or None, lengths (B,) or None -> output (T, B, D * P), h_n
    (D, B, P), c_n (D, B, H) (None but for the LSTM), workspace (D, T * B * width) float32
    (`workspace_width`; (0,) unless save_workspace). See the module docstring."""
    check_acc_dtype(op, input.dtype)
    G = GATES[cell]
    T, B, I, D, H, P = _check_layer_shapes(op, input, h0, c0, w_ih, w_hh, b_ih, b_hh, w_hr, G)
    dtype, device = input.dtype, input.device
    interpret = interpreting(device)
    seed = seed_arg(dropout_p, seed, op)
    lens = _lengths_arg(lengths, T, B, device, op)
    x = unit_last_stride(input)
    has_proj = w_hr is not None

    # The input projection of every step: one GEMM per direction, with the biases that add to
    # it (all but the reset-after GRU's b_hn, which r multiplies: the step kernel adds it).
    if seed is not None:
        xd = _dropout(x, dropout_p, seed)
    else:
        xd = x.to(_F32).reshape(T * B, I)
    xproj = torch.matmul(xd, w_ih.to(_F32).transpose(1, 2))  # (D, T*B, G H)
    has_bn = cell == CELL_GRU and b_ih is not None
    if b_ih is not None:
        bias = b_ih.to(_F32) + b_hh.to(_F32)
        if has_bn:
            bias[:, 2 * H :] = b_ih[:, 2 * H :]
        xproj += bias[:, None, :]
    xproj = xproj.contiguous()

    states = torch.empty((2, D, B, P), dtype=_F32, device=device)
    states[0] = h0
    c = c0.to(_F32, copy=True).contiguous() if cell == CELL_LSTM else xproj
    scratch_shape = (0,)
    if has_proj:
        scratch_shape = (D, B, H)  # o tanh(c) before the projection
    elif cell == CELL_GRU_RESET_BEFORE:
        scratch_shape = (D, B, 2 * H)  # z | r * h_{t-1}
    scratch = torch.empty(scratch_shape, dtype=_F32, device=device)
    out = output_buffer((T, B, D * P), dtype, device)
    width = workspace_width(cell, H, P)
    ws = poison(
        torch.empty((D, T * B * width) if save_workspace else (0,), dtype=_F32, device=device)
    )
    ws_arg = ws if save_workspace else xproj
    w_hh_ = unit_last_stride(w_hh)
    w_hr_ = unit_last_stride(w_hr) if has_proj else w_hh_
    b_hn = b_hh.contiguous() if has_bn else w_hh_
    precision = dot_precision(dtype)
    phases = (0, 1) if cell == CELL_GRU_RESET_BEFORE else (0,)
    if T > 0 and B > 0:
        block_b, block_h, block_p = _step_tiles(B, H, P, D, device, interpret)
        block_k = block_size(P, interpret)
        block_kh = block_size(H, interpret)
        step_grid = (triton.cdiv(H, block_h), triton.cdiv(B, block_b), D)
        proj_grid = (triton.cdiv(P, block_p), triton.cdiv(B, block_b), D)
        step_kernel = wrap_triton(_fwd_step_kernel)
        proj_kernel = wrap_triton(_fwd_proj_kernel)
        with on_device(input):
            for s in range(T):
                h_in, h_out = states[s % 2], states[(s + 1) % 2]
                for phase in phases:
                    step_kernel[step_grid](
                        xproj,
                        w_hh_,
                        b_hn,
                        h_in,
                        h_out,
                        c,
                        scratch,
                        out,
                        ws_arg,
                        lens,
                        w_hh_.stride(0),
                        w_hh_.stride(1),
                        b_hn.stride(0),
                        out.stride(0),
                        out.stride(1),
                        s,
                        T,
                        B,
                        H,
                        P,
                        CELL=cell,
                        PHASE=phase,
                        HAS_BN=has_bn,
                        HAS_PROJ=has_proj,
                        SAVE=save_workspace,
                        PRECISION=precision,
                        ACCURATE=not interpret,
                        BLOCK_B=block_b,
                        BLOCK_H=block_h,
                        BLOCK_K=block_k,
                        num_warps=warps(block_b, block_h),
                    )
                if has_proj:
                    proj_kernel[proj_grid](
                        scratch,
                        w_hr_,
                        h_in,
                        h_out,
                        out,
                        ws_arg,
                        lens,
                        w_hr_.stride(0),
                        w_hr_.stride(1),
                        out.stride(0),
                        out.stride(1),
                        s,
                        T,
                        B,
                        H,
                        P,
                        SAVE=save_workspace,
                        PRECISION=precision,
                        BLOCK_B=block_b,
                        BLOCK_P=block_p,
                        BLOCK_K=block_kh,
                        num_warps=warps(block_b, block_p),
                    )
    h_n = states[T % 2].to(dtype)
    c_n = c.to(dtype) if cell == CELL_LSTM else None
    return finish(out, dtype), h_n, c_n, ws


def layer_backward(
    cell: int,
    op: str,
    grad_output: torch.Tensor | None,
    grad_h_n: torch.Tensor | None,
    grad_c_n: torch.Tensor | None,
    input: torch.Tensor,
    h0: torch.Tensor,
    c0: torch.Tensor | None,
    w_ih: torch.Tensor,
    w_hh: torch.Tensor,
    w_hr: torch.Tensor | None,
    lengths: torch.Tensor | None,
    workspace: torch.Tensor,
    dropout_p: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The recurrence of the backward of one layer of `cell` (arguments as `layer_forward`,
    workspace the one it saved; missing incoming gradients are zeros) -> dgates (D, T, B, DGW)
    float32 (DGW = 4H for the LSTM (i|f|g|o) and the GRU (r|z|n|n of h W_hh^T, see
    _bwd_gates_kernel), H for the RNN; 0 past a row's end), dh_{-1} = grad_h0 (D, B, P) and
    dc_{-1} = grad_c0 (D, B, H) (None but for the LSTM) float32, dhp (D, T, B, P) float32 (the
    projected LSTM's gradient of h_t, else (0,)). The products with the weights are the
    caller's (GEMMs over all T * B rows)."""
    check_acc_dtype(op, input.dtype)
    G = GATES[cell]
    T, B, I, D, H, P = _check_layer_shapes(op, input, h0, c0, w_ih, w_hh, None, None, w_hr, G)
    dtype, device = input.dtype, input.device
    interpret = interpreting(device)
    width = workspace_width(cell, H, P)
    if (
        workspace.dtype != _F32
        or tuple(workspace.shape) != (D, T * B * width)
        or not workspace.is_contiguous()
    ):
        raise ValueError(
            f"fastattn::{op}: workspace must be the contiguous float32 "
            f"({D}, {T * B * width}) tensor that the forward op saved "
            f"(save_workspace=True), got {workspace.dtype} "
            f"{tuple(workspace.shape)}"
        )
    lens = _lengths_arg(lengths, T, B, device, op)
    has_proj = w_hr is not None
    lstm = cell == CELL_LSTM

    dh = (
        grad_h_n.to(_F32, copy=True).contiguous()
        if grad_h_n is not None
        else torch.zeros((D, B, P), dtype=_F32, device=device)
    )
    dc = None
    if lstm:
        dc = (
            grad_c_n.to(_F32, copy=True).contiguous()
            if grad_c_n is not None
            else torch.zeros((D, B, H), dtype=_F32, device=device)
        )
    dg_width = H if G == 1 else 4 * H
    dgates = poison(torch.empty((D, T, B, dg_width), dtype=_F32, device=device))
    dhp = poison(torch.empty((D, T, B, P) if has_proj else (0,), dtype=_F32, device=device))
    gout = unit_last_stride(grad_output) if grad_output is not None else dh
    g_t, g_b = (gout.stride(0), gout.stride(1)) if grad_output is not None else (0, 0)
    w_hh_ = unit_last_stride(w_hh)
    w_hr_ = unit_last_stride(w_hr) if has_proj else w_hh_
    # The initial state the gates' gradient reads: c0 (LSTM), h0 (GRU).
    s0 = unit_last_stride(c0) if lstm else unit_last_stride(h0)
    precision = dot_precision(dtype)
    if T > 0 and B > 0:
        block_b, block_h, block_p = _step_tiles(B, H, P, D, device, interpret)
        block_kp = block_size(P, interpret)
        # rows of W_hh in dh_{t-1}'s product: all but the reset-before GRU's n block
        k_dh = {CELL_LSTM: 4 * H, CELL_GRU: 3 * H, CELL_GRU_RESET_BEFORE: 2 * H}.get(cell, H)
        block_kg = block_size(k_dh, interpret)
        gates_grid = (triton.cdiv(H, block_h), triton.cdiv(B, block_b), D)
        dh_grid = (triton.cdiv(P, block_p), triton.cdiv(B, block_b), D)
        gates_kernel = wrap_triton(_bwd_gates_kernel)
        reset_kernel = wrap_triton(_bwd_reset_kernel)
        dh_kernel = wrap_triton(_bwd_dh_kernel)
        with on_device(input):
            for s in range(T - 1, -1, -1):
                gates_kernel[gates_grid](
                    gout,
                    dh,
                    dc if lstm else dh,
                    w_hr_,
                    workspace,
                    s0,
                    lens,
                    dgates,
                    dhp,
                    g_t,
                    g_b,
                    w_hr_.stride(0),
                    w_hr_.stride(1),
                    s0.stride(0),
                    s0.stride(1),
                    s,
                    T,
                    B,
                    H,
                    P,
                    CELL=cell,
                    HAS_GOUT=grad_output is not None,
                    HAS_PROJ=has_proj,
                    PRECISION=precision,
                    ACCURATE=not interpret,
                    BLOCK_B=block_b,
                    BLOCK_H=block_h,
                    BLOCK_K=block_kp,
                    num_warps=warps(block_b, block_h),
                )
                if cell == CELL_GRU_RESET_BEFORE:
                    reset_kernel[gates_grid](
                        dgates,
                        w_hh_,
                        workspace,
                        s0,
                        dh,
                        lens,
                        w_hh_.stride(0),
                        w_hh_.stride(1),
                        s0.stride(0),
                        s0.stride(1),
                        s,
                        T,
                        B,
                        H,
                        PRECISION=precision,
                        BLOCK_B=block_b,
                        BLOCK_H=block_h,
                        BLOCK_K=block_size(H, interpret),
                        num_warps=warps(block_b, block_h),
                    )
                dh_kernel[dh_grid](
                    dgates,
                    w_hh_,
                    dh,
                    lens,
                    w_hh_.stride(0),
                    w_hh_.stride(1),
                    s,
                    T,
                    B,
                    H,
                    P,
                    CELL=cell,
                    PRECISION=precision,
                    BLOCK_B=block_b,
                    BLOCK_P=block_p,
                    BLOCK_K=block_kg,
                    num_warps=warps(block_b, block_p),
                )
    else:
        dgates.zero_()
        dhp.zero_()
    return dgates, dh, dc, dhp


def previous_states(ws_h: torch.Tensor, h0: torch.Tensor) -> torch.Tensor:
    """h_{t-1} of every step (D, T * B, P) float32 from the workspace's carried states ws_h
    (D, T, B, P): the previous processing step's state, h0 (D, B, P) at the first step."""
    D, T, B, P = ws_h.shape
    h0f = h0.to(_F32)
    prev = []
    for d in range(D):
        if d == 0:
            prev.append(torch.cat([h0f[0:1], ws_h[0, : T - 1]]) if T else ws_h[0])
        else:
            prev.append(torch.cat([ws_h[1, 1:], h0f[1:2]]) if T else ws_h[1])
    return torch.stack(prev).view(D, T * B, P)


def dropped_input(input: torch.Tensor, dropout_p: float, seed: torch.Tensor | None) -> torch.Tensor:
    """The layer's input as its input projection saw it: (T * B, I) float32, dropout applied."""
    T, B, I = input.shape
    if seed is not None:
        return _dropout(unit_last_stride(input), dropout_p, seed)
    return input.to(_F32).reshape(T * B, I)


def input_gradient(
    dg_x: torch.Tensor,
    w_ih: torch.Tensor,
    shape: tuple[int, ...],
    dropout_p: float,
    seed: torch.Tensor | None,
) -> torch.Tensor:
    """grad of the layer's input (T, B, I) float32 from the input-side gate gradients dg_x
    (D, T * B, G H): dg_x W_ih summed over the directions, through the dropout mask."""
    T, B, I = shape
    dx = torch.matmul(dg_x, w_ih.to(_F32)).sum(0).view(T, B, I)
    if seed is not None:
        dx = _dropout(dx, dropout_p, seed).view(T, B, I)
    return dx
