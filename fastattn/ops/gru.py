"""GRU: `gru_cell` and the multi-layer `gru` (public functions; the shared driver, checks and
registration are in fastattn/ops/_recurrent.py; the op contract of fastattn::gru_layer /
gru_layer_backward, with its fake implementations and autograd, is
fastattn/contracts/recurrent.py).

Backends: "cpu" runs the native layer ops (csrc/gru/gru_cpu.cpp on the recurrent engine of
csrc/recurrent, generic over the cell), "cuda" the same ops' CUDA bodies (csrc/gru/gru_cuda.cu on
the CUDA recurrent engine, csrc/recurrent/recurrent_cuda.cu: persistent cooperative kernel or
per-step fallback, generic over the cell; `cuda_recurrent_path` says which path a layer takes),
"triton" the same ops suffixed _triton (fastattn/triton/gru.py on the Triton recurrent engine,
generic over the cell), "reference" runs fastattn/reference/gru.py under torch autograd. A backend
without GRU kernels is reported by `unsupported_backends` and refused with its reason when asked
for explicitly. `gru_cell` runs the layer op with T = 1. "torch" runs torch's own GRU and GRU cell
(fastattn/aten/gru.py) for the calls they compute as fastattn defines them (not the reset-before
form, not dropout; see there); the automatic choice takes it only where a speed table measured it
faster.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .. import _backend
from ..reference import gru as ref
from . import _recurrent


def unsupported_backends(dtype: torch.dtype = torch.float32) -> dict[str, str]:
    """Backend -> why it cannot run the GRU ops on `dtype` here; the backends not named can."""
    return _recurrent.unsupported_backends("gru", dtype)


def cuda_recurrent_path(
    input: torch.Tensor, w_hh: torch.Tensor, *, reset_after: bool = True, backward: bool = False
) -> str:
    """Which recurrent path the CUDA backend takes for one GRU layer: "persistent" or
    "per_step" (see fastattn.ops.lstm.cuda_recurrent_path; the reset-before form runs two
    phases per step on either path). input: (T, B, I) CUDA; w_hh: (D, 3H, H) or (3H, H)."""
    return _recurrent.cuda_recurrent_path("gru", input, w_hh, reset_after, backward)


def _check_reset_after(op: str, reset_after) -> bool:
    if not isinstance(reset_after, bool):
        raise TypeError(f"{op}: reset_after must be a bool, got {reset_after!r}")
    return reset_after


def gru_cell(
    input: torch.Tensor,
    hx: torch.Tensor | None,
    w_ih: torch.Tensor,
    w_hh: torch.Tensor,
    b_ih: torch.Tensor | None = None,
    b_hh: torch.Tensor | None = None,
    *,
    reset_after: bool = True,
    backend: str | None = None,
) -> torch.Tensor:
    """One GRU step (`torch.nn.GRUCell`'s math and gate order r, z, n).

    `r = sigmoid(W_ir x + b_ir + W_hr h + b_hr)`, `z = sigmoid(W_iz x + b_iz + W_hz h + b_hz)`,
    `n = tanh(W_in x + b_in + r * (W_hn h + b_hn))` with `reset_after=True` (torch, cuDNN) or
    `n = tanh(W_in x + b_in + W_hn (r * h) + b_hn)` with `reset_after=False` (Cho et al. 2014),
    and `hy = (1 - z) * n + z * h`.

    Args:
        input: (B, I), or unbatched (I,).
        hx: (B, H) or (H,), or None (zeros).
        w_ih: (3H, I).
        w_hh: (3H, H).
        b_ih: (3H,) or None (both biases or neither).
        b_hh: (3H,) or None.
        reset_after: Where the reset gate applies (above).
        backend: The backend for this call ("cpu", "triton", "cuda", "torch", "reference");
            None chooses automatically.

    Returns:
        hy, shaped like hx.

    Raises:
        ValueError: Shapes, sizes, dtypes or devices that do not fit together (the messages read as
            torch's).
        BackendError: The backend asked for cannot run this call; the message says why.
    """
    op = "gru_cell"
    _check_reset_after(op, reset_after)
    return _recurrent.run_cell(
        op,
        "gru",
        input,
        hx,
        w_ih,
        w_hh,
        b_ih,
        b_hh,
        backend=backend,
        variant=reset_after,
        reference_cell=ref.gru_cell,
    )


def gru(
    input: torch.Tensor,
    hx: torch.Tensor | None,
    weights: Sequence[torch.Tensor],
    *,
    num_layers: int,
    bidirectional: bool = False,
    batch_first: bool = False,
    dropout: float = 0.0,
    training: bool = False,
    lengths: torch.Tensor | None = None,
    reset_after: bool = True,
    backend: str | None = None,
):
    """A multi-layer (bidirectional) GRU over whole sequences, fused per layer.

    Computes what `torch.nn.GRU` computes, with its weights (or, with `reset_after=False`, the
    textbook GRU of `gru_cell`). D below is 2 if bidirectional else 1.

    Args:
        input: (T, B, I), (B, T, I) with `batch_first`, or unbatched (T, I).
        hx: h_0 (num_layers * D, B, H) ((num_layers * D, H) unbatched) or None (zeros).
        weights: In `nn.GRU`'s `_flat_weights` order: per layer and direction w_ih (3H, I_l),
            w_hh (3H, H)[, b_ih (3H,), b_hh (3H,)]; I_0 = I, then I_l = D * H.
        num_layers: The number of layers.
        bidirectional: Run a reverse direction too.
        batch_first: The input and output are (B, T, ...).
        dropout: Dropout on the outputs of every layer but the last, when training (fastattn's
            Philox stream: reproducible under `torch.manual_seed`, the same on every backend).
        training: Whether dropout applies.
        lengths: (B,) integer sequence lengths in [0, T] of a padded batch: no work past a
            sequence's end, h_n at each sequence's last step, outputs past the end 0.
        reset_after: True for torch's and cuDNN's GRU, False for the textbook form (`gru_cell`).
        backend: The backend for this call ("cpu", "triton", "cuda", "torch", "reference");
            None chooses automatically.

    Returns:
        (output, h_n) as `torch.nn.GRU`: output (T, B, D * H) ((B, T, D * H) with `batch_first`,
        (T, D * H) unbatched), h_n (num_layers * D, B, H).

    Raises:
        ValueError: Shapes, sizes, dtypes or devices that do not fit together (the messages read as
            torch's).
        BackendError: The backend asked for cannot run this call; the message says why.
    """
    op = "gru"
    _check_reset_after(op, reset_after)
    return _recurrent.run_layers(
        op,
        "gru",
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
        variant=reset_after,
        reference_layer=ref.gru_layer,
    )


if _recurrent.has_op("gru_layer"):
    _recurrent.register("gru", "", ref.gru_layer, fakes=True)
_recurrent.register_triton("gru", ref.gru_layer)
_backend.register_torch_op("gru")
_backend.register_torch_op("gru_cell")
