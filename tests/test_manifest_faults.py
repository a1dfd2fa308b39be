"""The manifest is untrusted input: every case of tests/fixtures/bad_manifests (shared with the Swift
tests) must be refused by `read_manifest` and by the commands that read an export, with one clear
error naming the field; a package whose description disagrees with the manifest is refused where
packages are opened; hashes are computed once per folder state.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from llama_ane.contract import manifest as manifest_module
from llama_ane.contract.manifest import ManifestError, read_manifest, sha256_path, write_manifest

CORPUS = Path(__file__).resolve().parent / "fixtures" / "bad_manifests"
CASES = sorted(p.stem for p in CORPUS.glob("*.json"))


def _step(node, parts: list[str], create: bool):
    """(container, key) that `parts` names inside `node` (see the corpus README for keys with dots)."""
    while True:
        if isinstance(node, list):
            key, rest = int(parts[0]), parts[1:]
        else:
            n = next((n for n in range(1, len(parts) + 1) if ".".join(parts[:n]) in node), None)
            if n is None:
                if not create:
                    raise KeyError(".".join(parts))
                n = len(parts)
            key, rest = ".".join(parts[:n]), parts[n:]
        if not rest:
            return node, key
        node, parts = node[key], rest


def apply_case(case: dict, export: Path, outside: Path) -> None:
    """Apply one corpus case to the export folder `export` (a copy); `outside` is a folder beside it."""
    path = export / "manifest.json"
    manifest = json.loads(path.read_text())
    if "replace" in case:
        manifest = case["replace"]
    for field, value in case.get("set", {}).items():
        node, key = _step(manifest, field.split("."), create=True)
        node[key] = value
    for field in case.get("delete", []):
        node, key = _step(manifest, field.split("."), create=False)
        del node[key]
    path.write_text(json.dumps(manifest))
    if "symlink" in case:
        target = export / case["symlink"]
        copy = outside / target.name
        shutil.copyfile(target, copy)
        target.unlink()
        target.symlink_to(copy)


def load_case(name: str) -> dict:
    return json.loads((CORPUS / f"{name}.json").read_text())


@pytest.fixture
def bad_export(tiny_export, tmp_path):
    """Factory: a copy of the tiny export with corpus case `name` applied."""
    def make(name: str) -> Path:
        export = tmp_path / "export"
        shutil.copytree(tiny_export, export)
        (tmp_path / "outside").mkdir()
        apply_case(load_case(name), export, tmp_path / "outside")
        return export
    return make


def test_corpus_cases_are_well_formed():
    assert len(CASES) >= 25
    keys = {"why", "set", "delete", "replace", "symlink", "mentions"}
    for name in CASES:
        case = load_case(name)
        assert set(case) <= keys and case["why"] and case["mentions"], name
        assert set(case) & {"set", "delete", "replace", "symlink"}, name


def test_the_good_export_is_accepted(tiny_export, tmp_path):
    """The corpus is only meaningful if the unchanged export passes, also through `apply_case`."""
    export = tmp_path / "export"
    shutil.copytree(tiny_export, export)
    apply_case({"set": {}}, export, tmp_path)
    assert read_manifest(export)["context_length"] == 256


@pytest.mark.parametrize("name", CASES)
def test_read_manifest_refuses(name, bad_export):
    export = bad_export(name)
    with pytest.raises(ManifestError) as e:
        read_manifest(export)
    message = str(e.value)
    assert "\n" not in message
    for word in load_case(name)["mentions"]:
        assert word in message, (word, message)
    assert "re-export" in message or "upgrade" in message or "copy the real files" in message, message


COMMANDS = {
    "generate --backend mil": lambda out: ["generate", str(out), "--prompt", "Hi", "--backend", "mil",
                                           "--max-new-tokens", "2"],
    "info": lambda out: ["info", str(out)],
    "inspect": lambda out: ["inspect", str(out)],
    "verify": lambda out: ["verify", str(out), "--no-transformers"],
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_commands_give_one_error_line(command, tiny_export, tmp_path):
    """Each command, on every case: exit code 1, one `Error:` line holding the case's words, no
    traceback, and the export's files left as they were."""
    from llama_ane.cli import main

    for name in CASES:
        case_dir = tmp_path / name
        export = case_dir / "export"
        shutil.copytree(tiny_export, export)
        (case_dir / "outside").mkdir()
        apply_case(load_case(name), export, case_dir / "outside")
        before = sorted(p.relative_to(export).as_posix() for p in export.rglob("*"))
        result = CliRunner().invoke(main, COMMANDS[command](export))
        assert result.exit_code == 1, (name, result.output, result.exception)
        assert "Traceback" not in result.output, (name, result.output)
        errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
        assert len(errors) == 1, (name, result.output)
        for word in load_case(name)["mentions"]:
            assert word in errors[0], (name, word, errors[0])
        assert sorted(p.relative_to(export).as_posix() for p in export.rglob("*")) == before, name


# ---- packages against the manifest ------------------------------------------------------------------------

def _longer_context(export: Path, context: int) -> list[int]:
    """Rewrite the manifest as if the export held `context` positions: context_length and every cache
    tensor agree with each other (so only the packages can tell). Returns chunk_0's new k_cache shape."""
    path = export / "manifest.json"
    m = json.loads(path.read_text())
    m["context_length"], m["context_buckets"] = context, [context]
    for entry in m["models"].values():
        for f in entry["functions"].values():
            for t in f["inputs"] + f["outputs"] + f.get("states", []):
                if t["name"] in manifest_module.CACHE_TENSORS:
                    t["shape"][-1] = context
    path.write_text(json.dumps(m))
    return next(t["shape"] for t in m["models"]["chunk_0"]["functions"]["decode"]["inputs"] if t["name"] == "k_cache")


@pytest.fixture
def longer_context(tiny_export, tmp_path):
    export = tmp_path / "export"
    shutil.copytree(tiny_export, export)
    shape = _longer_context(export, 512)
    read_manifest(export)  # consistent in itself: the hashes and every field agree
    return export, shape


def _assert_names_both_shapes(message: str, shape: list[int]) -> None:
    assert "chunk_0.mlpackage" in message and "'k_cache'" in message, message
    assert str(shape) in message and str(shape[:-1] + [256]) in message, message


@pytest.mark.parametrize("backend", ["mil", "torch"])
def test_backends_refuse_packages_that_disagree(longer_context, backend):
    import llama_ane

    export, shape = longer_context
    model = llama_ane.load(export, backend=backend)
    with pytest.raises(ManifestError) as e:
        model.score([1, 2, 3])
    _assert_names_both_shapes(str(e.value), shape)
    model.close()


@pytest.mark.parametrize("args", [["inspect"], ["generate", "--prompt", "Hi", "--backend", "mil"]])
def test_commands_refuse_packages_that_disagree(longer_context, args):
    from llama_ane.cli import main

    export, shape = longer_context
    result = CliRunner().invoke(main, [args[0], str(export), *args[1:]])
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, result.output
    _assert_names_both_shapes(errors[0], shape)


# ---- hashing once per folder state --------------------------------------------------------------------------

def test_hashes_are_computed_once_per_folder_state(tiny_export, tmp_path, monkeypatch):
    export = tmp_path / "export"
    shutil.copytree(tiny_export, export)
    hashed = []
    real = manifest_module._sha256_file
    monkeypatch.setattr(manifest_module, "_sha256_file", lambda p: hashed.append(p) or real(p))
    read_manifest(export)
    assert hashed, "the first read hashes every file"
    hashed.clear()
    read_manifest(export)
    assert hashed == []
    # the same bytes count, same size, modification time set back: still seen, and refused
    weights = next((export / "chunk_1.mlpackage").rglob("weight.bin"))
    before = weights.stat()
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    with pytest.raises(ManifestError, match=r"chunk_1\.mlpackage does not match its sha256"):
        read_manifest(export)
    assert {p.relative_to(export).parts[0] for p in hashed} == {"chunk_1.mlpackage"}  # only the changed package


def test_write_manifest_then_read_agree(tiny_export, tmp_path):
    """A manifest written by write_manifest after a file changed records the new hash, not a stale one."""
    export = tmp_path / "export"
    shutil.copytree(tiny_export, export)
    read_manifest(export)
    with open(export / "tokenizer_config.json", "a") as f:
        f.write(" ")
    m = json.loads((export / "manifest.json").read_text())
    m["files"] = list(m["files"])
    write_manifest(export, m)
    assert read_manifest(export)["files"]["tokenizer_config.json"] == sha256_path(export / "tokenizer_config.json")


# ---- the real command line ----------------------------------------------------------------------------------

@pytest.mark.export
@pytest.mark.parametrize("name,args", [
    ("dotdot_function_file", ["generate", "--prompt", "Hi", "--backend", "mil"]),
    ("files_map_deleted", ["info"]),
    ("symlink_tokenizer_outside", ["verify", "--no-transformers"]),
    ("manifest_is_list", ["inspect"]),
])
def test_process_exits_with_one_error_line(name, args, bad_export, tmp_path):
    from support.cli import assert_clear_error, run_cli

    export = bad_export(name)
    proc = run_cli([args[0], export, *args[1:]], tmp_path / "tmpdir")
    assert_clear_error(proc, load_case(name)["mentions"], 1)
    assert list((tmp_path / "tmpdir").iterdir()) == []
