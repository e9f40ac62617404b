"""tools/compile_cache.py, the build's C++ compiler cache: an object is reused only for the same
compiler, code-generation flags and preprocessed source, wherever the headers were found."""

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "compile_cache.py"
COMPILER = shutil.which("c++") or shutil.which("g++")

pytestmark = pytest.mark.skipif(
    COMPILER is None or not TOOL.exists(), reason="needs a C++ compiler and tools/"
)


def _load():
    spec = importlib.util.spec_from_file_location("compile_cache", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tree(root: Path, value: int) -> Path:
    """A source including a header from `root/include` that defines VALUE."""
    (root / "include").mkdir(parents=True)
    (root / "include" / "value.h").write_text(f"#define VALUE {value}\n")
    source = root / "unit.cpp"
    source.write_text('#include "value.h"\nint value() { return VALUE; }\n')
    return source


def _compile(cache: Path, root: Path, source: Path, *flags: str) -> subprocess.CompletedProcess:
    obj = root / "unit.o"
    args = [*flags, "-I", str(root / "include"), "-MD", "-MT", str(obj), "-MF", f"{obj}.d"]
    args += ["-o", str(obj), "-c", str(source)]
    return subprocess.run(
        [sys.executable, str(TOOL), str(cache), COMPILER, *args], capture_output=True, text=True
    )


def _stored(cache: Path) -> list[Path]:
    return sorted(cache.rglob("*.o"))


def test_same_source_elsewhere_is_a_hit_and_writes_the_dependency_file(tmp_path):
    cache = tmp_path / "cache"
    first, second = tmp_path / "a", tmp_path / "b"
    assert _compile(cache, first, _tree(first, 7), "-O2").returncode == 0
    assert len(_stored(cache)) == 1
    assert _compile(cache, second, _tree(second, 7), "-O2").returncode == 0
    assert len(_stored(cache)) == 1  # found, not compiled again
    assert (second / "unit.o").read_bytes() == (first / "unit.o").read_bytes()
    assert str(second / "include" / "value.h") in (second / "unit.o.d").read_text()


def test_a_different_header_or_flag_is_a_miss(tmp_path):
    cache = tmp_path / "cache"
    base = tmp_path / "base"
    assert _compile(cache, base, _tree(base, 7), "-O2").returncode == 0
    header = tmp_path / "header"
    assert _compile(cache, header, _tree(header, 8), "-O2").returncode == 0
    flag = tmp_path / "flag"
    assert _compile(cache, flag, _tree(flag, 7), "-O1").returncode == 0
    assert len(_stored(cache)) == 3
    assert (header / "unit.o").read_bytes() != (base / "unit.o").read_bytes()


def test_a_failing_compile_reports_and_stores_nothing(tmp_path):
    cache = tmp_path / "cache"
    root = tmp_path / "bad"
    source = _tree(root, 7)
    source.write_text("int value() { return missing; }\n")
    proc = _compile(cache, root, source, "-O2")
    assert proc.returncode != 0 and "missing" in proc.stderr
    assert _stored(cache) == []


def test_only_single_source_compiles_are_keyed():
    tool = _load()
    assert tool.split_command(["-o", "lib.so", "a.o", "b.o"])[0] is None  # a link
    source, output, key = tool.split_command(
        ["-DX=1", "-I/somewhere", "-isystem", "/other", "-O3", "-o", "u.o", "-c", "u.cpp"]
    )
    assert (source, output, key) == ("u.cpp", "u.o", ["-DX=1", "-O3"])
