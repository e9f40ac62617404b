"""The build's choices that users meet first: which CUDA toolkit setup.py compiles with
(tools/cuda_toolkit.py) and how the environment report reads an arch list."""

import importlib.util
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from fastattn.__main__ import arch_coverage

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("cuda_toolkit", ROOT / "tools" / "cuda_toolkit.py")
cuda_toolkit = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cuda_toolkit)


def _executable(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def _toolkit(root: Path, *, header=True, lib="lib64") -> Path:
    """A fake toolkit whose nvcc answers --dryrun the way nvcc does (`#$ TOP=<root>/bin/..`)."""
    _executable(root / "bin" / "nvcc", f'#!/bin/sh\necho "#$ TOP={root}/bin/.." >&2\n')
    if header:
        (root / "include").mkdir(parents=True)
        (root / "include" / "cuda_runtime.h").write_text("")
    if lib:
        (root / lib).mkdir(parents=True)
        (root / lib / "libcudart.so.13").write_text("")
    return root


def _find(environ=None, nvcc=None, default_root="/nonexistent/cuda"):
    return cuda_toolkit.find_cuda_home(
        environ or {}, which=lambda name: nvcc, default_root=str(default_root)
    )


def test_cuda_home_from_the_environment_first(tmp_path):
    chosen = _toolkit(tmp_path / "chosen")
    default = _toolkit(tmp_path / "default")
    assert _find({"CUDA_HOME": str(chosen)}, default_root=default) == str(chosen)
    assert _find({"CUDA_PATH": str(chosen)}, default_root=default) == str(chosen)


@pytest.mark.parametrize("name", ["CUDA_HOME", "CUDA_PATH"])
def test_a_cuda_home_that_is_no_toolkit_is_an_error(tmp_path, name):
    broken = _toolkit(tmp_path / "broken", header=False)
    with pytest.raises(cuda_toolkit.ToolkitError, match=f"{name}=.*no include/cuda_runtime.h"):
        _find({name: str(broken)}, default_root=_toolkit(tmp_path / "default"))


def test_usr_local_cuda_is_preferred_over_nvcc_on_path(tmp_path):
    default = _toolkit(tmp_path / "cuda")
    other = _toolkit(tmp_path / "other")
    assert _find(nvcc=str(other / "bin" / "nvcc"), default_root=default) == str(default)


def test_a_wrapper_nvcc_yields_the_toolkit_it_runs_not_its_folder(tmp_path):
    real = _toolkit(tmp_path / "cuda-13.0")
    # as /usr/local/bin/nvcc on the build machines: a script, so resolving links does not help,
    # and the parent of its folder (here tmp_path/usr_local) has no headers or libraries
    wrapper = _executable(
        tmp_path / "usr_local" / "bin" / "nvcc", f'#!/bin/sh\nexec {real}/bin/nvcc "$@"\n'
    )
    assert _find(nvcc=str(wrapper)) == str(real)


def test_a_symlinked_nvcc_resolves_to_its_toolkit(tmp_path):
    real = _toolkit(tmp_path / "cuda-13.0", lib="targets/x86_64-linux/lib")
    link = tmp_path / "bin" / "nvcc"
    link.parent.mkdir()
    link.symlink_to(real / "bin" / "nvcc")
    assert _find(nvcc=str(link)) == str(real)


def test_incomplete_toolkits_are_skipped(tmp_path):
    no_lib = _toolkit(tmp_path / "cuda", lib=None)  # /usr/local/cuda without libcudart
    assert "libcudart" in cuda_toolkit.toolkit_problem(no_lib)
    assert _find(default_root=no_lib) is None
    assert _find(nvcc=str(no_lib / "bin" / "nvcc"), default_root=no_lib) is None


def test_no_toolkit_at_all():
    assert _find() is None


def test_command_line_prints_the_root(tmp_path):
    root = _toolkit(tmp_path / "cuda")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "cuda_toolkit.py")],
        env=dict(os.environ, CUDA_HOME=str(root)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0 and proc.stdout.strip() == str(root), proc.stderr
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "cuda_toolkit.py")],
        env=dict(os.environ, CUDA_HOME=str(tmp_path / "missing")),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1 and "CUDA_HOME=" in proc.stderr


@pytest.mark.parametrize(
    "archs, cc, expected",
    [
        ("8.0;9.0+PTX", (8, 0), "native code for sm_80"),
        ("8.0;9.0+PTX", (8, 6), "native code for sm_80"),  # same major: sm_80 code runs on 8.6
        ("8.0;9.0+PTX", (8, 9), "native code for sm_80"),
        ("8.0;9.0+PTX", (9, 0), "native code for sm_90"),
        ("8.0;9.0+PTX", (10, 0), "compute_90 PTX"),  # Blackwell through the driver's JIT
        ("8.0;9.0+PTX", (12, 0), "compute_90 PTX"),
        ("8.0;9.0+PTX", (7, 5), "NOT COVERED"),
        ("9.0", (8, 0), "NOT COVERED"),
        ("9.0", (12, 0), "NOT COVERED"),  # no PTX: newer majors cannot run sm_90
        ("8.6", (8, 0), "NOT COVERED"),  # sm_86 code needs minor >= 6
        ("9.0a;12.0", (9, 0), "native code for sm_90"),
        ("9.0a", (10, 0), "NOT COVERED"),
        ("8.0 12.0", (12, 1), "native code for sm_120"),
    ],
)
def test_arch_coverage(archs, cc, expected):
    assert expected in arch_coverage(archs, *cc)


def test_pyproject_configures_without_warnings():
    """setuptools reads pyproject.toml without a deprecation warning (a TOML-table license
    was deprecated, with builds refused from 2027-02-18)."""
    import warnings

    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dist = apply_configuration(Distribution(), ROOT / "pyproject.toml")
    assert dist.metadata.license_expression == "BSD-3-Clause"
