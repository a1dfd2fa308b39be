"""Drafters for speculative decoding: they propose token trees that the model then verifies.

A drafter sees the tokens so far (prompt and generated text, ending with the root: the last
sampled token, not verified yet) and returns a `DraftTree` of at most `k` tokens below the root.
It never decides what is generated: the verify step keeps only what the model itself would have
produced (runtime/speculative.py).

    PromptLookupDrafter   n-gram matches in the prompt and the generated text (no extra model);
                          the continuations after several matches are merged into one tree
    ModelDrafter          a smaller export with the same tokenizer drafts a chain greedily
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

import numpy as np

from ..errors import InvalidArgumentError


@dataclass
class DraftTree:
    """A token tree: node 0 is the root; `parents[i]` < i is node i's parent (-1 for the root).

    `probs[i]` is the drafter's distribution float [vocab] of node i's token given its parent, or
    None when the token was picked deterministically (a point mass: prompt lookup, greedy drafting).
    """

    tokens: list[int]
    parents: list[int]
    probs: list[np.ndarray | None] = field(default_factory=list)

    @classmethod
    def root(cls, token: int) -> "DraftTree":
        return cls([int(token)], [-1], [None])

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, parent: int, token: int, probs: np.ndarray | None = None) -> int:
        """The node for `token` under `parent` (an existing child with that token, or a new node)."""
        for i in self.children(parent):
            if self.tokens[i] == token:
                return i
        self.tokens.append(int(token))
        self.parents.append(parent)
        self.probs.append(probs)
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


class Drafter(Protocol):
    def draft(self, tokens: Sequence[int], k: int) -> DraftTree:
        """A tree under the root `tokens[-1]` with at most `k` drafted tokens (0 if nothing to propose)."""


class PromptLookupDrafter:
    """Prompt lookup: find the last n tokens earlier in the text and propose what followed them.

    The longest n-gram (from `max_ngram` down to `min_ngram`) that occurs earlier is used; its
    most recent `matches` occurrences each give a continuation. The continuation of the most
    recent match gets most of the `k` tokens, the others a few each (`alternative` tokens) and
    shared prefixes merge, so several matches make one tree.
    """

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1, matches: int = 4, alternative: int = 2):
        if not 1 <= min_ngram <= max_ngram:
            raise InvalidArgumentError(f"n-gram sizes must satisfy 1 <= min <= max, got {min_ngram}..{max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.matches, self.alternative = matches, alternative

    def continuations(self, tokens: Sequence[int], length: int) -> list[list[int]]:
        """Up to `matches` distinct continuations (most recent match first) of the longest n-gram
        ending `tokens` that occurs earlier in it, each at most `length` tokens."""
        arr = np.asarray(tokens, dtype=np.int64)
        found: list[list[int]] = []
        for n in range(min(self.max_ngram, len(arr) - 1), self.min_ngram - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)  # earlier n-grams, not the last
            starts = np.flatnonzero((windows == arr[-n:]).all(axis=1))[::-1]  # most recent first
            for s in starts:
                cont = arr[s + n:s + n + length].tolist()
                if cont and cont not in found:
                    found.append(cont)
                    if len(found) == self.matches:
                        return found
            if found:
                return found
        return found

    def draft(self, tokens: Sequence[int], k: int) -> DraftTree:
        tree = DraftTree.root(tokens[-1])
        if k < 1:
            return tree
        conts = self.continuations(tokens, k)
        if not conts:
            return tree
        reserved = min(self.alternative * (len(conts) - 1), k // 2)  # room kept for the alternatives
        for j, cont in enumerate(conts):
            budget = k - reserved if j == 0 else self.alternative
            node = 0
            for token in cont[:budget]:
                if len(tree) - 1 >= k and not any(tree.tokens[c] == token for c in tree.children(node)):
                    break
                node = tree.add(node, token)
        return tree


class ModelDrafter:
    """Drafts a chain greedily with a smaller export (same tokenizer): `k` decode steps of the
    draft model per verify step. Its cache follows the text: each call keeps the longest common
    prefix with what it holds and prefills the rest."""

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
            node = tree.add(node, token)
            if step + 1 < k:
                logits = self.pipeline.run_window([token])[0]
        return tree

    def close(self) -> None:
        self.model.close()
