"""Triton kernels of fastattn, one module per op. Imported only when triton is installed.

On CPU tensors the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set before
import); there bfloat16 arithmetic is not trustworthy, so kernels upcast right after every
load and launchers let torch round float32 results to bfloat16 (`interpreting()`).
"""
from __future__ import annotations

import os

import torch
from torch.library import triton_op

from .._debug import poison


# Set by tests/triton_aot.py, which runs the launchers on CPU tensors with kernel launches
# intercepted, to record (and compile for sm_90) what they would launch on a GPU.
ASSUME_GPU = False


def on_gpu(device: torch.device) -> bool:
    """True when launchers should pick their GPU launch shapes (tiles, splits) for `device`."""
    return device.type == "cuda" or ASSUME_GPU


def device_sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of `device` (an H100's 132 when ASSUME_GPU records on a CPU)."""
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def interpreting(device: torch.device) -> bool:
    """True when kernels for tensors on `device` run under Triton's CPU interpreter."""
    return device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"


def output_buffer(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Where a kernel writes a result of `dtype`: float32 under the interpreter for bfloat16
    (its float32 -> bfloat16 store truncates instead of rounding to nearest)."""
    if dtype == torch.bfloat16 and interpreting(device):
        dtype = torch.float32
    return poison(torch.empty(shape, dtype=dtype, device=device))


def output_like(x: torch.Tensor) -> torch.Tensor:
    """An output laid out like x (float32 under the interpreter for bfloat16), poisoned in tests."""
    if x.dtype == torch.bfloat16 and interpreting(x.device):
        return poison(torch.empty(x.shape, dtype=torch.float32, device=x.device))
    return poison(torch.empty_like(x))


def finish(buffer: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round an output_buffer to the result dtype (no-op unless it was widened)."""
    return buffer if buffer.dtype == dtype else buffer.to(dtype)


def register_op(name: str, fake, mutates_args: tuple[str, ...] = ()):
    """Decorator registering a launcher as the torch op `name` (a native op's schema, suffixed
    _triton). On a GPU it is a triton_op: torch.compile sees the kernels, and the fake
    implementation is the launcher itself traced with fake tensors. Under TRITON_INTERPRET=1,
    wrap_triton hands back the interpreted kernel, which would run on fake tensors while
    tracing; there the op is an opaque custom op with the explicit `fake`, so opcheck and
    torch.compile work on CPU too."""
    def decorate(fn):
        if os.environ.get("TRITON_INTERPRET") == "1":
            op = torch.library.custom_op(name, mutates_args=mutates_args)(fn)
            op.register_fake(fake)
            return op
        return triton_op(name, mutates_args=mutates_args)(fn)
    return decorate
