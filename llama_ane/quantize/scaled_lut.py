"""Scaled LUTs: a LUT per group of rows whose values every block of a row scales and shifts.

    dense[o, i] = scale[o, b] * (lut[group of o, code[o, i]] - offset[o, b]),   b = i // block

A plain LUT shared by whole rows cannot follow a weight whose blocks each sit on their own range
or grid: a checkpoint that was block-quantized before (GGUF's Q4_1 layers, say) needs a different
set of 2^bits values in every block of 32. Dividing each block by its own scale and offset first
puts every block on one common range, where a LUT of 2^bits values shared by the group fits them
all (exactly, for such a checkpoint); the LUT then learns the shape of that common grid, which
integers would fix as uniform.

Fitting, per weight:
1. each block's scale and offset: those of `int_compress` at the same bits (its range search),
   so that w / scale + offset lies on [0, 2^bits - 1];
2. the group's LUT by weighted k-means on those normalised values, each weighing its input
   channel's importance times its block's scale squared (the error it makes in the dense weight);
3. each block's scale and offset refitted by least squares to the LUT values its codes chose.

Core ML runs it as two constexpr ops: constexpr_lut_to_dense, whose output is the `data` of a
constexpr_blockwise_shift_scale (iOS18/macOS15; export.compressed builds them).
"""

from __future__ import annotations

import numpy as np

from .kmeans import lut_compress, lut_decompress
from .linear import fit_scale_offset, int_compress


def _per_block(array: np.ndarray, blocks: int) -> np.ndarray:
    """`array` (out, in, ...) as float32 (out, blocks, in / blocks * rest)."""
    return array.reshape(array.shape[0], blocks, -1).astype(np.float32)


def scaled_lut_compress(weight: np.ndarray, nbits: int, group_size: int, block_size: int,
                        importance: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Compress `weight` (out, in, ...) with one LUT of 2^nbits values per `group_size` output
    channels (0: one for the tensor) and a scale and an offset per row and block of `block_size`
    input channels (0: one per row). `importance` (in,) weighs each input channel's error.

    Returns (indices uint8 of weight's shape, lut (groups, 2^nbits), scale and offset
    (out, in / block, 1, ...)), the last three in weight's dtype.
    """
    _, scale, offset = int_compress(weight, nbits, block_size, importance=importance)
    shape, blocks = scale.shape, scale.shape[1]  # (out, in / block, 1, ...)
    w = _per_block(weight, blocks)
    s, o = _per_block(scale, blocks), _per_block(offset, blocks)
    normalised = (w / s + o).astype(weight.dtype).reshape(weight.shape)
    channel = np.ones(1, np.float32) if importance is None else np.asarray(importance, np.float32)
    channel = np.broadcast_to(channel.reshape((-1,) + (1,) * (weight.ndim - 2)), weight.shape[1:])
    per_input = _per_block(channel[None], blocks)  # (1, blocks, block elements): each value's input channel
    value_weights = np.broadcast_to(per_input * s * s, w.shape).reshape(weight.shape)
    indices, lut = lut_compress(normalised, nbits, group_size, value_weights=value_weights)
    del normalised, value_weights
    q = _per_block(lut_decompress(indices, lut), blocks)
    scale, offset = fit_scale_offset(w, per_input, q, scale.reshape(s.shape), offset.reshape(o.shape))
    return indices, lut, scale.reshape(shape), offset.reshape(shape)


def scaled_lut_decompress(indices: np.ndarray, lut: np.ndarray, scale: np.ndarray,
                          offset: np.ndarray) -> np.ndarray:
    """The dense weight of `scaled_lut_compress`'s output, in float32."""
    blocks = scale.shape[1]
    q = _per_block(lut_decompress(indices, lut), blocks)
    return ((q - _per_block(offset, blocks)) * _per_block(scale, blocks)).reshape(indices.shape)
