"""Resident memory (contract/resident.py): what a runtime wires for the functions it holds, per
runtime, as modelled from the published measurements; the Python runtime's loads follow the plan."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from llama_ane.config import LlamaConfig
from llama_ane.contract import resident as rs
from llama_ane.contract.device_model import CHIPS, manifest_from_config
from llama_ane.testing import TINY_CONFIG

CFG = LlamaConfig.from_hf_dict(dict(TINY_CONFIG, vocab_size=320, num_hidden_layers=4, head_dim=32))


def weights(m: dict, model: str) -> int:
    w = m["weights"][model]
    return w.get("read_bytes", w["bytes"])


def test_core_ml_wires_a_copy_per_function_and_core_ai_one():
    """Core ML: each package's first function its weights x 1.0-1.9, each further one x 0.37-1.02
    (the measured range, its middle as the figure); Core AI: x 0.93 for all its entry points. An
    export with decode functions; the default holds one copy (test_prefill_decodes)."""
    m = manifest_from_config(CFG, context_length=1024, decode_function="decode")
    got = rs.resident(m)
    assert got.runtime == "Core ML"
    want = {"low": 0.0, "mid": 0.0, "high": 0.0}
    for model, entry in m["models"].items():
        n = len(entry["functions"])
        for case, (first, further) in {"low": (1.0, 0.37), "mid": (1.45, 0.695), "high": (1.9, 1.02)}.items():
            want[case] += weights(m, model) * (first + (n - 1) * further)
    assert got.bytes == pytest.approx(want["mid"], abs=2) and got.range == pytest.approx((want["low"], want["high"]), abs=2)
    assert got.weight_copy_bytes == pytest.approx(1.45 * sum(weights(m, k) for k in m["models"]), abs=2)
    # 5 functions in each package of weights (two buckets' prefill and decode, the cascade)
    assert {len(p["functions"]) for f, p in got.packages.items() if p["weight_bytes"]} == {5}
    assert got.copies > 2.5

    coreai = rs.resident(manifest_from_config(CFG, context_length=1024, target="coreai"))
    assert coreai.runtime == "Core AI" and coreai.copies == pytest.approx(1.0)
    assert coreai.bytes == pytest.approx(0.93 * sum(weights(m, k) for k in m["models"]), rel=1e-3)


def test_single_function_packages_are_a_copy_each():
    """iOS17 writes one package per function: each is loaded, and wired, on its own."""
    m = manifest_from_config(CFG, context_length=256, target="iOS17")
    got = rs.resident(m)
    assert all(len(p["functions"]) == 1 for p in got.packages.values())
    assert got.bytes == pytest.approx(sum(1.45 * weights(m, model) for model, e in m["models"].items()
                                          for _ in e["functions"]), abs=len(got.packages))


def test_first_load_runs_through_the_published_points():
    assert rs.first_load_seconds(7) == pytest.approx(46.0)
    assert rs.first_load_seconds(28) == pytest.approx(717.0)
    assert rs.first_load_seconds(14) < rs.first_load_seconds(15) and rs.first_load_seconds(0) == 0.0


def test_the_new_chips_and_how_they_run_luts():
    assert CHIPS["M6"].bandwidth_gb_s == CHIPS["M5 Max"].bandwidth_gb_s == (155.0, 165.0)
    assert "natively" in CHIPS["M6"].luts and "int8" in CHIPS["M5 Max"].luts
    assert CHIPS["M4"].luts is None  # no source


@pytest.mark.export
def test_info_prices_the_resident_memory(tmp_path):
    from llama_ane.commands.info import command as info
    from llama_ane.testing import make_tiny_checkpoint

    folder = make_tiny_checkpoint(tmp_path / "ckpt", num_hidden_layers=4, head_dim=32)
    for target in ("iOS18", "coreai"):
        args = ["--config", str(folder), "--context-length", "1024", "--target", target]
        out = json.loads(CliRunner().invoke(info, args + ["--json"]).output)
        want = rs.resident(manifest_from_config(LlamaConfig.from_hf_dict(json.loads((folder / "config.json").read_text())),
                                                context_length=1024, target=target))
        assert out["resident_bytes"] == want.bytes and out["weight_copy_bytes"] == want.weight_copy_bytes
        assert out["resident"]["first_load_s"] == pytest.approx(rs.first_load_seconds(want.functions), abs=0.1)
        assert "modelled" in out["resident"]["modelled"] and "Forge" in out["resident"]["source"]
        text = CliRunner().invoke(info, args).output
        assert f"resident  {want.runtime} holding its {want.functions} functions" in text


@pytest.mark.export
def test_the_runtime_holds_the_functions_of_the_plan(tiny_export):
    """A counting stand-in store under the pipeline, driven through prefill, decode, a cascade and
    speculative decoding: it ends holding exactly the plan's functions, whose resident bytes are
    what info reports."""
    import llama_ane
    from llama_ane.commands.info import command as info
    from llama_ane.contract.manifest import function_entry
    from llama_ane.runtime.backends.mil_backend import MilBackend
    from llama_ane.runtime.model import LlamaANEModel

    class CountingStore(MilBackend):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.held: dict[tuple[str, str], rs.Loaded] = {}
            self.loads = 0

        def predict(self, model, function, inputs):
            e = function_entry(self.manifest, model, function)
            if (e["file"], e["function_name"]) not in self.held:
                self.loads += 1
                self.held[(e["file"], e["function_name"])] = rs.Loaded(
                    model, function, e["file"], e["function_name"], rs.package_weight_bytes(self.manifest, model))
            return super().predict(model, function, inputs)

        def release(self, model):
            files = {f["file"] for f in self.manifest["models"][model]["functions"].values()}
            self.held = {k: v for k, v in self.held.items() if k[0] not in files}
            super().release(model)

    manifest = llama_ane.load(tiny_export, backend="mil").manifest
    store = CountingStore(tiny_export, manifest, precision="fp32")
    model = LlamaANEModel(tiny_export, manifest, store)
    prompt = list(range(5, 90))  # more than a prefill window
    model.generate(prompt, max_new_tokens=4)
    model.generate_branches(prompt[:40], [[7], [8], [9]], max_new_tokens=3)
    model.generate(prompt[:30] * 2, max_new_tokens=6, speculative="lookup", draft_tokens=4)
    model.close()
    plan = rs.load_plan(manifest)
    assert set(store.held) == {(f.file, f.function_name) for f in plan}
    assert store.loads == len(plan)  # each loaded once: nothing dropped and loaded again
    held = rs.resident(manifest, list(store.held.values()))
    reported = json.loads(CliRunner().invoke(info, [str(tiny_export), "--json"]).output)
    assert held.bytes == reported["resident_bytes"] == rs.resident(manifest).bytes
    assert np.isclose(held.weight_copy_bytes, reported["weight_copy_bytes"])


def test_core_ai_packages_stay_at_the_size_reported_stable():
    """Core AI programs of 1.1 GB and more were reported to panic the kernel on M6, 0.5-0.7 GB ran for
    thousands of calls: a Core AI export's packages hold at most 0.7 GB, where an iOS one holds ~1 GB."""
    from llama_ane.limits import FILE_LIMIT_BYTES

    llama_1b = LlamaConfig.from_hf_dict({
        "model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256,
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "tie_word_embeddings": True})
    coreai = manifest_from_config(llama_1b, target="coreai")
    ios = manifest_from_config(llama_1b)
    assert max(w["bytes"] for w in coreai["weights"].values()) <= FILE_LIMIT_BYTES["Core AI"] == 700_000_000
    assert max(w["bytes"] for w in ios["weights"].values()) > 900_000_000
    assert len(coreai["chunks"]) > len(ios["chunks"])


def test_bench_records_each_functions_first_load_and_wired_memory():
    """bench's wired-memory path, with a fake reader of the machine's wired memory and a backend that
    loads functions one at a time: a row per function of the plan, in its order, each with its
    load time, the wired memory it added and the model's figure for it, which sum to resident_bytes."""
    from llama_ane.runtime.backends.base import Backend
    from llama_ane.runtime.bench import measure_loads

    m = manifest_from_config(CFG, context_length=1024)

    class Loader(Backend):
        loaded: list = []

        def predict(self, model, function, inputs):
            raise AssertionError("nothing runs")

        def load_function(self, model, function):
            self.loaded.append((model, function))
            wired[0] += 1000 + len(self.loaded)  # what the machine wires for it
            return True

    wired = [5_000_000]
    got = measure_loads(Loader(), m, read_wired=lambda: wired[0])
    plan = rs.load_plan(m)
    assert [(r["model"], r["function"]) for r in got["functions"]] == [(f.model, f.function) for f in plan]
    assert Loader.loaded == [(f.model, f.function) for f in plan]
    assert [r["wired_delta_bytes"] for r in got["functions"]] == [sum(1000 + k for k in range(1, n + 1))
                                                                  for n in range(1, len(plan) + 1)]
    assert got["wired_delta_bytes"] == wired[0] - 5_000_000 and got["wired_before_bytes"] == 5_000_000
    assert sum(r["modelled_bytes"] for r in got["functions"]) == pytest.approx(got["modelled_resident_bytes"],
                                                                               abs=len(plan))
    assert got["modelled_resident_bytes"] == rs.resident(m).bytes
    assert all(r["load_s"] >= 0 for r in got["functions"]) and "modelled" in got["modelled"]
    assert measure_loads(Loader(), m, read_wired=lambda: None) is None  # off macOS: no wired memory to read

    class CannotLoad(Loader):
        def load_function(self, model, function):
            return False

    assert measure_loads(CannotLoad(), m, read_wired=lambda: 1) is None


@pytest.mark.macos
def test_the_wired_memory_of_this_mac_is_read():
    from llama_ane.memory import wired_bytes

    assert wired_bytes() > 0


PUBLISHED = {  # the published shapes (their config.json's sizes)
    "Llama-3.2-1B": dict(model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
                         tie_word_embeddings=True),
    "Llama-3.2-3B": dict(model_type="llama", hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                         num_attention_heads=24, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                         tie_word_embeddings=True),
    "Qwen3-4B": dict(model_type="qwen3", hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                     tie_word_embeddings=True),
}


@pytest.mark.parametrize("name", list(PUBLISHED))
@pytest.mark.parametrize("target", ["iOS18", "macOS15"])
def test_the_default_export_of_a_published_shape_holds_one_copy(name, target):
    """At default options a Core ML export keeps one function per package (the prefill window serves
    every phase), so its modelled resident memory is one copy of its weights, within the 1.25x the
    design allows; with decode functions it would hold more than two."""
    cfg = LlamaConfig.from_hf_dict(dict(PUBLISHED[name], max_position_embeddings=131072, rms_norm_eps=1e-5))
    wired = rs.resident(manifest_from_config(cfg, target=target))
    assert wired.runtime == "Core ML" and wired.bytes <= 1.25 * wired.weight_copy_bytes
    assert all(len(p["functions"]) == 1 for p in wired.packages.values() if p["weight_bytes"])
    assert rs.resident(manifest_from_config(cfg, target=target, decode_function="decode")).copies > 2
