"""fastattn across Hugging Face architectures: small randomly initialised
models built offline, each run with attn_implementation="eager" and "fastattn" on the same
weights. Per architecture: logits at the valid positions with left and with right padding,
the gradient of every parameter, and greedy `generate()` tokens with the dynamic and the
static cache. A spy proves that every attention layer ran fastattn (and on which backend).

The grid covers decoders with GQA and MQA, sliding windows, softcap, partial and interleaved
rotary, MLA with Dv != D (DeepSeek-V3), attention sinks (GPT-OSS), top-k sparse `indices`
(DeepSeek-V3.2), encoders, and encoder-decoders with cross attention (T5 with its learned
relative position bias, BART, Marian). Comparisons are in float32, where eager stays finite
on left padding (see tests/test_transformers_integration.py for float64).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import fastattn  # noqa: E402
import fastattn.integrations.transformers as fa_hf  # noqa: E402

VOCAB = 97
COMMON = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0)
SMALL = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=37,
    max_position_embeddings=64,
)
# (expert matrices with 16-byte aligned strides: torch's grouped_mm requires them)
MOE = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=8, intermediate_size=40)
MLA = dict(q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=6)
SEQ2SEQ = dict(
    d_model=32,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=37,
    decoder_ffn_dim=37,
    max_position_embeddings=64,
)

# name -> (config class, model class, config keywords, kind, what it exercises)
ARCHITECTURES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(SMALL, num_key_value_heads=2), "decoder"),
    "mistral": (
        "MistralConfig",
        "MistralForCausalLM",
        dict(SMALL, num_key_value_heads=2, sliding_window=4),
        "decoder",
    ),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(SMALL, num_key_value_heads=1), "decoder"),
    "qwen3": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(SMALL, num_key_value_heads=2, head_dim=16),
        "decoder",
    ),
    "gemma": (
        "GemmaConfig",
        "GemmaForCausalLM",
        dict(SMALL, num_key_value_heads=1, head_dim=16),
        "decoder",
    ),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(
            SMALL,
            num_key_value_heads=2,
            head_dim=8,
            sliding_window=4,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=None,
        ),
        "decoder",
    ),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(SMALL, rotary_pct=0.5), "decoder"),
    "phi": ("PhiConfig", "PhiForCausalLM", dict(SMALL, partial_rotary_factor=0.5), "decoder"),
    "stablelm": (
        "StableLmConfig",
        "StableLmForCausalLM",
        dict(SMALL, partial_rotary_factor=0.25, num_key_value_heads=2),
        "decoder",
    ),
    "cohere": ("CohereConfig", "CohereForCausalLM", dict(SMALL, num_key_value_heads=2), "decoder"),
    "glm": (
        "GlmConfig",
        "GlmForCausalLM",
        dict(SMALL, num_key_value_heads=2, head_dim=8, partial_rotary_factor=0.5),
        "decoder",
    ),
    "deepseek_v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(SMALL, num_key_value_heads=4, first_k_dense_replace=1, n_group=1, topk_group=1)
        | MLA
        | MOE,
        "decoder",
    ),
    "deepseek_v32": (
        "DeepseekV32Config",
        "DeepseekV32ForCausalLM",
        dict(
            SMALL,
            num_key_value_heads=4,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            index_topk=4,
            index_n_heads=2,
            index_head_dim=8,
        )
        | MLA
        | MOE,
        "decoder",
    ),
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        dict(
            SMALL,
            num_key_value_heads=2,
            head_dim=8,
            num_local_experts=4,
            intermediate_size=40,
            num_experts_per_tok=2,
            sliding_window=4,
        ),
        "decoder",
    ),
    "gpt2": (
        "GPT2Config",
        "GPT2LMHeadModel",
        dict(n_embd=32, n_layer=2, n_head=4, n_positions=64),
        "decoder",
    ),
    "gpt_bigcode": (
        "GPTBigCodeConfig",
        "GPTBigCodeForCausalLM",
        dict(n_embd=32, n_layer=2, n_head=4, n_positions=64, multi_query=True),
        "decoder",
    ),
    "opt": (
        "OPTConfig",
        "OPTForCausalLM",
        dict(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            ffn_dim=37,
            max_position_embeddings=64,
            word_embed_proj_dim=32,
        ),
        "decoder",
    ),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict(SMALL, num_key_value_heads=2), "decoder"),
    "starcoder2": (
        "Starcoder2Config",
        "Starcoder2ForCausalLM",
        dict(SMALL, num_key_value_heads=2, sliding_window=4),
        "decoder",
    ),
    "granite": (
        "GraniteConfig",
        "GraniteForCausalLM",
        dict(SMALL, num_key_value_heads=2),
        "decoder",
    ),
    "bert": ("BertConfig", "BertForMaskedLM", dict(SMALL), "encoder"),
    "roberta": (
        "RobertaConfig",
        "RobertaForMaskedLM",
        dict(SMALL, max_position_embeddings=70),
        "encoder",
    ),
    "electra": ("ElectraConfig", "ElectraForMaskedLM", dict(SMALL, embedding_size=16), "encoder"),
    "t5": (
        "T5Config",
        "T5ForConditionalGeneration",
        dict(
            d_model=32,
            d_kv=8,
            d_ff=37,
            num_layers=2,
            num_decoder_layers=2,
            num_heads=4,
            relative_attention_num_buckets=8,
            decoder_start_token_id=0,
        ),
        "encoder-decoder",
    ),
    "bart": (
        "BartConfig",
        "BartForConditionalGeneration",
        dict(SEQ2SEQ, decoder_start_token_id=2),
        "encoder-decoder",
    ),
    "marian": (
        "MarianConfig",
        "MarianMTModel",
        dict(SEQ2SEQ, decoder_start_token_id=0),
        "encoder-decoder",
    ),
}


@pytest.fixture(autouse=True)
def _setup(one_thread):
    fa_hf.register()
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    yield
    transformers.logging.set_verbosity(verbosity)


def routed_or_skip(name: str):
    """(config, model class) of `name`; skips where this transformers lacks the architecture
    or its attention does not call the interface (older releases)."""
    config_name, class_name, keywords, _ = ARCHITECTURES[name]
    if not hasattr(transformers, config_name) or not hasattr(transformers, class_name):
        pytest.skip(f"transformers {transformers.__version__} has no {class_name}")
    cls = getattr(transformers, class_name)
    if not fa_hf.routes_attention_through_interface(cls):
        pytest.skip(f"{class_name} does not call the attention interface in this transformers")
    return getattr(transformers, config_name)(**COMMON, **keywords), cls


def build_pair(name: str):
    """(eager model, fastattn model) in float32 eval mode with identical random weights."""
    config, cls = routed_or_skip(name)
    torch.manual_seed(0)
    eager = cls._from_config(copy.deepcopy(config), attn_implementation="eager")
    fast = cls._from_config(copy.deepcopy(config), attn_implementation="fastattn")
    with torch.no_grad():  # nonzero biases and norms too
        g = torch.Generator().manual_seed(1)
        for p in eager.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    fast.load_state_dict(eager.state_dict())
    return eager.float().eval(), fast.float().eval()


def batch(padding: str):
    """input_ids (3, 11) and attention_mask with left or right padding."""
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, VOCAB, (3, 11), generator=g)
    mask = torch.ones(3, 11, dtype=torch.long)
    if padding == "right":
        mask[1, 7:] = 0
        mask[2, 4:] = 0
    else:
        mask[1, :3] = 0
        mask[2, :6] = 0
    return ids.masked_fill(mask == 0, 0), mask


class Spy:
    """Counts the integration's fastattn.attention calls and the keywords they carried."""

    def __init__(self, monkeypatch):
        self.calls: list[dict] = []
        real = fa_hf.attention

        def spy(q, k, v, **kw):
            out = real(q, k, v, **kw)
            self.calls.append(dict(kw, backend=fastattn.last_backend("attention")))
            return out

        monkeypatch.setattr(fa_hf, "attention", spy)


def logits_and_grads(model, kind, ids, mask):
    model.zero_grad(set_to_none=True)
    inputs = dict(input_ids=ids, attention_mask=mask)
    if kind == "encoder-decoder":
        dec = torch.randint(3, VOCAB, (ids.shape[0], 5), generator=torch.Generator().manual_seed(4))
        inputs["decoder_input_ids"] = dec
        valid = torch.ones(dec.shape, dtype=torch.bool)
    else:
        valid = mask.bool()
    logits = model(**inputs).logits
    weight = torch.randn(logits.shape, generator=torch.Generator().manual_seed(3))
    (torch.where(valid[..., None], logits, 0) * weight).sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    return logits.detach()[valid], grads


@pytest.mark.parametrize("padding", ("left", "right"))
@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_logits_and_gradients_match_eager(monkeypatch, name, padding):
    eager, fast = build_pair(name)
    kind = ARCHITECTURES[name][3]
    ids, mask = batch(padding)
    logits_e, grads_e = logits_and_grads(eager, kind, ids, mask)
    spy = Spy(monkeypatch)
    logits_f, grads_f = logits_and_grads(fast, kind, ids, mask)
    assert spy.calls, "fastattn never ran"
    assert {kw["backend"] for kw in spy.calls} == {"cpu"}  # fused: the reference never ran
    assert torch.isfinite(logits_f).all()
    torch.testing.assert_close(logits_f, logits_e, rtol=1e-4, atol=2e-5)
    assert grads_f.keys() == grads_e.keys()
    compared = 0
    for key, g_e in grads_e.items():
        g_f = grads_f[key]
        assert (g_f is None) == (g_e is None), key
        if g_e is not None:
            compared += 1
            torch.testing.assert_close(
                g_f, g_e, rtol=1e-3, atol=2e-5, msg=lambda m, key=key: f"{key}: {m}"
            )
    assert compared > 10


@pytest.mark.parametrize("cache", ("dynamic", "static"))
@pytest.mark.parametrize(
    "name", sorted(n for n, spec in ARCHITECTURES.items() if spec[3] != "encoder")
)
def test_greedy_generation_same_tokens(monkeypatch, name, cache):
    eager, fast = build_pair(name)
    ids, mask = batch("left")
    new = 5
    kw = dict(
        attention_mask=mask,
        max_new_tokens=new,
        do_sample=False,
        use_cache=True,
        pad_token_id=0,
        eos_token_id=None,
    )
    if cache == "static":
        kw["cache_implementation"] = "static"
    with torch.no_grad():
        out_e = eager.generate(input_ids=ids, **kw)
        spy = Spy(monkeypatch)
        out_f = fast.generate(input_ids=ids, **kw)
    assert spy.calls
    assert torch.equal(out_f, out_e), f"eager {out_e.tolist()} fastattn {out_f.tolist()}"


def test_t5_relative_bias_gets_its_gradient_through_the_kernels(monkeypatch):
    """T5's position_bias reaches fastattn as a float mask that requires grad: the bias
    parameter's gradient equals eager's and the cpu kernels (not the reference) ran."""
    eager, fast = build_pair("t5")
    ids, mask = batch("right")
    spy = Spy(monkeypatch)
    _, grads_e = logits_and_grads(eager, "encoder-decoder", ids, mask)
    _, grads_f = logits_and_grads(fast, "encoder-decoder", ids, mask)
    biased = [
        kw for kw in spy.calls if kw["attn_mask"] is not None and kw["attn_mask"].requires_grad
    ]
    assert biased, "no call carried the learned bias"
    assert {kw["backend"] for kw in biased} == {"cpu"}
    key = "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
    assert grads_f[key].abs().sum() > 0
    torch.testing.assert_close(grads_f[key], grads_e[key], rtol=1e-3, atol=2e-5)


def test_deepseek_v32_indices_select_keys(monkeypatch):
    """DeepSeek-V3.2 hands fastattn its top-k `indices`; folded into the mask they change
    the result (the model with index_topk below the length differs from one that keeps every
    key), and the result equals eager's."""
    eager, fast = build_pair("deepseek_v32")
    ids, mask = batch("right")
    spy = Spy(monkeypatch)
    with torch.no_grad():
        sparse = fast(input_ids=ids, attention_mask=mask).logits
        reference = eager(input_ids=ids, attention_mask=mask).logits
    assert spy.calls and all(kw["attn_mask"] is not None for kw in spy.calls)
    valid = mask.bool()
    torch.testing.assert_close(sparse[valid], reference[valid], rtol=1e-4, atol=2e-5)
    fast.config.index_topk = 64  # every key selected: a different result
    for layer in fast.model.layers:
        layer.self_attn.indexer.index_topk = 64
    with torch.no_grad():
        dense = fast(input_ids=ids, attention_mask=mask).logits
    assert not torch.allclose(dense[valid], sparse[valid], atol=1e-4)


def test_unknown_keyword_is_refused():
    q = torch.randn(1, 2, 3, 4)
    module = torch.nn.Module()
    with pytest.raises(ValueError, match="head_mask"):
        fa_hf.fastattn_attention_forward(module, q, q, q, None, head_mask=torch.ones(2))
    # keywords that do not change the result, and None values, pass
    out, _ = fa_hf.fastattn_attention_forward(
        module, q, q, q, None, position_ids=torch.arange(3), head_mask=None, use_cache=True
    )
    assert out.shape == (1, 3, 2, 4)


def test_indices_of_the_wrong_shape_are_refused():
    q = torch.randn(1, 2, 3, 4)
    with pytest.raises(ValueError, match="indices"):
        fa_hf.fastattn_attention_forward(
            torch.nn.Module(), q, q, q, None, indices=torch.zeros(1, 2, 2, dtype=torch.int32)
        )


def test_models_that_bypass_the_interface_warn_once():
    """BLOOM computes attention (with ALiBi) in its own layers: building it with
    attn_implementation="fastattn" warns, once per architecture."""
    if not hasattr(transformers, "BloomForCausalLM"):
        pytest.skip("no BLOOM in this transformers")
    cls = transformers.BloomForCausalLM
    if fa_hf.routes_attention_through_interface(cls):
        pytest.skip("BLOOM calls the attention interface in this transformers")
    config = transformers.BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=1, n_head=4)
    fa_hf._warned_classes.discard(cls.__module__)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cls._from_config(copy.deepcopy(config), attn_implementation="fastattn")
        cls._from_config(copy.deepcopy(config), attn_implementation="fastattn")
    ours = [w for w in caught if "never calls" in str(w.message)]
    assert len(ours) == 1 and "Bloom" in str(ours[0].message)
    # a model that routes through the interface builds quietly
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build_pair("llama")
    assert not [w for w in caught if "never calls" in str(w.message)]
