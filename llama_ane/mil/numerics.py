"""How the executor stores and computes numbers: the fp16 (ANE) and fp32 policies.

fp16 mode ("as the ANE computes")
    Every tensor the program types as fp16 is stored as numpy float16 between ops, as the ANE
    keeps activations in half precision. Each op reads its fp16 operands, computes in float32
    and rounds its result to float16 once:
      * elementwise ops (add, mul, exp, rsqrt, ...) are therefore correctly rounded fp16 ops
        (float32 carries more than twice fp16's 11-bit significand, so the double rounding
        of a single fp16 op is exact);
      * conv, matmul, linear and einsum multiply fp16 operands exactly and accumulate the
        products in float32;
      * reductions (reduce_*, softmax, layer_norm) accumulate in float32.
    Apple does not publish the width of the ANE's accumulators; float32 accumulation with one
    fp16 rounding per op output is the model used here. What this mode catches is what matters
    for an export: every intermediate tensor
    round-trips through fp16, so overflow to inf (an RMSNorm sum of squares, a -inf mask) and
    fp16 saturation show up exactly where they would on device.

fp32 mode
    fp16-typed tensors are held as float32 (no rounding anywhere); same algorithms. The gap
    between the two modes is the cost of half precision; the gap between fp32 mode and the torch
    source is the conversion itself.

ANE-numerics mode (fp16 with `ane=True`)
    fp16 mode plus the deviations others report of the Neural Engine, so that the parity gate
    can catch on Linux what would go wrong on a device:
      * `softplus` collapses to 0 above ~10.4 in fp16 (coremltools issue 2687);
      * `silu` has ~1e-3 absolute error near 0 (Anemll Forge): modelled as +1e-3 on |x| <= 1;
      * fp16 subnormals (|x| < 2^-14) "lose their precision": modelled at its harshest, every
        op's subnormal results flushed to zero. The flush and the shape of silu's error are
        assumptions; the magnitudes are the sources'.

Integer and bool tensors keep their program dtype in both modes.
"""

from __future__ import annotations

import numpy as np
from coremltools.converters.mil.mil import types

from ..precision import PRECISIONS


_FIXED = {
    types.fp32: np.float32,
    types.fp64: np.float64,
    types.int32: np.int32,
    types.int64: np.int64,
    types.int16: np.int16,
    types.uint16: np.uint16,
    types.int8: np.int8,
    types.uint8: np.uint8,
    types.uint32: np.uint32,
    types.bool: np.bool_,
}


# the Neural Engine's reported deviations (ANE-numerics mode, see the module docstring)
SOFTPLUS_COLLAPSE = 10.4  # fp16 softplus gives 0 above this (coremltools issue 2687)
SILU_ERROR = 1e-3  # absolute error of silu near 0 (Anemll Forge)
SILU_ERROR_SPAN = 1.0  # |x| up to which that error is applied (an assumption: "near 0")
FP16_TINY = float(np.finfo(np.float16).tiny)  # 2^-14, the smallest normal fp16


class Numerics:
    """The storage dtype for each MIL dtype under one precision policy.

    Parameters
    ----------
    precision : {"fp16", "fp32"}
        "fp16" keeps fp16 tensors in float16 (ANE behaviour); "fp32" widens them to float32.
    ane : bool
        With "fp16": also apply the Neural Engine's reported deviations (the module docstring).
    """

    def __init__(self, precision: str = "fp16", ane: bool = False):
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        if ane and precision != "fp16":
            raise ValueError("the ANE-numerics mode computes in fp16")
        self.precision = precision
        self.ane = ane
        self.half = np.dtype(np.float16 if precision == "fp16" else np.float32)
        self.accumulate = np.dtype(np.float32)

    def storage(self, builtin) -> np.dtype:
        """numpy dtype holding a tensor of MIL element type `builtin` (types.fp16, types.int32, ...)."""
        if builtin == types.fp16:
            return self.half
        if builtin in _FIXED:
            return np.dtype(_FIXED[builtin])
        raise TypeError(f"the mil executor has no storage for MIL dtype {types.builtin_to_string(builtin)}")

    def storage_for_name(self, name: str) -> np.dtype:
        """Like `storage` for a MIL dtype string such as "fp16" or "int32" (cast's `dtype`)."""
        return self.storage(types.string_to_builtin(name))

    def widen(self, x: np.ndarray) -> np.ndarray:
        """`x` as a float32 (or wider) array to compute with; ints are left alone."""
        if x.dtype == np.float16:
            return x.astype(np.float32)
        return x
