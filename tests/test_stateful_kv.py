"""`--kv-cache state`: the chunks' K/V caches as Core ML states, updated in the graph by a slice update.

The tiny export here has the options of the shared `tiny_export` fixture with state caches, so the
two give the same numbers wherever both run the same programs: the greedy tokens, the logits of a
window that must fall back to one-token steps near the end of the context, cascade branches and
a prompt-cache file, on the mil backend (the exported programs themselves) and the torch backend.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import llama_ane
from llama_ane.contract.plan import ExportOptions, ExportOptionsError
from llama_ane.export.ane_rules import FunctionSummary, OpInfo, TensorInfo, check_fallback_ops, check_states
from llama_ane.export.inspect import inspect_path
from llama_ane.mil.package import TensorDesc

pytestmark = pytest.mark.export  # exports or runs models end to end: outside the quick unit tier


@pytest.fixture(scope="module")
def state_export(tiny_checkpoint, tmp_path_factory):
    """The tiny_export model and options (decode functions) with state caches, through the parity gate
    (verify=True). Where the prefill window decodes, test_prefill_decodes holds state caches."""
    from llama_ane.api import export_model

    ckpt = tiny_checkpoint(num_hidden_layers=5, head_dim=32)
    return export_model(ckpt, tmp_path_factory.mktemp("export") / "tiny-state", context_length=256,
                        prefill_length=64, layers_per_chunk=2, kv_cache="state", decode_function="decode",
                        verify=True, progress=False)


def _prompt(n: int, seed: int = 0) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 300, size=n)]


def test_options_need_an_ios18_target_and_fp16():
    with pytest.raises(ExportOptionsError, match="iOS18"):
        ExportOptions(target="iOS17", kv_cache="state").check()
    with pytest.raises(ExportOptionsError, match="float16"):
        ExportOptions(precision="fp32", kv_cache="state").check()
    with pytest.raises(ExportOptionsError, match="--kv-cache must be one of"):
        ExportOptions(kv_cache="ring").check()
    # no speculative verify function: its accepted path is written by the cache-update model
    assert ExportOptions(kv_cache="state").verify_window == 0 and ExportOptions().verify_window == 0
    with pytest.raises(ExportOptionsError, match="no speculative verify function"):
        ExportOptions(kv_cache="state", verify_window=16).check()


def test_manifest_declares_states_and_no_window_cache_updates(state_export):
    m = json.loads((state_export / "manifest.json").read_text())
    assert m["cache"]["kind"] == "state"
    for chunk in m["chunks"]:
        n = len(chunk["layers"])
        for fn in ("prefill", "decode"):
            entry = m["models"][chunk["model"]]["functions"][fn]
            assert [t["name"] for t in entry["states"]] == ["k_cache", "v_cache"]
            assert all(t["shape"] == [n, 64, 1, 256] and t["dtype"] == "float16" for t in entry["states"])
            assert "position" in [t["name"] for t in entry["inputs"]]
            last = chunk["model"] == m["lm_head"].get("folded_into")  # the last chunk carries the LM head
            assert [t["name"] for t in entry["outputs"]] == (["logits_0"] if last else ["hidden_states_out"])
        # only the cascade's suffix caches are still written by the cache-update model
        assert list(chunk["cache_update"]) == ["decode_branches"]
    assert set(m["models"]["cache_update"]["functions"]) == {"decode_branches_l2", "decode_branches_l1"}


def test_state_export_passes_inspect_strict(state_export):
    report = inspect_path(state_export)
    assert report.violations == []
    decode = next(f for p in report.packages if p.file == "chunk_0.mlpackage" for f in p.functions
                  if f.function == "decode")
    assert {d.name for d in decode.inputs if d.is_state} == {"k_cache", "v_cache"}
    assert decode.op_histogram["slice_update"] == 2 and decode.op_histogram["write_state"] == 2


@pytest.mark.parametrize("backend", ["mil", "torch"])
def test_same_greedy_tokens_as_the_default_export(tiny_export, state_export, backend):
    prompt = _prompt(100)
    default = llama_ane.load(tiny_export, backend=backend).generate(prompt, max_new_tokens=24)
    state = llama_ane.load(state_export, backend=backend).generate(prompt, max_new_tokens=24)
    assert state.token_ids == default.token_ids
    assert state.decoded_tokens > 0


def test_windows_near_the_end_of_the_context_run_one_token_at_a_time(tiny_export, state_export):
    """A state is written a whole window at a time, so at position 200 of 256 a 30-token window
    (64 with its padding) runs as 30 decode steps; the logits are those of the default export,
    whose cache-update model drops the padding instead."""
    logits = {}
    for name, path in (("default", tiny_export), ("state", state_export)):
        model = llama_ane.load(path, backend="mil")
        model.pipeline.reset()
        model.pipeline.prefill(_prompt(200, seed=1))
        logits[name] = model.pipeline.prefill(_prompt(30, seed=2), all_logits=True)
        assert model.pipeline.position == 230
    assert logits["state"].shape == (30, 320)
    np.testing.assert_allclose(logits["state"], logits["default"], atol=2e-2)
    assert (logits["state"].argmax(-1) == logits["default"].argmax(-1)).all()


def test_the_mil_executor_writes_the_state_in_place(state_export):
    """After a prefill window the state arrays hold the window's K/V in its columns and zeros after."""
    model = llama_ane.load(state_export, backend="mil")
    model.pipeline.reset()
    model.pipeline.prefill(_prompt(40, seed=3))
    k = model.pipeline.cache.caches[0]["k"]
    assert k.dtype == np.float16
    assert (np.abs(k[..., :40]).max(axis=(0, 1, 2)) > 0).all()  # every token's column is written
    assert not k[..., 64:].any()  # the window's padding is written, nothing past it
    with pytest.raises(llama_ane.runtime.backends.base.BackendError, match="writable float16"):
        m = json.loads((state_export / "manifest.json").read_text())
        entry = m["models"]["chunk_0"]["functions"]["decode"]
        inputs = {t["name"]: np.zeros(t["shape"], np.int32 if t["dtype"] == "int32" else np.float16)
                  for t in entry["inputs"] + entry["states"]}
        inputs["k_cache"] = inputs["k_cache"].astype(np.float32)  # not the state's dtype: refused
        model.backend.predict("chunk_0", "decode", inputs)


@pytest.mark.parametrize("backend", ["mil", "torch"])
def test_cascade_branches_equal_the_default_export(tiny_export, state_export, backend):
    prefix, conts = _prompt(70, seed=4), [_prompt(9, seed=5), _prompt(14, seed=6)]
    default = llama_ane.load(tiny_export, backend=backend).generate_branches(prefix, conts, max_new_tokens=8)
    state = llama_ane.load(state_export, backend=backend).generate_branches(prefix, conts, max_new_tokens=8)
    assert [b.token_ids for b in state.branches] == [b.token_ids for b in default.branches]


def test_a_prompt_cache_file_of_a_state_export(state_export, tmp_path):
    model = llama_ane.load(state_export, backend="mil")
    document, question = _prompt(90, seed=7), _prompt(6, seed=8)
    cache = model.make_cache()
    model.generate(document, max_new_tokens=1, cache=cache)
    path = model.save_cache(cache, tmp_path / "doc.npz")
    again = llama_ane.load(state_export, backend="mil")
    answer = again.generate(document + question, max_new_tokens=10, cache=again.load_cache(path))
    assert answer.reused_tokens == 90
    assert answer.token_ids == again.generate(document + question, max_new_tokens=10).token_ids


def _summary(ops, tensors, inputs=()):
    return FunctionSummary("p.mlpackage", "decode", "chunk", list(inputs), [], tensors, ops)


def test_only_a_slice_update_written_into_a_state_may_slice_at_runtime():
    op = OpInfo("slice_update", "upd", {"x": False, "update": False, "begin": False, "end": False})
    into_state = _summary([op], [TensorInfo("upd", (2, 64, 1, 256), "fp16", "op", {"write_state"})])
    elsewhere = _summary([op], [TensorInfo("upd", (2, 64, 1, 256), "fp16", "op", {"matmul"})])
    assert check_fallback_ops(into_state) == []
    assert [v.rule for v in check_fallback_ops(elsewhere)] == ["fallback-op"]


def test_state_rules():
    fp16 = TensorDesc("k_cache", (2, 64, 1, 256), "float16", is_state=True)
    fp32 = TensorDesc("v_cache", (2, 64, 1, 256), "float32", is_state=True)
    declared = [{"name": "k_cache", "shape": [2, 64, 1, 256], "dtype": "float16"}]
    assert check_states(_summary([], [], [fp16]), "iOS18", declared) == []
    assert [v.rule for v in check_states(_summary([], [], [fp16, fp32]), "iOS18")] == ["state-dtype"]
    assert [v.rule for v in check_states(_summary([], [], [fp16]), "iOS17")] == ["state-target"]
    assert [v.rule for v in check_states(_summary([], [], [fp16]), "iOS18", [])] == ["state-manifest"]


def test_cli_export_kv_cache_state_on_an_old_target_is_a_clear_error(tiny_checkpoint, tmp_path):
    from click.testing import CliRunner

    from llama_ane.cli import main

    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["export", str(tiny_checkpoint(num_hidden_layers=5, head_dim=32)), "-o", str(out),
                                  "--kv-cache", "state", "--target", "iOS17", "--quiet"])
    assert r.exit_code != 0 and "iOS18" in r.output and "Traceback" not in r.output
    assert not out.exists()


@pytest.mark.slow
@pytest.mark.long
def test_smollm2_input_caches_give_the_default_greedy_tokens(smollm2_export, tmp_path):
    """SmolLM2 with input caches and decode functions: through the parity gate and inspect --strict,
    and the exported programs (mil, fp16) decode the tokens of the default export's (state caches,
    the prefill window decoding)."""
    from llama_ane.api import export_model

    out = export_model(None, tmp_path / "smollm2-inputs", kv_cache="inputs", decode_function="decode", verify=True,
                       progress=False)
    assert inspect_path(out).violations == []
    default, inputs = (llama_ane.load(p, backend="mil") for p in (smollm2_export, out))
    assert default.manifest["cache"]["kind"] == "state"
    prompt = default.tokenizer.encode("The capital of France is")
    assert inputs.generate(prompt, max_new_tokens=16).token_ids == default.generate(prompt, max_new_tokens=16).token_ids
