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
    """Drop-in `torch.nn.GRU`, computed by `fastattn.gru`.

    The same constructor, `forward(input, hx=None) -> (output, h_n)`, parameter names and
    state_dict as torch's (see `torch.nn.GRU`); input (T, B, I), batch-first (B, T, I), unbatched
    (T, I) or a PackedSequence (then run with lengths: no work past any sequence's end, and the
    output is a PackedSequence), hx h_0 (num_layers * D, B, H) or None.

    Args:
        *args: `torch.nn.GRU`'s arguments: input_size, hidden_size, num_layers=1, bias=True,
            batch_first=False, dropout=0.0, bidirectional=False, device=None, dtype=None.
        reset_after: True: torch's and cuDNN's GRU; False: the textbook GRU of Cho et al. 2014
            (`fastattn.gru_cell`). Both take the same parameters.
        **kwargs: The same, by keyword.
    """

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
    """Drop-in `torch.nn.GRUCell` (a subclass), computed by `fastattn.gru_cell`.

    Args:
        *args: `torch.nn.GRUCell`'s arguments: input_size, hidden_size, bias=True, device=None,
            dtype=None.
        reset_after: As in `GRU`.
        **kwargs: The same, by keyword.
    """

    def __init__(self, *args, reset_after: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        self.reset_after = _reset_after(reset_after)

    def extra_repr(self) -> str:
        s = super().extra_repr()
        return s if getattr(self, "reset_after", True) else s + ", reset_after=False"

    def forward(self, input: torch.Tensor, hx: torch.Tensor | None = None) -> torch.Tensor:
        """One step, as `torch.nn.GRUCell.forward`.

        Args:
            input: (B, I) or (I,).
            hx: (B, H) or (H,), or None (zeros).

        Returns:
            h_1, (B, H) or (H,).
        """
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
