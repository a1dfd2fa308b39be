"""Chunk-major (streamed) teacher-forced scoring, the backends' `release`, and the streamed
transformers reference of the parity gate.

`Pipeline.score_streamed` runs every window through one model before the next model loads; its
logits must be the token-major ones exactly, and at no point may a backend hold the weights of
more than one model. The transformers reference computed one decoder layer at a time must match
`LlamaForCausalLM`.
"""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch

import llama_ane
from conftest import LLAMA3_ROPE
from llama_ane.checkpoint.loader import load_checkpoint
from llama_ane.checkpoint.mapping import LAYER_TENSORS
from llama_ane.contract.plan import ExportOptions, plan_export
from llama_ane.contract.manifest import model_names
from llama_ane.runtime.backends.torch_modules import build_model
from llama_ane.reference import transformers_logits

pytestmark = pytest.mark.export  # exports or runs models end to end: outside the quick unit tier

CONTEXT, WINDOW = 128, 32
# 3 full prefill windows and a 1-token (decode) window; 2 full windows and a partial one
LENGTHS = (3 * WINDOW + 1, 2 * WINDOW + 13)
WEIGHTED = ("embeddings", "chunk_", "lm_head")  # manifest models with weights (cache_update has none)


def random_ids(vocab: int, n: int, seed: int = 0) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, vocab, n)]


@pytest.fixture(scope="module")
def chunked_export(tiny_checkpoint, tmp_path_factory):
    """An fp16 export of a 3-layer tiny model, one layer per chunk (3 chunks), context 128, window 32,
    every model a call of its own (caches as inputs, the LM head apart), with decode functions."""
    from llama_ane.api import export_model

    ckpt = tiny_checkpoint(num_hidden_layers=3, head_dim=32)
    return export_model(ckpt, tmp_path_factory.mktemp("export") / "chunked", context_length=CONTEXT,
                        prefill_length=WINDOW, layers_per_chunk=1, kv_cache="inputs", fold_lm_head="no",
                        decode_function="decode", progress=False, verify=False)


def token_major(model, ids) -> np.ndarray:
    """Logits [T, vocab] of the ordinary forward loop (window after window through every model)."""
    model.pipeline.reset()
    logits = model.pipeline.prefill(ids, all_logits=True)
    model.pipeline.wait()
    return logits


class LiveCounter:
    """Weak references to the objects a backend builds, to count how many are still alive."""

    def __init__(self):
        self.refs: list[tuple[str, weakref.ref]] = []

    def add(self, label: str, obj) -> None:
        self.refs.append((label, weakref.ref(obj)))

    def alive(self) -> list[str]:
        return sorted(label for label, ref in self.refs if ref() is not None)


def watch(backend, counter: LiveCounter) -> tuple[list[list[str]], list[tuple[str, list[str]]]]:
    """Record the live objects of `counter` after every prediction of `backend`, and after every
    release (with the released model's name). Returns both lists, filled as the backend runs."""
    predicted: list[list[str]] = []
    released: list[tuple[str, list[str]]] = []
    predict, release = backend.predict, backend.release

    def predict_and_count(model, function, inputs):
        out = predict(model, function, inputs)
        predicted.append(counter.alive())
        return out

    def release_and_count(model):
        release(model)
        released.append((model, counter.alive()))
    backend.predict, backend.release = predict_and_count, release_and_count
    return predicted, released


@pytest.fixture
def no_gc():
    """Garbage collection off: what a release frees must be freed by reference counting, at once."""
    gc.disable()
    yield
    gc.enable()


@pytest.mark.parametrize("n", LENGTHS)
def test_streamed_equals_token_major_torch_fp32(chunked_export, n):
    model = llama_ane.load(chunked_export, backend="torch", precision="fp32")
    try:
        ids = random_ids(model.manifest["config"]["vocab_size"], n)
        want = token_major(model, ids)
        got = model.pipeline.score_streamed(ids)
        assert got.dtype == np.float32 and got.shape == want.shape == (n, model.manifest["config"]["vocab_size"])
        np.testing.assert_array_equal(got, want)
        assert model.pipeline.position == 0  # left reset, ready for another sequence
        np.testing.assert_array_equal(token_major(model, ids), want)  # the released models load again
    finally:
        model.close()


@pytest.mark.parametrize("n", LENGTHS)
def test_streamed_equals_token_major_mil_fp16(chunked_export, n):
    model = llama_ane.load(chunked_export, backend="mil", precision="fp16")
    try:
        ids = random_ids(model.manifest["config"]["vocab_size"], n, seed=1)
        want = token_major(model, ids)
        got = model.pipeline.score_streamed(ids)
        np.testing.assert_array_equal(got, want)
    finally:
        model.close()


def test_mil_backend_holds_one_package_at_a_time(chunked_export, monkeypatch, no_gc):
    import llama_ane.mil as mil

    counter = LiveCounter()

    class CountedExecutor(mil.PackageExecutor):
        def __init__(self, path, *args, **kwargs):
            super().__init__(path, *args, **kwargs)
            counter.add(path.name, self)

    monkeypatch.setattr(mil, "PackageExecutor", CountedExecutor)
    model = llama_ane.load(chunked_export, backend="mil")
    predicted, released = watch(model.backend, counter)
    try:
        model.pipeline.score_streamed(random_ids(model.manifest["config"]["vocab_size"], 2 * WINDOW + 5))
    finally:
        model.close()
    assert len(model.manifest["chunks"]) == 3
    packages = ["embeddings", "chunk_0", "chunk_1", "chunk_2", "lm_head"]
    assert sorted({name for names in predicted for name in names}) == sorted(
        [f"{p}.mlpackage" for p in [*packages, "cache_update"]])  # every package ran
    for names in predicted:
        assert len([name for name in names if name.startswith(WEIGHTED)]) <= 1, names
    # each package is freed (not only forgotten) when released, before the next one loads
    assert [model for model, _ in released] == packages
    for model_name, names in released:
        assert set(names) <= {"cache_update.mlpackage"}, (model_name, names)
    assert counter.alive() == []  # close() dropped the rest


def test_mil_executor_holds_one_function_program_at_a_time(chunked_export, monkeypatch):
    # coremltools reads a copy of the weights for each function of a package: loading them one
    # at a time, each freed before the next, keeps one such copy beside the prepared weights
    import llama_ane.mil.executor as executor

    programs: list[weakref.ref] = []
    load = executor._function_program

    def counted(package, name):
        assert all(ref() is None for ref in programs), f"a program is still alive when {name!r} loads"
        program = load(package, name)
        programs.append(weakref.ref(program))
        return program

    monkeypatch.setattr(executor, "_function_program", counted)
    package = executor.PackageExecutor(chunked_export / "chunk_0.mlpackage")
    assert len(programs) == len(package.function_names) >= 2
    assert all(ref() is None for ref in programs)
    assert gc.get_freeze_count() == 0  # the collections' freeze was undone


def test_torch_backend_holds_one_model_at_a_time(chunked_export, monkeypatch, no_gc):
    import llama_ane.runtime.backends.torch_backend as torch_backend

    counter = LiveCounter()

    def counted_build(ckpt, manifest, model, *args, **kwargs):
        modules = build_model(ckpt, manifest, model, *args, **kwargs)
        for module in {id(m): m for m in modules.values()}.values():
            counter.add(model, module)
        return modules

    monkeypatch.setattr(torch_backend, "build_model", counted_build)
    model = llama_ane.load(chunked_export, backend="torch", precision="fp16")
    predicted, released = watch(model.backend, counter)
    try:
        model.pipeline.score_streamed(random_ids(model.manifest["config"]["vocab_size"], 2 * WINDOW + 5))
    finally:
        model.close()
    assert sorted({name for names in predicted for name in names}) == sorted(  # direct caches: no cache update
        ["embeddings", "chunk_0", "chunk_1", "chunk_2", "lm_head"])
    for names in predicted:
        assert len({name for name in names if name.startswith(WEIGHTED)}) <= 1, names
    for model_name, names in released:
        assert set(names) <= {"cache_update"}, (model_name, names)


def layer_tensors(layer: int) -> set[str]:
    return {f"model.layers.{layer}.{name}" for name in LAYER_TENSORS.values()}


def test_build_model_reads_only_its_own_weights(tiny_checkpoint):
    ckpt = load_checkpoint(tiny_checkpoint(num_hidden_layers=3, tie_word_embeddings=True))
    plan = plan_export(ckpt.config, ExportOptions(context_length=64, prefill_length=16, layers_per_chunk=2,
                                                  branch_width=2, suffix_length=32, kv_cache="inputs",
                                                  fold_lm_head="no", decode_function="decode"))
    manifest = plan.manifest("tiny", {}, {}, files={})
    assert plan.chunks == [[0, 1], [2]]
    read: list[str] = []
    get, get_rows = ckpt.get, ckpt.get_rows
    ckpt.get = lambda name: read.append(name) or get(name)
    ckpt.get_rows = lambda name, start, end: read.append(name) or get_rows(name, start, end)
    want = {
        "embeddings": {"model.embed_tokens.weight"},
        "chunk_0": layer_tensors(0) | layer_tensors(1),
        "chunk_1": layer_tensors(2),
        "lm_head": {"model.embed_tokens.weight", "model.norm.weight"},  # tied
        "cache_update": set(),
    }
    assert model_names(manifest) == list(want)
    for name, tensors in want.items():
        read.clear()
        modules = build_model(ckpt, manifest, name)
        assert set(read) == tensors, name
        assert all(t.device.type == "cpu" for m in modules.values() for t in [*m.parameters(), *m.buffers()])
        assert set(modules) == set(manifest["models"][name]["functions"])
    with pytest.raises(KeyError, match="chunk_2"):
        build_model(ckpt, manifest, "chunk_2")
    # the functions of one model share its weights
    chunk = build_model(ckpt, manifest, "chunk_1")
    assert chunk["prefill"] is chunk["decode"] and chunk["decode_branches"].chunk is chunk["decode"]
    emb = build_model(ckpt, manifest, "embeddings")
    assert emb["prefill"].embed_tokens is emb["decode"].embed_tokens is emb["decode_branches"].embed_tokens


@pytest.mark.parametrize("overrides", [{}, {"tie_word_embeddings": True}, {"rope_scaling": dict(LLAMA3_ROPE)}],
                         ids=["untied", "tied", "llama3_rope"])
def test_streamed_transformers_reference_matches_llama_for_causal_lm(tiny_checkpoint, overrides):
    from transformers import LlamaForCausalLM

    folder = tiny_checkpoint(**overrides)
    ckpt = load_checkpoint(folder)
    ids = random_ids(ckpt.config.vocab_size, 100, seed=2)  # longer than the llama3 original context (64)
    full = LlamaForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        want = full(torch.tensor([ids])).logits[0].numpy()
    got = transformers_logits(ids, ckpt)
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
