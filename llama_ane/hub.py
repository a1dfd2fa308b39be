"""Models named by a Hugging Face Hub repo id (`owner/name`), fetched into the Hub's own cache.

What the user gives is decided once to be a local path or a repo id, and a path never reaches the
Hub: an existing file or folder, anything that looks like a path (it starts with `/`, `.` or `~`,
holds more than one separator or ends with `.gguf`) is a path; `owner/name` that names nothing here
is a repo id. A repo holding a llama-ane export (`manifest.json` at its root) is fetched whole; a
checkpoint only its config, safetensors weights and tokenizer files. A reader of one kind refuses a
repo of the other before fetching its files, and a reader of a checkpoint's config alone fetches
only that file (see `Need`). With HF_HUB_OFFLINE=1 the cache alone answers, and a repo that is not
there is refused with the command that fetches it. Every command resolves what the user typed with
`locate`. This module imports only the error base, so every layer may use it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Literal

from .errors import LlamaANEError

# a checkpoint's files that loading reads: config, safetensors weights (and index), tokenizer, chat template
CHECKPOINT_FILES = ["*.json", "*.safetensors", "tokenizer.model", "*.jinja"]
# what decides the kind of a repo: an export's manifest or a checkpoint's config
KIND_FILES = ["manifest.json", "config.json"]
_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")
# what the reader of a repo needs from it: whatever it holds (None: an export whole, a checkpoint's
# files), an export ("export") or a checkpoint ("checkpoint") and nothing else, or a checkpoint's
# config.json alone ("config"); a repo of the other kind is refused before its files are fetched
Need = Literal["export", "checkpoint", "config"] | None


class HubError(LlamaANEError, OSError):
    """A repo id that cannot be fetched: the message names it, why, and what to do."""


def looks_like_path(text: str) -> bool:
    """Whether `text` is written as a path (so it never names a Hub repo)."""
    return text.startswith(("/", ".", "~")) or text.count(os.sep) > 1 or text.endswith(".gguf")


def repo_id(source: str | Path | None) -> str | None:
    """The Hub repo id that `source` names, or None when it is a local path (or None itself).

    A `Path` object is always a path; a string is a repo id only when nothing exists at it and it
    reads `owner/name` (the Hub's own rules: letters, digits, `-`, `_`, `.`; no `--` or `..`)."""
    if source is None or isinstance(source, Path):
        return None
    text = str(source)
    if looks_like_path(text) or Path(text).expanduser().exists() or not _REPO_ID.fullmatch(text):
        return None
    if "--" in text or ".." in text or text.endswith(".git"):
        return None
    return text


def resolve(source: str | Path, revision: str | None = None, need: Need = None) -> Path:
    """`source` as an absolute local path: a repo id fetched (see `fetch`), a path resolved.

    `revision` (a branch, tag or commit) applies to a repo id only; with a path it is refused."""
    repo = repo_id(source)
    if repo is not None:
        return fetch(repo, revision, need)
    if revision is not None:
        raise HubError(f"--revision {revision} applies to a Hugging Face repo id (owner/name), but {source} is a "
                       "local path; drop --revision")
    return Path(source).expanduser().resolve()


def locate(source: str | Path | None, revision: str | None = None, need: Need = None) -> Path | None:
    """What a command reads for the model or export the user named: a repo id's snapshot folder
    (see `fetch`), a local path as typed (so that messages name it as given), or None for nothing.

    `revision` applies to a repo id only: with a path, or with nothing given, it is refused."""
    if source is None:
        if revision is not None:
            raise HubError(f"--revision {revision} applies to a Hugging Face repo id (owner/name), and none was "
                           "given; drop --revision")
        return None
    if repo_id(source) is None and revision is None:
        return Path(source)
    return resolve(source, revision, need)


def fetch(repo: str, revision: str | None = None, need: Need = None) -> Path:
    """Download `repo` at `revision` into the Hugging Face cache (or find it there) and return its
    snapshot folder: an export in full, a checkpoint's config, weights and tokenizer (its config
    alone where `need` is "config"). A repo of another kind than `need` names is refused."""
    folder = _snapshot(repo, revision, KIND_FILES)
    commit = folder.name  # the snapshot is named by its commit: the rest comes from that same commit
    export, checkpoint = (folder / "manifest.json").is_file(), (folder / "config.json").is_file()
    if need == "config" and checkpoint:
        return folder
    if need in ("checkpoint", "config") and export and not checkpoint:
        raise HubError(f"the Hugging Face repo {repo} holds a llama-ane export (manifest.json), not a checkpoint "
                       "(config.json); pass a checkpoint's repo id or folder")
    if export and need != "checkpoint":
        return _snapshot(repo, commit, None)
    if need == "export" and checkpoint:
        raise HubError(f"the Hugging Face repo {repo} holds a checkpoint (config.json), not a llama-ane export "
                       f"(manifest.json); export it first with `llama-ane export {repo} -o OUT`")
    if checkpoint:
        return _snapshot(repo, commit, CHECKPOINT_FILES)
    raise HubError(f"the Hugging Face repo {repo} holds neither a llama-ane export (manifest.json) nor a checkpoint "
                   "(config.json) at its root; for a .gguf, download the file and pass its path")


def cached_repo(folder: Path) -> tuple[str, str] | None:
    """(repo id, commit) of a folder that is a snapshot in the Hugging Face cache, else None."""
    snapshots, repo_folder = folder.parent, folder.parent.parent
    if snapshots.name != "snapshots" or not repo_folder.name.startswith("models--"):
        return None
    return repo_folder.name.removeprefix("models--").replace("--", "/"), folder.name


def hub_cli() -> str:
    """The command line the installed huggingface_hub provides: `hf` (0.34 and later) or, before
    it, `huggingface-cli`."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        scripts = {ep.name for ep in distribution("huggingface_hub").entry_points if ep.group == "console_scripts"}
    except PackageNotFoundError:
        scripts = set()
    return "huggingface-cli" if "huggingface-cli" in scripts and "hf" not in scripts else "hf"


def download_command(repo: str, revision: str | None = None) -> str:
    """The shell command that puts `repo` (at `revision`) into the Hugging Face cache."""
    return f"{hub_cli()} download {repo}" + (f" --revision {revision}" if revision else "")


def login_command() -> str:
    """The shell command that logs in to the Hugging Face Hub (for a gated or private repo)."""
    return "huggingface-cli login" if hub_cli() == "huggingface-cli" else "hf auth login"


def _snapshot(repo: str, revision: str | None, patterns: list[str] | None) -> Path:
    from huggingface_hub import constants, errors, snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    # a cached snapshot missing files: newer huggingface_hub only (an empty tuple catches nothing)
    incomplete = getattr(errors, "IncompleteSnapshotError", ())

    at = f" at revision {revision}" if revision else ""
    try:
        folder = Path(snapshot_download(repo, revision=revision, allow_patterns=patterns))
    except GatedRepoError:
        raise HubError(f"the Hugging Face repo {repo} is gated: accept its terms on huggingface.co/{repo} and log in "
                       f"({login_command()})") from None
    except RepositoryNotFoundError:
        raise HubError(f"{repo} is not a folder here and no Hugging Face repo of that name was found; check the "
                       f"name, or log in ({login_command()}) for a private repo") from None
    except RevisionNotFoundError:
        raise HubError(f"the Hugging Face repo {repo} has no revision {revision}; pass a branch, tag or commit it "
                       "has") from None
    except incomplete:
        raise HubError(f"the cached copy of {repo}{at} is incomplete and the Hub cannot be reached; fetch it again "
                       f"online with `{download_command(repo, revision)}`") from None
    except LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "the Hub cannot be reached"
        raise HubError(f"{repo}{at} is not a folder here nor in the Hugging Face cache, and {why}; fetch it online "
                       f"with `{download_command(repo, revision)}`, or pass a local folder") from None
    except (HfHubHTTPError, OSError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise HubError(f"could not fetch the Hugging Face repo {repo}{at} ({first}); check the connection and "
                       "try again") from None
    if not folder.is_dir():  # nothing in the repo matched: the Hub gives the folder it would have made
        raise HubError(f"the Hugging Face repo {repo}{at} holds neither a llama-ane export (manifest.json) nor a "
                       "checkpoint (config.json) at its root")
    return folder.resolve()
