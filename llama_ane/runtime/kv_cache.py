"""A sequence's K/V cache as an object: reusable across generations, savable as a prompt-cache file.

`KVCache.tokens` are the token ids whose K/V the caches hold, in order (position = their number);
`KVCache.caches[i]` is chunk i's {"k", "v"}, each (layers, kv_channels, 1, context). Positions past
`position` may hold stale K/V: every function masks them, and the next write overwrites them.

A prompt-cache file (`save_cache` / `load_cache`, numpy .npz) holds the tokens, the filled
positions of every cache, and the sha256 of the manifest of the export that made it; a file made
by another export is refused.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import LlamaANEError

CACHE_FILE_VERSION = 1


class PromptCacheError(LlamaANEError, ValueError):
    """A prompt-cache file that cannot be used with this export; the message says why."""


@dataclass
class KVCache:
    """Token ids and the per-chunk caches holding their K/V (see the module docstring)."""

    tokens: list[int] = field(default_factory=list)
    caches: list[dict[str, np.ndarray]] = field(default_factory=list)

    @property
    def position(self) -> int:
        return len(self.tokens)


def manifest_digest(manifest: dict) -> str:
    """sha256 of the manifest's canonical JSON: what a prompt-cache file is tied to."""
    return hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def save_cache(cache: KVCache, manifest: dict, path: str | Path) -> Path:
    """Write `cache` to `path` (.npz): only its filled positions, tied to `manifest`."""
    path = Path(path)
    n = cache.position
    arrays = {f"{name}_{i}": c[name][..., :n] for i, c in enumerate(cache.caches) for name in ("k", "v")}
    meta = {"version": CACHE_FILE_VERSION, "manifest_sha256": manifest_digest(manifest), "name": manifest["name"],
            "tokens": [int(t) for t in cache.tokens]}
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "wb") as f:
        np.savez(f, meta=np.frombuffer(json.dumps(meta).encode(), np.uint8), **arrays)
    tmp.replace(path)  # never a half-written file under the real name
    return path


def load_cache(path: str | Path, manifest: dict, empty: KVCache) -> KVCache:
    """Read a prompt-cache file into `empty` (a new cache of this export) and return it.

    Raises PromptCacheError if the file is not a prompt cache or was made by another export.
    """
    path = Path(path)
    try:
        data = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise PromptCacheError(f"{path} is not a llama-ane prompt-cache file ({e}); delete it to make a new one") from None
    with data:
        return _fill(path, data, manifest, empty)


def _fill(path: Path, data, manifest: dict, empty: KVCache) -> KVCache:
    """`empty` given the tokens and K/V of the open prompt-cache file `data`, after checking it."""
    try:
        meta = json.loads(bytes(data["meta"]).decode())
    except (ValueError, KeyError) as e:
        raise PromptCacheError(f"{path} is not a llama-ane prompt-cache file ({e}); delete it to make a new one") from None
    if meta.get("version") != CACHE_FILE_VERSION:
        raise PromptCacheError(f"{path} has prompt-cache version {meta.get('version')}, this llama-ane reads "
                               f"{CACHE_FILE_VERSION}; delete it to make a new one")
    if meta["manifest_sha256"] != manifest_digest(manifest):
        raise PromptCacheError(f"{path} was made by another export ({meta.get('name')}, manifest sha256 "
                               f"{meta['manifest_sha256'][:12]}...) than this one ({manifest['name']}, "
                               f"{manifest_digest(manifest)[:12]}...); delete it, or use the export that made it")
    n = len(meta["tokens"])
    for i, c in enumerate(empty.caches):
        for name in ("k", "v"):
            c[name][..., :n] = data[f"{name}_{i}"]  # cast to the backend's dtype
    empty.tokens = list(meta["tokens"])
    return empty
