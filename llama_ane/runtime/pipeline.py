"""The chunked inference pipeline: one forward pass, windows of tokens through embeddings -> block
chunks -> LM head, for single sequences and for cascade branches alike.

Every model's inputs are taken by name from what the manifest says the function reads: the
embeddings' outputs, the running hidden states, the chunk's cache, and any state the caller adds
(a cascade's suffix caches). Caches are written one of two ways:

  * by the cache-update model (every backend; what a device runs): after chunk i runs, its update
    is submitted to a worker thread and chunk i+1 starts at once; chunk i waits for its own update
    only when it runs again. An update that fails or does not finish in time is raised as
    `CacheUpdateError` in the caller, never a hang.
  * directly, for a backend with `direct_cache` (the torch backend on a CPU): the window's new K/V
    is copied into the cache arrays in place, and each chunk reads only the cache positions that
    hold tokens (the others are masked: their attention weights are exactly 0). The same numbers,
    without a thread competing for the cores or a pass over the whole context per step.

An export whose caches are Core ML states (`--kv-cache state`, manifest "cache"."kind") has no
cache-update model for its windows: each chunk function reads its state and writes the window's
K/V into it at `position`. The pipeline passes the same cache arrays as states (the mil backend
writes them in place, as Core ML updates an MLState), and a backend that runs the torch modules
hands the new K/V back to be written directly. A prefill window must then fit in the states
whole, padding included: the last tokens before the end run one at a time, except where the
prefill window decodes, whose states hold a window more than the context (`cache_length`).

Where the prefill window decodes (manifest decode_function "prefill"), the embeddings take each
row's position and the host makes the masks (runtime/masks.py), so that a cascade step can run as
one such window too (runtime/cascade.py).

Where the sliding layers keep a ring buffer (manifest cache.sliding), each chunk's cache dict also
holds "k_ring"/"v_ring" (their layers, channels, 1, R) beside "k"/"v" (the other layers'; either
pair is absent where the chunk has no such layers): position p is in slot p mod R, the ring is
read whole in every bucket and by direct caches (its masks cover its slots, which the embeddings
compute from `position`), and rewinding further than the ring can serve starts the sequence again.

Gemma 4's per-layer inputs come from the embeddings whole ("per_layer_inputs", every layer's rows;
where the table is cut by rows, each later file adds to them and the last completes them, as
"per_layer_inputs_out"); each chunk reads its own layers' rows as "per_layer_input".

`Pipeline.score_streamed` scores a fixed sequence in the other order (every window through one
model, then the next model), with the same per-window steps, so only one model's weights need to
be loaded at a time.

Every tensor name comes from `model.names`; the conv and recurrent states move on by the manifest's
carry rules (`runtime.carry`: what each function reads and returns for them), as in the Swift host.
"""

from __future__ import annotations

import functools
from typing import Callable

import numpy as np

from ..config import LlamaConfig
from ..model import names as N
from ..model.layers.delta_net import delta_rows, delta_shape
from ..model.functions import conv_rows, conv_state_width
from ..model.layers import MASK_VALUE
from ..errors import InvalidArgumentError, LlamaANEError
from ..contract.manifest import (cache_length, context_buckets, decode_function, function_entry, function_states,
                                 kv_cache_kind, ring_channels, ring_of)
from ..contract.specs import (BRANCHES, VERIFY, base_function, bucket_function, bucket_of, chunk_rows,
                              ring_rewind_limit, shared_rows, suffix_groups)
from .async_updates import AsyncUpdates, CacheUpdateError  # noqa: F401  (re-exported for callers)
from .backends.base import Backend
from .carry import FROM_OUTPUT, IN_STATE, carry_mode, move
from .kv_cache import KV_KEYS, RING_KEYS, RING_KV_KEYS, KVCache, common_prefix
from .masks import HostMasks

#: embeddings outputs that mask cache positions, and where their cache columns are (a sliding
#: layer's mask like the mask it is the twin of)
CACHE_MASKS = {N.MASK: "leading", N.PREFIX_MASK: "all", N.SLIDING_MASK: "leading", N.SLIDING_PREFIX_MASK: "all"}
#: a chunk's cache tensors (manifest names) -> their keys in a KVCache's per-chunk dict
CACHE_KEYS = {**{N.cache(key): key for key in KV_KEYS + RING_KV_KEYS}, **{c.state: c.key for c in N.CARRIED}}
#: a cascade's suffix caches (manifest names) -> the keys of the caches they hold a branch's K/V of
SUFFIX_KEYS = {N.suffix(key): key for key in KV_KEYS + RING_KV_KEYS}
#: the outputs of a window's new K/V (k_new, k_ring_new, ...)
NEW_KV = tuple(N.new(key) for key in KV_KEYS + RING_KV_KEYS)
RING_MASKS = (N.SLIDING_MASK, N.SLIDING_PREFIX_MASK)  # over the ring's slots where there is one


class ContextFullError(LlamaANEError, RuntimeError):
    """The tokens would not fit in the exported context length."""


class UnwiredInputError(RuntimeError):
    """A function reads a tensor that nothing in the pipeline produces (an export this runtime does not know)."""


class Pipeline:
    """One sequence's state (a `KVCache`) and the code that advances it.

    Attributes
    ----------
    cache : KVCache
        The tokens whose K/V are cached and the per-chunk caches; swap it with `use`.
    direct : bool
        Caches written in place and read up to the filled positions (see the module docstring).
    stateful : bool
        The chunk functions update their caches themselves (Core ML states).
    """

    def __init__(self, backend: Backend, manifest: dict):
        self.backend = backend
        self.manifest = manifest
        self.context_length: int = manifest["context_length"]
        self.buckets: list[int] = context_buckets(manifest)
        self.prefill_length: int = manifest["prefill_length"]
        self.chunks: list[dict] = manifest["chunks"]
        self.embedding_models: list[str] = manifest["embeddings"]["models"]
        self.head_models: list[str] = manifest["lm_head"]["models"]
        # the chunk that carries the LM head (--fold-lm-head): its outputs are the logits, with no head call
        self.folded: str | None = manifest["lm_head"].get("folded_into")
        # what a decoded token runs: "decode", or "prefill" where the prefill functions decode too
        self.decode_function = decode_function(manifest)
        self.lm_outputs = [o["name"] for model in (self.head_models or [self.folded])
                           for o in manifest["models"][model]["functions"][self.decode_function]["outputs"]
                           if N.logits_split(o["name"]) is not None]
        self.direct = bool(getattr(backend, "direct_cache", False))
        self.stateful = kv_cache_kind(manifest) == "state"
        self.ring = ring_of(manifest)  # the sliding layers' ring slots, 0: none
        self.config = cfg = LlamaConfig.from_dict(manifest["config"])
        # columns of the context-long caches (a state where the prefill window decodes has room for its padding)
        self.cache_length = cache_length(manifest)
        # where the prefill window decodes, its rows' positions are inputs and the host makes its masks
        self.masks = HostMasks(cfg, self.context_length, self.ring, backend.dtype) \
            if self.decode_function == "prefill" else None
        # per chunk: its layers' rows in the full cache and in the ring
        self.rows = [chunk_rows(cfg, c["layers"], self.ring) for c in self.chunks]
        # Gemma 4's KV-shared layers: the producers in other chunks each chunk reads (full cache, ring),
        # and where every layer lives (chunk, its index there)
        self.shared = [shared_rows(cfg, c["layers"], self.ring) for c in self.chunks]
        self.home = {n: (c, j) for c, chunk in enumerate(self.chunks) for j, n in enumerate(chunk["layers"])}
        # per chunk: its conv layers' count (LFM2's, and Qwen3.5's linear-attention layers'), and the
        # conv state's shape per layer (C, 1, W)
        self.conv_layers = [len(conv_rows(cfg, c["layers"])) for c in self.chunks]
        self.conv_shape = (cfg.conv_channels, 1, conv_state_width(cfg))
        # per chunk: its linear-attention layers' count (Qwen3.5), whose recurrent state is (H*Dk, 1, Dv) each
        self.delta_layers = [len(delta_rows(cfg, c["layers"])) for c in self.chunks]
        self.delta_shape = delta_shape(cfg).state_shape[1:] if cfg.recurrent_layers else None
        # per chunk: its layers' rows of the embeddings' per-layer inputs (Gemma 4), None where there are none
        p = cfg.per_layer_input_size
        self.per_layer_rows = [np.array([n * p + j for n in c["layers"] for j in range(p)]) if p else None
                               for c in self.chunks]
        self.rewind_limit = ring_rewind_limit(cfg, self.ring, self.prefill_length) if self.ring else None
        self.updates = AsyncUpdates([c["model"] for c in self.chunks])
        # per (chunk, function): how it carries each state beside the K/V (`runtime.carry`)
        self._carry: dict[tuple[int, str], dict[N.CarriedState, str]] = {}
        self.cache = self.new_cache()
        # the last `verify_tree` until `accept`: (start, window size, token ids, each chunk's pending write)
        self._tree: tuple[int, int, np.ndarray, list[tuple[int, str, dict]]] | None = None

    @property
    def position(self) -> int:
        """Tokens already written to the caches."""
        return self.cache.position

    def new_cache(self) -> KVCache:
        """An empty KVCache of this export: zeroed (layers, kv_channels, 1, context) arrays per chunk,
        and (ring layers, kv_channels, 1, R) ones where the chunk has ring layers."""
        return KVCache([], [self._empty(i) for i in range(len(self.chunks))])

    def _empty(self, i: int) -> dict[str, np.ndarray]:
        full, ring = self.rows[i]
        out = {key: self._zeros(len(full)) for key in KV_KEYS if full}
        out.update({key: self._zeros(len(ring), self.ring, ring_channels(self.manifest))
                    for key in RING_KV_KEYS if ring})
        if self.conv_layers[i]:
            out[N.CONV.key] = np.zeros((self.conv_layers[i], *self.conv_shape), self.backend.dtype)
        if self.delta_layers[i]:
            out[N.DELTA.key] = np.zeros((self.delta_layers[i], *self.delta_shape), self.backend.dtype)
        return out

    def _zeros(self, layers: int, length: int | None = None, channels: int | None = None) -> np.ndarray:
        return np.zeros((layers, channels or self.manifest["cache"]["channels"], 1, length or self.cache_length),
                        self.backend.dtype)

    @staticmethod
    def cache_inputs(caches: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """A chunk's caches {"k", "v", "k_ring", "v_ring"} by the names its functions read them."""
        return {name: caches[key] for name, key in CACHE_KEYS.items() if key in caches}
    def reset(self) -> None:
        """Start a new, empty cache: the next window starts at position 0 (a failed update of the
        previous sequence is dropped with its caches)."""
        self.updates.discard()
        self.cache = self.new_cache()

    def use(self, cache: KVCache) -> None:
        """Continue from `cache` (the current one's pending updates land first)."""
        self.updates.wait_all()
        self.cache = cache

    def start(self, cache: KVCache | None) -> None:
        """Begin a generation: on `cache` if given (`use`), else on a new, empty one (`reset`)."""
        if cache is None:
            self.reset()
        else:
            self.use(cache)

    def rewind(self, keep: int) -> int:
        """Forget all but the first `keep` cached tokens (their K/V stay where they are); returns the
        tokens kept. A ring whose slots of the tokens kept were overwritten since (more than
        `rewind_limit` tokens back) cannot serve them, nor can a conv state (it holds only the
        last tokens' values) go back at all: then nothing is kept."""
        self.updates.wait_all()
        if self.rewind_limit is not None and self.position - keep > self.rewind_limit:
            keep = 0
        if any(self.conv_layers) and keep < self.position:
            keep = 0
            # new arrays, not zeroed ones: a program's states are made afresh for them
            self.cache.caches = [self._empty(i) for i in range(len(self.chunks))]
        del self.cache.tokens[keep:]
        return keep

    def wait(self) -> None:
        """Block until every pending cache update has landed."""
        self.updates.wait_all()

    def _window(self, token_ids: np.ndarray) -> tuple[str, np.ndarray]:
        """The function and the input_ids of a window of n = len(token_ids) tokens.

        One token runs the "decode" functions with input_ids (1, 1); more run "prefill" with
        (1, prefill_length), padded with 0 (the padding's cache entries lie past the new position
        and are masked until overwritten). Where the prefill functions decode too, one token is such
        a window; with direct caches (the torch modules, which take any S) it runs unpadded.
        """
        n = len(token_ids)
        if not 1 <= n <= self.prefill_length:
            raise ValueError(f"a window holds 1..{self.prefill_length} tokens, got {n}")
        fn = "decode" if n == 1 and self.decode_function == "decode" else "prefill"
        width = 1 if n == 1 and (fn == "decode" or self.direct) else self.prefill_length
        window = np.zeros((1, width), np.int32)
        window[0, :n] = token_ids
        return fn, window

    def bucket(self, positions: int) -> int:
        """The smallest context bucket that holds `positions` cache positions: the one a window
        ending there runs in (its functions read no more of the cache than that)."""
        return next((b for b in self.buckets if b >= positions), self.context_length)

    def _bucket_of_window(self, k: int, end: int, every_bucket: bool) -> int:
        holding = [b for b in self.buckets if b >= end] or [self.context_length]
        return holding[k % len(holding)] if every_bucket else holding[0]

    def embed(self, fn: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Function `fn` of the embeddings files in order on `inputs` (input_ids and the function's
        positions): hidden_states (1, C, 1, S), the RoPE tables and the masks. Each file after the
        first adds the lookup of its rows of the table to the hidden states (the same in every
        context bucket: they run the bucket's base function)."""
        out = dict(self.backend.predict(self.embedding_models[0], fn, inputs))
        for part in self.embedding_models[1:]:
            self._embed_part(part, base_function(fn), inputs[N.INPUT_IDS], out)
        return out

    def _embed_part(self, part: str, fn: str, input_ids: np.ndarray, emb: dict[str, np.ndarray]) -> None:
        """Embeddings file `part` on the files' before it outputs `emb`, updated in place: its rows'
        lookup added to the hidden states (and Gemma 4's per_layer_inputs, which the last file
        completes)."""
        inputs = {N.INPUT_IDS: input_ids, N.HIDDEN_STATES: emb[N.HIDDEN_STATES]}
        if N.PER_LAYER_INPUTS in emb:
            inputs[N.PER_LAYER_INPUTS] = emb[N.PER_LAYER_INPUTS]
        out = self.backend.predict(part, fn, inputs)
        emb[N.HIDDEN_STATES] = out[N.HIDDEN_STATES_OUT]
        if N.PER_LAYER_INPUTS_OUT in out:
            emb[N.PER_LAYER_INPUTS] = out[N.PER_LAYER_INPUTS_OUT]

    def window_inputs(self, window: np.ndarray, position: int) -> dict[str, np.ndarray]:
        """The embeddings' inputs of a window at `position`: its tokens and the position, or (host
        masks) each row's position."""
        if self.masks is not None:
            return {N.INPUT_IDS: window, N.POSITIONS: position + np.arange(window.shape[1], dtype=np.int32)}
        return {N.INPUT_IDS: window, N.POSITION: np.array([position], np.int32)}

    def host_inputs(self, fn: str, position: int, s: int) -> dict[str, np.ndarray]:
        """What the chunks of a window of S rows at `position` read besides the embeddings' outputs
        where the host makes the masks: the position (where a state is written) and the masks over
        the function's context bucket. {} for the others."""
        if self.masks is None:
            return {}
        return {N.POSITION: np.array([position], np.int32),
                **self.masks.window_masks(position, s, bucket_of(fn, self.context_length))}

    def logits(self, fn: str, hidden: np.ndarray) -> np.ndarray:
        """Function `fn` of every LM head file on hidden (1, C, 1, S), the split logits joined in
        vocabulary order: float32 [S, vocab]."""
        parts: dict[str, np.ndarray] = {}
        for model in self.head_models:
            parts.update(self.backend.predict(model, base_function(fn), {N.HIDDEN_STATES: hidden}))
        return self._join(parts)

    def _join(self, parts: dict[str, np.ndarray]) -> np.ndarray:
        full = np.concatenate([parts[name] for name in self.lm_outputs], axis=1)  # (1, V, 1, S)
        return full[0, :, 0, :].T.astype(np.float32)

    def _check_room(self, n: int) -> None:
        if self.position + n > self.context_length:
            raise ContextFullError(
                f"{n} tokens do not fit: {self.position} are cached and the exported context length "
                f"is {self.context_length}; shorten the prompt, add --overflow shift (overflow=\"shift\") to keep "
                "the most recent tokens, or re-export with a larger --context-length")

    def visible(self, emb: dict[str, np.ndarray], length: int) -> dict[str, np.ndarray]:
        """`emb` with its cache masks cut to the first `length` cache positions (direct caches only).

        "mask" (1,1,S,T+S) keeps its cache columns [0, length) and its S window columns;
        "prefix_mask" (1,1,1,T) its first `length` columns; their sliding twins the same.
        """
        out = dict(emb)
        for name, where in CACHE_MASKS.items():
            if name in out and not (self.ring and name in RING_MASKS):  # a ring is read whole
                m = out[name]
                out[name] = (m[..., :length] if where == "all" else
                             np.concatenate([m[..., :length], m[..., m.shape[-1] - m.shape[-2]:]], axis=-1))
        return out

    def chunk_caches(self, i: int, length: int, bucket: int | None = None) -> dict[str, np.ndarray]:
        """Chunk i's caches {"k", "v"} as the chunk reads them: with direct caches, views of their
        first `length` positions (those holding tokens); as inputs, views of the first `bucket`
        positions (the function's context bucket); as states, the whole arrays (every bucket's
        function reads its part of one state of the whole context). A ring ("k_ring", "v_ring")
        is read whole."""
        caches = self.cache.caches[i]
        if self.direct:
            cut = length
        elif self.stateful or bucket is None or bucket == self.context_length:
            return caches
        else:
            cut = bucket
        return {key: cache if key in RING_KEYS else cache[..., :cut]
                for key, cache in caches.items()}

    def forward(self, fn: str, embed_inputs: dict[str, np.ndarray], write: Callable[[int, str, dict], None],
                visible: int, state: Callable[[int], dict[str, np.ndarray]] | None = None,
                host: dict[str, np.ndarray] | None = None, release: bool = False) -> np.ndarray:
        """One step of function `fn` through every model: the one forward pass of every decoder.

        embed_inputs: the embeddings function's int32 inputs (input_ids and its positions);
        write(i, update_function, chunk_outputs): stores chunk i's new K/V (see `write_window`);
        visible: cache positions that hold tokens (with direct caches, the chunks read only these);
        state(i): chunk i's own extra inputs by name (a cascade's suffix caches);
        host: what the chunks read that the host makes (`host_inputs`: masks, the write position);
        release: drop each embeddings and chunk model once it has run (`Backend.release`), so that
        one model's weights are held at a time (the verify gate's one pass).
        Each chunk's inputs are taken by the names the manifest gives them. Returns the logits,
        float32 [S, vocab] (S = the function's query length).
        """
        emb = self.embed(fn, embed_inputs)  # hidden (1,C,1,S), cos, sin, masks
        if release:
            for name in self.embedding_models:
                self.backend.release(name)
        if host:
            emb.update(host)
        if self.direct:
            emb = self.visible(emb, visible)
        hidden = emb[N.HIDDEN_STATES]
        bucket = bucket_of(fn, self.context_length)
        outs: list[dict[str, np.ndarray]] = []
        for i, chunk in enumerate(self.chunks):
            self.updates.wait(i)
            out = self.run_chunk(i, fn, {**embed_inputs, **emb}, hidden, self.chunk_caches(i, visible, bucket),
                                 outs, lambda c: self.chunk_caches(c, visible, bucket), state)
            outs.append(out)
            hidden = out.get(N.HIDDEN_STATES_OUT)
            write(i, chunk["cache_update"].get(fn), out)
            if release:
                self.backend.release(chunk["model"])
        return self.logits_of(fn, out)

    def run_chunk(self, i: int, fn: str, inputs: dict[str, np.ndarray], hidden: np.ndarray,
                  caches: dict[str, np.ndarray], outs: list[dict[str, np.ndarray]],
                  caches_of: Callable[[int], dict[str, np.ndarray]],
                  state: Callable[[int], dict[str, np.ndarray]] | None = None) -> dict[str, np.ndarray]:
        """Chunk i's function `fn` on hidden states `hidden` and its caches `caches` as it reads them
        (`chunk_caches`); `inputs`: the step's other named inputs (the embeddings' outputs, the
        host's masks and positions); `outs`, `caches_of`, `state`: what its KV-shared layers read of
        earlier chunks (`shared_inputs`), `state(i)` also its own extra inputs. Every loop over the
        chunks (`forward`, `score_streamed`) runs a chunk through here. Returns its outputs by name."""
        model = self.chunks[i]["model"]
        pool = {**inputs, N.HIDDEN_STATES: hidden, **self.cache_inputs(caches), **self.per_layer_input(i, inputs),
                **(state(i) if state else {}), **self.shared_inputs(i, fn, outs, caches_of, state)}
        return self.backend.predict(model, fn, self._inputs(model, fn, pool))

    def shared_inputs(self, i: int, fn: str, outs: list[dict[str, np.ndarray]],
                      caches_of: Callable[[int], dict[str, np.ndarray]],
                      state: Callable[[int], dict[str, np.ndarray]] | None = None) -> dict[str, np.ndarray]:
        """What chunk i's KV-shared layers read of their producers in earlier chunks (model.chunk's
        shared inputs): each producer's rows of its chunk's caches (`caches_of(c)`, as that chunk
        read them), of the K/V that chunk output in this step (`outs[c]`) and, in the cascade, of its
        suffix caches (`state(c)`). {} for a chunk without such layers."""
        out: dict[str, np.ndarray] = {}
        cfg = self.config
        for rows, ring in zip(self.shared[i], (False, True)):
            parts: dict[str, list[np.ndarray]] = {}
            for p in rows:
                c, j = self.home[p]
                full, in_ring = self.rows[c]
                key, row = (KV_KEYS[0], full.index(j)) if j in full else (RING_KV_KEYS[0], in_ring.index(j))
                caches, new_key, new_row = caches_of(c), key, row
                if fn == BRANCHES:  # its K/V of this step and its suffix caches, by the suffix groups
                    new_key, rows_c, at = next((k, r, a) for k, r, a in suffix_groups(cfg, self.chunks[c]["layers"],
                                                                                      self.ring) if j in r)
                    new_row, g = rows_c.index(j), at.num_key_value_heads
                    suffixes = state(c)
                for kv in "kv":  # this chunk's name of the producer's tensor; the producer's K or V
                    mine = N.kv(kv, ring)
                    held, new = (N.kv(kv, ring=k in RING_KV_KEYS) for k in (key, new_key))
                    parts.setdefault(N.shared(N.cache(mine)), []).append(caches[held][row:row + 1])
                    parts.setdefault(N.shared(N.new(mine)), []).append(outs[c][N.new(new)][new_row:new_row + 1])
                    if fn == BRANCHES:
                        parts.setdefault(N.shared(N.suffix(mine)), []).append(
                            suffixes[N.suffix(new)][new_row * g:(new_row + 1) * g])
            out.update({name: np.concatenate(arrays, axis=0) for name, arrays in parts.items()})
        return out

    def per_layer_input(self, i: int, emb: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Chunk i's rows of the embeddings' per-layer inputs {"per_layer_input": (1, L*P, 1, S)}, or {}."""
        rows = self.per_layer_rows[i]
        return {} if rows is None else {N.PER_LAYER_INPUT: emb[N.PER_LAYER_INPUTS][:, rows]}

    def logits_of(self, fn: str, out: dict[str, np.ndarray]) -> np.ndarray:
        """The logits after the last chunk's outputs `out` of function `fn`: its own logits_j when
        it carries the LM head, else every LM head file on its hidden states. float32 [S, vocab]."""
        return self._join(out) if self.folded else self.logits(fn, out[N.HIDDEN_STATES_OUT])

    def _inputs(self, model: str, fn: str, pool: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The inputs and states of `fn` of `model`, by the manifest's names, from `pool`."""
        entry = function_entry(self.manifest, model, fn)
        names = [t["name"] for t in entry["inputs"] + function_states(entry)]
        missing = [n for n in names if n not in pool]
        if missing:
            raise UnwiredInputError(f"{model} ({fn}) reads {', '.join(missing)}, which this runtime does not "
                                    "produce; is the export from a newer llama-ane?")
        return {n: pool[n] for n in names}

    def update(self, function: str, state: dict[str, np.ndarray], chunk_out: dict[str, np.ndarray],
               values: dict[str, np.ndarray]) -> None:
        """Run cache-update `function` and store its outputs `X_out` back into `state[X]`.

        Its inputs come by name from `state` (the caches it rewrites, keyed "k"/"v" or by name),
        the chunk's outputs and `values` (int32 positions)."""
        entry = function_entry(self.manifest, "cache_update", function)
        keys = self._state_keys(entry)
        width = {t["name"]: t["shape"][-1] for t in entry["inputs"]}  # a context bucket's first positions
        named = {name: state[key][..., :width[name]] for name, key in keys.items()}
        out = self.backend.predict("cache_update", function,
                                   self._inputs("cache_update", function, {**named, **chunk_out, **values}))
        for name, key in keys.items():
            new = out[N.updated(name)]
            if new.shape == state[key].shape:
                state[key] = new
            else:  # a context bucket's first positions of the whole cache
                state[key][..., :new.shape[-1]] = new

    @staticmethod
    def _state_keys(entry: dict) -> dict[str, str]:
        """The tensors a cache update rewrites (outputs X_out of inputs X), each with the key of
        its array in a state dict: "k_cache" -> "k", "v_suffix" -> "v", "k_ring" -> "k_ring",
        "k_ring_suffix" -> "k_ring" (`CACHE_KEYS`, `SUFFIX_KEYS`)."""
        outputs = {t["name"] for t in entry["outputs"]}
        keys = {**CACHE_KEYS, **SUFFIX_KEYS}
        rewritten = [t["name"] for t in entry["inputs"] if N.updated(t["name"]) in outputs]
        unknown = [name for name in rewritten if name not in keys]
        if unknown:
            raise UnwiredInputError(f"a cache update rewrites {', '.join(unknown)}, which this runtime does not hold; "
                                    "is the export from a newer llama-ane?")
        return {name: keys[name] for name in rewritten}

    def ring_slots(self, positions: np.ndarray) -> np.ndarray:
        """The ring slots of cache positions (int32), -1 (dropped) staying -1."""
        positions = np.asarray(positions, np.int32)
        return np.where(positions >= 0, positions % max(self.ring, 1), -1).astype(np.int32)

    def write_window(self, i: int, fn: str, function: str | None, out: dict[str, np.ndarray], position: int,
                     n: int) -> None:
        """Store chunk i's k_new/v_new (layers, kv, 1, S) of its function `fn` for the window at
        `position` (n real tokens, which fit in the context): in place (direct caches, or a stateful
        export's K/V handed back by the torch modules), not at all (the program updated its states),
        or by the cache-update model `function` in the background. Its conv and recurrent states
        move on first (`carry_states`)."""
        caches = self.cache.caches[i]
        self.carry_states(i, fn, caches, out, n)
        if self.stateful and not any(name in out for name in NEW_KV):
            return
        if function is None and not (self.direct or self.stateful):  # a chunk of conv layers only keeps no K/V
            return
        if self.direct or self.stateful:
            for key in KV_KEYS + RING_KV_KEYS:
                if N.new(key) not in out:
                    continue
                # n <= R: no ring slot written twice
                columns = (self.ring_slots(position + np.arange(n)) if key in RING_KV_KEYS
                           else slice(position, position + n))
                caches[key][..., columns] = out[N.new(key)][..., :n]
            return
        self.updates.submit(i, functools.partial(
            self.update, function, caches, out, {N.POSITION: np.array([position], np.int32)}))

    def carry_modes(self, i: int, fn: str) -> dict[N.CarriedState, str]:
        """How chunk i's function `fn` carries each state beside the K/V (`carry.carry_mode`), from
        the manifest: what the function reads and returns for it."""
        modes = self._carry.get((i, fn))
        if modes is None:
            model = self.chunks[i]["model"]
            entry = function_entry(self.manifest, model, fn)
            modes = self._carry[(i, fn)] = {c: carry_mode(entry, c, f"{model} ({fn})") for c in N.CARRIED}
        return modes

    def carry_states(self, i: int, fn: str, caches: dict[str, np.ndarray], out: dict[str, np.ndarray], n: int) -> None:
        """Chunk i's conv and recurrent states after its function `fn` ran a window of n real tokens,
        by the manifest's carry rules: a state the function reads as an input moves on by what it
        returns (`CarriedState.after_window`: the conv state by the window's values, the last W up
        to the n-th real one, a slice here where the programs pick them with short_conv's one-hot;
        the recurrent state replaced by the one after the window's real tokens); a state the program
        holds it writes itself, unless the backend handed the write back (the torch modules)."""
        for carried, mode in self.carry_modes(i, fn).items():
            if mode == FROM_OUTPUT or (mode == IN_STATE and carried.new in out):
                caches[carried.key] = move(carried.after_window, caches[carried.key], out[carried.new], n)

    def run_window(self, token_ids: list[int] | np.ndarray) -> np.ndarray:
        """Advance by up to `prefill_length` tokens; return their logits, float32 [n, vocab].

        Token-major: the window goes through the embeddings, every chunk and the LM head.
        """
        ids = np.asarray(token_ids, dtype=np.int32).reshape(-1)
        fn, window = self._window(ids)
        start = self.position
        if start + len(ids) > self.context_length:
            raise ContextFullError(
                f"the context is full: {start} + {len(ids)} tokens exceed the exported context length "
                f"{self.context_length}; re-export with a larger --context-length")
        if self.stateful and start + window.shape[1] > self.cache_length:
            # a state is written a whole window at a time: the padding must fit too
            return np.concatenate([self.run_window(ids[j:j + 1]) for j in range(len(ids))], axis=0)
        fn = bucket_function(fn, self.bucket(start + len(ids)), self.context_length)
        logits = self.forward(fn, self.window_inputs(window, start),
                              lambda i, function, out: self.write_window(i, fn, function, out, start, len(ids)),
                              visible=start, state=lambda i: {N.WINDOW_TOKENS: np.array([len(ids)], np.int32)},
                              host=self.host_inputs(fn, start, window.shape[1]))[:len(ids)]
        self.cache.tokens.extend(int(t) for t in ids)
        return logits

    def verify_tree(self, token_ids: np.ndarray, depths: np.ndarray, tree_mask: np.ndarray) -> np.ndarray:
        """Run the "verify" function on a token tree after the cached tokens; return the logits
        after each of its n tokens, float32 [n, vocab]. Nothing reaches the cache until `accept`.

        token_ids, depths: (n,) int32, the tree's tokens (token 0 the root) and depths; tree_mask:
        (1, 1, n, n) additive (chunks/verify.py). The window is padded to the exported W (padding
        sees only itself and nothing sees it); with direct caches it runs at its n tokens instead.
        """
        w = self.manifest.get("verify_window", 0)
        n = len(token_ids)
        if not w:
            raise InvalidArgumentError("this export has no verify function: re-export it with --verify-window 16")
        if not 1 <= n <= w:
            raise ValueError(f"a verify window holds 1..{w} tokens, got {n}")
        start = self.position
        self._check_room(int(depths.max()) + 1)
        size = n if self.direct else w
        ids, pos = np.zeros((1, size), np.int32), np.zeros(size, np.int32)
        ids[0, :n], pos[:n] = token_ids, depths
        mask = np.full((1, 1, size, size), MASK_VALUE, self.backend.dtype)
        mask[0, 0, np.arange(size), np.arange(size)] = 0
        mask[..., :n, :n] = tree_mask
        pending: list[tuple[int, str, dict]] = []
        inputs = {N.INPUT_IDS: ids, N.POSITION: np.array([start], np.int32), N.DEPTHS: pos, N.TREE_MASK: mask}
        logits = self.forward(VERIFY, inputs, lambda i, function, out: pending.append((i, function, out)),
                              visible=start)[:n]
        self._tree = (start, size, np.asarray(token_ids, np.int32), pending)
        return logits

    def accept(self, path: list[int]) -> None:
        """Keep the tree tokens `path` (window indices from the root down one branch, root first)
        of the last `verify_tree`: their K/V go to the cache at consecutive positions, the rest is
        dropped. Direct caches copy the columns; otherwise the "verify" cache update writes them."""
        start, size, ids, pending = self._tree
        self._tree = None
        path = list(path)
        if not path or path[0] != 0:
            raise ValueError(f"an accepted path starts at the root (index 0), got {path}")
        slots = np.full(size, -1, np.int32)
        slots[path] = start + np.arange(len(path), dtype=np.int32)
        where = {N.SLOTS: slots, **({N.RING_SLOTS: self.ring_slots(slots)} if self.ring else {})}
        for i, function, out in pending:
            caches = self.cache.caches[i]
            if self.direct:
                for key in KV_KEYS + RING_KV_KEYS:
                    if N.new(key) in out:
                        columns = where[N.RING_SLOTS][path] if key in RING_KV_KEYS else slice(start, start + len(path))
                        caches[key][..., columns] = out[N.new(key)][..., path]
            else:
                self.updates.submit(i, functools.partial(self.update, function, caches, out, where))
        self.cache.tokens.extend(int(t) for t in ids[path])

    def score_streamed(self, token_ids: list[int] | np.ndarray, every_bucket: bool = False) -> np.ndarray:
        """Teacher-forced logits float32 [T, vocab] of `token_ids` from position 0, one model at a time.

        The same windows, functions and cache writes as `prefill(token_ids, all_logits=True)` after
        `reset()` (with direct caches, the same cache positions read, as `forward` does), in
        chunk-major order: every window through the embeddings, then every window
        through chunk 0 (against chunk 0's own caches, updated after each window), then chunk 1, ...,
        then the LM head. Each model is released (`Backend.release`) before the next one loads, and
        a chunk's caches are dropped once it has seen every window, so memory holds one model's
        weights, one chunk's caches and the windows' activations (hidden states, T x C). A window's
        computation does not depend on the order, so the logits are the token-major ones exactly.

        With `every_bucket`, window k runs in the k-th (cyclically) of the context buckets that hold
        it, not always the smallest: one pass then runs every bucket's functions (the parity gate),
        and the logits stay those of any bucket (a bucket's extra positions are masked to exactly 0).

        Starts and ends with `reset()`: whatever sequence the pipeline held is dropped. Where
        KV-shared layers read an earlier chunk's caches (Gemma 4), that chunk's caches as each window
        read them and its window K/V are kept, copied, until the chunks reading them have run.
        """
        ids = np.asarray(token_ids, dtype=np.int32).reshape(-1)
        if len(ids) == 0:
            raise InvalidArgumentError("no tokens to score; give some text")
        self.reset()  # the caches of chunks not yet run are untouched zeros (np.zeros commits no pages)
        self._check_room(len(ids))
        starts = range(0, len(ids), self.prefill_length)
        parts = [ids[start:start + self.prefill_length] for start in starts]
        windows = [self._window(part) for part in parts]  # (function, input_ids (1, S)), in its context bucket
        windows = [(bucket_function(fn, self._bucket_of_window(k, start + len(part), every_bucket),
                                    self.context_length), window)
                   for k, ((fn, window), part, start) in enumerate(zip(windows, parts, starts))]
        first, *later = self.embedding_models
        embs = [{**self.backend.predict(first, fn, self.window_inputs(window, start)),
                 **self.host_inputs(fn, start, window.shape[1])} for (fn, window), start in zip(windows, starts)]
        self.backend.release(first)
        for part in later:
            for emb, (fn, window) in zip(embs, windows):
                self._embed_part(part, base_function(fn), window, emb)
            self.backend.release(part)
        if self.direct:  # as `forward` reads them: the masks up to the filled positions
            embs = [self.visible(emb, start) for emb, start in zip(embs, starts)]
        hidden = [emb[N.HIDDEN_STATES] for emb in embs]  # per window (1, C, 1, S)
        producers = {self.home[p][0] for shared in self.shared for rows in shared for p in rows}
        # per producer chunk, per window: its caches as read and its window K/V (what shared_inputs takes)
        kept: dict[int, list[tuple[dict[str, np.ndarray], dict[str, np.ndarray]]]] = {}
        for i, chunk in enumerate(self.chunks):
            for w, ((fn, _), start) in enumerate(zip(windows, starts)):
                caches = self.cache.caches[i]
                read = self.chunk_caches(i, start, bucket_of(fn, self.context_length))
                position = np.array([start], np.int32)
                outs = [kept[c][w][1] if c in kept else {} for c in range(i)]
                out = self.run_chunk(i, fn, {**embs[w], N.POSITION: position,
                                             N.WINDOW_TOKENS: np.array([len(parts[w])], np.int32)},
                                     hidden[w], read, outs, lambda c: kept[c][w][0])
                if i in producers:  # copies: the writes below change the caches in place
                    kept.setdefault(i, []).append(({k: a.copy() for k, a in read.items()},
                                                   {k: a.copy() for k, a in out.items() if k in NEW_KV}))
                hidden[w] = out[N.HIDDEN_STATES_OUT] if chunk["model"] != self.folded else out
                # synchronous: the next window of this chunk reads the updated caches at once
                if self.direct or self.stateful:
                    self.write_window(i, fn, None, out, start, len(parts[w]))
                else:
                    self.carry_states(i, fn, caches, out, len(parts[w]))
                    if fn in chunk["cache_update"]:
                        self.update(chunk["cache_update"][fn], caches, out, {N.POSITION: position})
            self.cache.caches[i] = None  # chunk i has seen every window
            self.backend.release(chunk["model"])
        # the LM head files, unless the last chunk carried the head (then `hidden` holds its outputs)
        outputs: list[dict[str, np.ndarray]] = [{} for _ in windows] if not self.folded else hidden
        for model in self.head_models:
            for out, (fn, _), h in zip(outputs, windows, hidden):
                out.update(self.backend.predict(model, base_function(fn), {N.HIDDEN_STATES: h}))
            self.backend.release(model)  # the cache-update model holds no weights and stays
        self.reset()
        return np.concatenate([self._join(out)[:len(part)] for out, part in zip(outputs, parts)], axis=0)

    def prefill(self, token_ids: list[int] | np.ndarray, all_logits: bool = False) -> np.ndarray:
        """Run `token_ids` in windows. Returns logits [T, vocab] if `all_logits`, else [vocab] of the last."""
        ids = np.asarray(token_ids, dtype=np.int32).reshape(-1)
        if len(ids) == 0:
            raise InvalidArgumentError("the prompt is empty (no tokens to prefill); give some text")
        self._check_room(len(ids))
        outs = []
        for start in range(0, len(ids), self.prefill_length):
            logits = self.run_window(ids[start:start + self.prefill_length])
            outs.append(logits if all_logits else logits[-1:])
        return np.concatenate(outs, axis=0) if all_logits else outs[-1][0]

    def extend(self, token_ids: list[int] | np.ndarray) -> tuple[np.ndarray, int]:
        """Make the cache hold exactly `token_ids`, prefilling only what it does not hold yet.

        The longest common prefix of `token_ids` with the cached tokens is kept (at most all but
        the last token, which runs to give the next-token logits); the rest is prefilled. Returns
        the logits after the last token, float32 [vocab], and the number of tokens reused.
        """
        ids = [int(t) for t in np.asarray(token_ids).reshape(-1)]
        if not ids:
            raise InvalidArgumentError("the prompt is empty (no tokens to prefill); give some text")
        keep = self.rewind(min(common_prefix(self.cache.tokens, ids), len(ids) - 1))
        return self.prefill(ids[keep:]), keep

    def close(self) -> None:
        self.updates.close()
