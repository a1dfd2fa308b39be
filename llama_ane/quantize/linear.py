"""Linear (integer) quantization: each block of a weight's row is a scale times small integers.

Two forms, as Core ML's "linear" and "linear_symmetric" modes:

* asymmetric (iOS18/macOS15, `constexpr_blockwise_shift_scale` with an offset): unsigned n-bit
  integers q in [0, 2^n - 1] and, per block, a scale (max - min) / (2^n - 1) and an offset
  -min / scale, so the block's range maps onto the whole grid: dense = scale * (q - offset);
* symmetric (every target; `constexpr_affine_dequantize` before iOS18): signed integers in
  [-2^(n-1), 2^(n-1) - 1], scale = largest magnitude / (2^(n-1) - 1), no offset: zero stays zero.

Scales and offsets are rounded to the weight's dtype first and the integers computed against the
rounded values, so what is stored is what dequantizes.

The asymmetric form does not simply map each block's min and max onto the grid: an outlier then
coarsens the steps of every other value. Each block tries a few ranges clipped at either end and
keeps the one with the least (importance-weighted) squared error, then refits scale and offset to
its integers by least squares (as llama.cpp's k-quants do). Min and max are among the candidates,
so a block already on a grid of the same size is kept exactly.
"""

from __future__ import annotations

import numpy as np

BATCH_ELEMENTS = 1 << 23  # weights quantized at once (rows are independent): bounds the temporaries


def _blocks(weight: np.ndarray, block_size: int) -> tuple[np.ndarray, tuple[int, ...]]:
    """(out, blocks, block elements) float32 view of `weight` (out, in, ...), and the shape of one
    value per block (out, in / block, 1, ...)."""
    out, inner = weight.shape[0], weight.shape[1]
    size = block_size or inner
    rest = weight.shape[2:]
    w = weight.reshape(out, inner // size, size * int(np.prod(rest, dtype=np.int64))).astype(np.float32)
    return w, (out, inner // size) + (1,) * len(rest)


CLIPS = (0.0, 0.05)  # fractions of a block's range tried off its low and its high end
REFITS = 1  # least-squares refits of scale and offset to the chosen integers
SEARCH_BITS = 4  # ranges are searched at this many bits or fewer; 8-bit blocks map min and max


def int_compress(weight: np.ndarray, nbits: int, block_size: int, symmetric: bool = False,
                 importance: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Quantize `weight` (out, in, ...) with one scale (and offset) per row and block of
    `block_size` input channels (0: one per row). `importance` (in,) weighs each input channel's
    squared error in the asymmetric form's search of ranges (see the module docstring).

    Returns (data: uint8 in [0, 2^n - 1], or int8 when `symmetric`, of weight's shape; scale and
    offset in weight's dtype, shaped (out, in / block, 1, ...); offset None when symmetric).
    """
    rows = max(1, BATCH_ELEMENTS // max(1, weight[0].size))
    if weight.shape[0] > rows:  # rows are independent: a batch at a time bounds the float32 temporaries
        parts = [int_compress(weight[i:i + rows], nbits, block_size, symmetric, importance)
                 for i in range(0, weight.shape[0], rows)]
        return (np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]),
                None if symmetric else np.concatenate([p[2] for p in parts]))
    w, shape = _blocks(weight, block_size)
    if symmetric:
        qmax = (1 << (nbits - 1)) - 1
        scale = (np.abs(w).max(axis=2, keepdims=True) / qmax).astype(weight.dtype)
        scale[scale == 0] = 1  # an all-zero block: any scale gives zeros
        data = np.clip(np.rint(w / scale.astype(np.float32)), -qmax - 1, qmax).astype(np.int8)
        return data.reshape(weight.shape), scale.reshape(shape), None
    top = (1 << nbits) - 1
    weights = np.ones((1, 1, 1), np.float32)
    if importance is not None:  # (in, ...) -> the weight of each value of a block
        per_row = np.broadcast_to(np.asarray(importance, np.float32).reshape((-1,) + (1,) * (weight.ndim - 2)),
                                  weight.shape[1:])
        weights = np.ascontiguousarray(per_row).reshape(1, w.shape[1], w.shape[2])
    low, high = w.min(axis=2, keepdims=True), w.max(axis=2, keepdims=True)
    if nbits > SEARCH_BITS:  # steps fine enough that min and max are as good as any range
        return _as_output(_grid(w, low, high, top, weight.dtype), weight.shape, shape)
    best = None

    def consider(candidate: tuple) -> None:
        nonlocal best
        err = (weights * (_dense(candidate[2], candidate[0], candidate[1]) - w) ** 2).sum(axis=2, keepdims=True)
        if best is None:
            best = [err, *candidate]
            return
        better = err < best[0]
        best = [np.where(better, new, old) for new, old in zip((err, *candidate), best)]

    for a in CLIPS:
        for b in CLIPS:
            candidate = _grid(w, low + a * (high - low), high - b * (high - low), top, weight.dtype)
            consider(candidate)
            for _ in range(REFITS):
                candidate = _refit(w, weights, candidate[2], candidate[0], candidate[1], top)
                consider(candidate)
    return _as_output(best[1:], weight.shape, shape)


def _as_output(candidate: tuple, weight_shape: tuple, shape: tuple) -> tuple:
    scale, offset, data = candidate
    return data.reshape(weight_shape), scale.reshape(shape), offset.reshape(shape)


def _dense(data: np.ndarray, scale: np.ndarray, offset: np.ndarray) -> np.ndarray:
    return (data.astype(np.float32) - offset.astype(np.float32)) * scale.astype(np.float32)


def _grid(w: np.ndarray, low: np.ndarray, high: np.ndarray, top: int, dtype) -> tuple:
    """Scale and offset (in `dtype`) mapping [low, high] onto 0..top, and w's integers on that grid."""
    scale = ((high - low) / top).astype(dtype)
    scale[scale == 0] = 1  # a constant block: q = offset everywhere
    scale32 = scale.astype(np.float32)
    offset = (-low / scale32).astype(dtype)
    data = np.clip(np.rint(w / scale32 + offset.astype(np.float32)), 0, top).astype(np.uint8)
    return scale, offset, data


def _refit(w: np.ndarray, weights: np.ndarray, data: np.ndarray, scale: np.ndarray, offset: np.ndarray,
           top: int) -> tuple:
    """The weighted least-squares scale s and shift m of w ~ s * q + m for the integers q of each
    block, and w's integers on the new grid; blocks whose fit is degenerate keep their grid."""
    new_scale, new_offset = fit_scale_offset(w, weights, data.astype(np.float32), scale, offset)
    new_data = np.clip(np.rint(w / new_scale.astype(np.float32) + new_offset.astype(np.float32)), 0, top).astype(np.uint8)
    return new_scale, new_offset, new_data


def fit_scale_offset(w: np.ndarray, weights: np.ndarray, q: np.ndarray, scale: np.ndarray,
                     offset: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The weighted least-squares scale s and offset o of w ~ s * (q - o) in each block, for
    blocks w and grid values q (out, blocks, block elements) float32 and weights broadcastable to
    them; blocks whose fit is degenerate (one value, or s <= 0) keep `scale` and `offset`
    (out, blocks, 1). Returned in their dtype, never a zero scale."""
    sw = np.broadcast_to(weights, w.shape).sum(axis=2, keepdims=True)
    sq, sx = (weights * q).sum(axis=2, keepdims=True), (weights * w).sum(axis=2, keepdims=True)
    sqq, sqx = (weights * q * q).sum(axis=2, keepdims=True), (weights * q * w).sum(axis=2, keepdims=True)
    det = sw * sqq - sq * sq
    ok = det > 1e-12 * np.maximum(sw * sqq, 1e-30)
    s = np.where(ok, (sw * sqx - sq * sx) / np.where(ok, det, 1), 0)
    ok &= s > 0
    m = (sx - s * sq) / np.maximum(sw, 1e-30)  # w ~ s * q + m
    new_scale = np.where(ok, s, scale.astype(np.float32)).astype(scale.dtype)
    new_scale[new_scale == 0] = 1
    new_offset = np.where(ok, -m / new_scale.astype(np.float32), offset.astype(np.float32)).astype(offset.dtype)
    return new_scale, new_offset


def int_decompress(data: np.ndarray, scale: np.ndarray, offset: np.ndarray | None = None) -> np.ndarray:
    """The dense weight of `int_compress`'s output, in float32."""
    out, blocks = scale.shape[0], scale.shape[1]
    q = data.reshape(out, blocks, -1).astype(np.float32)
    if offset is not None:
        q = q - offset.reshape(out, blocks, 1).astype(np.float32)
    return (q * scale.reshape(out, blocks, 1).astype(np.float32)).reshape(data.shape)
