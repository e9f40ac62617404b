"""Test support: output poisoning.

With poisoning on, every op fills the outputs it allocates with NaN before its kernel runs
(native ops through fastattn._C, Triton launchers through `poison`), so an element that a
kernel forgets to write shows up as NaN. The test suite turns it on for every test.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from . import _native

_poison = False


def set_poison(on: bool) -> None:
    global _poison
    _poison = bool(on)
    _native.set_poison(_poison)


@contextlib.contextmanager
def poison_outputs(on: bool = True) -> Iterator[None]:
    previous = _poison
    set_poison(on)
    try:
        yield
    finally:
        set_poison(previous)


def poison(t: torch.Tensor) -> torch.Tensor:
    """Fill a freshly allocated floating output with NaN when poisoning is on; returns t."""
    if _poison and t.is_floating_point() and t.numel() > 0 and not torch.compiler.is_compiling():
        t.fill_(float("nan"))
    return t
