"""pytest plugin: routes the CPU dispatch of varlen_attention_forward/backward and
attention_decode to the emulated CUDA kernels (cuda_emu.h), so that a test file's CPU-backend
tests run the CUDA code paths on the CPU:

    PYTHONPATH=$(pwd):tools/cuda_emu python -m pytest -p emu_route tests/test_varlen_attention.py -k cpu
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
SMEM = run.H100_SMEM
_lib = torch.library.Library("fastattn", "IMPL")
_lib.impl("varlen_attention_forward", lambda *a: ext.varlen_forward(*a, SMEM), "CPU")
_lib.impl("varlen_attention_backward", lambda *a: ext.varlen_backward(*a[:-1], SMEM), "CPU")
_lib.impl("attention_decode", lambda *a: ext.decode(*a, 132, SMEM), "CPU")
print("fastattn varlen/decode CPU ops routed to the CUDA emulator", file=sys.stderr)
