"""A compiler cache for the C++ objects of the build (CMake's CXX compiler launcher).

    python tools/compile_cache.py CACHE_DIR COMPILER ARGS...

CMakeLists.txt puts it in front of every C++ compile when no ccache is installed, with
CACHE_DIR = build/compile-cache of the checkout. The CPU kernels (the per-ISA copies of
csrc/*/*_cpu_kernel.cpp, most of a build's compile time) include no torch header, so a build
against another torch (each (torch, CUDA) configuration has its own CMake folder under build/)
gets them from here instead of compiling them again.

The key of an object is what determines it: the compiler (its path, size and modification
time, and its --version), the arguments that shape code generation, and the preprocessed
source. Left out of the key: the output and dependency-file names, the include directories
and the source's path (their effect is the preprocessed text, which is in the key), and the
preprocessor's line markers (file paths only). The preprocessing run is the compile command
with -E, so it also writes the dependency file that ninja reads. A hit copies the stored
object to the output path; a miss compiles, then stores the object. Any other command (not one
-c compile of one source into one -o object) runs unchanged.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# Options whose value (the next argument, or glued to the option) names a file or folder that
# the preprocessed text or the output location already accounts for.
PATH_OPTIONS = ("-o", "-MF", "-MT", "-MQ", "-I", "-isystem", "-iquote", "-idirafter", "-include")
FLAG_OPTIONS = ("-MD", "-MMD", "-c")
SOURCE_SUFFIXES = (".c", ".cc", ".cpp", ".cxx")


def split_command(args: list[str]) -> tuple[str | None, str | None, list[str]]:
    """(source, output, the arguments of the key) of a compile command, or (None, None, [])
    when it is not a single-source -c compile with an -o output."""
    if "-c" not in args:
        return None, None, []
    source = output = None
    kept: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        glued = next((o for o in PATH_OPTIONS if arg.startswith(o) and arg != o), None)
        if arg in PATH_OPTIONS:
            if arg == "-o" and i + 1 < len(args):
                output = args[i + 1]
            i += 2
            continue
        if glued is not None and glued in ("-o", "-I", "-MF", "-MT", "-MQ"):
            if glued == "-o":
                output = arg[2:]
            i += 1
            continue
        if arg in FLAG_OPTIONS:
            i += 1
            continue
        if not arg.startswith("-") and arg.endswith(SOURCE_SUFFIXES):
            if source is not None:
                return None, None, []
            source = arg
            i += 1
            continue
        kept.append(arg)
        i += 1
    if source is None or output is None:
        return None, None, []
    return source, output, kept


def preprocess_command(compiler: str, args: list[str]) -> list[str]:
    """The compile command turned into a preprocessing run writing the text to stdout."""
    out: list[str] = [compiler]
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "-c":
            out.append("-E")
        elif arg == "-o":
            out += ["-o", "-"]
            i += 1
        elif arg.startswith("-o") and len(arg) > 2:
            out += ["-o", "-"]
        else:
            out.append(arg)
        i += 1
    return out


def compiler_identity(compiler: str) -> bytes:
    path = shutil.which(compiler) or compiler
    stat = os.stat(path)
    version = subprocess.run([path, "--version"], capture_output=True, check=True).stdout
    return f"{os.path.realpath(path)}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode() + version


def without_line_markers(text: bytes) -> bytes:
    return b"\n".join(
        line for line in text.split(b"\n") if not (line.startswith(b"# ") or line == b"#")
    )


def main(argv: list[str]) -> int:
    cache_dir, compiler, args = Path(argv[1]), argv[2], argv[3:]
    source, output, key_args = split_command(args)
    if source is None:
        return subprocess.call([compiler, *args])
    pre = subprocess.run(preprocess_command(compiler, args), capture_output=True)
    if pre.returncode != 0:  # let the real compile report the error
        return subprocess.call([compiler, *args])
    digest = hashlib.sha256()
    text = without_line_markers(pre.stdout)
    for part in (compiler_identity(compiler), "\0".join(key_args).encode(), text):
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)
    key = digest.hexdigest()
    stored = cache_dir / key[:2] / f"{key}.o"
    if stored.exists():
        shutil.copyfile(stored, output)
        return 0
    status = subprocess.call([compiler, *args])
    if status == 0:
        stored.parent.mkdir(parents=True, exist_ok=True)
        # A temporary file, then a rename: a parallel job never reads half an object.
        with tempfile.NamedTemporaryFile(dir=stored.parent, delete=False) as staging:
            staging.write(Path(output).read_bytes())
        os.replace(staging.name, stored)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv))
