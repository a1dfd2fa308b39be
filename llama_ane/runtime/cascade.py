"""Branch decoding over a shared prefix (cascade): one prefix cache, B private suffix caches.

The prefix is prefilled once with the ordinary pipeline; its cache then serves every branch. Each
step runs the "decode_branches" functions: one token per branch, the prefix read once for all
of them inside the graph, each branch's own suffix cache, and the log-sum-exp merge
(chunks/cascade.py). Branches advance independently: a branch first feeds its own text (the
question, in document QA) one token per step, then samples; branches of different lengths and
branches that have finished are handled with masks. More branches than the exported width B run
in groups of B, each group reusing the same prefix cache.

Where the cascade steps through the prefill window (manifest "cascade" "window": the prefill window
decodes and every layer attends over one cache, model.functions.cascades_in_window), there are no
suffix caches: a step runs the group's tokens as the rows of one prefill window, each at its own
position, and writes their K/V into the one cache after the prefix, the branches side by side
(runtime/masks.py: branch b's i-th token in column P + i*G + b for a group of G). The masks show each
row the prefix and its own branch. The prefix is read once for every branch, as in the cascade
function, and the model keeps one function; the branches' tokens then share the context.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from ..errors import InvalidArgumentError
from ..contract.manifest import window_cascade
from ..contract.specs import BRANCHES, bucket_function, suffix_groups
from ..model import names as N
from .carry import BRANCHES as CARRIED_BY_BRANCH, branch_copies, move
from .kv_cache import KV_KEYS, RING_KV_KEYS, KVCache
from .pipeline import ContextFullError, Pipeline
from .sampling import SamplingParams, SeededRandom, branch_seed, sample
from .text_stream import TextStream

# a branch's per-branch states (cache keys) -> the cascade function's inputs they are read as; the
# other keys are suffix caches ("k" -> "k_suffix")
BRANCH_STATES = {c.key: c.branches for c in N.CARRIED}


@dataclass
class BranchResult:
    """One branch's output: its own input ids, generated ids and text, and why it stopped."""

    index: int
    input_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = "length"
    logits: list = field(default_factory=list, repr=False)  # per fed token, when recording (teacher forcing)


@dataclass
class CascadeStats:
    """Per-run accounting. Bytes are the prefix K/V read per decode step, all layers."""

    prefix_tokens: int
    branches: int
    steps: int
    generated_tokens: int
    prefill_seconds: float
    decode_seconds: float
    prefix_bytes_per_step_cascade: int
    prefix_bytes_per_step_separate: int
    reused_tokens: int = 0  # prefix tokens whose K/V a given cache already held

    @property
    def decode_tokens_per_s(self) -> float:
        return self.generated_tokens / self.decode_seconds if self.decode_seconds > 0 else float("nan")


@dataclass
class CascadeOutput:
    """What `generate_branches` returns: one result per branch, in order, and the run's accounting."""

    branches: list[BranchResult]
    stats: CascadeStats


class _Branch:
    """Mutable decoding state of one branch within a group."""

    def __init__(self, result: BranchResult, rng: SeededRandom, first_logits: np.ndarray | None,
                 text: TextStream):
        self.result = result
        self.rng = rng
        self.queue = list(result.input_ids)  # own tokens still to feed
        self.cached = 0  # tokens in this branch's suffix cache
        self.first_logits = first_logits  # prefix logits, when the branch has no text of its own
        self.text = text
        self.done = False


def prefix_bytes_per_step(manifest: dict, prefix_tokens: int, dtype_bytes: int) -> int:
    """Bytes of prefix K and V that one decode step reads, over all layers: a model from the cache
    shapes (attention layers x K/V channels x prefix tokens; conv layers keep no K/V), not a measurement."""
    config = manifest["config"]
    layers = config["num_hidden_layers"] - len(config.get("conv_layers", [])) - len(config.get("delta_layers", []))
    return 2 * layers * manifest["cache"]["channels"] * prefix_tokens * dtype_bytes


@dataclass
class WindowSteps:
    """A group's steps through the prefill window so far (`CascadeDecoder.new_state`)."""

    steps: int = 0


class CascadeDecoder:
    """Runs groups of up to B branches over the prefix held in `pipeline`'s caches."""

    def __init__(self, pipeline: Pipeline, tokenizer, eos_token_ids: Sequence[int]):
        manifest = pipeline.manifest
        self.width = int(manifest.get("branch_width") or 0)
        if self.width < 1:
            raise InvalidArgumentError("this export has no cascade function (exported with --branches 0); "
                             "re-export with --branches 8")
        self.pipeline = pipeline
        self.backend = pipeline.backend
        self.manifest = manifest
        self.suffix_length = int(manifest["suffix_length"])
        self.in_window = window_cascade(manifest)  # a step runs as the prefill window (module docstring)
        self.tokenizer = tokenizer
        self.eos = set(eos_token_ids)

    def run(self, prefix_ids: Sequence[int], own: Sequence[Sequence[int]], max_new_tokens: int,
            params: SamplingParams, seed: int | None = None, stop: Sequence[str] | None = None,
            on_token: Callable[[int, int, str], None] | None = None, teacher_forced: bool = False,
            cache: KVCache | None = None) -> CascadeOutput:
        """Prefill the shared prefix once (reusing what `cache` holds), then decode one branch per
        entry of `own` (its own tokens after the prefix) in groups of the exported width B, each
        branch seeded from `seed` and its index; returns the results and the run's accounting."""
        try:
            self.check_budget(len(prefix_ids), [len(o) for o in own], max_new_tokens)
            self.pipeline.start(cache)
            t0 = time.perf_counter()
            first, reused = self.pipeline.extend(prefix_ids)
            self.pipeline.wait()
            t1 = time.perf_counter()
            results = [BranchResult(i, list(ids)) for i, ids in enumerate(own)]
            steps = 0
            for start in range(0, len(results), self.width):
                group = [_Branch(r, SeededRandom(None if seed is None else branch_seed(seed, r.index)), first,
                                 TextStream(self.tokenizer, stop or []))
                         for r in results[start:start + self.width]]
                steps += self.run_group(group, len(prefix_ids), max_new_tokens, params, on_token,
                                        record_logits=teacher_forced)
            t2 = time.perf_counter()
        finally:
            self.close()
        per_step = prefix_bytes_per_step(self.manifest, len(prefix_ids), self.backend.dtype.itemsize)
        stats = CascadeStats(len(prefix_ids), len(results), steps, sum(len(r.token_ids) for r in results),
                             t1 - t0, t2 - t1, per_step, per_step * min(len(results), self.width),
                             reused_tokens=reused)
        return CascadeOutput(results, stats)

    def check_budget(self, prefix_tokens: int, own_tokens: Sequence[int], max_new_tokens: int) -> None:
        """Refuse branches whose tokens would not fit: clear errors, before any work."""
        ctx = self.pipeline.context_length
        if prefix_tokens < 1:
            raise InvalidArgumentError("the shared prefix is empty; give a prompt or document")
        if prefix_tokens > ctx:
            raise ContextFullError(f"the prefix has {prefix_tokens} tokens but the exported context holds {ctx}; "
                                   "shorten it or re-export with a larger --context-length")
        need = max(own_tokens) + max_new_tokens
        group = min(len(own_tokens), self.width)
        if self.fits(prefix_tokens, 0, need, group):
            return
        if self.in_window:
            raise ContextFullError(
                f"a branch needs {need} tokens (its own {max(own_tokens)} + {max_new_tokens} new); {group} branches "
                f"side by side after the {prefix_tokens}-token prefix take {prefix_tokens + need * group} cache "
                f"positions, but the exported context holds {ctx}; lower --max-new-tokens, run fewer branches at "
                "once or re-export with a larger --context-length")
        raise ContextFullError(
            f"a branch needs {need} suffix tokens (its own {max(own_tokens)} + {max_new_tokens} new) but the "
            f"export holds {self.suffix_length} per branch; lower --max-new-tokens or re-export with a larger "
            "--suffix-length")

    def new_suffix(self, layers: int, kv_heads: int, head_dim: int) -> np.ndarray:
        """Zeroed suffix cache of `layers` layers: (layers*kv_heads, B, head_dim, suffix_length)."""
        return np.zeros((layers * kv_heads, self.width, head_dim, self.suffix_length), self.backend.dtype)

    def new_suffixes(self, i: int) -> dict[str, np.ndarray]:
        """Chunk i's suffix caches {"k", "v"} over its attention layers (where the global layers are
        wider, over those, with {"k_ring", "v_ring"} over the ring's: specs.suffix_groups), and its
        states beside the K/V per branch, each branch's a copy of the prefix's
        (`CarriedState.copy_to_branches`): the conv layers' {"conv"} (L_c, C, B, W), Qwen3.5's
        recurrent states {"delta"} (L_d*B, H*Dk, 1, Dv)."""
        out = {}
        for key, rows, at in suffix_groups(self.pipeline.config, self.manifest["chunks"][i]["layers"],
                                           self.pipeline.ring):
            for name in (N.kv("k", key in RING_KV_KEYS), N.kv("v", key in RING_KV_KEYS)):
                out[name] = self.new_suffix(len(rows), at.num_key_value_heads, at.head_dim)
        prefix = self.pipeline.cache.caches[i]
        if any(c.key in prefix for c in N.CARRIED):
            sync = getattr(self.backend, "sync_states", None)
            if sync is not None:  # a program's states hold the prefix's states
                sync()
        for carried in N.CARRIED:
            if carried.key in prefix:
                out[carried.key] = branch_copies(carried.copy_to_branches, prefix[carried.key], self.width)
        return out

    def _write(self, i: int, function: str, out: dict[str, np.ndarray], suffixes: list[dict],
               slots: np.ndarray) -> None:
        """Store chunk i's k_new/v_new (layers, kv, 1, B) at each branch's suffix slot: in place (direct
        caches; a slot past the suffix length is dropped, as the cache-update model drops it) or by
        the cache-update model in the background."""
        suffix = suffixes[i]
        # each branch's states beside the K/V move on by its one token (`CarriedState.after_branch_step`)
        for carried, mode in self.pipeline.carry_modes(i, BRANCHES).items():
            if mode == CARRIED_BY_BRANCH:
                suffix[carried.key] = move(carried.after_branch_step, suffix[carried.key], out[carried.new])
        if not any(N.new(key) in out for key in KV_KEYS + RING_KV_KEYS):  # a chunk of conv layers only has no suffix caches
            return
        if self.pipeline.direct:
            for name in (key for key in KV_KEYS + RING_KV_KEYS if key in suffix):
                new = out[N.new(name)].reshape(-1, suffix[name].shape[2], self.width)  # (L*G, D, B)
                for b, slot in enumerate(slots):
                    if slot < self.suffix_length:
                        suffix[name][:, b, :, slot] = new[:, :, b]
            return
        self.pipeline.updates.submit(i, functools.partial(
            self.pipeline.update, function, suffix, out, {N.SUFFIX_POSITIONS: slots}))

    def new_state(self) -> "list[dict] | WindowSteps":
        """What a group's steps keep between them: each chunk's suffix caches (`new_suffixes`), or,
        through the prefill window, the count of steps written after the prefix."""
        if self.in_window:
            return WindowSteps()
        return [self.new_suffixes(i) for i in range(len(self.manifest["chunks"]))]

    def fits(self, prefix_tokens: int, steps: int, need: int, lanes: int | None = None) -> bool:
        """Whether a branch of `need` more tokens fits after `steps` steps of a group over
        `prefix_tokens`: in its suffix cache, or through the window, in the context, where every
        step takes a column per branch slot (`lanes`, default the exported width)."""
        if self.in_window:
            return prefix_tokens + (steps + need) * (lanes or self.width) <= self.pipeline.context_length
        return need <= self.suffix_length

    def branch_columns(self, prefix_tokens: int, steps: int, lane: int, tokens: int, width: int) -> np.ndarray:
        """The cache columns of the last `tokens` tokens written by branch slot `lane` of a group of
        `width` after `steps` steps through the window (`window_step`'s layout)."""
        return prefix_tokens + (steps - tokens + np.arange(tokens)) * width + lane

    def window_step(self, tokens: np.ndarray, seen: np.ndarray, steps: int, prefix_tokens: int) -> np.ndarray:
        """One step of a group of G branches as one prefill window (`in_window`): tokens (G,), each
        branch's tokens written in the last `seen` (G,) of the `steps` steps so far (a branch may
        join a group later, in a free slot) -> logits float32 (G, vocab)."""
        p = self.pipeline
        g = len(tokens)
        base = prefix_tokens + steps * g  # where this step's G columns go
        width = g if p.direct else p.prefill_length
        ids, positions = np.zeros((1, width), np.int32), np.full(width, prefix_tokens, np.int32)
        ids[0, :g], positions[:g] = tokens, prefix_tokens + seen
        bucket = p.bucket(base + g)
        host = {N.POSITION: np.array([base], np.int32),
                **p.masks.branch_masks(prefix_tokens, g, seen, steps, width, bucket)}
        fn = bucket_function("prefill", bucket, p.context_length)
        return p.forward(fn, {N.INPUT_IDS: ids, N.POSITIONS: positions},
                         lambda i, function, out: p.write_window(i, fn, function, out, base, g), visible=base,
                         host=host)[:g]

    def step(self, tokens: np.ndarray, cached: np.ndarray, prefix_tokens: int,
             state: "list[dict] | WindowSteps") -> np.ndarray:
        """One decode step of the whole group: tokens (B,), cached (B,) -> logits float32 (B, vocab);
        `state` from `new_state`, moved on."""
        if isinstance(state, WindowSteps):
            logits = self.window_step(tokens, cached, state.steps, prefix_tokens)
            state.steps += 1
            return logits
        suffixes = state
        positions = (prefix_tokens + cached).astype(np.int32)
        slots = cached.astype(np.int32)
        return self.pipeline.forward(
            BRANCHES, {N.INPUT_IDS: tokens.reshape(1, -1).astype(np.int32), N.POSITIONS: positions,
                       N.PREFIX_LENGTH: np.array([prefix_tokens], np.int32)},
            lambda i, function, out: self._write(i, function, out, suffixes, slots), visible=prefix_tokens,
            state=lambda i: {BRANCH_STATES.get(key) or N.suffix(key): a for key, a in suffixes[i].items()})

    def run_group(self, branches: list[_Branch], prefix_tokens: int, max_new_tokens: int,
                  params: SamplingParams, on_token: Callable[[int, int, str], None] | None, record_logits: bool = False) -> int:
        """Decode one group (<= B branches) to completion. Returns the number of steps run.

        With `record_logits` and `max_new_tokens` 0, each branch only feeds its own tokens and keeps
        the logits after each one (teacher forcing).
        """
        state = self.new_state()
        for b in branches:  # a branch without text of its own starts from the prefix's next-token logits
            if not b.queue and max_new_tokens == 0:
                b.done = True
            elif not b.queue:
                self._emit(b, sample(b.first_logits, params, b.rng), max_new_tokens, on_token)
        steps = 0
        while not all(b.done for b in branches):
            tokens = np.zeros(len(branches) if self.in_window else self.width, np.int32)
            cached = np.zeros(len(tokens), np.int32)
            for j, b in enumerate(branches):
                cached[j] = b.cached if self.in_window else min(b.cached, self.suffix_length)
                if not b.done:
                    tokens[j] = b.queue[0]
            logits = self.step(tokens, cached, prefix_tokens, state)
            steps += 1
            for j, b in enumerate(branches):
                if b.done:
                    continue
                b.queue.pop(0)
                b.cached += 1
                if record_logits:
                    b.result.logits.append(logits[j])
                if not b.queue and max_new_tokens == 0:
                    b.done = True
                elif not b.queue:  # the fed token was the branch's last own token or a generated one
                    self._emit(b, sample(logits[j], params, b.rng), max_new_tokens, on_token)
        self.pipeline.wait()
        return steps

    def _emit(self, b: _Branch, token: int, max_new_tokens: int,
              on_token: Callable[[int, int, str], None] | None) -> None:
        """Record a sampled token; finish the branch on EOS, a stop string or its token budget."""
        r = b.result
        if token in self.eos:
            b.done, r.finish_reason = True, "eos"
        else:
            delta = b.text.push(token)
            if b.text.stopped:
                b.done, r.finish_reason = True, "stop"
            elif len(b.text.token_ids) >= max_new_tokens:
                b.done = True
            else:
                b.queue.append(token)
            if on_token is not None:
                on_token(r.index, token, delta)
        if b.done:
            r.token_ids, r.text = b.text.token_ids, b.text.text

    def close(self) -> None:
        """Let the group's pending suffix updates land."""
        self.pipeline.wait()


def split_shared_prefix(sequences: Sequence[Sequence[int]]) -> tuple[list[int], list[list[int]]]:
    """Split token sequences into their longest common prefix and the remainders.

    Each remainder keeps at least one token, so every branch feeds text of its own (the prefix's
    last logits would otherwise stand in for all of them).
    """
    if not sequences:
        raise InvalidArgumentError("no branches given")
    n = min(len(s) for s in sequences)
    common = 0
    while common < n and all(s[common] == sequences[0][common] for s in sequences):
        common += 1
    common = min(common, n - 1) if len(sequences) > 1 else max(common - 1, 0)
    return list(sequences[0][:common]), [list(s[common:]) for s in sequences]
