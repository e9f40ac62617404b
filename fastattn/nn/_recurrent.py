"""The forward shared by fastattn.nn.GRU and fastattn.nn.RNN (one hidden state): torch.nn.GRU's
and torch.nn.RNN's own argument handling and errors, PackedSequence in and out, the layers run
by fastattn.gru / fastattn.rnn; and the helpers every recurrent module shares (fastattn.nn's
LSTM, GRU, RNN and their cells): autocast, PackedSequence unpacking and packing, the cells'
input checks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence


class SingleStateRNNBase(nn.RNNBase):
    """torch.nn.RNNBase with the forward of torch.nn.GRU / nn.RNN, running `_op(input, hx,
    weights, lengths, batch_first)` (defined by the subclass) on the padded batch."""

    _op: Callable[..., Any]  # the subclass's method
    _name = "RNN"
    _dims_word = ""  # torch.nn.RNN says "got 1D tensor instead", torch.nn.GRU "got 1D instead"

    def _weights(self) -> list[torch.Tensor]:
        # Read by name on every call (not the cached _flat_weights): parameters replaced after
        # construction (functional_call, swapping) are the ones used.
        return [getattr(self, name) for name in self._flat_weights_names]

    def _zeros(self, batch: int, like: torch.Tensor) -> torch.Tensor:
        layers = self.num_layers * (2 if self.bidirectional else 1)
        return torch.zeros(layers, batch, self.hidden_size, dtype=like.dtype, device=like.device)

    def _run(self, input, hx, lengths=None, batch_first=None):
        weights = self._weights()
        for w in weights:  # ATen's error for mixed devices
            if w.device != input.device:
                raise RuntimeError(
                    "Input and parameter tensors are not at the same device, found "
                    f"input tensor at {input.device} and parameter tensor at "
                    f"{w.device}"
                )
        if hx is not None and hx.device != input.device:
            raise RuntimeError(
                "Input and hidden tensors are not at the same device, found input "
                f"tensor at {input.device} and hidden tensor at {hx.device}"
            )
        device_type = input.device.type
        if (
            device_type in ("cpu", "cuda")
            and torch.is_autocast_enabled(device_type)
            and not (lengths is not None and device_type == "cpu")
        ):
            input, hx_t, weights = autocast_inputs(
                device_type, input, None if hx is None else (hx,), weights
            )
            hx = None if hx_t is None else hx_t[0]
        return self._op(
            input, hx, weights, lengths, self.batch_first if batch_first is None else batch_first
        )

    def forward(self, input, hx=None):  # mirrors torch.nn.GRU.forward / nn.RNN.forward
        if isinstance(input, PackedSequence):
            data, batch_sizes, sorted_indices, unsorted_indices = input
            if hx is None:
                hx = self._zeros(int(batch_sizes[0]), data)
            else:
                hx = self.permute_hidden(hx, sorted_indices)
            self.check_forward_args(data, hx, batch_sizes)
            padded, lengths = unpack_sequence(data, batch_sizes)
            output, hidden = self._run(padded, hx, lengths=lengths, batch_first=False)
            return (
                PackedSequence(
                    pack_output(output, lengths), batch_sizes, sorted_indices, unsorted_indices
                ),
                self.permute_hidden(hidden, unsorted_indices),
            )

        if input.dim() not in (2, 3):
            raise ValueError(
                f"{self._name}: Expected input to be 2D or 3D, got {input.dim()}D"
                f"{self._dims_word} instead"
            )
        is_batched = input.dim() == 3
        batch_dim = 0 if self.batch_first else 1
        checked = input if is_batched else input.unsqueeze(batch_dim)
        if hx is not None:
            if not is_batched and hx.dim() != 2:
                raise RuntimeError(
                    f"For unbatched 2-D input, hx should also be 2-D but got {hx.dim()}-D tensor"
                )
            if is_batched and hx.dim() != 3:
                raise RuntimeError(
                    f"For batched 3-D input, hx should also be 3-D but got {hx.dim()}-D tensor"
                )
        checked_hx = (
            self._zeros(checked.size(batch_dim), checked)
            if hx is None
            else hx
            if is_batched
            else hx.unsqueeze(1)
        )
        self.check_forward_args(checked, checked_hx, None)
        if checked.size(1 if self.batch_first else 0) == 0:  # ATen's rule, torch's words
            raise RuntimeError("Expected sequence length to be larger than 0 in RNN")
        return self._run(input, hx)


def autocast_inputs(device_type, input, hx, weights):
    """input, hx and weights in the autocast dtype of `device_type` (floating tensors only)."""
    dtype = torch.get_autocast_dtype(device_type)

    def cast(t):
        return t.to(dtype) if t is not None and t.is_floating_point() else t

    return (
        cast(input),
        None if hx is None else tuple(cast(h) for h in hx),
        [cast(w) for w in weights],
    )


# torch's packing reads batch sizes and lengths on the host: under torch.compile it runs
# eagerly between graphs. Said explicitly, since torch 2.11's Dynamo traced
# _pad_packed_sequence into fake tensors and failed.
@torch.compiler.disable
def unpack_sequence(data, batch_sizes):
    return pad_packed_sequence(PackedSequence(data, batch_sizes))


@torch.compiler.disable
def pack_output(output, lengths):
    return pack_padded_sequence(output, lengths, enforce_sorted=True).data


def cell_inputs(name: str, cell: nn.RNNCellBase, input, hx):
    """torch.nn.GRUCell's / RNNCell's checks (its errors): (x (B, I), h (B, H), batched)."""
    if input.dim() not in (1, 2):
        raise ValueError(f"{name}: Expected input to be 1D or 2D, got {input.dim()}D instead")
    if hx is not None and hx.dim() not in (1, 2):
        raise ValueError(f"{name}: Expected hidden to be 1D or 2D, got {hx.dim()}D instead")
    batched = input.dim() == 2
    x = input if batched else input.unsqueeze(0)
    if hx is None:
        h = torch.zeros(x.size(0), cell.hidden_size, dtype=x.dtype, device=x.device)
    else:
        h = hx if batched else hx.unsqueeze(0)
    if x.size(1) != cell.input_size:
        raise RuntimeError(
            f"input has inconsistent input_size: got {x.size(1)} expected {cell.input_size}"
        )
    if h.size(0) != x.size(0):
        raise RuntimeError(
            f"Input batch size {x.size(0)} doesn't match hidden0 batch size {h.size(0)}"
        )
    if h.size(1) != cell.hidden_size:
        raise RuntimeError(
            f"hidden0 has inconsistent hidden_size: got {h.size(1)}, expected {cell.hidden_size}"
        )
    return x, h, batched
