"""The torch backend of `fastattn.rnn` and `fastattn.rnn_cell`: torch._VF.rnn_tanh /
rnn_relu (cuDNN on CUDA, ATen's loop on the CPU) and their cells, on the arguments the public
ops (fastattn/ops/rnn.py, fastattn/ops/_recurrent.py) have checked and put in canonical form.
Both nonlinearities are torch's; what is computed as fastattn defines it, and what is
refused, is fastattn/aten/_recurrent.py's docstring.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import _VF

from . import _recurrent

_LAYERS = {"tanh": _VF.rnn_tanh, "relu": _VF.rnn_relu}
_CELLS = {"tanh": _VF.rnn_tanh_cell, "relu": _VF.rnn_relu_cell}


def refusal(
    device: torch.device,
    dtype: torch.dtype,
    *,
    seq_len: int,
    dropout_p: float,
    lengths: torch.Tensor | None,
) -> str | None:
    """Why torch's Elman RNN cannot compute this `fastattn.rnn` call as fastattn defines it,
    or None."""
    return _recurrent.refusal(device, dtype, seq_len=seq_len, dropout_p=dropout_p, lengths=lengths)


def rnn(
    x: torch.Tensor,
    h0: torch.Tensor,
    weights: Sequence[torch.Tensor],
    *,
    nonlinearity: str,
    has_bias: bool,
    num_layers: int,
    bidirectional: bool,
    lengths: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The multi-layer Elman RNN on torch's kernel: x (T, B, I) time-major, T > 0; h0
    (num_layers * D, B, H); weights in nn.RNN's _flat_weights order; nonlinearity "tanh" or
    "relu"; lengths int64 (B,) on the host or None. Returns output (T, B, D * H) and h_n
    (num_layers * D, B, H) in x's dtype."""
    output, (h_n,) = _recurrent.run_layers(
        _LAYERS[nonlinearity],
        x,
        (h0,),
        weights,
        has_bias=has_bias,
        num_layers=num_layers,
        bidirectional=bidirectional,
        lengths=lengths,
    )
    return output, h_n


def rnn_cell(
    x: torch.Tensor,
    h: torch.Tensor,
    w_ih: torch.Tensor,
    w_hh: torch.Tensor,
    b_ih: torch.Tensor | None,
    b_hh: torch.Tensor | None,
    *,
    nonlinearity: str,
) -> torch.Tensor:
    """One Elman RNN step on torch's cell: x (B, I), h (B, H), w_ih (H, I), w_hh (H, H), b_ih
    and b_hh (H,) or None -> hy (B, H) in x's dtype."""
    return _recurrent.run_cell(_CELLS[nonlinearity], x, h, w_ih, w_hh, b_ih, b_hh)
