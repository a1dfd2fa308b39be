"""A sequence's K/V cache as an object: reusable across generations, savable as a prompt-cache file.

`KVCache.tokens` are the token ids whose K/V the caches hold, in order (position = their number);
`KVCache.caches[i]` is chunk i's {"k", "v"}, each (layers, kv_channels, 1, context), and where the
export's sliding layers keep a ring buffer, {"k_ring", "v_ring"} (ring layers, kv_channels, 1, R),
position p in slot p mod R. Positions past `position` may hold stale K/V: every function masks them,
and the next write overwrites them.

A prompt-cache file (`save_cache` / `load_cache`, numpy .npz) holds the tokens, the filled
positions of every cache (a ring whole, with its length), and the sha256 of the manifest of the export that made it; optionally how
its text was wrapped ("chat": by the chat template, "raw": as given), so that a run that wraps
its prompt otherwise can say so rather than silently reuse nothing, and a conversation's messages
(chat's /save), so that /load resumes the conversation itself. It is
untrusted: each array is checked from its .npy header (dtype, shape; never a pickle) before it is
read, and a file made by another export or longer than the context is refused. A file is written
under a temporary name and renamed, so a failed save leaves neither a partial nor a truncated file.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import secrets
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from ..errors import LlamaANEError
from ..model import names as N

CACHE_FILE_VERSION = 1
# saved whole: a chunk's ring buffer (its slots hold the last R positions), its conv layers' state
# (the last K-1 values of each, LFM2) and its linear-attention layers' recurrent state (Qwen3.5)
# the keys of a chunk's K/V in its cache dict (`names.kv`): the full caches' and the ring's
KV_KEYS, RING_KV_KEYS = N.KV_STEMS[:2], N.KV_STEMS[2:]
RING_KEYS = (*RING_KV_KEYS, *(c.key for c in N.CARRIED))
WRAPPINGS = ("chat", "raw")  # the prompt wrapped by the export's chat template, or given as it is


class PromptCacheError(LlamaANEError, ValueError):
    """A prompt-cache file that cannot be used with this export; the message says why."""


@dataclass
class KVCache:
    """Token ids and the per-chunk caches holding their K/V (see the module docstring)."""

    tokens: list[int] = field(default_factory=list)
    caches: list[dict[str, np.ndarray]] = field(default_factory=list)
    wrapping: str | None = None  # one of WRAPPINGS, or None: not recorded
    messages: list[dict[str, str]] | None = None  # the conversation the tokens render, if one

    @property
    def position(self) -> int:
        return len(self.tokens)


def _ring_length(cache: KVCache) -> int:
    """Slots of the ring buffer `cache` holds, 0 where it has none."""
    return next((c[RING_KV_KEYS[0]].shape[-1] for c in cache.caches if RING_KV_KEYS[0] in c), 0)


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
    """Write `cache` to `path` (.npz): only its filled positions, tied to `manifest`.

    The file appears whole or not at all: it is written under a temporary name in the same folder,
    synced and renamed over `path`; on any failure the temporary file is removed and `path` is left
    as it was. An existing file that is not a prompt cache is refused rather than replaced.
    """
    path = Path(path)
    if path.exists() and not _looks_like_prompt_cache(path):
        raise PromptCacheError(f"{path} exists and is not a llama-ane prompt-cache file; it was left as it is: "
                               "choose another file name for the prompt cache")
    n = cache.position
    arrays = {f"{name}_{i}": c[name] if name in RING_KEYS else c[name][..., :n]
              for i, c in enumerate(cache.caches) for name in (*KV_KEYS, *RING_KEYS) if name in c}
    meta = {"version": CACHE_FILE_VERSION, "manifest_sha256": manifest_digest(manifest), "name": manifest["name"],
            "tokens": [int(t) for t in cache.tokens]}
    ring = _ring_length(cache)
    if ring:
        meta["ring_length"] = ring
    if cache.wrapping is not None:
        meta["wrapping"] = cache.wrapping
    if cache.messages is not None:
        arrays["messages"] = np.frombuffer(json.dumps(cache.messages).encode(), np.uint8)
    tmp = None
    try:
        # a fresh name beside the target (the rename stays on one file system), made with the user's umask
        partial = path.with_name(f".{path.name}.{secrets.token_hex(4)}.partial")
        f = open(partial, "xb")
        tmp = partial  # ours to remove from here on
        with f:
            np.savez(f, meta=np.frombuffer(json.dumps(meta).encode(), np.uint8), **arrays)
            f.flush()
            os.fsync(f.fileno())  # the data is on disk before the name points at it
        os.replace(tmp, path)
        tmp = None
    except OSError as e:
        raise PromptCacheError(f"cannot write the prompt-cache file {path}: {_why(e, path)}") from None
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
    return path


def _why(e: OSError, path: Path) -> str:
    """What went wrong writing `path`, and what to do."""
    if e.errno == errno.ENOSPC:
        return "the disk is full; free some space or save it on another disk"
    if e.errno == errno.ENOENT and not path.parent.is_dir():
        return f"the folder {path.parent} does not exist; create it or choose another folder"
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"the folder {path.parent} is not writable; choose another folder"
    return f"{e.strerror or e}; choose another file name or folder"


def _looks_like_prompt_cache(path: Path) -> bool:
    """Whether `path` is a zip holding a prompt cache's meta array (what save_cache may replace)."""
    try:
        with zipfile.ZipFile(path) as z:
            return "meta.npy" in z.namelist()
    except (OSError, zipfile.BadZipFile):
        return False


def load_cache(path: str | Path, manifest: dict, empty: KVCache) -> KVCache:
    """Read a prompt-cache file into `empty` (a new cache of this export) and return it.

    Raises PromptCacheError, naming the file and the problem, if the file is missing, unreadable,
    not a prompt cache (object arrays are never unpickled), incomplete, made by another export or
    longer than the context.
    """
    path = Path(path)
    if not path.is_file():
        where = "is a folder, not a file" if path.is_dir() else "does not exist"
        raise PromptCacheError(f"the prompt-cache file {path} {where}; check the name")
    try:
        if not zipfile.is_zipfile(path):
            raise ValueError("it is not a zip archive")
        data = np.load(path, allow_pickle=False)
        if not isinstance(data, np.lib.npyio.NpzFile):
            raise ValueError("it is not an .npz archive")
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        raise _unusable(path, f"it cannot be read as an .npz archive: {e}") from None
    with data:
        return _fill(path, data, manifest, empty)


def _unusable(path: Path, problem: str) -> PromptCacheError:
    return PromptCacheError(f"{path} is not a usable llama-ane prompt-cache file ({problem}); it was left as it "
                            "is: re-create it (generate --prompt-cache with a new file name, or /save in chat)")


_READ_ERRORS = (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error)


def _array(path: Path, data, key: str, dtypes: tuple[type, ...], fits: Callable[[tuple[int, ...]], bool],
           want: str) -> np.ndarray:
    """The array `key` of the open archive, checked from its header before any data is read: one of
    `dtypes` (never Python objects) and a shape that `fits` (a crafted header may declare any size)."""
    member = f"{key}.npy"
    if member not in data.zip.namelist():
        raise _unusable(path, f"it has no {key!r} array")
    try:
        with data.zip.open(member) as f:
            version = np.lib.format.read_magic(f)
            if version not in ((1, 0), (2, 0)):
                raise ValueError(f"unsupported .npy format version {version}")
            read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else \
                np.lib.format.read_array_header_2_0
            shape, _, dtype = read_header(f)
    except _READ_ERRORS as e:
        raise _unusable(path, f"its {key!r} array cannot be read: {e}") from None
    if dtype not in [np.dtype(d) for d in dtypes] or not fits(shape):
        raise _unusable(path, f"its {key!r} array is {dtype} {shape}; this export's needs {want}")
    try:
        return data[key]
    except _READ_ERRORS as e:
        raise _unusable(path, f"its {key!r} array cannot be read: {e}") from None


def _json_array(path: Path, data, key: str, limit: int):
    """The JSON value stored as uint8 bytes (at most `limit`) in the archive's array `key`."""
    array = _array(path, data, key, (np.uint8,), lambda shape: len(shape) == 1 and shape[0] <= limit,
                   f"uint8 JSON bytes of at most {limit}")
    try:
        return json.loads(array.tobytes().decode("utf-8"))
    except ValueError as e:
        raise _unusable(path, f"its {key!r} array is not JSON: {e}") from None


def _meta(path: Path, data, manifest: dict, context: int) -> dict:
    """The checked metadata of the open archive: version, export identity, and tokens that fit."""
    meta = _json_array(path, data, "meta", 16 * context + 4096)  # `context` token ids and a few short fields
    if not isinstance(meta, dict):
        raise _unusable(path, "its 'meta' array is not a JSON object")
    if meta.get("version") != CACHE_FILE_VERSION:
        raise PromptCacheError(f"{path} has prompt-cache version {meta.get('version')!r}, this llama-ane reads "
                               f"{CACHE_FILE_VERSION}; re-create it with this version")
    digest = manifest_digest(manifest)
    if meta.get("manifest_sha256") != digest:
        made_by = str(meta.get("manifest_sha256"))[:12]
        raise PromptCacheError(f"{path} was made by another export ({meta.get('name')!r}, manifest sha256 "
                               f"{made_by}...) than this one ({manifest['name']}, {digest[:12]}...); use the export "
                               "that made it, or re-create it with this one")
    tokens = meta.get("tokens")
    vocab = manifest["config"]["vocab_size"]
    if not isinstance(tokens, list) or not all(type(t) is int and 0 <= t < vocab for t in tokens):
        raise _unusable(path, f"its tokens are not a list of token ids below the vocabulary size {vocab}")
    if len(tokens) > context:
        raise _unusable(path, f"it holds {len(tokens)} tokens, more than this export's context of {context}")
    if meta.get("wrapping") not in (None, *WRAPPINGS):
        raise _unusable(path, f"its wrapping {meta.get('wrapping')!r} is none of {', '.join(WRAPPINGS)}")
    return meta


def _messages(path: Path, data, context: int) -> list[dict[str, str]] | None:
    """The conversation stored with the cache (None if there is none), checked: a list of
    {"role", "content"} strings, of a size the context's text could have."""
    if "messages.npy" not in data.zip.namelist():
        return None
    messages = _json_array(path, data, "messages", 64 * context + 65536)  # the text of `context` tokens, escaped
    if not isinstance(messages, list) or not all(
            isinstance(m, dict) and set(m) == {"role", "content"} and all(isinstance(v, str) for v in m.values())
            for m in messages):
        raise _unusable(path, "its 'messages' are not a list of {role, content} texts")
    return messages


def _fill(path: Path, data, manifest: dict, empty: KVCache) -> KVCache:
    """`empty` given the tokens and K/V of the open prompt-cache file `data`, after checking it."""
    context = next((c[KV_KEYS[0]].shape[-1] for c in empty.caches if KV_KEYS[0] in c), manifest["context_length"])
    meta = _meta(path, data, manifest, context)
    tokens = meta["tokens"]
    ring = _ring_length(empty)
    if meta.get("ring_length", 0) != ring:
        raise _unusable(path, f"its sliding layers' ring buffer holds {meta.get('ring_length', 0)!r} positions, "
                              f"this export's {ring}")
    messages = _messages(path, data, context)
    n = len(tokens)
    for i, c in enumerate(empty.caches):
        for name in (*KV_KEYS, *RING_KEYS):
            if name not in c:
                continue
            key, want = f"{name}_{i}", c[name].shape if name in RING_KEYS else c[name][..., :n].shape
            array = _array(path, data, key, (np.float16, np.float32), lambda shape: shape == want,
                           f"float16 or float32 {want}")
            c[name][..., :want[-1]] = array  # cast to the backend's dtype
    empty.tokens = list(tokens)
    empty.wrapping, empty.messages = meta.get("wrapping"), messages
    return empty
