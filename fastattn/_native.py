"""Loads the compiled extension fastattn._C (torch must be imported first: libc10.so)."""

from __future__ import annotations

import contextlib

import torch  # noqa: F401  (loads libc10 / libtorch before the extension)

C = None
IMPORT_ERROR: str | None = None
try:
    from . import _C as C  # type: ignore[no-redef]  # noqa: F401  (the extension itself)
except Exception as exc:  # the pure-Python parts (reference, triton) still work
    IMPORT_ERROR = f"{type(exc).__name__}: {exc}"
    from pathlib import Path

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


@contextlib.contextmanager
def value_errors():
    """Re-raises a native op's RuntimeError tagged VALUE_ERROR_TAG as ValueError (its message
    from the tag on)."""
    try:
        yield
    except RuntimeError as exc:
        message = str(exc)
        at = message.find(VALUE_ERROR_TAG)
        if at < 0:
            raise
        raise ValueError(message[at + len(VALUE_ERROR_TAG) :].split("\n")[0]) from None
