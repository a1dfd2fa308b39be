"""One-dimensional k-means over many groups at once: the LUT of each group of weights.

For palettization every group (one LUT's worth of output channels) needs its own k-means on its
values. Running them one by one is what makes palettizing a 1B model slow; here every group's
Lloyd iterations run together as a few batched tensor ops on the sorted groups (see `lloyd`).

Sorting is a large part of the cost, so fp16 weights are sorted by their bit patterns made
order-keeping (`_fp16_keys`): a group of up to 65536 values as one 32-bit word per value, key above
index, by numpy's SIMD sort; larger groups by a radix sort of the keys (`_sort_rows`). The same
sort's order assigns every weight its code without searching (`lut_compress`).

Initialisation matters more than iterations in 1-D (Lloyd moves centroids across a group only
slowly): the centroids start where the asymptotically optimal quantizer puts them
(`companded_start`), and 30 iterations then land within about 1% of the exact k-means error on
Gaussian- and Laplace-shaped weights (benchmarks/palettize_compare.py measures it against
coremltools' exact k-means).
"""

from __future__ import annotations

import numpy as np
import torch

MAX_ITERATIONS = 30
TOLERANCE = 1e-5  # of a group's value range: a centroid moving less has converged
COMPANDING_POINTS = 1024  # ranks at which a group's density is read for the starting centroids
BATCH_ELEMENTS = 1 << 21  # weights clustered at once: ~40 bytes each of working memory, ~80 MB, which
# the allocator reuses from batch to batch (larger temporaries are fresh pages every time, and slower)
BIN_VALUES = 8  # values per bin of the prefix sums Lloyd reads its cluster sums from (see RankSums)


def kmeans_1d(groups: torch.Tensor, clusters: int, iterations: int = MAX_ITERATIONS,
              weights: torch.Tensor | None = None) -> torch.Tensor:
    """Cluster each row of `groups` (G, N) into `clusters` values: centroids (G, K) float32, ascending.

    With `weights` (G, N) >= 0, each value counts that much (weighted means; the error minimised
    is sum weight * (value - centroid)^2). Groups with fewer distinct values than K repeat centroids.
    """
    values = groups.to(torch.float32).numpy()
    order = np.argsort(values, axis=1)
    xs = np.take_along_axis(values, order, axis=1)
    ws = None if weights is None else np.take_along_axis(weights.to(torch.float64).numpy(), order, axis=1)
    return lloyd(xs, clusters, ws, iterations)


def lloyd(xs: np.ndarray, clusters: int, ws: np.ndarray | None = None,
          iterations: int = MAX_ITERATIONS) -> torch.Tensor:
    """Lloyd's k-means on rows already sorted: xs (G, N) float32 ascending, optional weights ws
    (G, N) in the same order -> centroids (G, K) float32, ascending.

    1-D clusters are intervals of the sorted values, so an iteration is a search of the K-1
    boundaries (midpoints between neighbouring centroids) in each row and sums read off its prefix
    sums (`RankSums`): O(K log N) per group and iteration instead of O(N).
    """
    g, n = xs.shape
    k = clusters
    xs_t = torch.from_numpy(np.ascontiguousarray(xs))
    ws_t = None if ws is None else torch.from_numpy(np.ascontiguousarray(ws, np.float32))
    below = RankSums(xs_t, ws_t)  # sums of weight * value and of the weights (a count: ranks' difference)
    centroids = companded_start(xs_t, k)
    span = (xs_t[:, -1] - xs_t[:, 0]).to(torch.float64).clamp_min(1e-12)
    edges = torch.empty(g, k + 1, dtype=torch.long)
    edges[:, 0], edges[:, -1] = 0, n
    for _ in range(iterations):
        midpoints = ((centroids[:, 1:] + centroids[:, :-1]) / 2).to(torch.float32)
        ranks, sums, mass = below.search(midpoints.contiguous())
        edges[:, 1:-1] = ranks  # cluster j: xs[edges[j]:edges[j+1]]
        sums = torch.diff(RankSums.with_ends(sums, below.sums), dim=1)  # (G, K): each cluster's weighted sum and weight
        counts = (torch.diff(edges, dim=1).to(torch.float64) if mass is None else
                  torch.diff(RankSums.with_ends(mass, below.mass), dim=1))
        moved = torch.where(counts > 0, sums / counts.clamp_min(1e-300), centroids)
        moved, _ = torch.sort(moved, dim=1)
        shift = ((moved - centroids).abs().amax(dim=1) / span).max()
        centroids = moved
        if shift < TOLERANCE:
            break
    return centroids.to(torch.float32)


class RankSums:
    """Exact sums of weight * value, and of the weights, over the first r values of each row of
    `values` (G, N) with `weights` (G, N) (None: all 1, whose sums the ranks are), for any ranks r:
    from prefix sums over bins of BIN_VALUES values plus the few values of the bin r falls in. An
    eighth of the memory traffic of prefix sums over every value, for the same float64 sums up
    to the float32 rounding of each bin's sum."""

    def __init__(self, values: torch.Tensor, weights: torch.Tensor | None = None, per: int = BIN_VALUES):
        g, n = values.shape
        self.per = per if n % per == 0 else 1
        self.values, self.weights = values, weights
        binned = values.view(g, n // self.per, self.per)
        if weights is None:
            sums, mass = binned.sum(dim=2), None  # 8 terms: float32 holds them
        else:
            w = weights.view(g, n // self.per, self.per)
            sums, mass = torch.einsum("gbi,gbi->gb", w, binned), w.sum(dim=2)
        self.sums = self._prefix(sums)
        self.mass = None if mass is None else self._prefix(mass)
        self.offsets = torch.arange(self.per)
        self.starts = values[:, ::self.per].contiguous()  # (G, B): each bin's first value, for `search`

    @staticmethod
    def with_ends(inner: torch.Tensor, prefix: torch.Tensor) -> torch.Tensor:
        """(G, E) sums before inner ranks -> (G, E + 2) with the sums before rank 0 (nothing) and
        rank N (everything, the last of `prefix`: `sums` or `mass`) on either side."""
        total = prefix[:, -1:]
        return torch.cat([torch.zeros_like(total), inner, total], dim=1)

    def search(self, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """For targets (G, E) float32: how many values of each row lie below each target (the
        rank torch.searchsorted gives, left side), and the sums before those ranks as `self(ranks)`
        gives them. The search runs over the bins' first values (an eighth of the row: it stays in
        cache), then among the 8 values of the bin it lands in, which the sums read anyway."""
        per = self.per
        if per == 1:
            ranks = torch.searchsorted(self.values, targets)
            return (ranks, *self(ranks))
        g, e = targets.shape
        bins = (torch.searchsorted(self.starts, targets) - 1).clamp_min(0)  # the last bin starting below
        at = (bins[:, :, None] * per + self.offsets).view(g, e * per)
        values = self.values.gather(1, at).view(g, e, per)
        before = values < targets[:, :, None]  # the bin's values below the target: all of those ahead of it
        ranks = bins * per + before.sum(dim=2)
        sums = self.sums.gather(1, bins)
        weights = before.to(torch.float32) if self.weights is None else \
            self.weights.gather(1, at).view(g, e, per) * before
        if self.mass is None:
            return ranks, sums + (values * weights).sum(dim=2).to(torch.float64), None
        return (ranks, sums + (weights * values).sum(dim=2).to(torch.float64),
                self.mass.gather(1, bins) + weights.sum(dim=2).to(torch.float64))

    @staticmethod
    def _prefix(bins: torch.Tensor) -> torch.Tensor:
        """(G, B) -> float64 (G, B + 1): the sum of the bins before each."""
        return torch.nn.functional.pad(torch.cumsum(bins.to(torch.float64), dim=1), (1, 0))

    def __call__(self, ranks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """ranks (G, E) in [0, N] -> float64 (G, E) sums of weight * value before each rank, and of
        the weights (None without weights)."""
        per = self.per
        bins = torch.div(ranks, per, rounding_mode="floor")
        sums = self.sums.gather(1, bins)
        mass = None if self.mass is None else self.mass.gather(1, bins)
        if per == 1:
            return sums, mass
        g, e = ranks.shape
        n = self.values.shape[1]
        into = ranks % per
        start = (ranks - into).clamp_max(n - per)  # a rank of N has no partial bin: start anywhere
        at = (start[:, :, None] + self.offsets).view(g, e * per)
        before = (self.offsets < into[:, :, None]).to(torch.float32)  # the bin's values that lie before the rank
        values = self.values.gather(1, at).view(g, e, per)
        if self.weights is None:
            return sums + (values * before).sum(dim=2).to(torch.float64), None
        weights = self.weights.gather(1, at).view(g, e, per) * before
        return (sums + (weights * values).sum(dim=2).to(torch.float64),
                mass + weights.sum(dim=2).to(torch.float64))


def companded_start(xs: torch.Tensor, clusters: int, points: int = COMPANDING_POINTS) -> torch.Tensor:
    """Starting centroids (G, K) float64 for sorted rows `xs` (G, N), spaced as the optimum is.

    For many clusters the best quantizer of a density p puts centroids with density proportional
    to p^(1/3) (Panter and Dite): denser than uniform where values are common, sparser than the
    quantiles in the tails. p is read from the gaps between `points` evenly ranked values: between
    ranks r/m and (r+1)/m, p ~ (1/m) / gap, so the cumulative centroid density grows by
    p^(1/3) * gap ~ gap^(2/3); centroids sit at its (i + 1/2)/K levels.
    """
    g, n = xs.shape
    m = min(points, n - 1) if n > 1 else 1
    ranks = torch.linspace(0, n - 1, m + 1, dtype=torch.float64).round().long()  # float32 rounds past 2^24
    at = xs[:, ranks].to(torch.float64)  # (G, m+1) values at evenly spaced ranks
    level = torch.zeros(g, m + 1, dtype=torch.float64)
    level[:, 1:] = torch.cumsum((at[:, 1:] - at[:, :-1]).clamp_min(0) ** (2 / 3), dim=1)
    level = level / level[:, -1:].clamp_min(1e-300)
    want = ((torch.arange(clusters, dtype=torch.float64) + 0.5) / clusters).expand(g, clusters).contiguous()
    hi = torch.searchsorted(level, want).clamp(1, m)
    below, above = level.gather(1, hi - 1), level.gather(1, hi)
    frac = ((want - below) / (above - below).clamp_min(1e-300)).clamp(0, 1)
    left = at.gather(1, hi - 1)
    return left + frac * (at.gather(1, hi) - left)


def _fp16_keys(values: np.ndarray) -> np.ndarray:
    """uint16 keys of fp16 `values` that sort as the values do: positive numbers get the sign bit
    set, negative ones have every bit flipped (so -0 sorts just below +0)."""
    bits = values.view(np.uint16)
    return bits ^ (((bits >> 15) * np.uint16(0x7FFF)) | np.uint16(0x8000))


def _fp16_of_keys(keys: np.ndarray) -> np.ndarray:
    """The fp16 values whose `_fp16_keys` are `keys` (uint16)."""
    flip = ((~keys >> 15) * np.uint16(0x7FFF)) | np.uint16(0x8000)
    return (keys ^ flip).view(np.float16)


def _sort_rows(part: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sort each row of `part` (g, n): (order (g, n) of the values, ascending, ties in index order;
    the sorted values float32 (g, n)). The order is uint16 when n <= 65536, else int64.

    fp16 rows of up to 65536 values are sorted as one uint32 per value, its order-keeping key
    above its index (numpy's SIMD sort of 32-bit integers, about twice as fast as an argsort): the
    sorted words give both the values and the order, with no gather."""
    g, n = part.shape
    index_bits = max(1, (n - 1).bit_length())
    if part.dtype == np.float16 and index_bits <= 16:
        words = (_fp16_keys(part).astype(np.uint32) << np.uint32(index_bits)) | np.arange(n, dtype=np.uint32)
        words.sort(axis=1)
        order = (words & np.uint32((1 << index_bits) - 1)).astype(np.uint16)
        return order, _fp16_of_keys((words >> np.uint32(index_bits)).astype(np.uint16)).astype(np.float32)
    if part.dtype == np.float16:  # a radix sort of the bit patterns
        order = np.argsort(_fp16_keys(part), axis=1, kind="stable")
    else:
        order = np.argsort(part.astype(np.float32), axis=1)
    return order, torch.gather(torch.from_numpy(part), 1, torch.from_numpy(order)).to(torch.float32).numpy()


def _sorted_codes(xs: np.ndarray, lut: np.ndarray) -> np.ndarray:
    """Code of every value of sorted rows xs (G, N) against the ascending LUTs (G, K): the index of
    its nearest LUT value (a value on a midpoint takes the lower one), as uint8 (G, N). In a sorted
    row the codes are runs of 0, 1, ..., K-1, whose lengths the midpoints' ranks give."""
    g, n = xs.shape
    k = lut.shape[1]
    midpoints = torch.from_numpy(np.ascontiguousarray((lut[:, 1:] + lut[:, :-1]) / 2, np.float32))
    edges = np.zeros((g, k + 1), np.int64)
    edges[:, 1:-1] = torch.searchsorted(torch.from_numpy(xs), midpoints, right=True).numpy()  # first rank above each midpoint
    edges[:, -1] = n
    runs = np.diff(edges, axis=1)  # (G, K): how many values get each code
    return np.repeat(np.tile(np.arange(k, dtype=np.uint8), g), runs.ravel()).reshape(g, n)


def lut_compress(weight: np.ndarray, nbits: int, group_size: int, importance: np.ndarray | None = None,
                 value_weights: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Palettize `weight` (out, in, ...) with one LUT of 2^nbits values per `group_size` output
    channels (0: one LUT for the whole tensor).

    `importance` (in,) weighs the error of each input channel: with the mean square of that
    channel's activations, the k-means minimises the expected squared error of the layer's output
    (its diagonal part) instead of the weights' own. `value_weights` (weight's shape), instead,
    weighs every value on its own (see quantize.scaled_lut).

    Returns (indices uint8 of weight's shape, lut float (groups, 2^nbits) in weight's dtype): the
    dense weight is lut[group of row, indices]. Groups are clustered in batches of about
    BATCH_ELEMENTS weights, so a 128k x 4k embedding table needs no more working memory than one
    MLP projection. Each batch is sorted once; that order gives the codes too.
    """
    rows = weight.shape[0]
    size = group_size or rows
    flat = np.ascontiguousarray(weight).reshape(rows // size, -1)  # (G, size * rest)
    groups, n = flat.shape
    per_value = None
    own = None if value_weights is None else np.asarray(value_weights, np.float32).reshape(groups, n)
    if importance is not None:  # (size * rest,): the weight of each value of a group, the same for every group
        per_row = np.broadcast_to(np.asarray(importance, np.float32).reshape((-1,) + (1,) * (weight.ndim - 2)),
                                  weight.shape[1:])
        per_value = np.broadcast_to(per_row, (size,) + per_row.shape).reshape(-1)
    step = max(1, BATCH_ELEMENTS // n)  # groups per batch: the sort and Lloyd of one batch at a time
    codes = np.empty((groups, n), np.uint8)
    luts = []
    for start in range(0, groups, step):
        order, xs = _sort_rows(flat[start:start + step])
        ws = (np.take_along_axis(own[start:start + step], order, axis=1) if own is not None else
              None if per_value is None else np.take(per_value, order))
        lut = lloyd(xs, 1 << nbits, ws).numpy().astype(weight.dtype)
        sorted_codes = torch.from_numpy(_sorted_codes(xs, lut.astype(np.float32)))
        # each sorted value's code, put where the value came from (in place, into `codes`)
        rank = torch.from_numpy(order.astype(np.int64, copy=False))
        torch.from_numpy(codes[start:start + step]).scatter_(1, rank, sorted_codes)
        luts.append(lut)
    return codes.reshape(weight.shape), np.concatenate(luts)


def lut_decompress(indices: np.ndarray, lut: np.ndarray) -> np.ndarray:
    """The dense weight of `lut_compress`'s output (its shape, the LUT's dtype)."""
    groups = lut.shape[0]
    flat = indices.reshape(groups, -1).astype(np.int64)
    return np.take_along_axis(lut, flat, axis=1).reshape(indices.shape)
