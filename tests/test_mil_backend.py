"""The mil backend on real exports: every function of every package against the torch backend,
teacher-forced logits over real text, greedy generation on SmolLM2, decode-step time, and (on
macOS) Core ML against mil. Fixtures `tiny_export` and `smollm2_export` come from conftest."""

from __future__ import annotations

import time

import numpy as np
import pytest

import llama_ane
from llama_ane.verify import compare_logits, default_text
from llama_ane.runtime.backends.base import BackendError
from llama_ane.runtime.backends.mil_backend import MilBackend
from conftest import convert_to
from support.checks import mil_vs_torch_fp16_on_text

ct = pytest.importorskip("coremltools")


def function_inputs(manifest: dict, model: str, function: str, seed: int = 0) -> dict[str, np.ndarray]:
    """Valid random inputs for one manifest function (ids in the vocabulary, positions in range)."""
    rng = np.random.default_rng(seed)
    entry = manifest["models"][model]["functions"][function]
    vocab = manifest["config"]["vocab_size"]
    feeds = {}
    for spec in entry["inputs"]:
        name, shape = spec["name"], tuple(spec["shape"])
        if spec["dtype"] == "int32":
            if "ids" in name:
                feeds[name] = rng.integers(0, vocab, shape).astype(np.int32)
            else:  # position, positions, prefix_length, suffix_positions
                feeds[name] = (5 + np.arange(int(np.prod(shape)))).reshape(shape).astype(np.int32)
        elif "mask" in name:
            feeds[name] = np.where(rng.random(shape) < 0.3, -1e4, 0.0).astype(np.float32)
        elif name in ("cos", "sin"):
            feeds[name] = rng.uniform(-1, 1, shape).astype(np.float32)
        else:
            feeds[name] = rng.standard_normal(shape).astype(np.float32)
    return feeds


def all_functions(manifest):
    return [(m, f) for m, e in manifest["models"].items() for f in e["functions"]]


@pytest.mark.parametrize("precision,tolerance", [("fp32", 2e-2), ("fp16", 6e-2)])
def test_every_function_of_every_package_matches_torch(tiny_export, precision, tolerance):
    torch_model = llama_ane.load(tiny_export, backend="torch", precision=precision)
    mil = MilBackend(tiny_export, torch_model.manifest, precision=precision)
    functions = all_functions(torch_model.manifest)
    assert {f for _, f in functions} >= {"prefill", "decode", "decode_branches"}
    for model, function in functions:
        feeds = function_inputs(torch_model.manifest, model, function)
        torch_feeds = {k: v if v.dtype == np.int32 else v.astype(torch_model.backend.dtype) for k, v in feeds.items()}
        want = torch_model.backend.predict(model, function, torch_feeds)
        got = mil.predict(model, function, feeds)
        assert list(got) == list(want), (model, function)
        for name in want:
            g, w = got[name].astype(np.float32), want[name].astype(np.float32)
            assert g.shape == w.shape
            scale = max(1.0, float(np.abs(w).max()))
            err = float(np.abs(g - w).max())
            assert err <= tolerance * scale, f"{model}/{function} {name}: max |diff| {err:.4g} (scale {scale:.3g})"
    # the functions of each package were compiled from one load of it
    assert len(mil._executors) == len({e["file"] for m in torch_model.manifest["models"].values()
                                       for e in m["functions"].values()})


def test_tiny_mil_fp16_matches_torch_fp16_on_real_text(tiny_export):
    c = mil_vs_torch_fp16_on_text(tiny_export, "tiny")
    assert c.top1_agreement >= 0.99
    assert c.mean_cosine > 0.999


TINY_VARIANTS = {
    "mha-tied": {"num_key_value_heads": 4, "tie_word_embeddings": True},
    "llama3-rope": {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
}


@pytest.mark.slow
@pytest.mark.parametrize("variant", sorted(TINY_VARIANTS))
def test_tiny_variants_mil_fp16_match_torch_fp16_on_real_text(variant, tiny_checkpoint, tmp_path):
    from llama_ane.api import export_model

    out = export_model(tiny_checkpoint(**TINY_VARIANTS[variant]), tmp_path / variant, context_length=256,
                       prefill_length=64, progress=False, verify=False)
    c = mil_vs_torch_fp16_on_text(out, f"tiny {variant}")
    assert c.top1_agreement >= 0.99
    assert c.mean_cosine > 0.999


def test_unknown_op_through_the_backend_names_op_and_package(tmp_path):
    from coremltools.converters.mil import Builder as mb

    @mb.program(input_specs=[mb.TensorSpec((1, 2, 4, 4))], opset_version=ct.target.iOS18)
    def prog(x):
        return mb.avg_pool(x=x, kernel_sizes=[2, 2], strides=[2, 2], pad_type="valid", name="y")

    convert_to(prog, tmp_path / "pool.mlpackage")
    io = {"inputs": [{"name": "x", "shape": [1, 2, 4, 4], "dtype": "float32"}],
          "outputs": [{"name": "y", "shape": [1, 2, 2, 2], "dtype": "float32"}]}
    manifest = {"precision": "fp32", "models": {"pool": {"functions": {
        "main": {"file": "pool.mlpackage", "function_name": "main", **io}}}}}
    backend = MilBackend(tmp_path, manifest, precision="fp32")
    with pytest.raises(BackendError, match=r"avg_pool.*pool\.mlpackage"):
        backend.predict("pool", "main", {"x": np.zeros((1, 2, 4, 4), np.float32)})


def test_bad_precision_is_refused(tiny_export):
    with pytest.raises(BackendError, match="fp16"):
        MilBackend(tiny_export, {}, precision="bf16")


@pytest.mark.slow
def test_smollm2_mil_fp16_matches_torch_fp16_on_128_tokens(smollm2_export):
    c = mil_vs_torch_fp16_on_text(smollm2_export, "SmolLM2")
    assert c.top1_agreement >= 0.99
    assert c.mean_cosine > 0.999


PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
]


@pytest.mark.slow
@pytest.mark.long  # the mil executor on SmolLM2 is held on 128 tokens above
def test_smollm2_mil_greedy_tokens_equal_torch_fp16(smollm2_export):
    mil = llama_ane.load(smollm2_export, backend="mil", precision="fp16")
    torch_model = llama_ane.load(smollm2_export, backend="torch", precision="fp16")
    for prompt in PROMPTS:
        got = mil.generate(prompt, max_new_tokens=16, temperature=0.0, stop=None)
        want = torch_model.generate(prompt, max_new_tokens=16, temperature=0.0, stop=None)
        assert got.token_ids == want.token_ids, (prompt, got.text, want.text)
        assert len(got.token_ids) == 16 or got.finish_reason == "eos"


@pytest.mark.macos
def test_coreml_matches_mil_on_the_tiny_export(tiny_export):
    coreml = llama_ane.load(tiny_export, backend="coreml")
    mil = llama_ane.load(tiny_export, backend="mil", precision="fp16")
    ids = mil.encode(default_text())[:128]
    c = compare_logits(coreml.score(ids), mil.score(ids), "mil")
    print(f"coreml vs mil: max |logit diff| {c.max_abs_diff:.4f}, top-1 {c.top1_agreement:.3f}")
    assert c.top1_agreement >= 0.99
    assert c.mean_cosine > 0.999
