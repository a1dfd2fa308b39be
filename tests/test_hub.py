"""Hugging Face repo ids: the path-or-repo decision, offline loading and exporting from a
pre-populated Hub cache, every command that takes a model or an export taking a repo id, one clear
error naming the command that fetches a repo that is not there, and no request at all once a model
is loaded (even after a change of working directory). Nothing here reaches the network."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from llama_ane.hub import HubError, cached_repo, repo_id

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hub_cache(root: Path, repo: str, folder: Path, commit: str = COMMIT, ref: str = "main") -> Path:
    """Put `folder`'s files in the Hugging Face cache at `root` as a download of `repo` at `commit`
    (its `ref` branch) leaves them: models--owner--name/snapshots/<commit>/..., refs/<ref>."""
    storage = root / ("models--" + repo.replace("/", "--"))
    snapshot = storage / "snapshots" / commit
    shutil.copytree(folder, snapshot)
    (storage / "refs").mkdir(parents=True, exist_ok=True)
    (storage / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    """An empty Hugging Face cache, offline: huggingface_hub reads only what the test puts there."""
    from huggingface_hub import constants

    cache = tmp_path / "hf" / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def no_requests(monkeypatch) -> list:
    """Make every Hub download and HTTP session of huggingface_hub and transformers record its call
    and fail; returns the list of calls (a caller that swallows the failure still leaves its trace)."""
    calls = []

    def refuse(*args, **kwargs):
        calls.append((args, kwargs))
        raise AssertionError("a Hub request was made")
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith(("huggingface_hub", "transformers")):
            continue
        for attr in ("get_session", "get_async_session", "hf_hub_download", "snapshot_download"):
            if callable(getattr(module, attr, None)):
                monkeypatch.setattr(module, attr, refuse)
    return calls


def test_what_is_a_repo_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert repo_id("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert repo_id("owner/name.v2_b-c") == "owner/name.v2_b-c"
    for path in ("./owner/name", "/owner/name", "~/name", "out/a/b", "model.gguf", "owner/model.gguf", "name",
                 "owner/na--me", "owner/..", "owner/name/", "", None, "default"):
        assert repo_id(path) is None, path
    assert repo_id(Path("owner/name")) is None  # given as a Path: a path
    (tmp_path / "out" / "smollm2").mkdir(parents=True)
    assert repo_id("out/smollm2") is None  # it exists here: a path, never the Hub


def test_cached_repo_reads_the_cache_layout(tmp_path):
    snapshot = tmp_path / "models--owner--my-model" / "snapshots" / COMMIT
    assert cached_repo(snapshot) == ("owner/my-model", COMMIT)
    assert cached_repo(tmp_path / "out" / "smollm2") is None


def test_a_revision_with_a_path_is_refused(tmp_path):
    import llama_ane
    from llama_ane.checkpoint.loader import load_checkpoint

    with pytest.raises(HubError, match="applies to a Hugging Face repo id"):
        llama_ane.load(str(tmp_path), revision="main")
    with pytest.raises(HubError, match="applies to a Hugging Face repo id"):
        load_checkpoint(tmp_path, revision="main")


def test_a_missing_repo_offline_is_one_error(offline_hub, monkeypatch):
    import llama_ane

    monkeypatch.chdir(offline_hub)
    with pytest.raises(HubError) as e:
        llama_ane.load("owner/missing")
    message = str(e.value)
    assert "owner/missing" in message and "HF_HUB_OFFLINE" in message and "\n" not in message


def test_a_checkpoint_loads_by_repo_id_offline(offline_hub, tiny_checkpoint, monkeypatch):
    import llama_ane
    from llama_ane.checkpoint.loader import CheckpointError, load_checkpoint

    snapshot = hub_cache(offline_hub, "owner/tiny-llama", tiny_checkpoint())
    monkeypatch.chdir(offline_hub.parent)
    ckpt = load_checkpoint("owner/tiny-llama")
    assert ckpt.name == "tiny-llama"
    assert ckpt.source == {"kind": "hf", "path": str(snapshot.resolve()), "repo": "owner/tiny-llama",
                           "revision": COMMIT}
    assert load_checkpoint("owner/tiny-llama", revision=COMMIT).source["path"] == str(snapshot.resolve())
    with pytest.raises(HubError, match="revision v9"):
        load_checkpoint("owner/tiny-llama", revision="v9")
    model = llama_ane.load("owner/tiny-llama", backend="torch", context_length=64, prefill_length=16)
    assert model.folder == snapshot.resolve()
    assert len(model.generate("The quick", max_new_tokens=3).token_ids) <= 3
    model.close()
    export_only = hub_cache(offline_hub, "owner/not-a-checkpoint", tiny_checkpoint(), commit="f" * 40)
    (export_only / "config.json").rename(export_only / "manifest.json")
    with pytest.raises(CheckpointError, match="is a llama-ane export, not a checkpoint"):
        load_checkpoint("owner/not-a-checkpoint")


def test_an_export_loads_by_repo_id_offline(offline_hub, tiny_export, monkeypatch):
    import llama_ane

    snapshot = hub_cache(offline_hub, "owner/tiny-ane", tiny_export)
    monkeypatch.chdir(offline_hub.parent)
    model = llama_ane.load("owner/tiny-ane", revision="main")
    assert model.folder == snapshot.resolve() and model.manifest["name"] == json.loads(
        (tiny_export / "manifest.json").read_text())["name"]
    reference = llama_ane.load(tiny_export)
    prompt = "The quick brown fox"
    assert model.generate(prompt, max_new_tokens=6).token_ids == reference.generate(prompt, max_new_tokens=6).token_ids
    model.close()
    reference.close()


@pytest.mark.export
def test_a_checkpoint_exports_by_repo_id_offline(offline_hub, tiny_checkpoint, tmp_path, monkeypatch):
    from click.testing import CliRunner

    from llama_ane.cli import main

    hub_cache(offline_hub, "owner/tiny-llama", tiny_checkpoint())
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["export", "owner/tiny-llama", "--revision", COMMIT, "-o", "out/tiny",
                                       "--context-length", "64", "--prefill-length", "16", "--branches", "0",
                                       "--no-verify", "--quiet"])
    assert result.exit_code == 0, result.output
    manifest = json.loads((tmp_path / "out" / "tiny" / "manifest.json").read_text())
    assert manifest["name"] == "tiny-llama"
    assert manifest["source"]["repo"] == "owner/tiny-llama" and manifest["source"]["revision"] == COMMIT


@pytest.mark.export
def test_the_cli_says_one_line_for_a_missing_repo_offline(tmp_path):
    env = dict(os.environ, HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1")
    done = subprocess.run([sys.executable, "-m", "llama_ane", "generate", "owner/missing", "--prompt", "hi"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and "owner/missing" in lines[0], done.stderr
    assert not (tmp_path / "owner").exists()


def test_a_loaded_model_makes_no_request_after_chdir(tiny_export, tmp_path, monkeypatch):
    import llama_ane

    monkeypatch.chdir(tiny_export.parent.parent)
    model = llama_ane.load(f"{tiny_export.parent.name}/{tiny_export.name}")  # relative, as a user types it
    assert model.folder.is_absolute()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    calls = no_requests(monkeypatch)
    result = model.generate("The quick brown fox", max_new_tokens=4)  # one user turn in the chat template
    assert result.token_ids or result.finish_reason == "eos"
    assert calls == []
    model.close()


# The files of published multimodal repos (Qwen3.5, Gemma 3 4B, Gemma 4): the text model's export needs
# its config, the weights and their index, the tokenizer and the chat template (the processor's too);
# the patterns take the processors' small JSON files as well (json), and leave the rest (other)
MULTIMODAL_REPOS = {
    "Qwen/Qwen3.5-2B": {"needed": ["config.json", "model.safetensors.index.json", "model-00001-of-00002.safetensors",
                                   "model-00002-of-00002.safetensors", "tokenizer.json", "tokenizer_config.json",
                                   "chat_template.jinja", "generation_config.json"],
                        "json": ["vocab.json", "preprocessor_config.json", "video_preprocessor_config.json"],
                        "other": [".gitattributes", "README.md", "LICENSE", "merges.txt"]},
    "google/gemma-3-4b-it": {"needed": ["config.json", "model.safetensors.index.json",
                                        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                                        "tokenizer.json", "tokenizer.model", "tokenizer_config.json",
                                        "special_tokens_map.json", "chat_template.json", "generation_config.json"],
                             "json": ["added_tokens.json", "preprocessor_config.json", "processor_config.json"],
                             "other": [".gitattributes", "README.md"]},
    "google/gemma-4-E2B-it": {"needed": ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                                         "chat_template.jinja", "generation_config.json"],
                              "json": ["processor_config.json"],
                              "other": [".gitattributes", "README.md", "assets/diagram.png"]},
}


@pytest.mark.parametrize("repo", list(MULTIMODAL_REPOS))
def test_a_multimodal_repo_fetches_what_its_text_models_export_needs(repo, tmp_path, monkeypatch):
    """`fetch` through a stand-in for snapshot_download that lays out the repo's files its patterns
    allow (huggingface_hub's own filter): every file the export reads arrives, the repo's others do not."""
    import huggingface_hub
    from huggingface_hub.utils import filter_repo_objects

    from llama_ane.hub import fetch

    kinds = MULTIMODAL_REPOS[repo]

    def snapshot_download(repo_id, revision=None, allow_patterns=None):
        assert repo_id == repo
        folder = tmp_path / "snapshots" / COMMIT
        files = kinds["needed"] + kinds["json"] + kinds["other"]
        for name in filter_repo_objects(files, allow_patterns=allow_patterns):
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / name).write_text("{}")
        return str(folder)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    folder = fetch(repo)
    got = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
    assert got == sorted(kinds["needed"] + kinds["json"])


# ---- every command that takes a model or an export takes a repo id --------------------------------------

EXPORT_REPO, CHECKPOINT_REPO, MISSING_REPO = "owner/tiny-ane", "owner/tiny-llama", "owner/missing"

# command -> (its arguments, ID standing for the repo id; the call that reads the folder the id names,
# "module:function"; the kind of repo the command reads)
REPO_COMMANDS = {
    "export": (["export", "ID", "-o", "out", "--no-verify", "--quiet"], "llama_ane.contract.tokenizer:check_tokenizer",
               "checkpoint"),
    "generate": (["generate", "ID", "--prompt", "Hi"], "llama_ane:load", "export"),
    "chat": (["chat", "ID"], "llama_ane:load", "export"),
    "serve": (["serve", "ID", "--port", "0"], "llama_ane:load", "export"),
    "info": (["info", "ID"], "llama_ane.contract.manifest:read_manifest", "export"),
    "info --config": (["info", "--config", "ID"], "llama_ane.contract.device_model:read_config", "checkpoint"),
    "eval": (["eval", "ID"], "llama_ane.evaluate:evaluate", "export"),
    "eval --reference": (["eval", EXPORT_REPO, "--reference", "ID"], "llama_ane.evaluate:evaluate", "export"),
    "verify": (["verify", "ID"], "llama_ane.verify:verify_export", "export"),
    "inspect": (["inspect", "ID"], "llama_ane.export.inspect:inspect_path", "export"),
    "bench": (["bench", "ID"], "llama_ane.runtime.bench:run_bench", "export"),
    "gpu-generate": (["gpu-generate", "ID"], "llama_ane.cuda.engine:load_hf_model", "checkpoint"),
}


class Reached(Exception):
    """What a stand-in for the call that reads the model raises: the command got that far."""


def stop_at(monkeypatch, target: str) -> list:
    """Replace the function `target` ("module:function") by one that records every argument it is
    given and raises Reached; returns the list of what it was given."""
    import importlib

    module, name = target.split(":")
    given = []

    def stand_in(*args, **kwargs):
        given.extend([*args, *kwargs.values()])
        raise Reached(target)
    monkeypatch.setattr(importlib.import_module(module), name, stand_in)
    return given


def as_if_on_a_gpu(monkeypatch) -> None:
    """gpu-generate's checks of CUDA and triton pass (nothing runs on the GPU: the model's loading is
    stood in for)."""
    import types

    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "triton", types.ModuleType("triton"))


@pytest.fixture
def hub_repos(offline_hub, tiny_checkpoint, tmp_path, monkeypatch) -> dict[str, Path]:
    """The offline cache holding an export repo (its manifest alone: the commands' reading of it is stood
    in for) and a checkpoint repo (a tiny one); the working directory an empty folder. Returns
    {kind: snapshot folder}."""
    export = tmp_path / "export-files"
    export.mkdir()
    (export / "manifest.json").write_text("{}")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    return {"export": hub_cache(offline_hub, EXPORT_REPO, export),
            "checkpoint": hub_cache(offline_hub, CHECKPOINT_REPO, tiny_checkpoint(), commit="c" * 40)}


def invoke(command: str, repo: str, *extra: str):
    from click.testing import CliRunner

    from llama_ane.cli import main

    args, _, _ = REPO_COMMANDS[command]
    return CliRunner().invoke(main, [repo if a == "ID" else a for a in args] + list(extra))


@pytest.mark.parametrize("revision", [None, "main"])
@pytest.mark.parametrize("command", list(REPO_COMMANDS))
def test_every_command_takes_a_cached_repo_id(command, revision, hub_repos, monkeypatch):
    _, reads, kind = REPO_COMMANDS[command]
    if command == "gpu-generate":
        as_if_on_a_gpu(monkeypatch)
    given = stop_at(monkeypatch, reads)
    repo = EXPORT_REPO if kind == "export" else CHECKPOINT_REPO
    result = invoke(command, repo, *(["--revision", revision] if revision else []))
    assert isinstance(result.exception, Reached), result.output
    snapshot = hub_repos[kind].resolve()
    assert snapshot in [Path(g).resolve() for g in given if isinstance(g, (str, Path))], given


@pytest.mark.parametrize("command", list(REPO_COMMANDS))
def test_every_command_names_the_fetch_command_for_a_repo_not_cached(command, hub_repos, monkeypatch):
    from llama_ane.hub import download_command

    if command == "gpu-generate":
        as_if_on_a_gpu(monkeypatch)
    result = invoke(command, MISSING_REPO)
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output and not isinstance(result.exception, Reached)
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.output
    assert MISSING_REPO in lines[0] and "HF_HUB_OFFLINE" in lines[0]
    assert f"`{download_command(MISSING_REPO)}`" in lines[0], lines[0]


def test_the_fetch_command_is_the_installed_hubs():
    from llama_ane.hub import download_command, hub_cli

    assert hub_cli() == ("hf" if shutil.which("hf") or not shutil.which("huggingface-cli") else "huggingface-cli")
    assert download_command("owner/name") == f"{hub_cli()} download owner/name"
    assert download_command("owner/name", "v1") == f"{hub_cli()} download owner/name --revision v1"


@pytest.mark.parametrize("command", ["info", "eval", "verify", "inspect", "bench"])
def test_a_command_that_reads_an_export_refuses_a_checkpoint_repo(command, hub_repos, monkeypatch):
    given = stop_at(monkeypatch, REPO_COMMANDS[command][1])
    result = invoke(command, CHECKPOINT_REPO)
    assert result.exit_code == 1 and given == [], result.output
    assert "holds a checkpoint" in result.output and f"llama-ane export {CHECKPOINT_REPO}" in result.output


@pytest.mark.parametrize("command", ["info --config", "gpu-generate"])
def test_a_command_that_reads_a_checkpoint_refuses_an_export_repo(command, hub_repos, monkeypatch):
    if command == "gpu-generate":
        as_if_on_a_gpu(monkeypatch)
    given = stop_at(monkeypatch, REPO_COMMANDS[command][1])
    result = invoke(command, EXPORT_REPO)
    assert result.exit_code == 1 and given == [], result.output
    assert "holds a llama-ane export" in result.output and "not a checkpoint" in result.output


@pytest.mark.parametrize("command", ["info", "eval", "verify", "inspect", "bench", "serve"])
def test_a_revision_with_a_folder_is_refused_by_every_command(command, tmp_path, monkeypatch):
    given = stop_at(monkeypatch, REPO_COMMANDS[command][1])
    (tmp_path / "manifest.json").write_text("{}")
    result = invoke(command, str(tmp_path), "--revision", "main")
    assert result.exit_code == 1 and given == [], result.output
    assert "--revision main applies to a Hugging Face repo id" in result.output


def test_info_models_a_checkpoint_repo_from_its_config_alone(hub_repos):
    from click.testing import CliRunner

    from llama_ane.cli import main

    result = CliRunner().invoke(main, ["info", "--config", CHECKPOINT_REPO, "--chip", "M4", "--json"])
    assert result.exit_code == 0, result.output
    config = json.loads((hub_repos["checkpoint"] / "config.json").read_text())
    assert json.loads(result.output)["config"]["hidden_size"] == config["hidden_size"]


def test_a_path_typed_like_a_repo_id_stays_a_path_where_it_exists(hub_repos, monkeypatch):
    """A folder `owner/tiny-ane` here is read, never the repo of that name."""
    here = Path("owner") / "tiny-ane"
    here.mkdir(parents=True)
    (here / "manifest.json").write_text("{}")
    given = stop_at(monkeypatch, REPO_COMMANDS["inspect"][1])
    result = invoke("inspect", str(here))
    assert isinstance(result.exception, Reached), result.output
    assert given[0] == here


@pytest.mark.export
def test_info_and_inspect_read_an_export_repo_as_its_folder(offline_hub, tiny_export, tmp_path, monkeypatch):
    hub_cache(offline_hub, EXPORT_REPO, tiny_export)
    monkeypatch.chdir(tmp_path)
    by_id, by_folder = invoke("info", EXPORT_REPO, "--json"), invoke("info", str(tiny_export), "--json")
    assert by_id.exit_code == 0, by_id.output
    assert json.loads(by_id.stdout) == json.loads(by_folder.stdout)
    by_id, by_folder = invoke("inspect", EXPORT_REPO, "--json"), invoke("inspect", str(tiny_export), "--json")
    assert by_id.exit_code == 0, by_id.output
    report, expected = json.loads(by_id.stdout), json.loads(by_folder.stdout)
    assert {**report, "path": None} == {**expected, "path": None}
