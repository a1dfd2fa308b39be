"""Qwen2/2.5, Qwen3 and Mistral checkpoints, end to end on tiny random models of each family.

Each checkpoint is written by transformers' own class of its family (Qwen2ForCausalLM, ...); the
Qwen ones carry a Qwen2-style tokenizer trained in the test (byte-level BPE, no BOS, ChatML). The
torch backend (fp32) is compared with that class on logits and greedy tokens; one fp16 export per
family (shared by a module fixture) is executed by the mil backend against torch fp16, decodes
cascade branches, and passes `inspect --strict`.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import llama_ane
from llama_ane.checkpoint.loader import TOKENIZER_FILES
from llama_ane.config import ConfigError, LlamaConfig
from llama_ane.testing import TINY_CONFIG, make_tiny_checkpoint

import swift_fixtures as sf
from support.checks import (check_cascade, check_gate_reference, check_greedy, check_inspect_strict, check_logits,
                            check_mil_branches, check_mil_fp16, export_tiny, load_fp32, made_once, reference)

pytestmark = pytest.mark.export  # exports or runs models end to end: outside the quick unit tier

QWEN_VOCAB = 960  # the config's vocabulary is padded past the tokenizer's 907 ids, as Qwen's is

# name -> checkpoint overrides (TINY_CONFIG: hidden 64, 4 query heads, 2 kv heads: GQA)
CASES = {
    "qwen2_tied": {"model_type": "qwen2", "tie_word_embeddings": True, "head_dim": 32},
    "qwen2_untied_mha": {"model_type": "qwen2", "num_key_value_heads": 4},
    "qwen3_untied": {"model_type": "qwen3", "head_dim": 64},  # explicit head_dim, not hidden / heads = 16
    "qwen3_tied_attention_bias": {"model_type": "qwen3", "head_dim": 32, "tie_word_embeddings": True,
                                  "attention_bias": True},
    "mistral_untied": {"model_type": "mistral", "head_dim": 32, "sliding_window": 4096},
}
EXPORTED = ["qwen2_tied", "qwen3_untied", "mistral_untied"]  # one export each, shared by the module


def make_family_checkpoint(path, **overrides):
    """A tiny checkpoint of `overrides["model_type"]`; Qwen families get the Qwen2-style tokenizer."""
    qwen = overrides["model_type"].startswith("qwen")
    folder = make_tiny_checkpoint(path, **(dict(vocab_size=QWEN_VOCAB, bos_token_id=None, eos_token_id=None)
                                           if qwen else {}), **overrides)
    if qwen:
        for name in TOKENIZER_FILES:
            (folder / name).unlink(missing_ok=True)
        sf.save_qwen2_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return made_once(tmp_path_factory, CASES, make_family_checkpoint)


# --- the config --------------------------------------------------------------------------------

BASE = dict(TINY_CONFIG, vocab_size=320)


def test_each_family_reads_what_its_block_has():
    qwen2 = LlamaConfig.from_hf_dict(dict(BASE, model_type="qwen2", sliding_window=32768, use_sliding_window=False))
    assert (qwen2.qkv_bias, qwen2.o_proj_bias, qwen2.qk_norm, qwen2.sliding_window) == (True, False, False, None)
    no_head_dim = {k: v for k, v in BASE.items() if k != "head_dim"}
    qwen3 = LlamaConfig.from_hf_dict(dict(no_head_dim, model_type="qwen3"))
    assert (qwen3.qkv_bias, qwen3.qk_norm, qwen3.head_dim) == (False, True, 128)  # transformers' default head_dim
    biased = LlamaConfig.from_hf_dict(dict(BASE, model_type="qwen3", attention_bias=True))
    assert biased.qkv_bias and biased.o_proj_bias
    assert biased.layer_extras == ("q_proj.bias", "k_proj.bias", "v_proj.bias", "o_proj.bias",
                                   "q_norm.weight", "k_norm.weight")
    mistral = LlamaConfig.from_hf_dict(dict(BASE, model_type="mistral", sliding_window=4096))
    assert mistral.sliding_window == 4096 and mistral.layer_extras == ()
    assert LlamaConfig.from_dict(biased.to_dict()) == biased  # the manifest's copy


@pytest.mark.parametrize("d, window", [
    ({"model_type": "qwen2", "sliding_window": 64, "use_sliding_window": True, "max_window_layers": 1}, 64),
    ({"model_type": "qwen2", "sliding_window": 64, "use_sliding_window": True, "max_window_layers": 3}, None),
    ({"model_type": "qwen3", "sliding_window": 64, "use_sliding_window": True,
      "layer_types": ["full_attention", "sliding_attention", "full_attention"]}, 64),
    ({"model_type": "qwen3", "sliding_window": 64, "use_sliding_window": False,
      "layer_types": ["sliding_attention"] * 3}, None),
    ({"model_type": "mistral", "sliding_window": None}, None),
])
def test_sliding_window_as_transformers_reads_it(d, window):
    import transformers

    cfg = LlamaConfig.from_hf_dict(dict(BASE, **d))
    assert cfg.sliding_window == window
    hf = transformers.AutoConfig.for_model(**dict(BASE, **d))
    hf_windowed = getattr(hf, "sliding_window", None) is not None and (
        d["model_type"] == "mistral" or "sliding_attention" in hf.layer_types)
    assert hf_windowed == (window is not None)


@pytest.mark.parametrize("change, words", [
    ({"model_type": "qwen2_moe"}, ["'qwen2_moe'", "'llama'", "'mistral'", "'qwen2'", "'qwen3'"]),
    ({"model_type": "qwen2", "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, ["RoPE", "'yarn'"]),
    ({"model_type": "qwen3", "mlp_bias": True}, ["mlp_bias"]),
])
def test_what_the_export_does_not_do_is_named(change, words):
    with pytest.raises(ConfigError) as e:
        LlamaConfig.from_hf_dict(dict(BASE, **change))
    for w in words:
        assert w in str(e.value)


def test_a_sliding_window_shorter_than_the_context_exports(tmp_path):
    """A window shorter than --context-length is no longer refused: the export's sliding layers read a
    mask of their own (tests/test_gemma3.py holds such a Mistral model to transformers' class)."""
    folder = make_tiny_checkpoint(tmp_path / "mistral", model_type="mistral", sliding_window=128,
                                  num_hidden_layers=1)
    model = llama_ane.load(folder, backend="torch", context_length=256, prefill_length=32)
    prefill = model.manifest["models"]["chunk_0"]["functions"]["prefill"]
    assert "sliding_mask" in [t["name"] for t in prefill["inputs"]]
    model.close()
    within = llama_ane.load(folder, backend="torch", context_length=128, prefill_length=32)  # the window holds all
    assert "sliding_mask" not in [t["name"] for t in within.manifest["models"]["chunk_0"]["functions"]["prefill"]
                                  ["inputs"]]
    within.close()


# --- torch fp32 against transformers' own class -------------------------------------------------

@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def case(request, checkpoints):
    folder = checkpoints(request.param)
    model = load_fp32(folder)
    yield request.param, model, reference(folder, CASES[request.param]["model_type"])
    model.close()


def token_range(model) -> int:
    """Ids below this are ordinary tokens of the model's tokenizer (not special, not padding rows)."""
    return min(model.manifest["config"]["vocab_size"], 880)


def test_logits_match_the_family_class(case):
    name, model, ref = case
    check_logits(name, model, ref, CASES[name]["model_type"], token_range(model))


def test_greedy_tokens_match_the_family_class(case):
    name, model, ref = case
    check_greedy(model, ref, token_range(model), 40)


def test_the_gate_builds_the_family_reference(case, checkpoints):
    name, model, ref = case
    check_gate_reference(name, checkpoints(name), ref, token_range(model))


def test_cascade_branches_equal_decoding_alone(checkpoints):
    for name in ("qwen2_tied", "qwen3_tied_attention_bias", "mistral_untied"):
        check_cascade(name, checkpoints(name))


# --- one fp16 export per family -----------------------------------------------------------------

@pytest.fixture(scope="module", params=EXPORTED, ids=EXPORTED)
def export(request, checkpoints, tmp_path_factory):
    return request.param, export_tiny(checkpoints(request.param), tmp_path_factory.mktemp("export") / request.param)


def test_the_manifest_records_the_family_and_its_weights(export):
    from llama_ane.contract.manifest import read_manifest
    from llama_ane.mil.weights import read_weights

    name, out = export
    manifest = read_manifest(out)
    cfg = manifest["config"]
    assert cfg["model_type"] == CASES[name]["model_type"]
    entry = manifest["models"]["chunk_0"]["functions"]["prefill"]
    extras = LlamaConfig.from_dict(cfg).layer_extras
    assert extras == {"qwen2_tied": ("q_proj.bias", "k_proj.bias", "v_proj.bias"),
                      "qwen3_untied": ("q_norm.weight", "k_norm.weight"), "mistral_untied": ()}[name]
    names = [f"layers_0_{e.replace('.', '_')}" for e in extras]
    weights = read_weights(out / entry["file"], entry["function_name"], names)
    for n in names:
        assert np.isfinite(weights[n]).all() and np.abs(weights[n]).max() > 0, n


def test_inspect_strict_passes(export):
    check_inspect_strict(export[1])


def test_mil_fp16_matches_torch_fp16(export):
    check_mil_fp16(*export, top1=0.99)


def test_mil_decode_branches_match_decoding_alone(export):
    check_mil_branches(*export)


# --- Qwen's tokenizer and ChatML in Python ------------------------------------------------------

def test_qwen_tokenizer_and_chatml_as_transformers(export):
    from transformers import AutoTokenizer

    name, out = export
    if not name.startswith("qwen"):
        pytest.skip("the Qwen tokenizer is on the Qwen exports")
    hf = AutoTokenizer.from_pretrained(str(out))
    model = llama_ane.load(out, backend="torch")
    tok = model.manifest["tokenizer"]
    assert tok["bos_token_id"] is None and tok["add_bos_token"] is False  # Qwen adds no BOS
    assert hf.convert_tokens_to_ids("<|im_end|>") in model.eos_token_ids
    for text in sf._case_strings(sf.QWEN2_SPECIALS + sf.QWEN2_PLAIN_ADDED, seed=7):
        assert model.encode(text) == hf(text).input_ids, text
    question = "What is 2+2? 👋"
    want = hf.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                  tokenize=False)
    assert want.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")
    ids = model.encode(question, chat=True)
    assert hf.decode(ids) == want
    assert ids == hf(want, add_special_tokens=False).input_ids
    out_text = model.generate(question, max_new_tokens=4, temperature=0.0)
    assert out_text.prompt_tokens == len(ids)
    model.close()


def test_chat_template_in_the_manifest_is_the_checkpoints(export):
    name, out = export
    manifest = json.loads((out / "manifest.json").read_text())
    template = manifest["tokenizer"]["chat_template"]
    if name.startswith("qwen"):
        assert template == sf.QWEN2_CHATML_TEMPLATE
    else:
        assert template and "<|im_start|>" in template


def test_the_gpu_engine_refuses_to_decode_past_a_sliding_window(tmp_path):
    """The GPU kernels attend to every cached token, so a Mistral sequence longer than its window is
    refused (before any kernel runs) rather than decoded wrongly; qwen3 is refused by name."""
    import transformers

    from llama_ane.cuda.engine import GPUEngine
    from llama_ane.testing import make_tiny_checkpoint

    mistral = transformers.AutoModelForCausalLM.from_pretrained(
        make_tiny_checkpoint(tmp_path / "mistral", model_type="mistral", sliding_window=48))
    engine = GPUEngine(mistral, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="sliding_window 48"):
        engine.generate(list(range(3, 40)), [[5, 6]], max_new_tokens=16)
    qwen3 = transformers.AutoModelForCausalLM.from_pretrained(
        make_tiny_checkpoint(tmp_path / "qwen3", model_type="qwen3", head_dim=32))
    with pytest.raises(ValueError, match="qwen3"):
        GPUEngine(qwen3, dtype=torch.float32, device="cpu")
