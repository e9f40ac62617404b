"""Elman RNN: `rnn_cell` and the multi-layer `rnn` (public functions; the shared driver,
checks and registration are in fastattn/ops/_recurrent.py; the op contract of
fastattn::rnn_layer / rnn_layer_backward, with its fake implementations and autograd, is
fastattn/contracts/recurrent.py).

Backends: "cpu" runs the native layer ops (csrc/rnn/rnn_cpu.cpp on the recurrent engine of
csrc/recurrent, generic over the cell), "cuda" their CUDA bodies (csrc/rnn/rnn_cuda.cu on the CUDA
recurrent engine, csrc/recurrent/recurrent_cuda.cu; `cuda_recurrent_path` says which path a layer
takes), "triton" the same ops suffixed _triton (fastattn/triton/rnn.py on the Triton recurrent
engine), "reference" runs fastattn/reference/rnn.py, "torch" torch's own RNN and cells
(fastattn/aten/rnn.py) for the calls they compute as fastattn defines them (not dropout; see
there), chosen automatically only where a speed table measured them faster.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .. import _backend
from ..reference import rnn as ref
from . import _recurrent


def unsupported_backends(dtype: torch.dtype = torch.float32) -> dict[str, str]:
    """Backend -> why it cannot run the RNN ops on `dtype` here; the backends not named can."""
    return _recurrent.unsupported_backends("rnn", dtype)


def cuda_recurrent_path(
    input: torch.Tensor, w_hh: torch.Tensor, *, nonlinearity: str = "tanh", backward: bool = False
) -> str:
    """Which recurrent path the CUDA backend takes for one RNN layer: "persistent" or
    "per_step" (see fastattn.ops.lstm.cuda_recurrent_path). input: (T, B, I) CUDA; w_hh:
    (D, H, H) or (H, H)."""
    _check_nonlinearity("cuda_recurrent_path", nonlinearity)
    return _recurrent.cuda_recurrent_path("rnn", input, w_hh, nonlinearity, backward)


def _check_nonlinearity(op: str, nonlinearity) -> str:
    if nonlinearity not in ("tanh", "relu"):
        raise ValueError(f"{op}: nonlinearity must be 'tanh' or 'relu', got {nonlinearity!r}")
    return nonlinearity


def rnn_cell(
    input: torch.Tensor,
    hx: torch.Tensor | None,
    w_ih: torch.Tensor,
    w_hh: torch.Tensor,
    b_ih: torch.Tensor | None = None,
    b_hh: torch.Tensor | None = None,
    *,
    nonlinearity: str = "tanh",
    backend: str | None = None,
) -> torch.Tensor:
    """One Elman RNN step (`torch.nn.RNNCell`): `hy = act(W_ih x + b_ih + W_hh h + b_hh)`.

    Args:
        input: (B, I), or unbatched (I,).
        hx: (B, H) or (H,), or None (zeros).
        w_ih: (H, I).
        w_hh: (H, H).
        b_ih: (H,) or None (both biases or neither).
        b_hh: (H,) or None.
        nonlinearity: "tanh" or "relu".
        backend: The backend for this call ("cpu", "triton", "cuda", "torch", "reference");
            None chooses automatically.

    Returns:
        hy, shaped like hx.

    Raises:
        ValueError: Shapes, sizes, dtypes or devices that do not fit together (the messages read as
            torch's).
        BackendError: The backend asked for cannot run this call; the message says why.
    """
    op = "rnn_cell"
    _check_nonlinearity(op, nonlinearity)
    return _recurrent.run_cell(
        op,
        "rnn",
        input,
        hx,
        w_ih,
        w_hh,
        b_ih,
        b_hh,
        backend=backend,
        variant=nonlinearity,
        reference_cell=ref.rnn_cell,
    )


def rnn(
    input: torch.Tensor,
    hx: torch.Tensor | None,
    weights: Sequence[torch.Tensor],
    *,
    num_layers: int,
    nonlinearity: str = "tanh",
    bidirectional: bool = False,
    batch_first: bool = False,
    dropout: float = 0.0,
    training: bool = False,
    lengths: torch.Tensor | None = None,
    backend: str | None = None,
):
    """A multi-layer (bidirectional) Elman RNN over whole sequences, fused per layer.

    `h_t = act(W_ih x_t + b_ih + W_hh h_(t-1) + b_hh)`, act tanh or relu, as `torch.nn.RNN`. D
    below is 2 if bidirectional else 1.

    Args:
        input: (T, B, I), (B, T, I) with `batch_first`, or unbatched (T, I).
        hx: h_0 (num_layers * D, B, H) ((num_layers * D, H) unbatched) or None (zeros).
        weights: In `nn.RNN`'s `_flat_weights` order: per layer and direction w_ih (H, I_l),
            w_hh (H, H)[, b_ih (H,), b_hh (H,)]; I_0 = I, then I_l = D * H.
        num_layers: The number of layers.
        nonlinearity: "tanh" or "relu".
        bidirectional: Run a reverse direction too.
        batch_first: The input and output are (B, T, ...).
        dropout: Dropout between layers when training, as in `fastattn.gru`.
        training: Whether dropout applies.
        lengths: (B,) integer sequence lengths of a padded batch, as in `fastattn.gru`.
        backend: The backend for this call ("cpu", "triton", "cuda", "torch", "reference");
            None chooses automatically.

    Returns:
        (output, h_n): output (T, B, D * H) ((B, T, D * H) with `batch_first`, (T, D * H)
        unbatched), h_n (num_layers * D, B, H).

    Raises:
        ValueError: Shapes, sizes, dtypes or devices that do not fit together (the messages read as
            torch's).
        BackendError: The backend asked for cannot run this call; the message says why.
    """
    op = "rnn"
    _check_nonlinearity(op, nonlinearity)
    return _recurrent.run_layers(
        op,
        "rnn",
        input,
        hx,
        weights,
        num_layers=num_layers,
        bidirectional=bidirectional,
        batch_first=batch_first,
        dropout=dropout,
        training=training,
        lengths=lengths,
        backend=backend,
        variant=nonlinearity,
        reference_layer=ref.rnn_layer,
    )


if _recurrent.has_op("rnn_layer"):
    _recurrent.register("rnn", "", ref.rnn_layer, fakes=True)
_recurrent.register_triton("rnn", ref.rnn_layer)
_backend.register_torch_op("rnn")
_backend.register_torch_op("rnn_cell")
