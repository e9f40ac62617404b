"""Which CUDA toolkit fastattn's build compiles with (used by setup.py and gpu_suite.sh).

    python tools/cuda_toolkit.py     # prints the toolkit root; exit status 1 when none is found

The order, first acceptable wins:
  1. CUDA_HOME, then CUDA_PATH, when set: the user's choice, so one that is not a toolkit is an
     error (a silently ignored CUDA_HOME would build against another toolkit, or without CUDA);
  2. /usr/local/cuda, the toolkit installers' own link to the current version;
  3. the nvcc on PATH: its real location (symlinks resolved), else the root that nvcc itself
     reports (`nvcc --dryrun` prints `TOP=...`), which also sees through a wrapper script such
     as a `/usr/local/bin/nvcc` that runs `exec /usr/local/cuda-13.0/bin/nvcc "$@"`: the
     parent of its folder, `/usr/local`, is no toolkit and broke the CMake configure.
A candidate is accepted only if it has bin/nvcc, include/cuda_runtime.h and the runtime
library (lib64/, lib/ or targets/*/lib/libcudart.so).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path


class ToolkitError(RuntimeError):
    """CUDA_HOME or CUDA_PATH names a folder that is not a CUDA toolkit."""


def toolkit_problem(root: str | os.PathLike) -> str | None:
    """Why `root` is not a usable CUDA toolkit, or None when it is one."""
    path = Path(root)
    if not (path / "bin" / "nvcc").is_file():
        return f"no bin/nvcc in {path}"
    if not (path / "include" / "cuda_runtime.h").is_file():
        return f"no include/cuda_runtime.h in {path}"
    libs = [path / "lib64", path / "lib", *sorted(path.glob("targets/*/lib"))]
    if not any(any(lib.glob("libcudart.so*")) for lib in libs if lib.is_dir()):
        return f"no libcudart.so in {path}/lib64, lib or targets/*/lib"
    return None


def _root_reported_by(nvcc: str, run: Callable[..., subprocess.CompletedProcess]) -> str | None:
    """The toolkit root that `nvcc --dryrun` reports (its `TOP=` line), or None."""
    try:
        # --dryrun prints the steps (TOP= first) without running them.
        result = run(
            [nvcc, "--dryrun", "-x", "cu", "-E", os.devnull],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    for line in (result.stdout or "").splitlines() + (result.stderr or "").splitlines():
        line = line.strip().removeprefix("#$").strip()
        if line.startswith("TOP="):
            return os.path.normpath(line[len("TOP=") :].strip().strip('"'))
    return None


def find_cuda_home(
    environ: Mapping[str, str] | None = None,
    which: Callable[[str], str | None] = shutil.which,
    run: Callable[..., subprocess.CompletedProcess] = subprocess.run,
    default_root: str = "/usr/local/cuda",
) -> str | None:
    """The CUDA toolkit root to build with, or None when there is none (see the module doc).

    Raises ToolkitError when CUDA_HOME or CUDA_PATH is set to something that is not a toolkit.
    """
    environ = os.environ if environ is None else environ
    for name in ("CUDA_HOME", "CUDA_PATH"):
        value = environ.get(name)
        if value:
            problem = toolkit_problem(value)
            if problem:
                raise ToolkitError(f"{name}={value} is not a CUDA toolkit: {problem}")
            return value
    if toolkit_problem(default_root) is None:
        return default_root
    nvcc = which("nvcc")
    if not nvcc:
        return None
    for candidate in (Path(nvcc).resolve().parent.parent, _root_reported_by(nvcc, run)):
        if candidate is not None and toolkit_problem(candidate) is None:
            return str(candidate)
    return None


if __name__ == "__main__":
    try:
        home = find_cuda_home()
    except ToolkitError as exc:
        sys.exit(f"cuda_toolkit: {exc}")
    if home is None:
        sys.exit("cuda_toolkit: no CUDA toolkit found (set CUDA_HOME)")
    print(home)
