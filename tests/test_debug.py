"""Tests of output poisoning (fastattn/_debug.py): with it on, which tests/conftest.py does for
every test, ops fill the outputs they allocate with NaN before their kernels run, so an element
a kernel forgets to write fails the comparison instead of passing with stale memory.
"""

import torch

from fastattn import _debug


def test_output_poisoning_is_active():
    """On in tests, switchable by context, and a no-op on integer tensors (no NaN)."""
    assert _debug._poison  # the autouse fixture in conftest.py
    assert torch.isnan(_debug.poison(torch.empty(3))).all()
    with _debug.poison_outputs(False):
        assert torch.equal(_debug.poison(torch.zeros(3)), torch.zeros(3))
    assert _debug._poison
    with _debug.poison_outputs(True):
        assert torch.isnan(_debug.poison(torch.zeros(3))).all()
        assert torch.equal(
            _debug.poison(torch.zeros(3, dtype=torch.long)), torch.zeros(3, dtype=torch.long)
        )
