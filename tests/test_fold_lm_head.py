"""--fold-lm-head: the last chunk computes the LM head, so a step makes one Core ML call fewer.

The plan folds the head where its weights fit beside the last chunk's in one package (auto), on
request (yes, refused where they do not fit) or never (no); the manifest records the chunk in
lm_head.folded_into; the folded export gives the numbers of the unfolded one on the exported
programs (mil) and the torch modules, for single sequences, cascade branches and verify windows,
with tied embeddings (the head's weights are the table's, copied into the chunk's package).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import llama_ane
from llama_ane.config import LlamaConfig
from llama_ane.contract.device_model import calls_per_step, manifest_from_config
from llama_ane.contract.manifest import ManifestError, read_manifest
from llama_ane.contract.plan import ExportOptions, ExportOptionsError, plan_export
from llama_ane.testing import TINY_CONFIG

TINY = LlamaConfig.from_hf_dict(dict(TINY_CONFIG, vocab_size=320, num_hidden_layers=5, head_dim=32))
# Llama-3.2-1B's published shapes: an iOS chunk of 8 layers (973 MB) leaves no room for its 525 MB head
LLAMA_1B = LlamaConfig.from_hf_dict(dict(TINY_CONFIG, vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                                         num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                                         head_dim=64, tie_word_embeddings=True, max_position_embeddings=131072))


def test_auto_folds_where_the_head_fits_and_yes_is_refused_where_it_does_not():
    folded = plan_export(TINY, ExportOptions(context_length=256, layers_per_chunk=2))
    assert folded.head_folded and "lm_head" not in folded.specs
    last = folded.specs["chunk_2"]
    for fn, io in last.items():  # every function of the last chunk, the cascade's included
        names = [t["name"] for t in io["outputs"]]
        assert names[0] == "logits_0" and "hidden_states_out" not in names, fn
        assert io["outputs"][0]["shape"] == [1, 320, 1, io["inputs"][0]["shape"][3]]
    unfolded = plan_export(TINY, ExportOptions(context_length=256, layers_per_chunk=2, fold_lm_head="no"))
    weights = {p.model: p.weight_bytes for p in unfolded.packages}
    assert {p.model: p.weight_bytes for p in folded.packages}["chunk_2"] == weights["chunk_2"] + weights["lm_head"]
    assert not plan_export(LLAMA_1B, ExportOptions(context_length=512)).head_folded
    with pytest.raises(ExportOptionsError, match="--fold-lm-head yes: the LM head .* does not fit beside chunk_1"):
        plan_export(LLAMA_1B, ExportOptions(context_length=512, fold_lm_head="yes"))
    with pytest.raises(ExportOptionsError, match="--fold-lm-head must be one of auto, yes, no"):
        ExportOptions(fold_lm_head="maybe").check()


def test_state_caches_and_the_folded_head_cut_the_calls_per_token():
    before = manifest_from_config(TINY, context_length=256, layers_per_chunk=2, kv_cache="inputs", fold_lm_head="no")
    after = manifest_from_config(TINY, context_length=256, layers_per_chunk=2)
    assert after["cache"]["kind"] == "state"
    assert after["lm_head"] == {"models": [], "vocab_splits": [320], "folded_into": "chunk_2"}
    # embeddings + 3 chunks + head + 3 cache updates, then embeddings + 3 chunks
    assert (calls_per_step(before), calls_per_step(after)) == (8, 4)


def test_kv_cache_auto_is_state_only_where_states_work():
    assert ExportOptions().kv_cache == "state"
    assert ExportOptions(verify_window=16).kv_cache == "inputs"
    assert ExportOptions(precision="fp32").kv_cache == "inputs"
    assert ExportOptions(target="iOS17").kv_cache == "inputs"
    assert ExportOptions(kv_cache="inputs").kv_cache == "inputs"
    # Core AI holds states in either precision (its runtime keeps what a cache-update model returns)
    assert ExportOptions(target="coreai").kv_cache == ExportOptions(target="coreai", precision="fp32").kv_cache == "state"
    assert ExportOptions(target="coreai", verify_window=16).kv_cache == "inputs"


@pytest.fixture(scope="module")
def exports(tiny_checkpoint, tmp_path_factory):
    """A tied-embeddings tiny model with inputs caches, a cascade and a verify window, the head
    folded (through the parity gate) and not."""
    from llama_ane.api import export_model

    ckpt = tiny_checkpoint(num_hidden_layers=3, head_dim=32, tie_word_embeddings=True)
    root = tmp_path_factory.mktemp("fold")
    options = dict(context_length=256, prefill_length=32, layers_per_chunk=2, branch_width=2, suffix_length=32,
                   verify_window=8, decode_function="decode", progress=False)
    return {fold: export_model(ckpt, root / fold, fold_lm_head=fold, verify=fold == "yes", **options)
            for fold in ("yes", "no")}


def _prompt(n: int, seed: int = 0) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 300, size=n)]


@pytest.mark.export
def test_folded_manifest_and_package(exports):
    m = read_manifest(exports["yes"])
    assert m["lm_head"]["folded_into"] == "chunk_1" and m["lm_head"]["models"] == []
    assert "lm_head" not in m["models"] and not (exports["yes"] / "lm_head.mlpackage").exists()
    assert set(m["models"]["chunk_1"]["functions"]) >= {"prefill", "decode", "decode_branches", "verify"}
    assert calls_per_step(m) == calls_per_step(read_manifest(exports["no"])) - 1


@pytest.mark.export
@pytest.mark.parametrize("backend", ["mil", "torch"])
def test_folded_export_gives_the_unfolded_numbers(exports, backend):
    models = {fold: llama_ane.load(path, backend=backend) for fold, path in exports.items()}
    logits = {}
    for fold, model in models.items():
        model.pipeline.reset()
        logits[fold] = model.pipeline.prefill(_prompt(45), all_logits=True)
    np.testing.assert_allclose(logits["yes"], logits["no"], atol=1e-2)
    tokens = {fold: model.generate(_prompt(40, 1), max_new_tokens=12).token_ids for fold, model in models.items()}
    assert tokens["yes"] == tokens["no"]
    prefix, conts = _prompt(50, 2), [_prompt(5, 3), _prompt(7, 4)]
    branches = {fold: [b.token_ids for b in model.generate_branches(prefix, conts, max_new_tokens=5).branches]
                for fold, model in models.items()}
    assert branches["yes"] == branches["no"]
    tree = {}
    for fold, model in models.items():
        model.pipeline.reset()
        model.pipeline.prefill(_prompt(20, 5))
        tree[fold] = model.pipeline.verify_tree(np.array(_prompt(3, 6), np.int32), np.array([0, 1, 1], np.int32),
                                                np.where(np.array([[1, 0, 0], [1, 1, 0], [1, 0, 1]], bool), 0.0,
                                                         -1e4).astype(model.backend.dtype).reshape(1, 1, 3, 3))
    np.testing.assert_allclose(tree["yes"], tree["no"], atol=1e-2)


@pytest.mark.export
def test_streamed_scoring_of_a_folded_export(exports):
    model = llama_ane.load(exports["yes"], backend="mil")
    ids = _prompt(70, 7)
    streamed = model.pipeline.score_streamed(ids)
    model.pipeline.reset()
    np.testing.assert_allclose(streamed, model.pipeline.prefill(ids, all_logits=True), atol=1e-3)


@pytest.mark.export
def test_a_folded_head_that_is_not_the_last_chunk_is_refused(exports, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(exports["yes"], copy)
    m = json.loads((copy / "manifest.json").read_text())
    m["lm_head"]["folded_into"] = "chunk_0"
    (copy / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ManifestError, match="lm_head.folded_into names 'chunk_0', not the last chunk"):
        read_manifest(copy)


# ---- functions per package ---------------------------------------------------------------------------------------

def test_an_export_past_the_functions_per_package_is_refused_naming_the_options():
    from llama_ane.limits import MAX_FUNCTIONS_PER_PACKAGE

    cfg = LlamaConfig.from_hf_dict(dict(TINY_CONFIG, vocab_size=320, max_position_embeddings=16384))
    # decode functions at the longest context: a prefill and a decode function per default bucket
    widest = plan_export(cfg, ExportOptions(context_length=16384, decode_function="decode"))
    assert max(len(fns) for model, fns in widest.specs.items() if model != "cache_update") == MAX_FUNCTIONS_PER_PACKAGE
    with pytest.raises(ExportOptionsError, match=r"\w+.mlpackage would hold 14 functions .* at most 13.*"
                                                 r"--context-buckets.*--branches 0.*--verify-window 0"):
        plan_export(cfg, ExportOptions(context_length=16384, verify_window=16, decode_function="decode"))
    # the default keeps one function a package
    assert max(len(fns) for fns in plan_export(cfg, ExportOptions(context_length=16384)).specs.values()) == 1


def test_info_lists_the_functions_of_each_package(tmp_path):
    from click.testing import CliRunner

    from llama_ane.cli import main

    (tmp_path / "config.json").write_text(json.dumps(dict(TINY_CONFIG, vocab_size=320)))
    result = CliRunner().invoke(main, ["info", "--config", str(tmp_path), "--context-length", "1024",
                                       "--decode-function", "decode"])
    assert result.exit_code == 0, result.output
    assert "functions per package (at most 13" in result.output
    assert "chunk_0.mlpackage             5: prefill_512, decode_512, prefill, decode, decode_branches" in result.output
    result = CliRunner().invoke(main, ["info", "--config", str(tmp_path), "--context-length", "1024"])
    assert "chunk_0.mlpackage             1: prefill" in result.output  # the default: one function
    assert "lm_head      computed in chunk_0" in result.output


@pytest.mark.export
def test_bytes_each_function_adds_beyond_the_shared_weights(exports):
    from llama_ane.commands.info import function_bytes

    m = read_manifest(exports["yes"])
    own = function_bytes(exports["yes"] / "chunk_1.mlpackage")
    assert set(own) == set(m["models"]["chunk_1"]["functions"])
    # the weights (and the head's) are shared by every function: what each adds is small beside them
    assert 0 <= sum(own.values()) < m["weights"]["chunk_1"]["bytes"] / 10
    embeddings = function_bytes(exports["yes"] / "embeddings.mlpackage")
    assert embeddings["prefill"] > embeddings["decode"]  # its masks and positions grow with the window
