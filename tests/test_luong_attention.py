"""fastattn.nn.LuongAttention against a plain float64 formula of Luong et al. 2015's scores
(dot, general, concat): context, weights, masks, one decoder step, gradients, bad input."""

from __future__ import annotations

import pytest
import torch

import fastattn

F64 = torch.float64


def expected(module, query, keys, values, mask):
    """The scores written out, softmax over keys, weighted sum (float64)."""
    q = query if query.dim() == 3 else query[:, None]
    if module.score == "dot":
        scores = q @ keys.transpose(1, 2)
    elif module.score == "general":
        scores = q @ module.linear.weight @ keys.transpose(1, 2)  # q^T W k
    else:
        W = torch.cat([module.query_proj.weight, module.key_proj.weight], dim=1)  # W_a
        pairs = torch.cat(
            [
                q[:, :, None].expand(-1, -1, keys.shape[1], -1),
                keys[:, None].expand(-1, q.shape[1], -1, -1),
            ],
            dim=-1,
        )
        scores = torch.tanh(pairs @ W.T) @ module.v
    if mask is not None:
        scores = scores.masked_fill(mask[:, None], float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    context = weights @ values
    if query.dim() == 2:
        return context[:, 0], weights[:, 0]
    return context, weights


@pytest.mark.parametrize("score", ["dot", "general", "concat"])
@pytest.mark.parametrize("step", [False, True], ids=["sequence", "one-step"])
@pytest.mark.parametrize("masked", [False, True])
def test_matches_formula_float64(score, step, masked):
    torch.manual_seed(0)
    Dq = 12 if score == "dot" else 10
    module = fastattn.nn.LuongAttention(Dq, 12, score=score, value_dim=7).double()
    B, Lq, Lk = 3, 5, 9
    query = torch.randn((B, Dq) if step else (B, Lq, Dq), dtype=F64, requires_grad=True)
    keys = torch.randn(B, Lk, 12, dtype=F64, requires_grad=True)
    values = torch.randn(B, Lk, 7, dtype=F64, requires_grad=True)
    mask = None
    if masked:
        mask = torch.zeros(B, Lk, dtype=torch.bool)
        mask[0, 4:] = True
        mask[2] = True  # every key masked: zero context, zero weights
    ctx, w = module(query, keys, values, key_padding_mask=mask, need_weights=True)
    ctx2, w2 = expected(module, query, keys, values, mask)
    torch.testing.assert_close(ctx, ctx2, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(w, w2, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(module(query, keys, values, key_padding_mask=mask), ctx)
    leaves = [query, keys, values] + list(module.parameters())
    g1 = torch.autograd.grad((ctx * torch.cos(ctx2.detach())).sum(), leaves)
    g2 = torch.autograd.grad((ctx2 * torch.cos(ctx2.detach())).sum(), leaves)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10)


def test_default_values_are_keys_and_float32():
    torch.manual_seed(0)
    module = fastattn.nn.LuongAttention(8, 8, score="dot")
    q, k = torch.randn(2, 3, 8), torch.randn(2, 6, 8)
    ctx = module(q, k)
    ctx2, _ = expected(module, q.double(), k.double(), k.double(), None)
    torch.testing.assert_close(ctx.double(), ctx2, rtol=1e-5, atol=1e-6)
    assert "score='dot'" in repr(module)


def test_errors():
    with pytest.raises(ValueError, match="score must be one of"):
        fastattn.nn.LuongAttention(4, 4, score="bilinear")
    with pytest.raises(ValueError, match="needs query_dim == key_dim"):
        fastattn.nn.LuongAttention(4, 5, score="dot")
    module = fastattn.nn.LuongAttention(4, 5)
    with pytest.raises(ValueError, match="query must be"):
        module(torch.randn(2, 3, 5), torch.randn(2, 3, 5))
    with pytest.raises(ValueError, match="keys must be"):
        module(torch.randn(2, 3, 4), torch.randn(2, 3, 4))
    with pytest.raises(ValueError, match="values must be"):
        module(torch.randn(2, 3, 4), torch.randn(2, 3, 5), torch.randn(2, 3, 6))
