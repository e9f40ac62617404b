"""pytest plugin: routes the CPU dispatch of attention_forward/backward,
varlen_attention_forward/backward and attention_decode to the emulated CUDA kernels
(cuda_emu.h), so that a test file's CPU-backend tests run the CUDA code paths on the CPU:

    PYTHONPATH=$(pwd):tools/cuda_emu python -m pytest -p emu_route \\
        tests/test_varlen_attention.py -k cpu
"""

import sys
from pathlib import Path

import torch

import fastattn  # noqa: F401  (defines the ops)

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools" / "cuda_emu"))
import run  # noqa: E402  (tools/cuda_emu/run.py)

ext = run.build()
ext.set_poison(True)
ext.set_device(run.H100_SMEM, 132)
# The emulated ops have the native ops' schemas (csrc/op_schemas.h): arguments pass through.
emulated = getattr(torch.ops, run.EMU_LIBRARY)
_lib = torch.library.Library("fastattn", "IMPL")
_ROUTED = (
    "attention_forward",
    "attention_backward",
    "varlen_attention_forward",
    "varlen_attention_backward",
    "attention_decode",
)
for _name in _ROUTED:
    _lib.impl(_name, getattr(emulated, _name), "CPU")
print("fastattn attention CPU ops routed to the CUDA emulator", file=sys.stderr)
