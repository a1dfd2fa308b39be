"""LlamaConfig: reading config.json (transformers 4 and 5 styles), validation, RoPE frequencies."""

from __future__ import annotations

import pytest
import torch

from llama_ane.config import ConfigError, LlamaConfig, inv_freq
from llama_ane.testing import TINY_CONFIG

from conftest import LLAMA3_ROPE

BASE = dict(TINY_CONFIG, vocab_size=320, bos_token_id=1, eos_token_id=2)


def test_reads_the_fields_we_use_and_drops_the_rest():
    cfg = LlamaConfig.from_hf_dict(dict(BASE, torch_dtype="float32", use_cache=True))
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers) == (320, 64, 3)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 2, 16)
    assert cfg.eos_token_id == [2]
    assert cfg.rope_scaling is None
    assert cfg.kv_channels == 32 and cfg.q_channels == 64


def test_defaults_for_missing_optional_fields():
    d = {k: v for k, v in BASE.items() if k not in ("head_dim", "num_key_value_heads", "eos_token_id")}
    cfg = LlamaConfig.from_hf_dict(d)
    assert cfg.num_key_value_heads == cfg.num_attention_heads  # MHA when absent
    assert cfg.head_dim == 64 // 4
    assert cfg.eos_token_id == []


def test_explicit_head_dim_is_kept():
    cfg = LlamaConfig.from_hf_dict(dict(BASE, head_dim=32))
    assert cfg.head_dim == 32 and cfg.q_channels == 128 and cfg.kv_channels == 64


def test_eos_list_is_kept():
    assert LlamaConfig.from_hf_dict(dict(BASE, eos_token_id=[2, 7])).eos_token_id == [2, 7]


def test_rope_scaling_transformers4_and_transformers5_styles_agree():
    v4 = LlamaConfig.from_hf_dict(dict(BASE, rope_theta=500000.0, rope_scaling=dict(LLAMA3_ROPE)))
    no_theta = {k: v for k, v in BASE.items() if k != "rope_theta"}
    v5 = LlamaConfig.from_hf_dict(dict(no_theta, rope_parameters=dict(LLAMA3_ROPE, rope_theta=500000.0)))
    assert v4 == v5
    assert v4.rope_theta == 500000.0
    assert v4.rope_scaling["rope_type"] == "llama3" and v4.rope_scaling["factor"] == 8.0



@pytest.mark.parametrize("family, rope", [
    ("LlamaConfig", {"rope_type": "default", "rope_theta": 500000.0}),
    ("Gemma3TextConfig", {"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                          "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}),
])
def test_rope_parameters_base_wins_over_a_top_level_rope_theta(family, rope):
    """A config.json with both a top-level rope_theta and rope_parameters is read as transformers 5
    reads it: the base in rope_parameters, whatever the top-level key says."""
    import transformers

    hf = getattr(transformers, family)
    theirs = hf.from_dict({"rope_theta": 1234.0, "rope_parameters": rope}).rope_parameters
    d = {**BASE, "model_type": hf.model_type, "rope_theta": 1234.0, "rope_parameters": rope}
    ours = LlamaConfig.from_hf_dict(d)
    assert ours.rope_theta == theirs.get("full_attention", theirs)["rope_theta"] != 1234.0

def test_old_type_key_and_default_rope_type():
    cfg = LlamaConfig.from_hf_dict(dict(BASE, rope_scaling={"type": "linear", "factor": 2.0}))
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    plain = LlamaConfig.from_hf_dict(dict(BASE, rope_parameters={"rope_type": "default", "rope_theta": 1e4}))
    assert plain.rope_scaling is None


@pytest.mark.parametrize("change, words", [
    ({"model_type": "gpt2"}, ["model_type", "gpt2", "supported"]),
    ({"model_type": None}, ["model_type"]),
    ({"hidden_act": "gelu"}, ["hidden_act", "gelu"]),
    ({"model_type": "qwen2_moe"}, ["qwen2_moe", "supported", "'qwen2'", "'qwen3'", "'mistral'"]),
    ({"mlp_bias": True}, ["bias"]),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, ["RoPE", "yarn"]),
    ({"num_key_value_heads": 3}, ["num_key_value_heads", "multiple"]),
    ({"head_dim": 15}, ["head_dim", "even"]),
    ({"num_hidden_layers": 0}, ["num_hidden_layers", "positive"]),
])
def test_unsupported_configs_are_refused_with_a_reason(change, words):
    with pytest.raises(ConfigError) as e:
        LlamaConfig.from_hf_dict(dict(BASE, **change))
    for w in words:
        assert w in str(e.value)


def test_missing_required_fields_are_named():
    d = {k: v for k, v in BASE.items() if k not in ("vocab_size", "intermediate_size")}
    with pytest.raises(ConfigError, match="vocab_size, intermediate_size"):
        LlamaConfig.from_hf_dict(d)


def test_manifest_round_trip():
    cfg = LlamaConfig.from_hf_dict(dict(BASE, rope_scaling=dict(LLAMA3_ROPE), tie_word_embeddings=True))
    assert LlamaConfig.from_dict(dict(cfg.to_dict(), unknown_key=1)) == cfg


def test_to_hf_dict_builds_the_same_transformers_config():
    from transformers import LlamaConfig as HFLlamaConfig

    cfg = LlamaConfig.from_hf_dict(dict(BASE, head_dim=24, rope_scaling=dict(LLAMA3_ROPE)))
    hf = HFLlamaConfig(**cfg.to_hf_dict())
    assert LlamaConfig.from_hf_dict(hf.to_dict()) == cfg


def _transformers_inv_freq(d: dict) -> torch.Tensor:
    from transformers import LlamaConfig as HFLlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = HFLlamaConfig(**d)
    rope_type = (d.get("rope_scaling") or {}).get("rope_type", "default")
    if rope_type == "default":
        dim = hf.head_dim
        theta = d.get("rope_theta", 10000.0)
        return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    inv, _ = ROPE_INIT_FUNCTIONS[rope_type](hf, "cpu")
    return inv.double()


@pytest.mark.parametrize("extra", [
    {},
    {"rope_theta": 500000.0, "head_dim": 32},
    {"rope_scaling": dict(LLAMA3_ROPE)},
    {"rope_scaling": dict(LLAMA3_ROPE, original_max_position_embeddings=8192), "rope_theta": 500000.0,
     "head_dim": 64, "hidden_size": 256},
    {"rope_scaling": {"rope_type": "linear", "factor": 4.0}},
])
def test_inv_freq_matches_transformers(extra):
    d = dict(BASE, **extra)
    ours = torch.tensor(inv_freq(LlamaConfig.from_hf_dict(d)), dtype=torch.float64)
    want = _transformers_inv_freq(d)
    assert ours.shape == want.shape
    torch.testing.assert_close(ours, want, rtol=1e-6, atol=0)


def test_llama3_scaling_changes_low_frequencies_only():
    plain = inv_freq(LlamaConfig.from_hf_dict(BASE))
    scaled = inv_freq(LlamaConfig.from_hf_dict(dict(BASE, rope_scaling=dict(LLAMA3_ROPE))))
    assert scaled[0] == plain[0]  # the highest frequency is kept
    assert scaled[-1] == pytest.approx(plain[-1] / LLAMA3_ROPE["factor"])
