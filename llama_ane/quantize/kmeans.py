"""One-dimensional k-means over many groups at once: the LUT of each group of weights.

For palettization every group (one LUT's worth of output channels) needs its own k-means on its
values. Running them one by one is what makes palettizing a 1B model slow; here every group's
Lloyd iterations run together as a few batched tensor ops on the sorted groups (see `lloyd`).

Sorting is most of the cost, so fp16 weights are sorted by their bit patterns made order-keeping
(`_fp16_keys`): numpy sorts 16-bit integers by radix, in linear time, and the same sort's order
assigns every weight its code without searching (`lut_compress`).

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
BATCH_ELEMENTS = 1 << 23  # weights clustered at once: bounds the working memory (~40 bytes each) to ~0.3 GiB


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
    sums: O(K log N) per group and iteration instead of O(N).
    """
    g, n = xs.shape
    k = clusters
    prefix = np.zeros((g, n + 1), np.float64)  # prefix sums of weight * value (and of the weights)
    if ws is None:
        np.cumsum(xs, axis=1, dtype=np.float64, out=prefix[:, 1:])
        mass = None  # the count of values below rank i is i
    else:
        mass = np.zeros((g, n + 1), np.float64)
        np.cumsum(ws, axis=1, out=mass[:, 1:])
        np.cumsum(ws * xs, axis=1, out=prefix[:, 1:])
        mass = torch.from_numpy(mass)
    prefix = torch.from_numpy(prefix)
    xs_t = torch.from_numpy(np.ascontiguousarray(xs))
    centroids = companded_start(xs_t, k)
    span = (xs_t[:, -1] - xs_t[:, 0]).to(torch.float64).clamp_min(1e-12)
    edges = torch.empty(g, k + 1, dtype=torch.long)
    edges[:, 0], edges[:, -1] = 0, n
    for _ in range(iterations):
        midpoints = ((centroids[:, 1:] + centroids[:, :-1]) / 2).to(torch.float32)
        edges[:, 1:-1] = torch.searchsorted(xs_t, midpoints.contiguous())  # cluster j: xs[edges[j]:edges[j+1]]
        if mass is None:
            counts = (edges[:, 1:] - edges[:, :-1]).to(torch.float64)
        else:
            counts = mass.gather(1, edges[:, 1:]) - mass.gather(1, edges[:, :-1])
        sums = prefix.gather(1, edges[:, 1:]) - prefix.gather(1, edges[:, :-1])
        moved = torch.where(counts > 0, sums / counts.clamp_min(1e-300), centroids)
        moved, _ = torch.sort(moved, dim=1)
        shift = ((moved - centroids).abs().amax(dim=1) / span).max()
        centroids = moved
        if shift < TOLERANCE:
            break
    return centroids.to(torch.float32)


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
    ranks = torch.linspace(0, n - 1, m + 1).round().long()
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


def _sorted_codes(xs: np.ndarray, lut: np.ndarray) -> np.ndarray:
    """Code of every value of sorted rows xs (G, N) against the ascending LUTs (G, K): the index of
    its nearest LUT value (a value on a midpoint takes the lower one), as uint8 (G, N)."""
    g, n = xs.shape
    midpoints = torch.from_numpy(np.ascontiguousarray((lut[:, 1:] + lut[:, :-1]) / 2, np.float32))
    edges = torch.searchsorted(torch.from_numpy(xs), midpoints, right=True).numpy()  # first rank above each midpoint
    steps = np.zeros((g, n + 1), np.uint8)  # +1 at every rank where the code goes up
    np.add.at(steps, (np.repeat(np.arange(g), edges.shape[1]), edges.ravel()), 1)
    return np.cumsum(steps[:, :n], axis=1, dtype=np.uint8)


def lut_compress(weight: np.ndarray, nbits: int, group_size: int,
                 importance: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Palettize `weight` (out, in, ...) with one LUT of 2^nbits values per `group_size` output
    channels (0: one LUT for the whole tensor).

    `importance` (in,) weighs the error of each input channel: with the mean square of that
    channel's activations, the k-means minimises the expected squared error of the layer's output
    (its diagonal part) instead of the weights' own.

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
    if importance is not None:  # (size * rest,): the weight of each value of a group, the same for every group
        per_row = np.broadcast_to(np.asarray(importance, np.float64).reshape((-1,) + (1,) * (weight.ndim - 2)),
                                  weight.shape[1:])
        per_value = np.broadcast_to(per_row, (size,) + per_row.shape).reshape(-1)
    step = max(1, BATCH_ELEMENTS // n)  # groups per batch: the sort and prefix sums of one batch at a time
    codes = np.empty((groups, n), np.uint8)
    luts = []
    for start in range(0, groups, step):
        part = flat[start:start + step]
        if part.dtype == np.float16:  # a radix sort of the bit patterns
            order = np.argsort(_fp16_keys(part), axis=1, kind="stable")
        else:
            order = np.argsort(part.astype(np.float32), axis=1)
        rank = torch.from_numpy(order)
        xs = torch.gather(torch.from_numpy(part), 1, rank).to(torch.float32).numpy()
        lut = lloyd(xs, 1 << nbits, None if per_value is None else per_value[order]).numpy().astype(weight.dtype)
        sorted_codes = torch.from_numpy(_sorted_codes(xs, lut.astype(np.float32)))
        torch.from_numpy(codes[start:start + step]).scatter_(1, rank, sorted_codes)  # in place, into `codes`
        luts.append(lut)
    return codes.reshape(weight.shape), np.concatenate(luts)


def lut_decompress(indices: np.ndarray, lut: np.ndarray) -> np.ndarray:
    """The dense weight of `lut_compress`'s output (its shape, the LUT's dtype)."""
    groups = lut.shape[0]
    flat = indices.reshape(groups, -1).astype(np.int64)
    return np.take_along_axis(lut, flat, axis=1).reshape(indices.shape)
