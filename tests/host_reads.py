"""Finding host reads of CUDA tensor values without a GPU.

A host read (`.item()`, `.tolist()`, `int(t)`, `bool(t)`, `nonzero`, a copy to the CPU) of a CUDA
tensor synchronises the stream and cannot be captured in a CUDA graph. `fake_cuda()` runs code
on fake CUDA tensors (FakeTensorMode: shapes, dtypes and devices, no data, no GPU needed) under
a dispatch mode that records every such read before it happens; a value read also raises there
(fake tensors have no values), so a test fails either way. Native and Triton ops run their fake
implementations, so this covers the Python layer of each op (argument checks, backend choice,
the ops it dispatches); the C++ checks are covered by the GPU tests (CUDA-graph capture and
`torch.cuda.set_sync_debug_mode("error")`).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from fastattn import _backend

aten = torch.ops.aten

# What a value read of a fake tensor raises (it has no value).
ValueReadError = DataDependentOutputException

# Ops whose result depends on tensor values on the host.
_VALUE_READS = (
    aten._local_scalar_dense.default,
    aten.nonzero.default,
    aten.equal.default,
    aten.is_nonzero.default,
)


def _device_type(x) -> str | None:
    return x.device.type if isinstance(x, torch.Tensor) else None


class HostReadRecorder(TorchDispatchMode):
    """Records the aten ops that read tensor values on the host or copy a non-CPU tensor to
    the CPU (`reads`, one line each)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []
        self.asserts = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        src = _device_type(args[0]) if args else None
        if func in (aten._assert_async.msg, aten._assert_async.default):
            self.asserts += 1
        if func in _VALUE_READS and src != "cpu":
            self.reads.append(f"{func} on a {src} tensor")
        elif (
            func is aten._to_copy.default
            and src not in (None, "cpu")
            and torch.device(kwargs.get("device") or args[0].device).type == "cpu"
        ):
            self.reads.append(f"{func}: a {src} tensor copied to the CPU")
        elif func is aten.copy_.default and src == "cpu" and _device_type(args[1]) != "cpu":
            self.reads.append(f"{func}: a {_device_type(args[1])} tensor copied to the CPU")
        return func(*args, **kwargs)


@contextlib.contextmanager
def fake_cuda(backend: str | None = None) -> Iterator[HostReadRecorder]:
    """Tensors created inside are fake (use device="cuda"); the cuda and triton backends count
    as available. Yields the recorder; the caller asserts `recorder.reads == []`. Skips with a
    CPU-only build of torch: there some fake kernels (indexing, nonzero) refuse CUDA devices.
    backend "triton": skips where Triton can neither launch (no GPU) nor interpret (its
    launchers then ask the absent driver for the device's properties)."""
    if torch.version.cuda is None:
        pytest.skip("fake CUDA tensors need a CUDA build of torch (this one is CPU-only)")
    triton_runs = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
    if backend == "triton" and not triton_runs:
        pytest.skip("triton needs a GPU or TRITON_INTERPRET=1 to run its launchers")
    saved = _backend._availability_cache
    status = dict(_backend.available_backends())
    status["cuda"] = "available"
    # The automatic choice tries triton first on CUDA tensors: where its launchers cannot run
    # (no GPU, no interpreter: they would ask the absent driver for the device), it stays
    # unavailable and the choice falls through to the cuda backend's fakes.
    status["triton"] = "available" if triton_runs else "unavailable: no GPU and no interpreter"
    _backend._availability_cache = status
    # A build without CUDA declares the native ops all the same, and on fake tensors their
    # fake implementations stand in for the CUDA kernels: count those as built too.
    missing_kernel = _backend.missing_kernel

    def missing_with_fake_cuda(kernel: str, backend: str) -> str:
        if backend == "cuda" and _backend.has_op(kernel):
            return ""
        return missing_kernel(kernel, backend)

    _backend.missing_kernel = missing_with_fake_cuda
    try:
        with FakeTensorMode(), HostReadRecorder() as recorder:
            yield recorder
    finally:
        _backend._availability_cache = saved
        _backend.missing_kernel = missing_kernel


def assert_no_host_reads(recorder: HostReadRecorder) -> None:
    assert recorder.reads == [], "host reads of CUDA tensors:\n" + "\n".join(recorder.reads)


def force_device_checks(monkeypatch) -> None:
    """Makes the Python layer check CPU tensors' values as it checks CUDA ones (device_check),
    to test the device-side rules here: on the CPU torch._assert_async raises at once."""
    from fastattn.ops import _recurrent, attention_with_kvcache, positional, varlen_attention

    # (fastattn.nn's modules check values through these op modules: learned_positions; the
    # recurrent ops' lengths through _recurrent.check_lengths)
    for module in (positional, attention_with_kvcache, varlen_attention, _recurrent):
        monkeypatch.setattr(
            module,
            "host_checks_enabled",
            lambda t=None: t is None and not torch.compiler.is_compiling(),
        )
        monkeypatch.setattr(module, "device_checks_enabled", lambda t: True)


def device_checks(recorder: HostReadRecorder) -> int:
    """How many asynchronous device checks (torch._assert_async) the recorded code queued."""
    return recorder.asserts


def run_failing_cuda_script(script: str) -> str:
    """Runs `script` (which must fail on the device) in a fresh interpreter from the repository
    root, without FASTATTN_HOST_CHECKS, and returns its output. A device-side assert leaves
    the CUDA context unusable, hence the separate process."""
    env = dict(os.environ)
    env.pop("FASTATTN_HOST_CHECKS", None)
    run = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script) + '\nprint("NO ERROR")\n'],
        cwd=Path(__file__).resolve().parent.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = run.stdout + run.stderr
    assert run.returncode != 0 and "NO ERROR" not in output, output
    assert "device-side assert" in output or "Assertion" in output, output
    return output


def assert_no_device_sync(run) -> None:
    """Call `run` once to warm up (Triton compiles, lazy initialisations), then again under
    torch.cuda.set_sync_debug_mode("error"), which raises on any synchronising call (a C++
    .item() included)."""
    run()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
