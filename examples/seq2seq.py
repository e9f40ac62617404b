"""An attentional encoder-decoder (Bahdanau et al. 2015, Luong et al. 2015) on fastattn's
recurrent family, trained with teacher forcing and decoded greedily and with beam search.

Task: reverse a string of digits (lengths 5 to 30 by default), a translation that a decoder
can only learn by attending to the right source position at every step.

Model: embeddings; a bidirectional GRU encoder over PackedSequences (padded batches); a
GRUCell decoder fed its previous attentional state (input feeding); Luong "general"
attention over the encoder states; the attentional state tanh(W_c [context; h]) and a linear
output layer. `--torch` builds the same model, with the same initial weights, from torch's
modules (nn.GRU, nn.GRUCell and a plain-torch Luong attention): the learning curves agree
and the step times compare the two.

    python examples/seq2seq.py                 # train (a few minutes), curve, accuracies
    python examples/seq2seq.py --torch         # the same with torch's modules
    python examples/seq2seq.py --check         # short schedule; exit 1 unless held-out
                                               # exact match >= 98% with beam search and
                                               # beam search >= greedy
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

try:
    import fastattn.nn as fnn
except ImportError:  # run from a source checkout that is not installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import fastattn.nn as fnn

PAD, BOS, EOS = 0, 1, 2
DIGITS = 10
VOCAB = 3 + DIGITS


# ---------------------------------------------------------------------------------------------
# Data


def make_batch(batch: int, min_len: int, max_len: int, generator: torch.Generator):
    """Random digit strings and their reversals.
    Returns src (B, S) padded with PAD, src_lengths (B,), tgt_in (B, T) = BOS + reversed,
    tgt_out (B, T) = reversed + EOS, both padded with PAD."""
    lengths = torch.randint(min_len, max_len + 1, (batch,), generator=generator)
    S = int(lengths.max())
    digits = torch.randint(3, 3 + DIGITS, (batch, S), generator=generator)
    positions = torch.arange(S)
    valid = positions[None, :] < lengths[:, None]
    src = digits.masked_fill(~valid, PAD)
    # reversed source: position t of the target is source position length - 1 - t
    index = (lengths[:, None] - 1 - positions[None, :]).clamp(min=0)
    reversed_ = src.gather(1, index).masked_fill(~valid, PAD)
    tgt_in = torch.cat([torch.full((batch, 1), BOS), reversed_], 1)
    tgt_out = torch.cat([reversed_, torch.full((batch, 1), PAD)], 1)
    tgt_out[torch.arange(batch), lengths] = EOS
    return src, lengths, tgt_in, tgt_out


# ---------------------------------------------------------------------------------------------
# Model


class TorchLuongAttention(nn.Module):
    """Luong "general" attention in plain torch, parameter for parameter like
    fastattn.nn.LuongAttention(query_dim, key_dim, score="general"): score = q^T W k."""

    def __init__(self, query_dim: int, key_dim: int):
        super().__init__()
        self.linear = nn.Linear(key_dim, query_dim, bias=False)

    def forward(self, query, keys, key_padding_mask=None):
        scores = torch.bmm((query @ self.linear.weight).unsqueeze(1), keys.transpose(1, 2))
        if key_padding_mask is not None:
            scores = scores.masked_fill(key_padding_mask[:, None, :], float("-inf"))
        return torch.bmm(torch.softmax(scores, -1), keys).squeeze(1)


class Seq2Seq(nn.Module):
    def __init__(self, emb: int, hidden: int, *, use_torch: bool):
        super().__init__()
        rnn = nn if use_torch else fnn
        self.hidden = hidden
        self.src_emb = nn.Embedding(VOCAB, emb, padding_idx=PAD)
        self.tgt_emb = nn.Embedding(VOCAB, emb, padding_idx=PAD)
        self.encoder = rnn.GRU(emb, hidden, batch_first=True, bidirectional=True)
        self.bridge = nn.Linear(2 * hidden, hidden)
        self.decoder = rnn.GRUCell(emb + hidden, hidden)
        if use_torch:
            self.attention = TorchLuongAttention(hidden, 2 * hidden)
        else:
            self.attention = fnn.LuongAttention(hidden, 2 * hidden, score="general")
        self.combine = nn.Linear(3 * hidden, hidden, bias=False)
        self.out = nn.Linear(hidden, VOCAB)

    def encode(self, src, lengths):
        """-> encoder states (B, S, 2H), key padding mask (B, S), initial decoder state (B, H)."""
        packed = pack_padded_sequence(
            self.src_emb(src), lengths, batch_first=True, enforce_sorted=False
        )
        states, h_n = self.encoder(packed)
        states, _ = pad_packed_sequence(states, batch_first=True, total_length=src.shape[1])
        h0 = torch.tanh(self.bridge(torch.cat([h_n[0], h_n[1]], -1)))
        return states, src == PAD, h0

    def step(self, token, h, feed, states, padding):
        """One decoder step: token (B,), h (B, H), feed (B, H) (previous attentional state)
        -> logits (B, V), h, attentional state."""
        h = self.decoder(torch.cat([self.tgt_emb(token), feed], -1), h)
        context = self.attention(h, states, key_padding_mask=padding)
        attentional = torch.tanh(self.combine(torch.cat([context, h], -1)))
        return self.out(attentional), h, attentional

    def forward(self, src, lengths, tgt_in):
        """Teacher forcing: logits (B, T, V)."""
        states, padding, h = self.encode(src, lengths)
        feed = h.new_zeros(h.shape)
        logits = []
        for t in range(tgt_in.shape[1]):
            step_logits, h, feed = self.step(tgt_in[:, t], h, feed, states, padding)
            logits.append(step_logits)
        return torch.stack(logits, 1)


# ---------------------------------------------------------------------------------------------
# Decoding


@torch.no_grad()
def greedy_decode(model: Seq2Seq, src, lengths, max_len: int):
    """-> tokens (B, max_len), EOS-terminated rows padded with PAD."""
    states, padding, h = model.encode(src, lengths)
    feed = h.new_zeros(h.shape)
    token = torch.full((src.shape[0],), BOS)
    done = torch.zeros(src.shape[0], dtype=torch.bool)
    out = []
    for _ in range(max_len):
        logits, h, feed = model.step(token, h, feed, states, padding)
        token = logits.argmax(-1).masked_fill(done, PAD)
        out.append(token)
        done |= token == EOS
        if bool(done.all()):
            break
    return torch.stack(out, 1)


@torch.no_grad()
def beam_decode(model: Seq2Seq, src, lengths, max_len: int, beam: int, alpha: float = 0.6):
    """Beam search with length normalisation (score = log p / len ** alpha) over B * beam rows
    at once. -> tokens (B, <= max_len) of the best finished hypothesis per source."""
    B = src.shape[0]
    states, padding, h = model.encode(src, lengths)
    # every row of the batch repeated beam times: (B * K, ...)
    states = states.repeat_interleave(beam, 0)
    padding = padding.repeat_interleave(beam, 0)
    h = h.repeat_interleave(beam, 0)
    feed = h.new_zeros(h.shape)
    token = torch.full((B * beam,), BOS)
    # only the first beam is live at the start (the others would duplicate it)
    score = torch.full((B, beam), float("-inf"))
    score[:, 0] = 0.0
    history = torch.zeros(B * beam, 0, dtype=torch.long)
    finished = torch.zeros(B, beam, dtype=torch.bool)
    best = [None] * B
    best_score = torch.full((B,), float("-inf"))
    for t in range(max_len):
        logits, h, feed = model.step(token, h, feed, states, padding)
        logp = torch.log_softmax(logits.float(), -1).view(B, beam, VOCAB)
        total = (score.unsqueeze(-1) + logp).view(B, beam * VOCAB)
        top, flat = total.topk(beam, -1)  # (B, K)
        origin, token = flat // VOCAB, flat % VOCAB
        rows = (torch.arange(B)[:, None] * beam + origin).view(-1)
        h, feed, history = h[rows], feed[rows], history[rows]
        token = token.view(-1)
        history = torch.cat([history, token[:, None]], 1)
        score = top
        # hypotheses ending here: keep the best by normalised score, then retire them
        ended = (token == EOS).view(B, beam) & torch.isfinite(score)
        normalised = score / ((t + 1) ** alpha)
        for b, k in ended.nonzero().tolist():
            if normalised[b, k] > best_score[b]:
                best_score[b] = normalised[b, k]
                best[b] = history[b * beam + k]
        score = score.masked_fill(ended, float("-inf"))
        # stop when no live hypothesis can still beat the best finished one
        bound = score.max(-1).values / ((t + 1) ** alpha)
        finished = best_score >= bound
        if bool(finished.all()):
            break
    out = torch.full((B, max_len), PAD)
    for b in range(B):
        if best[b] is None:  # nothing finished: the best live hypothesis
            best[b] = history[b * beam + int(score[b].argmax())]
        out[b, : best[b].shape[0]] = best[b]
    return out


def exact_match(pred, tgt_out) -> float:
    """Fraction of rows whose tokens up to and including EOS equal the target's."""
    T = tgt_out.shape[1]
    pred = pred[:, :T]
    if pred.shape[1] < T:
        pred = torch.cat([pred, torch.full((pred.shape[0], T - pred.shape[1]), PAD)], 1)
    return float((pred == tgt_out).all(1).float().mean())


# ---------------------------------------------------------------------------------------------
# Training


def train(args) -> dict:
    torch.manual_seed(args.seed)
    model = Seq2Seq(args.emb, args.hidden, use_torch=args.torch)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    # --check decays the learning rate to 0 over its short schedule: at a constant rate its
    # held-out accuracy depends on where the last steps happen to land (docs/guides/recurrent.md,
    # the seq2seq example's section), for torch's modules and fastattn's alike.
    schedule = (
        torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / args.steps)
        if args.check
        else None
    )
    data = torch.Generator().manual_seed(args.seed + 1)
    loss_fn = nn.CrossEntropyLoss(ignore_index=PAD)
    curve = []
    start = time.perf_counter()
    step_time = 0.0
    for step in range(1, args.steps + 1):
        src, lengths, tgt_in, tgt_out = make_batch(args.batch, args.min_len, args.max_len, data)
        t0 = time.perf_counter()
        logits = model(src, lengths, tgt_in)
        loss = loss_fn(logits.reshape(-1, VOCAB), tgt_out.reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if schedule is not None:
            schedule.step()
        step_time += time.perf_counter() - t0
        if step % args.log_every == 0 or step == args.steps:
            loss_value = float(loss.detach())
            curve.append((step, loss_value))
            print(
                f"step {step:5d}  loss {loss_value:.4f}  "
                f"{1e3 * step_time / step:.1f} ms/step  {time.perf_counter() - start:.0f} s",
                flush=True,
            )
    model.eval()
    held_out = torch.Generator().manual_seed(args.seed + 2)
    src, lengths, _, tgt_out = make_batch(args.eval_size, args.min_len, args.max_len, held_out)
    max_len = tgt_out.shape[1] + 2
    greedy = exact_match(greedy_decode(model, src, lengths, max_len), tgt_out)
    beam = exact_match(beam_decode(model, src, lengths, max_len, args.beam), tgt_out)
    modules = "torch" if args.torch else "fastattn"
    if not args.torch:
        import fastattn

        ran = {op: fastattn.last_backend(op) for op in ("gru", "gru_cell", "attention")}
        print("fastattn backends:", ", ".join(f"{op}={name}" for op, name in ran.items()))
    print(
        f"{modules} modules: held-out exact match ({args.eval_size} strings of length "
        f"{args.min_len}-{args.max_len}): greedy {100 * greedy:.1f}%, beam (K={args.beam}) "
        f"{100 * beam:.1f}%; {1e3 * step_time / args.steps:.1f} ms per training step"
    )
    return dict(curve=curve, greedy=greedy, beam=beam, ms_per_step=1e3 * step_time / args.steps)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--torch", action="store_true", help="torch's modules instead")
    parser.add_argument("--check", action="store_true", help="short schedule, exit 1 on failure")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--min-len", type=int, default=5)
    parser.add_argument("--max-len", type=int, default=None)
    parser.add_argument("--emb", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=None)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--beam", type=int, default=4)
    parser.add_argument("--eval-size", type=int, default=500)
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    # --check: shorter strings and a smaller model, a schedule that fits a test's time
    if args.max_len is None:
        args.max_len = 12 if args.check else 30
    if args.hidden is None:
        args.hidden = 64 if args.check else 128
    if args.steps is None:
        args.steps = 400 if args.check else 2000
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    result = train(args)
    if args.check:
        ok = result["beam"] >= 0.98 and result["beam"] >= result["greedy"]
        print("check:", "passed" if ok else "FAILED (need beam >= 98% and beam >= greedy)")
        return 0 if ok else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
