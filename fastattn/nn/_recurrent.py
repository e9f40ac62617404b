"""The forward shared by fastattn.nn.GRU and fastattn.nn.RNN (one hidden state): torch.nn.GRU's
and torch.nn.RNN's own argument handling and errors, PackedSequence in and out, the layers run
by fastattn.gru / fastattn.rnn."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence

from .lstm import _autocast, _pack, _unpack


class SingleStateRNNBase(nn.RNNBase):
    """torch.nn.RNNBase with the forward of torch.nn.GRU / nn.RNN, running `_op(input, hx,
    weights, lengths, batch_first)` (defined by the subclass) on the padded batch."""

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
            input, hx_t, weights = _autocast(
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
            padded, lengths = _unpack(data, batch_sizes)
            output, hidden = self._run(padded, hx, lengths=lengths, batch_first=False)
            return (
                PackedSequence(
                    _pack(output, lengths), batch_sizes, sorted_indices, unsorted_indices
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
