"""One weight's compressed arrays, and the dense weight they stand for: the one place that picks
the numerics of each form (`kmeans` LUTs, `scaled_lut`, `linear` integers)."""

from __future__ import annotations

import numpy as np

from .kmeans import lut_compress, lut_decompress
from .linear import int_compress, int_decompress
from .scaled_lut import scaled_lut_compress, scaled_lut_decompress
from .schemes import Compression


COMPENSATION_DAMPING = 1.0  # of the mean of the second moments' diagonal: a calibration of a few hundred
# tokens leaves most directions of a layer's inputs unseen, and codes compensated less damped fit
# those tokens at the cost of other text (SmolLM2: less output error than plain codes on held-out
# prose at 0.3 and 1.0, more at 0.01)


def statistics_key(key: str | None, c: Compression | None) -> str | None:
    """The calibration's key a fit as `c` reads for a weight whose inputs' statistics are under
    `key`: its second moments (KEY.gram) for error-compensated codes, else the key itself (None:
    the weight has no inputs, a table)."""
    return f"{key}.gram" if key is not None and c is not None and c.compensated else key


def fit(value: np.ndarray, c: Compression, importance: np.ndarray | None = None) -> tuple:
    """Compress `value` (fp16, shape (out, in, ...)) as `c` says, LUTs and int4 ranges weighted by
    `importance` (per input channel) when given. `importance` may instead be the inputs' second
    moments (in, in), a calibration's KEY.gram: fits are weighted by its diagonal, and a LUT
    that `c` says is compensated takes error-compensating codes (quantize.gptq) against it.

    Returns (codes, table, offset, scale): LUT indices or integers of value's shape; the LUT
    (groups, 2^bits) or the integers' scales; the offsets of asymmetric integers and scaled LUTs
    (else None); a scaled LUT's scales (else None)."""
    gram = None
    if importance is not None and np.ndim(importance) == 2:
        gram, importance = importance, np.ascontiguousarray(np.diag(importance))
    if c.kind == "lut":
        if c.scaled:
            indices, lut, scale, offset = scaled_lut_compress(value, c.bits, c.group_size, c.block_size, importance)
        else:
            (indices, lut), scale, offset = lut_compress(value, c.bits, c.group_size, importance), None, None
        if c.compensated and gram is not None:
            indices = compensated_codes(value, c, lut, offset, scale, gram)
        return indices, lut, offset, scale
    data, scale, offset = int_compress(value, c.bits, c.block_size, symmetric=c.symmetric, importance=importance)
    return data, scale, offset, None


_FACTORS: list[tuple[np.ndarray, object]] = []  # the last few (second moments, their inverse factor)
FACTORS_KEPT = 8  # a layer's inputs: the forms of one unit, and the row blocks of one weight, share one


def _factor(gram: np.ndarray):
    """quantize.gptq's inverse factor of `gram`, found once for the last few arrays asked for."""
    import torch

    from .gptq import inverse_factor

    for seen, factor in _FACTORS:
        if seen is gram or seen.shape == gram.shape and np.array_equal(seen, gram):
            return factor
    factor = inverse_factor(torch.from_numpy(gram), COMPENSATION_DAMPING)
    _FACTORS.append((gram, factor))
    del _FACTORS[:-FACTORS_KEPT]
    return factor


def compensated_codes(value: np.ndarray, c: Compression, lut: np.ndarray, offset: np.ndarray | None,
                      scale: np.ndarray | None, gram: np.ndarray) -> np.ndarray:
    """LUT indices of `value` (out, in, 1, ...) chosen by quantize.gptq against the inputs' second
    moments `gram` (in, in): each row's values are its group's LUT, scaled and shifted by the row's
    own scale and offset when `c` is scaled (per channel only)."""
    import torch

    from .gptq import assign

    rows = value.shape[0]
    if value[0].size != value.shape[1] or c.scaled and c.block_size:
        raise ValueError(f"error-compensated codes need a 2-D weight and a LUT scaled per channel at most, not {c}")
    values = lut.astype(np.float32)[np.arange(rows) // (c.group_size or rows)]  # (out, K)
    if scale is not None:
        values = (values - offset.reshape(rows, 1).astype(np.float32)) * scale.reshape(rows, 1).astype(np.float32)
    order = np.argsort(values, axis=1, kind="stable")
    ranked = assign(value.reshape(rows, -1), np.take_along_axis(values, order, 1), torch.from_numpy(gram),
                    factor=_factor(gram))
    return np.take_along_axis(order, ranked.astype(np.int64), 1).astype(np.uint8).reshape(value.shape)


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
