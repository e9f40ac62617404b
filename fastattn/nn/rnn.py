"""Drop-in Elman RNN modules backed by fastattn.rnn / fastattn.rnn_cell.

`RNN` has torch.nn.RNN's constructor (nonlinearity "tanh" or "relu"), parameters, state_dict,
forward signature and returns, PackedSequence included; it derives from torch.nn.RNNBase with
mode "RNN_TANH" / "RNN_RELU" as torch.nn.RNN does (not from torch.nn.RNN, which Dynamo refuses
by default). `RNNCell` subclasses torch.nn.RNNCell and replaces its forward.
"""

from __future__ import annotations

import torch
from torch import nn

from ..ops.rnn import rnn, rnn_cell
from ._recurrent import SingleStateRNNBase, cell_inputs


class RNN(SingleStateRNNBase):
    """Drop-in `torch.nn.RNN`, computed by `fastattn.rnn`.

    The same constructor, `forward(input, hx=None) -> (output, h_n)` (PackedSequence included),
    parameter names and state_dict as torch's (see `torch.nn.RNN`).

    Args:
        *args: `torch.nn.RNN`'s arguments: input_size, hidden_size, num_layers=1,
            nonlinearity="tanh", bias=True, batch_first=False, dropout=0.0, bidirectional=False,
            device=None, dtype=None.
        **kwargs: The same, by keyword.
    """

    _name = "RNN"
    _dims_word = " tensor"

    def __init__(self, *args, **kwargs):  # torch.nn.RNN's argument handling and errors
        if "proj_size" in kwargs:
            raise ValueError("proj_size argument is only supported for LSTM, not RNN or GRU")
        if len(args) > 3:
            self.nonlinearity = args[3]
            args = args[:3] + args[4:]
        else:
            self.nonlinearity = kwargs.pop("nonlinearity", "tanh")
        if self.nonlinearity == "tanh":
            mode = "RNN_TANH"
        elif self.nonlinearity == "relu":
            mode = "RNN_RELU"
        else:
            raise ValueError(
                f"Unknown nonlinearity '{self.nonlinearity}'. Select from 'tanh' or 'relu'."
            )
        super().__init__(mode, *args, **kwargs)

    def _op(self, input, hx, weights, lengths, batch_first):
        return rnn(
            input,
            hx,
            weights,
            num_layers=self.num_layers,
            nonlinearity="relu" if self.mode == "RNN_RELU" else "tanh",
            bidirectional=self.bidirectional,
            batch_first=batch_first,
            dropout=self.dropout,
            training=self.training,
            lengths=lengths,
            backend=getattr(self, "fastattn_backend", None),
        )


class RNNCell(nn.RNNCell):
    """Drop-in `torch.nn.RNNCell` (a subclass), computed by `fastattn.rnn_cell`.

    Args:
        input_size: Features of the input, I.
        hidden_size: Features of the state, H.
        bias: Use b_ih and b_hh.
        nonlinearity: "tanh" or "relu".
        device: The parameters' device.
        dtype: The parameters' dtype.
    """

    def forward(self, input: torch.Tensor, hx: torch.Tensor | None = None) -> torch.Tensor:
        """One step, as `torch.nn.RNNCell.forward`.

        Args:
            input: (B, I) or (I,).
            hx: (B, H) or (H,), or None (zeros).

        Returns:
            h_1, (B, H) or (H,).
        """
        x, h, batched = cell_inputs("RNNCell", self, input, hx)
        if self.nonlinearity not in ("tanh", "relu"):  # torch.nn.RNNCell's error
            raise RuntimeError(f"Unknown nonlinearity: {self.nonlinearity}")
        hy = rnn_cell(
            x,
            h,
            self.weight_ih,
            self.weight_hh,
            self.bias_ih,
            self.bias_hh,
            nonlinearity=self.nonlinearity,
            backend=getattr(self, "fastattn_backend", None),
        )
        return hy if batched else hy.squeeze(0)
