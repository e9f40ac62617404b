"""Plain-PyTorch definition of the LSTM ops (the "reference" backend): a per-step loop.

The functions take the canonical arguments the public ops (fastattn/ops/lstm.py) build: a
time-major input (T, B, I) and the weights of one layer stacked over its D directions. The
arithmetic happens in the compute type (float32 for float16/bfloat16/float32, float64 for
float64) and each layer's results are rounded once to the input's dtype, as the kernels do.

    gates = x W_ih^T + b_ih + h W_hh^T + b_hh          split in torch's order i, f, g, o
    c'    = sigmoid(f) * c + sigmoid(i) * tanh(g)
    h'    = sigmoid(o) * tanh(c')                      (then h' W_hr^T with a projection)

Variable lengths: row b takes part in steps t < lengths[b] only; its state stops changing
after its last step (forward direction) or starts from (h0, c0) at t = lengths[b] - 1
(reverse direction), and its outputs past the end are 0. Dropout (between layers) is applied
to a layer's input with fastattn's Philox stream, elements numbered row-major over (T, B, I).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..contracts import compute_dtype
from .positional import apply_dropout


def _cell(x_t, h, c, w_ih, w_hh, b_ih, b_hh):
    gates = F.linear(x_t, w_ih, b_ih) + F.linear(h, w_hh, b_hh)
    i, f, g, o = gates.chunk(4, dim=-1)
    c_new = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    return torch.sigmoid(o) * torch.tanh(c_new), c_new


def lstm_cell(
    input: torch.Tensor,
    hx: torch.Tensor,
    cx: torch.Tensor,
    w_ih: torch.Tensor,
    w_hh: torch.Tensor,
    b_ih: torch.Tensor | None = None,
    b_hh: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One step: input (B, I), hx/cx (B, H), w_ih (4H, I), w_hh (4H, H) -> (hy, cy)."""
    acc = compute_dtype(input.dtype)
    up = lambda t: None if t is None else t.to(acc)
    hy, cy = _cell(up(input), up(hx), up(cx), up(w_ih), up(w_hh), up(b_ih), up(b_hh))
    return hy.to(input.dtype), cy.to(input.dtype)


def lstm_layer(
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One layer, all of its D directions.

    input (T, B, I); h0 (D, B, P); c0 (D, B, H); w_ih (D, 4H, I); w_hh (D, 4H, P);
    b_ih, b_hh (D, 4H) or None; w_hr (D, P, H) or None (P = H without it); lengths int (B,)
    or None; dropout_p/seed: dropout applied to the input first.
    Returns output (T, B, D * P) (direction d in columns [d * P, (d + 1) * P)), h_n (D, B, P)
    and c_n (D, B, H), in the input's dtype.
    """
    T, B, _ = input.shape
    D, _, P = w_hh.shape
    acc = compute_dtype(input.dtype)
    x = apply_dropout(input.to(acc), dropout_p, seed)
    if lengths is not None:
        lengths = lengths.to(device=input.device, dtype=torch.int64).view(B, 1)
    outputs, h_n, c_n = [], [], []
    for d in range(D):
        weights = [None if w is None else w[d].to(acc) for w in (w_ih, w_hh, b_ih, b_hh)]
        w_proj = None if w_hr is None else w_hr[d].to(acc)
        h, c = h0[d].to(acc), c0[d].to(acc)
        steps = range(T) if d == 0 else range(T - 1, -1, -1)
        out: list = [None] * T  # every step is filled below
        for t in steps:
            h_new, c_new = _cell(x[t], h, c, *weights)
            if w_proj is not None:
                h_new = F.linear(h_new, w_proj)
            if lengths is None:
                h, c = h_new, c_new
                out[t] = h_new
            else:
                active = lengths > t
                h = torch.where(active, h_new, h)
                c = torch.where(active, c_new, c)
                out[t] = h_new.masked_fill(~active, 0.0)
        outputs.append(torch.stack(out) if T > 0 else x.new_zeros((0, B, P)))
        h_n.append(h)
        c_n.append(c)
    output = torch.cat(outputs, dim=-1)
    return (
        output.to(input.dtype),
        torch.stack(h_n).to(input.dtype),
        torch.stack(c_n).to(input.dtype),
    )
