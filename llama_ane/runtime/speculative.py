"""Speculative decoding: a drafter proposes a token tree, one "verify" window checks all of it.

Each step starts from the root, the last sampled token (not cached yet). The drafter proposes a
tree of continuations below it (runtime/drafters.py); `Pipeline.verify_tree` runs the tree in one
window of the one forward pass and gives the model's logits after every node. Walking down from
the root, the model's own choice at each node is made from those logits:

  * greedy: the argmax; if a child of the node drafted that token, it is accepted and the walk
    goes on from the child, else the argmax is the step's last token;
  * sampling (temperature > 0): speculative sampling with rejection. Each child c, drafted with
    probability q (a point mass for deterministic drafts), is accepted with probability
    min(1, p(c) / q(c)); after a rejection p becomes the normalised residual max(p - q, 0).
    If no child is accepted, the step's last token is sampled from what remains of p.

So every accepted token, and the step's last token, is distributed exactly as plain decoding
would produce it (greedy: the very same tokens). Only the accepted path reaches the cache
(`Pipeline.accept`); the last token is the next step's root.

Drafting is worth it when it gives more tokens per second than plain decoding. The decoder keeps
two running averages, the seconds of a plain step and of a verify step (drafting included; the
window is the export's W wide whatever the tree, as Core ML runs it), and one rule (`StepTimes`):
verify a drafted tree when its expected tokens, 1 + the sum over its nodes of the chance that the
node and its ancestors are accepted (the drafter's per-node chances, `DraftTree.expected_tokens`),
per second of a verify step beat 1 token per second of a plain step; otherwise take a plain step.
The first step of a generation is plain (it measures one).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import numpy as np

from ..errors import InvalidArgumentError

from .drafters import DraftTree, Drafter
from .pipeline import Pipeline
from .sampling import SamplingParams, SeededRandom, probabilities


@dataclass
class SpeculativeStats:
    """Accounting of one speculative generation."""

    verify_steps: int = 0  # verify windows run
    decode_steps: int = 0  # plain one-token steps (nothing drafted, or no tree worth a window)
    drafted_tokens: int = 0  # tree nodes below the root, over all verify steps
    accepted_tokens: int = 0  # drafted tokens kept
    verify_seconds: float = 0.0
    decode_seconds: float = 0.0

    @property
    def tokens_per_step(self) -> float:
        """Tokens produced per verify step: the accepted drafts plus the model's own next token."""
        return (self.accepted_tokens + self.verify_steps) / self.verify_steps if self.verify_steps else float("nan")

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafted tokens over drafted tokens (every node of every tree)."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else float("nan")

    def as_dict(self) -> dict:
        return {"verify_steps": self.verify_steps, "decode_steps": self.decode_steps,
                "drafted_tokens": self.drafted_tokens, "accepted_tokens": self.accepted_tokens,
                "tokens_per_step": round(self.tokens_per_step, 3), "acceptance_rate": round(self.acceptance_rate, 3)}


def choose(tree: DraftTree, logits: np.ndarray, params: SamplingParams,
           rng: SeededRandom) -> tuple[list[int], int]:
    """Walk `tree` with the model's logits float32 [n, vocab] (row i: after node i).

    Returns the accepted path (node indices, root first) and the next token: the model's choice
    after the path's last node (greedy: argmax; else drawn from the residual distribution).
    """
    path = [0]
    while True:
        node = path[-1]
        p = probabilities(logits[node], params)
        chosen = None
        for c in tree.children(node):
            if _accepts(p, tree.tokens[c], tree.probs[c], rng):
                chosen = c
                break
            p = _residual(p, tree.tokens[c], tree.probs[c])
        if chosen is None:
            return path, _draw(p, rng)
        path.append(chosen)


def _accepts(p: np.ndarray, token: int, q: np.ndarray | None, rng: SeededRandom) -> bool:
    """Accept drafted `token` with probability min(1, p/q) (q a point mass when None); a certain
    answer (ratio 0 or 1, as in greedy decoding) draws nothing from `rng`."""
    ratio = p[token] if q is None else min(1.0, p[token] / max(q[token], 1e-30))
    if ratio >= 1.0:
        return True
    if ratio <= 0.0:
        return False
    return bool(rng.next_unit() < ratio)


def _residual(p: np.ndarray, token: int, q: np.ndarray | None) -> np.ndarray:
    """norm(max(p - q, 0)) after rejecting `token` (q = its point mass when None)."""
    if q is None:
        r = p.copy()
        r[token] = 0.0
    else:
        r = np.maximum(p - q, 0.0)
    total = r.sum()
    return r / total if total > 0 else p


def _draw(p: np.ndarray, rng: SeededRandom) -> int:
    """The greedy choice of a one-hot p without touching `rng`; else a draw from p."""
    top = int(np.argmax(p))
    if p[top] >= 1.0:
        return top
    at = int(np.searchsorted(np.cumsum(p), rng.next_unit(), side="right"))  # as sampling.sample draws
    return min(at, p.size - 1)


def check_speculative(manifest: dict, draft_tokens: int | None) -> int:
    """The export's verify window W, after checking it has one and that `draft_tokens` fits in it."""
    w = manifest.get("verify_window", 0)
    if not w:
        raise InvalidArgumentError("this export has no verify function for speculative decoding; re-export it with "
                                   "--verify-window W (e.g. 16) to decode speculatively")
    if draft_tokens is not None and not 1 <= draft_tokens <= w - 1:
        raise InvalidArgumentError(f"--draft-tokens must be 1..{w - 1} (the export's verify window is {w}), got {draft_tokens}")
    return w


class StepTimes:
    """The two running averages speculative decoding decides by, and its one rule.

    `plain_seconds` is the mean of the plain steps measured, `verify_seconds` the mean of the verify
    steps (None before the first of each). A tree expected to give `expected` tokens is worth a
    verify step when expected / verify_seconds > 1 / plain_seconds. Before a plain step is
    measured nothing is verified; before a verify step is, every tree with a drafted token is (it
    measures one).
    """

    def __init__(self):
        self._plain = (0, 0.0)  # (steps, seconds)
        self._verify = (0, 0.0)

    @staticmethod
    def _mean(steps: tuple[int, float]) -> float | None:
        return steps[1] / steps[0] if steps[0] else None

    @property
    def plain_seconds(self) -> float | None:
        return self._mean(self._plain)

    @property
    def verify_seconds(self) -> float | None:
        return self._mean(self._verify)

    def plain(self, seconds: float) -> None:
        self._plain = (self._plain[0] + 1, self._plain[1] + seconds)

    def verify(self, seconds: float) -> None:
        self._verify = (self._verify[0] + 1, self._verify[1] + seconds)

    def worth_verifying(self, expected: float) -> bool:
        """Whether a verify step expected to give `expected` tokens beats plain decoding."""
        plain, window = self.plain_seconds, self.verify_seconds
        if plain is None:
            return False
        if window is None:
            return expected > 1.0
        return expected * plain > window


class SpeculativeDecoder:
    """Generates tokens with a drafter and the verify function of `pipeline`'s export.

    `decode_one(token)` feeds one token the plain way and returns the logits after it (or None
    when the context is full and generation must stop); it also handles context shifts. Trees have
    at most `draft_tokens` drafted nodes (default W - 1). With `adaptive` False every drafted tree
    is verified, whatever the times (tests).
    """

    def __init__(self, pipeline: Pipeline, drafter: Drafter, params: SamplingParams, rng: SeededRandom,
                 decode_one: Callable[[int], np.ndarray | None], draft_tokens: int | None = None,
                 adaptive: bool = True):
        w = check_speculative(pipeline.manifest, draft_tokens)
        self.pipeline, self.drafter, self.params, self.rng = pipeline, drafter, params, rng
        self.decode_one = decode_one
        self.max_draft = draft_tokens or w - 1
        self.adaptive = adaptive
        self.stats = SpeculativeStats()
        self.times = StepTimes()
        self.unconsumed = 0  # accepted tokens cached that the caller has not gone past (see `tokens`)

    def tokens(self, logits: np.ndarray, history: Sequence[int]) -> Iterator[int]:
        """Yield generated tokens, starting from the logits after `history` (the prompt); the
        caller stops iterating when it has enough. Ends when the context is full.

        A verify step caches its accepted tokens before they are yielded; when the caller stops
        at one of them, `unconsumed` counts that token and those after it (the caller rewinds them,
        so the cache holds what plain decoding would have fed)."""
        text = list(history)
        root = _draw(probabilities(logits, self.params), self.rng)
        while True:
            text.append(root)
            yield root
            t0 = time.perf_counter()
            tree = self._draft(text)
            if len(tree) == 1:
                t0 = time.perf_counter()
                logits = self.decode_one(root)
                self._timed_decode(time.perf_counter() - t0)
                if logits is None:
                    return
                root = _draw(probabilities(logits, self.params), self.rng)
                continue
            out = self.pipeline.verify_tree(np.asarray(tree.tokens, np.int32), tree.depths(),
                                            tree.mask(self.pipeline.backend.dtype))
            path, root = choose(tree, out, self.params, self.rng)
            self.pipeline.accept(path)
            self._timed_verify(time.perf_counter() - t0, len(tree) - 1, len(path) - 1)
            for i, node in enumerate(path[1:]):
                text.append(tree.tokens[node])
                self.unconsumed = len(path) - 1 - i  # cached, and not yet passed by the caller
                yield tree.tokens[node]
            self.unconsumed = 0

    def _draft(self, text: list[int]) -> DraftTree:
        """The tree to verify after `text`, or the root alone (a plain step) when nothing fits or
        is drafted, or when the tree is not worth a verify step (`StepTimes.worth_verifying`). The
        drafter is asked every step, the first included (it may learn from how the text went on)."""
        room = self.pipeline.context_length - self.pipeline.position - 1  # the root takes one position
        k = min(self.max_draft, room)
        tree = self.drafter.draft(text, k) if k >= 1 else DraftTree.root(text[-1])
        if len(tree) == 1 or not self.adaptive or self.times.worth_verifying(tree.expected_tokens()):
            return tree
        return DraftTree.root(text[-1])

    def _timed_decode(self, seconds: float) -> None:
        self.stats.decode_steps += 1
        self.stats.decode_seconds += seconds
        self.times.plain(seconds)

    def _timed_verify(self, seconds: float, drafted: int, accepted: int) -> None:
        s = self.stats
        s.verify_steps += 1
        s.verify_seconds += seconds
        s.drafted_tokens += drafted
        s.accepted_tokens += accepted
        self.times.verify(seconds)
