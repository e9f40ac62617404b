"""Helpers shared by the public ops: argument checks with clear messages, dropout seeds, and
the registration of every backend's kernels as torch ops (the op layer registers; the kernel
modules only define launchers)."""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from types import ModuleType

import torch

from .. import _backend

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def check_tensor(
    op: str,
    name: str,
    t,
    *,
    dims: int | tuple[int, ...] | None = None,
    float_dtype: bool = False,
    int_dtype: bool = False,
) -> None:
    """Raise TypeError/ValueError naming `op` and argument `name` when t breaks a rule."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if float_dtype and t.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{op}: {name} must be float32, float16, bfloat16 or float64, got {t.dtype}"
        )
    if int_dtype and (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool):
        raise TypeError(f"{op}: {name} must be an integer tensor (int64 or int32), got {t.dtype}")
    if dims is not None:
        allowed = (dims,) if isinstance(dims, int) else dims
        if t.dim() not in allowed:
            want = " or ".join(f"{d}-D" for d in allowed)
            raise ValueError(f"{op}: {name} must be {want}, got shape {tuple(t.shape)}")


def check_same_device(
    op: str, reference_name: str, reference: torch.Tensor, **others: torch.Tensor | None
) -> None:
    for name, t in others.items():
        if t is not None and t.device != reference.device:
            raise ValueError(
                f"{op}: {name} must be on the same device as {reference_name} "
                f"({reference.device}), got {t.device}"
            )


def check_unit_last_stride(op: str, name: str, t: torch.Tensor) -> None:
    if t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(
            f"{op}: {name} must have a unit stride in its last dimension, got "
            f"strides {t.stride()} (call .contiguous() first)"
        )


def check_dropout(op: str, p) -> float:
    if not isinstance(p, (int, float)) or not 0.0 <= float(p) < 1.0:
        raise ValueError(f"{op}: dropout_p must be a float in [0, 1), got {p!r}")
    return float(p)


def dropout_seed(p: float, device: torch.device) -> torch.Tensor | None:
    """Per-call (seed, stream) int64 (2,) on `device`, drawn from torch's generator of that
    device, so torch.manual_seed makes dropout reproducible; None when p == 0."""
    if p <= 0.0:
        return None
    return torch.randint(0, 2**62, (2,), dtype=torch.int64, device=device)


def host_checks_enabled(t: torch.Tensor | None = None) -> bool:
    """Whether a check may read the values of `t` on the host (`.item()`, `.tolist()`).

    Yes for CPU tensors in eager mode (no synchronisation, clear Python errors). No for CUDA
    tensors: a host read stalls the stream on every call and cannot be captured in a CUDA
    graph, so their values are checked on the device instead (`device_check`, or the native
    kernels' own checks). FASTATTN_HOST_CHECKS=1 (read per call) restores the eager host checks
    for every device, a debugging aid. Never while torch.compile traces (the native kernels
    still check, and `device_check` traces). `t` None asks about CPU tensors.
    """
    if torch.compiler.is_compiling():
        return False
    if t is None or t.device.type == "cpu":
        return True
    return os.environ.get("FASTATTN_HOST_CHECKS") == "1"


def device_checks_enabled(t: torch.Tensor) -> bool:
    """Whether the values of `t` are checked with `device_check` (asynchronously on its
    device): a tensor that is not on the CPU and not checked on the host."""
    return t.device.type != "cpu" and not host_checks_enabled(t)


def device_check(op: str, ok: torch.Tensor, message: str) -> None:
    """Asynchronous check of a one-element bool tensor computed on the device: no host read,
    capturable in a CUDA graph, traced by torch.compile. A false value fails as a device-side
    assert: on CUDA the message is torch's _assert_async's, the context is left in error (later
    CUDA calls raise) and the kernels queued after it on the stream do not run. Rerun with
    FASTATTN_HOST_CHECKS=1 (and CUDA_LAUNCH_BLOCKING=1) for the Python error naming the value."""
    torch._assert_async(ok, f"{op}: {message}")


def device_check_range(op: str, t: torch.Tensor, lo: int, hi: int | None, message: str) -> None:
    """device_check that every value of the integer tensor t lies in [lo, hi] (hi None: no
    upper bound)."""
    if t.numel() == 0:
        return
    ok = t >= lo
    if hi is not None:
        ok &= t <= hi
    device_check(op, ok.all(), message)


# ---------------------------------------------------------------------------------------------
# Registration


def triton_kernels(name: str) -> ModuleType | None:
    """The Triton kernels of op `name` (fastattn.triton.<name>), or None when they cannot be
    imported (triton missing or too old); the first such error is what
    fastattn.available_backends() reports for the triton backend."""
    try:
        return importlib.import_module(f"fastattn.triton.{name}")
    except Exception as exc:  # ImportError, or a triton too old for these kernels
        if _backend.TRITON_IMPORT_ERROR is None:
            _backend.TRITON_IMPORT_ERROR = f"{type(exc).__name__}: {exc}"
        return None


def register_triton_op(
    name: str, launcher: Callable, fake: Callable | None = None, mutates_args: tuple[str, ...] = ()
) -> None:
    """Registers a Triton launcher as the torch op `name` (a native op's schema, suffixed
    _triton; the schema is inferred from the launcher's annotations). On a GPU it is a
    triton_op: torch.compile sees the kernels, and the fake implementation is the launcher
    traced with fake tensors. Under TRITON_INTERPRET=1 wrap_triton hands back the interpreted
    kernel, which would run on fake tensors while tracing; there, when the op's contract gives
    a `fake`, the op is an opaque custom op with that fake, so opcheck and torch.compile work
    on CPU too (without one it stays a triton_op)."""
    if fake is not None and os.environ.get("TRITON_INTERPRET") == "1":
        op = torch.library.custom_op(name, mutates_args=mutates_args)(launcher)
        op.register_fake(fake)
        return
    torch.library.triton_op(name, mutates_args=mutates_args)(launcher)


def register_native_fakes(fakes: dict[str, Callable]) -> None:
    """register_fake for the native ops fastattn::<name> -> fake that this build declares."""
    for name, fake in fakes.items():
        if _backend.has_op(name):
            torch.library.register_fake(f"fastattn::{name}")(fake)


def register_autograd(op: str, formula: tuple[Callable, Callable]) -> None:
    """Attaches (backward, setup_context) to the torch op fastattn::<op>."""
    backward, setup_context = formula
    torch.library.register_autograd(f"fastattn::{op}", backward, setup_context=setup_context)


def register_forward_backward(
    forward: str,
    backward: str,
    forward_fake: Callable,
    backward_fake: Callable,
    autograd_formula: Callable,
    reference: Callable,
    triton_module: str,
) -> None:
    """Registers an op pair fastattn::<forward> / <backward> (the backward is the forward's
    kernel gradient) for every backend, from the op's contract: the fakes of the native ops,
    the backward formula `autograd_formula(backward_op, reference)` on the native forward, and
    the same for the Triton twins <forward>_triton / <backward>_triton, whose launchers
    fastattn/triton/<triton_module>.py defines under the native names."""
    register_native_fakes({forward: forward_fake, backward: backward_fake})
    ops = torch.ops.fastattn
    if _backend.has_op(forward):
        register_autograd(forward, autograd_formula(getattr(ops, backward), reference))
    kernels = triton_kernels(triton_module)
    if kernels is None:
        return
    for name, fake in ((forward, forward_fake), (backward, backward_fake)):
        register_triton_op(f"fastattn::{name}_triton", getattr(kernels, name), fake)
    register_autograd(
        forward + "_triton", autograd_formula(getattr(ops, backward + "_triton"), reference)
    )
