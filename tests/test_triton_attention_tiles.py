"""The tile ranges of the Triton attention kernels (fastattn/triton/attention_common.py) against
brute force: which key tiles a query tile walks (key_range) and which of them are interior
(interior_key_range: every key in range and visible to every row, so the kernels skip the
band test there), and the same for the query tiles of a key tile (query_range,
interior_query_range: every row sees every key of the tile). Without a lower side to the band
the kernels compile no stretch before the interior (forward, dQ) or after it (dK/dV), so those
must then be empty. An interior range one tile too wide lets hidden keys through only
where a window or the causal diagonal crosses that tile, which the attention grids reach
for a few shapes; here every shape class is enumerated. The ranges must also be the widest
correct ones (a narrower interior is correct but slow) and, with the edge stretches, walk
exactly the tiles of [lo, hi).

Runs the device functions under Triton's interpreter (one program per case) on CPU tensors.
"""

from __future__ import annotations

import random

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from fastattn.triton import interpreting  # noqa: E402
from fastattn.triton.attention_common import (  # noqa: E402
    interior_key_range,
    interior_query_range,
    key_range,
    query_range,
)

pytestmark = pytest.mark.skipif(
    not interpreting(torch.device("cpu")), reason="runs the device functions on the interpreter"
)

UNBOUNDED = 2**30


@triton.jit
def _ranges_kernel(Cases, Out, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Case c = (tile start, Lq, Lk, window_lo, window_hi) -> key_range and interior_key_range
    of the query tile starting there, then query_range and interior_query_range of the key
    tile starting there (8 int32)."""
    c = tl.program_id(0)
    start = tl.load(Cases + c * 5)
    lq = tl.load(Cases + c * 5 + 1)
    lk = tl.load(Cases + c * 5 + 2)
    w_lo = tl.load(Cases + c * 5 + 3)
    w_hi = tl.load(Cases + c * 5 + 4)
    lo, hi = key_range(start, lk, w_lo, w_hi, BLOCK_M, BLOCK_N)
    int_lo, int_hi = interior_key_range(start, lk, w_lo, w_hi, lo, hi, BLOCK_M, BLOCK_N)
    qlo, qhi = query_range(start, lq, w_lo, w_hi, BLOCK_M, BLOCK_N)
    qint_lo, qint_hi = interior_query_range(start, w_lo, w_hi, qlo, qhi, BLOCK_M, BLOCK_N)
    tl.store(Out + c * 8 + 0, lo)
    tl.store(Out + c * 8 + 1, hi)
    tl.store(Out + c * 8 + 2, int_lo)
    tl.store(Out + c * 8 + 3, int_hi)
    tl.store(Out + c * 8 + 4, qlo)
    tl.store(Out + c * 8 + 5, qhi)
    tl.store(Out + c * 8 + 6, qint_lo)
    tl.store(Out + c * 8 + 7, qint_hi)


def _bands(lq: int, lk: int, rng: random.Random) -> list[tuple[int, int]]:
    """(window_lo, window_hi) of the kinds the ops pass: none, causal top-left and bottom-right,
    sliding windows on either alignment, one-sided windows, and a band that hides some rows."""
    shift = lk - lq
    return [
        (-UNBOUNDED, UNBOUNDED),
        (-UNBOUNDED, 0),
        (-UNBOUNDED, shift),
        (shift - rng.randrange(0, 70), shift + rng.randrange(0, 20)),
        (-rng.randrange(0, 40), rng.randrange(0, 40)),
        (shift - rng.randrange(0, 50), UNBOUNDED),
        (-rng.randrange(0, 50) - lq, -lq + rng.randrange(0, 30)),  # hides the first rows
    ]


def _cases(block_m: int, block_n: int, seed: int) -> list[tuple[int, int, int, int, int]]:
    rng = random.Random(seed)
    cases = []
    for _ in range(8):
        lq, lk = rng.randrange(1, 260), rng.randrange(1, 260)
        for w_lo, w_hi in _bands(lq, lk, rng):
            # Query-tile starts for the key side, key-tile starts for the query side: both
            # tile grids, so every start is one or the other.
            starts = set(range(0, lq, block_m)) | set(range(0, lk, block_n))
            for start in sorted(starts):
                cases.append((start, lq, lk, w_lo, w_hi))
    return cases


def _visible(i: int, j: int, lq: int, lk: int, w_lo: int, w_hi: int) -> bool:
    return i < lq and j < lk and i + w_lo <= j <= i + w_hi


def _stretches(lo: int, int_lo: int, int_hi: int, hi: int, block: int) -> list[int]:
    """The tile starts the kernels walk: the edge before, the interior, the edge after."""
    return [*range(lo, int_lo, block), *range(int_lo, int_hi, block), *range(int_hi, hi, block)]


def _check_key_side(case, got, block_m, block_n):
    start_m, lq, lk, w_lo, w_hi = case
    lo, hi, int_lo, int_hi = got
    rows = range(start_m, start_m + block_m)
    what = f"query tile {start_m} (Lq {lq}, Lk {lk}, band [{w_lo}, {w_hi}], {block_m}x{block_n})"
    walked = list(range(lo, hi, block_n))
    assert lo % block_n == 0 and lo >= 0, what
    # Every visible key of the tile's rows lies in a walked tile.
    for i in rows:
        for j in range(lk):
            if _visible(i, j, lq, lk, w_lo, w_hi):
                assert lo <= j < max(hi, lo), f"{what}: key {j} seen by row {i} is not walked"
    assert _stretches(lo, int_lo, int_hi, hi, block_n) == walked, (what, got)
    # Interior tiles: exactly the walked tiles whose every key is in range and in every row's
    # band (rows past Lq included: their results are never stored).
    full = [
        t
        for t in walked
        if t + block_n <= lk and all(i + w_lo <= t and t + block_n - 1 <= i + w_hi for i in rows)
    ]
    assert list(range(int_lo, int_hi, block_n)) == full, (what, got, full)
    if w_lo <= -UNBOUNDED:  # the kernels compile the stretch before the interior only with one
        assert int_lo == lo or int_lo >= hi, f"{what}: a stretch before the interior, no window"


def _check_query_side(case, got, block_m, block_n):
    start_n, lq, lk, w_lo, w_hi = case
    lo, hi, int_lo, int_hi = got
    keys = range(start_n, start_n + block_n)
    what = f"key tile {start_n} (Lq {lq}, Lk {lk}, band [{w_lo}, {w_hi}], {block_m}x{block_n})"
    walked = list(range(lo, hi, block_m))
    assert lo % block_m == 0 and lo >= 0, what
    for j in keys:
        for i in range(lq):
            if _visible(i, j, lq, lk, w_lo, w_hi):
                assert lo <= i < max(hi, lo), f"{what}: row {i} that sees key {j} is not walked"
    assert _stretches(lo, int_lo, int_hi, hi, block_m) == walked, (what, got)
    # Interior: every row in every key's band; rows and keys out of range may be in them (the
    # dK/dV kernel loads them as zeros).
    full = [
        t
        for t in walked
        if all(i + w_lo <= j <= i + w_hi for i in range(t, t + block_m) for j in keys)
    ]
    assert [t for t in range(int_lo, int_hi, block_m) if t < hi] == full, (what, got, full)
    if w_lo <= -UNBOUNDED:  # the kernels compile the stretch after the interior only with one
        assert not range(int_hi, hi, block_m), f"{what}: a stretch after the interior, no window"


@pytest.mark.parametrize("block_m,block_n", [(16, 16), (32, 16), (16, 64), (64, 32)])
def test_tile_ranges_match_brute_force(block_m, block_n):
    cases = _cases(block_m, block_n, seed=block_m * 1000 + block_n)
    args = torch.tensor(cases, dtype=torch.int32)
    out = torch.full((len(cases), 8), -7, dtype=torch.int32)
    _ranges_kernel[(len(cases),)](args, out, BLOCK_M=block_m, BLOCK_N=block_n)
    interior_tiles = 0
    for case, row in zip(cases, out.tolist()):
        if case[0] % block_m == 0 and case[0] < case[1]:
            _check_key_side(case, row[:4], block_m, block_n)
            interior_tiles += row[3] > row[2]
        if case[0] % block_n == 0 and case[0] < case[2]:
            _check_query_side(case, row[4:], block_m, block_n)
    assert interior_tiles > len(cases) // 10, "the cases hardly reach an interior"


# The kernels with small tiles: the interpreter's tile is otherwise as long as the sequence (up
# to 128), so few calls walk more than one stretch. With 16 x 16 tiles every case below walks
# edges before and after an interior, in the forward and both backward kernels.
SMALL_TILE_CASES = [
    # (feature of tests/test_attention.make_case, head dim, (Lq, Lk), dtype)
    ("causal", 32, (70, 90), torch.float16),
    ("causal_br", 32, (90, 61), torch.bfloat16),
    ("window", 16, (100, 100), torch.float16),
    ("gqa", 32, (45, 77), torch.bfloat16),
    ("padding", 16, (50, 83), torch.float16),
    ("alibi", 16, (64, 64), torch.bfloat16),
    ("dropout", 16, (40, 70), torch.float16),
    ("causal", 16, (48, 48), torch.float32),  # float32: every tile an edge tile (no INTERIOR)
]


@pytest.mark.parametrize("feature,D,lengths,dtype", SMALL_TILE_CASES)
def test_small_tiles_match_the_reference(monkeypatch, feature, D, lengths, dtype):
    from test_attention import check_against_reference, make_case

    import fastattn.triton.attention as triton_attention

    monkeypatch.setattr(triton_attention, "interpreter_block", lambda length: 16)
    q, k, v, kw = make_case(feature, D, *lengths, dtype, torch.device("cpu"))
    if feature == "window":
        kw["window"] = (45, 20)  # 16-row tiles share 50 keys: edges on both sides, interiors
    check_against_reference("triton", q, k, v, kw)
