"""torch.compile(dynamic=True, fullgraph=True) over every op and module: sequence lengths and
batch sizes stay symbolic (one graph for every length, no recompilation), other head dims give
correct results (the softmax scale 1/sqrt(D) is a float argument, which torch specializes),
and forward and backward match eager."""

import pytest
import torch
from torch._dynamo.utils import counters

import fastattn


def _r(*shape):
    return torch.randn(*shape, requires_grad=True)


def _cu(n):
    return torch.tensor([0, n, 2 * n + 1], dtype=torch.int32)


def _kv_inputs(Lmax, D):
    return (
        torch.randn(2, 4, 1, D),
        torch.zeros(2, 2, Lmax, D),
        torch.zeros(2, 2, Lmax, D),
        torch.randn(2, 2, 1, D),
        torch.randn(2, 2, 1, D),
        torch.tensor([3, Lmax - 2], dtype=torch.int32),
    )


def _kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens):
    return fastattn.attention_with_kvcache(
        q, k_cache.clone(), v_cache.clone(), k_new=k_new, v_new=v_new, cache_seqlens=cache_seqlens
    )


_lstm = fastattn.nn.LSTM(3, 4, num_layers=2, bidirectional=True)
_mha = fastattn.nn.MultiheadAttention(8, 2, batch_first=True)
_sin_pe = fastattn.nn.SinusoidalPositionalEncoding(16)

# name: (function, make(length, other) -> inputs, lengths (other fixed), (length, other) with
# another head dim or width, backward?)
CASES = {
    "attention": (
        lambda q, k, v: fastattn.attention(q, k, v, causal=True),
        lambda L, D: (_r(2, 4, L, D), _r(2, 2, L, D), _r(2, 2, L, D)),
        16,
        (9, 32),
        True,
    ),
    "attention-masks": (
        lambda q, k, v, m: fastattn.attention(q, k, v, key_padding_mask=m, window=(3, 0)),
        lambda L, D: (
            _r(2, 2, L, D),
            _r(2, 2, L + 1, D),
            _r(2, 2, L + 1, D),
            torch.arange(L + 1).expand(2, L + 1) % 4 == 1,
        ),
        16,
        (9, 24),
        True,
    ),
    "varlen_attention": (
        lambda q, k, v, cu: fastattn.varlen_attention(
            q, k, v, cu, cu, q.shape[0], q.shape[0], causal=True
        ),
        lambda n, D: (_r(2 * n + 1, 2, D), _r(2 * n + 1, 2, D), _r(2 * n + 1, 2, D), _cu(n)),
        16,
        (6, 32),
        True,
    ),
    "additive_attention": (
        lambda q, k, wq, wk, v: fastattn.additive_attention(q, k, w_query=wq, w_keys=wk, v=v),
        lambda L, D: (_r(2, L, D), _r(2, L + 2, D), _r(6, D), _r(6, D), _r(6)),
        8,
        (6, 12),
        True,
    ),
    "lstm_cell": (
        lambda x, h, c, wi, wh: fastattn.lstm_cell(x, h, c, wi, wh),
        lambda B, H: (_r(B, 3), _r(B, H), _r(B, H), _r(4 * H, 3), _r(4 * H, H)),
        4,
        (5, 6),
        True,
    ),
    "nn.LSTM": (lambda x: _lstm(x)[0], lambda T, B: (_r(T, B, 3),), 2, (6, 3), True),
    "nn.MultiheadAttention": (
        lambda x: _mha(x, x, x, need_weights=False)[0],
        lambda L, B: (_r(B, L, 8),),
        2,
        (6, 3),
        True,
    ),
    "add_sinusoidal": (
        lambda x: fastattn.add_sinusoidal(x, scale=2.0),
        lambda L, D: (_r(2, L, D),),
        8,
        (6, 16),
        True,
    ),
    "embed_with_positions": (
        lambda w, t: fastattn.embed_with_positions(t, w),
        lambda L, D: (_r(10, D), torch.arange(2 * L).view(2, L) % 10),
        8,
        (6, 16),
        True,
    ),
    "apply_rotary": (
        lambda x: fastattn.apply_rotary(x),
        lambda L, D: (_r(2, 2, L, D),),
        8,
        (6, 16),
        True,
    ),
    "nn.SinusoidalPositionalEncoding": (
        lambda x: _sin_pe(x),
        lambda L, B: (_r(B, L, 16),),
        2,
        (6, 3),
        True,
    ),
    "attention_with_kvcache": (_kvcache, _kv_inputs, 8, (24, 16), False),
}


def _outputs(result):
    result = result if isinstance(result, tuple) else (result,)
    return [t for t in result if isinstance(t, torch.Tensor)]


def _run(fn, inputs, backward):
    outs = _outputs(fn(*inputs))
    grads = []
    if backward:
        leaves = [t for t in inputs if t.requires_grad]
        grads = torch.autograd.grad(sum(o.sum() for o in outs), leaves)
    return [o.detach() for o in outs], list(grads)


@pytest.mark.parametrize("name", list(CASES))
def test_compile_dynamic(name):
    fn, make, other, changed, backward = CASES[name]
    torch.manual_seed(0)
    lengths = [(5, other), (7, other), (11, other)]
    cases = [make(*shape) for shape in lengths + [changed]]
    expected = [_run(fn, inputs, backward) for inputs in cases]  # eager first
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(fn, dynamic=True, fullgraph=True)
    for i, (inputs, want) in enumerate(zip(cases, expected)):
        got = _run(compiled, inputs, backward)
        for g, w in zip(got[0] + got[1], want[0] + want[1]):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)
        if i == len(lengths) - 1:  # every length ran in the first graph
            assert counters["stats"]["unique_graphs"] == 1, (name, dict(counters["stats"]))


def test_compile_caches_carry_fastattn_fingerprint(tmp_path, monkeypatch):
    """AOTAutograd's cache keys on the traced graph, which names a fastattn op but not its
    autograd formula: fastattn's fingerprint in torch's cache_key_tag makes a changed fastattn
    miss the cache (a stale compiled backward called the op with another argument list)."""
    from fastattn import _compile_cache

    if not hasattr(torch.compiler.config, "cache_key_tag"):
        pytest.skip("this torch has no torch.compiler.config.cache_key_tag")
    assert "fastattn-" + _compile_cache.package_fingerprint() in torch.compiler.config.cache_key_tag
    # The fingerprint follows the sources: a file that changes changes it.
    fake_root = tmp_path / "fastattn"
    fake_root.mkdir()
    source = fake_root / "op.py"
    source.write_text("x = 1\n")
    monkeypatch.setattr(_compile_cache, "__file__", str(fake_root / "_compile_cache.py"))
    before = _compile_cache.package_fingerprint()
    source.write_text("x = 22\n")
    assert _compile_cache.package_fingerprint() != before
    # A user's own tag stays in front, and tagging twice adds nothing.
    # (config.patch, not monkeypatch: monkeypatch's undo would delete the config entry.)
    with torch.compiler.config.patch(cache_key_tag="mine"):
        _compile_cache.tag_compile_caches()
        _compile_cache.tag_compile_caches()
        assert torch.compiler.config.cache_key_tag.startswith("mine|fastattn-")
        assert torch.compiler.config.cache_key_tag.count("fastattn-") == 1
