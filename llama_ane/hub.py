"""Models named by a Hugging Face Hub repo id (`owner/name`), fetched into the Hub's own cache.

What the user gives is decided once to be a local path or a repo id, and a path never reaches the
Hub: an existing file or folder, anything that looks like a path (it starts with `/`, `.` or `~`,
holds more than one separator or ends with `.gguf`) is a path; `owner/name` that names nothing here
is a repo id. A repo holding a llama-ane export (`manifest.json` at its root) is fetched whole; a
checkpoint only its config, safetensors weights and tokenizer files. With HF_HUB_OFFLINE=1 the
cache alone answers. This module imports only the error base, so every layer may use it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from .errors import LlamaANEError

# a checkpoint's files that loading reads: config, safetensors weights (and index), tokenizer, chat template
CHECKPOINT_FILES = ["*.json", "*.safetensors", "tokenizer.model", "*.jinja"]
# what decides the kind of a repo: an export's manifest or a checkpoint's config
KIND_FILES = ["manifest.json", "config.json"]
_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")


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


def resolve(source: str | Path, revision: str | None = None) -> Path:
    """`source` as an absolute local path: a repo id fetched (see `fetch`), a path resolved.

    `revision` (a branch, tag or commit) applies to a repo id only; with a path it is refused."""
    repo = repo_id(source)
    if repo is not None:
        return fetch(repo, revision)
    if revision is not None:
        raise HubError(f"--revision {revision} applies to a Hugging Face repo id (owner/name), but {source} is a "
                       "local path; drop --revision")
    return Path(source).expanduser().resolve()


def fetch(repo: str, revision: str | None = None) -> Path:
    """Download `repo` at `revision` into the Hugging Face cache (or find it there) and return its
    snapshot folder: an export in full, a checkpoint's config, weights and tokenizer."""
    folder = _snapshot(repo, revision, KIND_FILES)
    commit = folder.name  # the snapshot is named by its commit: the rest comes from that same commit
    if (folder / "manifest.json").is_file():
        return _snapshot(repo, commit, None)
    if (folder / "config.json").is_file():
        return _snapshot(repo, commit, CHECKPOINT_FILES)
    raise HubError(f"the Hugging Face repo {repo} holds neither a llama-ane export (manifest.json) nor a checkpoint "
                   "(config.json) at its root; for a .gguf, download the file and pass its path")


def cached_repo(folder: Path) -> tuple[str, str] | None:
    """(repo id, commit) of a folder that is a snapshot in the Hugging Face cache, else None."""
    snapshots, repo_folder = folder.parent, folder.parent.parent
    if snapshots.name != "snapshots" or not repo_folder.name.startswith("models--"):
        return None
    return repo_folder.name.removeprefix("models--").replace("--", "/"), folder.name


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
                       "(hf auth login)") from None
    except RepositoryNotFoundError:
        raise HubError(f"{repo} is not a folder here and no Hugging Face repo of that name was found; check the "
                       "name, or log in (hf auth login) for a private repo") from None
    except RevisionNotFoundError:
        raise HubError(f"the Hugging Face repo {repo} has no revision {revision}; pass a branch, tag or commit it "
                       "has") from None
    except incomplete:
        raise HubError(f"the cached copy of {repo}{at} is incomplete and the Hub cannot be reached; fetch it again "
                       "online") from None
    except LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "the Hub cannot be reached"
        raise HubError(f"{repo}{at} is not a folder here nor in the Hugging Face cache, and {why}; fetch it once "
                       "online, or pass a local folder") from None
    except (HfHubHTTPError, OSError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise HubError(f"could not fetch the Hugging Face repo {repo}{at} ({first}); check the connection and "
                       "try again") from None
    if not folder.is_dir():  # nothing in the repo matched: the Hub gives the folder it would have made
        raise HubError(f"the Hugging Face repo {repo}{at} holds neither a llama-ane export (manifest.json) nor a "
                       "checkpoint (config.json) at its root")
    return folder.resolve()
