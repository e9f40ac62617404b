"""Drop-in LSTM modules backed by fastattn.lstm / fastattn.lstm_cell.

`LSTM` has torch.nn.LSTM's constructor, parameters (weight_ih_l0, weight_hh_l0, bias_ih_l0,
bias_hh_l0, weight_hr_l0 with proj_size, ..._reverse), state_dict, forward signature and
returns, PackedSequence included. It derives from torch.nn.RNNBase with mode "LSTM", as
torch.nn.LSTM does, but not from torch.nn.LSTM: Dynamo refuses to trace any instance of
torch.nn.LSTM (or of a subclass) unless torch._dynamo.config.allow_rnn is set, and a model
using fastattn.nn.LSTM must compile with torch.compile(fullgraph=True) as it is. The shape
checks and error messages are torch.nn.LSTM's own (its methods are reused below).

`LSTMCell` subclasses torch.nn.LSTMCell and only replaces its forward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence

from ..ops.lstm import lstm, lstm_cell
from ._recurrent import autocast_inputs, pack_output, unpack_sequence


class LSTM(nn.RNNBase):
    """Drop-in `torch.nn.LSTM`, computed by `fastattn.lstm`.

    The same constructor, forward, returns, parameter names and state_dict as torch's (see
    `torch.nn.LSTM`). A PackedSequence input is unpacked to a padded batch and its lengths, run
    with `fastattn.lstm(lengths=...)` (no work past any sequence's end) and packed again with the
    input's batch_sizes, sorted_indices and unsorted_indices. It derives from
    `torch.nn.RNNBase`, not from `torch.nn.LSTM`, so that `torch.compile(fullgraph=True)` traces
    models that use it.

    Args:
        *args: `torch.nn.LSTM`'s arguments: input_size, hidden_size, num_layers=1, bias=True,
            batch_first=False, dropout=0.0, bidirectional=False, proj_size=0, device=None,
            dtype=None.
        **kwargs: The same, by keyword.
    """

    # torch.nn.LSTM's own checks and hidden-state permutation (they only read the attributes
    # RNNBase defines), so errors read exactly as torch's.
    get_expected_cell_size = nn.LSTM.get_expected_cell_size
    # (Any: torch's stubs type them for nn.LSTM's self and narrow RNNBase's signatures.)
    check_forward_args: Any = nn.LSTM.check_forward_args
    permute_hidden: Any = nn.LSTM.permute_hidden

    def __init__(self, *args, **kwargs):
        super().__init__("LSTM", *args, **kwargs)

    def _weights(self) -> list[torch.Tensor]:
        # Read by name on every call (not the cached _flat_weights), so parameters replaced
        # after construction (functional_call, swapping) are the ones used.
        return [getattr(self, name) for name in self._flat_weights_names]

    def _zeros(self, batch: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        layers = self.num_layers * (2 if self.bidirectional else 1)
        real_hidden = self.proj_size if self.proj_size > 0 else self.hidden_size
        kw: dict[str, Any] = dict(dtype=like.dtype, device=like.device)
        return (
            torch.zeros(layers, batch, real_hidden, **kw),
            torch.zeros(layers, batch, self.hidden_size, **kw),
        )

    def _check_devices(self, input, hx) -> None:
        # torch.nn.LSTM's (ATen's) errors for mixed devices
        for w in self._weights():
            if w.device != input.device:
                raise RuntimeError(
                    "Input and parameter tensors are not at the same device, found "
                    f"input tensor at {input.device} and parameter tensor at "
                    f"{w.device}"
                )
        for h in hx or ():
            if h.device != input.device:
                raise RuntimeError(
                    "Input and hidden tensors are not at the same device, found "
                    f"input tensor at {input.device} and hidden tensor at "
                    f"{h.device}"
                )

    def _run(self, input, hx, lengths=None, batch_first=None):
        self._check_devices(input, hx)
        weights = self._weights()
        device_type = input.device.type
        packed_on_cpu = lengths is not None and device_type == "cpu"
        if (
            device_type in ("cpu", "cuda")
            and torch.is_autocast_enabled(device_type)
            and not packed_on_cpu
        ):
            # torch.nn.LSTM runs in the autocast dtype where torch casts: CPU autocast lists
            # aten::lstm's padded overload (not the packed one), cuDNN's RNN casts on CUDA.
            input, hx, weights = autocast_inputs(device_type, input, hx, weights)
        return lstm(
            input,
            hx,
            weights,
            num_layers=self.num_layers,
            bidirectional=self.bidirectional,
            batch_first=self.batch_first if batch_first is None else batch_first,
            dropout=self.dropout,
            training=self.training,
            proj_size=self.proj_size,
            lengths=lengths,
        )

    def forward(self, input, hx=None):  # noqa: C901 (mirrors torch.nn.LSTM.forward)
        """Run the layers over whole sequences, as `torch.nn.LSTM.forward`.

        Args:
            input: (T, B, I), (B, T, I) with batch_first, unbatched (T, I), or a PackedSequence.
            hx: (h_0, c_0) or None (zeros).

        Returns:
            (output, (h_n, c_n)); output is a PackedSequence when the input is one.
        """
        if isinstance(input, PackedSequence):
            data, batch_sizes, sorted_indices, unsorted_indices = input
            if hx is None:
                hx = self._zeros(int(batch_sizes[0]), data)
            else:
                hx = self.permute_hidden(hx, sorted_indices)
            self.check_forward_args(data, hx, batch_sizes)
            # Padded (T, B, I) in sorted order (longest first) and the sorted lengths.
            padded, lengths = unpack_sequence(data, batch_sizes)
            output, hidden = self._run(padded, hx, lengths=lengths, batch_first=False)
            packed = pack_output(output, lengths)
            return (
                PackedSequence(packed, batch_sizes, sorted_indices, unsorted_indices),
                self.permute_hidden(hidden, unsorted_indices),
            )

        if input.dim() not in (2, 3):
            raise ValueError(f"LSTM: Expected input to be 2D or 3D, got {input.dim()}D instead")
        is_batched = input.dim() == 3
        batch_dim = 0 if self.batch_first else 1
        checked = input if is_batched else input.unsqueeze(batch_dim)
        if hx is None:  # fastattn.lstm starts from zeros
            self.check_forward_args(checked, self._zeros(checked.size(batch_dim), checked), None)
        else:
            if is_batched:
                if hx[0].dim() != 3 or hx[1].dim() != 3:
                    raise RuntimeError(
                        "For batched 3-D input, hx and cx should also be 3-D but "
                        f"got ({hx[0].dim()}-D, {hx[1].dim()}-D) tensors"
                    )
            else:
                if hx[0].dim() != 2 or hx[1].dim() != 2:
                    raise RuntimeError(
                        "For unbatched 2-D input, hx and cx should also be 2-D "
                        f"but got ({hx[0].dim()}-D, {hx[1].dim()}-D) tensors"
                    )
            self.check_forward_args(
                checked, hx if is_batched else (hx[0].unsqueeze(1), hx[1].unsqueeze(1)), None
            )
        if checked.size(1 if self.batch_first else 0) == 0:  # ATen's rule, torch's words
            raise RuntimeError("Expected sequence length to be larger than 0 in RNN")
        return self._run(input, hx)


class LSTMCell(nn.LSTMCell):
    """Drop-in `torch.nn.LSTMCell` (a subclass), computed by `fastattn.lstm_cell`.

    Args:
        input_size: Features of the input, I.
        hidden_size: Features of the state, H.
        bias: Use b_ih and b_hh.
        device: The parameters' device.
        dtype: The parameters' dtype.
    """

    def forward(
        self, input: torch.Tensor, hx: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One step, as `torch.nn.LSTMCell.forward`.

        Args:
            input: (B, I) or (I,).
            hx: (h_0, c_0), each (B, H) or (H,), or None (zeros).

        Returns:
            (h_1, c_1), each (B, H) or (H,).
        """
        if input.dim() not in (1, 2):
            raise ValueError(f"LSTMCell: Expected input to be 1D or 2D, got {input.dim()}D instead")
        if hx is not None:
            for idx, value in enumerate(hx):
                if value.dim() not in (1, 2):
                    raise ValueError(
                        f"LSTMCell: Expected hx[{idx}] to be 1D or 2D, got {value.dim()}D instead"
                    )
        is_batched = input.dim() == 2
        x = input if is_batched else input.unsqueeze(0)
        if hx is None:
            zeros = torch.zeros(x.size(0), self.hidden_size, dtype=x.dtype, device=x.device)
            hx = (zeros, zeros)
        elif not is_batched:
            hx = (hx[0].unsqueeze(0), hx[1].unsqueeze(0))
        # ATen's checks of torch.nn.LSTMCell (RuntimeError, the same wording).
        if x.size(1) != self.input_size:
            raise RuntimeError(
                f"input has inconsistent input_size: got {x.size(1)} expected {self.input_size}"
            )
        for label, t in (("0", hx[0]), ("1", hx[1])):
            if t.size(0) != x.size(0):
                raise RuntimeError(
                    f"Input batch size {x.size(0)} doesn't match hidden{label} "
                    f"batch size {t.size(0)}"
                )
            if t.size(1) != self.hidden_size:
                raise RuntimeError(
                    f"hidden{label} has inconsistent hidden_size: got "
                    f"{t.size(1)}, expected {self.hidden_size}"
                )
        weights = (self.weight_ih, self.weight_hh, self.bias_ih, self.bias_hh)
        if x.device.type == "cuda" and torch.is_autocast_enabled("cuda"):
            # aten::lstm_cell is on CUDA autocast's lower-precision list (not on CPU's)
            x, hx, weights = autocast_inputs("cuda", x, hx, weights)
        hy, cy = lstm_cell(x, hx[0], hx[1], *weights)
        return (hy, cy) if is_batched else (hy.squeeze(0), cy.squeeze(0))
