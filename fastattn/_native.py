"""Loads the compiled extension fastattn._C (torch must be imported first: libc10.so)."""

from __future__ import annotations

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
