"""Tests of fastattn's Philox-4x32-10 stream (fastattn/reference/random.py), which every backend's
dropout draws from (csrc/common/philox.h, fastattn/triton/random.py): a scalar Philox on Python
ints, checked against Random123's known-answer vectors, is the independent definition; the
reference's batched implementation and its dropout numbers must equal it bit for bit. That each
kernel drops exactly these elements is tested per op (test_positional.py, test_attention.py,
test_lstm.py, ...).
"""

from __future__ import annotations

import pytest
import torch

from fastattn.reference import random as philox_ref

_M32 = 0xFFFFFFFF


def philox_scalar(counter, key):
    """Philox-4x32-10 (Salmon et al. 2011) on Python ints."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for _ in range(10):
        p0 = 0xD2511F53 * c0
        p1 = 0xCD9E8D57 * c2
        c0, c1, c2, c3 = (
            ((p1 >> 32) ^ c1 ^ k0) & _M32,
            p1 & _M32,
            ((p0 >> 32) ^ c3 ^ k1) & _M32,
            p0 & _M32,
        )
        k0 = (k0 + 0x9E3779B9) & _M32
        k1 = (k1 + 0xBB67AE85) & _M32
    return [c0, c1, c2, c3]


def uniform_scalar(seed: int, stream: int, element: int) -> float:
    block = element // 4
    words = philox_scalar(
        (block & _M32, block >> 32, stream & _M32, stream >> 32), (seed & _M32, seed >> 32)
    )
    return (words[element % 4] >> 8) / 2**24


def test_philox_scalar_known_answers():
    """The scalar implementation above reproduces Random123's known-answer vectors."""
    assert philox_scalar((0, 0, 0, 0), (0, 0)) == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    assert philox_scalar((_M32,) * 4, (_M32, _M32)) == [
        0x408F276D,
        0x41C83B0E,
        0xA20BC7C6,
        0x6D5451FD,
    ]
    assert philox_scalar(
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0)
    ) == [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]


PHILOX_CASES = [
    ((0, 0, 0, 0), (0, 0)),
    ((_M32, _M32, _M32, _M32), (_M32, _M32)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0)),
    ((1, 0, 7, 0), (123, 0)),
    ((0xDEADBEEF, 5, 0x80000000, 0x7FFFFFFF), (0xFFFFFFFE, 1)),
]


def test_reference_philox_matches_scalar():
    for counter, key in PHILOX_CASES:
        ctr = [torch.tensor([c], dtype=torch.int64) for c in counter]
        words = philox_ref.philox4x32_10(*ctr, *key)
        assert [int(w) for w in words] == philox_scalar(counter, key), (counter, key)
    # batched: one tensor per counter word holding every case, key words as 0-dim tensors
    ctr = [torch.tensor(word, dtype=torch.int64) for word in zip(*[c for c, _ in PHILOX_CASES])]
    key = (torch.tensor(0x1234ABCD), torch.tensor(0x0F0F0F0F))
    words = philox_ref.philox4x32_10(*ctr, *key)
    for i, (counter, _) in enumerate(PHILOX_CASES):
        assert [int(w[i]) for w in words] == philox_scalar(counter, (0x1234ABCD, 0x0F0F0F0F))


@pytest.mark.parametrize(
    "seed,stream", [(0, 0), (123, 456), (2**62 - 1, 2**40 + 5), (0xFFFFFFFF, 0x100000000)]
)
def test_reference_dropout_uniform_matches_scalar(seed, stream):
    elements = [0, 1, 2, 3, 4, 5, 7, 1023, 2**32 + 1, 2**34 + 3, 4 * 2**33 + 2]
    u = philox_ref.dropout_uniform(
        torch.tensor([seed, stream]), torch.tensor(elements, dtype=torch.int64)
    )
    assert u.dtype == torch.float32
    for e, value in zip(elements, u.tolist()):
        assert value == uniform_scalar(seed, stream, e), (seed, stream, e)
    keep = philox_ref.dropout_keep_mask(torch.tensor([seed, stream]), (2, 3), 0.5)
    expected = [
        [uniform_scalar(seed, stream, 3 * r + c) >= 0.5 for c in range(3)] for r in range(2)
    ]
    assert keep.tolist() == expected
