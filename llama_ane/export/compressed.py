"""Compressed weights as Core ML constexpr ops: the packed codes and their LUTs or scales.

`compress(value, c, ios18)` runs the numerics of `llama_ane.quantize` once per weight and returns
the arrays the op needs; `constexpr(name, payload, ios18)` emits the op, in each function that uses
the weight. On iOS18/macOS15 the op's inputs are consts whose `weight_id` is derived from the
parameter name, so every function of a multifunction package shares one copy of them in the blob:

    lutN  constexpr_lut_to_dense(indices: uintN, weight's shape; lut: (G, 1.., K, 1) fp16)
    intN  constexpr_blockwise_shift_scale(data: uintN, weight's shape; scale, offset: (O, I/block, 1..)
          fp16): dense = scale * (data - offset)

Older targets (one function per package, nothing to share) get the iOS16 forms through
coremltools' own constructors: one LUT per tensor, and symmetric int8 with one scale per output
channel (constexpr_affine_dequantize).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import types

from ..quantize import Compression
from ..quantize.kmeans import lut_compress
from ..quantize.linear import int_compress


@dataclass(frozen=True)
class Payload:
    """The compressed arrays of one weight: codes (indices or integers, the weight's shape) and
    either a LUT (groups, 2^bits) or scales (out, in / block, 1, ...)."""

    compression: Compression
    codes: np.ndarray
    table: np.ndarray  # the LUT or the scales
    shape: tuple[int, ...]
    offset: np.ndarray | None = None  # asymmetric integers: per block, like the scales


def compress(value: np.ndarray, c: Compression, importance: np.ndarray | None = None) -> Payload:
    """Compress one weight (fp16, shape (out, in, ...)) as `c` says; LUTs fitted with `importance`
    (per input channel, see quantize.kmeans) when given."""
    if c.kind == "lut":
        indices, lut = lut_compress(value, c.bits, c.group_size, importance)
        return Payload(c, indices, lut, value.shape)
    data, scale, offset = int_compress(value, c.bits, c.block_size, symmetric=c.symmetric)
    return Payload(c, data, scale, value.shape, offset)


def _sub_byte(codes: np.ndarray, dtype: str) -> np.ndarray:
    """`codes` typed as MIL's `dtype` ("uint4", "int4", ...): coremltools packs them when saving."""
    return codes.astype(types.nptype_from_builtin(types.string_to_builtin(dtype)))


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
        return mb.constexpr_lut_to_dense(indices=indices, lut=_shared(lut, f"{name}.lut"), name=op_name)
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
