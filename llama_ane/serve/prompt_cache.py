"""An LRU of cached prefixes (token ids and their K/V), bounded by bytes, optionally spilled to disk.

Each entry keeps only the filled positions of every chunk's cache, so its size follows its tokens,
not the context. A request looks up the entry sharing the longest token prefix with its prompt;
the pipeline then reuses those positions and prefills only the rest (`Pipeline.extend`).

With a folder, an entry evicted from RAM is written there as a prompt-cache file (the format of
`llama-ane generate --prompt-cache`, tied to this export) and read back, checked, when a prompt
matches it better than anything in RAM. Files already in the folder at start are indexed; a file
that is not a usable prompt cache of this export is left alone and not used.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from ..runtime.kv_cache import RING_KEYS, KVCache, PromptCacheError, common_prefix, load_cache, save_cache

log = logging.getLogger(__name__)


@dataclass
class _Entry:
    tokens: tuple[int, ...]
    caches: list[dict[str, np.ndarray]]  # per chunk {"k", "v"}: (..., n) filled positions only

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for c in self.caches for a in c.values())


class PromptCache:
    """Cached prefixes of one export.

    `new_cache` makes an empty KVCache of the export (`Pipeline.new_cache`); `manifest` ties
    spilled files to the export. Thread-safe: the scheduler's worker uses it, `/metrics` reads it.
    """

    def __init__(self, new_cache: Callable[[], KVCache], manifest: dict, max_bytes: int,
                 folder: str | Path | None = None):
        self.new_cache = new_cache
        self.manifest = manifest
        self.max_bytes = max(0, int(max_bytes))
        self.folder = None if folder is None else Path(folder)
        self._ram: OrderedDict[tuple[int, ...], _Entry] = OrderedDict()
        self._disk: dict[tuple[int, ...], Path] = {}
        self._lock = threading.Lock()
        if self.folder is not None:
            self._index_folder()

    @property
    def bytes(self) -> int:
        with self._lock:
            return sum(e.nbytes for e in self._ram.values())

    @property
    def entries(self) -> int:
        return len(self._ram)

    def _index_folder(self) -> None:
        for path in sorted(self.folder.glob("*.npz")):
            try:
                cache = load_cache(path, self.manifest, self.new_cache())
            except PromptCacheError as e:
                log.warning("prompt cache: %s is not used: %s", path, e)
                continue
            self._disk[tuple(cache.tokens)] = path

    def shared(self, ids: Sequence[int]) -> int:
        """The most tokens of `ids` an entry holds (what `lookup` would reuse), copying nothing."""
        ids = list(ids)
        with self._lock:
            keys = list(self._ram) + list(self._disk)
        return max((common_prefix(list(key), ids) for key in keys), default=0)

    def lookup(self, ids: Sequence[int]) -> tuple[KVCache, int]:
        """A working cache holding the cached entry that shares the longest prefix with `ids`
        (a fresh, empty one when none does), and that shared length."""
        ids = list(ids)
        with self._lock:
            best, shared = None, 0
            for key, entry in self._ram.items():
                n = common_prefix(list(key), ids)
                if n > shared:
                    best, shared = entry, n
            on_disk = max(self._disk, key=lambda key: common_prefix(list(key), ids), default=None)
            disk_shared = 0 if on_disk is None else common_prefix(list(on_disk), ids)
            if best is not None:
                self._ram.move_to_end(best.tokens)
        cache = self.new_cache()
        if disk_shared > shared:
            try:
                cache = load_cache(self._disk[on_disk], self.manifest, cache)
            except PromptCacheError as e:  # changed on disk since it was indexed
                log.warning("prompt cache: %s", e)
                with self._lock:
                    self._disk.pop(on_disk, None)
                return self.new_cache(), 0
            self.put(cache)
            return cache, disk_shared
        if best is None:
            return cache, 0
        n = len(best.tokens)
        for target, source in zip(cache.caches, best.caches):
            for name, held in source.items():  # a ring buffer is held whole
                target[name][..., :held.shape[-1]] = held
        cache.tokens = list(best.tokens)
        return cache, shared

    def clear(self) -> None:
        """Forget every entry held in RAM (files in the folder stay)."""
        with self._lock:
            self._ram.clear()

    def put(self, cache: KVCache) -> None:
        """Remember the tokens `cache` holds and their K/V (copied: the caller goes on using it).

        An entry whose tokens begin the new ones is replaced by it (the new one holds all it held);
        a new prefix of an entry is only marked as used."""
        tokens = tuple(int(t) for t in cache.tokens)
        if not tokens or self.max_bytes == 0 and self.folder is None:
            return
        n = len(tokens)
        entry = _Entry(tokens, [{name: (a if name in RING_KEYS else a[..., :n]).copy() for name, a in c.items()}
                                for c in cache.caches])  # rings and carried states (conv, delta) whole
        spill: list[_Entry] = []
        with self._lock:
            for key in list(self._ram):
                if key == tokens[:len(key)]:
                    del self._ram[key]
                elif tokens == key[:n]:
                    self._ram.move_to_end(key)
                    return
            self._ram[tokens] = entry
            total = sum(e.nbytes for e in self._ram.values())
            while self._ram and total > self.max_bytes:
                _, old = self._ram.popitem(last=False)
                total -= old.nbytes
                spill.append(old)
        for old in spill:
            self._spill(old)

    def _spill(self, entry: _Entry) -> None:
        if self.folder is None:
            return
        name = hashlib.sha256(np.asarray(entry.tokens, np.int64).tobytes()).hexdigest()[:32]
        path = self.folder / f"{name}.npz"
        try:
            save_cache(KVCache(list(entry.tokens), entry.caches), self.manifest, path)
        except PromptCacheError as e:  # a full disk costs the entry, not the request
            log.warning("prompt cache: %s", e)
            return
        with self._lock:
            self._disk[entry.tokens] = path
