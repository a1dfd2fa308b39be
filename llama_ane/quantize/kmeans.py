"""One-dimensional k-means over many groups at once, in torch: the LUT of each group of weights.

For palettization every group (one LUT's worth of output channels) needs its own k-means on its
values. Running them one by one is what makes palettizing a 1B model slow; here every group's
Lloyd iterations run together as a few batched tensor ops on the sorted groups (see kmeans_1d).

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

    Each row is sorted once; 1-D clusters are then intervals of the sorted values, so a Lloyd
    iteration is a search of the K-1 boundaries (midpoints between neighbouring centroids) in the
    sorted row and sums read off its prefix sums: O(K log N) per group and iteration instead of
    O(N). With `weights` (G, N) >= 0, each value counts that much (weighted means; the error
    minimised is sum weight * (value - centroid)^2). Groups with fewer distinct values than K
    repeat centroids.
    """
    values = groups.to(torch.float32).numpy()
    if weights is None:  # numpy's vectorised sort is an order of magnitude faster than torch.sort on a CPU
        xs, ws = torch.from_numpy(np.sort(values, axis=1)), torch.ones(1, 1, dtype=torch.float64)
    else:
        order = np.argsort(values, axis=1)
        xs = torch.from_numpy(np.take_along_axis(values, order, axis=1))
        ws = torch.from_numpy(np.take_along_axis(weights.to(torch.float64).numpy(), order, axis=1))
    g, n = xs.shape
    k = clusters
    mass = torch.zeros(g, n + 1, dtype=torch.float64)  # prefix sums of the weights, and of weight * value
    mass[:, 1:] = torch.cumsum(ws.expand(g, n), dim=1)
    prefix = torch.zeros(g, n + 1, dtype=torch.float64)
    prefix[:, 1:] = torch.cumsum(ws * xs, dim=1)
    centroids = companded_start(xs, k)
    span = (xs[:, -1] - xs[:, 0]).to(torch.float64).clamp_min(1e-12)
    edges = torch.empty(g, k + 1, dtype=torch.long)
    edges[:, 0], edges[:, -1] = 0, n
    for _ in range(iterations):
        midpoints = ((centroids[:, 1:] + centroids[:, :-1]) / 2).to(torch.float32)
        edges[:, 1:-1] = torch.searchsorted(xs, midpoints.contiguous())  # cluster j: xs[edges[j]:edges[j+1]]
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


def _assign(x: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """Nearest centroid of each value: x (G, N), sorted centroids (G, K) -> (G, N) int64."""
    midpoints = (centroids[:, 1:] + centroids[:, :-1]) / 2  # (G, K-1), the cluster boundaries
    return torch.searchsorted(midpoints.contiguous(), x.contiguous())


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
    MLP projection.
    """
    rows = weight.shape[0]
    size = group_size or rows
    flat = torch.from_numpy(np.ascontiguousarray(weight)).reshape(rows // size, -1)  # (G, size * rest)
    scale = None
    if importance is not None:  # (1, size * rest): the same for every group
        per_row = np.broadcast_to(np.asarray(importance, np.float32).reshape((-1,) + (1,) * (weight.ndim - 2)),
                                  weight.shape[1:])
        scale = torch.from_numpy(np.ascontiguousarray(np.broadcast_to(per_row, (size,) + per_row.shape))).reshape(1, -1)
    groups, n = flat.shape
    step = max(1, BATCH_ELEMENTS // n)  # groups per batch: the sort and prefix sums of one batch at a time
    luts, codes = [], []
    for start in range(0, groups, step):
        part = flat[start:start + step]
        weights = None if scale is None else scale.expand(part.shape[0], -1)
        lut = kmeans_1d(part, 1 << nbits, weights=weights).numpy().astype(weight.dtype)
        codes.append(_assign(part.to(torch.float32), torch.from_numpy(lut.astype(np.float32))).to(torch.uint8))
        luts.append(lut)
    return torch.cat(codes).numpy().reshape(weight.shape), np.concatenate(luts)


def lut_decompress(indices: np.ndarray, lut: np.ndarray) -> np.ndarray:
    """The dense weight of `lut_compress`'s output (its shape, the LUT's dtype)."""
    groups = lut.shape[0]
    flat = indices.reshape(groups, -1).astype(np.int64)
    return np.take_along_axis(lut, flat, axis=1).reshape(indices.shape)
