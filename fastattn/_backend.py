"""Backend choice: which implementation of an op runs a call.

Five backends: "cuda" (CUDA C++ kernels in fastattn._C), "triton" (Triton kernels; CPU tensors
only under TRITON_INTERPRET=1), "cpu" (C++ kernels in fastattn._C), "torch" (torch's own fused
kernels, SDPA's and cuDNN's / oneDNN's, for the calls they compute exactly as fastattn defines
them: fastattn/aten) and "reference" (plain PyTorch, the definition of correct). The choice for
a call is, in order: the op's `backend=` argument, the innermost `use_backend` context,
`set_backend`, the FASTATTN_BACKEND environment variable (read at import), then the automatic
choice for the tensors' device: its kernel backend (CUDA tensors -> cuda or triton, else
reference; CPU tensors -> cpu, else reference), or torch's kernel where the speed table
(fastattn/speed_table.py) measured it faster for the call's key on this class of device.
FASTATTN_AUTO=kernels (read at import) leaves the table out: fastattn's own kernels always.

An explicitly requested backend that cannot run a call raises BackendError. The automatic
choice never falls back silently from a kernel that exists to a slower one: when the default
backend for a device lacks a feature, the op raises unless a fallback is documented for it,
and `last_backend(op)` always names the backend that actually ran.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from typing import Any

import torch

from . import speed_table

BACKENDS = ("cuda", "triton", "cpu", "torch", "reference")
# The backends every op implements (the torch backend only the ops in _TORCH_OPS).
KERNEL_BACKENDS = ("cuda", "triton", "cpu", "reference")
_TORCH_OPS: set[str] = set()


def register_torch_op(op: str) -> None:
    """Declare that public op `op` has a torch-backend implementation (fastattn/aten)."""
    _TORCH_OPS.add(op)


def torch_implements(op: str) -> bool:
    return op in _TORCH_OPS


def _auto_mode(value: str | None) -> str:
    if value in (None, "", "table"):
        return "table"
    if value == "kernels":
        return "kernels"
    raise ValueError(f"FASTATTN_AUTO must be 'table' or 'kernels', got {value!r}")


# "table": the automatic choice reads the speed table; "kernels": fastattn's kernels always.
AUTO_MODE = _auto_mode(os.environ.get("FASTATTN_AUTO"))


class BackendError(RuntimeError):
    """A backend was asked for that cannot run the call (not built, wrong device, or a feature it
    does not implement); the message says which and why. A subclass of RuntimeError.
    """


# Per-thread state: `stack` (use_backend contexts) and `last` (op name -> backend that ran its
# last call). Dynamo traces attribute access on a threading.local (the update is replayed per
# thread after the graph runs); threading.get_ident() it cannot trace (a graph break under
# torch.compile(fullgraph=True)), so no thread-id-keyed dict.
class _ThreadState(threading.local):
    # Both attributes exist on every thread from its first access, so a compiled graph's
    # guards never depend on whether an eager call ran first (a `hasattr` guard would make
    # the second call after a thread's first one recompile).
    def __init__(self) -> None:
        self.stack: list[str | None] = []
        self.last: dict[str, str] = {}


_state = _ThreadState()
_global_backend: str | None = None
_env_backend = os.environ.get("FASTATTN_BACKEND") or None


def _validate(name: str | None, what: str) -> str | None:
    if name is None:
        return None
    if not isinstance(name, str) or name not in BACKENDS:
        raise ValueError(f"{what} must be one of {', '.join(BACKENDS)} or None, got {name!r}")
    return name


if _env_backend is not None:
    _validate(_env_backend, "FASTATTN_BACKEND")


def set_backend(name: str | None) -> None:
    """Set the process-wide backend.

    Args:
        name: "cuda", "triton", "cpu", "torch" or "reference"; None restores the automatic choice
            per device. `use_backend` and an op's `backend=` argument take precedence.

    Raises:
        ValueError: An unknown backend name.
    """
    global _global_backend
    _global_backend = _validate(name, "backend")


@contextlib.contextmanager
def use_backend(name: str | None) -> Iterator[None]:
    """Run the enclosed fastattn calls on a backend, on this thread (a context manager).

    Args:
        name: "cuda", "triton", "cpu", "torch" or "reference"; None: the automatic choice.

    Yields:
        None; the backend applies until the block ends (blocks nest).

    Raises:
        ValueError: An unknown backend name.
    """
    _validate(name, "backend")
    stack = _state.stack
    stack.append(name)
    try:
        yield
    finally:
        stack.pop()


def requested_backend() -> str | None:
    """The backend asked for by use_backend / set_backend / FASTATTN_BACKEND, or None."""
    if _state.stack:
        return _state.stack[-1]
    if _global_backend is not None:
        return _global_backend
    return _env_backend


def record_backend(op: str, backend: str) -> None:
    """Records that `backend` ran the current call of public op `op` on this thread (what
    `last_backend(op)` returns); the ops call it once they have chosen."""
    _state.last[op] = backend


def last_backend(op: str) -> str | None:
    """The backend that ran the last call of a public op on this thread.

    Args:
        op: The op's name, e.g. "attention", "lstm", "gru_cell".

    Returns:
        The backend's name ("torch" when torch's kernel ran), or None when the op has not run on
        this thread.
    """
    return _state.last.get(op)


# ---------------------------------------------------------------------------------------------
# Availability


def _native_status() -> tuple[bool, bool, str]:
    """(cpu_ok, cuda_loaded, why the CUDA kernels are not loaded) for the compiled extension."""
    from . import _native

    if _native.C is None:
        return False, False, f"fastattn._C failed to import: {_native.IMPORT_ERROR}"
    return True, _native.CUDA is not None, _native.CUDA_STATUS


TRITON_IMPORT_ERROR: str | None = None  # set by fastattn/__init__.py when the kernels fail


def triton_status() -> str:
    """'available' or why the Triton backend cannot run here."""
    if TRITON_IMPORT_ERROR is not None:
        return f"not available: the Triton kernels did not import ({TRITON_IMPORT_ERROR})"
    try:
        import triton  # noqa: F401
    except Exception as exc:  # pragma: no cover - depends on the environment
        return f"not available: triton does not import ({exc})"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "available"
    if torch.cuda.is_available():
        return "available"
    return "not available: no CUDA device (set TRITON_INTERPRET=1 to run on CPU tensors)"


def available_backends() -> dict[str, str]:
    """Which backends can run in this process.

    Returns:
        A dict mapping each backend ("cuda", "triton", "cpu", "torch", "reference") to
        "available" or the reason it is not (e.g. "not built: ...").
    """
    cpu_ok, cuda_built, reason = _native_status()
    status: dict[str, str] = {}
    if not cpu_ok:
        status["cuda"] = f"not available: {reason}"
    elif not cuda_built:
        status["cuda"] = f"{reason} (the CUDA kernels, fastattn/_C_cuda.so)"
    elif not torch.cuda.is_available():
        status["cuda"] = "not available: built with CUDA, but no CUDA device is visible"
    else:
        status["cuda"] = "available"
    status["triton"] = triton_status()
    status["cpu"] = "available" if cpu_ok else f"not available: {reason}"
    status["torch"] = "available"
    status["reference"] = "available"
    return status


_availability_cache: dict[str, str] | None = None


# Evaluated eagerly even while torch.compile traces: the first fastattn call of a process may
# be a compiled one, and available_backends() calls into the extension module (build_info),
# which Dynamo cannot trace (a graph break under fullgraph=True).
@torch.compiler.assume_constant_result
def _availability() -> dict[str, str]:
    global _availability_cache
    if _availability_cache is None:
        _availability_cache = available_backends()
    return _availability_cache


def _can_run_device(backend: str, device: torch.device) -> str | None:
    """None when `backend` can run tensors on `device`, else the reason it cannot."""
    status = _availability()[backend]
    if status != "available":
        return status
    if backend == "cuda" and device.type != "cuda":
        return f"the cuda backend runs CUDA tensors, got tensors on {device}"
    if backend == "cpu" and device.type != "cpu":
        return f"the cpu backend runs CPU tensors, got tensors on {device}"
    if backend == "torch" and device.type not in ("cpu", "cuda"):
        return f"the torch backend runs CPU and CUDA tensors, got tensors on {device}"
    if backend == "triton":
        if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            return "the triton backend runs CPU tensors only under TRITON_INTERPRET=1"
        if device.type not in ("cpu", "cuda"):
            return f"the triton backend runs CUDA tensors, got tensors on {device}"
    return None


# The automatic choice on CUDA tensors, per op. The first GPU run (an H100, 2026-11-26;
# docs/performance.md) measured the Triton kernels of `attention` and `lstm` well ahead of the
# CUDA ones, so those two try Triton first. Every other op keeps the CUDA kernels first: they
# measured as fast or faster (positional encodings) or have not been measured on a GPU yet. The
# GRU and the Elman RNN (layers and cells) run on the same recurrent engines as the LSTM
# (fastattn/triton/recurrent.py, csrc/recurrent/), so they take the LSTM's order.
_CUDA_TENSOR_ORDER = ("cuda", "triton", "reference")
_RECURRENT_ORDER = ("triton", "cuda", "reference")
_CUDA_TENSOR_ORDER_BY_OP = {
    "attention": ("triton", "cuda", "reference"),
    "lstm": _RECURRENT_ORDER,
    "gru": _RECURRENT_ORDER,
    "gru_cell": _RECURRENT_ORDER,
    "rnn": _RECURRENT_ORDER,
    "rnn_cell": _RECURRENT_ORDER,
}


def automatic_order(op: str, device_type: str) -> tuple[str, ...]:
    """The backends the automatic choice tries, in order, for `op` on a `device_type` tensor
    (the first that implements the op and can run the call wins)."""
    if device_type == "cuda":
        return _CUDA_TENSOR_ORDER_BY_OP.get(op, _CUDA_TENSOR_ORDER)
    return ("cpu", "reference")


# ---------------------------------------------------------------------------------------------
# Kernels in this build

_DISPATCH_KEYS = {"cpu": "CPU", "cuda": "CUDA"}
_missing_cache: dict[tuple[str, str], str] = {}
TRITON_NO_FLOAT64 = "the triton backend does not take float64 (its kernels compute in float32)"


# Fixed once fastattn is imported (the native ops are declared when fastattn._C loads, the
# Triton ops are registered by the op layer during the import), and evaluated eagerly even
# while torch.compile traces: the dispatcher query is not traceable, and a string is a
# constant Dynamo uses without guards.
@torch.compiler.assume_constant_result
def missing_kernel(kernel: str, backend: str) -> str:
    """ "" when this build has `backend`'s implementation of the torch op fastattn::<kernel>
    (e.g. "attention_forward"), else why not: "cpu"/"cuda" need fastattn._C to declare the op
    with a kernel for that device; "triton" needs fastattn::<kernel>_triton (registered when
    the Triton kernels import); "reference" always has one. Whether a device can run the
    backend at all is the other half of `cannot_run`."""
    key = (kernel, backend)
    if key not in _missing_cache:
        reason = ""
        if backend in _DISPATCH_KEYS:
            dispatch_key = _DISPATCH_KEYS[backend]
            from . import _native

            if (
                _native.C is None
                or not has_op(kernel)
                or not torch._C._dispatch_has_kernel_for_dispatch_key(
                    f"fastattn::{kernel}", dispatch_key
                )
            ):
                reason = f"fastattn._C has no {dispatch_key} kernel for {kernel} in this build"
        elif backend == "triton" and not has_op(kernel + "_triton"):
            reason = (
                f"no Triton kernel for {kernel} here (fastattn::{kernel}_triton is not "
                f"registered; see fastattn.available_backends())"
            )
        _missing_cache[key] = reason
    return _missing_cache[key]


def has_op(name: str) -> bool:
    """Whether the torch op fastattn::<name> is registered (declared by fastattn._C, or a
    Triton op registered by the op layer)."""
    try:
        getattr(torch.ops.fastattn, name)
    except (AttributeError, RuntimeError):
        return False
    return True


def cannot_run(
    backend: str, device: torch.device, kernel: str | None = None, dtype: torch.dtype | None = None
) -> str | None:
    """The one query "is this kernel built, and can it run this call": None when `backend`
    can run a call of the torch op fastattn::<kernel> (None: any op) on tensors of `dtype` on
    `device`, else the reason it cannot (backend not available, wrong device, no kernel in
    this build, float64 on triton)."""
    why = _can_run_device(backend, device)
    if why is None and kernel is not None and backend not in ("reference", "torch"):
        why = missing_kernel(kernel, backend) or None
    if why is None and backend == "triton" and dtype == torch.float64:
        why = TRITON_NO_FLOAT64
    return why


def select_backend(
    op: str,
    device: torch.device,
    backend: str | None = None,
    supported: tuple[str, ...] = BACKENDS,
    limits: dict[str, str] | None = None,
    *,
    kernel: str | None = None,
    dtype: torch.dtype | None = None,
    speed_key: tuple | None = None,
) -> str:
    """The backend that runs this call of `op` on `device`.

    backend: the op's own `backend=` argument (wins over everything else).
    supported: the backends that implement this op ("torch" counts only for an op that
        registered a torch implementation: register_torch_op).
    kernel, dtype: the torch op fastattn::<kernel> that the call runs and its tensors' dtype:
        a backend without that kernel in this build, or refusing the dtype, cannot run it
        (`cannot_run`).
    limits: backend -> why it cannot run this particular call (a feature it lacks). The
        automatic choice skips such a backend (last_backend shows what ran instead); an
        explicit request for it raises BackendError with the reason.
    speed_key: the call's key in the speed table (fastattn/speed_table.py: dtype, head-dim
        and length classes, features, whether a gradient is needed), from static properties
        only; None: the op is not in the table (the automatic choice is the kernel backend).
    """
    limits = limits or {}
    supported = tuple(b for b in supported if b != "torch" or op in _TORCH_OPS)
    requested = _validate(backend, "backend") or requested_backend()
    if requested is not None:
        if requested not in supported:
            raise BackendError(
                f"{op}: backend {requested!r} does not implement this op "
                f"(implemented by: {', '.join(supported)})"
            )
        why = cannot_run(requested, device, kernel, dtype) or limits.get(requested)
        if why is not None:
            raise BackendError(f"{op}: backend {requested!r} cannot run this call: {why}")
        return requested
    if torch.compiler.is_compiling():  # traced as is: the memo would add guards on its dict
        return _automatic_choice(op, device, supported, limits, kernel, dtype, speed_key)
    memo_key = (
        op,
        device.type,
        device.index,
        kernel,
        dtype,
        speed_key,
        supported,
        tuple(limits),
        AUTO_MODE,
    )
    memo = _automatic_choices.get(memo_key)
    if (
        memo is None
        or memo[1] is not _availability_cache
        or memo[2] is not _missing_cache
        or memo[3] is not speed_table._tables
    ):
        chosen = _automatic_choice(op, device, supported, limits, kernel, dtype, speed_key)
        memo = (chosen, _availability_cache, _missing_cache, speed_table._tables)
        _automatic_choices[memo_key] = memo
    return memo[0]


# The automatic choice of select_backend per call key: a decoding step's lookup otherwise costs
# several microseconds. Each entry holds the caches the choice read (a test that replaces one
# gets a fresh choice), and speed_table.reset() clears it (forget_automatic_choices).
_automatic_choices: dict[tuple, tuple[str, Any, Any, Any]] = {}


def forget_automatic_choices() -> None:
    _automatic_choices.clear()


def _automatic_choice(
    op: str,
    device: torch.device,
    supported: tuple[str, ...],
    limits: dict[str, str],
    kernel: str | None,
    dtype: torch.dtype | None,
    speed_key: tuple | None,
) -> str:
    """select_backend's choice when no backend was requested."""
    chosen = "reference"
    for candidate in automatic_order(op, device.type):
        if (
            candidate in supported
            and cannot_run(candidate, device, kernel, dtype) is None
            and candidate not in limits
        ):
            chosen = candidate
            break
    if (
        chosen != "reference"
        and speed_key is not None
        and AUTO_MODE == "table"
        and "torch" in supported
        and "torch" not in limits
        and _can_run_device("torch", device) is None
    ):
        if speed_table.faster(device, speed_key, chosen) == "torch":
            return "torch"
    return chosen
