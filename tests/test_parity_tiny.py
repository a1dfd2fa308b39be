"""Parity of the chunked ANE-layout modules (torch backend, fp32) with transformers' LlamaForCausalLM.

Each tiny random checkpoint is loaded twice from the same folder: by transformers (the reference
implementation) and by `llama_ane.load(..., backend="torch")`, which runs the very modules the
exporter traces, window by window, with the cache written by the cache-update model.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import llama_ane
from conftest import LLAMA3_ROPE
from support.parity import (GREEDY_TOKENS, MAX_LOGIT_DIFF, SEQ_LEN, assert_same_greedy, random_ids,
                            reference_greedy, reference_logits)

pytestmark = pytest.mark.export  # exports or runs models end to end: outside the quick unit tier

# name -> (checkpoint overrides, load options)
CASES = {
    "gqa": ({}, {"prefill_length": 32}),
    "mha": ({"num_key_value_heads": 4}, {"prefill_length": 64}),
    "5_layers_2_per_chunk": ({"num_hidden_layers": 5}, {"prefill_length": 32, "layers_per_chunk": 2}),
    "tied_embeddings": ({"tie_word_embeddings": True}, {"prefill_length": 16, "layers_per_chunk": 1}),
    "untied_embeddings": ({"tie_word_embeddings": False}, {"prefill_length": 32, "layers_per_chunk": 3}),
    "llama3_rope": ({"rope_scaling": dict(LLAMA3_ROPE)}, {"prefill_length": 32}),
    "head_dim_32": ({"head_dim": 32}, {"prefill_length": 32, "layers_per_chunk": 2}),
    "mha_head_dim_8_llama3": ({"num_key_value_heads": 4, "head_dim": 8, "rope_scaling": dict(LLAMA3_ROPE),
                               "num_hidden_layers": 4}, {"prefill_length": 64, "layers_per_chunk": 3}),
}


def reference(folder):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def case(request, tiny_checkpoint):
    overrides, options = CASES[request.param]
    folder = tiny_checkpoint(**overrides)
    model = llama_ane.load(folder, backend="torch", precision="fp32", context_length=256, **options)
    yield folder, model, reference(folder)
    model.close()


def test_the_case_is_what_it_says(case, request):
    """Guard against a config override silently not reaching either model."""
    folder, model, ref = case
    overrides, options = CASES[request.node.callspec.params["case"]]
    cfg = model.manifest["config"]
    for key, value in overrides.items():
        if key == "rope_scaling":
            assert cfg["rope_scaling"]["rope_type"] == "llama3"
            assert (ref.config.rope_parameters or {}).get("rope_type") == "llama3"
        else:
            assert cfg[key] == value
            assert getattr(ref.config, key) == value
    plan = [c["layers"] for c in model.manifest["chunks"]]
    if "layers_per_chunk" in options:
        assert all(len(c) == options["layers_per_chunk"] for c in plan[:-1])
    assert model.manifest["prefill_length"] == options["prefill_length"]
    assert SEQ_LEN > 2 * options["prefill_length"]


def test_logits_match_transformers(case):
    folder, model, ref = case
    ids = random_ids(model.manifest["config"]["vocab_size"], SEQ_LEN, seed=1)
    got = model.score(ids)
    want = reference_logits(ref, ids)
    assert got.dtype == np.float32 and got.shape == want.shape == (SEQ_LEN, model.manifest["config"]["vocab_size"])
    diff = float(np.abs(got - want).max())
    print(f"max |logit diff| = {diff:.2e} (logits up to {np.abs(want).max():.1f})")
    assert diff <= MAX_LOGIT_DIFF
    assert np.abs(want).max() > 1.0  # the comparison is not between near-zero logits


def test_greedy_tokens_match_transformers(case):
    folder, model, ref = case
    prompt = random_ids(model.manifest["config"]["vocab_size"], 40, seed=2)  # more than one prefill window
    want = reference_greedy(ref, prompt, GREEDY_TOKENS)
    got = model.generate(prompt, max_new_tokens=GREEDY_TOKENS, temperature=0.0)
    assert_same_greedy(got, want, model.eos_token_ids)
    assert got.prompt_tokens == len(prompt)


def test_text_prompt_through_the_tokenizer(tiny_checkpoint):
    from transformers import AutoTokenizer

    folder = tiny_checkpoint()
    model = llama_ane.load(folder, backend="torch", precision="fp32", context_length=128, prefill_length=16)
    prompt = "The quick brown fox jumps over the lazy dog."
    ids = AutoTokenizer.from_pretrained(str(folder))(prompt).input_ids
    assert model.encode(prompt) == ids
    want = reference_greedy(reference(folder), ids, 12)
    assert_same_greedy(model.generate(prompt, max_new_tokens=12, raw=True), want, model.eos_token_ids)
    model.close()


def test_converted_export_folder_with_the_torch_backend(tiny_export):
    """The tiny export (5 layers, 2 per chunk, prefill 64, context 256) through its own manifest,
    with the checkpoint's fp32 weights."""
    model = llama_ane.load(tiny_export, backend="torch", checkpoint=load_checkpoint_of(tiny_export))
    assert model.backend.name == "torch"
    assert [c["layers"] for c in model.manifest["chunks"]] == [[0, 1], [2, 3], [4]]
    ref = reference(model.manifest["source"]["path"])
    ids = random_ids(model.manifest["config"]["vocab_size"], SEQ_LEN, seed=3)
    diff = float(np.abs(model.score(ids) - reference_logits(ref, ids)).max())
    print(f"tiny export, torch fp32: max |logit diff| = {diff:.2e}")
    assert diff <= MAX_LOGIT_DIFF
    prompt = ids[:70]
    assert_same_greedy(model.generate(prompt, max_new_tokens=GREEDY_TOKENS),
                       reference_greedy(ref, prompt, GREEDY_TOKENS), model.eos_token_ids)
    model.close()


def test_torch_fp16_stays_close_on_the_tiny_export(tiny_export):
    """The export's own precision (fp16) on torch: looser, but the same argmax almost everywhere."""
    model = llama_ane.load(tiny_export, backend="torch", precision="fp16")
    assert model.backend.dtype == np.float16
    ref = reference(model.manifest["source"]["path"])
    ids = random_ids(model.manifest["config"]["vocab_size"], SEQ_LEN, seed=4)
    got, want = model.score(ids), reference_logits(ref, ids)
    assert np.isfinite(got).all()
    assert float(np.mean(got.argmax(-1) == want.argmax(-1))) >= 0.95
    assert float(np.abs(got - want).max()) < 0.1
    model.close()


def load_checkpoint_of(export):
    from llama_ane.contract.manifest import read_manifest

    return read_manifest(export)["source"]["path"]


def test_a_copied_export_runs_its_own_weights_with_the_torch_backend(tiny_export, tmp_path):
    """Moved away from its checkpoint, an export still runs on the torch backend, from the weights in
    its packages: the same values the mil backend executes, so in fp32 the two agree closely."""
    import shutil

    copy = tmp_path / "moved"
    shutil.copytree(tiny_export, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["source"]["path"] = str(tmp_path / "no-such-checkpoint")  # the checkpoint is gone
    (copy / "manifest.json").write_text(json.dumps(manifest))
    ids = random_ids(manifest["config"]["vocab_size"], 100, seed=5)
    torch_model = llama_ane.load(copy, backend="torch", precision="fp32")
    mil_model = llama_ane.load(copy, backend="mil", precision="fp32")
    try:
        diff = float(np.abs(torch_model.score(ids) - mil_model.score(ids)).max())
    finally:
        torch_model.close()
        mil_model.close()
    print(f"torch (export weights) vs mil, fp32: max |logit diff| = {diff:.2e}")
    assert diff <= MAX_LOGIT_DIFF


@pytest.mark.parametrize("window", [1, 6, 16, 40])
def test_grouped_attention_is_per_head_softmax_attention_in_both_forms(window, monkeypatch):
    """grouped_attention stacks a small window's query heads per kv head and broadcasts a large
    one's (layers.GROUPED_ROWS): both are each head's softmax attention over the cache and the
    window, with the kv head of its group."""
    from llama_ane.model.layers import attention as layers

    g, r, d, t = 2, 3, 8, 20
    gen = torch.Generator().manual_seed(window)
    q, kc, vc = torch.randn(g, r, d, window, generator=gen), torch.randn(g, d, t, generator=gen), torch.randn(g, d, t, generator=gen)
    kw, vw = torch.randn(g, d, window, generator=gen), torch.randn(g, d, window, generator=gen)
    mask = torch.where(torch.rand(1, 1, window, t + window, generator=gen) < 0.3, layers.MASK_VALUE, 0.0)
    expected = torch.empty(g, r, d, window)
    for head in range(g * r):
        kv = head // r
        keys, values = torch.cat([kc[kv], kw[kv]], dim=1), torch.cat([vc[kv], vw[kv]], dim=1)  # (D, T+S)
        p = torch.softmax(q[kv, head % r].T @ keys + mask[0, 0], dim=1)  # (S, T+S)
        expected[kv, head % r] = values @ p.T
    assert (r * window <= layers.GROUPED_ROWS) == (window < 40)  # 40 x 3 rows: broadcast by default
    default = layers.grouped_attention(q, kc, vc, kw, vw, mask, r, t)
    monkeypatch.setattr(layers, "GROUPED_ROWS", 0)
    broadcast = layers.grouped_attention(q, kc, vc, kw, vw, mask, r, t)
    monkeypatch.setattr(layers, "GROUPED_ROWS", 10 ** 6)
    stacked = layers.grouped_attention(q, kc, vc, kw, vw, mask, r, t)
    for out in (default, broadcast, stacked):
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
