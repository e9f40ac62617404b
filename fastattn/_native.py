"""Loads the compiled extension: fastattn._C (the op library, the CPU kernels and the build
report; torch must be imported first: libtorch_cpu.so) and, when torch has CUDA, the CUDA
kernels' library fastattn/_C_cuda.so, which registers their CUDA kernels with the ops. Both are
on libtorch's stable ABI (docs/design/stable_abi.md), so one build serves CPU-only and CUDA
torch."""

from __future__ import annotations

import contextlib
import ctypes
from pathlib import Path

import torch  # loads libtorch before the extension

C = None
IMPORT_ERROR: str | None = None
_package = Path(__file__).resolve().parent
try:
    from . import _C as C  # type: ignore[attr-defined,no-redef]  # noqa: F401  (the extension itself)
except Exception as exc:  # the pure-Python parts (reference, triton) still work
    IMPORT_ERROR = f"{type(exc).__name__}: {exc}"
    _package = Path(__file__).resolve().parent
    if not any(_package.glob("_C*.so")):
        # Python's message here ("partially initialized module ... circular import") misleads.
        IMPORT_ERROR = (
            f"fastattn._C is not built in {_package} (a source checkout without a "
            "build imported instead of the installed package? Build it there with "
            "`pip install --no-build-isolation -e .`, or run from another folder)"
        )


# The native ops are on libtorch's stable ABI, across which every C++ exception arrives as
# RuntimeError; checks that Python raises as ValueError tag their message with this instead.
VALUE_ERROR_TAG = "[ValueError] "


def _as_value_error(exc: BaseException) -> ValueError | None:
    """The ValueError a native op's RuntimeError stands for (its message from VALUE_ERROR_TAG
    on), or None when it carries no tag."""
    message = str(exc)
    at = message.find(VALUE_ERROR_TAG)
    if at < 0:
        return None
    return ValueError(message[at + len(VALUE_ERROR_TAG) :].split("\n")[0])


class _ValueErrors:
    """The context manager value_errors returns in eager mode: a class, because a
    generator-based one is set up on every call of the native ops that use it, each decoding
    step among them."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, exc, traceback) -> None:
        if kind is None or not issubclass(kind, RuntimeError):
            return
        error = _as_value_error(exc)
        if error is not None:
            raise error from None


_VALUE_ERRORS = _ValueErrors()


@contextlib.contextmanager
def _traced_value_errors():
    """value_errors under torch.compile: TorchDynamo before torch 2.14 enters generator-based
    context managers but not a user class's."""
    try:
        yield
    except RuntimeError as exc:
        error = _as_value_error(exc)
        if error is None:
            raise
        raise error from None


def value_errors():
    """Re-raises a native op's RuntimeError tagged VALUE_ERROR_TAG as ValueError (its message
    from the tag on): `with value_errors(): ...`."""
    if torch.compiler.is_compiling():
        return _traced_value_errors()
    return _VALUE_ERRORS


CUDA_LIBRARY = _package / "_C_cuda.so"
CUDA = None  # ctypes handle of _C_cuda.so once loaded
# "loaded", or why the CUDA kernels are not: "not built: ...", "not loaded: torch has no CUDA",
# "failed to load: ..."
CUDA_STATUS = "not built: fastattn was compiled without CUDA"


def _load_cuda() -> None:
    global CUDA, CUDA_STATUS
    if C is None:
        CUDA_STATUS = "not loaded: fastattn._C did not import"
    elif not CUDA_LIBRARY.exists():
        CUDA_STATUS = "not built: fastattn was compiled without CUDA"
    elif torch.version.cuda is None:
        CUDA_STATUS = "not loaded: torch has no CUDA"
    else:
        try:
            torch.ops.load_library(str(CUDA_LIBRARY))  # registers the CUDA kernels
            CUDA = ctypes.CDLL(str(CUDA_LIBRARY))  # the same, already loaded library
            CUDA_STATUS = "loaded"
        except Exception as exc:  # a CUDA torch whose CUDA libraries do not load
            CUDA_STATUS = f"failed to load: {type(exc).__name__}: {exc}"


_load_cuda()


def set_poison(on: bool) -> None:
    """Tests: NaN-fill every output the native ops allocate (both libraries)."""
    if C is not None:
        C._set_poison(bool(on))
    if CUDA is not None:
        CUDA.fastattn_cuda_set_poison(ctypes.c_bool(bool(on)))
