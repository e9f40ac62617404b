"""pytest plugin: routes the CPU dispatch of the recurrent layer ops (lstm_layer, gru_layer,
rnn_layer and their backward) to the emulated CUDA op bodies and kernels (emu_lstm.h,
csrc/recurrent/recurrent_cuda.cu), so that a test file's CPU-backend tests (autograd, layers,
bidirectional, PackedSequence, lengths, dropout, cells) run the CUDA code on the CPU:

    PYTHONPATH=$(pwd):tools/cuda_emu python -m pytest -p emu_route_recurrent \\
        tests/test_gru_rnn.py -k "cpu and not isa and not opcheck"

FASTATTN_LSTM_CUDA_PATH=per_step in the environment runs the per-step path instead of the
persistent kernel. The emulated device has an H100's 227 KB of shared memory per block but
EMU_SMS (default 8) SMs: every CUDA thread of a cooperative launch is an OS thread here, and
an H100-sized grid (132 blocks x 256 threads) of every layer call would exhaust the machine
(the persistent plan then takes larger unit blocks U).
"""

import os
import sys
from pathlib import Path

import torch

import fastattn  # noqa: F401  (defines the ops)

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools" / "cuda_emu"))
import run_lstm  # noqa: E402  (tools/cuda_emu/run_lstm.py)

ext = run_lstm.build()
ext.set_device(int(os.environ.get("EMU_SMS", "8")), 227 * 1024, 1)
# The emulated ops have the native ops' schemas (csrc/op_schemas.h): arguments pass through.
emulated = torch.ops.fastattn_emu
_lib = torch.library.Library("fastattn", "IMPL")
for _name in (
    "lstm_layer",
    "lstm_layer_backward",
    "gru_layer",
    "gru_layer_backward",
    "rnn_layer",
    "rnn_layer_backward",
):
    _lib.impl(_name, getattr(emulated, _name), "CPU")
print("fastattn recurrent layer CPU ops routed to the CUDA emulator", file=sys.stderr)
