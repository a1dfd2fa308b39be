"""`verify`: the parity gate passes on a good export and fails, with a clear message, on one whose
weights were deliberately corrupted (whether or not the manifest hashes were rewritten to match)."""

from __future__ import annotations

import shutil
import struct

import numpy as np
import pytest
from click.testing import CliRunner

from llama_ane.commands.verify import command as verify_command
from llama_ane.contract.manifest import read_manifest, write_manifest
from llama_ane.verify import compare_logits, default_text, top1_agreement, verify_export
from llama_ane.mil import MilPackage

BLOB_SENTINEL = 0xDEADBEEF


def shuffle_weights(package_path, seed=0) -> int:
    """Permute the values of every weight blob of a package in place; returns how many blobs.

    The blob file holds, at each const's offset, a header (sentinel, dtype, size, data offset);
    the values keep their distribution (no NaN) but lose their meaning.
    """
    package = MilPackage(package_path)
    locations = {loc for fn in package.function_names for loc in package.blob_locations(fn).values()}
    rng = np.random.default_rng(seed)
    changed = 0
    for file, offset in sorted(locations):
        path = package.weights_dir / file
        raw = bytearray(path.read_bytes())
        sentinel, _dtype, size, data_offset = struct.unpack_from("<IIQQ", raw, offset)
        assert sentinel == BLOB_SENTINEL
        values = np.frombuffer(bytes(raw[data_offset:data_offset + size]), dtype=np.float16)
        if values.size < 64:
            continue  # norms and small vectors: leave them, the projections are enough
        raw[data_offset:data_offset + size] = rng.permutation(values).tobytes()
        path.write_bytes(bytes(raw))
        changed += 1
    return changed


@pytest.fixture
def corrupted_copy(tiny_export, tmp_path):
    out = tmp_path / "corrupted"
    shutil.copytree(tiny_export, out)
    assert shuffle_weights(out / "chunk_0.mlpackage") >= 4
    return out


def test_verify_passes_on_the_tiny_export(tiny_export):
    result = CliRunner().invoke(verify_command, [str(tiny_export)])
    print(result.output)
    assert result.exit_code == 0, result.output
    assert "max |diff|" in result.output and "top-1" in result.output
    assert "torch (fp32)" in result.output and "transformers" in result.output
    # the three logits come from streamed scoring, one model's weights in memory at a time
    assert ("streamed: one model in memory at a time (embeddings, 3 chunks, lm_head); "
            "transformers one decoder layer at a time") in result.output
    assert result.output.rstrip().endswith("passed")


def test_verify_fails_on_corrupted_weights_with_matching_hashes(corrupted_copy):
    # a conversion that wrote wrong weights would also write their hashes: only the numbers can tell
    manifest = read_manifest(corrupted_copy, check_hashes=False)
    write_manifest(corrupted_copy, manifest)
    report = verify_export(corrupted_copy, with_transformers=False)
    print(report)
    assert not report.passed
    assert report.error is None
    torch_cmp, tree_cmp = report.comparisons  # the text, then the speculative verify function's token tree
    assert torch_cmp.top1_agreement < 0.9 and "verify tree" in tree_cmp.reference
    assert report.method.startswith("streamed: one model in memory at a time (embeddings, 3 chunks, lm_head)\n")
    text = str(report)
    assert "FAIL: top-1 agreement" in text and "does not reproduce the reference logits" in text
    result = CliRunner().invoke(verify_command, [str(corrupted_copy), "--no-transformers"])
    assert result.exit_code == 1


def test_verify_fails_on_corrupted_weights_caught_by_their_hash(corrupted_copy):
    report = verify_export(corrupted_copy)
    assert not report.passed
    assert "chunk_0.mlpackage does not match its sha256" in report.error
    result = CliRunner().invoke(verify_command, [str(corrupted_copy)])
    assert result.exit_code == 1 and "FAILED" in result.output


def _unbuildable_reference(monkeypatch) -> None:
    """transformers' model of the family fails to build, as Lfm2Config's missing rms_norm_eps once made it."""
    def broken(token_ids, checkpoint):
        raise AttributeError("'LlamaConfig' object has no attribute 'rms_norm_eps'")
    monkeypatch.setattr("llama_ane.reference.transformers_logits", broken)


def _error_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("Error:")]


def test_a_reference_that_cannot_be_built_fails_verify(tiny_export, monkeypatch):
    _unbuildable_reference(monkeypatch)
    result = CliRunner().invoke(verify_command, [str(tiny_export), "--quiet"])
    print(result.output)
    assert result.exit_code == 1
    (error,) = _error_lines(result.output)
    for words in ("transformers reference could not be built", "rms_norm_eps", "transformers 5.", "--no-transformers"):
        assert words in error
    assert not result.output.rstrip().endswith("passed")
    # skipped by name, the gate passes and says it was partial
    result = CliRunner().invoke(verify_command, [str(tiny_export), "--quiet", "--no-transformers"])
    assert result.exit_code == 0, result.output
    assert "transformers: skipped by --no-transformers" in result.output
    assert result.output.rstrip().endswith("passed, partially: only the conversion was checked, not the whole model")


@pytest.mark.export
def test_a_reference_that_cannot_be_built_fails_the_export(tiny_checkpoint, tmp_path, monkeypatch):
    from llama_ane.commands.export import command as export_command

    _unbuildable_reference(monkeypatch)
    ckpt, out = tiny_checkpoint(num_hidden_layers=2, head_dim=32), tmp_path / "out"
    args = [str(ckpt), "-o", str(out), "--context-length", "64", "--prefill-length", "16", "--quiet"]
    result = CliRunner().invoke(export_command, args)
    print(result.output)
    assert result.exit_code == 1
    (error,) = _error_lines(result.output)
    assert "parity gate" in error and "could not be built" in error and "--no-transformers" in error
    assert not out.exists() and not list(tmp_path.iterdir())  # nothing written, nothing left
    result = CliRunner().invoke(export_command, args + ["--no-transformers"])
    assert result.exit_code == 0, result.output
    assert "transformers: skipped by --no-transformers" in result.output and "passed, partially" in result.output
    assert (out / "manifest.json").exists()


@pytest.mark.export
def test_the_export_and_its_gate_hash_each_package_once(tiny_checkpoint, tmp_path, monkeypatch):
    """The manifest's hashes, the gate's check of them and each of the gate's loads (the tokenizer,
    the programs in fp16 and fp32, the torch modules, the verify tree on both) share one read of
    each file: nothing the loads do to a package changes it, so the hash of its first read holds."""
    import collections
    from pathlib import Path

    from llama_ane.api import export_model
    from llama_ane.contract import manifest as contract_manifest

    hashed, asked = collections.Counter(), collections.Counter()
    read_file, hash_path = contract_manifest._sha256_file, contract_manifest.sha256_path

    def counted_read(path):
        hashed[Path(path).relative_to(tmp_path).as_posix().split("/", 1)[1]] += 1
        return read_file(path)

    def counted_hash(path):
        asked[Path(path).name] += 1
        return hash_path(path)
    monkeypatch.setattr(contract_manifest, "_sha256_file", counted_read)
    monkeypatch.setattr(contract_manifest, "sha256_path", counted_hash)
    out = export_model(tiny_checkpoint(num_hidden_layers=2, head_dim=32), tmp_path / "out", context_length=64,
                       prefill_length=16, layers_per_chunk=1, verify_window=16, progress=False, workers=1)
    files = read_manifest(out, check_hashes=False)["files"]
    packages = sorted(name for name in files if name.endswith(".mlpackage"))
    assert len(packages) >= 3, packages
    for package in packages:
        assert asked[package] >= 5, (package, asked)  # the gate checks it on every load...
        inside = [name for name in hashed if name.startswith(package + "/")]
        assert len(inside) == len([p for p in (out / package).rglob("*") if p.is_file()]) >= 3, inside
    assert set(hashed.values()) == {1}, hashed  # ...and each file of the export is read for it once


def test_the_reference_error_says_which_transformers_is_tested(monkeypatch):
    """Outside the range pyproject.toml declares, the error says how to install one inside it."""
    from importlib import metadata

    from llama_ane.verify import reference_failure

    tested = next(r for r in metadata.requires("llama-ane") if r.startswith("transformers"))
    assert "<" in tested and ">=" in tested  # a range: a newer release is tried first (benchmarks/transformers_latest.py)
    monkeypatch.setattr(metadata, "version", lambda name: "4.40.0")
    error = reference_failure(KeyError("rope_type"))
    assert "KeyError: 'rope_type'" in error and "transformers 4.40.0 is installed" in error
    assert "pip install 'transformers" in error and "--no-transformers" in error


def test_verify_refuses_a_text_too_short_to_tell(tiny_export, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("Hi there")
    result = CliRunner().invoke(verify_command, [str(tiny_export), "--text", str(short)])
    assert result.exit_code == 1
    assert "verification needs at least 16" in result.output
    assert len(default_text().split()) > 200


def test_top1_agreement_counts_ties_at_the_resolution_of_the_logits():
    want = np.array([[1.0, 3.0, 3.0], [0.0, 2.0, 1.0], [5.0, 4.999, 0.0], [5.0, 4.98, 0.0]])
    got = np.array([[0.0, 1.0, 2.0], [0.0, 2.0, 1.5], [4.0, 5.0, 0.0], [4.0, 5.0, 0.0]])
    # row 0: got picks 2, tied with 1 in want -> agrees; row 1 agrees; rows 2, 3: near ties
    assert top1_agreement(got, want) == pytest.approx(2 / 4)
    # at fp16 resolution an ulp at 5.0 is 1/256: 0.001 apart is within 2 ulps, 0.02 apart is not
    assert top1_agreement(got, want, np.float16) == pytest.approx(3 / 4)
    c = compare_logits(got, want, "x")
    assert c.max_abs_diff == pytest.approx(2.0)
    with pytest.raises(ValueError):
        compare_logits(got[:, :2], want, "x")
