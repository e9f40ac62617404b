"""Thin driver around CMakeLists.txt (the one build definition), as vLLM does.

Environment:
  FASTATTN_CUDA=auto|0|1   compile the CUDA kernels (auto: when torch is a CUDA build and nvcc
                           is found)
  TORCH_CUDA_ARCH_LIST     CUDA archs, default "8.0;9.0"
  MAX_JOBS                 parallel compile jobs
  CMAKE_ARGS               extra arguments for the CMake configure step
  FASTATTN_DEBUG_CHECKS=1  bounds checks inside the kernels
  CUDA_HOME                CUDA toolkit root (default /usr/local/cuda)
"""
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
DEFAULT_CUDA_ARCHS = "8.0;9.0"


def _find_cuda_home() -> str | None:
    for candidate in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if candidate and Path(candidate, "bin", "nvcc").exists():
            return candidate
    nvcc = shutil.which("nvcc")
    if nvcc:
        # /usr/local/bin/nvcc may be a wrapper; resolve symlinks to find the real toolkit.
        real = Path(nvcc).resolve().parent.parent
        if (real / "include" / "cuda_runtime.h").exists():
            return str(real)
    return None


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
                "(install a CUDA build of torch and set CUDA_HOME to the toolkit root)")
        return True
    if mode != "auto":
        raise RuntimeError(f"FASTATTN_CUDA must be auto, 0 or 1, got {mode!r}")
    return available


class CMakeExtension(Extension):
    def __init__(self, name: str):
        super().__init__(name, sources=[])


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
        cuda_home = _find_cuda_home()
        use_cuda = _cuda_enabled(torch.version.cuda, cuda_home)
        archs = os.environ.get("TORCH_CUDA_ARCH_LIST", DEFAULT_CUDA_ARCHS)
        tag = f"torch{torch.__version__}-{'cuda' if use_cuda else 'cpu'}-py{sys.version_info[0]}{sys.version_info[1]}"
        build_dir = ROOT / "build" / tag
        build_dir.mkdir(parents=True, exist_ok=True)

        env = dict(os.environ)
        env["TORCH_CUDA_ARCH_LIST"] = archs
        cmake_args = [
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-DFASTATTN_OUTPUT_DIR={build_dir / 'out'}",
            f"-DFASTATTN_CUDA={'ON' if use_cuda else 'OFF'}",
            f"-DFASTATTN_DEBUG_CHECKS={'ON' if os.environ.get('FASTATTN_DEBUG_CHECKS') == '1' else 'OFF'}",
            "-DCMAKE_BUILD_TYPE=Release",
        ]
        if cuda_home:
            # Torch's cmake config looks for a toolkit whenever torch is a CUDA build.
            cmake_args.append(f"-DCUDA_TOOLKIT_ROOT_DIR={cuda_home}")
            env["CUDA_HOME"] = cuda_home
        if shutil.which("ninja") or _ninja_from_pip():
            cmake_args += ["-G", "Ninja"]
            ninja = shutil.which("ninja") or _ninja_from_pip()
            cmake_args.append(f"-DCMAKE_MAKE_PROGRAM={ninja}")
        cmake_args += shlex.split(os.environ.get("CMAKE_ARGS", ""))

        cmake = _cmake_executable()
        jobs = os.environ.get("MAX_JOBS") or str(os.cpu_count() or 1)
        print(f"fastattn: building {tag}, CUDA {'on, archs ' + archs if use_cuda else 'off'}, {jobs} jobs",
              flush=True)
        subprocess.run([cmake, "-S", str(ROOT), "-B", str(build_dir), *cmake_args], check=True, env=env)
        subprocess.run([cmake, "--build", str(build_dir), "--parallel", jobs], check=True, env=env)
        # Each (torch, CUDA) configuration builds in its own folder; its result is copied to
        # where setuptools expects it.
        _replace_file(build_dir / "out" / target.name, target)


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
)
