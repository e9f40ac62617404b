"""Helpers shared by the public ops: argument checks with clear messages, dropout seeds, and
the registration of every backend's kernels as torch ops (the op layer registers; the kernel
modules only define launchers)."""

from __future__ import annotations

import functools
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
    """Attaches (backward, setup_context) to the torch op fastattn::<op>, and builds the same
    formula as an autograd.Function for eager calls (`kernel_op`)."""
    backward, setup_context = formula
    torch.library.register_autograd(f"fastattn::{op}", backward, setup_context=setup_context)
    overload = getattr(torch.ops.fastattn, op).default
    function = _eager_function(overload, op, backward, setup_context)
    _EAGER_CALLS[op] = functools.partial(_call_eager, function, overload)


# op name -> the eager call of the op (`_call_eager` bound to its autograd.Function, which runs
# the op's kernel below autograd with the registered formula); built once at registration.
_EAGER_CALLS: dict[str, Callable] = {}


def _eager_function(overload, op: str, backward: Callable, setup_context: Callable):
    """torch.library's autograd wrapper costs tens of microseconds per call in Python
    (keysets, default filling, a generated Function per call path); a decoder that calls a
    small op 20 times a step pays it on every call. This Function applies the same formula
    (setup_context, backward) around the op's kernel, dispatched below autograd."""

    # setup_context is called from forward rather than declared as the Function's own: a
    # declared one makes every apply bind the arguments with inspect.signature (~30 us).
    def forward(ctx, *args):
        with torch._C._AutoDispatchBelowAutograd():
            output = overload(*args)
        setup_context(ctx, args, output)
        return output

    return type(
        f"{op}_function",
        (torch.autograd.Function,),
        {"forward": staticmethod(forward), "backward": staticmethod(backward)},
    )


def kernel_op(name: str) -> Callable:
    """The callable that runs the torch op fastattn::<name>: in eager mode the op's
    autograd.Function (with inputs that need gradients) or the kernel below autograd (without:
    no autograd wrapper to pass through); while torch.compile traces, the op itself, which
    Dynamo sees as one node with its fake and autograd."""
    call = _EAGER_CALLS.get(name)
    if call is None or torch.compiler.is_compiling():
        return getattr(torch.ops.fastattn, name)
    return call


def _call_eager(function, overload, *args):
    if torch._C._are_functorch_transforms_active():
        # torch.func (grad, vmap, jvp) needs the op's own autograd registration: an
        # autograd.Function without a declared setup_context does not run under functorch.
        return overload(*args)
    if torch.is_grad_enabled() and any(
        isinstance(a, torch.Tensor) and a.requires_grad for a in args
    ):
        return function.apply(*args)
    with torch._C._AutoDispatchBelowAutograd():
        return overload(*args)


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


# ---------------------------------------------------------------------------------------------
# Attention sinks (GPT-OSS): one learned logit per query head that joins every row's softmax
# denominator without a value. The kernels compute (out, lse) without it; `apply_sinks` adds
# it exactly, for every op and backend that has no sink in its own math (the reference has):
#     lse' = logaddexp(lse, sink_h),  out' = out * exp(lse - lse') = out * sigmoid(lse - sink_h)
# since the kernels' probabilities exp(s_j - lse) become exp(s_j - lse'). The rescale is plain
# torch, so autograd carries dL/dout' and dL/dlse' back to the kernels' backward (which takes a
# grad_lse) and to `sinks`; dropout is unaffected (it scales each kept probability alike).


def canonical_sinks(op: str, sinks, q: torch.Tensor, Hq: int) -> torch.Tensor | None:
    """Checks the `sinks` argument: a floating (Hq,) tensor on q's device. Returned as is (the
    compute dtype is applied by `apply_sinks` / the reference, so a float32 sink trains beside
    bf16 activations)."""
    if sinks is None:
        return None
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"{op}: sinks must be a torch.Tensor or None, got {type(sinks).__name__}")
    if sinks.dtype not in FLOAT_DTYPES:
        raise ValueError(
            f"{op}: sinks must be float32, float16, bfloat16 or float64, got {sinks.dtype}"
        )
    if tuple(sinks.shape) != (Hq,):
        raise ValueError(
            f"{op}: sinks must be (Hq,) = ({Hq},) (one logit per query head), got "
            f"{tuple(sinks.shape)}"
        )
    if sinks.device != q.device:
        raise ValueError(f"{op}: sinks must be on q's device ({q.device}), got {sinks.device}")
    return sinks


def apply_sinks(
    out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out', lse') of attention whose kernel gave (out, lse), with the per-head sink logits
    `sinks` (Hq,) joined to every row's denominator.

    lse: float32/float64, its dim `head_dim` the query head: (B, Hq, Lq) (head_dim 1) with
        out (B, Hq, Lq, Dv), or varlen's (Hq, total_q) (head_dim 0) with out (total_q, Hq, Dv).
    A row with no visible key (lse -inf) gives out' 0 and lse' = sink. Guarded so that no NaN
    arises forward or backward, even for a sink of -inf (no sink: lse' = lse, -inf on an empty
    row). Returns out' in out's dtype, lse' in lse's dtype."""
    shape = [1] * lse.dim()
    shape[head_dim] = -1
    sink = sinks.to(lse.dtype).view(shape)
    # Both -inf: logaddexp and lse - sink are NaN (and so their gradients): run them on zeros.
    both = torch.isneginf(lse) & torch.isneginf(sink)
    lse_safe = lse.masked_fill(both, 0.0)
    sink_safe = torch.where(both, torch.zeros_like(lse_safe), sink)
    new_lse = torch.logaddexp(lse_safe, sink_safe).masked_fill(both, float("-inf"))
    # exp(lse - lse') without forming it: exactly 0 for an empty row, 1 for a -inf sink.
    factor = torch.sigmoid(lse_safe - sink_safe).masked_fill(both, 0.0)
    factor = factor.unsqueeze(-1) if head_dim == 1 else factor.transpose(0, 1).unsqueeze(-1)
    new_out = (out.to(factor.dtype) * factor).to(out.dtype)
    return new_out, new_lse
