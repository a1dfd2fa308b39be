"""`llama-ane export --target coreai`: Core AI assets from the export plan, run by coreai-core's
runtime (the coreai backend) and compared with the torch modules they are converted from."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("coreai_torch", reason='needs the coreai extra: pip install -e ".[coreai]" (Python >= 3.11)')

pytestmark = pytest.mark.export

PROMPT_IDS = [5, 17, 42, 99, 3, 250, 7, 64, 11, 128, 33, 200]


def export_coreai(ckpt: Path, out: Path, *options: str) -> subprocess.CompletedProcess:
    """One `llama-ane export --target coreai` command on a tiny checkpoint. The context holds the
    128 tokens the parity gate scores: over fewer, one near-tie of a random model's flat logits
    would weigh more than the gate's 1% allows."""
    return subprocess.run([sys.executable, "-m", "llama_ane", "export", str(ckpt), "-o", str(out), "--target", "coreai",
                           "--context-length", "128", "--prefill-length", "16", "--branches", "0", *options],
                          capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def coreai_exports(tiny_checkpoint, tmp_path_factory):
    """fp32 and fp16 Core AI exports of one tiny model, each made (and verified) by one command."""
    ckpt = tiny_checkpoint(num_hidden_layers=3, head_dim=32)
    folders = {}
    for precision in ("fp32", "fp16"):
        out = tmp_path_factory.mktemp("coreai") / precision
        done = export_coreai(ckpt, out, "--precision", precision)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "passed" in done.stdout + done.stderr  # the parity gate ran on the coreai backend
        folders[precision] = out
    return ckpt, folders


def test_export_writes_aimodel_assets_the_manifest_names(coreai_exports):
    _, folders = coreai_exports
    manifest = json.loads((folders["fp32"] / "manifest.json").read_text())
    assert manifest["deployment_target"] == "coreai"
    files = {f["file"] for m in manifest["models"].values() for f in m["functions"].values()}
    assert files and all(name.endswith(".aimodel") and (folders["fp32"] / name / "main.mlirb").is_file()
                         for name in files)
    assert not list(folders["fp32"].glob("*.mlpackage"))
    for bucket in manifest["context_buckets"]:  # every bucket's prefill and decode are entry points
        fns = manifest["models"]["embeddings"]["functions"]
        assert {f["function_name"] for f in fns.values()} == set(fns)


def _greedy(model, steps: int = 12) -> list[int]:
    return [int(t) for t in model.generate(PROMPT_IDS, max_new_tokens=steps, temperature=0.0).token_ids]


def test_coreai_backend_greedy_tokens_equal_torch_fp32(coreai_exports):
    from llama_ane.runtime.model import load

    _, folders = coreai_exports
    tokens = {}
    for backend in ("auto", "torch"):  # auto: a Core AI export runs on the coreai backend
        model = load(folders["fp32"], backend=backend, **({"checkpoint": coreai_exports[0]} if backend == "torch"
                                                          else {}))
        try:
            tokens[model.backend.name] = _greedy(model)
        finally:
            model.close()
    assert tokens["coreai"] == tokens["torch"]


def test_coreai_fp16_top1_against_torch_fp16(coreai_exports):
    from llama_ane.runtime.model import load
    from llama_ane.verify import top1_agreement

    ckpt, folders = coreai_exports
    ids = list(range(3, 3 + 48))
    logits = {}
    for backend, options in (("coreai", {}), ("torch", {"checkpoint": ckpt, "precision": "fp16"})):
        model = load(folders["fp16"], backend=backend, **options)
        try:
            logits[backend] = np.asarray(model.score(ids), dtype=np.float32)
        finally:
            model.close()
    assert logits["coreai"].shape == logits["torch"].shape
    assert top1_agreement(logits["coreai"], logits["torch"], np.float16) >= 0.98


def test_structure_of_saved_assets(coreai_exports):
    from llama_ane.export.coreai import structure
    from llama_ane.limits import MAX_DIM

    _, folders = coreai_exports
    manifest = json.loads((folders["fp16"] / "manifest.json").read_text())
    for entry in manifest["models"].values():
        for f in entry["functions"].values():
            found, violations = structure(folders["fp16"] / f["file"], "fp16")
            assert violations == []
            assert 0 < found["largest_dim"][0] <= MAX_DIM
            assert f["function_name"] in found["functions"]
    # the same fp16 rule fails an fp32 asset: the check reads the program, not the manifest
    chunk = next(f["file"] for f in manifest["models"]["chunk_0"]["functions"].values())
    _, violations = structure(folders["fp32"] / chunk, "fp16")
    assert any(rule == "fp32-io" and "is float32, not float16" in message for rule, _, message in violations)


def test_other_compression_is_refused(tiny_checkpoint, tmp_path):
    done = export_coreai(tiny_checkpoint(), tmp_path / "out", "--quantize", "int8")
    assert done.returncode != 0
    assert done.stderr.strip().splitlines()[-1].startswith("Error: --target coreai compresses weights with coreai-opt")
    assert not (tmp_path / "out").exists()


def test_lut4_export_runs_and_passes_its_gate(tiny_checkpoint, tmp_path):
    out = tmp_path / "lut4"
    done = export_coreai(tiny_checkpoint(num_hidden_layers=3, head_dim=32), out, "--quantize", "lut4")
    assert done.returncode == 0, done.stderr[-3000:]
    manifest = json.loads((out / "manifest.json").read_text())
    assert {d["scheme"] for d in manifest["quantization"].values() if "scheme" in d} == {"lut4"}
    from llama_ane.export.coreai import structure

    chunk = next(f["file"] for f in manifest["models"]["chunk_0"]["functions"].values())
    found, _ = structure(out / chunk, "fp16")
    assert "coreai.lut_to_dense" in found["operations"]  # palettized weights in the program itself


@pytest.mark.slow
def test_smollm2_coreai_export_passes_its_parity_gate(tmp_path):
    """The default model (SmolLM2-135M-Instruct) to Core AI in one command, whose parity gate runs
    the assets on the coreai backend against the torch modules and transformers."""
    out = tmp_path / "smollm2"
    done = subprocess.run([sys.executable, "-m", "llama_ane", "export", "-o", str(out), "--target", "coreai",
                           "--context-length", "256", "--prefill-length", "64", "--branches", "0"],
                          capture_output=True, text=True, timeout=3600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = done.stdout + done.stderr
    assert "backend coreai" in report and "passed" in report
    assets = [p for p in out.iterdir() if p.is_dir()]
    assert assets and all(p.suffix == ".aimodel" for p in assets)
