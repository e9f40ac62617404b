"""Whole models: one forward + backward training step (loss, then gradients of every
parameter) of torch models and of their fastattn versions (model_definitions.to_fastattn:
swap_modules, same Parameters), providers "torch" and "fastattn".

The models are those of tests/test_models.py, defined once in benchmarks/model_definitions.py,
here at larger sizes: "transformer" (nn.Transformer), "gpt" (a pre-norm decoder), "tagger" (a
bidirectional LSTM on PackedSequences) and "seq2seq" (an LSTM encoder-decoder with additive
attention), the LSTM models only when fastattn.nn.LSTM / LSTMCell exist. Plus an inference case:
the "transformer" forward in eval mode under no_grad, where torch runs its fused encoder fast
path (and packs padded batches into NestedTensors).

Before timing, the loss and every gradient (the eval case: the logits at valid positions) of
both models are checked against a ground truth, the torch model run in a higher precision
(float64 for float32 models, float32 for bfloat16 ones), by FlashAttention's rule per tensor:
fastattn's relative error (largest |difference| over the largest |value|) may be at most
`FACTOR` times torch's own error in the same dtype, plus a floor. Comparing the bfloat16 models
with each other under a fixed bound does not work: over several layers and decoder steps the
bfloat16 torch model is itself off by 0.1-0.4 (relative, worst gradient) from the ground truth,
and two correct bfloat16 implementations differ from each other by as much.
"""

from __future__ import annotations

import copy
import warnings

import torch
import torch.nn.functional as F
from common import Case, relative_error
from model_definitions import (
    PAD,
    GPTDecoder,
    LSTMSeq2Seq,
    LSTMTagger,
    TransformerSeq2Seq,
    has_lstm,
    no_dropout,
    to_fastattn,
)
from torch import nn

# FlashAttention's rule: fastattn's error <= FACTOR x torch's error (same dtype) + FLOOR.
FACTOR = {"train": 3.0, "eval": 2.0}  # gradients 3x, as the tests' rule (tests/tolerance.py)
FLOOR = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
TAGS = 17

# torch's own notices from the torch models' fast paths, which say nothing about fastattn:
# the eval-mode encoder packs padded batches into NestedTensors (a prototype API).
warnings.filterwarnings("ignore", message="The PyTorch API of nested tensors is in prototype")
warnings.filterwarnings("ignore", message="nested_from_padded CUDA kernels only support")


def target(op: str) -> float:
    """The targets: every model row at least 1.1x torch, the seq2seq training step 1.3x."""
    return 1.3 if op.startswith("model seq2seq") else 1.1


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
    tags = torch.randint(0, TAGS, t.shape, generator=g).to(device).masked_fill(t == PAD, -100)
    return (t,), tags


def model_case(name, size, B, L, dtype, device, *, train=True) -> Case:
    vocab = size["vocab"]
    torch.manual_seed(0)
    if name == "transformer":
        model = TransformerSeq2Seq(
            vocab, size["d"], size["heads"], size["layers"], size["ff"], dropout=0.1
        )
    elif name == "gpt":
        model = GPTDecoder(vocab, size["d"], size["heads"], size["layers"], size["ff"], dropout=0.1)
    elif name == "tagger":
        model = LSTMTagger(vocab, size["d"], size["hidden"], TAGS)
    else:
        model = LSTMSeq2Seq(vocab, size["d"], size["hidden"], size["attn"])
    original = model.to(device=device, dtype=dtype)
    fast = to_fastattn(name, copy.deepcopy(original))
    for m in original.modules():  # cuDNN's packed weights (copies and .to() can unpack them)
        if isinstance(m, nn.LSTM):
            m.flatten_parameters()
    # The ground truth: torch's model with the same (rounded) weights in a higher precision.
    truth_dtype = torch.float64 if dtype == torch.float32 else torch.float32
    g = torch.Generator().manual_seed(1)
    inputs, target = make_batch(name, B, L, vocab, device, g)
    ignore = -100 if name == "tagger" else PAD

    def loss_of(m):
        logits = m(*inputs)
        logits = logits.reshape(-1, logits.shape[-1])
        if logits.dtype != torch.float64:
            logits = logits.float()
        return F.cross_entropy(logits, target.reshape(-1), ignore_index=ignore)

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
            return (
                loss.detach(),
                *[p.grad.detach().clone() for p in m.parameters() if p.grad is not None],
            )

        return run

    def infer(m):
        def run():
            with torch.no_grad():
                return m(*inputs)

        return run

    def ground_truth():
        truth_model = copy.deepcopy(original).to(truth_dtype)
        truth_model.train(train)
        return (checked if train else valid_logits(infer))(truth_model)()

    def valid_logits(run):
        valid = (inputs[-1] != PAD)[..., None]
        return lambda m: lambda: run(m)().masked_fill(~valid, 0.0)

    if train:
        original.train(), fast.train()
        providers = {"torch": step(original), "fastattn": step(fast)}
        check_providers = {"torch": checked(original), "fastattn": checked(fast)}
    else:
        original.eval(), fast.eval()
        providers = {"torch": infer(original), "fastattn": infer(fast)}
        check_providers = {
            "torch": valid_logits(infer)(original),
            "fastattn": valid_logits(infer)(fast),
        }
    dims = ", ".join(f"{k}={v}" for k, v in size.items() if k != "vocab")
    return Case(
        op=f"model {name}" + (" train step" if train else " eval fwd"),
        name=f"B={B} L={L} {dims}",
        providers=providers,
        reference="torch",
        baselines=("torch",),
        check=relative_error,
        check_providers=check_providers,
        ground_truth=ground_truth,
        factor=FACTOR["train" if train else "eval"],
        tolerance=FLOOR[dtype],
        dtype=str(dtype)[6:],
    )


def cases(profile: str, device: torch.device) -> list[Case]:
    f32 = torch.float32
    if device.type == "cuda":
        dtype = torch.bfloat16
        tr = dict(vocab=32000, d=512, heads=8, layers=6, ff=2048)
        gpt = dict(vocab=32000, d=768, heads=12, layers=12, ff=3072)
        out = [
            model_case("transformer", tr, 32, 256, dtype, device),
            model_case("gpt", gpt, 16, 1024, dtype, device),
            model_case("transformer", tr, 32, 256, dtype, device, train=False),
        ]
        if profile == "full":
            out += [
                model_case("transformer", tr, 32, 256, f32, device),
                model_case("gpt", gpt, 8, 2048, dtype, device),
            ]
        lstm = [
            ("tagger", dict(vocab=32000, d=256, hidden=512), 64, 100),
            ("seq2seq", dict(vocab=32000, d=256, hidden=512, attn=256), 64, 50),
        ]
    elif profile == "quick":
        tr = dict(vocab=1000, d=128, heads=4, layers=2, ff=512)
        gpt = dict(vocab=1000, d=128, heads=4, layers=2, ff=512)
        out = [
            model_case("transformer", tr, 16, 64, f32, device),
            model_case("gpt", gpt, 8, 256, f32, device),
            model_case("transformer", tr, 16, 64, f32, device, train=False),
        ]
        lstm = [
            ("tagger", dict(vocab=1000, d=64, hidden=128), 16, 40),
            ("seq2seq", dict(vocab=1000, d=64, hidden=128, attn=64), 16, 20),
        ]
    else:
        tr = dict(vocab=8000, d=256, heads=4, layers=3, ff=1024)
        gpt = dict(vocab=8000, d=256, heads=4, layers=4, ff=1024)
        out = [
            model_case("transformer", tr, 32, 128, f32, device),
            model_case("gpt", gpt, 16, 512, f32, device),
            model_case("transformer", tr, 32, 128, f32, device, train=False),
        ]
        lstm = [
            ("tagger", dict(vocab=8000, d=128, hidden=256), 32, 100),
            ("seq2seq", dict(vocab=8000, d=128, hidden=256, attn=128), 32, 40),
        ]
    if has_lstm():
        dtype = torch.bfloat16 if device.type == "cuda" else f32
        out += [model_case(name, size, B, L, dtype, device) for name, size, B, L in lstm]
    else:
        print(
            "bench_models: the LSTM models are skipped (fastattn.nn.LSTM / LSTMCell do not "
            "exist yet)"
        )
    return out


def summary(rows: list[dict]) -> list[str]:
    return [
        f"{r['op']} {r['case']}: fastattn {r['speedup']:.2f}x torch "
        f"({r['median_ms']:.1f} ms per call)"
        for r in rows
        if r.get("provider") == "fastattn" and "speedup" in r
    ]
