"""Thin driver around CMakeLists.txt (the one build definition), as vLLM does.

Environment:
  FASTATTN_CUDA=auto|0|1   compile the CUDA kernels (auto: when torch is a CUDA build and nvcc
                           is found)
  TORCH_CUDA_ARCH_LIST     CUDA archs, default "8.0;9.0+PTX" (see DEFAULT_CUDA_ARCHS)
  MAX_JOBS                 parallel compile jobs
  CMAKE_ARGS               extra arguments for the CMake configure step
  FASTATTN_DEBUG_CHECKS=1  bounds checks inside the kernels
  CUDA_HOME                CUDA toolkit root (else CUDA_PATH, /usr/local/cuda, or the nvcc on
                           PATH: tools/cuda_toolkit.py)
"""

import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
# Native code for Ampere (sm_80, which also runs on sm_86/sm_89: same major version) and Hopper
# (sm_90), plus compute_90 PTX that the driver compiles on first use for newer GPUs (Blackwell
# sm_100/sm_120): two compiled archs cost about twice a one-arch build, where compiling 10.0 and
# 12.0 as well would double that again. Set TORCH_CUDA_ARCH_LIST="8.0;9.0;10.0;12.0" for native
# Blackwell code (no JIT on first use), or to your GPU's arch alone for the fastest build.
DEFAULT_CUDA_ARCHS = "8.0;9.0+PTX"
CUDA_LIBRARY = "_C_cuda.so"  # the CUDA kernels: a second library beside fastattn._C


def _load_cuda_toolkit_module():
    """tools/cuda_toolkit.py (the toolkit search, also used by gpu_suite.sh and tested)."""
    spec = importlib.util.spec_from_file_location(
        "fastattn_cuda_toolkit", ROOT / "tools" / "cuda_toolkit.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cuda_enabled(torch_cuda: str | None, cuda_home: str | None) -> bool:
    mode = os.environ.get("FASTATTN_CUDA", "auto").strip().lower()
    if mode in ("0", "off", "false", "no"):
        return False
    available = torch_cuda is not None and cuda_home is not None
    if mode in ("1", "on", "true", "yes"):
        if not available:
            raise RuntimeError(
                "FASTATTN_CUDA=1 but the CUDA kernels cannot be built: "
                f"torch.version.cuda={torch_cuda!r}, CUDA toolkit={cuda_home!r} "
                "(install a CUDA build of torch and set CUDA_HOME to the toolkit root)"
            )
        return True
    if mode != "auto":
        raise RuntimeError(f"FASTATTN_CUDA must be auto, 0 or 1, got {mode!r}")
    return available


class CMakeExtension(Extension):
    def __init__(self, name: str):
        # py_limited_api: the module is built against CPython's limited API (csrc/bindings.cpp),
        # so setuptools names it _C.abi3.so, and the wheel is tagged cp310-abi3 below.
        super().__init__(name, sources=[], py_limited_api=True)


def _replace_file(src: Path, dst: Path) -> None:
    """Copy src over dst through a rename, so processes that have dst mapped keep a valid file."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    staging = dst.with_name(dst.name + ".tmp")
    shutil.copy2(src, staging)
    os.replace(staging, dst)


class CMakeBuild(build_ext):
    def copy_file(self, src, dst, *args, **kwargs):
        # setuptools copies the built library into the source tree (--inplace, editable
        # installs) by overwriting it in place; a rename is safe for running processes.
        if str(dst).endswith(".so"):
            _replace_file(Path(src), Path(dst))
            return str(dst), True
        return super().copy_file(src, dst, *args, **kwargs)

    def build_extension(self, ext: Extension) -> None:
        import torch  # the torch we build against: pip install --no-build-isolation

        target = Path(self.get_ext_fullpath(ext.name)).resolve()
        cuda_home = _load_cuda_toolkit_module().find_cuda_home()
        use_cuda = _cuda_enabled(torch.version.cuda, cuda_home)
        archs = os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip() or DEFAULT_CUDA_ARCHS
        python = f"py{sys.version_info[0]}{sys.version_info[1]}"
        tag = f"torch{torch.__version__}-{'cuda' if use_cuda else 'cpu'}-{python}"
        build_dir = ROOT / "build" / tag
        build_dir.mkdir(parents=True, exist_ok=True)

        env = dict(os.environ)
        env["TORCH_CUDA_ARCH_LIST"] = archs
        # cmake >= 4 (what `pip install cmake` brings) refuses projects whose
        # cmake_minimum_required predates 3.5, which some of torch's cmake files still declare.
        env.setdefault("CMAKE_POLICY_VERSION_MINIMUM", "3.5")
        debug_checks = os.environ.get("FASTATTN_DEBUG_CHECKS") == "1"
        cmake_args = [
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-DFASTATTN_OUTPUT_DIR={build_dir / 'out'}",
            f"-DFASTATTN_CUDA={'ON' if use_cuda else 'OFF'}",
            f"-DFASTATTN_DEBUG_CHECKS={'ON' if debug_checks else 'OFF'}",
            "-DCMAKE_BUILD_TYPE=Release",
        ]
        if cuda_home:
            # Torch's cmake config looks for a toolkit whenever torch is a CUDA build.
            cmake_args.append(f"-DCUDA_TOOLKIT_ROOT_DIR={cuda_home}")
            env["CUDA_HOME"] = cuda_home
        # The pip package's ninja first, whatever PATH holds: a build first made with another
        # ninja (an activated venv's, or the system's, older one) would be redone in full,
        # since a ninja that cannot read a newer .ninja_log treats every output as dirty.
        ninja = _ninja_from_pip() or shutil.which("ninja")
        if ninja:
            cmake_args += ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"]
        cmake_args += shlex.split(os.environ.get("CMAKE_ARGS", ""))

        cmake = _cmake_executable()
        jobs = os.environ.get("MAX_JOBS") or str(os.cpu_count() or 1)
        if use_cuda:
            cuda = f"on, archs {archs}, toolkit {cuda_home}"
        elif torch.version.cuda is None:
            cuda = "off (torch is a CPU build)"
        else:
            mode = os.environ.get("FASTATTN_CUDA", "auto")
            cuda = f"off (FASTATTN_CUDA={mode}, toolkit {cuda_home})"
        print(f"fastattn: building {tag}, CUDA {cuda}, {jobs} jobs", flush=True)
        subprocess.run(
            [cmake, "-S", str(ROOT), "-B", str(build_dir), *cmake_args], check=True, env=env
        )
        subprocess.run([cmake, "--build", str(build_dir), "--parallel", jobs], check=True, env=env)
        # Each (torch, CUDA) configuration builds in its own folder; its result is copied to
        # where setuptools expects it, and into the source tree's package as well, so that
        # `python -m fastattn` run in the checkout after `pip install .` (the README's steps)
        # imports a complete package rather than sources without _C.
        built = build_dir / "out" / target.name
        _replace_file(built, target)
        in_tree = ROOT / "fastattn" / target.name
        if in_tree.resolve() != target:
            _replace_file(built, in_tree)
        # The CUDA kernels' library (loaded by fastattn/_native.py when torch has CUDA) goes
        # next to _C; a CPU-only build removes one left from an earlier CUDA build. A
        # per-Python _C.cpython-*.so from an older build goes too: Python would import it
        # ahead of _C.abi3.so (it tries the specific suffix first).
        cuda_built = build_dir / "out" / CUDA_LIBRARY
        for folder in {target.parent, in_tree.parent}:
            for stale in folder.glob("_C.cpython-*.so"):
                stale.unlink()
            if use_cuda:
                _replace_file(cuda_built, folder / CUDA_LIBRARY)
            else:
                (folder / CUDA_LIBRARY).unlink(missing_ok=True)


def _ninja_from_pip() -> str | None:
    try:
        import ninja  # noqa: F401

        candidate = Path(ninja.BIN_DIR) / "ninja"
        return str(candidate) if candidate.exists() else None
    except Exception:
        return None


def _cmake_executable() -> str:
    try:
        import cmake  # the pip package brings a newer cmake than the system's

        candidate = Path(cmake.CMAKE_BIN_DIR) / "cmake"
        if candidate.exists():
            return str(candidate)
    except Exception:
        pass
    return shutil.which("cmake") or "cmake"


setup(
    packages=find_packages(include=["fastattn", "fastattn.*"]),
    ext_modules=[CMakeExtension("fastattn._C")],
    cmdclass={"build_ext": CMakeBuild},
    # One wheel for every CPython from 3.10 on (the limited API) and every torch from the stable
    # ABI's target on (docs/design/stable_abi.md).
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
)
