"""A NaN in an input reaches every output it feeds, as in torch: never a finite number.

x86 min and max return their second operand when either is NaN, so a clamp written value-first
(max(t, -126) in an exponential) turns a NaN score into a tiny probability and a NaN key into a
finite output row; a running maximum that loses a NaN can make a row look empty (output 0). The
expected pattern comes from the float64 reference backend (and from torch's own modules for
the recurrent layers): which output elements are NaN must match exactly; gradients must carry
the NaN to every row it reaches and nowhere the reference does not.
"""

from __future__ import annotations

import pytest
import torch
from test_attention import KERNEL_BACKENDS, attention_device, make_case, run_attention
from test_gru_rnn import kind_device
from test_gru_rnn import make_pair as make_gru_rnn_pair
from test_lstm import lstm_device
from test_lstm import make_pair as make_lstm_pair
from test_varlen_attention import cu_seqlens, varlen_device

import fastattn

NAN = float("nan")
# Lq = Lk = 96 takes the CPU kernel's key-major tiles where the call is plain; 20 x 33 (fewer
# than 64 queries) and every masked or biased feature take the query-major tiles.
SHAPES = ((96, 96), (20, 33))
FEATURES = ("plain", "causal", "bool_mask", "padding", "alibi", "window", "softcap")


def poison(q, k, v, where: str, value: float = NAN):
    """Copies of q, k, v with one element set to `value`: in a query, a key or a value row."""
    q, k, v = (t.clone() for t in (q, k, v))
    t = {"q": q, "k": k, "v": v}[where]
    t[0, -1, t.shape[2] // 3, 1] = value
    return q, k, v


def nan_pattern(results):
    return [None if r is None else torch.isnan(r).cpu() for r in results]


def _kernel_cases():
    """(backend, dtype, shape) triples; the triton backend's under the CPU interpreter (1-2 s a
    case) run one shape in float32 unless the slow tests are asked for: the two shapes are two
    tile paths of the cpu backend only."""
    for backend in KERNEL_BACKENDS:
        for dtype, dtype_id in ((torch.float32, "f32"), (torch.bfloat16, "bf16")):
            for shape in SHAPES:
                slow = backend == "triton" and (dtype != torch.float32 or shape != SHAPES[1])
                yield pytest.param(
                    backend,
                    dtype,
                    shape,
                    id=f"{shape[0]}x{shape[1]}-{dtype_id}-{backend}",
                    marks=[pytest.mark.slow] if slow else [],
                )


@pytest.mark.parametrize("backend,dtype,shape", list(_kernel_cases()))
@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("where", ("q", "k", "v"))
def test_attention_nan_reaches_what_it_feeds(backend, dtype, shape, feature, where):
    device = attention_device(backend)
    Lq, Lk = shape
    q, k, v, kw = make_case(feature, 64, Lq, Lk, dtype, device)
    clean = q, k, v
    q, k, v = poison(q, k, v, where)
    g = torch.Generator().manual_seed(3)
    grad_out = torch.randn(*q.shape[:3], v.shape[3], generator=g).to(dtype).to(device)
    grad_lse = torch.randn(*q.shape[:3], generator=g).to(device)
    got = run_attention(backend, q, k, v, kw, grad_out, grad_lse)
    expected = run_attention("reference", q, k, v, kw, grad_out, grad_lse, cast=torch.float64)
    out, lse, dq, dk, dv = nan_pattern(got)
    ref_out, ref_lse = nan_pattern(expected)[:2]
    assert ref_out.any(), "the NaN reached nothing: the case does not test anything"
    checks = (("out", out, ref_out), ("lse", lse, ref_lse))
    if where == "v":
        # A NaN value times a masked key's probability 0 is NaN in the reference's dense P V
        # and, within a tile, in a kernel's: the output must be NaN wherever the value counts
        # (where changing it changes the float64 reference) and nowhere the reference is not.
        reach = [
            fastattn.attention(
                *(t.double() for t in poison(*clean, where, x)), backend="reference", **kw
            )
            for x in (0.0, 1.0)
        ]
        reach = (reach[0] != reach[1]).cpu()
        assert not (reach & ~out).any(), "an output the NaN value reaches is not NaN"
        assert not (out & ~ref_out).any(), "NaN where the reference has none"
        checks = checks[1:]
    for name, a, b in checks:
        mismatch = (a != b).nonzero()
        assert mismatch.numel() == 0, (
            f"{name}: {len(mismatch)} elements differ in NaN-ness from the reference, first "
            f"{mismatch[0].tolist()} (NaN here: {bool(a[tuple(mismatch[0])])})"
        )
    # Gradients: every row of dq whose output row has a NaN has one (through dS, or through
    # Delta = rowsum(dO * O)), and so do dk and dv (unless the NaN is in v: dv = P^T dO). They
    # may have more: a masked key's zero probability times a NaN is NaN in a tiled kernel and
    # in the reference's dense products alike, and where it lands is each implementation's.
    assert not (out.any(-1) & ~dq.any(-1)).any(), "a dq row lost its output row's NaN"
    assert dk.any() and (where == "v" or dv.any()), "a key gradient lost the NaN"


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=("f32", "bf16"))
def test_attention_nan_rows_without_keys_stay_zero(backend, dtype):
    """A row with no visible key is 0 (lse -inf) even when a masked key's value is NaN: the
    tiles multiply its zero probabilities by that value (0 * NaN = NaN), so the row's output
    must be set to 0, not scaled by 0."""
    device = attention_device(backend)
    q, k, v, _ = make_case("plain", 64, 40, 50, dtype, device)
    mask = torch.ones(40, 50, dtype=torch.bool)
    mask[7] = False  # row 7 sees no key
    mask[:, 3] = False  # no row sees key 3, whose value is NaN
    v = v.clone()
    v[:, :, 3] = NAN
    out, lse = fastattn.attention(
        q, k, v, attn_mask=mask.to(device), return_lse=True, backend=backend
    )
    assert torch.all(out[:, :, 7] == 0) and torch.all(torch.isneginf(lse[:, :, 7]))
    assert not torch.isnan(lse).any()


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=("f32", "bf16"))
@pytest.mark.parametrize("where", ("q", "k", "v"))
def test_varlen_nan_stays_in_its_sequence_and_head(backend, dtype, where):
    """A NaN in the last head of sequence 0 reaches nothing of another head or sequence. A
    tile's lanes past a shorter sequence's last query hold the previous tile's scores unless the
    kernel clears them; one thread runs the tasks in order, so sequence 1 (33 queries: a partial
    tile, an odd count in the bfloat16 pairs) follows the NaN's tiles on the same scratch."""
    device = varlen_device(backend)
    lengths_q, lengths_k, H, D = (64, 33), (70, 45), 2, 64
    cu_q, cu_k = cu_seqlens(lengths_q, device), cu_seqlens(lengths_k, device)
    g = torch.Generator().manual_seed(5)
    q = torch.randn(sum(lengths_q), H, D, generator=g).to(dtype)
    k, v = (torch.randn(sum(lengths_k), H, D, generator=g).to(dtype) for _ in range(2))
    {"q": q, "k": k, "v": v}[where][50 if where == "q" else 3, H - 1, 1] = NAN
    leaves = [t.to(device).requires_grad_() for t in (q, k, v)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = fastattn.varlen_attention(
            *leaves, cu_q, cu_k, max(lengths_q), max(lengths_k), backend=backend
        )
        out.backward(torch.randn(out.shape, generator=g).to(dtype).to(device))
    finally:
        torch.set_num_threads(threads)
    assert torch.isnan(out[: lengths_q[0], H - 1]).any(), "the NaN reached nothing"
    for name, t, n0 in (
        ("out", out, lengths_q[0]),
        ("dq", leaves[0].grad, lengths_q[0]),
        ("dk", leaves[1].grad, lengths_k[0]),
        ("dv", leaves[2].grad, lengths_k[0]),
    ):
        leaked = torch.isnan(t[n0:]).sum() + torch.isnan(t[:n0, : H - 1]).sum()
        assert leaked == 0, f"{name}: {int(leaked)} NaN outside sequence 0's head {H - 1}"


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("num_splits", (1, 4))
def test_kvcache_nan_reaches_what_it_feeds(backend, num_splits):
    """A NaN key inside a sequence's cache length makes that head's output NaN, and so does a
    NaN query (in every split's partial, which the merge must not take for an empty row); NaN
    past the lengths is never read."""
    device = attention_device(backend)
    B, H, Lmax, D = 2, 2, 160, 64
    g = torch.Generator().manual_seed(4)
    q = torch.randn(B, H, 1, D, generator=g).to(device)
    k_cache = torch.randn(B, H, Lmax, D, generator=g).to(device)
    v_cache = torch.randn(B, H, Lmax, D, generator=g).to(device)
    k_cache[:, :, 120:] = NAN
    v_cache[:, :, 120:] = NAN
    k_cache[0, 1, 30, 2] = NAN
    q[1, 0, 0, 5] = NAN
    lengths = torch.tensor([100, 120], dtype=torch.int32, device=device)
    out = fastattn.attention_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=lengths, num_splits=num_splits, backend=backend
    )
    assert torch.isnan(out[0, 1]).all() and torch.isnan(out[1, 0]).all()
    assert not torch.isnan(out[0, 0]).any() and not torch.isnan(out[1, 1]).any()


RECURRENT_KINDS = ("lstm", "gru", "rnn-tanh", "rnn-relu")


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("kind", RECURRENT_KINDS)
def test_recurrent_nan_reaches_what_it_feeds(backend, kind):
    """A NaN in one time step of one sequence: that sequence's outputs from that step on are
    NaN, exactly where torch's own module's are, and nothing else."""
    if kind == "lstm":
        device = lstm_device(backend)
        theirs, ours = make_lstm_pair(16, 32, device=device, dtype=torch.float32, batch_first=True)
    else:
        device = kind_device(backend, kind)
        theirs, ours = make_gru_rnn_pair(
            kind, 16, 32, device=device, dtype=torch.float32, batch_first=True
        )
    x = torch.randn(3, 10, 16, generator=torch.Generator().manual_seed(6)).to(device)
    x[1, 4, 2] = NAN
    with fastattn.use_backend(backend):
        got = ours(x)[0]
    expected = theirs(x)[0]
    assert torch.isnan(expected[1, 4:]).all() and not torch.isnan(expected[[0, 2]]).any()
    assert torch.equal(torch.isnan(got), torch.isnan(expected))
