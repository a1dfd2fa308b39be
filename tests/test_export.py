"""The export folder: manifest records, self-validation (and its failures on tampered copies),
atomic writes, and the backends' view of it."""

from __future__ import annotations

import hashlib
import json
import platform
import shutil
from pathlib import Path

import numpy as np
import pytest

import llama_ane
from llama_ane.contract.manifest import FORMAT_VERSION, ManifestError, read_manifest, write_manifest
from llama_ane.export.validate import MAX_DIM, validate_export
from llama_ane.testing import CHAT_TEMPLATE
from conftest import convert_to


@pytest.fixture(scope="module")
def manifest(tiny_export):
    return json.loads((tiny_export / "manifest.json").read_text())


@pytest.fixture
def copy(tiny_export, tmp_path):
    """A private copy of the tiny export to tamper with."""
    dest = tmp_path / "copy"
    shutil.copytree(tiny_export, dest)
    return dest


def rewrite_manifest(folder: Path, edit) -> None:
    """Apply `edit` to the manifest and write it back with fresh hashes (as a careless tool would)."""
    m = json.loads((folder / "manifest.json").read_text())
    edit(m)
    m["files"] = list(m["files"])
    write_manifest(folder, m)


def all_tensors(manifest):
    for model, entry in manifest["models"].items():
        for fn, f in entry["functions"].items():
            for kind in ("inputs", "outputs"):
                for t in f[kind]:
                    yield model, fn, kind, t


# ---- what a good export records --------------------------------------------------------------------

def test_manifest_records(manifest, tiny_export):
    assert manifest["format_version"] == 2
    assert manifest["context_length"] == 256 and manifest["prefill_length"] == 64
    assert manifest["precision"] == "fp16" and manifest["multifunction"] is True
    assert manifest["source"]["kind"] == "hf"
    cfg = manifest["config"]
    assert cfg["num_hidden_layers"] == 5 and cfg["model_type"] == "llama"
    assert manifest["created_by"]["llama_ane"] == llama_ane.__version__
    assert "coremltools" in manifest["created_by"]
    assert read_manifest(tiny_export) == manifest


def test_every_layer_in_exactly_one_chunk(manifest):
    plan = [c["layers"] for c in manifest["chunks"]]
    assert plan == [[0, 1], [2, 3], [4]]
    kv = manifest["cache"]["channels"]
    assert kv == manifest["config"]["num_key_value_heads"] * manifest["config"]["head_dim"]
    for chunk in manifest["chunks"]:
        fns = manifest["models"][chunk["model"]]["functions"]
        k_cache = next(t for t in fns["decode"]["inputs"] if t["name"] == "k_cache")
        assert k_cache["shape"] == [len(chunk["layers"]), kv, 1, manifest["context_length"]]
        for fn, update in chunk["cache_update"].items():
            assert update in manifest["models"]["cache_update"]["functions"]


def test_tokenizer_records(manifest, tiny_export):
    from transformers import AutoTokenizer

    tok = manifest["tokenizer"]
    hf = AutoTokenizer.from_pretrained(manifest["source"]["path"])
    assert tok["bos_token_id"] == hf.bos_token_id == 1
    assert tok["eos_token_ids"] == [2] and hf.eos_token_id == 2
    assert tok["chat_template"] == CHAT_TEMPLATE
    assert tok["special_tokens"]["<|im_start|>"] == 1 and tok["special_tokens"]["<|im_end|>"] == 2
    assert tok["add_bos_token"] is False
    assert "tokenizer.json" in tok["files"]
    for name in tok["files"]:
        assert (tiny_export / name).is_file() and name in manifest["files"]


def test_chat_template_renders_from_the_export(tiny_export):
    model = llama_ane.load(tiny_export, backend="torch")
    ids = model.encode("hi", chat=True)
    text = model.tokenizer.decode(ids)
    assert text.startswith("<|im_start|>user\nhi<|im_end|>\n") and text.endswith("<|im_start|>assistant\n")
    model.close()


def test_file_hashes_follow_the_documented_rule(manifest, tiny_export):
    """Recompute the sha256 of every artifact independently of llama_ane (docs/manifest.md)."""
    def file_hash(p):
        return hashlib.sha256(p.read_bytes()).hexdigest()

    for name, digest in manifest["files"].items():
        path = tiny_export / name
        if path.is_file():
            want = file_hash(path)
        else:
            h = hashlib.sha256()
            for f in sorted((f for f in path.rglob("*") if f.is_file()), key=lambda f: f.relative_to(path).as_posix()):
                h.update(f.relative_to(path).as_posix().encode() + b"\0" + file_hash(f).encode() + b"\n")
            want = h.hexdigest()
        assert digest == want, name
        assert not Path(name).is_absolute() and ".." not in Path(name).parts
    packages = {f["file"] for _, entry in manifest["models"].items() for f in entry["functions"].values()}
    assert packages <= set(manifest["files"])
    assert {p.name for p in tiny_export.glob("*.mlpackage")} == packages


def test_no_dimension_over_16384_and_cache_rules(manifest):
    dims = [d for *_, t in all_tensors(manifest) for d in t["shape"]]
    assert max(dims) <= MAX_DIM
    assert manifest["context_length"] % 32 == 0
    assert sum(manifest["lm_head"]["vocab_splits"]) == manifest["config"]["vocab_size"]
    for *_, t in all_tensors(manifest):
        assert t["dtype"] in ("float16", "int32")  # fp16 export: no fp32 at the I/O


def test_validate_export_passes(tiny_export, manifest):
    assert validate_export(tiny_export) == manifest


# ---- validation failures ------------------------------------------------------------------------------

def test_modified_package_file_is_caught(copy):
    weights = next((copy / "chunk_1.mlpackage").rglob("weight.bin"))
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(ManifestError, match=r"chunk_1\.mlpackage does not match its sha256"):
        validate_export(copy)
    with pytest.raises(ManifestError, match="sha256"):
        llama_ane.load(copy, backend="torch")  # loading refuses it too


def test_modified_tokenizer_is_caught(copy):
    with open(copy / "tokenizer.json", "a") as f:
        f.write(" ")
    with pytest.raises(ManifestError, match=r"tokenizer\.json does not match its sha256"):
        validate_export(copy)


def test_missing_package_is_caught(copy):
    shutil.rmtree(copy / "chunk_0.mlpackage")
    with pytest.raises(ManifestError, match=r"chunk_0\.mlpackage is named in the manifest but missing"):
        validate_export(copy)


def test_edited_input_shape_is_caught(copy):
    real = {}

    def edit(m):
        k_cache = next(t for t in m["models"]["chunk_0"]["functions"]["prefill"]["inputs"] if t["name"] == "k_cache")
        real["shape"] = list(k_cache["shape"])
        k_cache["shape"] = k_cache["shape"][:-1] + [2 * k_cache["shape"][-1]]  # a longer context than exported
    rewrite_manifest(copy, edit)
    with pytest.raises(ManifestError, match="context_length 256"):
        read_manifest(copy)  # the hashes are fine, but the cache no longer holds context_length positions
    with pytest.raises(ManifestError) as e:
        validate_export(copy)
    msg = str(e.value)
    edited = real["shape"][:-1] + [2 * real["shape"][-1]]
    assert "chunk_0.mlpackage" in msg and "'k_cache'" in msg and str(edited) in msg and str(real["shape"]) in msg


def test_edited_output_dtype_is_caught(copy):
    def edit(m):
        m["models"]["chunk_0"]["functions"]["decode"]["outputs"][0]["dtype"] = "float32"
    rewrite_manifest(copy, edit)
    with pytest.raises(ManifestError, match=r"chunk_0\.mlpackage \(decode\) output '\w+' is float16.*float32"):
        validate_export(copy)


def test_renamed_input_is_caught(copy):
    def edit(m):
        m["models"]["embeddings"]["functions"]["prefill"]["inputs"][1]["name"] = "start"
    rewrite_manifest(copy, edit)
    with pytest.raises(ManifestError, match=r"embeddings\.mlpackage \(prefill\) has no input 'start'"):
        validate_export(copy)


def test_missing_function_is_caught(copy):
    def edit(m):
        m["models"]["chunk_2"]["functions"]["decode"]["function_name"] = "decode_fast"
    rewrite_manifest(copy, edit)
    with pytest.raises(ManifestError, match="no function 'decode_fast'"):
        validate_export(copy)


@pytest.mark.parametrize("version", [1, 3, None, "2"])
def test_unknown_format_version_is_refused(copy, version):
    rewrite_manifest(copy, lambda m: m.update(format_version=version))
    with pytest.raises(ManifestError, match="format_version"):
        validate_export(copy)


@pytest.mark.parametrize("name", ["/etc/passwd", "../outside.json", "a/../../b"])
def test_file_names_must_stay_inside(copy, name):
    m = json.loads((copy / "manifest.json").read_text())
    m["files"][name] = "0" * 64
    (copy / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ManifestError, match="plain relative name"):
        validate_export(copy)


def test_no_manifest_is_not_an_export(copy):
    (copy / "manifest.json").unlink()
    with pytest.raises(ManifestError, match="manifest.json is missing"):
        validate_export(copy)


def test_broken_manifest_json(copy):
    (copy / "manifest.json").write_text('{"format_version": 1,')
    with pytest.raises(ManifestError, match="not valid JSON"):
        validate_export(copy)


def test_dimension_over_16384_is_caught(tmp_path):
    """A package whose I/O agrees with its manifest but has a dimension the ANE cannot take."""
    import coremltools as ct
    import torch

    class Double(torch.nn.Module):
        def forward(self, x):
            return x * 2

    width = MAX_DIM + 16
    traced = torch.jit.trace(Double().eval(), torch.zeros(1, width))
    convert_to(traced, tmp_path / "wide.mlpackage", inputs=[ct.TensorType(name="x", shape=(1, width), dtype=np.float16)],
               outputs=[ct.TensorType(name="y", dtype=np.float16)], convert_to="mlprogram")
    io = {"inputs": [{"name": "x", "shape": [1, width], "dtype": "float16"}],
          "outputs": [{"name": "y", "shape": [1, width], "dtype": "float16"}]}
    # the smallest manifest the schema accepts, every section naming the one model
    manifest = {"format_version": FORMAT_VERSION, "name": "wide", "created_by": {}, "source": {"kind": "hf"},
                "config": {k: 1 for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                          "num_key_value_heads", "head_dim")},
                "context_length": 32, "prefill_length": 1, "branch_width": 0, "suffix_length": 0, "precision": "fp16",
                "deployment_target": "iOS18", "multifunction": False,
                "cache": {"layout": "", "channels": 1, "dtype": "float16"},
                "embeddings": {"models": ["wide"], "vocab_ranges": [[0, 1]]},
                "lm_head": {"models": ["wide"], "vocab_splits": [1]}, "chunks": [{"model": "wide", "layers": [0]}],
                "tokenizer": {"files": [], "eos_token_ids": []}, "files": ["wide.mlpackage"],
                "models": {"wide": {"functions": {"main": {"file": "wide.mlpackage", "function_name": "main", **io}}}}}
    write_manifest(tmp_path, manifest)
    with pytest.raises(ManifestError, match=f"wide.mlpackage \\(main\\) input 'x' has a dimension over {MAX_DIM}"):
        validate_export(tmp_path)


# ---- atomic export -----------------------------------------------------------------------------------------

def leftovers(parent: Path, name: str) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(f".{name}.partial-"))


def test_existing_out_is_not_replaced_without_force(tiny_checkpoint, tmp_path):
    from llama_ane.api import ExportError, export_model

    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ExportError, match="already exists; pass --force"):
        export_model(tiny_checkpoint(), out, context_length=64, prefill_length=32, progress=False, verify=False)
    assert (out / "keep.txt").read_text() == "mine"


@pytest.mark.export
@pytest.mark.parametrize("stage", ["convert_all", "validate_export"])
def test_failed_export_leaves_nothing_that_looks_complete(tiny_checkpoint, tmp_path, monkeypatch, stage):
    """A failure during conversion or validation leaves no OUT and no partial folder."""
    from llama_ane import api
    from llama_ane.export import convert, validate

    seen = {}

    def boom(*args, **kwargs):
        if stage == "validate_export":  # the partial folder is complete but for the rename
            seen["partial"] = Path(args[0])
            seen["names"] = sorted(p.name for p in Path(args[0]).iterdir())
        raise RuntimeError(f"simulated failure in {stage}")
    monkeypatch.setattr(convert if stage == "convert_all" else validate, stage, boom)
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="simulated failure"):
        api.export_model(tiny_checkpoint(num_hidden_layers=1), out, context_length=64, prefill_length=32,
                         progress=False, verify=False)
    assert not out.exists()
    assert leftovers(tmp_path, "out") == []
    if stage == "validate_export":
        assert seen["partial"].name.startswith(".out.partial-") and not seen["partial"].exists()
        assert "manifest.json" in seen["names"] and "chunk_0.mlpackage" in seen["names"]


def test_failed_forced_export_keeps_the_previous_one(tiny_export, tmp_path, monkeypatch):
    """--force over a good export, interrupted (Ctrl-C) during conversion: the old export survives."""
    from llama_ane import api
    from llama_ane.export import convert

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    out = tmp_path / "prev"
    shutil.copytree(tiny_export, out)
    monkeypatch.setattr(convert, "convert_all", interrupted)
    with pytest.raises(KeyboardInterrupt):
        api.export_model(read_manifest(out)["source"]["path"], out, context_length=256, prefill_length=64,
                         layers_per_chunk=2, force=True, progress=False, verify=False)
    validate_export(out)
    assert leftovers(tmp_path, "prev") == []


@pytest.mark.parametrize("options, words", [
    ({"layers_per_chunk": 0}, ["--layers-per-chunk", "at least 1"]),
    ({"context_length": 100, "prefill_length": 64}, ["--context-length 100", "multiple", "64"]),
    ({"context_length": 48, "prefill_length": 16}, ["--context-length 48", "multiple of 32"]),
    ({"prefill_length": 0}, ["--prefill-length"]),
    ({"context_length": 4096}, ["max_position_embeddings 2048"]),
    ({"target": "watchOS9"}, ["--target", "watchOS9"]),
    ({"precision": "int4"}, ["--precision"]),
])
def test_bad_options_are_refused_before_anything_is_written(tiny_checkpoint, tmp_path, options, words):
    from llama_ane.api import export_model
    from llama_ane.contract.plan import ExportOptionsError

    out = tmp_path / "out"
    with pytest.raises(ExportOptionsError) as e:
        export_model(tiny_checkpoint(), out, **{"context_length": 256, "prefill_length": 64, **options},
                     progress=False, verify=False)
    for w in words:
        assert w in str(e.value)
    assert list(tmp_path.iterdir()) == []


# ---- backends on the export ------------------------------------------------------------------------------

@pytest.mark.skipif(platform.system() == "Darwin", reason="Core ML predicts on macOS")
def test_coreml_backend_refuses_clearly_off_macos(tiny_export):
    from llama_ane.runtime.backends.base import BackendError

    with pytest.raises(BackendError, match="needs macOS.*--backend torch"):
        llama_ane.load(tiny_export, backend="coreml")


def test_auto_backend_is_torch_off_macos(tiny_export):
    if platform.system() == "Darwin":
        pytest.skip("auto is coreml on macOS")
    model = llama_ane.load(tiny_export)
    assert model.backend.name == "torch"
    model.close()


def test_only_torch_runs_a_checkpoint_directly(tiny_checkpoint):
    with pytest.raises(ValueError, match="not an export folder"):
        llama_ane.load(tiny_checkpoint(), backend="coreml")


@pytest.mark.macos
def test_coreml_backend_matches_torch_on_the_tiny_export(tiny_export):
    """Core ML (all compute units) against the torch modules it was converted from, same fp16 export."""
    coreml = llama_ane.load(tiny_export, backend="coreml", compute_units="ALL")
    torch_ = llama_ane.load(tiny_export, backend="torch", precision="fp32")
    ids = [int(t) for t in np.random.default_rng(5).integers(3, coreml.manifest["config"]["vocab_size"], 150)]
    got, want = coreml.score(ids), torch_.score(ids)
    cos = np.sum(got * want, -1) / (np.linalg.norm(got, axis=-1) * np.linalg.norm(want, axis=-1))
    assert float(np.mean(got.argmax(-1) == want.argmax(-1))) >= 0.98
    assert float(cos.mean()) >= 0.999
    prompt = ids[:70]
    a = coreml.generate(prompt, max_new_tokens=16).token_ids
    b = torch_.generate(prompt, max_new_tokens=16).token_ids
    assert a[:8] == b[:8]
    coreml.close()
    torch_.close()
