"""One weight's compressed arrays, and the dense weight they stand for: the one place that picks
the numerics of each form (`kmeans` LUTs, `scaled_lut`, `linear` integers)."""

from __future__ import annotations

import numpy as np

from .kmeans import lut_compress, lut_decompress
from .linear import int_compress, int_decompress
from .scaled_lut import scaled_lut_compress, scaled_lut_decompress
from .schemes import Compression


def fit(value: np.ndarray, c: Compression, importance: np.ndarray | None = None) -> tuple:
    """Compress `value` (fp16, shape (out, in, ...)) as `c` says, LUTs and int4 ranges weighted by
    `importance` (per input channel) when given.

    Returns (codes, table, offset, scale): LUT indices or integers of value's shape; the LUT
    (groups, 2^bits) or the integers' scales; the offsets of asymmetric integers and scaled LUTs
    (else None); a scaled LUT's scales (else None)."""
    if c.kind == "lut" and c.scaled:
        indices, lut, scale, offset = scaled_lut_compress(value, c.bits, c.group_size, c.block_size, importance)
        return indices, lut, offset, scale
    if c.kind == "lut":
        indices, lut = lut_compress(value, c.bits, c.group_size, importance)
        return indices, lut, None, None
    data, scale, offset = int_compress(value, c.bits, c.block_size, symmetric=c.symmetric, importance=importance)
    return data, scale, offset, None


def dense(c: Compression, codes: np.ndarray, table: np.ndarray, offset: np.ndarray | None = None,
          scale: np.ndarray | None = None) -> np.ndarray:
    """The float32 weight that `fit`'s arrays decompress to (what the device computes with)."""
    if c.kind == "lut" and scale is not None:
        return scaled_lut_decompress(codes, table, scale, offset)
    if c.kind == "lut":
        return lut_decompress(codes, table).astype(np.float32)
    return int_decompress(codes, table, offset)


def roundtrip(value: np.ndarray, c: Compression, importance: np.ndarray | None = None) -> np.ndarray:
    """`value` compressed as `c` says and decompressed again, float32."""
    return dense(c, *fit(value, c, importance))
