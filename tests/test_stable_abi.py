"""fastattn's native library uses libtorch's stable ABI only (docs/stable_abi.md): no C++
symbol of ATen, c10 or torch is left undefined in the shared object, so it loads into any torch
from the targeted version (2.11) on; what it calls in libtorch is the stable C shim
(aoti_torch_*, torch_*). Checked on the built object with nm (binutils)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

import fastattn
from fastattn import _native

NM = shutil.which("nm")
pytestmark = pytest.mark.skipif(NM is None, reason="needs nm (binutils)")

# Demangled C++ names of libtorch's unstable API. The stable API's own C++ (torch::stable,
# torch::headeronly, c10's header-only types such as c10::Half) is inline and never undefined.
UNSTABLE = re.compile(r"\b(at|c10|caffe2|torch|pybind11::detail::type_caster<at)::")

# The shim's C functions (and the CUDA runtime's, in the CUDA build) are what libtorch offers
# the library; anything else from libtorch would tie it to one torch build.
C_SHIM = re.compile(r"^(aoti_torch_|torch_)\w+$")

# Libraries of a CUDA torch that a CPU-only torch does not have: the CPU part must not need them.
CUDA_ONLY_LIBS = ("libtorch_cuda.so", "libc10_cuda.so")


def _library() -> Path:
    if _native.C is None:
        pytest.skip(f"fastattn._C did not import: {_native.IMPORT_ERROR}")
    return Path(_native.C.__file__)


def _undefined(path: Path, demangle: bool) -> list[str]:
    args = [NM, "-D", "--undefined-only"] + (["-C"] if demangle else []) + [str(path)]
    out = subprocess.run(args, check=True, capture_output=True, text=True).stdout
    # Lines read "                 U name" (or "w name" for weak symbols).
    return [line.split(None, 1)[1].strip() for line in out.splitlines() if line.strip()]


def unstable_symbols(path: Path) -> list[str]:
    """The undefined demangled symbols of the object at `path` from libtorch's C++ API."""
    return sorted(s for s in _undefined(path, demangle=True) if UNSTABLE.search(s))


def test_no_unstable_torch_symbols():
    path = _library()
    found = unstable_symbols(path)
    assert not found, (
        f"{path.name} uses {len(found)} symbols of libtorch's C++ API (not the stable ABI); "
        "the first: " + "; ".join(found[:15])
    )


def test_torch_calls_are_the_stable_c_shim():
    """Every undefined symbol that is neither the C/C++ runtime's, Python's nor CUDA's is a
    function of the stable C shim."""
    path = _library()
    ours = [
        s.split("@")[0]
        for s in _undefined(path, demangle=False)
        if not s.startswith(("_Z", "_Py", "Py", "_ITM_", "__", "_Unwind", "cuda", "_cuda"))
        and "@" not in s  # versioned: glibc, libstdc++, libgcc
    ]
    torch_like = [s for s in ours if "torch" in s or "aoti" in s]
    assert torch_like, "no stable-shim call found: is this the fastattn library?"
    assert all(C_SHIM.match(s) for s in torch_like), torch_like


def test_build_info_reports_the_stable_abi():
    info = fastattn.build_info()
    assert info["abi"] == "stable"
    assert re.fullmatch(r"\d+\.\d+", info["torch_target"]), info["torch_target"]


def test_cpu_build_does_not_need_cuda_torch():
    """A CPU-only build links no CUDA library of torch (it loads under a CPU-only torch)."""
    path = _library()
    if fastattn.build_info()["cuda"]:
        pytest.skip("a CUDA build (the CUDA kernels need torch's CUDA libraries)")
    needed = subprocess.run(
        ["readelf", "-d", str(path)], check=True, capture_output=True, text=True
    ).stdout
    for lib in CUDA_ONLY_LIBS:
        assert lib not in needed, f"{path.name} needs {lib}"
