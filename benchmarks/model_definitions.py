"""The whole models of the model tests (tests/test_models.py) and the model benchmarks
(benchmarks/bench_models.py): one definition of each, as users write them with torch.nn, and
their fastattn versions (`to_fastattn`). The tests build them small, the benchmarks larger.

- "transformer": a post-norm nn.Transformer encoder-decoder with sinusoidal positions, padded
  source and target batches and a causal target mask (fastattn version: swap_modules);
- "gpt": a GPT-style pre-norm decoder (nn.TransformerEncoder with a causal mask), learned
  positions, right-padded batches (swap_modules);
- "tagger": a 2-layer bidirectional LSTM tagger fed PackedSequences (swap_modules);
- "seq2seq": an LSTM encoder-decoder with additive (Bahdanau) attention, the torch version
  computing it the straightforward way (fastattn version: swap_modules plus
  fastattn.nn.AdditiveAttention on the same Parameters); "seq2seq-attention-only" swaps only
  the attention.

Masks: the causal masks are bool (True = masked), like the key padding masks, so torch's
"mismatched key_padding_mask and attn_mask" deprecation warning has no cause.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import fastattn
import fastattn.nn as fnn

PAD = 0


def sinusoid_table(length: int, d: int) -> torch.Tensor:
    """(length, d) float32 sinusoidal positions, computed in float64."""
    position = torch.arange(length, dtype=torch.float64).unsqueeze(1)
    div = torch.exp(torch.arange(0, d, 2, dtype=torch.float64) * (-math.log(10000.0) / d))
    pe = torch.zeros(length, d, dtype=torch.float64)
    pe[:, 0::2] = torch.sin(position * div)
    pe[:, 1::2] = torch.cos(position * div)
    return pe.float()


def causal_mask(length: int, device: torch.device) -> torch.Tensor:
    """(length, length) bool, True above the diagonal (the future keys a query may not see)."""
    return torch.ones(length, length, dtype=torch.bool, device=device).triu(1)


class TransformerSeq2Seq(nn.Module):
    def __init__(
        self,
        vocab: int,
        d: int,
        heads: int,
        layers: int,
        ff: int,
        dropout: float = 0.0,
        max_len: int = 1024,
    ):
        super().__init__()
        self.d = d
        self.src_emb = nn.Embedding(vocab, d, padding_idx=PAD)
        self.tgt_emb = nn.Embedding(vocab, d, padding_idx=PAD)
        self.register_buffer("pe", sinusoid_table(max_len, d), persistent=False)
        self.transformer = nn.Transformer(
            d, heads, layers, layers, ff, dropout, batch_first=True, norm_first=False
        )
        self.out = nn.Linear(d, vocab)

    def forward(self, src, tgt_in):
        src_pad, tgt_pad = src == PAD, tgt_in == PAD
        pe = self.pe.to(self.out.weight.dtype)
        x = self.src_emb(src) * math.sqrt(self.d) + pe[: src.shape[1]]
        y = self.tgt_emb(tgt_in) * math.sqrt(self.d) + pe[: tgt_in.shape[1]]
        h = self.transformer(
            x,
            y,
            tgt_mask=causal_mask(tgt_in.shape[1], x.device),
            src_key_padding_mask=src_pad,
            tgt_key_padding_mask=tgt_pad,
            memory_key_padding_mask=src_pad,
            tgt_is_causal=True,
        )
        return self.out(h)


class GPTDecoder(nn.Module):
    def __init__(
        self,
        vocab: int,
        d: int,
        heads: int,
        layers: int,
        ff: int,
        dropout: float = 0.0,
        max_len: int = 2048,
    ):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(max_len, d)
        layer = nn.TransformerEncoderLayer(
            d, heads, ff, dropout, activation="gelu", batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, tokens):
        L = tokens.shape[1]
        x = self.tok(tokens) + self.pos(torch.arange(L, device=tokens.device))
        h = self.blocks(
            x, mask=causal_mask(L, x.device), src_key_padding_mask=tokens == PAD, is_causal=True
        )
        return self.head(self.norm(h))


class LSTMTagger(nn.Module):
    def __init__(self, vocab: int, d: int, hidden: int, tags: int, dropout: float = 0.0):
        super().__init__()
        self.emb = nn.Embedding(vocab, d, padding_idx=PAD)
        self.lstm = nn.LSTM(
            d, hidden, num_layers=2, bidirectional=True, batch_first=True, dropout=dropout
        )
        self.out = nn.Linear(2 * hidden, tags)

    def forward(self, tokens):
        lengths = (tokens != PAD).sum(1)
        packed = pack_padded_sequence(
            self.emb(tokens), lengths.cpu(), batch_first=True, enforce_sorted=False
        )
        out, _ = self.lstm(packed)
        out, _ = pad_packed_sequence(out, batch_first=True, total_length=tokens.shape[1])
        return self.out(out)


class StraightforwardAdditive(nn.Module):
    """Bahdanau attention as tutorials write it (the full (B, Lk, A) tanh per step), with
    fastattn.nn.AdditiveAttention's parameter names."""

    def __init__(self, query_dim: int, key_dim: int, attn_dim: int):
        super().__init__()
        self.query_proj = nn.Linear(query_dim, attn_dim, bias=False)
        self.key_proj = nn.Linear(key_dim, attn_dim)
        self.v = nn.Parameter(torch.empty(attn_dim).uniform_(-(attn_dim**-0.5), attn_dim**-0.5))

    def forward(self, query, keys, values=None, key_padding_mask=None, need_weights=False):
        values = keys if values is None else values
        e = torch.tanh(self.query_proj(query).unsqueeze(1) + self.key_proj(keys)) @ self.v
        e = e.masked_fill(key_padding_mask, float("-inf"))
        w = torch.softmax(e, dim=-1)
        ctx = torch.bmm(w.unsqueeze(1), values).squeeze(1)
        return (ctx, w) if need_weights else ctx


class LSTMSeq2Seq(nn.Module):
    def __init__(self, vocab: int, d: int, hidden: int, attn: int):
        super().__init__()
        self.hidden = hidden
        self.src_emb = nn.Embedding(vocab, d, padding_idx=PAD)
        self.tgt_emb = nn.Embedding(vocab, d, padding_idx=PAD)
        self.encoder = nn.LSTM(d, hidden, batch_first=True)
        self.decoder = nn.LSTMCell(d + hidden, hidden)
        self.attn = StraightforwardAdditive(hidden, hidden, attn)
        self.out = nn.Linear(2 * hidden, vocab)

    def forward(self, src, tgt_in):
        src_pad = src == PAD
        lengths = (~src_pad).sum(1)
        packed = pack_padded_sequence(
            self.src_emb(src), lengths.cpu(), batch_first=True, enforce_sorted=False
        )
        enc, (h, c) = self.encoder(packed)
        enc, _ = pad_packed_sequence(enc, batch_first=True, total_length=src.shape[1])
        h, c = h[0], c[0]
        ctx = torch.zeros_like(h)
        logits = []
        for t in range(tgt_in.shape[1]):  # teacher forcing, input feeding
            h, c = self.decoder(torch.cat([self.tgt_emb(tgt_in[:, t]), ctx], -1), (h, c))
            ctx = self.attn(h, enc, key_padding_mask=src_pad)
            logits.append(self.out(torch.cat([h, ctx], -1)))
        return torch.stack(logits, 1)


NEEDS_LSTM = {"tagger", "seq2seq"}


def has_lstm() -> bool:
    return hasattr(fnn, "LSTM") and hasattr(fnn, "LSTMCell")


def to_fastattn(name: str, model: nn.Module) -> nn.Module:
    """The fastattn version of a model, in place (the same Parameter objects)."""
    if name == "seq2seq-attention-only":
        fastattn.swap_modules(model, lstm=False)
    else:
        fastattn.swap_modules(model)
    if name.startswith("seq2seq"):
        old = model.attn
        new = fnn.AdditiveAttention(
            old.query_proj.in_features, old.key_proj.in_features, old.v.shape[0]
        ).to(old.v)
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
