"""fastattn.distributed on gloo/CPU: ring and Ulysses attention against one-process attention
in float64 (outputs, lse, dq/dk/dv), sharding round trips, the context-parallel
MultiheadAttention, bad input (clear errors, no hang), the ring's overlap, and fastattn models
under DDP and FSDP2.

Process groups of 2 and 4 ranks are spawned once per module (tests/distributed_harness.py)
and shared by the tests; every call is bounded in time, and a hung group is killed and fails
its test. Each rank draws the same full tensors (same seed), computes the one-process result
itself, and compares its shard of it.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from distributed_harness import WorkerGroup
from tolerance import assert_fa_close, assert_grad_close

import fastattn
import fastattn.distributed as fd

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def groups(tmp_path_factory):
    """groups(world) -> a live WorkerGroup of that size (restarted after a killed one)."""
    made: dict[int, WorkerGroup] = {}
    tmp = tmp_path_factory.mktemp("rendezvous")

    def get(world: int) -> WorkerGroup:
        group = made.get(world)
        if group is None or not group.alive:
            made[world] = group = WorkerGroup(world, tmp)
        return group

    yield get
    for group in made.values():
        group.close()


def _close(name, got, want, atol=1e-10):
    err = float((got.detach() - want.detach()).abs().max()) if got.numel() else 0.0
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert err <= atol, f"{name}: max error {err:.3e} > {atol:.1e}"


def _full_problem(B, Hq, Hkv, L, D, Dv, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, L, D, generator=g, dtype=dtype)
    k = torch.randn(B, Hkv, L, D, generator=g, dtype=dtype)
    v = torch.randn(B, Hkv, L, Dv, generator=g, dtype=dtype)
    grad_out = torch.randn(B, Hq, L, Dv, generator=g, dtype=dtype)
    grad_lse = torch.randn(B, Hq, L, generator=g, dtype=torch.float64).to(
        torch.float64 if dtype == torch.float64 else torch.float32
    )
    return q, k, v, grad_out, grad_lse


def _one_process(q, k, v, grad_out, grad_lse, **kwargs):
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    torch.manual_seed(1234)  # the dropout seed (the sharded call draws it the same way)
    out, lse = fastattn.attention(q, k, v, return_lse=True, **kwargs)
    grads = torch.autograd.grad((out * grad_out).sum() + (lse * grad_lse).sum(), (q, k, v))
    return out.detach(), lse.detach(), grads


def _sharded(fn, q, k, v, grad_out, grad_lse, layout, **kwargs):
    def shard(x):
        return fd.shard_sequence(x, dim=2, layout=layout)

    ql, kl, vl = (shard(t).clone().requires_grad_(True) for t in (q, k, v))
    torch.manual_seed(1234)
    out, lse = fn(ql, kl, vl, layout=layout, return_lse=True, **kwargs)
    grads = torch.autograd.grad(
        (out * shard(grad_out)).sum() + (lse * shard(grad_lse)).sum(), (ql, kl, vl)
    )
    return out.detach(), lse.detach(), grads, shard


def _feature_cases(Hq):
    slopes = torch.linspace(0.2, 1.1, Hq)
    return [
        ("plain", 4, {}),
        ("causal", 4, dict(causal=True)),
        ("window", 4, dict(window=(4, 2))),
        ("causal+window", 4, dict(causal=True, window=(5, -1))),
        ("alibi", 4, dict(alibi_slopes=slopes)),
        ("causal+alibi", 2, dict(causal=True, alibi_slopes=slopes)),
        ("softcap", 4, dict(softcap=1.5, scale=0.7)),
        ("gqa+causal", 2, dict(causal=True)),
        (
            "mqa+all",
            1,
            dict(causal="bottom_right", window=(7, 0), alibi_slopes=slopes, softcap=2.0, scale=0.5),
        ),
        # The one-process call's dropout mask, numbered on global positions.
        ("dropout", 2, dict(dropout_p=0.3)),
        ("dropout+causal+alibi", 4, dict(dropout_p=0.2, causal=True, alibi_slopes=slopes)),
    ]


def _ring_cases(rank, world):
    B, Hq, D, Dv, c = 2, 4, 5, 7, 3
    for layout in ("zigzag", "contiguous"):
        L = 2 * world * c
        for name, Hkv, kwargs in _feature_cases(Hq):
            problem = _full_problem(B, Hq, Hkv, L, D, Dv, seed=len(name))
            out, lse, grads = _one_process(*problem, **kwargs)
            out_l, lse_l, grads_l, shard = _sharded(fd.ring_attention, *problem, layout, **kwargs)
            tag = f"{layout} {name}"
            _close(f"{tag} out", out_l, shard(out))
            _close(f"{tag} lse", lse_l, shard(lse))
            for gname, got, want in zip(("dq", "dk", "dv"), grads_l, grads):
                _close(f"{tag} {gname}", got, shard(want))


@pytest.mark.parametrize("world", [2, 4])
def test_ring_attention_matches_one_process(groups, world):
    groups(world).run(_ring_cases, timeout=240)


def _ring_float32(rank, world):
    B, Hq, Hkv, D, Dv, L = 1, 4, 2, 16, 16, 8 * world * 2
    kwargs = dict(causal=True, alibi_slopes=torch.linspace(0.1, 0.4, Hq))
    problem64 = _full_problem(B, Hq, Hkv, L, D, Dv, seed=3)
    problem32 = tuple(t.float() for t in problem64)
    ref64 = _one_process(*problem64, **kwargs)
    ref32 = _one_process(*problem32, **kwargs)
    out, lse, grads, shard = _sharded(fd.ring_attention, *problem32, "zigzag", **kwargs)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    assert_fa_close("out", out, shard(ref64[0]), shard(ref32[0]))
    assert_fa_close("lse", lse, shard(ref64[1]), shard(ref32[1]))
    for name, got, want64, want32 in zip(("dq", "dk", "dv"), grads, ref64[2], ref32[2]):
        assert_grad_close(name, got, shard(want64), shard(want32))


def test_ring_attention_float32_tolerance(groups):
    groups(2).run(_ring_float32)


def _ulysses_cases(rank, world):
    B, Hq, D, Dv = 2, 4, 6, 5
    L = 2 * world * 2
    g = torch.Generator().manual_seed(11)
    padding = torch.rand(B, L, generator=g) < 0.3
    padding[:, 0] = False
    bool_mask = torch.rand(Hq, L, L, generator=g) < 0.8
    bool_mask |= torch.eye(L, dtype=torch.bool)
    cases = [
        ("plain", Hq, {}),
        ("causal+gqa", Hq // 2 if (Hq // 2) % world == 0 else Hq, dict(causal=True)),
        (
            "window+alibi+softcap",
            Hq,
            dict(window=(3, 1), softcap=2.0, alibi_slopes=torch.linspace(0.3, 0.9, Hq)),
        ),
        ("key_padding_mask", Hq, dict(key_padding_mask=padding)),
        ("attn_mask per head", Hq, dict(attn_mask=bool_mask)),
    ]
    for layout in ("zigzag", "contiguous"):
        for name, Hkv, kwargs in cases:
            problem = _full_problem(B, Hq, Hkv, L, D, Dv, seed=len(name) + 50)
            out, lse, grads = _one_process(*problem, **kwargs)
            out_l, lse_l, grads_l, shard = _sharded(
                fd.ulysses_attention, *problem, layout, **kwargs
            )
            tag = f"ulysses {layout} {name}"
            _close(f"{tag} out", out_l, shard(out))
            _close(f"{tag} lse", lse_l, shard(lse))
            for gname, got, want in zip(("dq", "dk", "dv"), grads_l, grads):
                _close(f"{tag} {gname}", got, shard(want))


@pytest.mark.parametrize("world", [2, 4])
def test_ulysses_attention_matches_one_process(groups, world):
    groups(world).run(_ulysses_cases, timeout=120)


def _round_trips(rank, world):
    g = torch.Generator().manual_seed(5)
    for layout in ("zigzag", "contiguous"):
        n = 2 * world
        x = torch.randn(3, 2 * n, 5, generator=g, dtype=torch.float64)
        local = fd.shard_sequence(x, dim=1, layout=layout)
        assert local.shape == (3, 2 * n // world, 5)
        pos = fd.shard_positions(2 * n, layout=layout)
        assert pos.dtype == torch.int64
        assert torch.equal(local, x[:, pos]), f"{layout}: shard_positions != shard_sequence"
        assert torch.equal(fd.shard_sequence(torch.arange(2 * n), dim=0, layout=layout), pos)
        full = fd.gather_sequence(local, dim=-2, layout=layout)
        assert torch.equal(full, x), f"{layout}: gather(shard(x)) != x"
        # Differentiable: the gradient is the sum over ranks of each rank's gradient.
        leaf = local.clone().requires_grad_(True)
        weight = torch.randn(
            x.shape, generator=torch.Generator().manual_seed(rank + 100), dtype=torch.float64
        )
        (fd.gather_sequence(leaf, dim=1, layout=layout) * weight).sum().backward()
        total = weight.clone()
        dist.all_reduce(total)
        assert torch.allclose(leaf.grad, fd.shard_sequence(total, dim=1, layout=layout))
    if layout == "zigzag":
        expect = torch.cat(
            [
                torch.arange(rank * 2, rank * 2 + 2),
                torch.arange((2 * world - 1 - rank) * 2, (2 * world - rank) * 2),
            ]
        )
        assert torch.equal(fd.shard_positions(4 * world, layout="zigzag"), expect)


@pytest.mark.parametrize("world", [2, 4])
def test_sharding_round_trips(groups, world):
    groups(world).run(_round_trips)


def _mha_context_parallel(rank, world):
    E, H, L, N = 12, 4, 4 * world, 2
    for method in ("ring", "ulysses"):
        for layout in ("zigzag", "contiguous"):
            for batch_first in (True, False):
                torch.manual_seed(0)
                mha = fastattn.nn.MultiheadAttention(
                    E, H, batch_first=batch_first, dtype=torch.float64
                )
                x = torch.randn(N, L, E, dtype=torch.float64)
                if not batch_first:
                    x = x.transpose(0, 1).contiguous()
                seq_dim = 1 if batch_first else 0
                causal_mask = torch.nn.Transformer.generate_square_subsequent_mask(
                    L, dtype=torch.float64
                )
                ref, _ = mha(x, x, x, attn_mask=causal_mask, is_causal=True, need_weights=False)
                ref.sum().backward()
                ref_grads = {n: p.grad.clone() for n, p in mha.named_parameters()}
                mha.zero_grad()
                local = fd.shard_sequence(x, dim=seq_dim, layout=layout)
                with fd.context_parallel(method=method, layout=layout):
                    out, weights = mha(
                        local,
                        local,
                        local,
                        attn_mask=causal_mask,
                        is_causal=True,
                        need_weights=False,
                    )
                assert weights is None
                tag = f"{method} {layout} batch_first={batch_first}"
                _close(f"{tag} out", out, fd.shard_sequence(ref, dim=seq_dim, layout=layout))
                out.sum().backward()
                for n, p in mha.named_parameters():
                    grad = p.grad.clone()
                    dist.all_reduce(grad)  # per-rank partial sums, completed as DDP would
                    _close(f"{tag} grad {n}", grad, ref_grads[n])
    # Ulysses takes a full-sequence key_padding_mask; the ring refuses it clearly.
    torch.manual_seed(1)
    mha = fastattn.nn.MultiheadAttention(E, H, batch_first=True, dtype=torch.float64)
    x = torch.randn(N, L, E, dtype=torch.float64)
    padding = torch.zeros(N, L, dtype=torch.bool)
    padding[0, -3:] = True
    ref, _ = mha(x, x, x, key_padding_mask=padding, need_weights=False)
    local = fd.shard_sequence(x, dim=1)
    with fd.context_parallel(method="ulysses"):
        out, _ = mha(local, local, local, key_padding_mask=padding, need_weights=False)
    _close("ulysses key_padding_mask", out, fd.shard_sequence(ref, dim=1))
    with fd.context_parallel(method="ring"):
        with pytest.raises(ValueError, match="key_padding_mask is not supported by the ring"):
            mha(local, local, local, key_padding_mask=padding, need_weights=False)
        with pytest.raises(ValueError, match="need_weights=True is not supported"):
            mha(local, local, local)
        with pytest.raises(ValueError, match="attn_mask is only accepted as the causal mask"):
            mha(local, local, local, attn_mask=torch.zeros(L, L), need_weights=False)
    assert fd.current_context() is None
    # A swapped torch model: nn.TransformerEncoderLayer (its MultiheadAttention swapped) on
    # sequence shards, causal over the whole sequence, against the same layer on one process.
    torch.manual_seed(2)
    layer = torch.nn.TransformerEncoderLayer(
        E, H, dim_feedforward=24, dropout=0.0, batch_first=True, dtype=torch.float64
    )
    fastattn.swap_modules(layer)
    x = torch.randn(N, L, E, dtype=torch.float64)
    mask = torch.nn.Transformer.generate_square_subsequent_mask(L, dtype=torch.float64)
    ref = layer(x, src_mask=mask, is_causal=True)
    ref.square().sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    layer.zero_grad()
    local = fd.shard_sequence(x, dim=1)
    with fd.context_parallel(method="ring"):
        out = layer(local, src_mask=mask, is_causal=True)
    _close("swapped encoder layer out", out, fd.shard_sequence(ref, dim=1))
    out.square().sum().backward()
    for n, p in layer.named_parameters():
        grad = p.grad.clone()
        dist.all_reduce(grad)
        _close(f"swapped encoder layer grad {n}", grad, ref_grads[n])


@pytest.mark.parametrize("world", [2])
def test_context_parallel_multihead_attention(groups, world):
    groups(world).run(_mha_context_parallel, timeout=120)


def _bad_input(rank, world):
    q = torch.randn(1, 2, 2 * world * 2, 4)
    # Full length not divisible into 2W chunks (zigzag) or W chunks (contiguous).
    with pytest.raises(ValueError, match=rf"positive multiple of {2 * world}"):
        fd.shard_sequence(torch.randn(1, 2, 2 * world + 1, 4), dim=2)
    with pytest.raises(ValueError, match=rf"seq_len must be a positive multiple of {world}"):
        fd.shard_positions(world + 1, layout="contiguous")
    with pytest.raises(ValueError, match="layout must be 'zigzag' or 'contiguous'"):
        fd.shard_positions(8, layout="striped")
    # An odd local length cannot hold two zigzag chunks.
    odd = torch.randn(1, 2, 3, 4)
    with pytest.raises(ValueError, match="positive even number with layout 'zigzag'"):
        fd.ring_attention(odd, odd, odd)
    # Mismatched shard shapes across ranks: every rank raises, naming each rank's shape.
    mine = torch.randn(1, 2, 4 + 2 * rank, 4)
    with pytest.raises(ValueError, match=r"q's shape must be the same on every rank"):
        fd.ring_attention(mine, mine, mine)
    with pytest.raises(ValueError, match=r"q's shape must be the same on every rank"):
        fd.ulysses_attention(mine, mine, mine)
    with pytest.raises(ValueError, match=r"x_local's shape must be the same on every rank"):
        fd.gather_sequence(mine, dim=2)
    # Heads not divisible by the world size (Ulysses).
    heads = torch.randn(1, world + 1, 4, 4)
    with pytest.raises(ValueError, match=rf"divisible by the group's world size \({world}\)"):
        fd.ulysses_attention(heads, heads, heads)
    # Dropout on the ring runs the reference math: a fused backend cannot be asked for.
    with pytest.raises(ValueError, match="backend must be None or 'reference'"):
        fd.ring_attention(q, q, q, dropout_p=0.1, backend="cpu")
    with pytest.raises(ValueError, match=r"dropout_p must be a float in \[0, 1\)"):
        fd.ring_attention(q, q, q, dropout_p=1.0)
    with pytest.raises(ValueError, match="alibi_slopes must be"):
        fd.ring_attention(q, q, q, alibi_slopes=torch.ones(3))
    with (
        pytest.raises(ValueError, match="method must be 'ring' or 'ulysses'"),
        fd.context_parallel(method="allgather"),
    ):
        pass
    # The group still works after the errors: nobody is left waiting.
    out = fd.ring_attention(q, q, q, causal=True)
    assert out.shape == q.shape


@pytest.mark.parametrize("world", [2, 4])
def test_bad_input_raises_clear_errors_without_hanging(groups, world):
    groups(world).run(_bad_input, timeout=60)


def _overlap(rank, world):
    import sys

    ring_module = sys.modules["fastattn.distributed.ring_attention"]  # (the function shadows it)
    q = torch.randn(1, 2, 4, 8, requires_grad=True)
    ring_module.TRACE = []
    try:
        out = fd.ring_attention(q, q, q, causal=True)
        forward = list(ring_module.TRACE)
        ring_module.TRACE.clear()
        out.sum().backward()
        backward = list(ring_module.TRACE)
    finally:
        ring_module.TRACE = None
    for name, trace in (("forward", forward), ("backward", backward)):
        for step in range(world - 1):
            send, compute = trace.index(("send_kv", step)), trace.index(("compute", step))
            assert send < compute, f"{name} step {step}: K/V transfer posted after the block"
            assert trace.index(("compute", step + 1)) > send
        assert trace.count(("compute", world - 1)) == 1
        assert ("send_kv", world - 1) not in trace  # W-1 transfers: the last block stays
    assert [e for e in backward if e[0] == "send_dkv"] == [("send_dkv", s) for s in range(world)]
    # Causal: the chunk pairs whose keys all lie after their queries are skipped, not computed;
    # every other pair is computed once (zigzag: the same count, 2W + 1, on every rank).
    mine = [rank, 2 * world - 1 - rank]
    computed = sorted(e[1:] for e in forward if e[0] == "block")
    assert computed == sorted((qi, ki) for qi in mine for ki in range(2 * world) if ki <= qi)
    assert len(computed) == 2 * world + 1


@pytest.mark.parametrize("world", [2, 4])
def test_ring_posts_transfers_before_local_attention(groups, world):
    groups(world).run(_overlap)


class _TinyModel(torch.nn.Module):
    """fastattn modules built directly (LSTM) and swapped in (the encoder layer's attention)."""

    def __init__(self, vocab=17, d=16, heads=4):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        self.positions = fastattn.nn.SinusoidalPositionalEncoding(d)
        layer = torch.nn.TransformerEncoderLayer(
            d, heads, dim_feedforward=32, dropout=0.0, batch_first=True
        )
        self.encoder = fastattn.swap_modules(layer)
        self.lstm = fastattn.nn.LSTM(d, d, batch_first=True)
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, tokens):
        x = self.encoder(self.positions(self.embed(tokens)))
        x, _ = self.lstm(x)
        return self.head(x)


def _train(model, batches, targets, steps=3):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        logits = model(batches[step])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets[step].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model


def _data(world, steps=3, per_rank=2, length=6, vocab=17):
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, vocab, (steps, world * per_rank, length), generator=g)
    targets = torch.randint(0, vocab, (steps, world * per_rank, length), generator=g)
    return tokens, targets


def _ddp_fsdp(rank, world, wrapper):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel

    tokens, targets = _data(world)
    torch.manual_seed(0)
    reference = _TinyModel().double()
    torch.manual_seed(0)
    model = _TinyModel().double()
    _train(reference, tokens, targets)
    rows = slice(rank * tokens.shape[1] // world, (rank + 1) * tokens.shape[1] // world)
    if wrapper == "ddp":
        wrapped = DistributedDataParallel(model)
    else:
        for module in (model.encoder, model.lstm):
            fully_shard(module)
        wrapped = fully_shard(model)
    _train(wrapped, tokens[:, rows], targets[:, rows])
    for (name, p), (_, want) in zip(model.named_parameters(), reference.named_parameters()):
        got = p.full_tensor() if isinstance(p, DTensor) else p
        _close(f"{wrapper} {name}", got, want, atol=1e-10)


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp2"])
def test_fastattn_model_trains_like_one_process(groups, wrapper):
    groups(2).run(_ddp_fsdp, wrapper, timeout=120)
