"""The reference attention backend checked against definitions that do not share its code.

Every accuracy test of a kernel compares it with fastattn's reference (fastattn/reference/
attention.py, varlen_attention.py), so the reference itself must be shown to compute what the
API documents; comparing it with itself proves nothing. Here it meets:
- torch.nn.functional.scaled_dot_product_attention in float64 (torch's math path) for what SDPA
  expresses: plain, bool and float masks, top-left causal, scale, GQA (enable_gqa);
- `textbook_attention`, a float64 loop over (batch, head, query) rows written from
  fastattn.attention's docstring, for everything else: bottom-right causal, windows, key
  padding, ALiBi, softcap, rows without a visible key (out 0, lse -inf), dropout (the Philox
  stream's element ((b * Hq + h) * Lq + i) * Lk + j; the stream itself is checked against
  Random123's known answers in test_philox.py), and the packed numbering of varlen_attention.
Outputs, lse and the gradients of q, k, v (the reference's autograd against torch's autograd of
these definitions) must agree to float64 rounding (1e-10 relative): a wrong mask element, an
off-by-one window or a sign of ALiBi is off by O(0.1).
"""

from __future__ import annotations

import math

import pytest
import torch

import fastattn
from fastattn.ops._common import dropout_seed
from fastattn.reference.random import dropout_uniform

F64 = torch.float64
TOL = dict(rtol=1e-10, atol=1e-12)


def visible_keys(i: int, Lq: int, Lk: int, causal, window) -> torch.Tensor:
    """Bool (Lk,): the keys query i may see by `causal` and `window` (fastattn.attention's
    docstring): top-left j <= i; bottom-right j <= i + Lk - Lq; window (left, right)
    i + Lk - Lq - left <= j <= i + Lk - Lq + right, -1 = unbounded side."""
    j = torch.arange(Lk)
    ok = torch.ones(Lk, dtype=torch.bool)
    if causal in (True, "top_left"):
        ok &= j <= i
    elif causal == "bottom_right":
        ok &= j <= i + Lk - Lq
    if window is not None:
        left, right = window
        if left >= 0:
            ok &= j >= i + Lk - Lq - left
        if right >= 0:
            ok &= j <= i + Lk - Lq + right
    return ok


def textbook_attention(
    q,
    k,
    v,
    *,
    causal=False,
    attn_mask=None,
    key_padding_mask=None,
    scale=None,
    alibi_slopes=None,
    window=None,
    softcap=0.0,
    keep=None,
    dropout_p=0.0,
):
    """Row by row: s_j = scale * q_i . k_j; softcap * tanh(s / softcap); - slope * |i + Lk - Lq
    - j|; + float mask; keys hidden by the bool mask, key padding, causal or window dropped;
    p = softmax over the visible keys; out_i = sum_j p_j * keep_j / (1 - dropout_p) * v_j,
    lse_i = logsumexp of the visible s_j. No visible key: out 0, lse -inf.

    q (B, Hq, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv), float64; masks broadcast to
    (B, Hq, Lq, Lk); alibi_slopes (Hq,) or (B, Hq); keep bool (B, Hq, Lq, Lk) or None.
    Returns out (B, Hq, Lq, Dv), lse (B, Hq, Lq), differentiable in q, k, v by autograd."""
    B, Hq, Lq, D = q.shape
    Hkv, Lk, Dv = k.shape[1], k.shape[2], v.shape[3]
    group = Hq // Hkv
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    mask = None if attn_mask is None else attn_mask.broadcast_to(B, Hq, Lq, Lk)
    slopes = None if alibi_slopes is None else alibi_slopes.broadcast_to(B, Hq).to(F64)
    distance = None
    outs, lses = [], []
    for b in range(B):
        for h in range(Hq):
            kh, vh = k[b, h // group], v[b, h // group]  # query head h reads k/v head h // group
            for i in range(Lq):
                s = (kh @ q[b, h, i]) * scale
                if softcap > 0:
                    s = softcap * torch.tanh(s / softcap)
                if slopes is not None:
                    distance = (i + Lk - Lq - torch.arange(Lk)).abs().to(F64)
                    s = s - slopes[b, h] * distance
                ok = visible_keys(i, Lq, Lk, causal, window)
                if mask is not None:
                    if mask.dtype == torch.bool:
                        ok &= mask[b, h, i].cpu()
                    else:
                        s = s + mask[b, h, i].to(F64)
                if key_padding_mask is not None:
                    ok &= ~key_padding_mask[b].cpu()
                ok &= ~torch.isneginf(s.detach())  # a float mask of -inf hides a key too
                idx = ok.nonzero().view(-1)
                if idx.numel() == 0:
                    outs.append(torch.zeros(Dv, dtype=F64))
                    lses.append(torch.tensor(float("-inf"), dtype=F64))
                    continue
                sv = s[idx]
                lse = torch.logsumexp(sv, dim=0)
                p = torch.exp(sv - lse)
                if dropout_p > 0:
                    p = p * keep[b, h, i, idx] / (1.0 - dropout_p)
                outs.append(p @ vh[idx])
                lses.append(lse)
    if not outs:  # no rows
        return q.new_zeros(B, Hq, Lq, Dv) + 0 * v.sum(), q.new_zeros(B, Hq, Lq)
    return torch.stack(outs).view(B, Hq, Lq, Dv), torch.stack(lses).view(B, Hq, Lq)


def _leaves(*shapes, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g, dtype=F64).requires_grad_() for s in shapes]


def _out_lse_grads(fn, leaves, seed, lse_grad=True):
    """(out, lse, dq, dk, dv) of fn(*leaves) -> (out, lse) for random output gradients (lse's
    gradient, with lse_grad, taken on the rows that see a key)."""
    out, lse = fn(*leaves)
    g = torch.Generator().manual_seed(seed + 1)
    grad_out = torch.randn(out.shape, generator=g, dtype=F64)
    grad_lse = torch.randn(lse.shape, generator=g, dtype=F64)
    loss = (out * grad_out).sum()
    if lse_grad:
        loss = loss + (lse.masked_fill(torch.isneginf(lse), 0.0) * grad_lse).sum()
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    grads = [torch.zeros_like(x) if d is None else d for x, d in zip(leaves, grads)]
    return (out.detach(), lse.detach(), *grads)


def _assert_same(got, want):
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        assert a.shape == b.shape, name
        if name == "lse":
            assert torch.equal(torch.isneginf(a), torch.isneginf(b)), "lse -inf rows differ"
            a, b = a.masked_fill(torch.isneginf(a), 0.0), b.masked_fill(torch.isneginf(b), 0.0)
        torch.testing.assert_close(a, b, msg=name, **TOL)


# ---------------------------------------------------------------------------------------------
# Against torch's SDPA (float64)

SDPA_CASES = {
    "plain": dict(),
    "causal": dict(causal=True),
    "scale": dict(scale=0.37),
    "bool_mask": dict(attn_mask="bool"),
    "float_mask": dict(attn_mask="float"),
    "gqa-float_mask": dict(attn_mask="float", gqa=3),
    "gqa-causal": dict(causal=True, gqa=2),
}


@pytest.mark.parametrize("case", list(SDPA_CASES))
def test_reference_matches_torch_sdpa_float64(case):
    kw = dict(SDPA_CASES[case])
    group = kw.pop("gqa", 1)
    B, Hkv, Lq, Lk, D, Dv = 2, 2, 7, 11, 8, 5
    Hq = Hkv * group
    q, k, v = _leaves((B, Hq, Lq, D), (B, Hkv, Lk, D), (B, Hkv, Lk, Dv), seed=1)
    g = torch.Generator().manual_seed(2)
    if kw.get("attn_mask") == "bool":
        mask = torch.rand(B, 1, Lq, Lk, generator=g) > 0.3
        mask[..., 0] = True  # every row sees a key (SDPA gives NaN for rows that see none)
        kw["attn_mask"] = mask
    elif kw.get("attn_mask") == "float":
        kw["attn_mask"] = torch.randn(Hq, Lq, Lk, generator=g, dtype=F64)

    def ours(q, k, v):
        return fastattn.attention(q, k, v, return_lse=True, backend="reference", **kw)

    def sdpa(q, k, v):
        out = torch.nn.functional.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=kw.get("attn_mask"),
            is_causal=bool(kw.get("causal")),
            scale=kw.get("scale"),
            enable_gqa=group > 1,
        )
        return out, torch.zeros(out.shape[:3], dtype=F64)  # SDPA has no lse

    got = _out_lse_grads(ours, [q, k, v], seed=3, lse_grad=False)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        want = _out_lse_grads(sdpa, [q, k, v], seed=3, lse_grad=False)
    assert fastattn.last_backend("attention") == "reference"
    for name, i in (("out", 0), ("dq", 2), ("dk", 3), ("dv", 4)):
        torch.testing.assert_close(got[i], want[i], msg=name, **TOL)


# ---------------------------------------------------------------------------------------------
# Against the textbook loop (float64): what SDPA cannot express

TEXTBOOK_CASES = {
    "causal_bottom_right-Lq<Lk": dict(causal="bottom_right"),
    "causal_bottom_right-Lq>Lk": dict(causal="bottom_right", Lq=13, Lk=6),
    "window": dict(window=(3, 1)),
    "window-left_only-causal": dict(window=(5, -1), causal=True),
    "window-right_only-Lq>Lk": dict(window=(-1, 0), Lq=12, Lk=5),
    "key_padding": dict(key_padding_mask=True),
    "alibi-heads": dict(alibi_slopes=(4,)),
    "alibi-batch-heads-causal": dict(alibi_slopes=(2, 4), causal="bottom_right"),
    "softcap": dict(softcap=2.0, scale=1.5),
    "bool_mask-empty_rows": dict(attn_mask="bool"),
    "float_mask-minus_inf": dict(attn_mask="float-inf"),
    "gqa-softcap-alibi-window": dict(gqa=2, softcap=5.0, alibi_slopes=(4,), window=(4, 2)),
    "dropout": dict(dropout_p=0.3),
    "everything": dict(
        gqa=2,
        causal="bottom_right",
        window=(5, -1),
        key_padding_mask=True,
        alibi_slopes=(2, 4),
        softcap=3.0,
        attn_mask="float",
        dropout_p=0.2,
        Dv=3,
    ),
}


@pytest.mark.parametrize("case", list(TEXTBOOK_CASES))
def test_reference_matches_textbook_float64(case):
    kw = dict(TEXTBOOK_CASES[case])
    group = kw.pop("gqa", 1)
    B, Hkv, D = 2, 4 // group, 6
    Lq, Lk, Dv = kw.pop("Lq", 9), kw.pop("Lk", 12), kw.pop("Dv", 5)
    Hq = Hkv * group
    q, k, v = _leaves((B, Hq, Lq, D), (B, Hkv, Lk, D), (B, Hkv, Lk, Dv), seed=4)
    g = torch.Generator().manual_seed(5)
    mask_kind = kw.pop("attn_mask", None)
    if mask_kind == "bool":
        mask = torch.rand(B, Hq, Lq, Lk, generator=g) > 0.4
        mask[0, 1, 2] = False  # a row that sees no key
        kw["attn_mask"] = mask
    elif mask_kind is not None:
        mask = torch.randn(1, Hq, Lq, Lk, generator=g, dtype=F64)
        if mask_kind == "float-inf":
            mask = mask.masked_fill(torch.rand(mask.shape, generator=g) < 0.3, float("-inf"))
            mask[0, 0, 1] = float("-inf")  # a row hidden entirely by -inf
        kw["attn_mask"] = mask
    if kw.pop("key_padding_mask", False):
        padding = torch.rand(B, Lk, generator=g) > 0.7
        padding[1] = True  # a sequence that is all padding
        kw["key_padding_mask"] = padding
    if "alibi_slopes" in kw:
        # float32: the slopes every backend takes (fastattn.attention rounds others to it)
        kw["alibi_slopes"] = torch.rand(kw["alibi_slopes"], generator=g) * 0.5
    p = kw.get("dropout_p", 0.0)

    def ours(q, k, v):
        torch.manual_seed(77)
        return fastattn.attention(q, k, v, return_lse=True, backend="reference", **kw)

    keep = None
    if p > 0:
        torch.manual_seed(77)
        seed = dropout_seed(p, torch.device("cpu"))  # the draw attention makes
        b, h, i, j = torch.meshgrid(
            torch.arange(B), torch.arange(Hq), torch.arange(Lq), torch.arange(Lk), indexing="ij"
        )
        keep = dropout_uniform(seed, ((b * Hq + h) * Lq + i) * Lk + j) >= p

    def textbook(q, k, v):
        return textbook_attention(q, k, v, keep=keep, **kw)

    got = _out_lse_grads(ours, [q, k, v], seed=6)
    assert fastattn.last_backend("attention") == "reference"
    want = _out_lse_grads(textbook, [q, k, v], seed=6)
    if case in ("causal_bottom_right-Lq>Lk", "bool_mask-empty_rows", "float_mask-minus_inf"):
        assert torch.isneginf(want[1]).any(), "the case must have rows without a visible key"
    if p > 0:
        assert 0.5 < keep.double().mean() < 0.9
    _assert_same(got, want)


def test_reference_low_precision_is_the_definition_rounded():
    """float32, float16 and bfloat16 inputs: the reference computes in float32 (its documented
    compute type) and rounds the output once, so it is within half an ulp of the output's dtype
    (plus float32 noise) of the float64 textbook run on the same rounded inputs; lse, float32,
    within float32 noise."""
    B, H, Lq, Lk, D = 1, 2, 10, 14, 16
    q64, k64, v64 = _leaves((B, H, Lq, D), (B, H, Lk, D), (B, H, Lk, D), seed=8)
    kw = dict(causal="bottom_right", softcap=4.0, window=(6, -1))
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        q, k, v = (t.detach().to(dtype) for t in (q64, k64, v64))
        exact, exact_lse = textbook_attention(q.double(), k.double(), v.double(), **kw)
        out, lse = fastattn.attention(q, k, v, return_lse=True, backend="reference", **kw)
        assert out.dtype == dtype and lse.dtype == torch.float32
        assert exact.abs().max() > 0.1 and torch.isfinite(exact_lse).all()
        half_ulp = torch.finfo(dtype).eps / 2 * float(exact.abs().max())
        torch.testing.assert_close(out.double(), exact, rtol=0, atol=half_ulp + 1e-5)
        torch.testing.assert_close(lse.double(), exact_lse, rtol=0, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# varlen_attention's reference against the textbook loop, sequence by sequence


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(causal=True),
        dict(causal="bottom_right", window=(3, -1)),
        dict(window=(2, 1), softcap=3.0),
        dict(alibi="batch-heads", causal="bottom_right"),
        dict(dropout_p=0.3, alibi="heads"),
    ],
    ids=["plain", "top_left", "bottom_right-window", "window-softcap", "alibi", "dropout"],
)
def test_varlen_reference_matches_textbook_float64(kw):
    """Each packed sequence is attention with its own Lq, Lk (bottom-right alignment by its
    own Lk - Lq); dropout numbers probability (b, h, i, j) as element
    ((cu_seqlens_q[b] + i) * Hq + h) * max_seqlen_k + j of the Philox stream."""
    kw = dict(kw)
    lengths = ((5, 8), (0, 3), (1, 1), (7, 2), (4, 0), (6, 6))
    Hq, Hkv, D, Dv = 4, 2, 6, 5
    total_q, total_k = sum(a for a, _ in lengths), sum(b for _, b in lengths)
    q, k, v = _leaves((total_q, Hq, D), (total_k, Hkv, D), (total_k, Hkv, Dv), seed=9)
    cu_q = torch.tensor([0] + [sum(a for a, _ in lengths[: n + 1]) for n in range(len(lengths))])
    cu_k = torch.tensor([0] + [sum(b for _, b in lengths[: n + 1]) for n in range(len(lengths))])
    cu_q, cu_k = cu_q.to(torch.int32), cu_k.to(torch.int32)
    max_q, max_k = max(a for a, _ in lengths), max(b for _, b in lengths) + 1  # max_k + 1: a
    # numbering that uses the max_seqlen_k passed, not the largest length
    g = torch.Generator().manual_seed(10)
    alibi = kw.pop("alibi", None)
    if alibi is not None:
        shape = (Hq,) if alibi == "heads" else (len(lengths), Hq)
        kw["alibi_slopes"] = torch.rand(shape, generator=g) * 0.5  # float32, as attention's
    p = kw.get("dropout_p", 0.0)

    def ours(q, k, v):
        torch.manual_seed(5)
        return fastattn.varlen_attention(
            q, k, v, cu_q, cu_k, max_q, max_k, return_lse=True, backend="reference", **kw
        )

    if p > 0:
        torch.manual_seed(5)
        seed = dropout_seed(p, torch.device("cpu"))

    def textbook(q, k, v):
        outs, lses = [], []
        for b, (Lq, Lk) in enumerate(lengths):
            qb = q[cu_q[b] : cu_q[b + 1]].transpose(0, 1)[None]
            kb = k[cu_k[b] : cu_k[b + 1]].transpose(0, 1)[None]
            vb = v[cu_k[b] : cu_k[b + 1]].transpose(0, 1)[None]
            one = {n: x for n, x in kw.items() if n not in ("alibi_slopes", "dropout_p")}
            if "alibi_slopes" in kw:
                slopes = kw["alibi_slopes"]
                one["alibi_slopes"] = slopes if slopes.dim() == 1 else slopes[b]
            keep = None
            if p > 0:
                h, i, j = torch.meshgrid(
                    torch.arange(Hq), torch.arange(Lq), torch.arange(Lk), indexing="ij"
                )
                element = ((int(cu_q[b]) + i) * Hq + h) * max_k + j
                keep = (dropout_uniform(seed, element) >= p)[None]
            ob, lb = textbook_attention(qb, kb, vb, keep=keep, dropout_p=p, **one)
            outs.append(ob[0].transpose(0, 1))
            lses.append(lb[0])
        return torch.cat(outs), torch.cat(lses, dim=1)

    got = _out_lse_grads(ours, [q, k, v], seed=11)
    assert fastattn.last_backend("varlen_attention") == "reference"
    want = _out_lse_grads(textbook, [q, k, v], seed=11)
    _assert_same(got, want)
