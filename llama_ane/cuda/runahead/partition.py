"""Context partitions for KV-Runahead: which tokens each process prefills.

A partition of a ``context_len``-token prompt over ``world`` processes is given by its bounds
``[0, b1, ..., b_{world-1}, context_len]``: process ``r`` takes tokens ``[b_r, b_{r+1})``. The
inner bounds are multiples of a ``granule`` (the KV page size, or a kernel's key block), so every
slab but the last fills whole pages.

KV-Runahead's load is uneven by nature: process ``r`` attends to every token before its slab, and
the last one waits for all the others' K/V. The paper finds the TTFT-minimising bounds by a
*hierarchical grid search* (five values per bound around the best point so far, the stride
halved at each level) over measured TTFTs, and serves other lengths from a lookup table of
searched partitions, interpolated linearly in the slab fractions between the two nearest lengths.

Pure Python: no torch, testable anywhere.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence


def check_bounds(bounds: Sequence[int], context_len: int, world: int, granule: int = 1) -> None:
    """Raise ``ValueError`` unless ``bounds`` is a partition of ``context_len`` over ``world``."""
    b = list(bounds)
    if len(b) != world + 1 or b[0] != 0 or b[-1] != context_len:
        raise ValueError(f"bounds must be [0, ..., {context_len}] with {world + 1} entries, "
                         f"got {b}")
    if any(hi <= lo for lo, hi in zip(b, b[1:])):
        raise ValueError(f"every process needs at least one token: bounds {b} do not increase")
    if any(x % granule for x in b[1:-1]):
        raise ValueError(f"inner bounds must be multiples of {granule}, got {b}")


def even_bounds(context_len: int, world: int, granule: int = 1) -> list[int]:
    """Equal slabs (the inner bounds rounded to ``granule``): the sequence-parallel split."""
    if context_len < world * granule:
        raise ValueError(f"{context_len} tokens cannot give {world} processes a slab of at least "
                         f"{granule} tokens each")
    inner = [round(context_len * r / world / granule) * granule for r in range(1, world)]
    bounds = [0] + inner + [context_len]
    check_bounds(bounds, context_len, world, granule)
    return bounds


def bounds_from_fractions(fractions: Sequence[float], context_len: int,
                          granule: int = 1) -> list[int]:
    """Bounds whose slabs are ``fractions`` of the context (rounded to ``granule``); an
    infeasible rounding falls back to the even split."""
    world = len(fractions)
    total = sum(fractions)
    acc, inner = 0.0, []
    for f in fractions[:-1]:
        acc += f / total
        inner.append(round(context_len * acc / granule) * granule)
    bounds = [0] + inner + [context_len]
    try:
        check_bounds(bounds, context_len, world, granule)
    except ValueError:
        return even_bounds(context_len, world, granule)
    return bounds


def fractions_of(bounds: Sequence[int]) -> list[float]:
    """Slab sizes as fractions of the context."""
    total = bounds[-1]
    return [(hi - lo) / total for lo, hi in zip(bounds, bounds[1:])]


@dataclass
class SearchResult:
    bounds: list[int]
    seconds: float
    evaluated: dict = field(default_factory=dict)  # tuple(bounds) -> measured seconds
    levels: int = 0


def hierarchical_grid_search(context_len: int, world: int,
                             measure: Callable[[list[int]], float], *, granule: int = 1,
                             points: int = 5, start: Sequence[int] | None = None,
                             stride: int | None = None,
                             progress: Callable[[str], None] | None = None) -> SearchResult:
    """The paper's hierarchical grid search for the bounds that minimise ``measure(bounds)``.

    Each level measures every valid point of a grid of ``points`` values per inner bound
    (``points ** (world - 1)`` candidates), centred on the best point so far with the level's
    stride; the next level halves the stride around the new best, down to ``granule``. A best
    point on the grid's edge moves the grid there at the same stride first (the optimum may lie
    beyond the first grid's reach). The first
    level starts at ``start`` (default: the even split) with ``stride`` (default: the largest
    power-of-two multiple of ``granule`` whose grid spans no more than half a slab each way).
    Every partition is measured once; ``evaluated`` keeps all of them.
    """
    if points < 2:
        raise ValueError(f"points must be at least 2, got {points}")
    best = list(start) if start is not None else even_bounds(context_len, world, granule)
    check_bounds(best, context_len, world, granule)
    if stride is None:
        reach = context_len / world / 2
        stride = granule
        while stride * 2 * (points // 2) <= reach:
            stride *= 2
    evaluated: dict[tuple, float] = {}

    def cost(bounds: list[int]) -> float:
        key = tuple(bounds)
        if key not in evaluated:
            evaluated[key] = float(measure(list(bounds)))
        return evaluated[key]

    best_s = cost(best)
    levels = 0
    half = points // 2
    offsets = [i - half for i in range(points)]
    while True:
        levels += 1
        centre = best[1:-1]
        edge = False
        for deltas in itertools.product(offsets, repeat=world - 1):
            cand = [0] + [c + d * stride for c, d in zip(centre, deltas)] + [context_len]
            try:
                check_bounds(cand, context_len, world, granule)
            except ValueError:
                continue
            s = cost(cand)
            if s < best_s:
                best, best_s = cand, s
                edge = any(abs(d) == half for d in deltas)
        if progress is not None:
            progress(f"level {levels}: stride {stride}, best {best} {best_s * 1e3:.2f} ms, "
                     f"{len(evaluated)} partitions measured")
        if edge:
            continue  # the best point is on the grid's edge: move the grid there, same stride
        if stride <= granule:
            break
        stride = max(granule, stride // 2 // granule * granule)
    return SearchResult(best, best_s, evaluated, levels)


class PartitionTable:
    """Searched partitions by process count and context length, interpolated for other lengths.

    ``entries[world][context_len]`` holds the slab fractions of the searched bounds. A length
    between two entries gets the fractions interpolated linearly between them; outside the table
    the nearest entry's fractions. JSON on disk: ``{"entries": {"2": {"16384": [f0, f1]}}}``.
    """

    def __init__(self, entries: dict | None = None) -> None:
        self.entries: dict[int, dict[int, list[float]]] = {}
        for world, by_len in (entries or {}).items():
            for length, fr in by_len.items():
                self.entries.setdefault(int(world), {})[int(length)] = [float(x) for x in fr]

    def add(self, bounds: Sequence[int]) -> None:
        self.entries.setdefault(len(bounds) - 1, {})[int(bounds[-1])] = fractions_of(bounds)

    def fractions(self, context_len: int, world: int) -> list[float] | None:
        """Interpolated slab fractions, or None when the table has no entry for ``world``."""
        by_len = self.entries.get(world)
        if not by_len:
            return None
        lengths = sorted(by_len)
        if context_len <= lengths[0]:
            return list(by_len[lengths[0]])
        if context_len >= lengths[-1]:
            return list(by_len[lengths[-1]])
        hi = next(n for n in lengths if n >= context_len)
        lo = max(n for n in lengths if n <= context_len)
        if hi == lo:
            return list(by_len[lo])
        t = (context_len - lo) / (hi - lo)
        return [a + t * (b - a) for a, b in zip(by_len[lo], by_len[hi])]

    def predict(self, context_len: int, world: int, granule: int = 1) -> list[int]:
        """Bounds for ``context_len`` over ``world`` processes (the even split without entries)."""
        fr = self.fractions(context_len, world)
        if fr is None:
            return even_bounds(context_len, world, granule)
        return bounds_from_fractions(fr, context_len, granule)

    def to_json(self) -> dict:
        return {"entries": {str(w): {str(n): fr for n, fr in sorted(by_len.items())}
                            for w, by_len in sorted(self.entries.items())}}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "PartitionTable":
        return cls(json.loads(Path(path).read_text())["entries"])
