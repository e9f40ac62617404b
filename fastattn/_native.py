"""Loads the compiled extension fastattn._C (torch must be imported first: libc10.so)."""
from __future__ import annotations

import torch  # noqa: F401  (loads libc10 / libtorch before the extension)

C = None
IMPORT_ERROR: str | None = None
try:
    from . import _C as C  # type: ignore[no-redef]
except Exception as exc:  # the pure-Python parts (reference, triton) still work
    IMPORT_ERROR = f"{type(exc).__name__}: {exc}"
