"""The manifest is untrusted input: every case of tests/fixtures/bad_manifests (shared with the Swift
tests) must be refused by `read_manifest` and by the commands that read an export, with one clear
error naming the field; a package whose description disagrees with the manifest is refused where
packages are opened; hashes are computed once per folder state.
"""

from __future__ import annotations

import json
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
