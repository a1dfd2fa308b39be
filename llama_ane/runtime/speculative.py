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

Drafting adapts to what pays. The decoder measures what a plain step and a verify window of n
nodes cost (`StepCosts`). A tree whose nodes carry estimated chances of acceptance (prompt
lookup) is cut to the nodes that raise the expected tokens per unit of time: with the nodes
ranked by the chance P_i that they are accepted, it keeps the n that maximise
(1 + P_1 + ... + P_n) / cost(n + 1), and takes a plain step instead when no n beats a plain
step's one token. A tree without estimates (a draft model's chain) keeps the older rule: its
length grows after a tree accepted to a leaf and shrinks after a rejection, and drafting pauses
(plain steps, for a growing cool-down) when recent verify steps give fewer tokens per second
than plain steps.
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
    decode_steps: int = 0  # plain one-token steps (nothing drafted, or drafting paused)
    drafted_tokens: int = 0  # tree nodes below the root, over all verify steps
    accepted_tokens: int = 0  # drafted tokens kept
    verify_seconds: float = 0.0
    decode_seconds: float = 0.0
    fallbacks: int = 0  # times drafting was paused for not paying

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
                "tokens_per_step": round(self.tokens_per_step, 3), "acceptance_rate": round(self.acceptance_rate, 3),
                "fallbacks": self.fallbacks}


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
                         "--verify-window 16 (the default)")
    if draft_tokens is not None and not 1 <= draft_tokens <= w - 1:
        raise InvalidArgumentError(f"--draft-tokens must be 1..{w - 1} (the export's verify window is {w}), got {draft_tokens}")
    return w


class StepCosts:
    """What a verify window costs, in plain steps, by its number of nodes n (the root included).

    Measured as generation runs: the seconds of plain steps (a moving average), and the seconds of
    recent verify windows, each divided by the plain step's seconds at the time. Two estimates are
    kept of those window costs:

      * a straight line over n (least squares, older windows weighing less, with two
        pseudo-windows of `PRIOR`, weighing `PRIOR_WEIGHT` each, so that a line exists from the
        first window on);
      * the average cost of the windows of each size n (older ones weighing less).

    A window's cost is its size's average shrunk towards the line: a size measured often costs
    what it measured, one never measured what the line says. Costs need not follow a line: a
    kernel that reads the weights once for up to a few columns makes a window of a few nodes cost
    little more than two, and the next node cost a jump (see runtime/backends/native_gemm.c).
    """

    PRIOR = (1.1, 0.1)  # a window of n nodes: 1.1 + 0.1 (n - 2) plain steps, before measuring
    PRIOR_WEIGHT = 0.25
    MEMORY = 0.95  # weight of a window measured one verify step earlier
    PLAIN_MEMORY = 0.8
    SIZE_MEMORY = 0.9  # weight of a window of the same size measured one window of that size earlier
    SIZE_WEIGHT = 0.5  # pseudo-windows of the line's cost in each size's average

    def __init__(self):
        self.plain_seconds: float | None = None
        self._sums = np.zeros(5)  # weighted sums of 1, x, y, x*x, x*y; x = n - 2, y = cost in plain steps
        self._sizes: dict[int, tuple[float, float]] = {}  # n -> weighted (windows, sum of their costs)

    def plain(self, seconds: float) -> None:
        prev = self.plain_seconds
        self.plain_seconds = seconds if prev is None else self.PLAIN_MEMORY * prev + (1 - self.PLAIN_MEMORY) * seconds

    def verify(self, n: int, seconds: float) -> None:
        if self.plain_seconds:
            x, y = n - 2.0, seconds / self.plain_seconds
            self._sums = self.MEMORY * self._sums + np.array([1.0, x, y, x * x, x * y])
            count, total = self._sizes.get(n, (0.0, 0.0))
            self._sizes[n] = (self.SIZE_MEMORY * count + 1.0, self.SIZE_MEMORY * total + y)

    def line(self) -> tuple[float, float]:
        """(intercept at n = 2, slope per node), in plain steps."""
        a, b = self.PRIOR
        prior = self.PRIOR_WEIGHT * np.array([[1.0, x, a + b * x, x * x, x * (a + b * x)] for x in (0.0, 8.0)]).sum(axis=0)
        w, sx, sy, sxx, sxy = self._sums + prior
        slope = max(0.0, (w * sxy - sx * sy) / (w * sxx - sx * sx))
        return (sy - slope * sx) / w, slope

    def __call__(self, n: int) -> float:
        """The cost of a verify window of n >= 2 nodes, in plain steps: the average of the windows
        of n nodes measured, with `SIZE_WEIGHT` pseudo-windows of the line's cost."""
        intercept, slope = self.line()
        count, total = self._sizes.get(n, (0.0, 0.0))
        return (total + self.SIZE_WEIGHT * (intercept + slope * (n - 2))) / (count + self.SIZE_WEIGHT)


def plan(tree: DraftTree, cost: Callable[[int], float]) -> DraftTree:
    """The part of `tree` worth verifying: the n best-ranked nodes (`DraftTree.ranked`) for the n
    that maximises expected tokens per cost, (1 + sum of their chances) / cost(n + 1); the root
    alone when no n gives more than a plain step (1 token per 1 step)."""
    best, best_rate, expected = 0, 1.0, 1.0
    ranked = tree.ranked()
    for n, (_, chance) in enumerate(ranked, start=1):
        expected += chance
        rate = expected / cost(n + 1)
        if rate > best_rate:
            best, best_rate = n, rate
    return tree.keep([node for node, _ in ranked[:best]])


class SpeculativeDecoder:
    """Generates tokens with a drafter and the verify function of `pipeline`'s export.

    `decode_one(token)` feeds one token the plain way and returns the logits after it (or None
    when the context is full and generation must stop); it also handles context shifts.
    """

    MIN_STEPS = 4  # verify steps measured before the fallback may judge (trees without estimates)
    FIRST_DRAFT = 4  # drafted tokens of the first tree without estimates; +2 after one accepted to a leaf, -1 otherwise
    COOLDOWN = 16  # plain steps after a first fallback; doubled after each further one, up to MAX_COOLDOWN
    MAX_COOLDOWN = 256

    def __init__(self, pipeline: Pipeline, drafter: Drafter, params: SamplingParams, rng: SeededRandom,
                 decode_one: Callable[[int], np.ndarray | None], draft_tokens: int | None = None,
                 adaptive: bool = True):
        w = check_speculative(pipeline.manifest, draft_tokens)
        self.pipeline, self.drafter, self.params, self.rng = pipeline, drafter, params, rng
        self.decode_one = decode_one
        self.max_draft = draft_tokens or w - 1
        self.draft_length = min(self.FIRST_DRAFT, self.max_draft)
        self.adaptive = adaptive
        self.stats = SpeculativeStats()
        self.costs = StepCosts()
        self.unconsumed = 0  # accepted tokens cached that the caller has not gone past (see `tokens`)
        self._paused = 0  # plain steps left before drafting again
        self._cooldown = self.COOLDOWN
        self._recent: list[tuple[float, int]] = []  # (seconds, tokens) of the last verify steps

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
            tree = self._draft(text)
            if len(tree) == 1:
                t0 = time.perf_counter()
                logits = self.decode_one(root)
                self._timed_decode(time.perf_counter() - t0)
                if logits is None:
                    return
                root = _draw(probabilities(logits, self.params), self.rng)
                continue
            t0 = time.perf_counter()
            out = self.pipeline.verify_tree(np.asarray(tree.tokens, np.int32), tree.depths(),
                                            tree.mask(self.pipeline.backend.dtype))
            path, root = choose(tree, out, self.params, self.rng)
            self.pipeline.accept(path)
            self._adapt_length(tree, path)
            self._timed_verify(time.perf_counter() - t0, len(tree) - 1, len(path) - 1, tree.estimated)
            for i, node in enumerate(path[1:]):
                text.append(tree.tokens[node])
                self.unconsumed = len(path) - 1 - i  # cached, and not yet passed by the caller
                yield tree.tokens[node]
            self.unconsumed = 0

    def _draft(self, text: list[int]) -> DraftTree:
        """The tree to verify after `text`, or the root alone (a plain step): on the first step
        (it measures a plain one), while drafting is paused, when nothing fits, or when no part
        of an estimated tree pays (`plan`). A drafter with estimates is asked every step (it
        learns from how the text went on) for as many nodes as the window takes."""
        room = self.pipeline.context_length - self.pipeline.position - 1  # the root takes one position
        estimates = getattr(self.drafter, "estimates", False)
        first = self.stats.decode_steps == 0
        if self._paused > 0 or (first and not estimates):
            self._paused = max(0, self._paused - 1)
            return DraftTree.root(text[-1])
        k = min(self.draft_length if self.adaptive and not estimates else self.max_draft, room)
        tree = self.drafter.draft(text, k) if k >= 1 else DraftTree.root(text[-1])
        if first:
            return DraftTree.root(text[-1])
        return plan(tree, self.costs) if self.adaptive and tree.estimated else tree

    def _adapt_length(self, tree: DraftTree, path: list[int]) -> None:
        """Longer trees (without estimates) after one accepted down to a leaf, shorter after a rejection."""
        leaf = not tree.children(path[-1])
        self.draft_length = (min(self.draft_length + 2, self.max_draft) if leaf
                             else max(1, self.draft_length - 1))

    def _timed_decode(self, seconds: float) -> None:
        self.stats.decode_steps += 1
        self.stats.decode_seconds += seconds
        self.costs.plain(seconds)

    def _timed_verify(self, seconds: float, drafted: int, accepted: int, estimated: bool = False) -> None:
        s = self.stats
        s.verify_steps += 1
        s.verify_seconds += seconds
        s.drafted_tokens += drafted
        s.accepted_tokens += accepted
        self.costs.verify(drafted + 1, seconds)
        self._recent = (self._recent + [(seconds, accepted + 1)])[-8:]
        if self.adaptive and not estimated and not self.pays():
            s.fallbacks += 1
            self._paused = self._cooldown
            self._cooldown = min(2 * self._cooldown, self.MAX_COOLDOWN)
            self._recent = []

    def pays(self) -> bool:
        """Whether recent verify steps give more tokens per second than plain decode steps
        (True until both have been measured enough to tell)."""
        s = self.stats
        if len(self._recent) < self.MIN_STEPS or s.decode_steps == 0:
            return True
        per_decode = s.decode_seconds / s.decode_steps
        seconds = sum(t for t, _ in self._recent)
        tokens = sum(n for _, n in self._recent)
        return tokens / seconds >= 1.0 / per_decode
