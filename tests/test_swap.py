"""Tests of fastattn.swap_modules / restore_modules / swap_summary (fastattn/swap.py).

swap_modules changes, in place, the class of every torch.nn.MultiheadAttention, nn.LSTM and
nn.LSTMCell (exact classes) to fastattn's: the module objects, their Parameter objects and the
state_dict keys stay the same, so an optimiser built before the swap keeps training the swapped
model and checkpoints move both ways. The LSTM tests run once fastattn.nn.LSTM / LSTMCell exist
(fastattn.nn.LSTM derives from torch.nn.RNNBase, not from torch.nn.LSTM) and skip until then.
"""

from __future__ import annotations

import copy
import io
import logging

import pytest
import torch
from torch import nn

import fastattn
import fastattn.nn as fnn
from fastattn import restore_modules, swap_modules, swap_summary

pytestmark = [
    pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors"),
    pytest.mark.filterwarnings("ignore:enable_nested_tensor is True"),
    pytest.mark.usefixtures("one_thread"),
]

F64 = torch.float64
TOL = dict(rtol=1e-12, atol=1e-12)
HAS_LSTM = hasattr(fnn, "LSTM")
HAS_LSTM_CELL = hasattr(fnn, "LSTMCell")
needs_lstm = pytest.mark.skipif(not HAS_LSTM, reason="fastattn.nn.LSTM is not available")
needs_lstm_cell = pytest.mark.skipif(
    not HAS_LSTM_CELL,
    reason="fastattn.nn.LSTMCell is not available",
)


def randomize_(module: nn.Module, seed: int = 0) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=g, dtype=F64).to(p.dtype))
    return module


class Block(nn.Module):
    """Attention held in a ModuleList and a ModuleDict, next to a subclass of torch's
    MultiheadAttention, which swap_modules must leave alone (exact classes only)."""

    class Custom(nn.MultiheadAttention):
        pass

    def __init__(self, d=12, heads=3):
        super().__init__()
        self.attns = nn.ModuleList(
            [nn.MultiheadAttention(d, heads, batch_first=True, dtype=F64) for _ in range(2)]
        )
        self.cross = nn.ModuleDict(
            {"mem": nn.MultiheadAttention(d, heads, kdim=5, vdim=7, batch_first=True, dtype=F64)}
        )
        self.custom = Block.Custom(d, heads, batch_first=True, dtype=F64)
        self.proj = nn.Linear(d, d, dtype=F64)

    def forward(self, x, memory, mem_v):
        for attn in self.attns:
            x = x + attn(x, x, x, need_weights=False)[0]
        x = x + self.cross["mem"](x, memory, mem_v, need_weights=False)[0]
        x = x + self.custom(x, x, x, need_weights=False)[0]
        return self.proj(x)


class Nested(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(Block(), Block())
        self.encoder = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(12, 2, 20, dropout=0.0, batch_first=True, dtype=F64),
            num_layers=2,
            enable_nested_tensor=True,
        )

    def forward(self, x, memory, mem_v, pad):
        h = x
        for block in self.blocks:
            h = block(h, memory, mem_v)
        return self.encoder(h, src_key_padding_mask=pad)


SWAPPED_NAMES = [
    "blocks.0.attns.0",
    "blocks.0.attns.1",
    "blocks.0.cross.mem",
    "blocks.1.attns.0",
    "blocks.1.attns.1",
    "blocks.1.cross.mem",
    "encoder.layers.0.self_attn",
    "encoder.layers.1.self_attn",
]


def nested_model():
    torch.manual_seed(0)
    return randomize_(Nested())


def nested_inputs():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 6, 12, generator=g, dtype=F64)
    memory = torch.randn(2, 4, 5, generator=g, dtype=F64)
    mem_v = torch.randn(2, 4, 7, generator=g, dtype=F64)
    pad = torch.zeros(2, 6, dtype=torch.bool)
    pad[1, 4:] = True
    return x, memory, mem_v, pad


def forward_backward(model, inputs):
    model.zero_grad(set_to_none=True)
    out = model(*inputs)
    valid = ~inputs[-1]
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=F64)
    (torch.where(valid[..., None], out, 0) * g).sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_same_run(a, b, valid=None):
    out_a, grads_a = a
    out_b, grads_b = b
    if valid is not None:
        out_a, out_b = out_a[valid], out_b[valid]
    torch.testing.assert_close(out_a, out_b, **TOL)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], **TOL, msg=name)


# ---------------------------------------------------------------------------------------------
# Attention


def test_swap_nested_model_in_place():
    model = nested_model()
    reference = copy.deepcopy(model)
    inputs = nested_inputs()
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    keys = list(model.state_dict())
    result = swap_modules(model)
    assert result is model
    # Same module objects, now of fastattn's class; the subclass is left alone.
    for name in SWAPPED_NAMES:
        assert type(modules[name]) is fnn.MultiheadAttention, name
        assert dict(model.named_modules())[name] is modules[name]
    assert type(model.blocks[0].custom) is Block.Custom
    assert all(type(m) is not nn.MultiheadAttention for m in model.modules())
    # Same Parameter objects, same state_dict keys.
    assert all(p is params[n] for n, p in model.named_parameters())
    assert list(model.state_dict()) == keys
    # Same outputs and gradients as the untouched copy (training mode).
    assert_same_run(forward_backward(model, inputs), forward_backward(reference, inputs))
    assert [name for name, _, _ in swap_summary(model)] == SWAPPED_NAMES


def test_swap_summary_contents_and_log(caplog):
    model = nested_model()
    assert swap_summary(model) == []
    with caplog.at_level(logging.INFO, logger="fastattn"):
        swap_modules(model)
    summary = swap_summary(model)
    assert summary == [(name, "MultiheadAttention", "MultiheadAttention") for name in SWAPPED_NAMES]
    logged = "\n".join(r.getMessage() for r in caplog.records)
    for name in SWAPPED_NAMES:
        assert name in logged


def test_swap_model_that_is_an_attention_module():
    torch.manual_seed(0)
    model = randomize_(nn.MultiheadAttention(12, 4, dtype=F64))
    reference = copy.deepcopy(model)
    params = list(model.parameters())
    assert swap_modules(model) is model
    assert type(model) is fnn.MultiheadAttention
    assert all(a is b for a, b in zip(model.parameters(), params))
    assert swap_summary(model) == [("<model>", "MultiheadAttention", "MultiheadAttention")]
    x = torch.randn(5, 2, 12, dtype=F64)
    fastattn._backend.record_backend("attention", "none")
    out, w = model(x, x, x)
    assert fastattn.last_backend("attention") == "cpu"
    out_r, w_r = reference(x, x, x)
    torch.testing.assert_close(out, out_r, **TOL)
    torch.testing.assert_close(w, w_r, **TOL)
    restore_modules(model)
    assert type(model) is nn.MultiheadAttention and swap_summary(model) == []


def test_attention_false_swaps_nothing():
    model = nested_model()
    before = [type(m) for m in model.modules()]
    assert swap_modules(model, attention=False, lstm=False) is model
    assert [type(m) for m in model.modules()] == before
    assert swap_summary(model) == []
    assert model.encoder.use_nested_tensor  # left as torch set it


def test_optimizer_built_before_swap_trains_swapped_model():
    """An Adam built on the torch model's parameters keeps training the swapped model: after
    three steps its parameters equal those of an unswapped copy trained the same way."""
    model = nested_model()
    reference = copy.deepcopy(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    opt_ref = torch.optim.Adam(reference.parameters(), lr=1e-2)
    inputs = nested_inputs()
    swap_modules(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for _ in range(3):
        for m, o in ((model, opt), (reference, opt_ref)):
            o.zero_grad()
            out = m(*inputs)
            torch.where(inputs[-1][..., None], 0, out).square().mean().backward()
            o.step()
    for (name, p), (_, p_ref) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p, p_ref, rtol=1e-10, atol=1e-10, msg=name)
    attn_w = model.blocks[0].attns[0].in_proj_weight
    assert not torch.equal(attn_w, before["blocks.0.attns.0.in_proj_weight"])  # it did train


def test_state_dict_round_trips():
    model = nested_model()
    swapped = swap_modules(copy.deepcopy(model))
    assert list(swapped.state_dict()) == list(model.state_dict())
    inputs = nested_inputs()
    valid = ~inputs[-1]
    # swapped -> file -> fresh torch model, and torch -> fresh swapped model
    buffer = io.BytesIO()
    torch.save(swapped.state_dict(), buffer)
    buffer.seek(0)
    torch.manual_seed(5)
    fresh_torch = Nested()
    fresh_fast = swap_modules(Nested())
    fresh_torch.load_state_dict(torch.load(buffer), strict=True)
    fresh_fast.load_state_dict(model.state_dict(), strict=True)
    expected = forward_backward(model, inputs)
    assert_same_run(forward_backward(fresh_torch, inputs), expected, valid)
    assert_same_run(forward_backward(fresh_fast, inputs), expected, valid)


def test_swapping_twice_is_harmless():
    model = nested_model()
    reference = copy.deepcopy(model)
    swap_modules(model)
    summary = swap_summary(model)
    hooks = [len(m._forward_pre_hooks) for m in model.modules()]
    swap_modules(model)
    swap_modules(model, backend=None)
    assert swap_summary(model) == summary
    assert [len(m._forward_pre_hooks) for m in model.modules()] == hooks
    inputs = nested_inputs()
    assert_same_run(forward_backward(model, inputs), forward_backward(reference, inputs))
    restore_modules(model)  # one restore undoes it all
    assert sum(type(m) is nn.MultiheadAttention for m in model.modules()) == len(SWAPPED_NAMES)
    assert swap_summary(model) == []


def test_restore_brings_back_torch_classes():
    model = nested_model()
    inputs = nested_inputs()
    expected = forward_backward(copy.deepcopy(model), inputs)
    params = list(model.parameters())
    hooks = [len(m._forward_pre_hooks) for m in model.modules()]
    swap_modules(model, backend="reference")
    assert not model.encoder.use_nested_tensor  # the packed eval path is off while swapped
    assert restore_modules(model) is model
    assert sum(type(m) is nn.MultiheadAttention for m in model.modules()) == len(SWAPPED_NAMES)
    assert all(a is b for a, b in zip(model.parameters(), params))
    assert [len(m._forward_pre_hooks) for m in model.modules()] == hooks  # hooks removed
    assert not any(
        hasattr(m, "fastattn_backend") or hasattr(m, "_fastattn_original_class")
        for m in model.modules()
    )
    assert model.encoder.use_nested_tensor  # torch's setting is back
    assert_same_run(forward_backward(model, inputs), expected)
    restore_modules(model)  # restoring an unswapped model is a no-op
    assert swap_summary(model) == []


def test_restored_encoder_uses_torch_fast_path_again(monkeypatch):
    calls = []
    real = torch._transformer_encoder_layer_fwd
    monkeypatch.setattr(
        torch, "_transformer_encoder_layer_fwd", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    model = nested_model().encoder.eval()
    x = torch.randn(2, 6, 12, dtype=F64)
    with torch.no_grad():
        swap_modules(model)
        model(x)
        assert calls == []
        restore_modules(model)
        model(x)
        assert len(calls) == 2  # both layers


@pytest.mark.parametrize("backend", ("reference", "cpu"))
def test_backend_argument(backend):
    model = nested_model()
    reference = copy.deepcopy(model)
    swap_modules(model, backend=backend)
    assert all(
        m.fastattn_backend == backend
        for m in model.modules()
        if isinstance(m, fnn.MultiheadAttention)
    )
    inputs = nested_inputs()
    fastattn._backend.record_backend("attention", "none")
    got = forward_backward(model, inputs)
    assert fastattn.last_backend("attention") == backend
    assert_same_run(got, forward_backward(reference, inputs), ~inputs[-1])
    # The module's backend wins over a surrounding use_backend.
    with fastattn.use_backend("cpu" if backend == "reference" else "reference"):
        model(*inputs)
    assert fastattn.last_backend("attention") == backend


def test_backend_that_cannot_run_raises_at_call():
    model = swap_modules(nested_model(), backend="cuda")
    with pytest.raises(fastattn.BackendError):
        model(*nested_inputs())


def test_swapped_eval_matches_torch_fast_path():
    """Eval under no_grad: the torch model packs the padded batch and runs its fused encoder;
    the swapped one runs fastattn on dense tensors; valid positions agree."""
    model = nested_model().eval()
    swapped = swap_modules(copy.deepcopy(model))
    inputs = nested_inputs()
    with torch.no_grad():
        out = model(*inputs)
        fastattn._backend.record_backend("attention", "none")
        got = swapped(*inputs)
    assert fastattn.last_backend("attention") == "cpu"
    valid = ~inputs[-1]
    torch.testing.assert_close(got[valid], out[valid], rtol=1e-10, atol=1e-10)


# ---------------------------------------------------------------------------------------------
# LSTM (when fastattn.nn.LSTM / LSTMCell exist)


class Recurrent(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(6, 8, num_layers=2, bidirectional=True, batch_first=True, dtype=F64)
        self.cell = nn.LSTMCell(16, 8, dtype=F64)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True, dtype=F64)

    def forward(self, x):
        out, _ = self.lstm(x)
        h = c = torch.zeros(x.shape[0], 8, dtype=x.dtype)
        states = []
        for t in range(out.shape[1]):
            h, c = self.cell(out[:, t], (h, c))
            states.append(h)
        states = torch.stack(states, 1)
        return self.attn(states, states, states, need_weights=False)[0]


def recurrent_model():
    torch.manual_seed(0)
    return randomize_(Recurrent())


@pytest.mark.skipif(HAS_LSTM, reason="only while fastattn.nn.LSTM is missing")
def test_lstm_without_replacement_raises_and_lstm_false_works():
    model = recurrent_model()
    with pytest.raises(RuntimeError, match="LSTM"):
        swap_modules(copy.deepcopy(model))
    swapped = swap_modules(model, lstm=False)
    assert type(swapped.lstm) is nn.LSTM and type(swapped.cell) is nn.LSTMCell
    assert type(swapped.attn) is fnn.MultiheadAttention


@needs_lstm
def test_lstm_class_family():
    assert issubclass(fnn.LSTM, nn.RNNBase)
    assert not issubclass(fnn.LSTM, nn.LSTM)  # Dynamo refuses nn.LSTM subclasses


@needs_lstm_cell
def test_lstm_cell_class_family():
    assert issubclass(fnn.LSTMCell, nn.LSTMCell)


@needs_lstm
@needs_lstm_cell
def test_swap_lstm_parameters_outputs_and_restore():
    model = recurrent_model()
    reference = copy.deepcopy(model)
    params = dict(model.named_parameters())
    keys = list(model.state_dict())
    x = torch.randn(3, 5, 6, dtype=F64, generator=torch.Generator().manual_seed(2))
    swap_modules(model)
    assert type(model.lstm) is fnn.LSTM and type(model.cell) is fnn.LSTMCell
    assert isinstance(model.lstm, nn.RNNBase) and model.lstm.mode == "LSTM"
    assert all(p is params[n] for n, p in model.named_parameters())
    assert list(model.state_dict()) == keys
    assert {name for name, _, _ in swap_summary(model)} == {"lstm", "cell", "attn"}
    for m in (model, reference):
        m.zero_grad()
        out = m(x)
        out.square().sum().backward()
        m.result = out.detach()
    torch.testing.assert_close(model.result, reference.result, **TOL)
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, **TOL, msg=name)
    restore_modules(model)
    assert type(model.lstm) is nn.LSTM and type(model.cell) is nn.LSTMCell


@needs_lstm
@needs_lstm_cell
def test_lstm_false_keeps_lstm_and_attention_false_keeps_attention():
    model = swap_modules(recurrent_model(), lstm=False)
    assert type(model.lstm) is nn.LSTM and type(model.cell) is nn.LSTMCell
    assert type(model.attn) is fnn.MultiheadAttention
    model = swap_modules(recurrent_model(), attention=False)
    assert type(model.lstm) is fnn.LSTM and type(model.cell) is fnn.LSTMCell
    assert type(model.attn) is nn.MultiheadAttention


@needs_lstm
@needs_lstm_cell
def test_optimizer_and_state_dict_with_lstm():
    model = recurrent_model()
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_ref = torch.optim.SGD(reference.parameters(), lr=0.1)
    swap_modules(model)
    x = torch.randn(3, 5, 6, dtype=F64, generator=torch.Generator().manual_seed(2))
    for m, o in ((model, opt), (reference, opt_ref)):
        for _ in range(2):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-10, msg=name)
    fresh = recurrent_model()
    fresh.load_state_dict(model.state_dict(), strict=True)
    torch.testing.assert_close(fresh(x), model(x), **TOL)
