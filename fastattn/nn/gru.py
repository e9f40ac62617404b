"""Drop-in GRU modules backed by fastattn.gru / fastattn.gru_cell.

`GRU` has torch.nn.GRU's constructor, parameters (weight_ih_l0, weight_hh_l0, bias_ih_l0,
bias_hh_l0, ..._reverse), state_dict, forward signature and returns, PackedSequence included;
it derives from torch.nn.RNNBase with mode "GRU" as torch.nn.GRU does (not from torch.nn.GRU:
Dynamo refuses instances of torch's RNN classes unless torch._dynamo.config.allow_rnn is set).
`GRUCell` subclasses torch.nn.GRUCell and replaces its forward. Both take one extra keyword,
`reset_after` (default True, torch's and cuDNN's form); reset_after=False runs the textbook
form of Cho et al. 2014 with the same parameters and state_dict.
"""

from __future__ import annotations

import torch
from torch import nn

from ..ops.gru import gru, gru_cell
from ._recurrent import SingleStateRNNBase, cell_inputs


def _reset_after(value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"reset_after must be a bool, got {value!r}")
    return value


class GRU(SingleStateRNNBase):
    """torch.nn.GRU, fused: GRU(input_size, hidden_size, num_layers=1, bias=True,
    batch_first=False, dropout=0.0, bidirectional=False, device=None, dtype=None, *,
    reset_after=True); forward(input, hx=None) with input (T, B, I) / batch-first (B, T, I) /
    unbatched (T, I) or a PackedSequence, hx h_0 (num_layers * D, B, H) or None; returns
    (output, h_n) as torch.nn.GRU (a PackedSequence output for a PackedSequence input, run
    with lengths: no work past any sequence's end)."""

    _name = "GRU"

    def __init__(self, *args, reset_after: bool = True, **kwargs):
        if "proj_size" in kwargs:
            raise ValueError("proj_size argument is only supported for LSTM, not RNN or GRU")
        self.reset_after = _reset_after(reset_after)
        super().__init__("GRU", *args, **kwargs)

    def extra_repr(self) -> str:
        s = super().extra_repr()
        return s if getattr(self, "reset_after", True) else s + ", reset_after=False"

    def _op(self, input, hx, weights, lengths, batch_first):
        return gru(
            input,
            hx,
            weights,
            num_layers=self.num_layers,
            bidirectional=self.bidirectional,
            batch_first=batch_first,
            dropout=self.dropout,
            training=self.training,
            lengths=lengths,
            reset_after=getattr(self, "reset_after", True),
            backend=getattr(self, "fastattn_backend", None),
        )


class GRUCell(nn.GRUCell):
    """torch.nn.GRUCell, fused: GRUCell(input_size, hidden_size, bias=True, device=None,
    dtype=None, *, reset_after=True); forward(input, hx=None) -> h' for input (B, I) or (I,)."""

    def __init__(self, *args, reset_after: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        self.reset_after = _reset_after(reset_after)

    def extra_repr(self) -> str:
        s = super().extra_repr()
        return s if getattr(self, "reset_after", True) else s + ", reset_after=False"

    def forward(self, input: torch.Tensor, hx: torch.Tensor | None = None) -> torch.Tensor:
        x, h, batched = cell_inputs("GRUCell", self, input, hx)
        weights = (self.weight_ih, self.weight_hh, self.bias_ih, self.bias_hh)
        hy = gru_cell(
            x,
            h,
            *weights,
            reset_after=getattr(self, "reset_after", True),
            backend=getattr(self, "fastattn_backend", None),
        )
        return hy if batched else hy.squeeze(0)
