"""Drafters for speculative decoding: they propose token trees that the model then verifies.

A drafter sees the tokens so far (prompt and generated text, ending with the root: the last
sampled token, not verified yet) and returns a `DraftTree` of at most `k` tokens below the root.
It never decides what is generated: the verify step keeps only what the model itself would have
produced (runtime/speculative.py).

    PromptLookupDrafter   n-gram matches in the prompt and the generated text (no extra model):
                          the continuations after several matches merged into one tree, each node
                          with its estimated chance of acceptance, learnt as the text goes on
    ModelDrafter          a smaller export with the same tokenizer drafts a chain greedily, each
                          node's chance of acceptance its own probability for the token
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Protocol, Sequence

import numpy as np

from ..errors import InvalidArgumentError
from .sampling import SamplingParams, probabilities


@dataclass
class DraftTree:
    """A token tree: node 0 is the root; `parents[i]` < i is node i's parent (-1 for the root).

    `probs[i]` is the drafter's distribution float [vocab] of node i's token given its parent, or
    None when the token was picked deterministically (a point mass: prompt lookup, greedy drafting).
    `confidence[i]` is the drafter's estimate of the chance that node i is accepted once its parent
    is (the root's is 1; 1.0 where a drafter gives none): what speculative decoding weighs a tree
    by (`expected_tokens`).
    """

    tokens: list[int]
    parents: list[int]
    probs: list[np.ndarray | None] = field(default_factory=list)
    confidence: list[float] = field(default_factory=list)
    _nodes: dict[tuple[int, int], int] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self):
        self.probs = self.probs or [None] * len(self.tokens)
        self.confidence = self.confidence or [1.0] * len(self.tokens)
        self._nodes = {(p, t): i for i, (p, t) in enumerate(zip(self.parents, self.tokens))}  # (parent, token) -> node

    @classmethod
    def root(cls, token: int) -> "DraftTree":
        return cls([int(token)], [-1], [None], [1.0])

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, parent: int, token: int, probs: np.ndarray | None = None, confidence: float = 1.0) -> int:
        """The node for `token` under `parent` (an existing child with that token, or a new node)."""
        if (parent, token) in self._nodes:
            return self._nodes[parent, token]
        self._nodes[parent, int(token)] = len(self.tokens)
        self.tokens.append(int(token))
        self.parents.append(parent)
        self.probs.append(probs)
        self.confidence.append(float(confidence))
        return len(self.tokens) - 1

    def children(self, node: int) -> list[int]:
        return [i for i, p in enumerate(self.parents) if p == node]

    def depths(self) -> np.ndarray:
        """Each node's depth (the root's is 0), int32 (n,)."""
        d = np.zeros(len(self.tokens), np.int32)
        for i, p in enumerate(self.parents):
            if p >= 0:
                d[i] = d[p] + 1
        return d

    def mask(self, dtype=np.float32, hidden: float = -1.0e4) -> np.ndarray:
        """The additive tree mask (1, 1, n, n): 0 where the key is the query or one of its
        ancestors, `hidden` elsewhere."""
        n = len(self.tokens)
        allowed = np.eye(n, dtype=bool)
        for i, p in enumerate(self.parents):
            if p >= 0:
                allowed[i] |= allowed[p]
        return np.where(allowed, 0.0, hidden).astype(dtype).reshape(1, 1, n, n)

    def ranked(self) -> list[tuple[int, float]]:
        """The nodes below the root, most likely to be accepted first: (node, the chance that it
        and every ancestor are accepted), best first; a node always comes after its parent."""
        kids: list[list[int]] = [[] for _ in self.tokens]
        for i, p in enumerate(self.parents[1:], start=1):
            kids[p].append(i)
        out: list[tuple[int, float]] = []
        frontier = [(-self.confidence[c], c) for c in kids[0]]
        heapq.heapify(frontier)
        while frontier:
            neg, node = heapq.heappop(frontier)
            out.append((node, -neg))
            for c in kids[node]:
                heapq.heappush(frontier, (neg * self.confidence[c], c))
        return out

    def keep(self, nodes: Sequence[int]) -> "DraftTree":
        """The tree of the root and `nodes` (each node's parent among them), in index order."""
        kept = sorted({0, *nodes})
        index = {v: i for i, v in enumerate(kept)}
        return DraftTree([self.tokens[v] for v in kept], [index[self.parents[v]] if v else -1 for v in kept],
                         [self.probs[v] for v in kept], [self.confidence[v] for v in kept])

    def expected_tokens(self) -> float:
        """The tokens a verify step of this tree is expected to give: the model's own next token
        plus, for every node, the chance that it and its ancestors are accepted."""
        return 1.0 + sum(chance for _, chance in self.ranked())

    def best(self, k: int) -> "DraftTree":
        """The `k` nodes most likely to be accepted (see `ranked`), with the root."""
        return self.keep([node for node, _ in self.ranked()[:k]])


class Drafter(Protocol):
    def draft(self, tokens: Sequence[int], k: int) -> DraftTree:
        """A tree under the root `tokens[-1]` with at most `k` drafted tokens (0 if nothing to propose)."""


class PromptLookupDrafter:
    """Prompt lookup: find the last tokens earlier in the text and propose what followed them.

    For every n from `max_ngram` down to `min_ngram`, the `matches` most recent occurrences of
    the last n tokens (not already found with a longer n) each give a continuation of up to
    `length` tokens, `candidates` continuations in all; shared prefixes merge into one tree.

    Each node carries its chance of acceptance, estimated from its match length m (a node d
    levels below the root continues a match of n + d - 1 tokens) and its votes (how many of the
    continuations propose it). The estimates are counts of how such proposals fared: at each
    call the drafter checks its previous tree against how the text actually went on (whether
    that tree was verified or not), starting from `PRIOR` (by match length) with weight `PRIOR_WEIGHT`.
    `draft` returns the `k` nodes most likely to be accepted (`DraftTree.best`).
    """

    PRIOR = {1: 0.2, 2: 0.35, 3: 0.5, 4: 0.65, 5: 0.75, 6: 0.8, 7: 0.85, 8: 0.9}  # by match length
    PRIOR_WEIGHT = 4.0  # pseudo-observations of each prior
    MAX_VOTES = 3  # votes counted up to this

    def __init__(self, max_ngram: int = 8, min_ngram: int = 1, matches: int = 4, candidates: int = 12,
                 length: int = 15):
        if not 1 <= min_ngram <= max_ngram:
            raise InvalidArgumentError(f"n-gram sizes must satisfy 1 <= min <= max, got {min_ngram}..{max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.matches, self.candidates, self.length = matches, candidates, length
        self._tried: dict[tuple[int, int], list[float]] = {}  # (match length, votes) -> [accepted, tried]
        self._last: tuple[list[int], DraftTree, list[tuple[int, int] | None]] | None = None

    def continuations(self, tokens: Sequence[int], length: int) -> list[tuple[int, list[int]]]:
        """(n, continuation) pairs: the tokens (at most `length`) after earlier occurrences of the
        last n tokens of `tokens`, longest n first and the most recent first for each n."""
        arr = np.asarray(tokens, dtype=np.int64)
        found: list[tuple[int, list[int]]] = []
        starts_seen: set[int] = set()
        for n in range(min(self.max_ngram, len(arr) - 1), self.min_ngram - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)  # earlier n-grams, not the last
            starts = np.flatnonzero((windows == arr[-n:]).all(axis=1))[::-1] + n  # most recent first
            taken = 0
            for s in starts.tolist():
                if s in starts_seen:  # already found with a longer match
                    continue
                starts_seen.add(s)
                found.append((n, arr[s:s + length].tolist()))
                taken += 1
                if taken == self.matches or len(found) == self.candidates:
                    break
            if len(found) == self.candidates:
                break
        return found

    def chance(self, match: int, votes: int) -> float:
        """The estimated chance that a proposal continuing a match of `match` tokens, made by
        `votes` continuations, is accepted once its parent is."""
        key = (min(match, max(self.PRIOR)), min(votes, self.MAX_VOTES))
        prior = 1.0 - (1.0 - self.PRIOR[key[0]]) ** key[1]
        accepted, tried = self._tried.get(key, (0.0, 0.0))
        return (accepted + self.PRIOR_WEIGHT * prior) / (tried + self.PRIOR_WEIGHT)

    def _learn(self, tokens: Sequence[int]) -> None:
        """Count how the previous tree's proposals fared against the tokens that followed its root."""
        if self._last is None:
            return
        text, tree, keys = self._last
        self._last = None
        if len(tokens) <= len(text) or list(tokens[:len(text)]) != text:
            return  # another text (a context shift, a new prompt)
        node = 0
        for token in tokens[len(text):]:
            nxt = None
            for c in tree.children(node):
                counts = self._tried.setdefault(keys[c], [0.0, 0.0])
                counts[0] += tree.tokens[c] == token
                counts[1] += 1
                if tree.tokens[c] == token:
                    nxt = c
            if nxt is None:
                return
            node = nxt

    def draft(self, tokens: Sequence[int], k: int) -> DraftTree:
        self._learn(tokens)
        tree = DraftTree.root(tokens[-1])
        if k < 1:
            return tree
        match, votes = [0], [0]  # per node: the longest match proposing it, its continuations
        for n, cont in self.continuations(tokens, self.length):
            node = 0
            for depth, token in enumerate(cont):
                size = len(tree)
                node = tree.add(node, token)
                if len(tree) > size:
                    match.append(n + depth)
                    votes.append(1)
                else:
                    match[node] = max(match[node], n + depth)
                    votes[node] += 1
        keys = [None] + [(min(m, max(self.PRIOR)), min(v, self.MAX_VOTES)) for m, v in zip(match[1:], votes[1:])]
        tree.confidence = [1.0] + [self.chance(*key) for key in keys[1:]]
        self._last = (list(tokens), tree, keys)
        return tree.best(k)


class ModelDrafter:
    """Drafts a chain greedily with a smaller export (same tokenizer): `k` decode steps of the
    draft model per verify step. Each node's chance of acceptance is the draft model's probability
    of its token. Its cache follows the text: each call keeps the longest common prefix with what
    it holds and prefills the rest."""

    def __init__(self, model):
        self.model = model  # a LlamaANEModel
        self.pipeline = model.pipeline
        self.pipeline.reset()

    def draft(self, tokens: Sequence[int], k: int) -> DraftTree:
        tree = DraftTree.root(tokens[-1])
        room = self.pipeline.context_length - len(tokens)
        k = min(k, room)
        if k < 1:
            return tree
        logits, _ = self.pipeline.extend(list(tokens))
        node = 0
        for step in range(k):
            token = int(np.argmax(logits))
            chance = float(probabilities(logits, SamplingParams(temperature=1.0))[token])
            node = tree.add(node, token, confidence=chance)
            if step + 1 < k:
                logits = self.pipeline.run_window([token])[0]
        return tree

    def close(self) -> None:
        self.model.close()
