"""Embedding tables and LM heads too large for one file are cut by vocabulary rows into several.

The plan decides it from the target's weight budget (at 8B, iOS: two files each); the exported
parts compute exactly what one file would: the embeddings files add up their lookups, the LM head
files each give their group of logits.
"""

from __future__ import annotations

import numpy as np
import pytest

from llama_ane.config import LlamaConfig
from llama_ane.contract.plan import ExportOptions, plan_export
from llama_ane.export import ane_rules
from llama_ane.limits import weight_budget

pytestmark = pytest.mark.export  # exports or runs models end to end: outside the quick unit tier

LLAMA31_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False)


@pytest.mark.parametrize("target, files", [("iOS18", 2), ("macOS15", 1)])
def test_8b_vocabulary_files_fit_the_target(target, files):
    plan = plan_export(LlamaConfig(**LLAMA31_8B), ExportOptions(target=target))
    assert len(plan.embedding_rows) == files and len(plan.head_groups) == files
    assert plan.embedding_rows[0][0] == 0 and plan.embedding_rows[-1][1] == 128256
    assert all(a[1] == b[0] for a, b in zip(plan.embedding_rows, plan.embedding_rows[1:]))
    assert [j for g in plan.head_groups for j in g] == list(range(8))
    for p in plan.packages:  # weights within the budget, so the file is within what inspect enforces
        assert p.weight_bytes <= weight_budget(target), p
        assert not ane_rules.check_file_size(p.file, p.weight_bytes + 1_000_000, target)
    manifest = plan.manifest("8b", {}, {}, files={})
    assert manifest["embeddings"]["models"] == ["embeddings", "embeddings_1"][:files]
    assert manifest["lm_head"]["models"] == ["lm_head", "lm_head_1"][:files]
    assert sum(manifest["lm_head"]["vocab_splits"]) == 128256


@pytest.fixture(scope="module")
def exports(tiny_checkpoint, tmp_path_factory, request):
    """The same tiny model (a 40000-row vocabulary) exported whole, and with a weight budget small
    enough that its embedding table and LM head take three files each."""
    from llama_ane.api import export_model
    import llama_ane.contract.plan as plan_module

    ckpt = tiny_checkpoint(vocab_size=40000, num_hidden_layers=2, head_dim=32)
    root = tmp_path_factory.mktemp("vocab")
    options = dict(context_length=64, prefill_length=16, layers_per_chunk=1, branch_width=2, suffix_length=32,
                   progress=False)
    whole = export_model(ckpt, root / "whole", verify=False, **options)
    mp = pytest.MonkeyPatch()
    mp.setattr(plan_module, "weight_budget", lambda target: 2_000_000)  # 40000 x 64 fp16 = 5.1 MB
    try:
        cut = export_model(ckpt, root / "cut", verify=True, **options)
    finally:
        mp.undo()
    return whole, cut


def test_cut_export_has_three_files_per_vocabulary_matrix(exports):
    from llama_ane.contract.manifest import read_manifest

    _, cut = exports
    m = read_manifest(cut)
    assert m["embeddings"]["models"] == ["embeddings", "embeddings_1", "embeddings_2"]
    assert m["embeddings"]["vocab_ranges"] == [[0, 13376], [13376, 26688], [26688, 40000]]  # cut at 64 rows
    assert m["lm_head"]["models"] == ["lm_head", "lm_head_1", "lm_head_2"]
    for model in m["embeddings"]["models"] + m["lm_head"]["models"]:
        assert (cut / f"{model}.mlpackage").is_dir()
    assert [o["name"] for o in m["models"]["lm_head_2"]["functions"]["prefill"]["outputs"]] == ["logits_2"]
    assert [i["name"] for i in m["models"]["embeddings_1"]["functions"]["prefill"]["inputs"]] == [
        "input_ids", "hidden_states"]


@pytest.mark.parametrize("backend, precision", [("torch", "fp32"), ("mil", "fp16")])
def test_cut_export_computes_what_the_whole_one_does(exports, backend, precision):
    """Token ids from every part of the vocabulary: the same logits, bit for bit."""
    import llama_ane

    ids = np.random.default_rng(0).integers(0, 40000, size=40).tolist()
    ids[:3] = [0, 13375, 13376]  # the first and last rows of a part
    scores = []
    for folder in exports:
        model = llama_ane.load(folder, backend=backend, precision=precision)
        try:
            scores.append(model.score(ids))
            scores.append(model.pipeline.score_streamed(ids))
            branch = model.score_branches(ids[:20], [ids[20:25], ids[25:28]])
            scores.extend(branch)
        finally:
            model.close()
    half = len(scores) // 2
    for whole, cut in zip(scores[:half], scores[half:]):
        np.testing.assert_array_equal(whole, cut)


def test_inspect_passes_the_cut_export(exports):
    from llama_ane.export.inspect import inspect_path

    report = inspect_path(exports[1])
    assert not report.violations, report.violations
