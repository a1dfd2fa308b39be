"""The chunked inference pipeline: windows of tokens through embeddings -> block chunks -> LM head,
with each chunk's cache written by the cache-update model in the background.

After chunk i runs, its cache update is submitted to a worker thread and chunk i+1 starts at once;
chunk i waits for its own update only when it runs again, at the next window. An update that fails
or does not finish in time is raised as `CacheUpdateError` in the caller, never a hang.
"""

from __future__ import annotations

import functools

import numpy as np

from .async_updates import AsyncUpdates, CacheUpdateError  # noqa: F401  (re-exported for callers)
from .backends.base import Backend


class ContextFullError(RuntimeError):
    """The tokens would not fit in the exported context length."""


class Pipeline:
    """One sequence's state (the caches and the position) and the code that advances it.

    Attributes
    ----------
    position : int
        Tokens already written to the caches.
    """

    def __init__(self, backend: Backend, manifest: dict):
        self.backend = backend
        self.manifest = manifest
        self.context_length: int = manifest["context_length"]
        self.prefill_length: int = manifest["prefill_length"]
        self.chunks: list[dict] = manifest["chunks"]
        self.lm_outputs = [o["name"] for o in manifest["models"]["lm_head"]["functions"]["decode"]["outputs"]]
        self.updates = AsyncUpdates([c["model"] for c in self.chunks])
        self.reset()

    def reset(self) -> None:
        """Empty the caches: the next window starts at position 0 (a failed update of the previous
        sequence is dropped with its caches)."""
        self.updates.discard()
        self.caches = [{"k": self.new_cache(len(c["layers"])), "v": self.new_cache(len(c["layers"]))}
                       for c in self.chunks]
        self.position = 0

    def new_cache(self, layers: int) -> np.ndarray:
        """A zeroed cache of one chunk, (layers, kv_channels, 1, context), in the backend's dtype."""
        return np.zeros((layers, self.manifest["cache"]["channels"], 1, self.context_length), self.backend.dtype)

    def wait(self) -> None:
        """Block until every pending cache update has landed."""
        self.updates.wait_all()

    def _update(self, i: int, function: str, k_new: np.ndarray, v_new: np.ndarray, position: int) -> None:
        cache = self.caches[i]
        out = self.backend.predict("cache_update", function, {
            "k_cache": cache["k"], "v_cache": cache["v"], "k_new": k_new, "v_new": v_new,
            "position": np.array([position], np.int32)})
        cache["k"], cache["v"] = out["k_cache_out"], out["v_cache_out"]

    def run_window(self, token_ids: list[int] | np.ndarray) -> np.ndarray:
        """Advance by up to `prefill_length` tokens; return their logits, float32 [n, vocab].

        One token runs the "decode" functions, more run "prefill" (the window padded with 0; the
        padding's cache entries lie past the new position and are masked until overwritten).
        """
        ids = np.asarray(token_ids, dtype=np.int32).reshape(-1)
        n = len(ids)
        if not 1 <= n <= self.prefill_length:
            raise ValueError(f"a window holds 1..{self.prefill_length} tokens, got {n}")
        if self.position + n > self.context_length:
            raise ContextFullError(
                f"the context is full: {self.position} + {n} tokens exceed the exported context length "
                f"{self.context_length}; re-export with a larger --context-length")
        fn = "decode" if n == 1 else "prefill"
        s = 1 if n == 1 else self.prefill_length
        window = np.zeros((1, s), np.int32)
        window[0, :n] = ids
        pos = np.array([self.position], np.int32)
        emb = self.backend.predict("embeddings", fn, {"input_ids": window, "position": pos})
        hidden = emb["hidden_states"]
        for i, chunk in enumerate(self.chunks):
            self.updates.wait(i)
            out = self.backend.predict(chunk["model"], fn, {
                "hidden_states": hidden, "cos": emb["cos"], "sin": emb["sin"], "mask": emb["mask"],
                "k_cache": self.caches[i]["k"], "v_cache": self.caches[i]["v"]})
            hidden = out["hidden_states_out"]
            self.updates.submit(i, functools.partial(
                self._update, i, chunk["cache_update"][fn], out["k_new"], out["v_new"], self.position))
        logits = self.backend.predict("lm_head", fn, {"hidden_states": hidden})
        full = np.concatenate([logits[name] for name in self.lm_outputs], axis=1)  # (1, V, 1, S)
        self.position += n
        return full[0, :, 0, :n].T.astype(np.float32)

    def prefill(self, token_ids: list[int] | np.ndarray, all_logits: bool = False) -> np.ndarray:
        """Run `token_ids` in windows. Returns logits [T, vocab] if `all_logits`, else [vocab] of the last."""
        ids = np.asarray(token_ids, dtype=np.int32).reshape(-1)
        if len(ids) == 0:
            raise ValueError("no tokens to prefill")
        if self.position + len(ids) > self.context_length:
            raise ContextFullError(
                f"{len(ids)} tokens do not fit: {self.position} are cached and the exported context length "
                f"is {self.context_length}; shorten the prompt or re-export with a larger --context-length")
        outs = []
        for start in range(0, len(ids), self.prefill_length):
            logits = self.run_window(ids[start:start + self.prefill_length])
            outs.append(logits if all_logits else logits[-1:])
        return np.concatenate(outs, axis=0) if all_logits else outs[-1][0]

    def close(self) -> None:
        self.updates.close()
