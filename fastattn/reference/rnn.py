"""Plain-PyTorch definition of the Elman RNN ops (the "reference" backend): a per-step loop.

    h' = act(x W_ih^T + b_ih + h W_hh^T + b_hh),   act = tanh or relu

Arguments, compute type, lengths and dropout as in fastattn/reference/gru.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .gru import recurrent_layer
from .lstm import compute_dtype

_ACTIVATIONS = {"tanh": torch.tanh, "relu": torch.relu}


def _cell(x_t, h, w_ih, w_hh, b_ih, b_hh, nonlinearity: str):
    return _ACTIVATIONS[nonlinearity](F.linear(x_t, w_ih, b_ih) + F.linear(h, w_hh, b_hh))


def rnn_cell(
    input: torch.Tensor,
    hx: torch.Tensor,
    w_ih: torch.Tensor,
    w_hh: torch.Tensor,
    b_ih: torch.Tensor | None = None,
    b_hh: torch.Tensor | None = None,
    nonlinearity: str = "tanh",
) -> torch.Tensor:
    """One step: input (B, I), hx (B, H), w_ih (H, I), w_hh (H, H), b_ih/b_hh (H,) -> hy."""
    acc = compute_dtype(input.dtype)
    up = lambda t: None if t is None else t.to(acc)
    hy = _cell(up(input), up(hx), up(w_ih), up(w_hh), up(b_ih), up(b_hh), nonlinearity)
    return hy.to(input.dtype)


def rnn_layer(
    input: torch.Tensor,
    h0: torch.Tensor,
    w_ih: torch.Tensor,
    w_hh: torch.Tensor,
    b_ih: torch.Tensor | None,
    b_hh: torch.Tensor | None,
    lengths: torch.Tensor | None,
    dropout_p: float,
    seed: torch.Tensor | None,
    nonlinearity: str = "tanh",
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer, all of its D directions: input (T, B, I); h0 (D, B, H); w_ih (D, H, I);
    w_hh (D, H, H); b_ih, b_hh (D, H) or None; lengths int (B,) or None. Returns output
    (T, B, D * H) and h_n (D, B, H) in the input's dtype."""
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
        lambda x_t, h, w_ih, w_hh, b_ih, b_hh: _cell(x_t, h, w_ih, w_hh, b_ih, b_hh, nonlinearity),
    )
