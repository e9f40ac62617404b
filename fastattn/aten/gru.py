"""The torch backend of `fastattn.gru` and `fastattn.gru_cell`: torch._VF.gru (cuDNN on CUDA,
ATen's loop on the CPU) and torch._VF.gru_cell, on the arguments the public ops
(fastattn/ops/gru.py, fastattn/ops/_recurrent.py) have checked and put in canonical form.
torch's GRU is fastattn's reset-after form (reset_after=True): the reset-before (textbook)
form, which torch does not have, is refused; the rest of what is computed as fastattn defines
it, and what is refused, is fastattn/aten/_recurrent.py's docstring.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import _VF

from . import _recurrent

RESET_BEFORE = (
    "reset_after=False (the reset-before, textbook GRU): torch's GRU kernels compute only the "
    "reset-after form"
)


def refusal(
    device: torch.device,
    dtype: torch.dtype,
    *,
    reset_after: bool,
    seq_len: int,
    dropout_p: float,
    lengths: torch.Tensor | None,
) -> str | None:
    """Why torch's GRU cannot compute this `fastattn.gru` call as fastattn defines it, or
    None."""
    if not reset_after:
        return RESET_BEFORE
    return _recurrent.refusal(device, dtype, seq_len=seq_len, dropout_p=dropout_p, lengths=lengths)


def cell_refusal(reset_after: bool) -> str | None:
    """Why torch's GRU cell cannot compute this `fastattn.gru_cell` call, or None."""
    return None if reset_after else RESET_BEFORE


def gru(
    x: torch.Tensor,
    h0: torch.Tensor,
    weights: Sequence[torch.Tensor],
    *,
    has_bias: bool,
    num_layers: int,
    bidirectional: bool,
    lengths: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The multi-layer reset-after GRU on torch's kernel: x (T, B, I) time-major, T > 0; h0
    (num_layers * D, B, H); weights in nn.GRU's _flat_weights order; lengths int64 (B,) on the
    host or None. Returns output (T, B, D * H) and h_n (num_layers * D, B, H) in x's dtype."""
    output, (h_n,) = _recurrent.run_layers(
        _VF.gru,
        x,
        (h0,),
        weights,
        has_bias=has_bias,
        num_layers=num_layers,
        bidirectional=bidirectional,
        lengths=lengths,
    )
    return output, h_n


def gru_cell(
    x: torch.Tensor,
    h: torch.Tensor,
    w_ih: torch.Tensor,
    w_hh: torch.Tensor,
    b_ih: torch.Tensor | None,
    b_hh: torch.Tensor | None,
) -> torch.Tensor:
    """One reset-after GRU step on torch._VF.gru_cell: x (B, I), h (B, H), w_ih (3H, I), w_hh
    (3H, H), b_ih and b_hh (3H,) or None -> hy (B, H) in x's dtype."""
    return _recurrent.run_cell(_VF.gru_cell, x, h, w_ih, w_hh, b_ih, b_hh)
