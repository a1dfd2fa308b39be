"""The chunked inference pipeline: windows of tokens through embeddings -> block chunks -> LM head,
with each chunk's cache written by the cache-update model in the background.

After chunk i runs, its cache update is submitted to a worker thread and chunk i+1 starts at once;
chunk i waits for its own update only when it runs again, at the next window. An update that fails
or does not finish in time is raised as `CacheUpdateError` in the caller, never a hang.

`Pipeline.score_streamed` scores a fixed sequence in the other order (every window through one
model, then the next model), with the same per-window steps, so only one model's weights need to
be loaded at a time.
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
        self.embedding_models: list[str] = manifest["embeddings"]["models"]
        self.head_models: list[str] = manifest["lm_head"]["models"]
        self.lm_outputs = [o["name"] for model in self.head_models
                           for o in manifest["models"][model]["functions"]["decode"]["outputs"]]
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

    def _window(self, token_ids: np.ndarray) -> tuple[str, np.ndarray]:
        """The function and the input_ids of a window of n = len(token_ids) tokens.

        One token runs the "decode" functions with input_ids (1, 1); more run "prefill" with
        (1, prefill_length), padded with 0 (the padding's cache entries lie past the new position
        and are masked until overwritten).
        """
        n = len(token_ids)
        if not 1 <= n <= self.prefill_length:
            raise ValueError(f"a window holds 1..{self.prefill_length} tokens, got {n}")
        fn = "decode" if n == 1 else "prefill"
        window = np.zeros((1, 1 if n == 1 else self.prefill_length), np.int32)
        window[0, :n] = token_ids
        return fn, window

    def embed(self, fn: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Function `fn` of the embeddings files in order on `inputs` (input_ids and the function's
        positions): hidden_states (1, C, 1, S), the RoPE tables and the masks. Each file after the
        first adds the lookup of its rows of the table to the hidden states."""
        out = dict(self.backend.predict(self.embedding_models[0], fn, inputs))
        for part in self.embedding_models[1:]:
            out["hidden_states"] = self._embed_part(part, fn, inputs["input_ids"], out["hidden_states"])
        return out

    def _embed_part(self, part: str, fn: str, input_ids: np.ndarray, hidden: np.ndarray) -> np.ndarray:
        return self.backend.predict(part, fn, {"input_ids": input_ids, "hidden_states": hidden})["hidden_states_out"]

    def _window_inputs(self, window: np.ndarray, position: int) -> dict[str, np.ndarray]:
        return {"input_ids": window, "position": np.array([position], np.int32)}

    def _run_chunk(self, i: int, fn: str, emb: dict[str, np.ndarray], hidden: np.ndarray) -> dict[str, np.ndarray]:
        """Block chunk i on hidden (1, C, 1, S) against its current caches: hidden_states_out
        (1, C, 1, S) and the window's k_new, v_new (layers, kv_channels, 1, S)."""
        return self.backend.predict(self.chunks[i]["model"], fn, {
            "hidden_states": hidden, "cos": emb["cos"], "sin": emb["sin"], "mask": emb["mask"],
            "k_cache": self.caches[i]["k"], "v_cache": self.caches[i]["v"]})

    def logits(self, fn: str, hidden: np.ndarray) -> np.ndarray:
        """Function `fn` of every LM head file on hidden (1, C, 1, S), the split logits joined in
        vocabulary order: float32 [S, vocab]."""
        parts: dict[str, np.ndarray] = {}
        for model in self.head_models:
            parts.update(self.backend.predict(model, fn, {"hidden_states": hidden}))
        return self._join(parts)

    def _join(self, parts: dict[str, np.ndarray]) -> np.ndarray:
        full = np.concatenate([parts[name] for name in self.lm_outputs], axis=1)  # (1, V, 1, S)
        return full[0, :, 0, :].T.astype(np.float32)

    def _check_room(self, n: int) -> None:
        if self.position + n > self.context_length:
            raise ContextFullError(
                f"{n} tokens do not fit: {self.position} are cached and the exported context length "
                f"is {self.context_length}; shorten the prompt or re-export with a larger --context-length")

    def run_window(self, token_ids: list[int] | np.ndarray) -> np.ndarray:
        """Advance by up to `prefill_length` tokens; return their logits, float32 [n, vocab].

        Token-major: the window goes through the embeddings, every chunk and the LM head; each
        chunk's cache update runs in the background while the next chunk computes.
        """
        ids = np.asarray(token_ids, dtype=np.int32).reshape(-1)
        fn, window = self._window(ids)
        if self.position + len(ids) > self.context_length:
            raise ContextFullError(
                f"the context is full: {self.position} + {len(ids)} tokens exceed the exported context length "
                f"{self.context_length}; re-export with a larger --context-length")
        emb = self.embed(fn, self._window_inputs(window, self.position))  # hidden (1,C,1,S), cos, sin, mask
        hidden = emb["hidden_states"]
        for i, chunk in enumerate(self.chunks):
            self.updates.wait(i)
            out = self._run_chunk(i, fn, emb, hidden)
            hidden = out["hidden_states_out"]
            self.updates.submit(i, functools.partial(
                self._update, i, chunk["cache_update"][fn], out["k_new"], out["v_new"], self.position))
        logits = self.logits(fn, hidden)[:len(ids)]
        self.position += len(ids)
        return logits

    def score_streamed(self, token_ids: list[int] | np.ndarray) -> np.ndarray:
        """Teacher-forced logits float32 [T, vocab] of `token_ids` from position 0, one model at a time.

        The same windows, functions and cache updates as `prefill(token_ids, all_logits=True)` after
        `reset()`, in chunk-major order: every window through the embeddings, then every window
        through chunk 0 (against chunk 0's own caches, updated after each window), then chunk 1, ...,
        then the LM head. Each model is released (`Backend.release`) before the next one loads, and
        a chunk's caches are dropped once it has seen every window, so memory holds one model's
        weights, one chunk's caches and the windows' activations (hidden states, T x C). A window's
        computation does not depend on the order, so the logits are the token-major ones exactly.

        Starts and ends with `reset()`: whatever sequence the pipeline held is dropped.
        """
        ids = np.asarray(token_ids, dtype=np.int32).reshape(-1)
        if len(ids) == 0:
            raise ValueError("no tokens to score")
        self.reset()  # the caches of chunks not yet run are untouched zeros (np.zeros commits no pages)
        self._check_room(len(ids))
        starts = range(0, len(ids), self.prefill_length)
        parts = [ids[start:start + self.prefill_length] for start in starts]
        windows = [self._window(part) for part in parts]  # (function, input_ids (1, S))
        first, *later = self.embedding_models
        embs = [dict(self.backend.predict(first, fn, self._window_inputs(window, start)))
                for (fn, window), start in zip(windows, starts)]
        self.backend.release(first)
        for part in later:
            for emb, (fn, window) in zip(embs, windows):
                emb["hidden_states"] = self._embed_part(part, fn, window, emb["hidden_states"])
            self.backend.release(part)
        hidden = [emb["hidden_states"] for emb in embs]  # per window (1, C, 1, S)
        for i, chunk in enumerate(self.chunks):
            for w, ((fn, _), start) in enumerate(zip(windows, starts)):
                out = self._run_chunk(i, fn, embs[w], hidden[w])
                hidden[w] = out["hidden_states_out"]
                # synchronous: the next window of this chunk reads the updated caches at once
                self._update(i, chunk["cache_update"][fn], out["k_new"], out["v_new"], start)
            self.caches[i] = None  # chunk i has seen every window
            self.backend.release(chunk["model"])
        outputs: list[dict[str, np.ndarray]] = [{} for _ in windows]
        for model in self.head_models:
            for out, (fn, _), h in zip(outputs, windows, hidden):
                out.update(self.backend.predict(model, fn, {"hidden_states": h}))
            self.backend.release(model)  # the cache-update model holds no weights and stays
        self.reset()
        return np.concatenate([self._join(out)[:len(part)] for out, part in zip(outputs, parts)], axis=0)

    def prefill(self, token_ids: list[int] | np.ndarray, all_logits: bool = False) -> np.ndarray:
        """Run `token_ids` in windows. Returns logits [T, vocab] if `all_logits`, else [vocab] of the last."""
        ids = np.asarray(token_ids, dtype=np.int32).reshape(-1)
        if len(ids) == 0:
            raise ValueError("no tokens to prefill")
        self._check_room(len(ids))
        outs = []
        for start in range(0, len(ids), self.prefill_length):
            logits = self.run_window(ids[start:start + self.prefill_length])
            outs.append(logits if all_logits else logits[-1:])
        return np.concatenate(outs, axis=0) if all_logits else outs[-1][0]

    def close(self) -> None:
        self.updates.close()
