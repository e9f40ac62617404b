"""Triton kernels of fastattn, one module per op, and the host-side helpers their launchers
share (below; device functions shared by the kernels are in _common.py). A kernel module
defines launchers; the op layer (fastattn/ops/<op>.py) registers them as torch ops with the
op's contract (fastattn/contracts/<op>.py), and imports them only when triton is installed.

On CPU tensors the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set before
import); there bfloat16 arithmetic is not trustworthy, so kernels upcast right after every
load and launchers let torch round float32 results to bfloat16 (`interpreting()`).
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch

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


# Shared memory a block may opt in to on an H100 (227 KB): what launchers plan for when
# ASSUME_GPU records on a CPU. tests/triton_aot.py lowers it to replay the pruning of an A100
# (163 KB) or an sm_86/89/120 card (99 KB).
ASSUMED_SHARED_MEMORY = 232448


@functools.cache
def _shared_memory_of(index: int) -> int:
    props = torch.cuda.get_device_properties(index)
    optin = getattr(props, "shared_memory_per_block_optin", 0)
    if optin:
        return int(optin)
    from triton.runtime import driver  # older torch: ask the CUDA driver through triton

    return int(driver.active.utils.get_device_properties(index)["max_shared_mem"])


def device_shared_memory(device: torch.device) -> int:
    """Bytes of shared memory one block of a kernel may use on `device` (the opt-in maximum:
    227 KB on an H100, 163 KB on an A100, 99 KB on sm_86/89/120); cached per device."""
    if device.type != "cuda":
        return ASSUMED_SHARED_MEMORY
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _shared_memory_of(index)


# Shared memory left to Triton beyond the tiles that launchers count (layout conversions,
# reduction scratch, barriers). Measured with triton 3.8 for sm_90 (tests/triton_aot.py), a
# kernel took at most 8 KB more than its counted tiles; twice that is kept free.
SHARED_MEMORY_MARGIN = 16 * 1024


def tile_budget(device: torch.device) -> int:
    """Shared memory that the tiles a launcher counts (resident and pipelined) should take on
    `device`: the device's limit less SHARED_MEMORY_MARGIN."""
    return device_shared_memory(device) - SHARED_MEMORY_MARGIN


# A CUDA grid's first axis holds 2**31 - 1 programs, its other two only 65535: launchers fold
# batch and tile indices into the first axis and check it here.
MAX_GRID_X = 2**31 - 1


def grid_x(op: str, what: str, programs: int) -> int:
    """`programs` as a grid's first axis, or a ValueError naming the op and the product of
    sizes (`what`) that exceeds the axis."""
    if programs > MAX_GRID_X:
        raise ValueError(
            f"{op} (triton): {what} = {programs} programs, more than a grid's "
            f"first axis holds (2**31 - 1)"
        )
    return programs


def interpreting(device: torch.device) -> bool:
    """True when kernels for tensors on `device` run under Triton's CPU interpreter."""
    return device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"


def output_buffer(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Where a kernel writes a result of `dtype`: float32 under the interpreter for bfloat16
    (its float32 -> bfloat16 store truncates instead of rounding to nearest)."""
    if dtype == torch.bfloat16 and interpreting(device):
        dtype = torch.float32
    return poison(torch.empty(shape, dtype=dtype, device=device))


def output_buffer_like(x: torch.Tensor) -> torch.Tensor:
    """An output laid out like x (float32 under the interpreter for bfloat16), poisoned in tests."""
    if x.dtype == torch.bfloat16 and interpreting(x.device):
        return poison(torch.empty(x.shape, dtype=torch.float32, device=x.device))
    return poison(torch.empty_like(x))


def finish(buffer: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round an output_buffer to the result dtype (no-op unless it was widened)."""
    return buffer if buffer.dtype == dtype else buffer.to(dtype)


def on_device(t: torch.Tensor):
    """Launch context: the tensor's CUDA device (no-op for CPU tensors under the interpreter)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot's input_precision for inputs of `dtype`: float32 products stay float32 ("ieee")
    as torch's own matmuls do at precision "highest"; 16-bit inputs (whose rounding dwarfs
    tf32's) and relaxed float32 use the tensor cores. The interpreter ignores it."""
    if dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest":
        return "ieee"
    return "tf32"
