"""Cascade branch decoding: each branch must equal decoding prefix + branch alone."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import llama_ane
from llama_ane.runtime.cascade import split_shared_prefix
from llama_ane.runtime.pipeline import ContextFullError

from conftest import LLAMA3_ROPE, NEAR_TIE
from support.parity import branch_inputs

pytestmark = pytest.mark.export  # exports or runs models end to end: outside the quick unit tier

SHAPES = {
    "gqa": {},
    "mha": {"num_key_value_heads": 4},
    "llama3-rope-tied": {"rope_scaling": LLAMA3_ROPE, "tie_word_embeddings": True},
}


def _load(folder, **kw):
    opts = dict(backend="torch", precision="fp32", context_length=256, prefill_length=32, layers_per_chunk=2,
                branch_width=4, suffix_length=64)
    opts.update(kw)
    return llama_ane.load(folder, **opts)


def _top1(branch_model, alone_model, prefix, conts, exact=None) -> float:
    """Top-1 agreement of teacher-forced cascade logits with scoring prefix + continuation alone, a
    pick within two ulps of the best logit at the branch model's precision counting as a tie (two
    fp16 computations may order such a pair either way); with `exact` (an fp32 model), also a
    position whose exact top-2 margin is below NEAR_TIE, where two fp16 programs rounding apart may
    rightly pick either token."""
    from llama_ane.verify import top1_agreement

    agree = total = 0
    for branch, cont in zip(branch_model.score_branches(prefix, conts), conts):
        alone = alone_model.score(prefix + cont)[len(prefix):]
        if exact is not None:
            top2 = np.sort(exact.score(prefix + cont)[len(prefix):], axis=-1)[:, -2:]
            near = (top2[:, 1] - top2[:, 0]) < NEAR_TIE
            branch, alone = branch[~near], alone[~near]
            agree += int(near.sum())
        if len(branch):
            agree += top1_agreement(branch, alone, branch_model.backend.dtype.type) * len(branch)
        total += len(cont)
    return agree / total


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_branches_equal_decoding_alone_fp32(tiny_checkpoint, shape):
    model = _load(tiny_checkpoint(num_hidden_layers=3, **SHAPES[shape]))
    prefix, conts = branch_inputs()  # 6 branches over width 4: two groups; own texts of different lengths
    out = model.generate_branches(prefix, conts, max_new_tokens=12)
    assert [r.index for r in out.branches] == list(range(len(conts)))
    for r, cont in zip(out.branches, conts):
        alone = model.generate(prefix + cont, max_new_tokens=12)
        assert r.token_ids == alone.token_ids, f"branch {r.index} differs from decoding it alone"
        assert r.finish_reason == alone.finish_reason


def test_teacher_forced_branch_logits_match_score(tiny_checkpoint):
    model = _load(tiny_checkpoint(num_hidden_layers=3))
    prefix, conts = branch_inputs(seed=1, lengths=(20, 5, 33))
    for logits, cont in zip(model.score_branches(prefix, conts), conts):
        ref = model.score(prefix + cont)[len(prefix):]
        assert logits.shape == ref.shape
        assert np.abs(logits - ref).max() < 1e-3


def test_fp16_top1_agreement(tiny_checkpoint):
    folder = tiny_checkpoint(num_hidden_layers=3)
    m16, m32 = _load(folder, precision="fp16"), _load(folder)
    prefix, conts = branch_inputs(seed=2, lengths=(40, 25, 30, 41))
    assert _top1(m16, m32, prefix, conts) >= 0.99


def test_text_branches_are_user_turns_of_prefix_plus_continuation(tiny_checkpoint):
    """By default each branch decodes as `generate(prefix + continuation)`, one user turn in the chat
    template, over the rendered branches' longest common token prefix."""
    model = _load(tiny_checkpoint(num_hidden_layers=3))
    doc, questions = "Caches hold the keys and values of every token so far.\n\n", ["What?", "Why so?", "Who"]
    out = model.generate_branches(doc, questions, max_new_tokens=6)
    shared, _ = split_shared_prefix([model.encode(doc + q, chat=True) for q in questions])
    assert out.stats.prefix_tokens == len(shared)
    for r, q in zip(out.branches, questions):
        assert r.token_ids == model.generate(doc + q, max_new_tokens=6).token_ids
    raw = model.generate_branches(doc, questions, max_new_tokens=6, raw=True)
    assert raw.stats.prefix_tokens == len(model.encode(doc))


def test_samples_share_the_prefix_and_are_seeded(tiny_checkpoint):
    model = _load(tiny_checkpoint(num_hidden_layers=3))
    prefix, _ = branch_inputs(seed=3)
    a = model.generate_branches(prefix, n=5, max_new_tokens=6, temperature=1.0, seed=7)
    b = model.generate_branches(prefix, n=5, max_new_tokens=6, temperature=1.0, seed=7)
    assert [r.token_ids for r in a.branches] == [r.token_ids for r in b.branches]
    assert len({tuple(r.token_ids) for r in a.branches}) > 1  # different per-branch streams
    greedy = model.generate_branches(prefix, n=3, max_new_tokens=6)
    alone = model.generate(prefix, max_new_tokens=6)
    assert all(r.token_ids == alone.token_ids for r in greedy.branches)


class _Recorder:
    """Wraps a backend and records which prefix buffers the branch functions read."""

    def __init__(self, backend):
        self.backend, self.name, self.dtype = backend, backend.name, backend.dtype
        self.prefix_buffers, self.suffix_shapes = set(), set()
        self.branch_calls, self.prefix_bytes, self.suffix_bytes = 0, 0, 0  # measured: what the backend is given

    def predict(self, model, function, inputs):
        if function == "decode_branches" and model.startswith("chunk_"):
            self.branch_calls += model == "chunk_0"
            self.prefix_bytes += inputs["k_cache"].nbytes + inputs["v_cache"].nbytes
            self.suffix_bytes += inputs["k_suffix"].nbytes + inputs["v_suffix"].nbytes
            self.prefix_buffers.add(inputs["k_cache"].__array_interface__["data"][0])
            self.prefix_buffers.add(inputs["v_cache"].__array_interface__["data"][0])
            self.suffix_shapes.add(inputs["k_suffix"].shape)
        return self.backend.predict(model, function, inputs)

    def close(self):
        self.backend.close()


@pytest.mark.parametrize("width", [2, 8])
def test_prefix_cache_exists_once_whatever_b(tiny_checkpoint, width):
    model = _load(tiny_checkpoint(num_hidden_layers=3), branch_width=width, decode_function="decode")
    rec = _Recorder(model.backend)
    model.backend = model.pipeline.backend = rec
    prefix, conts = branch_inputs(seed=4, lengths=(2, 3, 4, 5, 6))
    out = model.generate_branches(prefix, conts, max_new_tokens=4)
    chunks = len(model.manifest["chunks"])
    assert len(rec.prefix_buffers) == 2 * chunks  # one K and one V prefix buffer per chunk, for all groups
    assert {s[1] for s in rec.suffix_shapes} == {width}  # branches live only in the suffix caches
    assert out.stats.steps == rec.branch_calls


def test_prefix_bytes_passed_per_step_do_not_grow_with_b(tiny_checkpoint):
    """Measured at the backend: the prefix K/V bytes one cascade step is given are the same for 2 and
    for 8 branches (one prefix for all), while the suffix bytes grow with B (the cascade's function)."""
    measured = {}
    for width in (2, 8):
        model = _load(tiny_checkpoint(num_hidden_layers=3), branch_width=width, decode_function="decode")
        rec = _Recorder(model.backend)
        model.backend = model.pipeline.backend = rec
        prefix, conts = branch_inputs(seed=4, lengths=(2, 3, 4, 5, 6, 7, 8, 9))
        model.generate_branches(prefix, conts, max_new_tokens=4)
        measured[width] = (rec.prefix_bytes / rec.branch_calls, rec.suffix_bytes / rec.branch_calls)
    assert measured[2][0] == measured[8][0] > 0
    assert measured[8][1] == 4 * measured[2][1]


def test_split_shared_prefix():
    prefix, rest = split_shared_prefix([[1, 2, 3, 4], [1, 2, 5], [1, 2, 3]])
    assert prefix == [1, 2] and rest == [[3, 4], [5], [3]]
    prefix, rest = split_shared_prefix([[1, 2], [1, 2]])  # every branch keeps one token of its own
    assert prefix == [1] and rest == [[2], [2]]


def test_bad_branch_input(tiny_checkpoint):
    folder = tiny_checkpoint(num_hidden_layers=3)
    model = _load(folder)
    prefix, conts = branch_inputs()
    with pytest.raises(ValueError, match="empty"):
        model.generate_branches(prefix, [], max_new_tokens=4)
    with pytest.raises(ValueError, match="at least 1"):
        model.generate_branches(prefix, n=0)
    with pytest.raises(ContextFullError, match="context"):
        model.generate_branches(list(range(3, 300)), conts)  # 297 > 256
    # through the prefill window the branches share the context: 4 x (9 + 60) after the prefix > 256
    with pytest.raises(ContextFullError, match="4 branches side by side after the .*--max-new-tokens"):
        model.generate_branches(prefix, conts, max_new_tokens=60)
    with pytest.raises(ContextFullError, match="suffix"):  # the cascade's function: 9 + 60 > 64
        _load(folder, decode_function="decode").generate_branches(prefix, conts, max_new_tokens=60)
    no_cascade = _load(folder, branch_width=0)
    with pytest.raises(ValueError, match="--branches"):
        no_cascade.generate_branches(prefix, conts)


def test_branches_on_converted_export(tiny_export):
    """The exported tiny model (branch width 8 by default), run with the torch backend."""
    model = llama_ane.load(tiny_export, backend="torch", precision="fp32")
    prefix, conts = branch_inputs(seed=5)
    out = model.generate_branches(prefix, conts, max_new_tokens=8)
    for r, cont in zip(out.branches, conts):
        assert r.token_ids == model.generate(prefix + cont, max_new_tokens=8).token_ids


def test_branches_mil_backend_top1(tiny_export):
    """The converted decode_branches programs themselves, executed by the mil backend in fp16,
    against the same backend decoding each branch alone through the prefill/decode programs."""
    pytest.importorskip("llama_ane.runtime.backends.mil_backend")
    mil = llama_ane.load(tiny_export, backend="mil")
    prefix, conts = branch_inputs(seed=6, lengths=(30, 20, 25))
    assert _top1(mil, mil, prefix, conts, exact=llama_ane.load(tiny_export, backend="torch", precision="fp32")) >= 0.99


DOCUMENT = (Path(__file__).resolve().parents[1] / "benchmarks" / "document.txt").read_text()
QUESTIONS = ["When was the lighthouse finished?", "Who paid for the stone pier?",
             "How many people come to the festival?", "What is in the old customs house?"]


@pytest.fixture(scope="module")
def smollm2_torch():
    return {p: llama_ane.load("default", backend="torch", precision=p) for p in ("fp32", "fp16")}


@pytest.mark.slow
def test_smollm2_document_qa_equals_alone(smollm2_torch):
    model = smollm2_torch["fp32"]
    prefix, own = split_shared_prefix(
        [model.encode(f"{DOCUMENT}\n\nQuestion: {q}", chat=True) for q in QUESTIONS])
    assert len(prefix) >= 400
    out = model.generate_branches(prefix, own, max_new_tokens=24)
    for r, cont in zip(out.branches, own):
        alone = model.generate(prefix + cont, max_new_tokens=24)
        assert r.token_ids == alone.token_ids, f"branch {r.index}: {r.text!r} vs alone {alone.text!r}"
    assert "1859" in out.branches[0].text  # the document says so; a sanity check on real text


@pytest.mark.slow
@pytest.mark.long
def test_smollm2_fp16_branches_top1(smollm2_torch):
    m16 = smollm2_torch["fp16"]  # fp16 on a CPU is emulated: two questions keep the test within a few minutes
    prefix, own = split_shared_prefix(
        [m16.encode(f"{DOCUMENT}\n\nQuestion: {q}", chat=True) for q in QUESTIONS[:2]])
    # teacher-force each question plus the fp32 model's own answer
    forced = [cont + smollm2_torch["fp32"].generate(prefix + cont, max_new_tokens=12).token_ids for cont in own]
    assert _top1(m16, m16, prefix, forced) >= 0.99


def test_cli_document_qa_and_samples(tiny_export, tmp_path):
    import json

    from click.testing import CliRunner

    from llama_ane.cli import main

    doc = tmp_path / "doc.txt"
    doc.write_text("The quick brown fox jumps over the lazy dog. Caches hold keys and values. " * 3)
    runner = CliRunner()
    res = runner.invoke(main, ["generate", str(tiny_export), "--backend", "torch", "--prompt-file", str(doc),
                               "--question", "What jumps?", "--question", "What do caches hold?",
                               "--max-new-tokens", "6", "--json", "--raw"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert [b["label"] for b in out["branches"]] == ["Q: What jumps?", "Q: What do caches hold?"]
    assert out["prefix_tokens"] > 0 and out["num_branches"] == 2 and out["steps"] > 0
    model = llama_ane.load(tiny_export, backend="torch")
    for q, b in zip(["What jumps?", "What do caches hold?"], out["branches"]):
        alone = model.generate(model.encode(doc.read_text()) + model.tokenizer(
            f"\n\nQuestion: {q}\nAnswer:", add_special_tokens=False).input_ids, max_new_tokens=6, stop=["\n\n"])
        assert b["token_ids"] == alone.token_ids

    res = runner.invoke(main, ["generate", str(tiny_export), "--backend", "torch", "--prompt", "Caches hold",
                               "--samples", "3", "--temperature", "1.0", "--seed", "1", "--max-new-tokens", "4"])
    assert res.exit_code == 0, res.output
    assert res.stdout.count("--- [") == 3 and "aggregate" in res.stderr

    res = runner.invoke(main, ["generate", str(tiny_export), "--backend", "torch", "--prompt", "x", "--samples", "0"])
    assert res.exit_code != 0 and "--samples must be at least 1" in res.output
    long_doc = tmp_path / "long.txt"
    long_doc.write_text("word " * 400)  # longer than the 256-token context
    res = runner.invoke(main, ["generate", str(tiny_export), "--backend", "torch", "--prompt-file", str(long_doc),
                               "--question", "q?"])
    assert res.exit_code != 0 and "context" in res.output and "Traceback" not in res.output
