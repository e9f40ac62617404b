"""Plain-PyTorch definition of the GRU ops (the "reference" backend): a per-step loop.

The functions take the canonical arguments the public ops (fastattn/ops/gru.py) build: a
time-major input (T, B, I) and the weights of one layer stacked over its D directions. The
arithmetic happens in the compute type (float32 for float16/bfloat16/float32, float64 for
float64) and each layer's results are rounded once to the input's dtype, as the kernels do.
Gates are in torch's order r, z, n:

    r = sigmoid(x W_ir^T + b_ir + h W_hr^T + b_hr)
    z = sigmoid(x W_iz^T + b_iz + h W_hz^T + b_hz)
    reset_after=True  (torch, cuDNN):  n = tanh(x W_in^T + b_in + r * (h W_hn^T + b_hn))
    reset_after=False (Cho et al.):    n = tanh(x W_in^T + b_in + (r * h) W_hn^T + b_hn)
    h' = (1 - z) * n + z * h

Variable lengths and dropout behave as in fastattn/reference/lstm.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .lstm import compute_dtype
from .positional import apply_dropout


def _cell(x_t, h, w_ih, w_hh, b_ih, b_hh, reset_after: bool):
    gi = F.linear(x_t, w_ih, b_ih)
    H = h.shape[-1]
    w_hrz, w_hn = w_hh[: 2 * H], w_hh[2 * H :]
    b_hrz, b_hn = (None, None) if b_hh is None else (b_hh[: 2 * H], b_hh[2 * H :])
    i_r, i_z, i_n = gi.chunk(3, dim=-1)
    h_r, h_z = F.linear(h, w_hrz, b_hrz).chunk(2, dim=-1)
    r = torch.sigmoid(i_r + h_r)
    z = torch.sigmoid(i_z + h_z)
    if reset_after:
        n = torch.tanh(i_n + r * F.linear(h, w_hn, b_hn))
    else:
        n = torch.tanh(i_n + F.linear(r * h, w_hn, b_hn))
    return (1 - z) * n + z * h


def gru_cell(
    input: torch.Tensor,
    hx: torch.Tensor,
    w_ih: torch.Tensor,
    w_hh: torch.Tensor,
    b_ih: torch.Tensor | None = None,
    b_hh: torch.Tensor | None = None,
    reset_after: bool = True,
) -> torch.Tensor:
    """One step: input (B, I), hx (B, H), w_ih (3H, I), w_hh (3H, H), b_ih/b_hh (3H,) -> hy."""
    acc = compute_dtype(input.dtype)
    up = lambda t: None if t is None else t.to(acc)
    hy = _cell(up(input), up(hx), up(w_ih), up(w_hh), up(b_ih), up(b_hh), reset_after)
    return hy.to(input.dtype)


def gru_layer(
    input: torch.Tensor,
    h0: torch.Tensor,
    w_ih: torch.Tensor,
    w_hh: torch.Tensor,
    b_ih: torch.Tensor | None,
    b_hh: torch.Tensor | None,
    lengths: torch.Tensor | None,
    dropout_p: float,
    seed: torch.Tensor | None,
    reset_after: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer, all of its D directions.

    input (T, B, I); h0 (D, B, H); w_ih (D, 3H, I); w_hh (D, 3H, H); b_ih, b_hh (D, 3H) or
    None; lengths int (B,) or None; dropout_p/seed: dropout applied to the input first.
    Returns output (T, B, D * H) (direction d in columns [d * H, (d + 1) * H)) and h_n
    (D, B, H), in the input's dtype.
    """
    return recurrent_layer(
        input,
        h0,
        w_ih,
        w_hh,
        b_ih,
        b_hh,
        lengths,
        dropout_p,
        seed,
        lambda x_t, h, w_ih, w_hh, b_ih, b_hh: _cell(x_t, h, w_ih, w_hh, b_ih, b_hh, reset_after),
    )


def recurrent_layer(input, h0, w_ih, w_hh, b_ih, b_hh, lengths, dropout_p, seed, cell):
    """The per-step loop of one layer for a cell h' = cell(x_t, h, w_ih, w_hh, b_ih, b_hh)
    (shared by the GRU and the Elman RNN)."""
    T, B, _ = input.shape
    D, _, H = w_hh.shape
    acc = compute_dtype(input.dtype)
    x = apply_dropout(input.to(acc), dropout_p, seed)
    if lengths is not None:
        lengths = lengths.to(device=input.device, dtype=torch.int64).view(B, 1)
    outputs, h_n = [], []
    for d in range(D):
        weights = [None if w is None else w[d].to(acc) for w in (w_ih, w_hh, b_ih, b_hh)]
        h = h0[d].to(acc)
        steps = range(T) if d == 0 else range(T - 1, -1, -1)
        out: list = [None] * T  # every step is filled below
        for t in steps:
            h_new = cell(x[t], h, *weights)
            if lengths is None:
                h = h_new
                out[t] = h_new
            else:
                active = lengths > t
                h = torch.where(active, h_new, h)
                out[t] = h_new.masked_fill(~active, 0.0)
        outputs.append(torch.stack(out) if T > 0 else x.new_zeros((0, B, H)))
        h_n.append(h)
    output = torch.cat(outputs, dim=-1)
    return output.to(input.dtype), torch.stack(h_n).to(input.dtype)
