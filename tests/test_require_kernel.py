"""tests/conftest.py's require_kernel: a kernel the build claims but lost fails its tests.

Every test file that needs a native or Triton kernel asks require_kernel (through its device
helper), which skips only where the build legitimately has no such kernel. Here the registry is
made to lose kernels (torch's dispatcher query, a missing .so, an op that is not registered) and
the helper, and the files' device helpers built on it, must fail rather than skip.
"""

from __future__ import annotations

import importlib
import re

import pytest
import torch
from conftest import require_kernel

from fastattn import _backend, _native

F32 = torch.float32


def outcome(call, *args) -> tuple[str, str]:
    """("passed" | "failed" | "skipped", message) of call(*args). Caught here, not by
    pytest.raises: a skip where a failure is expected must fail this test, not skip it."""
    try:
        call(*args)
    except pytest.fail.Exception as exc:
        return "failed", str(exc)
    except pytest.skip.Exception as exc:
        return "skipped", str(exc)
    return "passed", ""


def expect(want: str, pattern: str, call, *args) -> None:
    got, message = outcome(call, *args)
    assert got == want, f"{want} expected, {got}: {message}"
    assert re.search(pattern, message), message


@pytest.fixture
def fresh_registry(monkeypatch):
    """missing_kernel's answers recomputed for this test (its cache is per process)."""
    monkeypatch.setattr(_backend, "_missing_cache", {})


@pytest.fixture
def lose_native_kernels(monkeypatch, fresh_registry):
    """torch's dispatcher reports no fastattn kernel for `key` (the registrations lost)."""
    has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key

    def lose(key: str) -> None:
        def query(name, dispatch_key):
            if name.startswith("fastattn::") and dispatch_key == key:
                return False
            return has_kernel(name, dispatch_key)

        monkeypatch.setattr(torch._C, "_dispatch_has_kernel_for_dispatch_key", query)
        monkeypatch.setattr(_backend, "_missing_cache", {})  # answers given before the loss

    return lose


def needs_native():
    if _native.C is None:
        pytest.skip(f"fastattn._C did not import: {_native.IMPORT_ERROR}")


def test_present_kernels_pass():
    needs_native()
    for kernel in ("attention_forward", "attention_decode", "additive_scores", "lstm_layer"):
        assert require_kernel(kernel, "cpu") is None
    assert require_kernel("anything", "reference") is None


def test_lost_cpu_kernel_fails(lose_native_kernels):
    needs_native()
    lose_native_kernels("CPU")
    expect(
        "failed",
        "fastattn._C has no CPU kernel for attention_forward.*lost kernel registration",
        require_kernel,
        "attention_forward",
        "cpu",
    )


# Each file's device helper, and the arguments of a CPU call of it.
SITES = [
    ("test_attention", "attention_device", ("cpu",)),
    ("test_attention_bias_grad", "kernel_device", ("cpu",)),
    ("test_sinks", "sinks_device", ("cpu", "varlen_attention_forward")),
    ("test_paged_kvcache", "paged_device", ("cpu",)),
    ("test_varlen_attention", "varlen_device", ("cpu",)),
    ("test_attention_with_kvcache", "kvcache_device", ("cpu",)),
    ("test_additive_attention", "skip_unavailable", ("cpu", F32)),
    ("test_lstm", "lstm_device", ("cpu",)),
    ("test_gru_rnn", "kind_device", ("cpu", "rnn-tanh")),
]


@pytest.mark.parametrize("module,helper,args", SITES, ids=[s[0] for s in SITES])
def test_device_helpers_fail_on_a_lost_kernel(lose_native_kernels, module, helper, args):
    """Unchanged, each helper returns the CPU device; with the CPU registrations gone, it
    fails (it used to skip, leaving a build without the kernel green)."""
    needs_native()
    device_of = getattr(importlib.import_module(module), helper)
    assert device_of(*args) == torch.device("cpu")
    lose_native_kernels("CPU")
    expect("failed", "lost kernel registration", device_of, *args)


def test_lost_triton_registration_fails(monkeypatch, fresh_registry):
    """The Triton kernels imported, but the op layer did not register the op's _triton op."""
    if _backend.TRITON_IMPORT_ERROR is not None:
        pytest.skip(f"backend triton: {_backend.triton_status()}")
    assert require_kernel("attention_forward", "triton") is None
    monkeypatch.setattr(_backend, "has_op", lambda name: not name.endswith("_triton"))
    monkeypatch.setattr(_backend, "_missing_cache", {})
    expect(
        "failed",
        "no Triton kernel for attention_forward",
        require_kernel,
        "attention_forward",
        "triton",
    )


def test_triton_kernels_that_do_not_import_skip(monkeypatch):
    monkeypatch.setattr(_backend, "TRITON_IMPORT_ERROR", "ImportError: no module named triton")
    expect("skipped", "no module named triton", require_kernel, "attention_forward", "triton")


class _BuildReport:
    """A stand-in fastattn._C whose build report says whether CUDA was compiled."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def build_info(self):
        return {"cuda": self.cuda}


def test_cuda_kernels_skip_or_fail_as_the_build_says(monkeypatch, fresh_registry):
    monkeypatch.setattr(_native, "C", _BuildReport(cuda=False))
    monkeypatch.setattr(_native, "CUDA_STATUS", "not built: fastattn was compiled without CUDA")
    expect("skipped", "compiled without CUDA", require_kernel, "attention_forward", "cuda")
    # A CUDA build under a torch without CUDA: the kernels cannot load, legitimately.
    monkeypatch.setattr(_native, "C", _BuildReport(cuda=True))
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(_native, "CUDA_STATUS", "not loaded: torch has no CUDA")
    expect("skipped", "torch has no CUDA", require_kernel, "attention_forward", "cuda")
    # A CUDA build under a CUDA torch whose kernels' library is gone or does not load: fails.
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(_native, "CUDA", None)
    monkeypatch.setattr(_native, "CUDA_STATUS", "not built: fastattn was compiled without CUDA")
    expect(
        "failed",
        r"build_info\(\)\['cuda'\].*not built",
        require_kernel,
        "attention_forward",
        "cuda",
    )


def test_native_library_missing_skips_broken_fails(monkeypatch, tmp_path):
    """No fastattn._C built: skip. One built that does not import: fail."""
    monkeypatch.setattr(_native, "C", None)
    monkeypatch.setattr(_native, "IMPORT_ERROR", "fastattn._C is not built in the folder")
    monkeypatch.setattr(_native, "CUDA_LIBRARY", tmp_path / "_C_cuda.so")
    for backend in ("cpu", "cuda"):
        expect("skipped", "is not built", require_kernel, "attention_forward", backend)
    (tmp_path / "_C.abi3.so").write_bytes(b"")
    monkeypatch.setattr(_native, "IMPORT_ERROR", "ImportError: undefined symbol: lost")
    for backend in ("cpu", "cuda"):
        expect(
            "failed",
            "built but does not import.*undefined symbol",
            require_kernel,
            "attention_forward",
            backend,
        )
