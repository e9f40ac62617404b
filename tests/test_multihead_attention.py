"""Tests of fastattn.nn.MultiheadAttention against torch.nn.MultiheadAttention.

The fastattn module is a copy.deepcopy of a torch module turned into fastattn's class with
MultiheadAttention.from_torch (same parameters, bit for bit), so the two must agree:
- in float64 to ~1e-12 for every feature torch has (batch_first both ways, unbatched input,
  self and cross attention, kdim/vdim, bias, add_bias_kv, add_zero_attn, 2-D and 3-D bool and
  float attn_mask, bool and float key_padding_mask, is_causal, need_weights with
  average_attn_weights both ways): outputs, returned weights and the gradients of every
  parameter and input;
- in float32 under FlashAttention's rule (tests/tolerance.py) against the float64 torch run;
- inside torch's Transformer layers and stacks, in training and eval mode (where torch would
  otherwise run its fused C++ encoder fast path; a spy proves that fastattn ran).
Dropout cannot equal torch's (fastattn draws its own Philox stream), so it is checked against
a reference built from the returned dropped-out weights. The biases torch initialises to zero
are redrawn at random so that they are tested too.
"""

from __future__ import annotations

import copy
import io
import math
import re

import pytest
import torch
import torch.nn.functional as F
from tolerance import assert_fa_close, assert_grad_close, float32_floor
from torch import nn

import fastattn
import fastattn.nn.attention as fa_mha
from fastattn import _backend
from fastattn.nn import MultiheadAttention

pytestmark = [
    pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask"),  # torch's
    pytest.mark.filterwarnings("ignore:enable_nested_tensor is True"),
    pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors"),
    pytest.mark.usefixtures("one_thread"),
]

F64 = torch.float64
E, H, KDIM, VDIM = 15, 3, 7, 11  # head_dim 5; key/value feature sizes differ from E
N, L, S = 2, 5, 7  # batch, query length, key length (L != S)
TOL = dict(rtol=1e-12, atol=1e-12)

CONFIGS = {
    "plain": {},
    "no-bias": dict(bias=False),
    "bias-kv": dict(add_bias_kv=True),
    "zero-attn": dict(add_zero_attn=True),
    "kdim-vdim": dict(kdim=KDIM, vdim=VDIM),
    "everything": dict(kdim=KDIM, vdim=VDIM, add_bias_kv=True, add_zero_attn=True, bias=False),
}
LAYOUTS = ("seq-first", "batch-first", "unbatched")
MASKS = (
    "none",
    "attn2d-bool",
    "attn2d-float",
    "attn3d-bool",
    "attn3d-float",
    "kpm-bool",
    "kpm-float",
    "attn2d-bool+kpm-bool",
    "attn3d-float+kpm-float",
    "attn2d-float+kpm-bool",
)
KINDS = ("self", "cross", "kv-shared")  # q is k is v / three tensors / k is v, q different


# ---------------------------------------------------------------------------------------------
# Helpers


def randomize_(module: nn.Module, seed: int = 0) -> nn.Module:
    """Redraw every parameter (torch starts biases at zero, which would hide bias bugs)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(0.5 * torch.randn(p.shape, generator=g, dtype=F64).to(p.dtype))
    return module


def make_pair(
    config: dict, *, batch_first: bool = False, dtype=F64, dropout: float = 0.0, seed: int = 0
):
    """(torch module, fastattn module with identical parameters)."""
    torch.manual_seed(seed)
    ref = nn.MultiheadAttention(
        E, H, dropout=dropout, batch_first=batch_first, dtype=dtype, **config
    )
    randomize_(ref, seed)
    fast = MultiheadAttention.from_torch(copy.deepcopy(ref))
    return ref, fast


def make_inputs(kind: str, layout: str, config: dict, dtype=F64, seed: int = 1):
    """(query, key, value) leaves for `kind` in `layout`; self-attention uses one tensor."""
    g = torch.Generator().manual_seed(seed)
    kd, vd = config.get("kdim", E), config.get("vdim", E)

    def shaped(length, features):
        if layout == "unbatched":
            shape = (length, features)
        elif layout == "batch-first":
            shape = (N, length, features)
        else:
            shape = (length, N, features)
        return torch.randn(shape, generator=g, dtype=F64).to(dtype).requires_grad_()

    if kind == "self":
        x = shaped(S, E)
        return x, x, x
    q = shaped(L, E)
    k = shaped(S, kd)
    v = k if kind == "kv-shared" else shaped(S, vd)
    return q, k, v


def make_masks(masks: str, layout: str, tgt_len: int, dtype=F64, seed: int = 2) -> dict:
    """attn_mask / key_padding_mask keywords for a MASKS entry. Boolean masks are True where
    attention is NOT allowed (torch's convention); key 0 is never masked, so no row is empty
    (torch gives NaN there, fastattn zeros: see test_fully_masked_row_is_zero_not_nan)."""
    g = torch.Generator().manual_seed(seed)
    unbatched = layout == "unbatched"
    kw = {}
    for part in masks.split("+"):
        if part == "none":
            continue
        what, kind = part.split("-")
        if what == "kpm":
            shape = (S,) if unbatched else (N, S)
        elif what == "attn2d":
            shape = (tgt_len, S)
        else:
            shape = (H, tgt_len, S) if unbatched else (N * H, tgt_len, S)
        if kind == "bool":
            m = torch.rand(shape, generator=g) > 0.6
            m[..., 0] = False
        else:
            m = torch.randn(shape, generator=g, dtype=F64).to(dtype)
        kw["key_padding_mask" if what == "kpm" else "attn_mask"] = m
    return kw


def inputs_of(q, k, v):
    """Distinct input leaves (self-attention has one)."""
    out = []
    for t in (q, k, v):
        if not any(t is o for o in out):
            out.append(t)
    return out


def run(module, q, k, v, *, need_weights, average=True, seed=3, **kw):
    """Forward, then backward of a random projection of the output (and of the weights when
    returned): (out, weights, grads of every parameter and input)."""
    for t in inputs_of(q, k, v):
        t.grad = None
    module.zero_grad(set_to_none=True)
    out, w = module(q, k, v, need_weights=need_weights, average_attn_weights=average, **kw)
    g = torch.Generator().manual_seed(seed)
    loss = (out * torch.randn(out.shape, generator=g, dtype=F64).to(out.dtype)).sum()
    if w is not None:
        loss = loss + (w * torch.randn(w.shape, generator=g, dtype=F64).to(w.dtype)).sum()
    loss.backward()
    grads = {name: p.grad for name, p in module.named_parameters()}
    for i, t in enumerate(inputs_of(q, k, v)):
        grads[f"input{i}"] = t.grad
    return out.detach(), None if w is None else w.detach(), grads


def clone_inputs(q, k, v):
    clones = {id(t): t.detach().clone().requires_grad_() for t in inputs_of(q, k, v)}
    return clones[id(q)], clones[id(k)], clones[id(v)]


def assert_same(name, a, b, **tol):
    assert a.shape == b.shape, f"{name}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    torch.testing.assert_close(a, b, **(tol or TOL), msg=lambda m: f"{name}: {m}")


def compare_runs(ref_run, fast_run):
    (o_r, w_r, g_r), (o_f, w_f, g_f) = ref_run, fast_run
    assert_same("output", o_f, o_r)
    assert (w_f is None) == (w_r is None)
    if w_r is not None:
        assert_same("weights", w_f, w_r)
    assert g_f.keys() == g_r.keys()
    for name in g_r:
        assert g_r[name] is not None and g_f[name] is not None, f"no gradient for {name}"
        assert_same(f"grad {name}", g_f[name], g_r[name])


class AttentionSpy:
    """Counts fastattn.nn.MultiheadAttention's kernel calls (and records their causal flag)."""

    def __init__(self, monkeypatch):
        self.calls = []
        for name in ("attention", "attention_with_weights"):
            monkeypatch.setattr(fa_mha, name, self._spy(getattr(fa_mha, name)))

    def _spy(self, original):
        def spy(*args, **kwargs):
            self.calls.append(kwargs)
            return original(*args, **kwargs)

        return spy


def reset_last_backend():
    _backend.record_backend("attention", "none")  # any later call overwrites it


# ---------------------------------------------------------------------------------------------
# 1. Every feature and the main combinations, float64


def _grid():
    for cname, config in CONFIGS.items():
        for layout in LAYOUTS:
            for kind in KINDS:
                if kind == "self" and ("kdim" in config):
                    continue  # self-attention needs kdim == vdim == embed_dim
                if kind == "kv-shared" and ("kdim" in config):
                    continue
                for masks in MASKS:
                    yield pytest.param(
                        cname, layout, kind, masks, id=f"{cname}-{layout}-{kind}-{masks}"
                    )


@pytest.mark.parametrize("cname,layout,kind,masks", list(_grid()))
def test_matches_torch_float64(cname, layout, kind, masks):
    config = CONFIGS[cname]
    ref, fast = make_pair(config, batch_first=(layout != "seq-first"))
    q, k, v = make_inputs(kind, layout, config)
    tgt_len = S if kind == "self" else L
    kw = make_masks(masks, layout, tgt_len)
    q2, k2, v2 = clone_inputs(q, k, v)
    reset_last_backend()
    # Weights per head and averaged, with gradients through them; then the weights-free path
    # (what nn.Transformer layers use), whose backward is the fused kernel's alone.
    for need_weights, average in ((True, False), (True, True), (False, True)):
        compare_runs(
            run(ref, q, k, v, need_weights=need_weights, average=average, **kw),
            run(fast, q2, k2, v2, need_weights=need_weights, average=average, **kw),
        )
    assert fastattn.last_backend("attention") == "cpu"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_returned_weights_shapes_and_rows(layout):
    """Weights are (N, L, S') averaged, (N, H, L, S') per head (no N when unbatched), S'
    counting the bias_kv and zero-attention columns; each row sums to 1."""
    config = dict(add_bias_kv=True, add_zero_attn=True)
    _, fast = make_pair(config, batch_first=layout == "batch-first")
    q, k, v = make_inputs("cross", layout, config)
    batch = () if layout == "unbatched" else (N,)
    _, w = fast(q, k, v, average_attn_weights=False)
    assert w.shape == (*batch, H, L, S + 2)
    torch.testing.assert_close(w.sum(-1), torch.ones_like(w.sum(-1)), rtol=0, atol=1e-12)
    _, w_avg = fast(q, k, v)
    assert w_avg.shape == (*batch, L, S + 2)
    assert_same("average", w_avg, w.mean(dim=-3))
    out, none = fast(q, k, v, need_weights=False)
    assert none is None and out.shape == q.shape


def test_float_masks_receive_gradients():
    """Float attn_mask and key_padding_mask that require grad get torch's gradients (fastattn
    runs them on the reference backend, the one that differentiates masks)."""
    ref, fast = make_pair({}, batch_first=True)
    q, k, v = make_inputs("cross", "batch-first", {})
    results = []
    for module in (ref, fast):
        qc, kc, vc = clone_inputs(q, k, v)
        kw = {
            name: m.requires_grad_()
            for name, m in make_masks("attn3d-float+kpm-float", "batch-first", L).items()
        }
        out, _ = module(qc, kc, vc, need_weights=False, **kw)
        g = torch.randn(out.shape, generator=torch.Generator().manual_seed(5), dtype=F64)
        (out * g).sum().backward()
        results.append((out, kw["attn_mask"].grad, kw["key_padding_mask"].grad))
    for name, a, b in zip(("out", "attn_mask grad", "key_padding_mask grad"), *results):
        assert b is not None, f"{name}: no gradient"
        assert_same(name, b, a)


def test_fully_masked_row_is_zero_not_nan():
    """A query that sees no key: torch returns NaN, fastattn a zero attention output (so the
    module's output is out_proj.bias there) and zero weights; other rows agree with torch."""
    ref, fast = make_pair({}, batch_first=True)
    q, k, v = make_inputs("cross", "batch-first", {})
    mask = torch.zeros(L, S, dtype=torch.bool)
    mask[2] = True  # query 2 may attend nowhere
    out_r, w_r = ref(q, k, v, attn_mask=mask)
    out_f, w_f = fast(q, k, v, attn_mask=mask)
    assert torch.isnan(out_r[:, 2]).all()  # torch's behaviour, which fastattn improves on
    rows = torch.arange(L) != 2
    assert_same("other rows", out_f[:, rows], out_r[:, rows])
    assert_same("masked row", out_f[:, 2], fast.out_proj.bias.detach().expand(N, E))
    assert (w_f[:, 2] == 0).all() and torch.isfinite(w_f).all()
    (out_f.sum() + w_f.sum()).backward()
    assert all(torch.isfinite(p.grad).all() for p in fast.parameters())
    assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()


# ---------------------------------------------------------------------------------------------
# 2. float32 under FlashAttention's rule


@pytest.mark.parametrize("masks", ("none", "attn2d-float+kpm-bool", "attn3d-bool", "kpm-float"))
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("cname,kind", [("plain", "self"), ("everything", "cross")])
def test_float32_flashattention_rule(cname, kind, layout, masks):
    """fastattn in float32 against torch in float64, with torch in float32 as the baseline."""
    config = CONFIGS[cname]
    ref64, _ = make_pair(config, batch_first=layout != "seq-first")
    ref32 = copy.deepcopy(ref64).float()
    fast32 = MultiheadAttention.from_torch(copy.deepcopy(ref32))
    q, k, v = make_inputs(kind, layout, config)
    kw64 = make_masks(masks, layout, S if kind == "self" else L)
    kw32 = {n: (m.float() if m.dtype == F64 else m) for n, m in kw64.items()}
    runs = {}
    for label, module, kw, dtype in (
        ("fast", fast32, kw32, torch.float32),
        ("ref64", ref64, kw64, F64),
        ("ref32", ref32, kw32, torch.float32),
    ):
        qc, kc, vc = clone_inputs(q, k, v)
        qc, kc, vc = (t.detach().to(dtype).requires_grad_() for t in (qc, kc, vc))
        if kind == "self":
            kc = vc = qc
        runs[label] = run(module, qc, kc, vc, need_weights=True, average=False, **kw)
    (out, w, grads), (o64, w64, g64), (o32, w32, g32) = runs["fast"], runs["ref64"], runs["ref32"]
    assert out.dtype == torch.float32
    assert_fa_close(f"{cname} output", out, o64, o32, floor=float32_floor(o64))
    assert_fa_close(f"{cname} weights", w, w64, w32, floor=float32_floor(w64))
    for name in g64:
        assert_grad_close(
            f"{cname} grad {name}",
            grads[name],
            g64[name],
            g32[name],
            floor=float32_floor(g64[name]),
        )


# ---------------------------------------------------------------------------------------------
# 3. Dropout


def _dropout_module(p=0.3):
    torch.manual_seed(0)
    module = randomize_(MultiheadAttention(E, H, dropout=p, batch_first=True, dtype=F64))
    return module.train()


def _dropout_inputs(Lq=16, Sk=24):
    g = torch.Generator().manual_seed(11)
    q = torch.randn(N, Lq, E, generator=g, dtype=F64, requires_grad=True)
    kv = torch.randn(N, Sk, E, generator=g, dtype=F64, requires_grad=True)
    kpm = torch.rand(N, Sk, generator=g) > 0.7
    kpm[:, 0] = False
    return q, kv, kpm


def _heads_reference(module, q, kv, kpm, keep, p):
    """out_proj(dropout(softmax(scores)) @ v_heads) in plain float64 PyTorch from the module's
    own parameters; keep: the dropout mask (N, H, L, S) to apply."""
    w_q, w_k, w_v = module.in_proj_weight.chunk(3)
    b_q, b_k, b_v = module.in_proj_bias.chunk(3)
    Dh = E // H

    def heads(x):
        return x.view(x.shape[0], x.shape[1], H, Dh).transpose(1, 2)

    qh, kh, vh = (
        heads(F.linear(q, w_q, b_q)),
        heads(F.linear(kv, w_k, b_k)),
        heads(F.linear(kv, w_v, b_v)),
    )
    s = (qh @ kh.transpose(-1, -2)) / math.sqrt(Dh)
    s = s.masked_fill(kpm[:, None, None, :], float("-inf"))
    probs = torch.softmax(s, dim=-1) * keep / (1.0 - p)
    ctx = (probs @ vh).transpose(1, 2).reshape(q.shape[0], q.shape[1], E)
    return module.out_proj(ctx), probs


def test_dropout_reproducible_under_manual_seed():
    module = _dropout_module()
    q, kv, kpm = _dropout_inputs()
    torch.manual_seed(7)
    out1, w1 = module(q, kv, kv, key_padding_mask=kpm, average_attn_weights=False)
    torch.manual_seed(7)
    out2, w2 = module(q, kv, kv, key_padding_mask=kpm, average_attn_weights=False)
    assert torch.equal(out1, out2) and torch.equal(w1, w2)
    torch.manual_seed(7)  # the same draw without weights: the kernel's own mask is the same
    out3, _ = module(q, kv, kv, key_padding_mask=kpm, need_weights=False)
    torch.testing.assert_close(out3, out1, **TOL)
    torch.manual_seed(8)
    out4, w4 = module(q, kv, kv, key_padding_mask=kpm, average_attn_weights=False)
    assert not torch.equal(w4, w1) and not torch.allclose(out4, out1)


def test_dropout_zero_where_dropped_and_rescaled():
    p = 0.3
    module = _dropout_module(p)
    q, kv, kpm = _dropout_inputs()
    torch.manual_seed(3)
    _, w = module(q, kv, kv, key_padding_mask=kpm, average_attn_weights=False)
    module.eval()
    _, w_eval = module(q, kv, kv, key_padding_mask=kpm, average_attn_weights=False)
    visible = w_eval > 0
    assert torch.equal(visible, ~kpm[:, None, None, :].expand_as(w_eval))
    dropped = visible & (w == 0)
    rate = dropped.sum().item() / visible.sum().item()
    print(f"dropped {rate:.3f} of {visible.sum().item()} visible weights (p={p})")
    assert abs(rate - p) < 0.05
    kept = visible & ~dropped
    torch.testing.assert_close(w[kept], w_eval[kept] / (1 - p), **TOL)
    assert (w[~visible] == 0).all()


def test_dropout_output_is_weights_times_values():
    """out == out_proj(weights_per_head @ v_heads) with the returned dropped-out weights, and
    the gradients equal those of that reference (the backward regenerates the same mask)."""
    p = 0.3
    module = _dropout_module(p)
    q, kv, kpm = _dropout_inputs()
    torch.manual_seed(5)
    out, w = module(q, kv, kv, key_padding_mask=kpm, need_weights=True, average_attn_weights=False)
    module.eval()
    _, w_eval = module(q, kv, kv, key_padding_mask=kpm, average_attn_weights=False)
    module.train()
    keep = ((w != 0) | (w_eval == 0)).to(F64)
    ref_out, ref_probs = _heads_reference(module, q, kv, kpm, keep, p)
    torch.testing.assert_close(w, ref_probs.detach(), **TOL)
    torch.testing.assert_close(out, ref_out, **TOL)
    # Gradients of the weights-free training path, drawn with the same seed.
    params = list(module.parameters())
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(9), dtype=F64)
    torch.manual_seed(5)
    out_nw, _ = module(q, kv, kv, key_padding_mask=kpm, need_weights=False)
    torch.testing.assert_close(out_nw, out, **TOL)
    grads = torch.autograd.grad((out_nw * g).sum(), params + [q, kv], allow_unused=True)
    ref_grads = torch.autograd.grad((ref_out * g).sum(), params + [q, kv], allow_unused=True)
    names = [n for n, _ in module.named_parameters()] + ["query", "key/value"]
    for name, a, b in zip(names, grads, ref_grads):
        if b is None:  # bias_k etc. are absent here; every parameter used must get one
            assert a is None or (a == 0).all(), name
            continue
        assert_same(f"grad {name}", a, b)


def test_dropout_off_in_eval_matches_torch():
    ref, fast = make_pair({}, batch_first=True, dropout=0.4)
    ref.eval(), fast.eval()
    q, k, v = make_inputs("cross", "batch-first", {})
    compare_runs(
        run(ref, q, k, v, need_weights=True), run(fast, *clone_inputs(q, k, v), need_weights=True)
    )


def test_dropout_gradient_flows_in_training_every_seed_differs():
    """Two training steps draw different masks; both backward passes give finite gradients."""
    module = _dropout_module(0.5)
    q, kv, kpm = _dropout_inputs(5, 7)
    outs = []
    for _ in range(2):
        out, _ = module(q, kv, kv, key_padding_mask=kpm, need_weights=False)
        out.sum().backward()
        outs.append(out.detach())
    assert not torch.allclose(outs[0], outs[1])
    assert all(torch.isfinite(p.grad).all() for p in module.parameters())


# ---------------------------------------------------------------------------------------------
# 4. is_causal


def _causal_masks(length):
    return {
        "float": nn.Transformer.generate_square_subsequent_mask(length, dtype=F64),
        "bool": torch.triu(torch.ones(length, length, dtype=torch.bool), diagonal=1),
    }


@pytest.mark.parametrize("mask_kind", ("float", "bool"))
@pytest.mark.parametrize("need_weights", (False, True), ids=("no-weights", "weights"))
@pytest.mark.parametrize("padding", (False, True), ids=("no-kpm", "kpm"))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_is_causal_hint_matches_torch(monkeypatch, layout, padding, need_weights, mask_kind):
    ref, fast = make_pair({}, batch_first=layout != "seq-first")
    q, k, v = make_inputs("self", layout, {})
    kw = {"attn_mask": _causal_masks(S)[mask_kind], "is_causal": True}
    if padding:
        kw.update(make_masks("kpm-bool", layout, S))
    spy = AttentionSpy(monkeypatch)
    compare_runs(
        run(ref, q, k, v, need_weights=need_weights, **kw),
        run(fast, *clone_inputs(q, k, v), need_weights=need_weights, **kw),
    )
    hint_used = not padding and not need_weights  # torch's rule for when the hint replaces the mask
    assert len(spy.calls) == 1
    assert spy.calls[0]["causal"] is hint_used
    assert (spy.calls[0]["attn_mask"] is None) == hint_used


def test_is_causal_hint_replaces_the_mask_as_in_torch():
    """With the hint (and no weights, no padding) torch ignores the mask's values and runs
    causal attention; so does fastattn."""
    ref, fast = make_pair({}, batch_first=True)
    q, k, v = make_inputs("self", "batch-first", {})
    not_causal = torch.zeros(S, S, dtype=F64)
    out_r, _ = ref(q, k, v, attn_mask=not_causal, is_causal=True, need_weights=False)
    out_f, _ = fast(q, k, v, attn_mask=not_causal, is_causal=True, need_weights=False)
    causal_f, _ = fast(q, k, v, attn_mask=_causal_masks(S)["bool"], need_weights=False)
    assert_same("hint", out_f, out_r)
    assert_same("hint == causal mask", out_f, causal_f)


def test_is_causal_without_mask_raises_like_torch():
    ref, fast = make_pair({})
    q, k, v = make_inputs("self", "seq-first", {})
    for module in (ref, fast):
        with pytest.raises(RuntimeError, match="is_causal"):
            module(q, k, v, is_causal=True)


# ---------------------------------------------------------------------------------------------
# 5. Construction, parameters and state_dict


@pytest.mark.parametrize("cname", CONFIGS)
@pytest.mark.parametrize("batch_first", (False, True))
def test_same_constructor_same_parameters(cname, batch_first):
    """Built with the same seed, fastattn's module has torch's parameters: same names, shapes,
    values and init order; it is a torch.nn.MultiheadAttention."""
    config = CONFIGS[cname]
    torch.manual_seed(4)
    ref = nn.MultiheadAttention(E, H, batch_first=batch_first, **config)
    torch.manual_seed(4)
    fast = MultiheadAttention(E, H, batch_first=batch_first, **config)
    assert isinstance(fast, nn.MultiheadAttention)
    assert [n for n, _ in fast.named_parameters()] == [n for n, _ in ref.named_parameters()]
    for (name, a), (_, b) in zip(fast.named_parameters(), ref.named_parameters()):
        assert torch.equal(a, b), name
    assert list(fast.state_dict()) == list(ref.state_dict())
    assert fast.batch_first == batch_first and fast.head_dim == E // H


@pytest.mark.parametrize("cname", CONFIGS)
def test_state_dict_loads_both_ways(cname):
    config = CONFIGS[cname]
    ref, fast = make_pair(config, batch_first=True, seed=1)
    assert list(fast.state_dict()) == list(ref.state_dict())
    buffer = io.BytesIO()
    torch.save(fast.state_dict(), buffer)
    buffer.seek(0)
    torch.manual_seed(9)  # fresh modules with other values
    ref2 = nn.MultiheadAttention(E, H, batch_first=True, dtype=F64, **config)
    fast2 = MultiheadAttention(E, H, batch_first=True, dtype=F64, **config)
    ref2.load_state_dict(torch.load(buffer), strict=True)
    fast2.load_state_dict(ref.state_dict(), strict=True)
    q, k, v = make_inputs("cross", "batch-first", config)
    for module in (ref2, fast2):
        out, w = module(q, k, v)
        out_ref, w_ref = ref(q, k, v)
        assert_same(type(module).__module__, out, out_ref)
        assert_same("weights", w, w_ref)


def test_from_torch_keeps_object_and_parameters():
    torch.manual_seed(0)
    module = nn.MultiheadAttention(E, H, kdim=KDIM, vdim=VDIM)
    params = dict(module.named_parameters())
    swapped = MultiheadAttention.from_torch(module)
    assert swapped is module and type(module) is MultiheadAttention
    assert all(p is params[n] for n, p in module.named_parameters())
    MultiheadAttention.from_torch(module)  # twice: one fast-path-disabling hook only
    assert len(module._forward_pre_hooks) == 1


def test_backend_argument(monkeypatch):
    _, fast = make_pair({}, batch_first=True)
    q, k, v = make_inputs("cross", "batch-first", {})
    fast.fastattn_backend = "reference"
    out_ref, _ = fast(q, k, v)
    assert fastattn.last_backend("attention") == "reference"
    fast.fastattn_backend = None
    out_cpu, _ = fast(q, k, v)
    assert fastattn.last_backend("attention") == "cpu"
    assert_same("reference vs cpu", out_cpu, out_ref)
    torch.manual_seed(0)
    built = MultiheadAttention(E, H, backend="reference", dtype=F64)
    built(q[0], k[0], v[0])
    assert fastattn.last_backend("attention") == "reference"


# ---------------------------------------------------------------------------------------------
# 6. Inside torch's Transformer layers and stacks


D_MODEL, NHEAD, D_FF = 16, 2, 24  # even head count: torch's encoder fast path applies
SRC, TGT, BATCH = 7, 6, 3
LAYER_KINDS = {
    "encoder-layer": 1,
    "decoder-layer": 2,
    "encoder": 2,
    "decoder": 4,
    "transformer": 6,
}  # -> attention modules called per forward


def build_layer_model(kind: str, norm_first: bool, batch_first: bool, dropout: float):
    torch.manual_seed(0)
    kw = dict(
        d_model=D_MODEL,
        nhead=NHEAD,
        dim_feedforward=D_FF,
        dropout=dropout,
        batch_first=batch_first,
        norm_first=norm_first,
        dtype=F64,
    )
    if kind == "encoder-layer":
        model = nn.TransformerEncoderLayer(**kw)
    elif kind == "decoder-layer":
        model = nn.TransformerDecoderLayer(**kw)
    elif kind == "encoder":
        model = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(**kw), 2, enable_nested_tensor=True
        )
    elif kind == "decoder":
        model = nn.TransformerDecoder(nn.TransformerDecoderLayer(**kw), 2)
    else:
        model = nn.Transformer(num_encoder_layers=2, num_decoder_layers=2, **kw)
    return randomize_(model, seed=3)


def layer_inputs(kind: str, batch_first: bool):
    """(args, kwargs, valid): right-padded batches (so torch's eval path may pack them into
    NestedTensors), causal target masks; `valid` (B, L) marks the output positions to compare
    (torch's packed encoder path writes zeros at padding)."""
    g = torch.Generator().manual_seed(21)

    def seq(length):
        x = torch.randn(BATCH, length, D_MODEL, generator=g, dtype=F64)
        x = x if batch_first else x.transpose(0, 1).contiguous()
        return x.requires_grad_()

    src_pad = torch.zeros(BATCH, SRC, dtype=torch.bool)
    src_pad[1, 5:] = True
    src_pad[2, 3:] = True
    tgt_pad = torch.zeros(BATCH, TGT, dtype=torch.bool)
    tgt_pad[0, 4:] = True
    causal = nn.Transformer.generate_square_subsequent_mask(TGT, dtype=F64)
    if kind in ("encoder-layer", "encoder"):
        return (seq(SRC),), {"src_key_padding_mask": src_pad}, ~src_pad
    memory = seq(SRC)
    tgt = seq(TGT)
    kw = dict(
        tgt_mask=causal,
        tgt_key_padding_mask=tgt_pad,
        memory_key_padding_mask=src_pad,
        tgt_is_causal=True,
    )
    if kind == "transformer":
        kw["src_key_padding_mask"] = src_pad
        return (memory, tgt), kw, ~tgt_pad
    return (tgt, memory), kw, ~tgt_pad


@pytest.mark.parametrize("mode", ("train", "eval"))
@pytest.mark.parametrize("batch_first", (True, False), ids=("batch-first", "seq-first"))
@pytest.mark.parametrize("norm_first", (False, True), ids=("post-norm", "pre-norm"))
@pytest.mark.parametrize(
    "how,kind",
    [("swap_modules", kind) for kind in LAYER_KINDS]
    + [("from_torch", "encoder"), ("from_torch", "transformer")],
)
def test_inside_transformer_modules(monkeypatch, how, kind, norm_first, batch_first, mode):
    """Swapped (swap_modules, or each attention turned with from_torch, as a user building a
    model with fastattn's class would have it) vs the torch model, float64. In eval mode under
    no_grad torch takes its fused encoder path (and packs padded batches into NestedTensors);
    the spy proves every attention call still ran fastattn."""
    original = build_layer_model(
        kind, norm_first, batch_first, dropout=0.0 if mode == "train" else 0.2
    )
    fast = copy.deepcopy(original)
    if how == "swap_modules":
        fastattn.swap_modules(fast)
        assert len(fastattn.swap_summary(fast)) == LAYER_KINDS[kind]  # each runs once
    else:
        for m in fast.modules():
            if type(m) is nn.MultiheadAttention:
                MultiheadAttention.from_torch(m)
    assert not any(type(m) is nn.MultiheadAttention for m in fast.modules())
    args, kw, valid = layer_inputs(kind, batch_first)
    args2 = tuple(a.detach().clone().requires_grad_() for a in args)
    spy = AttentionSpy(monkeypatch)
    reset_last_backend()
    if mode == "eval":
        original.eval(), fast.eval()
        with torch.no_grad():
            out_r, out_f = original(*args, **kw), fast(*args2, **kw)
    else:
        out_r, out_f = original(*args, **kw), fast(*args2, **kw)
    assert len(spy.calls) == LAYER_KINDS[kind]
    assert fastattn.last_backend("attention") == "cpu"
    if not batch_first:
        out_r, out_f = out_r.transpose(0, 1), out_f.transpose(0, 1)
    assert_same("output (valid positions)", out_f[valid], out_r[valid], rtol=1e-10, atol=1e-10)
    if mode == "train":
        g = torch.randn(out_r.shape, generator=torch.Generator().manual_seed(2), dtype=F64)
        (torch.where(valid[..., None], out_r, 0) * g).sum().backward()
        (torch.where(valid[..., None], out_f, 0) * g).sum().backward()
        for (name, p), q in zip(original.named_parameters(), fast.parameters()):
            assert_same(f"grad {name}", q.grad, p.grad, rtol=1e-10, atol=1e-10)
        for i, (a, b) in enumerate(zip(args, args2)):
            assert_same(f"grad input {i}", b.grad, a.grad, rtol=1e-10, atol=1e-10)


def test_encoder_layer_fast_path_really_disabled(monkeypatch):
    """The swapped encoder layer never calls torch's fused encoder-layer op in eval mode (the
    unswapped one does, which is what makes the comparison above meaningful)."""
    calls = []
    real = torch._transformer_encoder_layer_fwd

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_transformer_encoder_layer_fwd", spy)
    model = build_layer_model("encoder-layer", False, True, 0.0).eval()
    x = torch.randn(BATCH, SRC, D_MODEL, dtype=F64)
    with torch.no_grad():
        expected = model(x)
        assert len(calls) == 1
        fastattn.swap_modules(model)
        got = model(x)
        assert len(calls) == 1
        fastattn.restore_modules(model)
        model(x)
        assert len(calls) == 2
    assert_same("eval", got, expected, rtol=1e-10, atol=1e-10)


def test_encoder_built_with_fastattn_attention_takes_packed_batches(monkeypatch):
    """A TransformerEncoder whose layers were given fastattn's attention directly (not through
    swap_modules, which turns the packing off) packs a padded batch into a NestedTensor in
    eval mode, as it decides from the layer alone: fastattn's module takes it (padding it back
    internally) and the valid positions equal the torch model's."""
    original = build_layer_model("encoder", False, True, 0.0).eval()
    fast = copy.deepcopy(original)
    for layer in fast.layers:
        attn = MultiheadAttention(D_MODEL, NHEAD, batch_first=True, dtype=F64)
        attn.load_state_dict(layer.self_attn.state_dict())
        layer.self_attn = attn
    assert fast.use_nested_tensor
    nested_inputs = []
    real = MultiheadAttention._forward_nested

    def spy(self, query, *args):
        nested_inputs.append(query.is_nested)
        return real(self, query, *args)

    monkeypatch.setattr(MultiheadAttention, "_forward_nested", spy)
    (x,), kw, valid = layer_inputs("encoder", True)
    with torch.no_grad():
        out_r, out_f = original(x, **kw), fast(x, **kw)
    assert nested_inputs == [True, True]  # both layers got the packed batch
    assert_same("valid positions", out_f[valid], out_r[valid], rtol=1e-10, atol=1e-10)
    with pytest.raises(AssertionError, match="NestedTensor"):  # other nested uses: clear error
        nested = torch.nested.nested_tensor([x[0, :3].detach(), x[1, :5].detach()])
        fast.layers[0].self_attn(
            nested, nested, nested, key_padding_mask=kw["src_key_padding_mask"][:2, :5]
        )


def test_compile_fullgraph_swapped_encoder_layer():
    """A swapped TransformerEncoderLayer compiles without graph breaks (training mode, padding
    and weights-free attention, as the layer calls it); output and gradients equal eager."""
    torch._dynamo.reset()
    # Inductor's caches key on the traced graph, not on the custom ops' fake kernels: an entry
    # compiled before a fake changed would be reused, so this test compiles afresh.
    caches = dict(fx_graph_cache=False, autotune_local_cache=False)
    with (
        torch._inductor.config.patch(caches),
        torch._functorch.config.patch(enable_autograd_cache=False),
    ):
        _compile_encoder_layer()


def _compile_encoder_layer():
    torch.manual_seed(0)
    layer = fastattn.swap_modules(
        nn.TransformerEncoderLayer(16, 2, 24, dropout=0.0, batch_first=True)
    )
    x = torch.randn(3, 6, 16)
    pad = torch.zeros(3, 6, dtype=torch.bool)
    pad[1, 4:] = True
    out = torch.compile(layer, fullgraph=True)(x, src_key_padding_mask=pad)
    eager = layer(x, src_key_padding_mask=pad)
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)
    grads = torch.autograd.grad(out.square().sum(), list(layer.parameters()))
    eager_grads = torch.autograd.grad(eager.square().sum(), list(layer.parameters()))
    for g, e in zip(grads, eager_grads):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# 7. Bad inputs raise what torch raises


def _bad_calls():
    q = torch.randn(L, N, E, dtype=F64)
    k = torch.randn(S, N, E, dtype=F64)
    return {
        "attn_mask-2d-shape": lambda m: m(q, k, k, attn_mask=torch.zeros(L, L, dtype=F64)),
        "attn_mask-3d-shape": lambda m: m(q, k, k, attn_mask=torch.zeros(N * H + 1, L, S)),
        "attn_mask-4d": lambda m: m(q, k, k, attn_mask=torch.zeros(1, N * H, L, S)),
        "attn_mask-int": lambda m: m(q, k, k, attn_mask=torch.zeros(L, S, dtype=torch.long)),
        "kpm-int": lambda m: m(q, k, k, key_padding_mask=torch.zeros(N, S, dtype=torch.long)),
        "kpm-shape": lambda m: m(q, k, k, key_padding_mask=torch.zeros(N, S + 1).bool()),
        "unbatched-kpm-2d": lambda m: m(
            q[:, 0], k[:, 0], k[:, 0], key_padding_mask=torch.zeros(1, S).bool()
        ),
        "embed-dim": lambda m: m(q[..., :-1], k, k),
        "query-4d": lambda m: m(q[None], k[None], k[None]),
        "key-2d": lambda m: m(q, k[:, 0], k),
        "key-value-length": lambda m: m(q, k, k[:-1]),
        "key-features": lambda m: m(q, k[..., :-2], k),
        "is_causal-without-mask": lambda m: m(q, k, k, is_causal=True),
    }


@pytest.mark.parametrize("case", list(_bad_calls()))
def test_bad_inputs_raise_like_torch(case):
    ref, fast = make_pair({})
    call = _bad_calls()[case]
    with pytest.raises(Exception) as torch_error:
        call(ref)
    with pytest.raises(Exception) as fast_error:
        call(fast)
    print(f"torch: {torch_error.value!r}\nfastattn: {fast_error.value!r}")
    assert type(fast_error.value) is type(torch_error.value)


def test_bad_constructor_raises_like_torch():
    with pytest.raises(AssertionError):
        nn.MultiheadAttention(10, 3)
    with pytest.raises(AssertionError):
        MultiheadAttention(10, 3)


# ---------------------------------------------------------------------------------------------
# torch's errors, word for word


def _mha_error_cases():
    E, r = 8, torch.randn
    cases = []
    for bf in (False, True):
        for kw in ({}, {"kdim": 5, "vdim": 3}, {"add_bias_kv": True, "add_zero_attn": True}):
            kd, vd = kw.get("kdim", E), kw.get("vdim", E)

            def sh(L, N, F, bf=bf):
                return (N, L, F) if bf else (L, N, F)

            good = lambda sh=sh, kd=kd, vd=vd: (r(*sh(5, 2, E)), r(*sh(4, 2, kd)), r(*sh(4, 2, vd)))
            bool_mask = lambda *s: torch.zeros(*s, dtype=torch.bool)
            calls = {
                "key 2-D": lambda sh=sh, kd=kd, vd=vd: ((r(*sh(5, 2, E)), r(5, kd), r(5, vd)), {}),
                "key/value lengths": lambda sh=sh, kd=kd, vd=vd: (
                    (r(*sh(5, 2, E)), r(*sh(4, 2, kd)), r(*sh(3, 2, vd))),
                    {},
                ),
                "2-D mask": lambda good=good: (good(), {"attn_mask": torch.zeros(5, 3)}),
                "3-D mask": lambda good=good: (good(), {"attn_mask": torch.zeros(3, 5, 4)}),
                "1-D mask": lambda good=good: (good(), {"attn_mask": torch.zeros(4)}),
                "int mask": lambda good=good: (
                    good(),
                    {"attn_mask": torch.zeros(5, 4, dtype=torch.int64)},
                ),
                "padding length": lambda good=good: (good(), {"key_padding_mask": bool_mask(2, 3)}),
                "padding batch": lambda good=good: (good(), {"key_padding_mask": bool_mask(3, 4)}),
                "int padding": lambda good=good: (
                    good(),
                    {"key_padding_mask": torch.zeros(2, 4, dtype=torch.int32)},
                ),
                "unbatched 2-D padding": lambda kd=kd, vd=vd: (
                    (r(5, E), r(4, kd), r(4, vd)),
                    {"key_padding_mask": bool_mask(2, 4)},
                ),
                "unbatched 3-D mask": lambda kd=kd, vd=vd: (
                    (r(5, E), r(4, kd), r(4, vd)),
                    {"attn_mask": torch.zeros(3, 5, 4)},
                ),
                "batch": lambda sh=sh, kd=kd, vd=vd: (
                    (r(*sh(5, 2, E)), r(*sh(4, 3, kd)), r(*sh(4, 3, vd))),
                    {},
                ),
                "embed dim": lambda sh=sh, kd=kd, vd=vd: (
                    (r(*sh(5, 2, 6)), r(*sh(4, 2, kd)), r(*sh(4, 2, vd))),
                    {},
                ),
                "key features": lambda sh=sh, kd=kd, vd=vd: (
                    (r(*sh(5, 2, E)), r(*sh(4, 2, kd + 1)), r(*sh(4, 2, vd))),
                    {},
                ),
                "4-D query": lambda sh=sh, kd=kd, vd=vd: (
                    (r(5, 2, 3, E), r(*sh(4, 2, kd)), r(*sh(4, 2, vd))),
                    {},
                ),
                "is_causal without mask": lambda good=good: (good(), {"is_causal": True}),
            }
            for name, call in calls.items():
                cases.append(pytest.param(bf, kw, call, id=f"bf{int(bf)}-{sorted(kw)}-{name}"))
    return cases


@pytest.mark.parametrize("batch_first, kwargs, call", _mha_error_cases())
def test_invalid_shapes_raise_torchs_errors(batch_first, kwargs, call):
    outcomes = []
    for cls in (torch.nn.MultiheadAttention, fastattn.nn.MultiheadAttention):
        torch.manual_seed(0)
        module = cls(8, 2, batch_first=batch_first, **kwargs)
        torch.manual_seed(1)
        args, kw = call()
        try:
            outcomes.append(("ok", tuple(module(*args, **kw)[0].shape)))
        except Exception as exc:  # noqa: BLE001 - the exception itself is what is compared
            outcomes.append((type(exc), str(exc)))
    assert outcomes[1] == outcomes[0]
    assert outcomes[0][0] != "ok"  # every case is an error in torch


@pytest.mark.parametrize("need_weights", [True, False])
def test_autocast_dtypes_like_torch(need_weights):
    torch.manual_seed(0)
    theirs, ours = nn.MultiheadAttention(8, 2), fastattn.nn.MultiheadAttention(8, 2)
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(5, 2, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = theirs(x, x, x, need_weights=need_weights)
        got = ours(x, x, x, need_weights=need_weights)
    assert got[0].dtype == want[0].dtype
    torch.testing.assert_close(got[0].float(), want[0].float(), atol=2e-2, rtol=2e-2)
    if need_weights:
        assert got[1].dtype == want[1].dtype


# ---------------------------------------------------------------------------------------------
# An in_proj_bias of another dtype (torch's test_multihead_attn_fast_path_query_and_bias_have_
# different_dtypes: a float64 module given a float16 in_proj_bias, called in eval mode)


@pytest.mark.parametrize("need_weights", (True, False), ids=("weights", "no-weights"))
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(
    "cname,kind", [("plain", "self"), ("plain", "kv-shared"), ("kdim-vdim", "cross")]
)
def test_in_proj_bias_of_another_dtype_like_torch(cname, kind, layout, need_weights):
    """Batch-first batched inputs: torch runs, adding the float16 bias converted to float64
    (its F.linear of the transposed input adds the bias after the matmul), so fastattn gives
    the same float64 output and weights, and the same gradients (the bias's in float16).
    Other layouts: torch's addmm refuses the bias, and fastattn raises torch's error."""
    config = CONFIGS[cname]
    ref, fast = make_pair(config, batch_first=layout == "batch-first")
    g = torch.Generator().manual_seed(5)
    bias = (0.5 * torch.randn(3 * E, generator=g, dtype=F64)).half()
    for module in (ref, fast):
        module.eval()
        module.in_proj_bias = nn.Parameter(bias.clone())
    q, k, v = make_inputs(kind, layout, config)
    if layout != "batch-first":
        with pytest.raises(RuntimeError) as theirs:
            ref(q, k, v, need_weights=need_weights)
        with pytest.raises(RuntimeError, match=re.escape(str(theirs.value))):
            fast(q, k, v, need_weights=need_weights)
        return
    (o_r, w_r, g_r), (o_f, w_f, g_f) = (
        run(ref, q, k, v, need_weights=need_weights),
        run(fast, *clone_inputs(q, k, v), need_weights=need_weights),
    )
    assert o_f.dtype == o_r.dtype == F64
    assert_same("output", o_f, o_r)
    assert (w_f is None) == (w_r is None) == (not need_weights)
    if need_weights:
        assert w_f.dtype == w_r.dtype == F64
        assert_same("weights", w_f, w_r)
    assert g_f.keys() == g_r.keys()
    for name in g_r:
        assert g_f[name].dtype == g_r[name].dtype, name
        # the float16 bias's gradient is a float64 sum rounded to float16: one rounding apart
        tol = dict(rtol=2e-3, atol=1e-6) if g_r[name].dtype == torch.float16 else {}
        assert_same(f"grad {name}", g_f[name], g_r[name], **tol)
    with torch.no_grad():  # torch's test case as it runs it: no gradients, eval mode
        for module in (ref, fast):
            out, _ = module(q, k, v, need_weights=need_weights)
            assert out.dtype == F64
            assert_same("no-grad output", out, o_r)
