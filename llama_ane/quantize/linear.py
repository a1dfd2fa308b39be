"""Linear (integer) quantization: each block of a weight's row is a scale times small integers.

Two forms, as Core ML's "linear" and "linear_symmetric" modes:

* asymmetric (iOS18/macOS15, `constexpr_blockwise_shift_scale` with an offset): unsigned n-bit
  integers q in [0, 2^n - 1] and, per block, a scale (max - min) / (2^n - 1) and an offset
  -min / scale, so the block's range maps onto the whole grid: dense = scale * (q - offset);
* symmetric (every target; `constexpr_affine_dequantize` before iOS18): signed integers in
  [-2^(n-1), 2^(n-1) - 1], scale = largest magnitude / (2^(n-1) - 1), no offset: zero stays zero.

Scales and offsets are rounded to the weight's dtype first and the integers computed against the
rounded values, so what is stored is what dequantizes.
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


def int_compress(weight: np.ndarray, nbits: int, block_size: int,
                 symmetric: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Quantize `weight` (out, in, ...) with one scale (and offset) per row and block of
    `block_size` input channels (0: one per row).

    Returns (data: uint8 in [0, 2^n - 1], or int8 when `symmetric`, of weight's shape; scale and
    offset in weight's dtype, shaped (out, in / block, 1, ...); offset None when symmetric).
    """
    rows = max(1, BATCH_ELEMENTS // max(1, weight[0].size))
    if weight.shape[0] > rows:  # rows are independent: a batch at a time bounds the float32 temporaries
        parts = [int_compress(weight[i:i + rows], nbits, block_size, symmetric) for i in range(0, weight.shape[0], rows)]
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
    low, high = w.min(axis=2, keepdims=True), w.max(axis=2, keepdims=True)
    scale = ((high - low) / top).astype(weight.dtype)
    scale[scale == 0] = 1  # a constant block: q = offset everywhere
    scale32 = scale.astype(np.float32)
    offset = (-low / scale32).astype(weight.dtype)
    data = np.clip(np.rint(w / scale32 + offset.astype(np.float32)), 0, top).astype(np.uint8)
    return data.reshape(weight.shape), scale.reshape(shape), offset.reshape(shape)


def int_decompress(data: np.ndarray, scale: np.ndarray, offset: np.ndarray | None = None) -> np.ndarray:
    """The dense weight of `int_compress`'s output, in float32."""
    out, blocks = scale.shape[0], scale.shape[1]
    q = data.reshape(out, blocks, -1).astype(np.float32)
    if offset is not None:
        q = q - offset.reshape(out, blocks, 1).astype(np.float32)
    return (q * scale.reshape(out, blocks, 1).astype(np.float32)).reshape(data.shape)
