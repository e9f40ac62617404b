"""Tests of the Hugging Face transformers integration (fastattn/integrations/transformers.py).

register() adds "fastattn" to transformers' attention and mask interfaces. Small randomly
initialised BERT, GPT-2 and Llama (grouped-query attention: num_key_value_heads <
num_attention_heads) models are built offline with `Model._from_config(copy.deepcopy(config),
attn_implementation=...)` (each model gets its own config copy: the attention function is
looked up from the config at run time) and compared with "eager" in float64: hidden states at
the valid (non-padding) positions and the gradients of every parameter. A spy on the
integration's call of fastattn.attention, and last_backend, prove that fastattn ran.

Padding: "eager" in float64 gives NaN for queries that see no key (left padding in a causal
model: its float64 mask becomes -inf in the float32 softmax), and the NaN reaches every
position of that sequence in the next layer, while fastattn gives zeros. Float64 comparisons
therefore use padding that leaves every query a key (right padding for causal models); left
padding is compared in float32, where eager stays finite.
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import fastattn  # noqa: E402
import fastattn.integrations.transformers as fa_hf  # noqa: E402

F64 = torch.float64
VOCAB = 97


@pytest.fixture(autouse=True)
def _setup(one_thread):
    """register() once per test (idempotent); quiet transformers; one intra-op thread (tiny
    models, pytest -n 2 on 2 cores)."""
    fa_hf.register()
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    yield
    transformers.logging.set_verbosity(verbosity)


def config_for(name: str):
    common = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if name == "bert":
        return transformers.BertConfig(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=37,
            max_position_embeddings=64,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            **common,
        )
    if name == "gpt2":
        return transformers.GPT2Config(
            n_embd=32,
            n_layer=2,
            n_head=4,
            n_positions=64,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            **common,
        )
    return transformers.LlamaConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=37,
        max_position_embeddings=64,
        attention_dropout=0.0,
        **common,
    )


BASE = {"bert": "BertModel", "gpt2": "GPT2Model", "llama": "LlamaModel"}
LM = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}
CAUSAL = {"bert": False, "gpt2": True, "llama": True}


def build_pair(name: str, classes=BASE, dtype=F64, reference: str = "eager"):
    """(reference model, fastattn model) with identical random weights."""
    cls = getattr(transformers, classes[name])
    config = config_for(name)
    torch.manual_seed(0)
    eager = cls._from_config(copy.deepcopy(config), attn_implementation=reference)
    fast = cls._from_config(copy.deepcopy(config), attn_implementation="fastattn")
    with torch.no_grad():  # random, nonzero biases and norms too
        g = torch.Generator().manual_seed(1)
        for p in eager.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    fast.load_state_dict(eager.state_dict())
    assert eager.config._attn_implementation == reference
    assert fast.config._attn_implementation == "fastattn"
    return eager.to(dtype), fast.to(dtype)


def batch(padding: str, seed: int = 2):
    """input_ids (3, 11) and attention_mask (1 = token) with `padding` in "none", "right",
    "left", "mixed" (BERT: padding anywhere but position 0)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (3, 11), generator=g)
    mask = torch.ones(3, 11, dtype=torch.long)
    if padding == "right":
        mask[1, 7:] = 0
        mask[2, 4:] = 0
    elif padding == "left":
        mask[1, :3] = 0
        mask[2, :6] = 0
    elif padding == "mixed":
        mask[1, 7:] = 0
        mask[2, 2:5] = 0
    ids = ids.masked_fill(mask == 0, 0)
    return ids, mask


class Spy:
    """Records the fastattn.attention calls the integration makes (q, k shapes, causal)."""

    def __init__(self, monkeypatch):
        self.calls = []
        real = fa_hf.attention

        def spy(q, k, v, **kw):
            self.calls.append(
                (tuple(q.shape), tuple(k.shape), kw.get("causal"), kw.get("attn_mask") is not None)
            )
            return real(q, k, v, **kw)

        monkeypatch.setattr(fa_hf, "attention", spy)


def hidden_and_grads(model, ids, mask, seed=3):
    model.zero_grad(set_to_none=True)
    hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
    valid = mask.bool()[..., None]
    g = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(seed), dtype=F64).to(
        hidden.dtype
    )
    (torch.where(valid, hidden, 0) * g).sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    return hidden.detach(), grads


# ---------------------------------------------------------------------------------------------
# Registration


def test_register_is_idempotent_and_registers_both_interfaces():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    fa_hf.register()
    fa_hf.register()
    assert AttentionInterface()["fastattn"] is fa_hf.fastattn_attention_forward
    assert "fastattn" in AttentionMaskInterface()


# ---------------------------------------------------------------------------------------------
# Hidden states and gradients vs eager, float64


# Llama's eager attention takes its softmax in float32 (softmax(..., dtype=torch.float32)) even
# for float64 models, so it agrees with float64 only to float32 rounding; Llama is therefore
# also compared with "sdpa", float64 throughout, at the float64 tolerance.
TOLERANCES = {"float64": dict(rtol=1e-9, atol=1e-10), "float32-softmax": dict(rtol=1e-5, atol=1e-5)}


def _float64_cases():
    for name in BASE:
        paddings = ("none", "mixed", "left") if name == "bert" else ("none", "right")
        references = (
            (("eager", "float32-softmax"), ("sdpa", "float64"))
            if name == "llama"
            else (("eager", "float64"),)
        )
        for reference, tol in references:
            for padding in paddings:
                for mode in ("train", "eval"):
                    yield pytest.param(
                        name,
                        reference,
                        tol,
                        padding,
                        mode,
                        id=f"{name}-vs-{reference}-{padding}-{mode}",
                    )


@pytest.mark.parametrize("name,reference,tol,padding,mode", list(_float64_cases()))
def test_hidden_states_and_gradients_match_eager(monkeypatch, name, reference, tol, padding, mode):
    eager, fast = build_pair(name, reference=reference)
    for model in (eager, fast):
        model.train(mode == "train")
    ids, mask = batch(padding)
    h_e, g_e = hidden_and_grads(eager, ids, mask)
    spy = Spy(monkeypatch)
    fastattn._backend.record_backend("attention", "none")
    h_f, g_f = hidden_and_grads(fast, ids, mask)
    layers = fast.config.num_hidden_layers
    assert len(spy.calls) == layers  # every layer ran fastattn
    assert fastattn.last_backend("attention") == "cpu"
    if name == "llama":  # GQA reaches fastattn unrepeated: 4 query heads, 2 key/value heads
        assert all(q[1] == 4 and k[1] == 2 for q, k, _, _ in spy.calls)
    assert torch.isfinite(h_e).all() and torch.isfinite(h_f).all()
    valid = mask.bool()
    torch.testing.assert_close(h_f[valid], h_e[valid], **TOLERANCES[tol])
    assert g_f.keys() == g_e.keys()
    unused = [key for key in g_e if g_e[key] is None]  # e.g. BERT's pooler
    assert all(g_f[key] is None for key in unused)
    assert len(unused) <= 2 and len(g_e) > 10
    for key in g_e:
        if g_e[key] is not None:
            assert g_f[key] is not None, key
            torch.testing.assert_close(
                g_f[key], g_e[key], **TOLERANCES[tol], msg=lambda m, key=key: f"{key}: {m}"
            )


@pytest.mark.parametrize("name", ("gpt2", "llama"))
def test_causal_without_mask_uses_the_causal_flag(monkeypatch, name):
    """No attention_mask: the integration passes causal=True and no mask (the fast path);
    results equal eager."""
    eager, fast = build_pair(name, reference="sdpa" if name == "llama" else "eager")
    eager.eval(), fast.eval()
    ids, _ = batch("none")
    spy = Spy(monkeypatch)
    with torch.no_grad():
        h_f = fast(input_ids=ids).last_hidden_state
        h_e = eager(input_ids=ids).last_hidden_state
    assert spy.calls and all(
        causal is True and not has_mask for _, _, causal, has_mask in spy.calls
    )
    torch.testing.assert_close(h_f, h_e, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", ("gpt2", "llama"))
def test_left_padding_float32(name):
    """Left padding (queries with no visible key) in float32: valid positions agree with
    eager; fastattn is finite everywhere. In float64 eager turns those rows into NaN (see the
    module docstring) while fastattn stays finite, which is checked too."""
    eager, fast = build_pair(name, dtype=torch.float32)
    eager.eval(), fast.eval()
    ids, mask = batch("left")
    with torch.no_grad():
        h_e = eager(input_ids=ids, attention_mask=mask).last_hidden_state
        h_f = fast(input_ids=ids, attention_mask=mask).last_hidden_state
    valid = mask.bool()
    assert torch.isfinite(h_f).all()
    torch.testing.assert_close(h_f[valid], h_e[valid], rtol=1e-4, atol=2e-5)
    with torch.no_grad():
        h64 = fast.to(F64)(input_ids=ids, attention_mask=mask).last_hidden_state
    assert torch.isfinite(h64).all()
    torch.testing.assert_close(h64[valid].float(), h_f[valid], rtol=1e-4, atol=2e-5)


def test_bert_float32_flashattention_scale():
    """float32 BERT with padding: fastattn's error against eager float64 is of the order of
    eager float32's own error (within 2x plus 16 float32 ulps, FlashAttention's rule)."""
    from tolerance import assert_fa_close, rounding_floor

    eager64, fast64 = build_pair("bert")
    eager32 = copy.deepcopy(eager64).float().eval()
    fast32 = copy.deepcopy(fast64).float().eval()
    eager64.eval()
    ids, mask = batch("mixed")
    with torch.no_grad():
        ref64 = eager64(input_ids=ids, attention_mask=mask).last_hidden_state
        ref32 = eager32(input_ids=ids, attention_mask=mask).last_hidden_state
        out = fast32(input_ids=ids, attention_mask=mask).last_hidden_state
    valid = mask.bool()
    floor = rounding_floor(ref64[valid], torch.float32) + 16 * torch.finfo(
        torch.float32
    ).eps * float(ref64[valid].abs().max())
    assert_fa_close("bert float32", out[valid], ref64[valid], ref32[valid], floor=floor)


# ---------------------------------------------------------------------------------------------
# Generation


@pytest.mark.parametrize("padding", ("none", "left"))
@pytest.mark.parametrize("name", ("gpt2", "llama"))
def test_greedy_generation_same_tokens(monkeypatch, name, padding):
    """Greedy generate with the KV cache: the same tokens as eager (float32; left padding as
    generation uses it), and the decode steps ran fastattn with one query against the cache."""
    eager, fast = build_pair(name, classes=LM, dtype=torch.float32)
    eager.eval(), fast.eval()
    ids, mask = batch(padding)
    new = 6
    kw = dict(
        attention_mask=mask,
        max_new_tokens=new,
        do_sample=False,
        use_cache=True,
        pad_token_id=0,
        eos_token_id=None,
    )
    with torch.no_grad():
        out_e = eager.generate(input_ids=ids, **kw)
        spy = Spy(monkeypatch)
        out_f = fast.generate(input_ids=ids, **kw)
    assert out_f.shape == (3, 11 + new)
    assert torch.equal(out_f, out_e), (
        f"eager {out_e[:, 11:].tolist()} fastattn {out_f[:, 11:].tolist()}"
    )
    layers = fast.config.num_hidden_layers
    assert len(spy.calls) == layers * new
    decode = [c for c in spy.calls if c[0][2] == 1]
    assert len(decode) == layers * (new - 1)
    assert {k[2] for _, k, _, _ in decode} == set(range(12, 11 + new))  # growing cache


def test_generation_float64_no_padding_same_tokens():
    eager, fast = build_pair("llama", classes=LM)
    eager.eval(), fast.eval()
    ids, _ = batch("none")
    kw = dict(max_new_tokens=4, do_sample=False, use_cache=True, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        assert torch.equal(fast.generate(input_ids=ids, **kw), eager.generate(input_ids=ids, **kw))


def test_position_bias_joins_the_mask_and_gets_its_gradient():
    """position_bias (T5) with a boolean mask: the same as eager's bias + mask, and the
    gradient reaches the bias (summed over the batch it is broadcast to)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 4, generator=g, dtype=F64) for _ in range(3))
    bias = torch.randn(1, 3, 5, 5, generator=g, dtype=F64, requires_grad=True)
    allowed = torch.ones(2, 1, 5, 5, dtype=torch.bool)
    allowed[1, ..., 3:] = False
    module = torch.nn.Module()
    out, _ = fa_hf.fastattn_attention_forward(module, q, k, v, allowed, position_bias=bias)
    scores = q @ k.transpose(-1, -2) / 2.0 + bias
    expected = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ v
    torch.testing.assert_close(out, expected.transpose(1, 2))
    (grad,) = torch.autograd.grad((out * out).sum(), bias)
    (grad_expected,) = torch.autograd.grad((expected * expected).sum(), bias)
    torch.testing.assert_close(grad, grad_expected)


# ---------------------------------------------------------------------------------------------
# GPT-OSS: attention sinks (s_aux) go to fastattn's `sinks`


def gpt_oss_pair():
    config = transformers.GptOssConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=24,
        num_hidden_layers=2,  # one sliding-window layer, one full
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=5,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        experts_implementation="eager",  # grouped_mm has no float64
    )
    torch.manual_seed(0)
    eager = transformers.GptOssModel._from_config(
        copy.deepcopy(config), attn_implementation="eager"
    )
    fast = transformers.GptOssModel._from_config(
        copy.deepcopy(config), attn_implementation="fastattn"
    )
    with torch.no_grad():  # sinks of a few units, so that they matter
        g = torch.Generator().manual_seed(1)
        for name, p in eager.named_parameters():
            scale = 2.0 if name.endswith("sinks") else 0.02
            p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))
    fast.load_state_dict(eager.state_dict())
    return eager.to(F64), fast.to(F64)


@pytest.mark.parametrize("padding", ("none", "right"))
def test_gpt_oss_sinks_match_eager(monkeypatch, padding):
    """GPT-OSS passes its per-head sinks as s_aux: hidden states and every parameter's
    gradient, the sinks' included, equal eager's in float64."""
    eager, fast = gpt_oss_pair()
    ids, mask = batch(padding)
    h_e, g_e = hidden_and_grads(eager, ids, mask)
    sinks_seen = []
    real = fa_hf.attention

    def spy(q, k, v, **kw):
        sinks_seen.append(kw.get("sinks"))
        return real(q, k, v, **kw)

    monkeypatch.setattr(fa_hf, "attention", spy)
    h_f, g_f = hidden_and_grads(fast, ids, mask)
    assert len(sinks_seen) == 2 and all(s is not None and s.shape == (4,) for s in sinks_seen)
    assert fastattn.last_backend("attention") == "cpu"
    valid = mask.bool()
    torch.testing.assert_close(h_f[valid], h_e[valid], rtol=1e-9, atol=1e-10)
    sink_keys = [key for key in g_e if key.endswith("sinks")]
    assert len(sink_keys) == 2 and all(g_e[key].abs().sum() > 0 for key in sink_keys)
    for key in g_e:
        if g_e[key] is not None:
            torch.testing.assert_close(
                g_f[key], g_e[key], rtol=1e-9, atol=1e-10, msg=lambda m, key=key: f"{key}: {m}"
            )
