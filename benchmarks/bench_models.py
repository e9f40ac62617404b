"""Whole models: one forward + backward training step (loss, then gradients of every
parameter) of torch models and of their fastattn versions (fastattn.swap_modules, same
Parameters), providers "torch" and "fastattn".

Models (as in tests/test_models.py, larger):
- "transformer": post-norm nn.Transformer encoder-decoder with sinusoidal positions, padded
  batches, a causal target mask;
- "gpt": a GPT-style pre-norm decoder (nn.TransformerEncoder with a causal mask), padding;
- "tagger": a 2-layer bidirectional LSTM tagger fed PackedSequences, and
- "seq2seq": an LSTM encoder-decoder with additive attention (fastattn version: swapped LSTMs
  plus fastattn.nn.AdditiveAttention), both only when fastattn.nn.LSTM / LSTMCell exist.
Plus an inference case: the "transformer" forward in eval mode under no_grad, where torch runs
its fused encoder fast path (and packs padded batches into NestedTensors).

Before timing, the fastattn model's loss and gradients are checked against torch's (relative
error of the worst tensor).
"""
from __future__ import annotations

import contextlib
import copy
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import fastattn
import fastattn.nn as fnn
from common import Case, relative_error

PAD = 0


def sinusoid_table(length: int, d: int) -> torch.Tensor:
    position = torch.arange(length, dtype=torch.float32).unsqueeze(1)
    div = torch.exp(torch.arange(0, d, 2, dtype=torch.float32) * (-math.log(10000.0) / d))
    pe = torch.zeros(length, d)
    pe[:, 0::2] = torch.sin(position * div)
    pe[:, 1::2] = torch.cos(position * div)
    return pe


class TransformerSeq2Seq(nn.Module):
    def __init__(self, vocab, d, heads, layers, ff, max_len=1024):
        super().__init__()
        self.d = d
        self.src_emb = nn.Embedding(vocab, d, padding_idx=PAD)
        self.tgt_emb = nn.Embedding(vocab, d, padding_idx=PAD)
        self.register_buffer("pe", sinusoid_table(max_len, d), persistent=False)
        self.transformer = nn.Transformer(d, heads, layers, layers, ff, dropout=0.1,
                                          batch_first=True, norm_first=False)
        self.out = nn.Linear(d, vocab)

    def forward(self, src, tgt_in):
        src_pad, tgt_pad = src == PAD, tgt_in == PAD
        pe = self.pe.to(self.out.weight.dtype)
        x = self.src_emb(src) * math.sqrt(self.d) + pe[: src.shape[1]]
        y = self.tgt_emb(tgt_in) * math.sqrt(self.d) + pe[: tgt_in.shape[1]]
        causal = nn.Transformer.generate_square_subsequent_mask(tgt_in.shape[1], dtype=x.dtype,
                                                                device=x.device)
        h = self.transformer(x, y, tgt_mask=causal, src_key_padding_mask=src_pad,
                             tgt_key_padding_mask=tgt_pad, memory_key_padding_mask=src_pad,
                             tgt_is_causal=True)
        return self.out(h)


class GPTDecoder(nn.Module):
    def __init__(self, vocab, d, heads, layers, ff, max_len=2048):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(max_len, d)
        layer = nn.TransformerEncoderLayer(d, heads, ff, dropout=0.1, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, tokens):
        L = tokens.shape[1]
        x = self.tok(tokens) + self.pos(torch.arange(L, device=tokens.device))
        causal = nn.Transformer.generate_square_subsequent_mask(L, dtype=x.dtype,
                                                                device=x.device)
        h = self.blocks(x, mask=causal, src_key_padding_mask=tokens == PAD, is_causal=True)
        return self.head(self.norm(h))


class LSTMTagger(nn.Module):
    def __init__(self, vocab, d, hidden, tags=17):
        super().__init__()
        self.emb = nn.Embedding(vocab, d, padding_idx=PAD)
        self.lstm = nn.LSTM(d, hidden, num_layers=2, bidirectional=True, batch_first=True)
        self.out = nn.Linear(2 * hidden, tags)

    def forward(self, tokens):
        lengths = (tokens != PAD).sum(1)
        packed = pack_padded_sequence(self.emb(tokens), lengths.cpu(), batch_first=True,
                                      enforce_sorted=False)
        out, _ = self.lstm(packed)
        out, _ = pad_packed_sequence(out, batch_first=True, total_length=tokens.shape[1])
        return self.out(out)


class StraightforwardAdditive(nn.Module):
    def __init__(self, query_dim, key_dim, attn_dim):
        super().__init__()
        self.query_proj = nn.Linear(query_dim, attn_dim, bias=False)
        self.key_proj = nn.Linear(key_dim, attn_dim)
        self.v = nn.Parameter(torch.empty(attn_dim).uniform_(-attn_dim ** -0.5,
                                                             attn_dim ** -0.5))

    def forward(self, query, keys, values=None, key_padding_mask=None):
        e = torch.tanh(self.query_proj(query).unsqueeze(1) + self.key_proj(keys)) @ self.v
        w = torch.softmax(e.masked_fill(key_padding_mask, float("-inf")), dim=-1)
        return torch.bmm(w.unsqueeze(1), keys).squeeze(1)


class LSTMSeq2Seq(nn.Module):
    def __init__(self, vocab, d, hidden, attn):
        super().__init__()
        self.src_emb = nn.Embedding(vocab, d, padding_idx=PAD)
        self.tgt_emb = nn.Embedding(vocab, d, padding_idx=PAD)
        self.encoder = nn.LSTM(d, hidden, batch_first=True)
        self.decoder = nn.LSTMCell(d + hidden, hidden)
        self.attn = StraightforwardAdditive(hidden, hidden, attn)
        self.out = nn.Linear(2 * hidden, vocab)

    def forward(self, src, tgt_in):
        src_pad = src == PAD
        packed = pack_padded_sequence(self.src_emb(src), (~src_pad).sum(1).cpu(),
                                      batch_first=True, enforce_sorted=False)
        enc, (h, c) = self.encoder(packed)
        enc, _ = pad_packed_sequence(enc, batch_first=True, total_length=src.shape[1])
        h, c = h[0], c[0]
        ctx = torch.zeros_like(h)
        logits = []
        for t in range(tgt_in.shape[1]):
            h, c = self.decoder(torch.cat([self.tgt_emb(tgt_in[:, t]), ctx], -1), (h, c))
            ctx = self.attn(h, enc, key_padding_mask=src_pad)
            logits.append(self.out(torch.cat([h, ctx], -1)))
        return torch.stack(logits, 1)


def to_fastattn(name: str, model: nn.Module) -> nn.Module:
    fastattn.swap_modules(model)
    if name == "seq2seq":
        old = model.attn
        new = fnn.AdditiveAttention(old.query_proj.in_features, old.key_proj.in_features,
                                    old.v.shape[0]).to(old.v)
        new.query_proj, new.key_proj, new.v = old.query_proj, old.key_proj, old.v
        model.attn = new
    return model


@contextlib.contextmanager
def no_dropout(model: nn.Module):
    """Dropout probabilities of nn.Dropout and nn.MultiheadAttention set to 0 inside."""
    saved = []
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            saved.append((m, "p", m.p))
            m.p = 0.0
        elif isinstance(m, nn.MultiheadAttention):
            saved.append((m, "dropout", m.dropout))
            m.dropout = 0.0
    try:
        yield
    finally:
        for m, attr, value in saved:
            setattr(m, attr, value)


def has_lstm() -> bool:
    return hasattr(fnn, "LSTM") and hasattr(fnn, "LSTMCell")


def make_batch(name, B, L, vocab, device, g):
    def tokens(length):
        t = torch.randint(1, vocab, (B, length), generator=g)
        lengths = torch.randint(max(1, length // 2), length + 1, (B,), generator=g)
        lengths[0] = length
        return t.masked_fill(torch.arange(length)[None] >= lengths[:, None], PAD).to(device)

    if name in ("transformer", "seq2seq"):
        src, tgt = tokens(L), tokens(L)
        tgt_in = torch.cat([torch.ones(B, 1, dtype=torch.long, device=device), tgt[:, :-1]], 1)
        return (src, tgt_in.masked_fill(tgt == PAD, PAD)), tgt
    t = tokens(L)
    if name == "gpt":
        return (t,), torch.cat([t[:, 1:], torch.full((B, 1), PAD, device=device)], 1)
    tags = torch.randint(0, 17, t.shape, generator=g).to(device).masked_fill(t == PAD, -100)
    return (t,), tags


def model_case(name, size, B, L, dtype, device, *, train=True) -> Case:
    vocab = size["vocab"]
    torch.manual_seed(0)
    if name == "transformer":
        model = TransformerSeq2Seq(vocab, size["d"], size["heads"], size["layers"], size["ff"])
    elif name == "gpt":
        model = GPTDecoder(vocab, size["d"], size["heads"], size["layers"], size["ff"])
    elif name == "tagger":
        model = LSTMTagger(vocab, size["d"], size["hidden"])
    else:
        model = LSTMSeq2Seq(vocab, size["d"], size["hidden"], size["attn"])
    original = model.to(device=device, dtype=dtype)
    fast = to_fastattn(name, copy.deepcopy(original))
    g = torch.Generator().manual_seed(1)
    inputs, target = make_batch(name, B, L, vocab, device, g)
    ignore = -100 if name == "tagger" else PAD

    def loss_of(m):
        logits = m(*inputs)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                               target.reshape(-1), ignore_index=ignore)

    def step(m):
        def run():
            m.zero_grad(set_to_none=True)
            loss_of(m).backward()
        return run

    def checked(m):  # loss and every gradient with dropout off (the masks differ)
        def run():
            with no_dropout(m):
                m.zero_grad(set_to_none=True)
                loss = loss_of(m)
                loss.backward()
            return (loss.detach(), *[p.grad.detach().clone() for p in m.parameters()
                                     if p.grad is not None])
        return run

    def infer(m):
        def run():
            with torch.no_grad():
                return m(*inputs)
        return run

    if train:
        original.train(), fast.train()
        providers = {"torch": step(original), "fastattn": step(fast)}
        check_providers = {"torch": checked(original), "fastattn": checked(fast)}
    else:
        original.eval(), fast.eval()
        providers = {"torch": infer(original), "fastattn": infer(fast)}
        valid = (inputs[-1] != PAD)[..., None]
        check_providers = {k: (lambda f=f: f().masked_fill(~valid, 0.0))
                           for k, f in providers.items()}
    dims = ", ".join(f"{k}={v}" for k, v in size.items() if k != "vocab")
    return Case(op=f"model {name}" + (" train step" if train else " eval fwd"),
                name=f"B={B} L={L} {dims}", providers=providers, reference="torch",
                baselines=("torch",), check=relative_error, check_providers=check_providers,
                tolerance=1e-3 if dtype == torch.float32 else 5e-2, dtype=str(dtype)[6:])


def cases(profile: str, device: torch.device) -> list[Case]:
    f32 = torch.float32
    if device.type == "cuda":
        dtype = torch.bfloat16
        tr = dict(vocab=32000, d=512, heads=8, layers=6, ff=2048)
        gpt = dict(vocab=32000, d=768, heads=12, layers=12, ff=3072)
        out = [model_case("transformer", tr, 32, 256, dtype, device),
               model_case("gpt", gpt, 16, 1024, dtype, device),
               model_case("transformer", tr, 32, 256, dtype, device, train=False)]
        if profile == "full":
            out += [model_case("transformer", tr, 32, 256, f32, device),
                    model_case("gpt", gpt, 8, 2048, dtype, device)]
        lstm = [("tagger", dict(vocab=32000, d=256, hidden=512), 64, 100),
                ("seq2seq", dict(vocab=32000, d=256, hidden=512, attn=256), 64, 50)]
    elif profile == "quick":
        tr = dict(vocab=1000, d=128, heads=4, layers=2, ff=512)
        gpt = dict(vocab=1000, d=128, heads=4, layers=2, ff=512)
        out = [model_case("transformer", tr, 16, 64, f32, device),
               model_case("gpt", gpt, 8, 256, f32, device),
               model_case("transformer", tr, 16, 64, f32, device, train=False)]
        lstm = [("tagger", dict(vocab=1000, d=64, hidden=128), 16, 40),
                ("seq2seq", dict(vocab=1000, d=64, hidden=128, attn=64), 16, 20)]
    else:
        tr = dict(vocab=8000, d=256, heads=4, layers=3, ff=1024)
        gpt = dict(vocab=8000, d=256, heads=4, layers=4, ff=1024)
        out = [model_case("transformer", tr, 32, 128, f32, device),
               model_case("gpt", gpt, 16, 512, f32, device),
               model_case("transformer", tr, 32, 128, f32, device, train=False)]
        lstm = [("tagger", dict(vocab=8000, d=128, hidden=256), 32, 100),
                ("seq2seq", dict(vocab=8000, d=128, hidden=256, attn=128), 32, 40)]
    if has_lstm():
        dtype = torch.bfloat16 if device.type == "cuda" else f32
        out += [model_case(name, size, B, L, dtype, device) for name, size, B, L in lstm]
    else:
        print("bench_models: the LSTM models are skipped (fastattn.nn.LSTM / LSTMCell do not "
              "exist yet)")
    return out


def summary(rows: list[dict]) -> list[str]:
    return [f"{r['op']} {r['case']}: fastattn {r['speedup']:.2f}x torch "
            f"({r['median_ms']:.1f} ms per call)"
            for r in rows if r.get("provider") == "fastattn" and "speedup" in r]
