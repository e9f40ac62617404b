"""attention_with_kvcache on the torch backend (torch's SDPA over the cache,
fastattn/aten/attention_with_kvcache.py) against the float64 reference, under FlashAttention's
rule (tests/tolerance.py): the output, and the new keys it rotated into the cache, may be off
by at most 2x the reference run in the input's precision, plus a rounding floor. Every feature
it accepts, every dtype; the caches' other rows must stay unchanged bit for bit (they hold NaN
past each sequence's length, which must not reach the output), the new values must land as
given, and rows with no visible key must be exactly 0. Then its refusals, each naming the
feature, and the backend choice.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import pytest
import torch
from host_reads import assert_no_host_reads, fake_cuda
from tolerance import F32_ULP, assert_fa_close, rounding_floor

import fastattn
from fastattn import BackendError, _backend, speed_table

pytestmark = pytest.mark.usefixtures("one_thread")

F64, F32, F16, BF16 = torch.float64, torch.float32, torch.float16, torch.bfloat16
DTYPES = (F32, F16, BF16, F64)
_DT = {F32: "f32", F16: "f16", BF16: "bf16", F64: "f64"}
NAN = float("nan")
# The comparisons count toward the torch backend in the run's oracle summary (conftest.py).
ON_TORCH = pytest.mark.parametrize("backend", ["torch"])


@dataclass(frozen=True)
class Case:
    lens: tuple[int, ...] = (0, 17, 39)  # cache_seqlens, one per sequence
    Lq: int = 1
    Lnew: int = 1
    Hq: int = 6
    Hkv: int = 2
    D: int = 16
    Dv: int = 16
    Lmax: int = 40  # a paged cache: its capacity (max_blocks_per_seq * block_size)
    rotary: str | None = None  # "neox", "gptj" or "partial" (NeoX over D / 2 features)
    kw: dict = field(default_factory=dict)  # causal, window, scale, alibi ("heads"/"batch")
    paged: bool = False  # 16-row blocks, shuffled in a pool, unused table entries -1
    heads_inner: bool = False  # q passed as a (B, Lq, Hq, D) tensor transposed
    append: bool = True  # False: k_new = v_new = None


CASES = {
    "decode-gqa-neox": Case(rotary="neox"),
    # one query per sequence over its whole prefix: the CPU path on views of the cache, with a
    # run of equal lengths (one SDPA call), a sequence with no key, and heads-inner q
    "decode-prefix-runs": Case(lens=(0, 23, 23, 9), Lnew=0, append=False, heads_inner=True),
    "decode-two-new-noncausal": Case(lens=(12, 12, 3), Lnew=2, kw={"causal": False}),
    # equal lengths on CPU: the rotation at one offset and the append through slices
    "decode-equal-lengths-gptj": Case(lens=(21, 21, 21), rotary="gptj"),
    "chunk-equal-lengths-neox": Case(lens=(30, 30, 30), Lq=2, Lnew=2, rotary="neox"),
    # one query, two appended tokens, causal: the query does not see the last key (masked path)
    "decode-two-new-causal": Case(lens=(12, 12, 3), Lnew=2),
    "chunk-gptj-window": Case(lens=(0, 20, 37), Lq=3, Lnew=3, rotary="gptj", kw={"window": (4, 0)}),
    "no-append-noncausal": Case(lens=(0, 5, 40), Lq=2, Lnew=0, kw={"causal": False}),
    "rows-without-keys": Case(lens=(0, 1, 30), Lq=3, Lnew=0),
    "mqa-dv-partial-bottom-right": Case(
        lens=(3, 0, 36),
        Lq=2,
        Lnew=2,
        Hq=5,
        Hkv=1,
        D=24,
        Dv=40,
        rotary="partial",
        kw={"causal": "bottom_right"},
    ),
    "window-noncausal": Case(lens=(9, 0, 30), Lq=3, Lnew=3, kw={"causal": False, "window": (3, 2)}),
    "window-left-unbounded": Case(
        lens=(4, 22, 38), Lq=2, Lnew=2, kw={"causal": False, "window": (-1, 1)}
    ),
    "scale-splits-lq-ne-lnew": Case(
        lens=(6, 0, 25), Lq=2, Lnew=1, kw={"scale": 0.3, "num_splits": 3}
    ),
    "paged-gqa-neox": Case(lens=(0, 20, 61), Lq=2, Lnew=2, Lmax=64, rotary="neox", paged=True),
    "heads-inner-q": Case(lens=(2, 11, 30), Lq=3, Lnew=3, rotary="gptj", heads_inner=True),
    "k-new-none": Case(lens=(7, 0, 40), Lq=2, Lnew=0, rotary="neox", append=False),
    "alibi-heads": Case(lens=(0, 13, 35), Lq=3, Lnew=3, kw={"alibi": "heads"}),
    "alibi-batch-window": Case(
        lens=(5, 19, 33), Lq=2, Lnew=2, kw={"alibi": "batch", "window": (6, 0)}
    ),
}
ALIBI = {name for name, case in CASES.items() if "alibi" in case.kw}


def _cases() -> list:
    return [
        pytest.param(name, dtype, id=f"{name}-{_DT[dtype]}")
        for name in CASES
        for dtype in DTYPES
        # ALiBi in 16-bit is refused: test_refusals_name_the_feature
        if not (name in ALIBI and dtype in (F16, BF16))
    ]


# ---------------------------------------------------------------------------------------------
# Inputs and runs


def make_inputs(case: Case, seed: int = 0) -> dict:
    """float64 inputs of `case`: q, k_cache, v_cache (NaN at every row no sequence has
    written), k_new, v_new, cache_seqlens, and as needed cos/sin, block_table, alibi_slopes."""
    g = torch.Generator().manual_seed(seed)
    B = len(case.lens)
    lens = torch.tensor(case.lens, dtype=torch.int32)
    if case.heads_inner:
        q = torch.randn(B, case.Lq, case.Hq, case.D, generator=g, dtype=F64).transpose(1, 2)
    else:
        q = torch.randn(B, case.Hq, case.Lq, case.D, generator=g, dtype=F64)
    inputs = {"q": q, "cache_seqlens": lens}
    written = torch.arange(case.Lmax).view(1, -1) < lens.view(-1, 1).long()  # (B, Lmax)
    for name, width in (("k", case.D), ("v", case.Dv)):
        cache = torch.randn(B, case.Hkv, case.Lmax, width, generator=g, dtype=F64)
        cache = cache.masked_fill(~written.view(B, 1, case.Lmax, 1), NAN)
        if case.append:
            inputs[f"{name}_new"] = torch.randn(
                B, case.Hkv, case.Lnew, width, generator=g, dtype=F64
            )
        inputs[f"{name}_cache"] = cache
    if case.paged:
        block_size = 16
        per_seq = case.Lmax // block_size
        num_blocks = B * per_seq + 3  # blocks no sequence uses hold NaN
        order = torch.randperm(num_blocks, generator=g)[: B * per_seq].view(B, per_seq)
        for name in ("k_cache", "v_cache"):
            dense = inputs[name]  # (B, Hkv, Lmax, W) -> pool (num_blocks, Hkv, 16, W)
            pool = torch.full((num_blocks, case.Hkv, block_size, dense.shape[3]), NAN, dtype=F64)
            blocks = dense.view(B, case.Hkv, per_seq, block_size, -1).transpose(1, 2)
            pool[order.reshape(-1)] = blocks.reshape(-1, case.Hkv, block_size, dense.shape[3])
            inputs[name] = pool
        # Entries a call never reads or writes may hold anything.
        used = (lens.long() + case.Lnew + block_size - 1) // block_size
        unused = torch.arange(per_seq).view(1, -1) >= used.view(-1, 1)
        inputs["block_table"] = order.masked_fill(unused, -1).to(torch.int32)
    if case.rotary is not None:
        rotary_dim = case.D // 2 if case.rotary == "partial" else case.D
        inv = 10000.0 ** (-torch.arange(0, rotary_dim, 2, dtype=F64) / rotary_dim)
        angles = torch.arange(case.Lmax + 8, dtype=F64).view(-1, 1) * inv
        inputs["rotary_cos"], inputs["rotary_sin"] = angles.cos(), angles.sin()
    alibi = case.kw.get("alibi")
    if alibi is not None:
        shape = (case.Hq,) if alibi == "heads" else (B, case.Hq)
        inputs["alibi_slopes"] = torch.rand(*shape, generator=g, dtype=F64) * 0.3
    return inputs


def call(backend: str, case: Case, inputs: dict, dtype: torch.dtype, **extra) -> torch.Tensor:
    """fastattn.attention_with_kvcache on `backend` with the floating inputs in `dtype` (the
    caches are written in place: pass copies)."""
    kw = {k: v for k, v in case.kw.items() if k != "alibi"}
    kw.update(extra)
    args = {}
    for name, value in inputs.items():
        if value.is_floating_point():
            value = value.to(dtype)
            if name == "alibi_slopes" and dtype != F64:
                value = value.to(F32)  # the slopes' own dtype: fastattn reads them as float32
        args[name] = value
    if case.rotary == "gptj":
        kw["rotary_interleaved"] = True
    return fastattn.attention_with_kvcache(
        args.pop("q"), args.pop("k_cache"), args.pop("v_cache"), backend=backend, **args, **kw
    )


def _copies(inputs: dict, dtype: torch.dtype) -> dict:
    """The inputs in `dtype` (caches as fresh tensors the call may write)."""
    return {
        n: (v.to(dtype) if v.is_floating_point() else v).clone() if n.endswith("cache") else v
        for n, v in inputs.items()
    }


def run_three(backend: str, case: Case, dtype: torch.dtype) -> dict:
    """The call on `backend` in `dtype`, and the reference in float64 and in `dtype`. Returns
    "out" -> (out, ref64, ref_lowp), "k rows" (the appended rows of k_cache, rotated) likewise,
    and "before"/"after" (the caches in `dtype` around the backend's call)."""
    inputs = make_inputs(case)
    results = {}
    runs = (("got", backend, dtype), ("ref64", "reference", F64), ("lowp", "reference", dtype))
    for label, be, dt in runs:
        copies = _copies(inputs, dt)
        if label == "got":
            results["before"] = {n: v.clone() for n, v in copies.items() if n.endswith("cache")}
        out = call(be, case, copies, dt)
        assert fastattn.last_backend("attention_with_kvcache") == be
        results[label] = (out, copies)
    got, ref64, lowp = (results.pop(k) for k in ("got", "ref64", "lowp"))
    results["after"] = {n: v for n, v in got[1].items() if n.endswith("cache")}
    results["out"] = (got[0], ref64[0], lowp[0])
    if case.append and case.Lnew:
        rows = [
            _new_rows(case, copies["k_cache"], inputs) for copies in (got[1], ref64[1], lowp[1])
        ]
        results["k rows"] = tuple(rows)
    return results


def _dense(case: Case, cache: torch.Tensor, inputs: dict) -> torch.Tensor:
    """(B, Hkv, Lmax, W): a paged pool read through the block table, or the dense cache."""
    if not case.paged:
        return cache
    table = inputs["block_table"].long().clamp(min=0)
    B, per_seq = table.shape
    blocks = cache[table.reshape(-1)].view(B, per_seq, *cache.shape[1:])
    return blocks.transpose(1, 2).reshape(B, cache.shape[1], -1, cache.shape[3])


def _new_rows(case: Case, cache: torch.Tensor, inputs: dict) -> torch.Tensor:
    """(B, Hkv, Lnew, W): the rows [cache_seqlens[b], + Lnew) of each sequence."""
    dense = _dense(case, cache, inputs)
    return torch.stack([dense[b, :, s : s + case.Lnew] for b, s in enumerate(case.lens)])


def _empty_rows(case: Case) -> torch.Tensor:
    """bool (B, Lq): query rows that see no key, by the definition (tests' own arithmetic)."""
    left, right = case.kw.get("window") or (-1, -1)
    causal = case.kw.get("causal", True)
    empty = torch.zeros(len(case.lens), case.Lq, dtype=torch.bool)
    for b, s in enumerate(case.lens):
        for i in range(case.Lq):
            pos, keys = s + i, range(s + (case.Lnew if case.append else 0))
            seen = [
                j
                for j in keys
                if (not causal or j <= pos)
                and (left < 0 or j >= pos - left)
                and (right < 0 or j <= pos + right)
            ]
            empty[b, i] = not seen
    return empty


def _floor(ref64: torch.Tensor, dtype: torch.dtype) -> float | None:
    """float32: the rule's floor plus 16 ulps of the largest magnitude (sums in another
    order); float64 (baseline 0): 64 ulps of it; 16-bit: the rule's own floor."""
    if ref64.numel() == 0:
        return None
    biggest = float(ref64.abs().max())
    if dtype == F32:
        return rounding_floor(ref64, dtype) + 16 * F32_ULP * biggest
    if dtype == F64:
        return 64 * torch.finfo(F64).eps * (1.0 + biggest)
    return None


def check(results: dict, tamper: dict | None = None) -> None:
    """out and the rotated new key rows within the rule; tamper: name -> factor first."""
    for name in ("out", "k rows"):
        if name not in results:
            continue
        got, ref64, lowp = results[name]
        if tamper and name in tamper:
            got = got * tamper[name]
        assert_fa_close(name, got, ref64, lowp, floor=_floor(ref64, got.dtype))


# ---------------------------------------------------------------------------------------------
# Against the reference


@ON_TORCH
@pytest.mark.parametrize("name,dtype", _cases())
def test_matches_reference(backend, name, dtype):
    case = CASES[name]
    results = run_three(backend, case, dtype)
    check(results)
    out = results["out"][0]
    assert out.dtype == dtype and not out.requires_grad
    assert not torch.isnan(out).any(), "NaN in the output (unwritten cache rows leaked?)"
    if case.heads_inner:  # laid out like q: (B, Lq, Hq, Dv) in memory
        assert out.transpose(1, 2).is_contiguous()
    empty = _empty_rows(case)
    assert torch.all(out.transpose(1, 2)[empty] == 0), "rows with no visible key must be 0"
    if name == "rows-without-keys":
        assert empty.any()

    # The caches: new values as given, new keys checked above, every other row unchanged.
    before, after = results["before"], results["after"]
    inputs = make_inputs(case)
    lnew = case.Lnew if case.append else 0
    if lnew:
        v_rows = _new_rows(case, after["v_cache"], inputs)
        assert torch.equal(v_rows, inputs["v_new"].to(dtype)), "v_cache's new rows"
    for cache in ("k_cache", "v_cache"):
        kept = ~_written_mask(case, after[cache].shape, inputs, lnew)
        torch.testing.assert_close(
            after[cache][kept], before[cache][kept], rtol=0, atol=0, equal_nan=True
        )


def _written_mask(case: Case, shape, inputs: dict, lnew: int) -> torch.Tensor:
    """bool of the caches' shape: the rows the call appends to."""
    mask = torch.zeros(shape, dtype=torch.bool)
    for b, s in enumerate(case.lens):
        for p in range(s, s + lnew):
            if case.paged:
                block = int(inputs["block_table"][b, p // 16])
                mask[block, :, p % 16] = True
            else:
                mask[b, :, p] = True
    return mask


# ---------------------------------------------------------------------------------------------
# The checks have teeth


@pytest.mark.parametrize("dtype", (F32, F16, BF16), ids=_DT.get)
def test_the_checks_have_teeth(dtype):
    """The output and the rotated new keys, scaled by 0 and by 1.25 (16-bit) or 1 + 1e-3
    (float32), fail the check that the unscaled results pass."""
    results = run_three("torch", CASES["chunk-gptj-window"], dtype)
    check(results)
    factors = (0.0, 1.0 + 1e-3) if dtype == F32 else (0.0, 1.25)
    for name in ("out", "k rows"):
        for factor in factors:
            with pytest.raises(AssertionError, match=name):
                check(results, tamper={name: factor})


# ---------------------------------------------------------------------------------------------
# Refusals and the backend choice

REFUSED = {
    "softcap": (F32, {"softcap": 2.0}, "softcap: torch's SDPA has no score capping"),
    "sinks": (F32, {"sinks": torch.zeros(6)}, "sinks: torch's SDPA returns no log-sum-exp"),
    "alibi-float16": (
        F16,
        {"alibi_slopes": torch.full((6,), 0.1)},
        "alibi_slopes with torch.float16",
    ),
    "alibi-bfloat16": (
        BF16,
        {"alibi_slopes": torch.full((6,), 0.1)},
        "alibi_slopes with torch.bfloat16",
    ),
}


@pytest.mark.parametrize("feature", list(REFUSED))
def test_refusals_name_the_feature(feature):
    """A forced call the torch backend cannot compute as fastattn defines it raises
    BackendError naming the feature, before anything is appended; the automatic choice runs
    fastattn's kernel instead."""
    dtype, extra, message = REFUSED[feature]
    case = CASES["decode-gqa-neox"]
    copies = _copies(make_inputs(case), dtype)
    before = {n: v.clone() for n, v in copies.items() if n.endswith("cache")}
    with pytest.raises(BackendError, match=r"backend 'torch' cannot run this call: " + message):
        call("torch", case, copies, dtype, **extra)
    for name, cache in before.items():
        torch.testing.assert_close(copies[name], cache, rtol=0, atol=0, equal_nan=True)
    call(None, case, copies, dtype, **extra)
    assert fastattn.last_backend("attention_with_kvcache") == "cpu"


def test_forced_calls_run_torch_and_the_default_runs_fastattns_kernel():
    case = CASES["decode-gqa-neox"]
    inputs = make_inputs(case)
    call("torch", case, _copies(inputs, F32), F32)
    assert fastattn.last_backend("attention_with_kvcache") == "torch"
    call(None, case, _copies(inputs, F32), F32)  # no speed table is shipped
    assert fastattn.last_backend("attention_with_kvcache") == "cpu"
    with fastattn.use_backend("torch"):
        call(None, case, _copies(inputs, F32), F32)
    assert fastattn.last_backend("attention_with_kvcache") == "torch"


def test_a_speed_table_entry_sends_the_automatic_choice_to_torch(monkeypatch):
    """A table entry marking torch faster for a decoding step's key (the capacity's length
    class, q's head dim, the features) moves that call to torch, and only that key."""
    monkeypatch.setattr(_backend, "AUTO_MODE", "table")  # conftest.py turns the table off
    features = ("causal", "gqa", "rotary")
    key = speed_table.key("attention_with_kvcache", F32, length=40, head_dim=16, features=features)
    entry = dict(dict(key), kernel="cpu", faster="torch", ratio=2.0)
    table = {"device_class": speed_table.device_class(torch.device("cpu")), "entries": [entry]}
    speed_table.reset()
    monkeypatch.setattr(speed_table, "_tables", [dict(table, module="t")])
    try:
        case = CASES["decode-gqa-neox"]
        inputs = make_inputs(case)
        call(None, case, _copies(inputs, F32), F32)
        assert fastattn.last_backend("attention_with_kvcache") == "torch"
        call(None, case, _copies(inputs, F32), F32, window=(4, 0))  # another key
        assert fastattn.last_backend("attention_with_kvcache") == "cpu"
    finally:
        monkeypatch.undo()
        speed_table.reset()


def test_without_host_checks_reads_the_whole_capacity(monkeypatch):
    """Where cache_seqlens is not read on the host (under torch.compile), SDPA reads every row
    up to the cache's capacity; the rows past each length, NaN here, are zeroed in its copy,
    so the result still meets the rule."""
    import fastattn.ops.attention_with_kvcache as op_module

    monkeypatch.setattr(op_module, "host_checks_enabled", lambda t=None: False)
    case = replace(CASES["chunk-gptj-window"], lens=(0, 3, 5))
    results = run_three("torch", case, F32)
    assert not torch.isnan(results["out"][0]).any()
    check(results)


@pytest.mark.parametrize(
    "name", ["decode-gqa-neox", "decode-prefix-runs", "decode-equal-lengths-gptj"]
)
def test_cpu_decoding_reads_prefix_views(monkeypatch, name):
    """On CPU, one query per sequence over its whole prefix takes SDPA over views of the cache:
    the masked path's zeroed copy of the cache (_keys) is never made."""
    import fastattn.aten.attention_with_kvcache as aten_module

    def no_copy(*args, **kwargs):
        raise AssertionError("the masked path ran: the cache was copied")

    monkeypatch.setattr(aten_module, "_keys", no_copy)
    check(run_three("torch", CASES[name], F32))


@pytest.mark.parametrize("paged", (False, True), ids=("dense", "paged"))
def test_no_host_reads_of_cuda_tensors(paged):
    """On CUDA tensors (fake ones here) the torch backend reads no value on the host (no
    synchronisation): cache_seqlens stays on the device, SDPA reads the whole capacity."""
    case = replace(CASES["chunk-gptj-window"], paged=paged, Lmax=48, kw={"alibi": "heads"})
    inputs = make_inputs(case)
    with fake_cuda() as recorder:
        shapes = {name: (t.shape, t.dtype) for name, t in inputs.items()}
        on_device = {n: torch.empty(s, dtype=dt, device="cuda") for n, (s, dt) in shapes.items()}
        out = call("torch", case, on_device, F32)
        assert out.shape == (3, case.Hq, case.Lq, case.Dv)
        assert fastattn.last_backend("attention_with_kvcache") == "torch"
    assert_no_host_reads(recorder)
