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

Searching every length is slow (each candidate is a timed prefill), so the table can also be
filled from a cost model instead: :func:`fit_rank_cost_model` fits each rank's time to a few timed
partitions (:func:`fitting_partitions`) as a function of its slab, and
:meth:`RankCostModel.partition` minimises the modelled TTFT in milliseconds of host time. The
search stays as the model's check (:func:`check_model_against_search`).

No torch: testable anywhere.
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


SP_LAYOUTS = ("even", "zigzag")


def sequence_parallel_spans(context_len: int, world: int, layout: str = "even",
                            granule: int = 1) -> list[list[tuple[int, int]]]:
    """The token ranges ``(start, end)`` each rank of sequence parallelism computes, by rank.

    ``even``: ``world`` equal slabs in order; a later rank's causal attention covers more keys.
    ``zigzag`` (load-balanced): ``2 * world`` equal chunks, rank ``r`` takes chunks ``r`` and
    ``2 * world - 1 - r``, so every rank attends over the same number of query-key pairs. Every
    range is a multiple of ``granule`` long (the context must divide into them).
    """
    if layout not in SP_LAYOUTS:
        raise ValueError(f"sequence-parallel layout must be one of {SP_LAYOUTS}, got {layout!r}")
    chunks = world if layout == "even" else 2 * world
    if context_len % (chunks * granule):
        raise ValueError(f"{layout} sequence-parallel prefill needs a prompt length divisible by "
                         f"{chunks} chunks x page size {granule}, got {context_len}")
    c = context_len // chunks
    if layout == "even":
        return [[(r * c, (r + 1) * c)] for r in range(world)]
    return [[(r * c, (r + 1) * c), ((chunks - 1 - r) * c, (chunks - r) * c)]
            for r in range(world)]


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


# -- the partition in seconds: a cost model fitted from a few timed partitions --------------------

RANK_FEATURES = ("fixed", "tokens", "attention", "prefix")


def rank_features(start: int, length: int) -> tuple[float, float, float, float]:
    """What one rank's time is modelled from, for the slab ``[start, start + length)``: a fixed
    cost, the slab's tokens (projections and MLP), its causal attention work (each token attends
    to every token before it: ``length * (start + length / 2)`` query-key pairs) and the prefix
    it receives and waits for (``start`` tokens of K/V)."""
    return (1.0, float(length), float(length) * (start + length / 2.0), float(start))


def _nonnegative_least_squares(rows: list[tuple[float, ...]], y: list[float]) -> list[float]:
    """``argmin |X c - y|`` over ``c >= 0`` for a few columns: every subset of the columns is
    solved by least squares and the best non-negative solution kept (2^4 subsets here)."""
    import numpy as np

    x, target = np.asarray(rows, np.float64), np.asarray(y, np.float64)
    scale = np.abs(x).max(axis=0)
    scale[scale == 0] = 1.0
    x = x / scale
    best, best_err = np.zeros(x.shape[1]), float(target @ target)
    for subset in itertools.product((False, True), repeat=x.shape[1]):
        cols = np.flatnonzero(subset)
        if not len(cols):
            continue
        sol = np.linalg.lstsq(x[:, cols], target, rcond=None)[0]
        if (sol < 0).any():
            continue
        c = np.zeros(x.shape[1])
        c[cols] = sol
        err = float(((x @ c - target) ** 2).sum())
        if err < best_err - 1e-15:
            best, best_err = c, err
    return [float(v) for v in best / scale]


@dataclass
class RankCostModel:
    """Seconds of each KV-Runahead rank as a non-negative combination of :func:`rank_features`,
    fitted to timed partitions on ``world`` GPUs. The modelled TTFT of a partition is its slowest
    rank; :meth:`partition` minimises it in milliseconds of host time, and :meth:`fill_table`
    fills a :class:`PartitionTable` from it."""

    world: int
    coef: tuple[float, float, float, float]
    samples: int = 0  # timed ranks the fit used

    def rank_seconds(self, start: int, length: int) -> float:
        return sum(c * f for c, f in zip(self.coef, rank_features(start, length)))

    def ranks(self, bounds: Sequence[int]) -> list[float]:
        return [self.rank_seconds(lo, hi - lo) for lo, hi in zip(bounds, bounds[1:])]

    def ttft(self, bounds: Sequence[int]) -> float:
        return max(self.ranks(bounds))

    def _longest_slab(self, start: int, limit: float, context_len: int) -> float:
        """The longest slab from ``start`` whose modelled time stays within ``limit`` (time grows
        with the slab: every coefficient is non-negative)."""
        lo, hi = 0.0, float(context_len - start)
        if self.rank_seconds(start, hi) <= limit:
            return hi
        for _ in range(60):
            mid = (lo + hi) / 2
            if self.rank_seconds(start, mid) <= limit:
                lo = mid
            else:
                hi = mid
        return lo

    def partition(self, context_len: int, granule: int = 1) -> list[int]:
        """The bounds that minimise the modelled TTFT: the smallest time limit under which
        consecutive slabs, each the longest within the limit, cover the context (bisection), the
        inner bounds rounded to ``granule`` and then refined by the grid search on the model."""
        world = self.world
        base = even_bounds(context_len, world, granule)
        if world == 1:
            return base
        lo, hi = 0.0, self.ttft(base)

        def covers(limit: float) -> tuple[bool, list[float]]:
            inner, start = [], 0.0
            for _ in range(world - 1):
                start += self._longest_slab(int(start), limit, context_len)
                inner.append(start)
            return self.rank_seconds(int(start), context_len - int(start)) <= limit, inner

        inner = None
        for _ in range(60):
            mid = (lo + hi) / 2
            ok, cand = covers(mid)
            if ok:
                hi, inner = mid, cand
            else:
                lo = mid
        if inner is None:
            return base
        bounds = [0] + [max(granule, round(x / granule) * granule) for x in inner] + [context_len]
        try:
            check_bounds(bounds, context_len, world, granule)
        except ValueError:
            bounds = base
        return hierarchical_grid_search(context_len, world, self.ttft, granule=granule,
                                        points=3, start=bounds, stride=granule).bounds

    def fill_table(self, context_lens: Sequence[int], granule: int = 1,
                   table: PartitionTable | None = None) -> PartitionTable:
        """A lookup table (new, or ``table`` extended) with this model's partition at each of
        ``context_lens`` for its GPU count."""
        table = PartitionTable() if table is None else table
        for n in context_lens:
            table.add(self.partition(n, granule))
        return table

    def to_json(self) -> dict:
        return dict(world=self.world, coef=dict(zip(RANK_FEATURES, self.coef)),
                    samples=self.samples)

    @classmethod
    def from_json(cls, data: dict) -> "RankCostModel":
        return cls(int(data["world"]), tuple(float(data["coef"][k]) for k in RANK_FEATURES),
                   int(data.get("samples", 0)))


def fitting_partitions(context_lens: Sequence[int], world: int,
                       granule: int = 1) -> list[list[int]]:
    """The few partitions to time for a fit: at each length the even split and one that gives
    the earlier ranks more (their attention is cheaper), so that every feature varies."""
    out = []
    for n in context_lens:
        out.append(even_bounds(n, world, granule))
        skew = bounds_from_fractions([2 * world - r for r in range(world)], n, granule)
        if skew not in out:
            out.append(skew)
    return out


def fit_rank_cost_model(samples: Sequence[tuple[Sequence[int], Sequence[float]]],
                        world: int | None = None) -> RankCostModel:
    """Fit :class:`RankCostModel` to timed partitions: ``samples`` are ``(bounds, seconds of
    each rank)``, every rank one row of the least-squares fit. All samples share one GPU
    count."""
    rows, y = [], []
    for bounds, seconds in samples:
        if len(seconds) != len(bounds) - 1:
            raise ValueError(f"bounds {list(bounds)} have {len(bounds) - 1} ranks but "
                             f"{len(seconds)} timings")
        if world is None:
            world = len(seconds)
        if len(seconds) != world:
            raise ValueError(f"every sample must have {world} ranks, got {len(seconds)}")
        for lo, hi, s in zip(bounds, bounds[1:], seconds):
            rows.append(rank_features(lo, hi - lo))
            y.append(float(s))
    if len(rows) < len(RANK_FEATURES):
        raise ValueError(f"need at least {len(RANK_FEATURES)} timed ranks, got {len(rows)}")
    return RankCostModel(int(world), tuple(_nonnegative_least_squares(rows, y)), len(rows))


def check_model_against_search(model: RankCostModel, context_len: int,
                               measure: Callable[[list[int]], float], *, granule: int = 1,
                               **search_kw) -> dict:
    """The search as a check of the model: the measured TTFT of the model's partition against
    the partition the hierarchical grid search finds by measuring (``measure(bounds)`` seconds)."""
    bounds = model.partition(context_len, granule)
    res = hierarchical_grid_search(context_len, model.world, measure, granule=granule,
                                   **search_kw)
    model_s = res.evaluated.get(tuple(bounds))
    if model_s is None:
        model_s = float(measure(list(bounds)))
    return dict(context=context_len, world=model.world, model_bounds=bounds,
                model_predicted_s=model.ttft(bounds), model_measured_s=model_s,
                search_bounds=res.bounds, search_s=res.seconds,
                search_measured=len(res.evaluated), model_vs_search=model_s / res.seconds)
