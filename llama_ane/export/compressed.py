"""Compressed weights as Core ML constexpr ops: the packed codes and their LUTs or scales.

`compress(value, c, ios18)` runs the numerics of `llama_ane.quantize` once per weight and returns
the arrays the op needs; `constexpr(name, payload, ios18)` emits the op, in each function that uses
the weight. On iOS18/macOS15 the op's inputs are consts whose `weight_id` is derived from the
parameter name, so every function of a multifunction package shares one copy of them in the blob:

    lutN  constexpr_lut_to_dense(indices: uintN, weight's shape; lut: (G, 1.., K, 1) fp16); a scaled
          LUT feeds its output as the data of constexpr_blockwise_shift_scale (scale, offset as below)
    intN  constexpr_blockwise_shift_scale(data: uintN, weight's shape; scale, offset: (O, I/block, 1..)
          fp16): dense = scale * (data - offset)

Older targets (one function per package, nothing to share) get the iOS16 forms through
coremltools' own constructors: one LUT per tensor, and symmetric int8 with one scale per output
channel (constexpr_affine_dequantize).

Sub-byte codes are held one per byte (typed uint4, uint6... as coremltools wants them) and packed
when the package is saved; `fast_sub_byte_packing` packs them with a few shifts instead of
coremltools' bit-array round trip, which is slower than the k-means that made them.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import numpy as np
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import types

from ..quantize import Compression
from ..quantize.fit import fit


@dataclass(frozen=True)
class Payload:
    """The compressed arrays of one weight: codes (indices or integers, the weight's shape) and
    either a LUT (groups, 2^bits) or scales (out, in / block, 1, ...); a scaled LUT has both."""

    compression: Compression
    codes: np.ndarray
    table: np.ndarray  # the LUT or the scales
    shape: tuple[int, ...]
    offset: np.ndarray | None = None  # asymmetric integers, scaled LUTs: per block, like the scales
    scale: np.ndarray | None = None  # scaled LUTs: (out, in / block, 1, ...)


def compress(value: np.ndarray | Payload, c: Compression, importance: np.ndarray | None = None) -> Payload:
    """Compress one weight (fp16, shape (out, in, ...)) as `c` says; LUTs fitted with `importance`
    (per input channel, see quantize.kmeans) when given. A weight compressed beforehand (a
    Payload, see convert.compression_units) is returned as it is."""
    if isinstance(value, Payload):
        return value
    codes, table, offset, scale = fit(value, c, importance)
    return Payload(c, codes, table, value.shape, offset, scale)


def join(parts: list[Payload]) -> Payload:
    """One weight from the payloads of its consecutive row blocks (rows are compressed
    independently: LUT groups and integer blocks never straddle rows)."""
    if len(parts) == 1:
        return parts[0]
    codes = np.concatenate([p.codes for p in parts])
    offsets = None if parts[0].offset is None else np.concatenate([p.offset for p in parts])
    scales = None if parts[0].scale is None else np.concatenate([p.scale for p in parts])
    return Payload(parts[0].compression, codes, np.concatenate([p.table for p in parts]), codes.shape, offsets, scales)


def _sub_byte(codes: np.ndarray, dtype: str) -> np.ndarray:
    """`codes` (uint8, one code a byte) typed as MIL's `dtype` ("uint4", ...) without a copy:
    coremltools packs them when saving."""
    return codes.view(types.nptype_from_builtin(types.string_to_builtin(dtype)))


PACK_ELEMENTS = 1 << 24  # codes packed at a time: bounds the temporaries of a large weight


def pack_bits(elements: np.ndarray, nbits: int) -> np.ndarray:
    """The low `nbits` of every element, packed from the least significant bit up (the layout of
    coremltools' pack_elements_into_bits, byte for byte): uint8 (ceil(n * nbits / 8),).

    Elements are taken a few at a time, as many as fill whole bytes (2 of 4 bits, 4 of 6 bits, 8
    of 3 bits), shifted into one integer whose low bytes are the packed ones.
    """
    flat = elements.reshape(-1).view(np.uint8) if elements.dtype.itemsize == 1 else elements.reshape(-1).astype(np.uint8)
    n = flat.size
    per = 8 // math.gcd(nbits, 8)  # elements that fill whole bytes
    width = per * nbits // 8  # those bytes
    out = np.empty(-(-n * nbits // 8), np.uint8)
    mask = np.uint32((1 << nbits) - 1)
    step = PACK_ELEMENTS - PACK_ELEMENTS % per
    for start in range(0, n, step):
        part = flat[start:start + step]
        if part.size % per:
            part = np.concatenate([part, np.zeros(per - part.size % per, np.uint8)])
        cols = part.reshape(-1, per)
        word = np.zeros(len(cols), np.uint32)
        for i in range(per):
            word |= (cols[:, i].astype(np.uint32) & mask) << np.uint32(nbits * i)
        packed = word.view(np.uint8).reshape(-1, 4)[:, :width].reshape(-1)  # little-endian: the low bytes
        first = start * nbits // 8
        out[first:first + len(packed)] = packed[:len(out) - first]
    return out


@contextlib.contextmanager
def fast_sub_byte_packing():
    """Save sub-byte consts with `pack_bits` instead of coremltools' own packer (same bytes)."""
    from coremltools.optimize import _utils

    saved = _utils.pack_elements_into_bits
    _utils.pack_elements_into_bits = pack_bits
    try:
        yield
    finally:
        _utils.pack_elements_into_bits = saved


def constexpr(name: str, p: Payload, ios18: bool):
    """The op that yields the dense weight `name` from payload `p` (op named `name` with dots as
    underscores, like the dense consts)."""
    from coremltools.converters.mil.frontend._utils import _construct_constexpr_dequant_op, _construct_constexpr_lut_op

    op_name = name.replace(".", "_")
    c, rank = p.compression, len(p.shape)
    if c.kind == "lut":
        lut = p.table.reshape((p.table.shape[0],) + (1,) * (rank - 1) + (p.table.shape[1], 1))  # (G, 1.., K, 1)
        if not ios18:
            return _construct_constexpr_lut_op(p.codes, lut, name=op_name)
        indices = _shared(_sub_byte(p.codes, f"uint{c.bits}"), f"{name}.indices")
        if p.scale is None:
            return mb.constexpr_lut_to_dense(indices=indices, lut=_shared(lut, f"{name}.lut"), name=op_name)
        values = mb.constexpr_lut_to_dense(indices=indices, lut=_shared(lut, f"{name}.lut"), name=f"{op_name}_lut")
        return mb.constexpr_blockwise_shift_scale(data=values, scale=_shared(p.scale, f"{name}.scale"),
                                                  offset=_shared(p.offset, f"{name}.offset"), name=op_name)
    if c.symmetric:  # int8 before iOS18: one scale per output channel, no offset
        scale = p.table.reshape(-1)
        return _construct_constexpr_dequant_op(p.codes, np.zeros_like(scale, np.int8), scale, axis=0, name=op_name)
    data = _shared(_sub_byte(p.codes, f"uint{c.bits}") if c.bits < 8 else p.codes, f"{name}.data")
    return mb.constexpr_blockwise_shift_scale(data=data, scale=_shared(p.table, f"{name}.scale"),
                                              offset=_shared(p.offset, f"{name}.offset"), name=op_name)


def _shared(value: np.ndarray, weight_id: str):
    var = mb.const(val=value, name=weight_id.replace(".", "_"))
    var.op.weight_id = weight_id
    return var
