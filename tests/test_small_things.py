"""The command line's small things: each command's --help has examples and imports neither torch nor
coremltools, `info` remembers what it hashed, an export closes with one line and its bar counts the
export's bytes, the Core AI packages' noise is dropped (and only it), and `make tag` tags a release."""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import shutil
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest
from click.testing import CliRunner

from llama_ane import _quiet
from llama_ane.cli import COMMANDS, EXAMPLES, main

ROOT = Path(__file__).resolve().parent.parent


# ---- --help ---------------------------------------------------------------------------------------------------

def test_every_command_has_examples_whose_options_exist():
    assert set(EXAMPLES) == set(COMMANDS)
    for name in COMMANDS:
        command = main.get_command(None, name)
        r = CliRunner().invoke(main, [name, "--help"])
        assert r.exit_code == 0, r.output
        assert "Examples:" in r.output and f"llama-ane {name}" in r.output, name
        flags = {opt for param in command.params for opt in getattr(param, "opts", [])}
        for line in EXAMPLES[name]:
            words = shlex.split(line.split("  # ")[0])
            assert words[:2] == ["llama-ane", name], line
            unknown = [w.split("=")[0] for w in words if w.startswith("-") and w.split("=")[0] not in flags]
            assert not unknown, (line, unknown)


def test_a_literal_choice_is_read_without_importing_its_module():
    from llama_ane.commands.options import LazyChoice, literal_constant
    from llama_ane.runtime.model import BACKENDS

    assert literal_constant("llama_ane.runtime.model", "BACKENDS") == BACKENDS
    assert literal_constant("llama_ane.runtime.model", "no_such_name") is None
    assert LazyChoice("llama_ane.runtime.model", "BACKENDS").choices == BACKENDS


HEAVY = ("torch", "coremltools", "transformers")
HELP_PROBE = """
import sys
from llama_ane.cli import main
for name in {names!r}:
    try:
        main([name, "--help"], standalone_mode=False)
    except BaseException as e:
        print(type(e).__name__, file=sys.stderr)
print(sorted(m for m in {heavy!r} if m in sys.modules))
"""


@pytest.mark.export
def test_no_command_help_imports_torch_or_coremltools():
    proc = subprocess.run([sys.executable, "-c", HELP_PROBE.format(names=sorted(COMMANDS), heavy=HEAVY)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("Examples:") == len(COMMANDS)
    assert proc.stdout.strip().splitlines()[-1] == "[]", proc.stdout[-2000:] + proc.stderr


# ---- info remembers what it hashed -------------------------------------------------------------------------

@pytest.mark.export
def test_info_hashes_each_file_once_and_remembers_it(tiny_export, tmp_path, monkeypatch):
    from llama_ane.commands import info
    from llama_ane.contract import manifest

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    out = tmp_path / "export"
    shutil.copytree(tiny_export, out)
    listing = sorted(p.relative_to(out).as_posix() for p in out.rglob("*"))
    hashed, read = [], []
    real_hash, real_read = manifest.sha256_path, info.function_bytes
    monkeypatch.setattr(manifest, "sha256_path", lambda p: hashed.append(p) or real_hash(p))
    monkeypatch.setattr(info, "function_bytes", lambda p: read.append(p) or real_read(p))
    manifest._HASHES.clear()  # this process's own memory of hashes: only the cache file may answer

    first = CliRunner().invoke(main, ["info", str(out)])
    assert first.exit_code == 0, first.stderr
    files = json.loads((out / "manifest.json").read_text())["files"]
    assert len(hashed) >= len(files) and read
    cache = tmp_path / "cache" / "llama-ane" / "info.json"
    assert cache.is_file()

    hashed.clear(), read.clear(), manifest._HASHES.clear()
    CliRunner().invoke(main, ["info", str(out)])  # a package read for its functions is hashed again once
    hashed.clear(), read.clear(), manifest._HASHES.clear()
    again = CliRunner().invoke(main, ["info", str(out)])
    assert again.exit_code == 0 and again.stdout == first.stdout
    assert hashed == [] and read == []  # nothing read again
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == listing  # nothing written there

    tokenizer = out / "tokenizer.json"
    tokenizer.write_bytes(tokenizer.read_bytes() + b" ")  # a change the cache must not hide
    tampered = CliRunner().invoke(main, ["info", str(out)])
    assert tampered.exit_code != 0 and "tokenizer.json does not match its sha256" in tampered.stderr


def test_the_remembered_entries_are_bounded_and_survive_a_bad_cache_file(tmp_path, monkeypatch):
    from llama_ane.commands.info import Remembered

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    (tmp_path / "cache" / "llama-ane").mkdir(parents=True)
    (tmp_path / "cache" / "llama-ane" / "info.json").write_text("not json")
    known = Remembered.load()
    assert known.entries == {}
    monkeypatch.setattr(Remembered, "MAX_ENTRIES", 2)
    for i in range(3):
        (tmp_path / f"f{i}").write_text(str(i))
        assert known.get(tmp_path / f"f{i}", "size", lambda p: p.stat().st_size) == 1
    known.save()
    kept = json.loads((tmp_path / "cache" / "llama-ane" / "info.json").read_text())
    assert sorted(Path(k).name for k in kept) == ["f1", "f2"]


# ---- an export: one closing line, a bar in bytes ---------------------------------------------------------------

def test_the_export_bar_counts_the_exports_bytes(monkeypatch):
    from llama_ane.export import convert
    from llama_ane.export.progress import ExportProgress

    specs = [types.SimpleNamespace(file="embeddings.mlpackage", weight_bytes=3_000_000, dense_bytes=6_000_000),
             types.SimpleNamespace(file="chunk_0.mlpackage", weight_bytes=20_000_003, dense_bytes=80_000_000)]
    units = {specs[0].file: [types.SimpleNamespace(spec=specs[0], weights=3_000_000)],
             specs[1].file: [types.SimpleNamespace(spec=specs[1], weights=1_000_003 + 7919 * i) for i in range(60)]}
    monkeypatch.setattr(convert, "compression_units", lambda plan: [u for us in units.values() for u in us])
    bar = ExportProgress(types.SimpleNamespace(packages=specs), enabled=True)
    try:
        assert bar.bar.total == 23_000_003  # the weights as stored: what the export holds, not the work
        for spec in specs:  # as an export goes: a package's units compressed, then it is built
            for unit in units[spec.file]:
                bar.compressed(unit.spec, unit.weights)
            assert bar.bar.n < sum(s.weight_bytes for s in specs[:specs.index(spec) + 1])  # filling with its work
            bar.built(spec)
        assert bar.bar.n == 23_000_003  # exactly: a bar past its total warns and shows a negative ETA
        bar.built(specs[0])  # never past a package's share
        assert bar.bar.n == 23_000_003
    finally:
        bar.close()


@pytest.mark.export
def test_an_export_closes_with_one_line(tiny_checkpoint, tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "llama_ane", "export", str(tiny_checkpoint(num_hidden_layers=1)),
                           "-o", str(out), "--context-length", "64", "--prefill-length", "32", "--no-verify"],
                          capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert re.fullmatch(r"exported .*out in \d+\.\d s, peak memory .*", lines[-1]), lines[-1]
    assert sum("in " in line and (line.startswith("exported") or line.startswith("done")) for line in lines) == 1
    total = re.findall(r"/([\d.]+)([kMG]?)\b", proc.stderr.replace("\r", "\n"))[-1]
    scale = {"": 1, "k": 1e3, "M": 1e6, "G": 1e9}[total[1]]
    weights = sum(w["bytes"] for w in json.loads((out / "manifest.json").read_text())["weights"].values())
    assert float(total[0]) * scale == pytest.approx(weights, rel=0.01)


# ---- third-party noise ---------------------------------------------------------------------------------------

def test_the_core_ai_warnings_are_dropped_and_others_kept():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            _quiet.quiet_third_party()
            warnings.warn("coreai-torch has only been validated with torch<=2.13.0; found torch 2.13.0+cpu.",
                          UserWarning)
            warnings.warn("`isinstance(treespec, LeafSpec)` is deprecated, use ...", FutureWarning)
            warnings.warn("a warning that matters", UserWarning)
            assert [str(w.message) for w in seen] == ["a warning that matters"]
            _quiet.quiet_third_party(False)  # llama-ane -v
            warnings.warn("coreai-torch has only been validated with torch<=2.13.0", UserWarning)
            assert len(seen) == 2
        finally:
            _quiet.quiet_third_party(False)


def test_coreai_torchs_progress_display_is_quiet():
    class Progress:
        def __init__(self, *args, disable=False, **kwargs):
            self.disable = disable

    printed = []

    class Bar:
        def print(self, *args, **kwargs):
            printed.append(args[0])

    utils = types.SimpleNamespace(Progress=Progress, _ProgressBar=Bar)
    try:
        _quiet.quiet_third_party()
        _quiet._quiet_coreai_torch(utils)
        assert utils.Progress(disable=False).disable
        Bar().print("[bold cyan]coreai-torch[/] [dim]0.4.3[/]: converting 5 program(s) to Core AI")
        Bar().print("a line that matters")
        assert printed == ["a line that matters"]
        _quiet.quiet_third_party(False)
        assert not utils.Progress(disable=False).disable
    finally:
        _quiet.quiet_third_party(False)


def test_the_runtimes_native_loading_lines_are_dropped(capfd):
    class AIModel:
        def load_function(self, name):
            os.write(2, f"ODIE [default]: Loading function '{name}'\n".encode())
            os.write(2, b"a native error that matters\n")
            return name

    module = types.SimpleNamespace(AIModel=AIModel)
    try:
        _quiet.quiet_third_party()
        _quiet._quiet_coreai_runtime(module)
        assert AIModel().load_function("prefill") == "prefill"
        err = capfd.readouterr().err
        assert "Loading function" not in err and "a native error that matters" in err
        _quiet.quiet_third_party(False)
        AIModel().load_function("decode")
        assert "Loading function 'decode'" in capfd.readouterr().err
    finally:
        _quiet.quiet_third_party(False)


def test_a_patch_runs_when_its_module_is_first_imported(tmp_path, monkeypatch):
    (tmp_path / "llama_ane_quiet_probe.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    _quiet.after_import("llama_ane_quiet_probe", lambda module: seen.append(module.VALUE))
    try:
        import llama_ane_quiet_probe  # noqa: F401

        assert seen == [1]
    finally:
        sys.modules.pop("llama_ane_quiet_probe", None)
        _quiet._HOOK.patches.pop("llama_ane_quiet_probe", None)


def test_coremltools_messages_keep_their_filter():
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())
    handler = Keep()
    logging.getLogger("coremltools").addHandler(handler)
    try:
        _quiet.quiet_third_party()
        logging.getLogger("coremltools").warning("Torch version 2.13.0 has not been tested with coremltools.")
        logging.getLogger("coremltools").warning("a conversion warning that matters")
        assert records == ["a conversion warning that matters"]
    finally:
        logging.getLogger("coremltools").removeHandler(handler)
        _quiet.quiet_third_party(False)


# ---- make tag --------------------------------------------------------------------------------------------------

@pytest.mark.export
@pytest.mark.skipif(shutil.which("make") is None or shutil.which("git") is None, reason="needs make and git")
def test_make_tag_tags_the_version_once_on_a_clean_tree(tmp_path):
    """In a throwaway repository holding the Makefile and the version file: the tag is v + the version,
    refused on uncommitted changes and when it exists."""
    (tmp_path / "llama_ane").mkdir()
    shutil.copyfile(ROOT / "Makefile", tmp_path / "Makefile")
    shutil.copyfile(ROOT / "llama_ane" / "_version.py", tmp_path / "llama_ane" / "_version.py")
    env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@example.com", GIT_COMMITTER_NAME="t",
               GIT_COMMITTER_EMAIL="t@example.com", GIT_CONFIG_GLOBAL=os.devnull, GIT_CONFIG_NOSYSTEM="1")

    def run(*args):
        return subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    for args in (["git", "init", "-q"], ["git", "add", "."], ["git", "commit", "-qm", "release"]):
        assert run(*args).returncode == 0
    from llama_ane import __version__

    (tmp_path / "Makefile").write_text((tmp_path / "Makefile").read_text() + "\n")
    dirty = run("make", "tag")
    assert dirty.returncode != 0 and "commit or stash" in dirty.stdout + dirty.stderr
    run("git", "checkout", "--", "Makefile")
    made = run("make", "tag")
    assert made.returncode == 0, made.stdout + made.stderr
    assert run("git", "tag", "--list").stdout.split() == [f"v{__version__}"]
    assert f"git push origin v{__version__}" in made.stdout
    again = run("make", "tag")
    assert again.returncode != 0 and "exists" in again.stdout + again.stderr
