"""The device cost model (contract/device_model.py, contract/traffic.py) and `llama-ane info`'s use of it:
bytes and calls counted by hand on tiny shapes, the calls checked against what the pipeline really
calls, the timing formula on made-up chips, and the CLI's options and refusals."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from click.testing import CliRunner

from llama_ane.cli import main
from llama_ane.contract import device_model as dm
from llama_ane.contract.traffic import bucket_for, kv_read_bytes, kv_write_bytes, weight_read_bytes
from llama_ane.errors import InvalidArgumentError

from support.traffic import CTX, TINY

KV_COLUMN = 5 * 64 * 2  # bytes of one position of every layer's K (or V) cache: 5 layers x 64 channels, fp16


def tiny_manifest(**options) -> dict:
    """The planned export of TINY with decode functions; with a verify window of 16 where the caches
    allow one, the LM head a file of its own unless asked."""
    options = {"context_length": CTX, "prefill_length": 64, "layers_per_chunk": 2, "fold_lm_head": "no",
               "decode_function": "decode",
               "verify_window": 0 if options.get("kv_cache") == "state" else 16, **options}
    return dm.manifest_from_config(TINY, **options)


@pytest.fixture(scope="module")
def verify_export(tiny_checkpoint, tmp_path_factory):
    """tiny_export's shapes with a verify function of 16 tokens (input caches, as a device runs them)
    and the LM head in a file of its own, as tiny_manifest plans it."""
    from llama_ane.api import export_model

    return export_model(tiny_checkpoint(num_hidden_layers=5, head_dim=32), tmp_path_factory.mktemp("export") / "v",
                        context_length=CTX, prefill_length=64, layers_per_chunk=2, verify_window=16,
                        fold_lm_head="no", decode_function="decode", progress=False, verify=False)


def run_cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def assert_one_error_line(result, *words: str) -> str:
    assert result.exit_code != 0
    assert "Traceback" not in result.stderr + result.stdout
    lines = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(lines) == 1, result.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


# ---- bytes and calls from a manifest -----------------------------------------------------------------------------

def test_bytes_of_a_decode_step_by_hand():
    m = tiny_manifest()
    stepped = sum(m["weights"][name]["bytes"] for name in ("chunk_0", "chunk_1", "chunk_2", "lm_head"))
    assert weight_read_bytes(m) == stepped + 64 * 2  # + one embedding row
    assert kv_read_bytes(m, CTX) == 2 * KV_COLUMN * CTX  # K and V, every position of the context
    assert kv_write_bytes(m, CTX) == 2 * kv_read_bytes(m, CTX)  # the cache update reads and rewrites them
    assert kv_write_bytes(m, CTX, kv_cache="state") == 2 * KV_COLUMN  # one column per state
    assert kv_read_bytes(m, 64) == 2 * KV_COLUMN * 64  # a smaller bucket reads less


def test_calls_per_step_by_hand():
    m = tiny_manifest()  # 1 embeddings file, 3 chunks, 1 LM head file, a cache update per chunk
    assert dm.calls_per_step(m, "decode") == dm.calls_per_step(m, "prefill") == 1 + 3 + 1 + 3
    assert dm.calls_per_step(m, "verify") == 8 and dm.calls_per_step(m, "decode_branches") == 8
    s = tiny_manifest(kv_cache="state", target="iOS18")
    assert dm.calls_per_step(s, "decode") == 5  # the chunks write their own states
    assert dm.calls_per_step(s, "decode_branches") == 8  # the suffix caches still go through the update model
    assert dm.decode_step(s, 10).calls == 5
    folded = tiny_manifest(kv_cache="state", fold_lm_head="auto")
    assert dm.calls_per_step(folded, "decode") == 4  # the last chunk computes the logits
    assert dm.calls_per_step(folded, "decode_branches") == 7


def test_bucket_for():
    m = tiny_manifest()
    assert bucket_for(m, 1) == bucket_for(m, CTX) == CTX
    m["context_buckets"] = [64, 128, CTX]
    assert [bucket_for(m, n) for n in (1, 64, 65, 128, 200)] == [64, 64, 128, 128, CTX]
    step = dm.decode_step(m, 70)  # 71 positions with the new token: the 128 bucket runs
    assert step.bytes == dm.decode_step(m, 100).bytes < dm.decode_step(m, 200).bytes
    assert dm.report(m, 70, [dm.CHIPS["M4"]])["kv_read_bytes"] == 2 * KV_COLUMN * 128
    # a cascade's prefix of 64 tokens fits the 64 bucket: its new tokens go to the suffix caches
    assert dm.cascade_cost(m, 64, 8).bytes < dm.cascade_cost(m, 65, 8).bytes


# ---- time per chip -----------------------------------------------------------------------------------------------

def flat_chip(gb_s: float = 100.0, call_ms: float = 1.0, tflops: float = 1e6) -> dm.Chip:
    return dm.Chip("test", (gb_s, gb_s), (call_ms, call_ms), tflops, "assumed", "assumed")


def test_decode_time_is_bytes_over_bandwidth_plus_calls():
    m = tiny_manifest()
    step = dm.decode_step(m, 100)
    assert step.tokens == 1
    assert flat_chip().seconds(step) == pytest.approx(step.bytes / 100e9 + 8 * 1e-3)
    assert flat_chip().tokens_per_s(step) == pytest.approx(1 / (step.bytes / 100e9 + 8e-3))
    chip = dm.Chip("range", (50.0, 100.0), (0.1, 0.3), 1e6, "assumed", "assumed")
    slow, mid, fast = (chip.tokens_per_s(step, case) for case in ("slow", "mid", "fast"))
    assert slow == pytest.approx(1 / (step.bytes / 50e9 + 8 * 0.3e-3))
    assert fast == pytest.approx(1 / (step.bytes / 100e9 + 8 * 0.1e-3))
    assert slow < mid < fast


def test_compute_bound_windows():
    m = tiny_manifest()
    window = dm.step_cost(m, "prefill", 0)
    # 2 flops per weight per token (the dense weights of the chunks and the head) + attention
    params = weight_read_bytes(m, dense=True) / 2
    attention = 4 * 5 * 4 * 32 * (CTX + 64)
    assert window.flops == pytest.approx(64 * (2 * params + attention))
    slow = flat_chip(gb_s=1e9, call_ms=0.0, tflops=1e-6)  # compute is all that counts
    assert slow.seconds(window) == pytest.approx(window.flops / 1e6)


def test_prefill_windows():
    m = tiny_manifest()
    p = dm.prefill_cost(m, 130)  # windows of 64, 64 and 2 tokens
    assert p.tokens == 130 and p.calls == 3 * dm.calls_per_step(m, "prefill")
    one = dm.prefill_cost(m, 129)  # 64, 64, then one token through the decode function
    assert one.tokens == 129 and one.bytes == 2 * dm.step_cost(m, "prefill", 0).bytes + dm.decode_step(m, 128).bytes


def test_cascade_reads_the_prefix_once():
    m = tiny_manifest()  # branch width 8, suffix 256
    step = dm.cascade_cost(m, 100, 8)
    suffix = 2 * 5 * 8 * 64 * 256 * 2  # K and V of 8 branches x 256 positions, fp16
    assert step.tokens == 8 and step.calls == 8
    assert step.bytes == (weight_read_bytes(m) + 2 * KV_COLUMN * CTX + suffix + 2 * suffix
                          + dm.window_io_bytes(m, "decode_branches"))
    two = dm.cascade_cost(m, 100, 9)  # a second group of the exported width
    assert two.tokens == 9 and two.bytes == 2 * step.bytes and two.calls == 16
    chip = dm.CHIPS["M4"]
    assert chip.tokens_per_s(step) > 5 * chip.tokens_per_s(dm.decode_step(m, 100))


def test_verify_break_even():
    m = tiny_manifest()  # verify window 16
    memory_bound = flat_chip()
    even = dm.break_even_tokens(m, 100, memory_bound)
    assert 1 <= even < 1.01  # the same weights and caches read, a slightly larger window passed between models
    compute_bound = flat_chip(gb_s=1e9, call_ms=0.0, tflops=1e-3)
    assert 16 <= dm.break_even_tokens(m, 100, compute_bound) < 17  # 16 tokens of compute for one decode's
    calls_bound = flat_chip(gb_s=1e9, call_ms=1000.0)
    assert dm.break_even_tokens(m, 100, calls_bound) == pytest.approx(1.0)  # the same calls


def test_chip_table_and_lookup():
    assert {"M1", "M4 Max", "M5", "A17 Pro", "A19 Pro"} <= set(dm.CHIPS)
    assert dm.chip("m4max") is dm.CHIPS["M4 Max"] and dm.chip("A18 pro") is dm.CHIPS["A18 Pro"]
    with pytest.raises(InvalidArgumentError, match="--chip 'M9'.*M1, M2"):
        dm.chip("M9")
    for c in dm.CHIPS.values():
        assert c.bandwidth_gb_s[0] <= c.bandwidth_gb_s[1] and c.per_call_ms[0] <= c.per_call_ms[1]
        assert all(s.startswith(("published", "assumed")) for s in c.describe()["sources"].values())


def test_report_refusals():
    m = tiny_manifest()
    for kwargs, flag in [({"filled": CTX}, "--filled"), ({"filled": -1}, "--filled"),
                         ({"filled": 0, "prompt_length": 0}, "--prompt-length"),
                         ({"filled": 0, "prompt_length": CTX + 1}, "--prompt-length"),
                         ({"filled": 1, "branches": 0}, "--branches"), ({"filled": 0, "branches": 2}, "--filled")]:
        with pytest.raises(InvalidArgumentError, match=flag):
            dm.report(m, chips=[dm.CHIPS["M1"]], **kwargs)
    with pytest.raises(InvalidArgumentError, match="--branches"):
        dm.report(tiny_manifest(branch_width=0), 0, [dm.CHIPS["M1"]], branches=4)


# ---- against an export and the runtime -------------------------------------------------------------------------

@pytest.mark.export
def test_config_path_gives_the_exports_own_bytes_and_calls(verify_export):
    from llama_ane.contract.manifest import read_manifest

    exported = read_manifest(verify_export)
    planned = tiny_manifest()
    assert planned["weights"] == exported["weights"] and planned["chunks"] == exported["chunks"]
    for n in (0, 100, CTX - 1):
        assert dm.decode_step(planned, n) == dm.decode_step(exported, n)
    assert dm.prefill_cost(planned, 200) == dm.prefill_cost(exported, 200)


@pytest.mark.export
def test_calls_are_what_the_pipeline_calls(verify_export):
    """Count the backend's predictions in real steps, run with the cache-update model as a device runs it."""
    import llama_ane

    model = llama_ane.load(verify_export, backend="torch", direct_cache=False)
    pipeline, backend = model.pipeline, model.backend
    calls = []
    predict = backend.predict
    backend.predict = lambda name, fn, inputs: calls.append((name, fn)) or predict(name, fn, inputs)
    try:
        pipeline.reset()
        pipeline.run_window([5, 6, 7])
        pipeline.wait()
        assert len(calls) == dm.calls_per_step(model.manifest, "prefill")
        calls.clear()
        pipeline.run_window([8])
        pipeline.wait()
        assert len(calls) == dm.calls_per_step(model.manifest, "decode") == dm.decode_step(model.manifest, 3).calls
        calls.clear()
        tree_mask = np.zeros((1, 1, 2, 2), np.float32)
        tree_mask[0, 0, 0, 1] = -1e4
        pipeline.verify_tree(np.array([9, 10], np.int32), np.array([0, 1], np.int32), tree_mask)
        pipeline.accept([0, 1])
        pipeline.wait()
        assert len(calls) == dm.calls_per_step(model.manifest, "verify")
    finally:
        model.close()


# ---- the command line --------------------------------------------------------------------------------------------

@pytest.mark.export
def test_info_models_an_export(verify_export):
    r = run_cli("info", verify_export, "--filled", "100", "--prompt-length", "130", "--branches", "9")
    assert r.exit_code == 0, r.stderr
    assert "8 Core ML calls per decode token" in r.stdout and "modelled" in r.stdout
    for name in dm.CHIPS:
        assert f"  {name} " in r.stdout
    assert "TTFT ms (P=130)" in r.stdout and "cascade tok/s (B=9)" in r.stdout and "verify break-even" in r.stdout
    j = run_cli("info", verify_export, "--filled", "100", "--chip", "m4 max", "--json")
    assert j.exit_code == 0, j.stderr
    got = json.loads(j.stdout)["decode_step_bytes"]
    from llama_ane.contract.manifest import read_manifest
    m = read_manifest(verify_export)
    assert got["filled"] == 100 and got["calls_per_token"] == 8
    assert got["weight_read_bytes"] == weight_read_bytes(m) and got["kv_read_bytes"] == 2 * KV_COLUMN * CTX
    assert list(got["chips"]) == ["M4 Max"]
    assert got["chips"]["M4 Max"]["tokens_per_s"] == pytest.approx(dm.CHIPS["M4 Max"].tokens_per_s(dm.decode_step(m, 100)))


@pytest.mark.export
def test_info_option_errors(tiny_export, tiny_checkpoint):
    assert_one_error_line(run_cli("info", tiny_export, "--chip", "M9"), "--chip", "M9", "M4 Max", "A19 Pro")
    assert_one_error_line(run_cli("info", tiny_export, "--filled", str(CTX)), "--filled", "0..255")
    assert_one_error_line(run_cli("info", tiny_export, "--prompt-length", "0"), "--prompt-length")
    assert_one_error_line(run_cli("info", tiny_export, "--branches", "0"), "--branches")
    assert_one_error_line(run_cli("info", tiny_export, "--context-length", "512"), "--context-length", "--config")
    assert_one_error_line(run_cli("info", tiny_export, "--config", tiny_checkpoint()), "OUT", "--config")
    assert_one_error_line(run_cli("info"), "OUT", "--config")
    assert_one_error_line(run_cli("info", tiny_export, "--bandwidth", "nan"), "--bandwidth", "finite")


def test_info_from_a_config(tmp_path):
    cfg = {**TINY.to_hf_dict(), "model_type": "llama"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    r = run_cli("info", "--config", tmp_path, "--context-length", "256", "--chip", "A18 Pro")
    assert r.exit_code == 0, r.stderr
    assert "not exported" in r.stdout and "modelled" in r.stdout and "A18 Pro" in r.stdout and "M1 " not in r.stdout
    j = run_cli("info", "--config", tmp_path / "config.json", "--context-length", "256", "--quantize", "lut4",
                "--kv-cache", "state", "--json")
    assert j.exit_code == 0, j.stderr
    got = json.loads(j.stdout)
    assert got["context_length"] == 256 and got["quantization"]["mlp"]["scheme"] == "lut4"
    step = got["decode_step_bytes"]
    assert step["calls_per_token"] == 1 + len(got["chunks"]) + len(got["lm_head"]["models"])  # no cache updates
    assert step["weight_read_bytes"] < step["weight_read_bytes_dense"] / 3  # 4-bit LUTs, with their tables
    # int4 in blocks is decompressed when the model loads on the Neural Engine: it reads fp16 bytes
    j = run_cli("info", "--config", tmp_path / "config.json", "--context-length", "256", "--quantize", "int4", "--json")
    step = json.loads(j.stdout)["decode_step_bytes"]
    assert step["weight_read_bytes"] == step["weight_read_bytes_dense"]
    assert set(step["chips"]) == set(dm.CHIPS) and all(math.isfinite(c["tokens_per_s"]) for c in step["chips"].values())


def test_info_on_a_checkpoint_folder_points_to_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY.to_hf_dict()))
    assert_one_error_line(run_cli("info", tmp_path), "not a llama-ane export", "manifest.json", "--config")


def test_info_config_errors(tmp_path):
    assert_one_error_line(run_cli("info", "--config", tmp_path / "nowhere.json"), "--config", "nowhere.json")
    (tmp_path / "bad.json").write_text("{not json")
    assert_one_error_line(run_cli("info", "--config", tmp_path / "bad.json"), "--config", "not valid JSON")
    (tmp_path / "gpt2.json").write_text(json.dumps({"model_type": "gpt2"}))
    assert_one_error_line(run_cli("info", "--config", tmp_path / "gpt2.json"), "gpt2")
    (tmp_path / "config.json").write_text(json.dumps(TINY.to_hf_dict()))
    assert_one_error_line(run_cli("info", "--config", tmp_path, "--quantize", "int3"), "--quantize", "int3")
    assert_one_error_line(run_cli("info", "--config", tmp_path, "--context-length", "100"), "--context-length")
