"""SmolLM3, Granite 3.x and SWA, OLMo 2 and 3, OLMo-Hybrid, Falcon-H1, EXAONE 4.0, Phi-3/3.5/4-mini, Gemma 3 and 4
(text), LFM2, LFM3 and Qwen3.5 (text) checkpoints, and a Mistral window shorter than the context, end to
end on tiny random models.

Each checkpoint is written by transformers' own class of its family (SmolLM3ForCausalLM, ...)
with the tiny test tokenizer and a small chat template in the family's style, written here. The
torch backend (fp32) is compared with that class on logits and greedy tokens; one fp16 export per
family is executed by the mil backend against torch fp16 and passes `inspect --strict`; cascade
branches decode as each branch alone.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from llama_ane.config import ConfigError, LlamaConfig
from llama_ane.testing import TINY_CONFIG, make_tiny_checkpoint

from support.checks import (check_cascade, check_gate_reference, check_greedy, check_inspect_strict, check_logits,
                            check_mil_ane_numerics, check_mil_branches, check_mil_fp16, export_tiny, load_fp32,
                            made_once, reference)
from support.families import CASES, TEMPLATES, longrope, make_family_checkpoint

pytestmark = pytest.mark.export  # exports or runs models end to end: outside the quick unit tier

# of the cases (support/families.py: name -> checkpoint overrides)
EXPORTED = ["smollm3_tied", "granite_tied", "olmo2_untied", "phi3_untied_longrope_short", "gemma3_tied_gqa",
            "mistral_window", "lfm2_tied_gqa", "gemma4_tied_gqa_k_eq_v", "gemma4_wide_global",
            "qwen35_untied_mha", "olmo3_tied_gqa", "exaone4_tied_gqa",
            "granite_swa_tied_gqa", "lfm3_tied_gqa",
            "olmo_hybrid_tied_gqa", "falcon_h1_tied_gqa"]  # one fp16 export each
CASCADE = ["smollm3_untied_mha", "granite_tied", "olmo2_tied_mha_attention_bias", "phi3_tied_mha_longrope_long",
           "gemma3_untied_mha", "mistral_window", "lfm2_tied_mha_conv_bias", "gemma4_untied_mha", "gemma4_wide_global",
           "gemma4_kv_shared", "qwen35_tied_gqa", "olmo3_untied_mha_attention_bias",
           "exaone4_untied_mha_no_window", "granite_swa_untied_mha", "lfm3_untied_mha_bias",
           "olmo_hybrid_untied_mha_nope", "falcon_h1_untied_mha"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return made_once(tmp_path_factory, CASES, make_family_checkpoint)


# --- the config --------------------------------------------------------------------------------

BASE = dict(TINY_CONFIG, vocab_size=320)


def test_smollm3_layers_without_rope_as_transformers_reads_them():
    import transformers

    for extra in ({"no_rope_layers": [1, 0, 0]}, {"no_rope_layer_interval": 2}, {}):
        d = dict(BASE, model_type="smollm3", num_hidden_layers=3, **extra)
        cfg = LlamaConfig.from_hf_dict(d)
        hf = transformers.AutoConfig.for_model(**d)
        assert [cfg.rotary(n) for n in range(3)] == [bool(v) for v in hf.no_rope_layers], extra
        assert LlamaConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg  # the manifest's copy
        assert transformers.AutoConfig.for_model(**cfg.to_hf_dict()).no_rope_layers == hf.no_rope_layers


@pytest.mark.parametrize("change, words", [
    ({"model_type": "smollm3", "no_rope_layers": [1, 0]}, ["no_rope_layers", "num_hidden_layers (3)"]),
    ({"model_type": "smollm3", "no_rope_layers": [1, 2, 1]}, ["no_rope_layers", "1 (the layer uses RoPE)"]),
    ({"model_type": "smollm3", "no_rope_layers": "1,0,1"}, ["no_rope_layers", "the string"]),
    ({"model_type": "smollm3", "no_rope_layer_interval": 0}, ["no_rope_layer_interval", "positive"]),
    ({"model_type": "granite", "embedding_multiplier": 0}, ["embedding_multiplier", "positive"]),
    ({"model_type": "granite", "logits_scaling": "8"}, ["logits_scaling", "the string"]),
    ({"model_type": "granite", "attention_multiplier": -1.0}, ["attention_multiplier", "positive"]),
    ({"model_type": "granitemoe"}, ["'granitemoe'", "'granite'"]),
    ({"model_type": "phi3", "partial_rotary_factor": 0.7}, ["partial_rotary_factor", "even"]),
    ({"model_type": "phi3", "partial_rotary_factor": 1.5}, ["partial_rotary_factor", "(0, 1]"]),
    ({"model_type": "phi3", "rope_scaling": dict(longrope(8), long_factor=[1.0, "2"])}, ["long_factor", "numbers"]),
    ({"model_type": "phi3", "rope_scaling": longrope(3)}, ["short_factor", "rotary_dim / 2 = 8"]),
    ({"model_type": "phi3", "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 8}}, ["long_factor"]),
    ({"model_type": "phi3", "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, ["'llama3'", "'phi3'"]),
    ({"model_type": "llama", "rope_scaling": longrope(8)}, ["'longrope'", "'llama'"]),
    ({"model_type": "phimoe"}, ["'phimoe'", "mixture-of-experts", "'phi3'"]),
    ({"model_type": "qwen3_5"}, ["'qwen3_5'", "unsupported", "Gated DeltaNet"]),
    ({"model_type": "gemma3"}, ["'gemma3'", "unsupported", "language_model", "'gemma3_text'"]),
    ({"model_type": "gemma4"}, ["'gemma4'", "unsupported", "language_model", "'gemma4_text'"]),
    ({"model_type": "gemma4_text", "global_head_dim": 16, "num_kv_shared_layers": 1}, ["num_kv_shared_layers"]),
    ({"model_type": "lfm2", "layer_types": ["conv", "sliding_attention", "conv"]}, ["layer_types", "\"conv\""]),
    ({"model_type": "lfm2", "full_attn_idxs": [0], "conv_L_cache": 1}, ["conv_L_cache", ">= 2"]),
    ({"model_type": "lfm3", "use_sandwich_norm": False}, ["use_sandwich_norm is false", "true"]),
    ({"model_type": "lfm3", "layer_types": ["conv", "sliding_attention", "conv"], "sliding_window": None},
     ["sliding_window is null", "set sliding_window"]),
    ({"model_type": "lfm3", "layer_types": ["conv", "linear_attention", "conv"]},
     ["layer_types", '"conv", "sliding_attention" or "full_attention"']),
    ({"model_type": "lfm3", "rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 2.0}}},
     ["rope_parameters.full_attention", "'yarn'", "proportional"]),
    ({"model_type": "lfm3", "layer_types": ["conv", "sliding_attention", "full_attention"],
      "rope_parameters": {"full_attention": {"rope_type": "default"}}}, ["rope_parameters", "sliding_attention"]),
    ({"model_type": "lfm3", "rope_parameters": {"full_attention": {"rope_type": "default", "partial_rotary_factor": 0.5}}},
     ["partial_rotary_factor", "proportional"]),
    ({"model_type": "qwen3_5_text", "linear_num_value_heads": 3}, ["linear_num_value_heads", "multiple"]),
    ({"model_type": "granite_swa", "layer_rope_theta": [10_000.0, 10_000.0, 20_000.0]},
     ["layer_rope_theta", "sliding layers the bases [10000.0, 20000.0]"]),
    ({"model_type": "granite_swa", "layer_rope_theta": [10_000.0]}, ["layer_rope_theta", "a list of 1", "(3)"]),
    ({"model_type": "granite_swa", "rope_scaling": {"rope_type": "linear", "factor": 2.0}}, ["'linear'", "'granite_swa'"]),
    ({"model_type": "exaone4", "sliding_window": 16, "sliding_window_pattern": "LLG"},
     ["sliding_window_pattern", "add layer_types"]),
])
def test_family_fields_are_checked(change, words):
    with pytest.raises(ConfigError) as e:
        LlamaConfig.from_hf_dict(dict(BASE, **change))
    for w in words:
        assert w in str(e.value)


def test_granite_multipliers_as_transformers_reads_them():
    import transformers

    d = dict(BASE, model_type="granite", embedding_multiplier=12.0, residual_multiplier=0.22,
             attention_multiplier=0.0078125, logits_scaling=16.0)
    cfg = LlamaConfig.from_hf_dict(d)
    assert (cfg.embedding_multiplier, cfg.residual_multiplier, cfg.query_scale, cfg.logits_scaling) == (
        12.0, 0.22, 0.0078125, 16.0)
    assert LlamaConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    hf = transformers.AutoConfig.for_model(**cfg.to_hf_dict())
    assert (hf.embedding_multiplier, hf.residual_multiplier, hf.attention_multiplier, hf.logits_scaling) == (
        12.0, 0.22, 0.0078125, 16.0)
    plain = LlamaConfig.from_hf_dict(dict(BASE, model_type="granite"))  # GraniteConfig's defaults: all 1.0
    assert plain.query_scale == transformers.GraniteConfig().attention_multiplier == 1.0
    assert LlamaConfig.from_hf_dict(dict(BASE, model_type="llama")).query_scale == 16 ** -0.5


def test_olmo2_block_as_transformers_builds_it():
    """OLMo 2's layer has no input norm, a norm after its MLP, and q/k norms across all heads: the
    parameters and shapes an export reads are those of transformers' Olmo2DecoderLayer."""
    import transformers

    from llama_ane.checkpoint.mapping import expected_tensors

    d = dict(BASE, model_type="olmo2", num_hidden_layers=1, attention_bias=True)
    cfg = LlamaConfig.from_hf_dict(d)
    assert (cfg.post_norms, cfg.qk_norm, cfg.qk_norm_across_heads, cfg.input_norm) == (True, True, True, False)
    assert LlamaConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**cfg.to_hf_dict()))
    theirs = {name: tuple(p.shape) for name, p in model.named_parameters()}
    ours = {name: tuple(getattr(cfg, dim) for dim in dims) for name, dims in expected_tensors(cfg).items()}
    assert ours == theirs
    qwen3 = LlamaConfig.from_hf_dict(dict(BASE, model_type="qwen3"))
    assert (qwen3.post_norms, qwen3.qk_norm_across_heads, qwen3.q_norm_channels) == (False, False, 16)


def test_phi3_fields_as_transformers_reads_them():
    """Phi-3's fused tensors, partial rotary and longrope as transformers' Phi3Config and model have them;
    the old rope type name "su" and the transformers 5 form (rope_parameters) read the same."""
    import transformers

    from llama_ane.checkpoint.mapping import expected_tensors

    d = dict(BASE, model_type="phi3", num_hidden_layers=1, partial_rotary_factor=0.75, max_position_embeddings=8192,
             original_max_position_embeddings=4096, rope_scaling=longrope(6))
    cfg = LlamaConfig.from_hf_dict(d)
    assert (cfg.fused_projections, cfg.rotary_dim, cfg.rope_scaling["rope_type"]) == (True, 12, "longrope")
    assert cfg.rope_scaling["original_max_position_embeddings"] == 4096
    assert LlamaConfig.from_hf_dict(dict(d, rope_scaling=dict(longrope(6), type="su"))) == cfg
    v5 = {k: v for k, v in d.items() if k not in ("rope_scaling", "partial_rotary_factor", "rope_theta")}
    v5["rope_parameters"] = dict(longrope(6), rope_theta=10000.0, partial_rotary_factor=0.75)
    assert LlamaConfig.from_hf_dict(v5) == cfg
    assert LlamaConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    hf = cfg.transformers_config()
    hf.pad_token_id = None  # Phi3Config's default (32000) is outside this vocabulary
    model = transformers.AutoModelForCausalLM.from_config(hf)
    theirs = {name: tuple(p.shape) for name, p in model.named_parameters()}
    ours = {name: tuple(getattr(cfg, dim) for dim in dims) for name, dims in expected_tensors(cfg).items()}
    assert ours == theirs


@pytest.mark.parametrize("field, value", [
    ("nope_layers", "1,2"), ("nope_layers", [5]), ("post_norms", "yes"), ("fused_projections", 1),
    ("partial_rotary_factor", "0.5"), ("embedding_multiplier", -2.0), ("attention_scale", "x"),
    ("rope_scaling", "longrope"), ("rope_scaling", {"rope_type": "longrope", "short_factor": 3, "long_factor": []}),
])
def test_a_manifest_config_with_a_bad_family_field_is_refused(field, value):
    """The manifest's copy of the config is untrusted too: each new field is checked when read back."""
    good = LlamaConfig.from_hf_dict(dict(BASE, model_type="phi3")).to_dict()
    with pytest.raises(ConfigError, match=field.split("_")[0]):
        LlamaConfig.from_dict(dict(good, **{field: value}))


@pytest.mark.parametrize("tokens", [100, 4096, 5000])
def test_longrope_tables_are_transformers_rotary_embedding(tokens):
    """The tables equal Phi3RotaryEmbedding's cos/sin on a sequence of `tokens` (short factors up to
    original_max_position_embeddings 4096, long past it), the unrotated channels at cos 1, sin 0; an
    export of `tokens` whose tables run longer (the prefill window past the context) keeps its factors."""
    import transformers

    from llama_ane.model.embeddings import rope_tables

    cfg = LlamaConfig.from_hf_dict(dict(BASE, model_type="phi3", partial_rotary_factor=0.75,
                                        max_position_embeddings=16384, rope_scaling=longrope(6)))
    rope = transformers.models.phi3.modeling_phi3.Phi3RotaryEmbedding(config=cfg.transformers_config())
    want_cos, want_sin = (t[0] for t in rope(torch.zeros(1), torch.arange(tokens)[None]))
    cos, sin = rope_tables(cfg, tokens)
    assert torch.equal(cos[:, :12], want_cos) and torch.equal(sin[:, :12], want_sin)
    assert (cos[:, 12:] == 1).all() and (sin[:, 12:] == 0).all()
    longer_cos, _ = rope_tables(cfg, tokens + 64, context_length=tokens)
    assert torch.equal(longer_cos[:tokens], cos)


def test_a_fused_tensor_of_the_wrong_shape_is_named(tmp_path):
    """A Phi-3 checkpoint whose config disagrees with its fused qkv_proj: one line naming the tensor,
    its shape, the shape the config gives it and how."""
    from llama_ane.checkpoint.loader import CheckpointError, load_checkpoint

    folder = make_tiny_checkpoint(tmp_path / "phi3", model_type="phi3", num_hidden_layers=1)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(config, num_key_value_heads=4)))
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(folder)
    for words in ("'model.layers.0.self_attn.qkv_proj.weight'", "[128, 64]", "[192, 64]",
                  "(num_attention_heads+2*num_key_value_heads)*head_dim"):
        assert words in str(e.value)


# --- torch fp32 against transformers' own class -------------------------------------------------

@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def case(request, checkpoints):
    from llama_ane.reference import recurrent_delta_rule

    folder = checkpoints(request.param)
    model = load_fp32(folder)
    model_type = CASES[request.param]["model_type"]
    with recurrent_delta_rule(model_type):  # Qwen3.5's reference: transformers' token-by-token delta rule
        yield request.param, model, reference(folder, model_type)
    model.close()


def test_logits_match_the_family_class(case):
    name, model, ref = case
    check_logits(name, model, ref, CASES[name]["model_type"], model.manifest["config"]["vocab_size"])


def test_greedy_tokens_match_the_family_class(case):
    name, model, ref = case
    check_greedy(model, ref, model.manifest["config"]["vocab_size"], 160)  # past 150 tokens of context


def test_the_gate_builds_the_family_reference(case, checkpoints):
    name, model, ref = case
    check_gate_reference(name, checkpoints(name), ref, model.manifest["config"]["vocab_size"])


def test_chat_template_applies_as_transformers(case, checkpoints):
    from transformers import AutoTokenizer

    name, model, _ = case
    hf = AutoTokenizer.from_pretrained(str(checkpoints(name)))
    messages = [{"role": "user", "content": "Caches hold keys and values?"}]
    assert model.manifest["tokenizer"]["chat_template"] == TEMPLATES[CASES[name]["model_type"]]
    want = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = model.encode(messages[0]["content"], chat=True)
    assert hf.decode(ids) == want
    assert ids == hf(want, add_special_tokens=False).input_ids


def test_cascade_branches_equal_decoding_alone(checkpoints):
    for name in CASCADE:
        check_cascade(name, checkpoints(name))


# --- one fp16 export per family -----------------------------------------------------------------

@pytest.fixture(scope="module", params=EXPORTED, ids=EXPORTED)
def export(request, checkpoints, tmp_path_factory):
    return request.param, export_tiny(checkpoints(request.param), tmp_path_factory.mktemp("export") / request.param)


def test_inspect_strict_passes(export):
    check_inspect_strict(export[1])


def test_mil_fp16_matches_torch_fp16(export):
    check_mil_fp16(*export, top1=0.98)


def test_mil_with_the_ane_numerics(export):
    check_mil_ane_numerics(*export)


def test_mil_decode_branches_match_decoding_alone(export):
    check_mil_branches(*export)


@pytest.mark.parametrize("position", [0, 30, 100, 200])
def test_the_exported_sliding_mask_hides_what_is_outside_the_window(export, position):
    """The sliding layers read a mask over their ring's slots that sees exactly the slots holding
    keys in (p - window, p] of each query p (slot j holds the latest position below p that is j
    modulo the ring's length), and the full layers one that sees every earlier key: made by the
    host where the prefill window decodes (the default), by the exported embeddings (mil) else."""
    import llama_ane

    name, out = export
    if "sliding_window" not in CASES[name]:
        pytest.skip("the windowed exports")
    model = llama_ane.load(out, backend="mil")
    window, ring = model.manifest["config"]["sliding_window"], model.manifest["cache"]["sliding"]["length"]
    assert window < ring < model.manifest["context_length"] and ring % 32 == 0
    if model.pipeline.masks is not None:
        emb = model.pipeline.host_inputs("prefill", position, model.manifest["prefill_length"])
    else:
        emb = model.pipeline.embed("decode", {"input_ids": np.array([[5]], np.int32),
                                              "position": np.array([position], np.int32)})
    t = model.manifest["context_length"]
    held = np.array([max([q for q in range(position) if q % ring == j], default=-1) for j in range(ring)])
    sees = emb["sliding_mask"][0, 0, 0, :ring + 1] == 0  # the ring's slots, then the query itself
    assert (sees == np.r_[(held >= 0) & (held > position - window), True]).all()
    cached = np.r_[np.arange(t) < position, True]  # the cache below the query, then the query itself
    assert ((emb["mask"][0, 0, 0, :t + 1] == 0) == cached).all()
    model.close()
