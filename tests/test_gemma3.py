"""Gemma 3 (text) and sliding windows shorter than the context: the config as transformers reads
it, what is refused by name, the sliding masks' I/O and the fp16 stream scale. The end-to-end
checks (torch fp32 against Gemma3ForCausalLM, mil fp16, inspect, cascade) run on the Gemma 3 and
windowed Mistral cases of tests/test_families.py.
"""

from __future__ import annotations

import pytest

from llama_ane.config import ConfigError, LlamaConfig
from llama_ane.testing import TINY_CONFIG

from support.families import CASES, GEMMA


# --- the config --------------------------------------------------------------------------------

BASE = dict(TINY_CONFIG, vocab_size=320)


def test_gemma3_config_as_transformers_reads_it():
    """Layer types, both RoPE bases, the scales and the defaults read as Gemma3TextConfig reads them,
    from transformers 4's fields and from transformers 5's rope_parameters alike."""
    import transformers

    d = dict(BASE, **CASES["gemma3_tied_gqa"])
    cfg = LlamaConfig.from_hf_dict(d)
    hf = transformers.AutoConfig.for_model(**d)
    assert [cfg.slides(n) for n in range(3)] == [t == "sliding_attention" for t in hf.layer_types]
    assert cfg.rope_theta == hf.rope_parameters["full_attention"]["rope_theta"] == 1e6
    assert cfg.rope_local_theta == hf.rope_parameters["sliding_attention"]["rope_theta"] == 1e4
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert cfg.query_scale == 24 ** -0.5 and cfg.embedding_multiplier == 64 ** 0.5
    assert LlamaConfig.from_hf_dict(hf.to_dict()) == LlamaConfig.from_hf_dict(dict(hf.to_dict()))
    v5 = LlamaConfig.from_hf_dict(hf.to_dict())
    assert (v5.rope_theta, v5.rope_local_theta, v5.rope_scaling, v5.sliding_layers) == (
        1e6, 1e4, cfg.rope_scaling, [0, 2])
    assert LlamaConfig.from_dict(cfg.to_dict()) == cfg  # the manifest's copy
    pattern = LlamaConfig.from_hf_dict(dict(BASE, **CASES["gemma3_untied_mha"]))
    assert pattern.sliding_layers == [n for n, t in enumerate(transformers.AutoConfig.for_model(
        **dict(BASE, **CASES["gemma3_untied_mha"])).layer_types) if t == "sliding_attention"] == [0, 2]


@pytest.mark.parametrize("change, words", [
    ({"final_logit_softcapping": 30.0}, ["final_logit_softcapping", "softcapping"]),
    ({"attn_logit_softcapping": 50.0}, ["attn_logit_softcapping"]),
    ({"use_bidirectional_attention": True}, ["use_bidirectional_attention"]),
    ({"hidden_activation": "silu"}, ["hidden_activation", "'silu'"]),
    ({"layer_types": ["sliding_attention"]}, ["layer_types", "num_hidden_layers (3)"]),
    ({"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
                          "full_attention": {"rope_type": "default", "rope_theta": 1e6}}}, ["sliding_attention"]),
])
def test_what_gemma3_export_does_not_do_is_named(change, words):
    with pytest.raises(ConfigError) as e:
        LlamaConfig.from_hf_dict(dict(BASE, **dict(GEMMA, **change)))
    for w in words:
        assert w in str(e.value)


def test_the_sliding_masks_appear_only_where_the_window_is_shorter_than_the_context():
    from llama_ane.model import chunk, embeddings
    from llama_ane.model.functions import Layout

    cfg = LlamaConfig.from_hf_dict(dict(BASE, **CASES["gemma3_tied_gqa"]))
    for context, windowed in ((256, True), (32, False)):
        layout = Layout(context, 16, "float16", branch_width=2, suffix_length=8, verify_window=4)
        emb = embeddings.functions(cfg, layout)
        chunks = chunk.functions(cfg, layout, 2)
        for fn, io in chunks.items():
            names = [t["name"] for t in io["inputs"]]
            assert ("cos_local" in names) and ("sin_local" in names)
            sliding = [n for n in names if n.startswith("sliding_")]
            assert bool(sliding) == windowed, (context, fn)
            produced = {t["name"] for t in emb[fn]["outputs"]}
            assert set(names) - {"hidden_states", "k_cache", "v_cache", "k_suffix", "v_suffix"} <= produced


def test_fp16_stream_scale_keeps_gemma_large_activations_finite():
    """A Gemma layer whose MLP products and stream reach past fp16's range (as the published
    checkpoints' do) stays finite in fp16 with the stream scale, and equals fp32."""
    import torch

    from llama_ane.model.chunk import DecoderLayer

    cfg = LlamaConfig.from_hf_dict(dict(BASE, **GEMMA, num_hidden_layers=1))
    torch.manual_seed(0)
    layer = DecoderLayer(cfg, 16, 0)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.normal_(0, 0.5)
        layer.mlp.gate_proj.weight.mul_(40)  # gelu(gate) * up near 1e6 without the scale
        layer.mlp.up_proj.weight.mul_(40 * cfg.stream_scale)  # as the mapping stores it
        layer.o_proj.weight.mul_(cfg.stream_scale)
        layer.post_attention_layernorm.weight.mul_(cfg.stream_scale * 200)  # post-norm weights in the hundreds
        layer.post_feedforward_layernorm.weight.mul_(cfg.stream_scale * 200)
    x = torch.randn(1, 64, 1, 4) * 3e4 * cfg.stream_scale  # a stream near 3e4 unscaled
    cos, sin = torch.ones(1, 32, 1, 4), torch.zeros(1, 32, 1, 4)
    mask = torch.zeros(1, 1, 4, 4).triu(1) * -1e4
    empty = torch.zeros(1, cfg.kv_channels, 1, 0)
    want = layer(x, cos, sin, mask, empty, empty)[0] / cfg.stream_scale
    assert want.abs().max() > 65504  # the unscaled stream would overflow fp16
    got = layer.half()(x.half(), cos.half(), sin.half(), mask.half(), empty.half(), empty.half())[0]
    assert torch.isfinite(got).all()
    assert torch.allclose(got.float() / cfg.stream_scale, want, rtol=2e-2, atol=want.abs().max().item() * 2e-3)
