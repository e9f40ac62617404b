"""Paged KV cache: attention_with_kvcache(..., block_table=) on every backend, and the block
allocator fastattn.nn.PagedKVCache.

A paged call is compared with the same call on a dense cache holding the same rows (gathered
through the table by the reference's gather_paged): the outputs, and the pools after the append
(the appended rows land at their table positions; blocks the call does not own are untouched).
Block sizes 16, 32, 48 (48 makes key tiles of the CPU kernel straddle blocks), random
non-contiguous tables with unused entries of -1, odd lengths, GQA, rotary, split-K.
"""

from __future__ import annotations

import pytest
import torch
from conftest import backend_device, require_kernel
from host_reads import assert_no_host_reads, device_checks, fake_cuda, force_device_checks

import fastattn
from fastattn.reference.attention_with_kvcache import gather_paged

pytestmark = pytest.mark.usefixtures("one_thread")


def paged_device(backend: str) -> torch.device:
    kernel = "attention_with_kvcache" if backend == "triton" else "attention_decode"
    require_kernel(kernel, backend)  # fails if the build lost it
    return backend_device(backend)


def paged_case(dtype, device, *, block_size, lengths, Lnew, Hq=4, Hkv=2, D=32, Dv=24, seed=0):
    """Pools, a random table (each sequence's blocks scattered through the pool, -1 past
    them), cache_seqlens, new tokens and rotary tables."""
    g = torch.Generator().manual_seed(seed * 101 + block_size)
    B = len(lengths)
    max_blocks = max(-(-(n + Lnew) // block_size) for n in lengths) + 1
    needed = [-(-(n + Lnew) // block_size) for n in lengths]
    num_blocks = sum(needed) + 5  # spare blocks the call must leave alone
    perm = torch.randperm(num_blocks, generator=g).to(torch.int32)
    table = torch.full((B, max_blocks), -1, dtype=torch.int32)
    start = 0
    for b, n in enumerate(needed):  # (no value reads: the CUDA cases build it on fake tensors)
        table[b, :n] = perm[start : start + n]
        start += n
    k_pool = torch.randn(num_blocks, Hkv, block_size, D, generator=g)
    v_pool = torch.randn(num_blocks, Hkv, block_size, Dv, generator=g)
    q = torch.randn(B, Hq, Lnew, D, generator=g)
    k_new = torch.randn(B, Hkv, Lnew, D, generator=g)
    v_new = torch.randn(B, Hkv, Lnew, Dv, generator=g)
    pe = fastattn.sinusoidal_table(max_blocks * block_size, D)
    cos, sin = pe[:, 1::2].contiguous(), pe[:, 0::2].contiguous()
    seqlens = torch.tensor(lengths, dtype=torch.int32)

    def to(t):
        return t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)

    return dict(
        q=to(q),
        k_pool=to(k_pool),
        v_pool=to(v_pool),
        table=table.to(device),
        seqlens=seqlens.to(device),
        k_new=to(k_new),
        v_new=to(v_new),
        cos=cos.to(device),
        sin=sin.to(device),
    )


def run_paged(c, backend, **kw):
    k_pool, v_pool = c["k_pool"].clone(), c["v_pool"].clone()
    out = fastattn.attention_with_kvcache(
        c["q"],
        k_pool,
        v_pool,
        cache_seqlens=c["seqlens"],
        k_new=c["k_new"],
        v_new=c["v_new"],
        rotary_cos=c["cos"],
        rotary_sin=c["sin"],
        block_table=c["table"],
        backend=backend,
        **kw,
    )
    assert fastattn.last_backend("attention_with_kvcache") == backend
    return out, k_pool, v_pool


def run_dense(c, backend, **kw):
    k_cache = gather_paged(c["k_pool"], c["table"]).clone()
    v_cache = gather_paged(c["v_pool"], c["table"]).clone()
    out = fastattn.attention_with_kvcache(
        c["q"],
        k_cache,
        v_cache,
        cache_seqlens=c["seqlens"],
        k_new=c["k_new"],
        v_new=c["v_new"],
        rotary_cos=c["cos"],
        rotary_sin=c["sin"],
        backend=backend,
        **kw,
    )
    return out, k_cache, v_cache


def owned_blocks(c):
    table, seqlens, Lnew = c["table"].cpu(), c["seqlens"].cpu(), c["k_new"].shape[2]
    bs = c["k_pool"].shape[2]
    owned = set()
    for b in range(table.shape[0]):
        owned.update(table[b, : -(-(int(seqlens[b]) + Lnew) // bs)].tolist())
    return owned


CASES = [
    # (block_size, lengths, Lnew, num_splits)
    (16, [0, 17, 70], 1, 0),
    (32, [5, 33, 100], 3, 2),
    (48, [47, 1, 130], 2, 3),
    (48, [95, 200, 0], 1, 1),
    # one sequence: the CPU kernel's tasks (every head of the sequence, whole blocks) split
    # its keys to keep two tasks
    (16, [150], 1, 0),
    (32, [77], 2, 0),
]


@pytest.mark.parametrize("dtype", (torch.float32, torch.float64))
@pytest.mark.parametrize("block_size", (16, 48))
def test_long_caches_stream_with_prefetches(dtype, block_size):
    """Caches larger than a CPU core's L2 (K and V: 12 MiB of float32, one thread): the CPU
    kernel prefetches the next key tile's cache lines while it computes the current one, a
    paged cache's block run by block run (48-row blocks: tiles straddle blocks). The same
    numbers as the dense cache and the reference."""
    device = paged_device("cpu")
    c = paged_case(dtype, device, block_size=block_size, lengths=[9000, 5003], Lnew=1, D=64, Dv=48)
    out, _, _ = run_paged(c, "cpu")
    dense, _, _ = run_dense(c, "cpu")
    ref, _, _ = run_dense(c, "reference")
    tol = {torch.float64: 1e-12, torch.float32: 2e-6}[dtype]
    torch.testing.assert_close(out, dense, rtol=tol, atol=tol)
    torch.testing.assert_close(out, ref, rtol=3 * tol, atol=3 * tol)


@pytest.mark.parametrize("dtype", (torch.float32, torch.float16, torch.bfloat16, torch.float64))
@pytest.mark.parametrize("block_size,lengths,Lnew,num_splits", CASES)
def test_paged_matches_dense(backend, dtype, block_size, lengths, Lnew, num_splits):
    device = paged_device(backend)
    if backend == "triton" and dtype == torch.float64:
        pytest.skip("the triton backend has no float64 kernels")
    c = paged_case(dtype, device, block_size=block_size, lengths=lengths, Lnew=Lnew)
    kw = dict(num_splits=num_splits)
    out, k_pool, v_pool = run_paged(c, backend, **kw)
    dense, k_dense, v_dense = run_dense(c, backend, **kw)
    ref, _, _ = run_dense(c, "reference")
    # The same kernel over the same rows: the same numbers (the tile order may differ where a
    # split or block boundary moves, so within rounding).
    tol = {torch.float64: 1e-12, torch.float32: 2e-6}.get(dtype, 2e-3)
    torch.testing.assert_close(out, dense, rtol=tol, atol=tol)
    if backend != "reference":  # for the reference, dense is ref
        torch.testing.assert_close(out.double(), ref.double(), rtol=3 * tol, atol=3 * tol)
    # The appended rows sit where the table says, identical to the dense append.
    used = [(b, p) for b in range(len(lengths)) for p in range(lengths[b] + Lnew)]
    k_read, v_read = gather_paged(k_pool, c["table"]), gather_paged(v_pool, c["table"])
    for b, p in used:
        assert torch.equal(k_read[b, :, p], k_dense[b, :, p]), (b, p)
        assert torch.equal(v_read[b, :, p], v_dense[b, :, p]), (b, p)
    # Blocks no sequence owns are untouched.
    spare = sorted(set(range(c["k_pool"].shape[0])) - owned_blocks(c))
    assert spare and torch.equal(k_pool[spare], c["k_pool"][spare])
    assert torch.equal(v_pool[spare], c["v_pool"][spare])


@pytest.mark.parametrize("backend_name", ("cpu", "triton", "reference"))
def test_paged_with_every_keyword(backend_name):
    """Window, ALiBi, softcap, sinks, non-causal and several queries over a paged cache."""
    device = paged_device(backend_name)
    c = paged_case(torch.float32, device, block_size=32, lengths=[9, 61, 40], Lnew=3, Hq=6)
    kw = dict(
        window=(20, -1),
        alibi_slopes=torch.rand(6, device=device) * 0.1,
        softcap=4.0,
        sinks=torch.randn(6, device=device),
    )
    for causal in (True, False):
        out, _, _ = run_paged(c, backend_name, causal=causal, **kw)
        ref, _, _ = run_dense(c, "reference", causal=causal, **kw)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_decode_without_append_reads_through_the_table():
    """No new tokens (k_new None): attention over the paged cache as it is."""
    paged_device("cpu")
    c = paged_case(torch.float32, torch.device("cpu"), block_size=16, lengths=[33, 7], Lnew=1)
    for backend in ("cpu", "reference"):
        out = fastattn.attention_with_kvcache(
            c["q"],
            c["k_pool"],
            c["v_pool"],
            cache_seqlens=c["seqlens"],
            block_table=c["table"],
            backend=backend,
        )
        dense = fastattn.attention_with_kvcache(
            c["q"],
            gather_paged(c["k_pool"], c["table"]),
            gather_paged(c["v_pool"], c["table"]),
            cache_seqlens=c["seqlens"],
            backend="reference",
        )
        torch.testing.assert_close(out, dense, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# Errors


def _error_case():
    c = paged_case(torch.float32, torch.device("cpu"), block_size=16, lengths=[20, 3], Lnew=1)
    return c


@pytest.mark.parametrize("backend_name", ("cpu", "triton", "reference"))
def test_block_outside_the_pool_is_refused(backend_name):
    paged_device(backend_name)
    c = _error_case()
    c["table"][0, 1] = c["k_pool"].shape[0]  # used by sequence 0 (positions 16..20)
    with pytest.raises(ValueError, match=r"block_table\[0, 1\] = .* outside the pool"):
        run_paged(c, backend_name)
    c = _error_case()
    c["table"][1, 0] = -3
    with pytest.raises(ValueError, match=r"block_table\[1, 0\] = -3 is outside the pool"):
        run_paged(c, backend_name)
    # Entries past a sequence's blocks are never read: -1 (or anything) is fine there.
    c = _error_case()
    c["table"][1, 1:] = 12345
    run_paged(c, backend_name)


def test_native_op_checks_blocks_itself():
    """The CPU kernel checks the entries it reads (the Python layer leaves that to it for the
    cpu backend; here called directly), with the Python layer's message. The stable ABI carries
    only RuntimeError: the op's message is tagged, and fastattn._native.value_errors() (which
    the Python layer calls it in) raises it as ValueError."""
    paged_device("cpu")
    c = _error_case()
    c["table"][0, 1] = 999
    args = (
        c["q"],
        c["k_pool"],
        c["v_pool"],
        c["seqlens"] + 1,
        c["seqlens"],
        None,
        0.5,
        0.0,
        2,
        -1,
        -1,
        1,
        c["table"],
    )
    rule = r"block_table\[0, 1\] = 999 is outside the pool"
    with pytest.raises(RuntimeError, match=r"\[ValueError\] attention_decode: " + rule):
        torch.ops.fastattn.attention_decode(*args)
    with pytest.raises(ValueError, match=rule), fastattn._native.value_errors():
        torch.ops.fastattn.attention_decode(*args)


@pytest.mark.parametrize("backend_name", ("cpu", "triton", "reference"))
def test_block_size_must_be_a_multiple_of_16(backend_name):
    paged_device(backend_name)
    c = _error_case()
    c["k_pool"], c["v_pool"] = c["k_pool"][:, :, :8], c["v_pool"][:, :, :8]
    with pytest.raises(ValueError, match="block_size .* multiple of 16, got 8"):
        run_paged(c, backend_name)


@pytest.mark.parametrize("backend_name", ("cpu", "triton", "reference"))
def test_append_past_the_table_capacity_is_refused(backend_name):
    paged_device(backend_name)
    c = _error_case()  # table (2, 3) of 16-token blocks: capacity 48
    pool_before = c["k_pool"].clone()
    c["seqlens"][0] = 48
    with pytest.raises(ValueError, match="exceed the block table's capacity .* = 48"):
        run_paged(c, backend_name)
    assert torch.equal(c["k_pool"], pool_before)


def test_bad_table_arguments_name_the_argument():
    c = _error_case()
    for table, error, match in (
        (c["table"].long(), TypeError, "block_table must be int32"),
        (c["table"][:1], TypeError, r"block_table must be int32 \(B, max_blocks_per_seq\)"),
        (c["table"][0], ValueError, "block_table must be 2-D"),
    ):
        c2 = dict(c, table=table)
        with pytest.raises(error, match=match):
            run_paged(c2, "reference")
    c2 = dict(c, v_pool=c["v_pool"][:-1])
    with pytest.raises(ValueError, match="with block_table, k_cache must be a pool"):
        run_paged(c2, "reference")


# ---------------------------------------------------------------------------------------------
# PagedKVCache


def test_paged_kv_cache_lifecycle():
    cache = fastattn.PagedKVCache(
        num_layers=2,
        num_blocks=6,
        block_size=16,
        num_kv_heads=2,
        head_dim=8,
        max_blocks_per_seq=3,
        max_sequences=3,
    )
    a, b = cache.allocate(), cache.allocate()
    assert cache.sequences == [a, b]
    cache.append(20)  # 2 blocks each
    assert cache.free_blocks == 2
    assert (cache.block_table_of() >= 0).sum(1).tolist() == [2, 2]
    cache.advance(20)
    assert cache.seqlens().tolist() == [20, 20]
    with pytest.raises(ValueError, match="more than max_blocks_per_seq"):
        cache.append(29, [a])
    cache.append(28, [a])  # 48 tokens: the third block
    d = cache.allocate()
    with pytest.raises(RuntimeError, match=r"out of blocks \(2 needed, 1 free\)"):
        cache.append(20, [d])
    assert cache.free_blocks == 1  # a failed append takes nothing
    cache.free(d)
    freed = cache.block_table[a, :3].tolist()
    cache.free(a)
    assert cache.sequences == [b] and cache.free_blocks == 4
    c = cache.allocate()
    cache.append(40, [c])
    assert sorted(cache.block_table[c, :3].tolist()) == sorted(freed)
    with pytest.raises(ValueError, match="not allocated"):
        cache.free(99)
    with pytest.raises(ValueError, match="advance.*call append first"):
        cache.advance(49, [c])
    with pytest.raises(ValueError, match="block_size must be a positive multiple of 16"):
        fastattn.PagedKVCache(
            num_layers=1,
            num_blocks=2,
            block_size=24,
            num_kv_heads=1,
            head_dim=8,
            max_blocks_per_seq=2,
        )


@pytest.mark.parametrize("backend_name", ("cpu", "reference"))
def test_paged_kv_cache_decodes_like_a_dense_cache(backend_name):
    """Three sequences prefilled with different lengths, then decoded token by token (one
    freed and replaced midway): every step's output equals the dense cache's."""
    paged_device(backend_name)
    g = torch.Generator().manual_seed(7)
    Hq, Hkv, D = 4, 2, 16
    cache = fastattn.PagedKVCache(
        num_layers=1,
        num_blocks=40,
        block_size=16,
        num_kv_heads=Hkv,
        head_dim=D,
        max_blocks_per_seq=6,
        dtype=torch.float64,
    )
    dense_k = torch.zeros(3, Hkv, 96, D, dtype=torch.float64)
    dense_v = torch.zeros_like(dense_k)
    dense_len = torch.zeros(3, dtype=torch.int32)
    seqs = [cache.allocate() for _ in range(3)]
    for step, L in enumerate((11, 1, 1, 1, 3, 1)):
        if step == 3:  # sequence 1 finishes; a new one takes its place (batch slot 1)
            cache.free(seqs[1])
            seqs[1] = cache.allocate()
            dense_len[1] = 0
            dense_k[1].zero_(), dense_v[1].zero_()
        q = torch.randn(3, Hq, L, D, generator=g, dtype=torch.float64)
        k = torch.randn(3, Hkv, L, D, generator=g, dtype=torch.float64)
        v = torch.randn(3, Hkv, L, D, generator=g, dtype=torch.float64)
        cache.append(L, seqs)
        out = cache.attention(0, q, k, v, seqs=seqs, backend=backend_name)
        cache.advance(L, seqs)
        want = fastattn.attention_with_kvcache(
            q, dense_k, dense_v, cache_seqlens=dense_len, k_new=k, v_new=v, backend="reference"
        )
        dense_len += L
        torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    assert cache.seqlens(seqs).tolist() == dense_len.tolist()


# ---------------------------------------------------------------------------------------------
# CUDA tensors: values checked on the device, never read on the host


@pytest.mark.parametrize("backend_name", ["reference", "triton"])
@pytest.mark.parametrize("case", ["outside", "capacity"])
def test_paged_device_checks(monkeypatch, backend_name, case):
    """The rules CUDA tensors get as asynchronous device checks (here forced on CPU tensors,
    where torch._assert_async raises at once), before anything is appended."""
    paged_device(backend_name)
    force_device_checks(monkeypatch)
    c = _error_case()
    if case == "outside":
        c["table"][0, 1] = 77
        match = r"block_table entries read or written must be block indices in \[0, num_blocks"
    else:
        c["seqlens"][0] = 48
        match = r"cache_seqlens must be in \[0, Lmax - Lnew\] = \[0, 47\].*capacity"
    pool_before = c["k_pool"].clone()
    with pytest.raises(RuntimeError, match=match):
        run_paged(c, backend_name)
    assert torch.equal(c["k_pool"], pool_before)


@pytest.mark.parametrize("backend_name", ["cuda", "triton"])
def test_paged_cuda_path_has_no_host_reads(backend_name):
    """A paged decoding step on (fake) CUDA tensors reads no value on the host; the triton path
    queues its device checks (the CUDA op checks inside its own kernels)."""
    with fake_cuda(backend_name) as recorder:
        c = paged_case(torch.float16, torch.device("cuda"), block_size=16, lengths=[3, 20], Lnew=1)
        out, _, _ = run_paged(c, backend_name)
        assert out.shape == (2, 4, 1, 24) and out.device.type == "cuda"
    assert_no_host_reads(recorder)
    if backend_name == "triton":
        assert device_checks(recorder) >= 2
