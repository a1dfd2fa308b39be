"""Next-token sampling from logits (greedy, temperature, repetition penalty, top-k, top-p, min-p) and
the rules shared with the Swift package, so that the same export, prompt and seed give the same
tokens in both:

* the generator: xoshiro256** seeded through SplitMix64 (`SeededRandom`, Swift's `SeededRandom`);
* the draw, in this order (`sample`, Swift's `Sampler.sample`):
  1. repetition penalty R (CTRL): every distinct token id among the last `REPETITION_WINDOW`
     tokens of the context (prompt and generated) has its logit l replaced, in float32, by
     l / R if l > 0, else l * R (`penalize`). It applies to greedy decoding too.
  2. temperature T: z = l / T (float64, T taken as float32); T = 0 (or top-k 1) is greedy: the
     argmax of the penalized logits, and no random number is drawn. (Dividing by T keeps each
     logit's sign, so the penalty gives the same result before or after it.)
  3. top-k: candidates sorted by z (ties: lower id first), the first k kept.
  4. top-p: p_i = exp(z_i - z_0) / sum, the smallest prefix whose cumulative p reaches top-p
     (taken as float32) kept.
  5. min-p P: of those, the tokens with p_i >= P * p_0 (p_0: the most likely one, always kept;
     P taken as float32; the ratio p_i / p_0 = exp(z_i - z_0) does not depend on the
     renormalization).
  6. one uniform number walked through the kept tokens' renormalized cumulative probabilities;
* per-branch seeding: branch i of a cascade samples with seed `seed + i` (mod 2**64) (`branch_seed`,
  Swift's `SamplingParameters.branch(_:)`);
* why a generation ended: `FINISH_REASONS` (Swift's `FinishReason`).

`tests/swift_fixtures.py` writes what this module draws into the Swift tests' fixtures.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..errors import InvalidArgumentError

# Tokens of the context (the last ones, prompt and generated) whose logits the repetition penalty
# lowers; Swift's `SamplingParameters.repetitionWindow` is the same number.
REPETITION_WINDOW = 64

# Why a generation (or a cascade branch) ended:
#   eos      an end-of-sequence token was sampled (it is not part of the returned tokens)
#   stop     a stop string appeared in the text
#   length   max_new_tokens were generated
#   context  the KV cache (a branch: its suffix cache) is full
FINISH_REASONS = ("eos", "stop", "length", "context")

_MASK = (1 << 64) - 1


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy; top_k 0, top_p 1.0, min_p 0.0 and repetition_penalty 1.0 disable
    those filters."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0

    def __post_init__(self):
        if not 0 <= self.temperature < float("inf"):  # refuses nan too
            raise InvalidArgumentError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise InvalidArgumentError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidArgumentError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidArgumentError(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0.0 < self.repetition_penalty < float("inf"):
            raise InvalidArgumentError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


def _rotl(x: int, k: int) -> int:
    return ((x << k) | (x >> (64 - k))) & _MASK


class SeededRandom:
    """xoshiro256** seeded through SplitMix64: the same seed gives the same numbers here and in Swift."""

    def __init__(self, seed: int | None = None):
        x = (secrets.randbits(64) if seed is None else seed) & _MASK
        state = []
        for _ in range(4):
            x = (x + 0x9E3779B97F4A7C15) & _MASK
            z = x
            z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
            z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
            state.append(z ^ (z >> 31))
        self._s = state

    def next(self) -> int:
        """The next unsigned 64-bit number."""
        s0, s1, s2, s3 = self._s
        result = (_rotl((s1 * 5) & _MASK, 7) * 9) & _MASK
        t = (s1 << 17) & _MASK
        s2 ^= s0
        s3 ^= s1
        s1 ^= s2
        s0 ^= s3
        s2 ^= t
        self._s = [s0, s1, s2, _rotl(s3, 45)]
        return result

    def next_unit(self) -> float:
        """A uniform float in [0, 1) with 53 random bits."""
        return (self.next() >> 11) * (1.0 / 9007199254740992.0)


def branch_seed(seed: int, index: int) -> int:
    """The seed of cascade branch `index` when the request's seed is `seed`."""
    return (seed + index) & _MASK


def argmax(logits: np.ndarray) -> int:
    """The index of the largest logit (the first one on ties); NaN logits never win."""
    logits = np.asarray(logits)
    return int(np.argmax(np.where(np.isnan(logits), -np.inf, logits)))


def penalize(logits: np.ndarray, recent: Sequence[int] | None, penalty: float) -> np.ndarray:
    """float32 logits [vocab] with the repetition penalty applied to the distinct ids among the
    last REPETITION_WINDOW of `recent` (the context so far): l / R where l > 0, l * R elsewhere.
    Without a penalty the logits come back as they are."""
    if penalty == 1.0 or not recent:
        return logits
    logits = np.asarray(logits, dtype=np.float32).reshape(-1)
    ids = np.unique(np.asarray(list(recent)[-REPETITION_WINDOW:], dtype=np.int64))
    ids = ids[(ids >= 0) & (ids < logits.size)]
    out = logits.copy()
    r = np.float32(penalty)
    seen = out[ids]
    out[ids] = np.where(seen > 0, seen / r, seen * r)
    return out


def candidates(logits: np.ndarray, params: SamplingParams,
               recent: Sequence[int] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The token ids that may be drawn, most likely first, and their renormalized probabilities
    (float64), from logits [vocab] and the context's `recent` token ids (for the repetition penalty)."""
    logits = np.asarray(penalize(logits, recent, params.repetition_penalty), dtype=np.float32).reshape(-1)
    ids = np.flatnonzero(~np.isnan(logits))
    z = logits[ids].astype(np.float64) / float(np.float32(params.temperature))
    order = np.argsort(-z, kind="stable")  # ties keep the lower id first
    ids, z = ids[order], z[order]
    if 0 < params.top_k < ids.size:
        ids, z = ids[:params.top_k], z[:params.top_k]
    probs = np.exp(z - z[0])
    total = np.cumsum(probs)[-1]  # summed in order, as the Swift sampler sums
    if params.top_p < 1.0:
        reached = np.cumsum(probs / total) >= float(np.float32(params.top_p))
        keep = int(np.argmax(reached)) + 1 if reached.any() else ids.size
        ids, probs = ids[:keep], probs[:keep]
        total = np.cumsum(probs)[-1]
    if params.min_p > 0.0:
        # probs[0] is exp(0) = 1: the most likely token, so the ratio is probs itself
        keep = int(np.count_nonzero(probs >= float(np.float32(params.min_p))))
        ids, probs = ids[:max(keep, 1)], probs[:max(keep, 1)]
        total = np.cumsum(probs)[-1]
    return ids, probs / total


def sample(logits: np.ndarray, params: SamplingParams, rng: SeededRandom,
           recent: Sequence[int] | None = None) -> int:
    """Pick a token id from logits [vocab], `recent` being the context's token ids so far (only the
    repetition penalty reads them); greedy draws no number from `rng`."""
    if params.greedy:
        return argmax(penalize(logits, recent, params.repetition_penalty))
    ids, probs = candidates(logits, params, recent)
    u = rng.next_unit()
    at = int(np.searchsorted(np.cumsum(probs), u, side="right"))  # first bucket whose end is above u
    return int(ids[min(at, ids.size - 1)])  # rounding may leave u past the last bucket


def probabilities(logits: np.ndarray, params: SamplingParams, recent: Sequence[int] | None = None) -> np.ndarray:
    """The distribution `sample` draws from, float64 [vocab]: one-hot at the argmax when greedy,
    else `candidates`' probabilities at their ids (zero elsewhere)."""
    p = np.zeros(np.asarray(logits).size, np.float64)
    if params.greedy:
        p[argmax(penalize(logits, recent, params.repetition_penalty))] = 1.0
        return p
    ids, probs = candidates(logits, params, recent)
    p[ids] = probs
    return p
