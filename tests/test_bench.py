"""`llama-ane bench`: measured numbers beside the cost model's, the bucket each decode ran in, Core
ML calls counted at the backend, labels off a device, option errors by flag, and (on macOS) the
compute plan."""

from __future__ import annotations

import json
import math
import platform
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from llama_ane.cli import main
from llama_ane.contract import device_model as dm
from llama_ane.contract.traffic import bucket_for
from llama_ane.runtime import bench

BUCKETS = (128, 256)
WIDTH = 4


def run_cli(*args):
    return CliRunner().invoke(main, ["bench", *map(str, args)])


def assert_one_error(r, *words):
    assert r.exit_code == 1, r.output
    lines = [line for line in r.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: "), r.output
    for w in words:
        assert w in lines[0], (w, lines[0])


@pytest.fixture(scope="module")
def bucket_export(tiny_checkpoint, tmp_path_factory):
    """A tiny export with decode functions, two context buckets (128, 256) and a cascade of width 4."""
    from llama_ane.api import export_model

    ckpt = tiny_checkpoint(num_hidden_layers=2, head_dim=32)
    return export_model(ckpt, tmp_path_factory.mktemp("bench") / "tiny", context_length=256, prefill_length=32,
                        layers_per_chunk=1, branch_width=WIDTH, suffix_length=32, context_buckets=BUCKETS,
                        decode_function="decode", progress=False, verify=False)


# ---- options (no export) --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, flag", [
    (["--prompt-lengths", "128,many"], "--prompt-lengths"),
    (["--prompt-lengths", "0"], "--prompt-lengths"),
    (["--filled", "-1"], "--filled"),
    (["--filled", "1.5"], "--filled"),
    (["--repeats", "0"], "--repeats"),
    (["--warmup", "-1"], "--warmup"),
    (["--branches", "-1"], "--branches"),
    (["--chip", "M99"], "--chip"),
])
def test_bad_options_are_refused_by_flag(argv, flag, tmp_path):
    assert_one_error(run_cli(tmp_path, *argv), flag)


def test_an_existing_json_file_is_kept_without_force(tmp_path):
    kept = tmp_path / "bench.json"
    kept.write_text("mine")
    assert_one_error(run_cli(tmp_path, "--json", kept), "--json", "--force")
    assert kept.read_text() == "mine"
    assert_one_error(run_cli(tmp_path, "--json", tmp_path / "no" / "b.json"), "--json", "does not exist")


def test_a_folder_without_a_manifest_is_refused(tmp_path):
    assert_one_error(run_cli(tmp_path), "not a llama-ane export")


def planned(context_length: int = 1024, **options) -> dict:
    from llama_ane.config import LlamaConfig
    from llama_ane.testing import TINY_CONFIG

    return dm.manifest_from_config(LlamaConfig.from_hf_dict(dict(TINY_CONFIG, vocab_size=320,
                                                                 max_position_embeddings=4096)),
                                   context_length=context_length, **options)


def test_defaults_decode_in_every_bucket_and_at_the_full_context():
    assert planned(1024)["context_buckets"] == [1024]  # the default keeps one function: one bucket
    m = planned(1024, decode_function="decode")
    assert m["context_buckets"] == [512, 1024]
    opts = bench.BenchOptions().resolved(m)
    assert opts.filled == (0, 512, 1023) and opts.prompt_lengths == (128,) and opts.branches == m["branch_width"]
    assert [bucket_for(m, f + 1) for f in opts.filled] == [512, 1024, 1024]
    assert bench.BenchOptions().resolved(planned(1024, branch_width=0)).branches is None
    assert bench.BenchOptions(branches=0).resolved(m).branches is None  # 0: no cascade steps


@pytest.mark.parametrize("options, flag", [
    ({"prompt_lengths": (1025,)}, "--prompt-lengths"),
    ({"filled": (1024,)}, "--filled"),
])
def test_lengths_outside_the_context_are_refused_by_flag(options, flag):
    with pytest.raises(bench.InvalidArgumentError, match=flag):
        bench.BenchOptions(**options).resolved(planned(1024))


def test_branches_need_a_cascade_function():
    with pytest.raises(bench.InvalidArgumentError, match="--branches"):
        bench.BenchOptions(branches=4).resolved(planned(1024, branch_width=0))


def test_the_mac_chip_is_read_from_its_brand_string():
    assert bench.detected_chip("Apple M4 Max").name == "M4 Max"
    assert bench.detected_chip("Apple M1").name == "M1"
    assert bench.detected_chip("Apple M2 Ultra") is None  # not in the model's table: no guess
    assert bench.detected_chip("AMD EPYC 7B13") is None
    linux = {"platform": "Linux", "cpu": "Apple M4"}  # off macOS only --chip names a chip
    assert bench.resolve_chip(None, linux) == (None, None)
    assert bench.resolve_chip("m4 max", linux)[0].name == "M4 Max"


# ---- the compute plan's summary, on stand-ins for coremltools' objects ---------------------------------------------

class MLNeuralEngineComputeDevice:
    pass


class MLGPUComputeDevice:
    pass


class MLCPUComputeDevice:
    pass


def op(name, device, weight=None, blocks=()):
    return SimpleNamespace(operator_name=name, device=device, weight=weight, blocks=list(blocks))


class FakePlan:
    def get_compute_device_usage_for_mlprogram_operation(self, o):
        return None if o.device is None else SimpleNamespace(preferred_compute_device=o.device())

    def get_estimated_cost_for_mlprogram_operation(self, o):
        return None if o.weight is None else SimpleNamespace(weight=o.weight)


def test_plan_summary_counts_ops_and_cost_per_device():
    inner = SimpleNamespace(operations=[op("gather", MLCPUComputeDevice, 0.1)])
    ops = [op("const", None), op("conv", MLNeuralEngineComputeDevice, 0.5), op("conv", MLNeuralEngineComputeDevice, 0.2),
           op("softmax", MLGPUComputeDevice, 0.1), op("cond", MLCPUComputeDevice, 0.1, blocks=[inner])]
    s = bench.plan_summary(FakePlan(), SimpleNamespace(block=SimpleNamespace(operations=ops)))
    assert s["ops"] == {"ANE": 2, "GPU": 1, "CPU": 2} and s["unplanned_ops"] == 1
    assert s["ane_op_share"] == pytest.approx(2 / 5) and s["ane_cost_share"] == pytest.approx(0.7 / 1.0)
    assert s["off_ane_ops"] == {"softmax": 1, "cond": 1, "gather": 1}
    uncosted = bench.plan_summary(FakePlan(), SimpleNamespace(block=SimpleNamespace(
        operations=[op("conv", MLNeuralEngineComputeDevice)])))
    assert uncosted["cost"] is None and uncosted["ane_cost_share"] is None and uncosted["ane_op_share"] == 1


# ---- a run off a device ---------------------------------------------------------------------------------------------

FILLED = (0, 127, 200)
REPEATS = 2


@pytest.mark.export
def test_linux_run_measures_what_the_model_predicts(bucket_export, tmp_path, monkeypatch):
    from llama_ane.contract.manifest import read_manifest

    def no_plan(*args):
        raise AssertionError("the compute plan is read on Core ML only")
    monkeypatch.setattr(bench, "compute_plan", no_plan)
    out = tmp_path / "bench.json"
    r = run_cli(bucket_export, "--backend", "torch", "--prompt-lengths", "40,64", "--filled",
                ",".join(map(str, FILLED)), "--branches", "6", "--repeats", REPEATS, "--chip", "M4",
                "--json", out)
    assert r.exit_code == 0, r.output
    assert "Not device numbers" in r.output and "modelled M4" in r.output
    got = json.loads(out.read_text())
    m = read_manifest(bucket_export)
    assert set(got) >= {"format", "device", "label", "backend", "machine", "versions", "export", "options", "chip",
                        "modelled", "load_s", "prefill", "decode", "cascade", "memory", "compute_plan"}
    assert got["device"] is False and got["backend"] == "torch" and "not on an Apple Neural Engine" in got["label"]
    assert got["compute_plan"] is None and got["chip"]["name"] == "M4" and got["chip"]["source"] == "--chip"
    assert set(got["machine"]) >= {"platform", "os", "architecture", "cpu", "cpu_count", "memory_bytes"}
    assert got["versions"]["llama_ane"] and got["versions"]["numpy"]
    assert got["export"]["context_buckets"] == list(BUCKETS) and got["export"]["branch_width"] == WIDTH
    chip = dm.CHIPS["M4"]

    assert [p["prompt_length"] for p in got["prefill"]] == [40, 64]
    for p in got["prefill"]:
        cost = dm.prefill_cost(m, p["prompt_length"])
        assert p["calls"] == cost.calls == p["modelled"]["calls"]
        assert p["modelled"]["ttft_ms"] == pytest.approx(chip.seconds(cost) * 1e3)
        assert len(p["timings"]["samples_s"]) == REPEATS and len(p["timings"]["warmup_s"]) == 1
        assert p["ttft_ms"] == pytest.approx(p["timings"]["median_s"] * 1e3)

    assert [d["filled"] for d in got["decode"]] == list(FILLED)
    assert [d["bucket"] for d in got["decode"]] == [128, 128, 256]
    assert [d["function"] for d in got["decode"]] == ["decode_128", "decode_128", "decode"]
    for d in got["decode"]:
        assert d["calls_per_token"] == dm.calls_per_step(m, "decode") == d["modelled"]["calls"]
        assert d["modelled"]["attended_positions"] == d["bucket"]
        assert d["modelled"]["tokens_per_s"] == pytest.approx(chip.tokens_per_s(dm.decode_step(m, d["filled"])))
        assert d["tokens_per_sample"] == min(bench.DECODE_TOKENS, d["bucket"] - d["filled"])
        assert d["tokens_per_s"] > 0 and len(d["timings"]["samples_s"]) == REPEATS
    assert got["decode"][1]["tokens_per_sample"] == 1  # 127 filled: one token left in the 128 bucket

    assert [c["prefix"] for c in got["cascade"]] == [127, 200]  # no cascade over an empty prefix
    for c in got["cascade"]:
        assert c["groups"] == math.ceil(6 / WIDTH) == 2
        assert c["calls_per_step"] == dm.cascade_cost(m, c["prefix"], 6).calls == c["modelled"]["calls"]

    mem = got["memory"]
    assert mem["kind"] == ("pss" if platform.system() == "Linux" else "rss")
    assert mem["peak_bytes"] >= mem["after_load_bytes"] > 0


@pytest.mark.export
def test_without_a_chip_off_macos_nothing_is_modelled(bucket_export):
    got = bench.run_bench(bucket_export, "mil", bench.BenchOptions(prompt_lengths=(3,), filled=(5,), branches=0,
                                                                     repeats=1, warmup=0))
    from llama_ane.contract.manifest import read_manifest

    m = read_manifest(bucket_export)
    assert got["backend"] == "mil" and got["device"] is False and got["chip"] is None and got["modelled"] is None
    assert "not on an Apple Neural Engine" in got["label"] and got["cascade"] == []
    assert got["decode"][0]["modelled"] is None and got["prefill"][0]["modelled"] is None
    assert got["decode"][0]["calls_per_token"] == dm.calls_per_step(m, "decode")
    assert got["prefill"][0]["calls"] == dm.prefill_cost(m, 3).calls
    assert got["prefill"][0]["timings"]["warmup_s"] == []


@pytest.mark.export
def test_a_default_export_benches_its_cascade_through_the_prefill_window(tiny_checkpoint, tmp_path):
    """The default export decodes and cascades through its prefill window (no decode_branches):
    bench measures the branches as generate_branches runs them, calls as the device model counts."""
    from llama_ane.api import export_model
    from llama_ane.contract.manifest import read_manifest

    out = export_model(tiny_checkpoint(num_hidden_layers=2, head_dim=32), tmp_path / "default", context_length=256,
                       prefill_length=32, branch_width=WIDTH, progress=False, verify=False)
    m = read_manifest(out)
    assert m["cascade"] == "window"
    got = bench.run_bench(out, "torch", bench.BenchOptions(prompt_lengths=(3,), filled=(40,), branches=6,
                                                           repeats=1, warmup=0))
    [c] = got["cascade"]
    assert c["function"] == "prefill" and c["groups"] == 2 and c["tokens_per_s"] > 0
    assert c["calls_per_step"] == dm.cascade_cost(m, 40, 6).calls


# ---- macOS: Core ML and its compute plan ----------------------------------------------------------------------------

@pytest.mark.macos
@pytest.mark.export
def test_coreml_run_is_labelled_device_and_reads_the_compute_plan(bucket_export):
    from llama_ane.contract.manifest import read_manifest

    got = bench.run_bench(bucket_export, "coreml", bench.BenchOptions(prompt_lengths=(40,), filled=(0, 200),
                                                                        repeats=2))
    m = read_manifest(bucket_export)
    assert got["device"] is True and got["backend"] == "coreml" and got["compute_units"] == "CPU_AND_NE"
    assert got["machine"]["platform"] == "Darwin" and got["machine"]["macos"]
    for d in got["decode"]:
        assert d["calls_per_token"] == dm.calls_per_step(m, "decode")
    plan = got["compute_plan"]
    files = {e["file"] for model in m["models"].values() for e in model["functions"].values()}
    assert set(plan["packages"]) == files
    for file, functions in plan["packages"].items():
        exported = {e["function_name"] for model in m["models"].values() for e in model["functions"].values()
                    if e["file"] == file}
        assert exported <= set(functions) or len(functions) == 1
        for s in functions.values():
            assert sum(s["ops"].values()) > 0 and 0 <= s["ane_op_share"] <= 1
            assert s["ane_cost_share"] is None or 0 <= s["ane_cost_share"] <= 1
    assert 0 <= plan["ane_op_share"] <= 1 and sum(plan["ops"].values()) > 0


@pytest.mark.macos
@pytest.mark.export
def test_coreml_cli_prints_the_plan_and_the_mac_chip(bucket_export, tmp_path):
    out = tmp_path / "bench.json"
    r = run_cli(bucket_export, "--prompt-lengths", "40", "--filled", "0", "--repeats", 1, "--json", out)
    assert r.exit_code == 0, r.output
    got = json.loads(out.read_text())
    assert got["device"] is True and "Device numbers" in r.output and "of ops on the Neural Engine" in r.output
    found = bench.detected_chip(got["machine"]["cpu"])
    assert (got["chip"] or {}).get("name") == (found.name if found else None)
