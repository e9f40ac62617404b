"""The torch backend of `fastattn.lstm` and `fastattn.lstm_cell`: torch._VF.lstm (cuDNN on
CUDA, oneDNN on the CPU; ATen's loop with a projection) and torch._VF.lstm_cell, on the
arguments the public ops (fastattn/ops/lstm.py) have checked and put in canonical form. What
is computed as fastattn defines it, and what is refused, is fastattn/aten/_recurrent.py's
docstring; the LSTM supports everything else fastattn's does (layers, bidirectional,
proj_size, lengths, no bias, every dtype).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import _VF

from . import _recurrent


def refusal(
    device: torch.device,
    dtype: torch.dtype,
    *,
    seq_len: int,
    dropout_p: float,
    lengths: torch.Tensor | None,
) -> str | None:
    """Why torch's LSTM cannot compute this `fastattn.lstm` call as fastattn defines it, or
    None (see fastattn/aten/_recurrent.py: refusal)."""
    return _recurrent.refusal(
        device, dtype, seq_len=seq_len, dropout_p=dropout_p, lengths=lengths, onednn_layers=True
    )


def lstm(
    x: torch.Tensor,
    h0: torch.Tensor,
    c0: torch.Tensor,
    weights: Sequence[torch.Tensor],
    *,
    has_bias: bool,
    num_layers: int,
    bidirectional: bool,
    lengths: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The multi-layer LSTM on torch's kernel.

    x: (T, B, I) time-major, T > 0; h0: (num_layers * D, B, P); c0: (num_layers * D, B, H);
    weights: nn.LSTM's _flat_weights order (w_ih, w_hh[, b_ih, b_hh][, w_hr] per layer and
    direction; a projection is read from P != H); lengths: int64 (B,) on the host or None.
    Returns output (T, B, D * P), h_n (num_layers * D, B, P), c_n (num_layers * D, B, H) in
    x's dtype.
    """
    output, (h_n, c_n) = _recurrent.run_layers(
        _VF.lstm,
        x,
        (h0, c0),
        weights,
        has_bias=has_bias,
        num_layers=num_layers,
        bidirectional=bidirectional,
        lengths=lengths,
    )
    return output, h_n, c_n


def lstm_cell(
    x: torch.Tensor,
    h: torch.Tensor,
    c: torch.Tensor,
    w_ih: torch.Tensor,
    w_hh: torch.Tensor,
    b_ih: torch.Tensor | None,
    b_hh: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One LSTM step on torch._VF.lstm_cell: x (B, I), h and c (B, H), w_ih (4H, I), w_hh
    (4H, H), b_ih and b_hh (4H,) or None -> (hy, cy), each (B, H) in x's dtype."""
    hy, cy = _recurrent.run_cell(_VF.lstm_cell, x, (h, c), w_ih, w_hh, b_ih, b_hh)
    return hy, cy
