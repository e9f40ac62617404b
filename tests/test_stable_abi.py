"""fastattn's native libraries use libtorch's stable ABI only (docs/design/stable_abi.md): no C++
symbol of ATen, c10 or torch is left undefined in fastattn._C or in the CUDA kernels' library
fastattn/_C_cuda.so, so they load into any torch from the targeted version (2.11) on; what they
call in libtorch is the stable C shim (aoti_torch_*, torch_*). _C needs no CUDA library (it
loads under a CPU-only torch); _C_cuda.so is loaded only when torch has CUDA. Checked on the
built objects with nm and readelf (binutils)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

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

# Libraries of a CUDA torch (and CUDA's) that a CPU-only torch does not have: _C must not need
# them.
CUDA_ONLY_LIBS = ("libtorch_cuda.so", "libc10_cuda.so", "libcudart.so")


def _library() -> Path:
    if _native.C is None:
        pytest.skip(f"fastattn._C did not import: {_native.IMPORT_ERROR}")
    return Path(_native.C.__file__)


def _libraries() -> list[Path]:
    """fastattn._C, and the CUDA kernels' library when this build has one."""
    return [_library()] + ([_native.CUDA_LIBRARY] if _native.CUDA_LIBRARY.exists() else [])


def _undefined(path: Path, demangle: bool) -> list[str]:
    args = [NM, "-D", "--undefined-only"] + (["-C"] if demangle else []) + [str(path)]
    out = subprocess.run(args, check=True, capture_output=True, text=True).stdout
    # Lines read "                 U name" (or "w name" for weak symbols).
    return [line.split(None, 1)[1].strip() for line in out.splitlines() if line.strip()]


def _readelf(path: Path, *flags: str) -> str:
    """readelf's output for the object at `path` (-d: the dynamic section; --version-info)."""
    return subprocess.run(
        ["readelf", *flags, str(path)], check=True, capture_output=True, text=True
    ).stdout


def unstable_symbols(path: Path) -> list[str]:
    """The undefined demangled symbols of the object at `path` from libtorch's C++ API."""
    return sorted(s for s in _undefined(path, demangle=True) if UNSTABLE.search(s))


def test_no_unstable_torch_symbols():
    for path in _libraries():
        found = unstable_symbols(path)
        assert not found, (
            f"{path.name} uses {len(found)} symbols of libtorch's C++ API (not the stable ABI); "
            "the first: " + "; ".join(found[:15])
        )


def test_torch_calls_are_the_stable_c_shim():
    """Every undefined symbol that is neither the C/C++ runtime's, Python's nor CUDA's is a
    function of the stable C shim."""
    for path in _libraries():
        ours = [
            s.split("@")[0]
            for s in _undefined(path, demangle=False)
            if not s.startswith(("_Z", "_Py", "Py", "_ITM_", "__", "_Unwind", "cuda", "_cuda"))
            and "@" not in s  # versioned: glibc, libstdc++, libgcc
        ]
        torch_like = [s for s in ours if "torch" in s or "aoti" in s]
        assert torch_like, f"no stable-shim call found in {path.name}"
        assert all(C_SHIM.match(s) for s in torch_like), (path.name, torch_like)


def test_build_info_reports_the_stable_abi():
    info = fastattn.build_info()
    assert info["abi"] == "stable"
    assert re.fullmatch(r"\d+\.\d+", info["torch_target"]), info["torch_target"]


@pytest.mark.skipif(shutil.which("readelf") is None, reason="needs readelf (binutils)")
def test_c_does_not_need_cuda():
    """fastattn._C links no CUDA library, in CUDA builds too (it loads under a CPU-only torch;
    the CUDA kernels are _C_cuda.so)."""
    path = _library()
    needed = _readelf(path, "-d")
    for lib in CUDA_ONLY_LIBS:
        assert lib not in needed, f"{path.name} needs {lib}"


def test_cuda_library_loads_only_with_cuda_torch():
    info = fastattn.build_info()
    status = info["cuda_library"]
    if not info["cuda"]:
        assert status.startswith("not built"), status
        assert not _native.CUDA_LIBRARY.exists()
    elif torch.version.cuda is None:
        assert status == "not loaded: torch has no CUDA", status
    else:
        assert status == "loaded", status
        # its kernels are registered for the CUDA dispatch key of every native op
        assert torch._C._dispatch_has_kernel_for_dispatch_key("fastattn::attention_forward", "CUDA")


def test_c_is_a_limited_api_module():
    """fastattn._C is built against CPython's limited API (csrc/bindings.cpp), as _C.abi3.so:
    the same object imports under every CPython from 3.10 on (the wheel is tagged abi3)."""
    path = _library()
    assert path.name == "_C.abi3.so", path.name
    assert fastattn.build_info()["python_abi"].startswith("abi3"), fastattn.build_info()
    # No per-version copy beside it: Python would import that one first.
    assert not list(path.parent.glob("_C.cpython-*.so")), list(path.parent.glob("_C.*.so"))


# The newest symbol versions a manylinux_2_28 library may need (auditwheel's policy for that
# tag: glibc 2.28 and the libstdc++ of GCC 8), the floor torch's own wheels hold to.
MANYLINUX_2_28 = {"GLIBC": (2, 28), "GLIBCXX": (3, 4, 24), "CXXABI": (1, 3, 11), "GCC": (7, 0, 0)}


def _needed_versions(path: Path) -> dict[str, tuple[int, ...]]:
    """The newest version of each versioned family (GLIBC, GLIBCXX, ...) the object needs."""
    needs = _readelf(path, "--version-info", "-W").split("Version needs section", 1)[-1]
    newest: dict[str, tuple[int, ...]] = {}
    for family, number in re.findall(r"Name: ([A-Z]+)_([0-9.]+)\b", needs):
        version = tuple(int(part) for part in number.split("."))
        newest[family] = max(newest.get(family, version), version)
    return newest


@pytest.mark.skipif(shutil.which("readelf") is None, reason="needs readelf (binutils)")
def test_symbol_versions_fit_manylinux_2_28():
    """csrc/common/manylinux_compat.{h,cpp}: built on any newer Linux, the libraries need no
    glibc or libstdc++ symbol newer than manylinux_2_28 allows, so the wheel's tag holds."""
    for path in _libraries():
        newest = _needed_versions(path)
        assert "GLIBC" in newest, f"no glibc version needs read from {path.name}: {newest}"
        for family, limit in MANYLINUX_2_28.items():
            if family in newest:
                assert newest[family] <= limit, (path.name, family, newest[family], limit)


def test_only_the_entry_points_are_exported():
    """The version script exports PyInit__C from _C and the fastattn_cuda_* functions from the
    CUDA library; everything else, the libstdc++ pieces compiled in among it, stays local."""
    for path in _libraries():
        out = subprocess.run(
            [NM, "-D", "--defined-only", str(path)], check=True, capture_output=True, text=True
        ).stdout
        names = [line.split()[-1] for line in out.splitlines() if line.strip()]
        prefix = "PyInit_" if path.name.startswith("_C.") else "fastattn_cuda_"
        assert names and all(name.startswith(prefix) for name in names), (path.name, names)


@pytest.mark.skipif(shutil.which("readelf") is None, reason="needs readelf (binutils)")
def test_torch_is_found_beside_the_package():
    """The run path names torch's libraries relative to the library itself (site-packages/
    torch/lib in an installed wheel), never the build machine's folders."""
    for path in _libraries():
        paths = re.findall(
            r"\((?:RUNPATH|RPATH)\)\s+Library r(?:un)?path: \[(.*)\]", _readelf(path, "-d")
        )
        assert paths == ["$ORIGIN/../torch/lib"], (path.name, paths)
