"""Elman RNN benchmarks: fastattn's fused RNN (the CPU recurrent engine shared with the LSTM
and the GRU) against torch.nn.RNN: T=100, I=H=512, B = 1, 8 and 64, tanh (and relu in the full
profile), inference and forward+backward, and on the CPU bfloat16 at B = 8 and 64 (see
bench_gru.py for the conventions)."""

from __future__ import annotations

import torch
from bench_gru import recurrent_case
from common import Case


def cases(profile: str, device: torch.device) -> list[Case]:
    kinds = ("rnn_tanh", "rnn_relu") if profile == "full" else ("rnn_tanh",)
    grid = [(torch.float32, B) for B in (1, 8, 64)]
    if device.type == "cpu":
        grid += [(torch.bfloat16, B) for B in (8, 64)]
    return [
        recurrent_case(kind, 100, B, 512, 512, device, backward=backward, dtype=dtype)
        for kind in kinds
        for backward in (False, True)
        for dtype, B in grid
    ]
