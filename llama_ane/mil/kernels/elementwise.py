"""Elementwise ops: binary arithmetic and comparisons, unary math, activations, cast and select.

Float operands are widened to float32 and the result is rounded once to the output's storage
dtype by the executor, so in fp16 mode each op is a correctly rounded fp16 op. Integer and bool
operands stay in their own dtype. Semantics (epsilons, defaults, broadcasting) follow the MIL op
definitions in coremltools; defaults come from the loaded ops themselves.
"""

from __future__ import annotations

import numpy as np

from ..numerics import SILU_ERROR, SILU_ERROR_SPAN, SOFTPLUS_COLLAPSE
from .registry import BuildContext, kernel, static

F32 = np.float32

_BINARY = {
    "add": np.add,
    "sub": np.subtract,
    "mul": np.multiply,
    "real_div": np.true_divide,
    "floor_div": np.floor_divide,
    "mod": np.mod,
    "pow": np.power,
    "maximum": np.maximum,
    "minimum": np.minimum,
    "equal": np.equal,
    "not_equal": np.not_equal,
    "less": np.less,
    "less_equal": np.less_equal,
    "greater": np.greater,
    "greater_equal": np.greater_equal,
    "logical_and": np.logical_and,
    "logical_or": np.logical_or,
    "logical_xor": np.logical_xor,
}


def _widen(x):
    x = np.asarray(x)
    return x.astype(F32) if x.dtype == np.float16 else x


@kernel(*_BINARY)
def binary(op, ctx: BuildContext):
    """x (*) y with numpy broadcasting; (*) is the op named by op_type.

    Operands are passed to numpy as stored: numpy's float16 loops convert each element to
    float32, compute and round once, which is exactly the correctly rounded fp16 op, and avoid
    widening whole tensors (a large win on (layers, channels, 1, context) cache updates).
    """
    fn = _BINARY[op.op_type]
    return lambda a: fn(a["x"], a["y"])


def _sigmoid(x):
    return 0.5 * (np.tanh(0.5 * x) + 1.0)  # overflow-free form of 1 / (1 + exp(-x))


_UNARY = {
    "abs": np.abs,
    "acos": np.arccos,
    "asin": np.arcsin,
    "atan": np.arctan,
    "atanh": np.arctanh,
    "ceil": np.ceil,
    "cos": np.cos,
    "cosh": np.cosh,
    "exp": np.exp,
    "exp2": np.exp2,
    "floor": np.floor,
    "logical_not": np.logical_not,
    "round": np.round,
    "sign": np.sign,
    "sin": np.sin,
    "sinh": np.sinh,
    "sqrt": np.sqrt,
    "square": np.square,
    "tan": np.tan,
    "tanh": np.tanh,
    "relu": lambda x: np.maximum(x, 0),
    "sigmoid": _sigmoid,
    "silu": lambda x: x * _sigmoid(x),
    "softsign": lambda x: x / (1 + np.abs(x)),
    "softplus": lambda x: np.logaddexp(0, x),
}


def _ane_softplus(x):
    """softplus as the Neural Engine is reported to compute it in fp16: 0 above SOFTPLUS_COLLAPSE."""
    return np.where(x > SOFTPLUS_COLLAPSE, F32(0), np.logaddexp(0, x))


def _ane_silu(x):
    """silu with the Neural Engine's reported error near 0 (SILU_ERROR on |x| <= SILU_ERROR_SPAN)."""
    return x * _sigmoid(x) + np.where(np.abs(x) <= SILU_ERROR_SPAN, F32(SILU_ERROR), F32(0))


_ANE_UNARY = {"softplus": _ane_softplus, "silu": _ane_silu}


@kernel(*_UNARY)
def unary(op, ctx: BuildContext):
    """f(x) elementwise in float32 (ints and bools stay as they are); in the ANE-numerics mode,
    softplus and silu as the Neural Engine is reported to compute them."""
    fn = _ANE_UNARY.get(op.op_type, _UNARY[op.op_type]) if ctx.numerics.ane else _UNARY[op.op_type]
    return lambda a: fn(_widen(a["x"]))


@kernel("rsqrt", "inverse", "log")
def unary_with_epsilon(op, ctx: BuildContext):
    """rsqrt: 1/sqrt(x + eps); inverse: 1/(x + eps); log: log(x + eps); eps from the op."""
    eps = F32(static(op, "epsilon"))
    if op.op_type == "rsqrt":
        return lambda a: 1.0 / np.sqrt(_widen(a["x"]) + eps)
    if op.op_type == "inverse":
        return lambda a: 1.0 / (_widen(a["x"]) + eps)
    return lambda a: np.log(_widen(a["x"]) + eps)


@kernel("clip", "threshold", "relu6", "leaky_relu", "elu", "thresholded_relu", "linear_activation",
        "sigmoid_hard", "scaled_tanh", "clamped_relu")
def parameterised(op, ctx: BuildContext):
    """Unary ops with scalar parameters alpha/beta (MIL definitions)."""
    alpha = static(op, "alpha")
    beta = static(op, "beta")
    alpha = None if alpha is None else F32(alpha)
    beta = None if beta is None else F32(beta)
    t = op.op_type
    if t == "clip":
        return lambda a: np.minimum(np.maximum(_widen(a["x"]), alpha), beta)
    if t == "threshold":
        return lambda a: np.maximum(_widen(a["x"]), alpha)
    if t == "relu6":
        return lambda a: np.minimum(np.maximum(_widen(a["x"]), 0), 6)
    if t == "leaky_relu":
        return lambda a: (lambda x: np.where(x >= 0, x, alpha * x))(_widen(a["x"]))
    if t == "elu":
        return lambda a: (lambda x: np.where(x > 0, x, alpha * np.expm1(np.minimum(x, 0))))(_widen(a["x"]))
    if t == "thresholded_relu":
        return lambda a: (lambda x: np.where(x > alpha, x, 0))(_widen(a["x"]))
    if t == "linear_activation":
        return lambda a: alpha * _widen(a["x"]) + beta
    if t == "sigmoid_hard":
        return lambda a: np.minimum(np.maximum(alpha * _widen(a["x"]) + beta, 0), 1)
    if t == "scaled_tanh":
        return lambda a: alpha * np.tanh(beta * _widen(a["x"]))
    # clamped_relu
    return lambda a: (lambda x: np.minimum(np.where(x >= 0, x, alpha * x), beta))(_widen(a["x"]))


@kernel("gelu")
def gelu(op, ctx: BuildContext):
    """gelu in the op's mode: TANH_APPROXIMATION, SIGMOID_APPROXIMATION or EXACT (erf)."""
    mode = str(static(op, "mode", "EXACT"))
    if mode == "TANH_APPROXIMATION":
        c = F32(np.sqrt(2 / np.pi))
        return lambda a: (lambda x: 0.5 * x * (1 + np.tanh(c * (x + F32(0.044715) * x ** 3))))(_widen(a["x"]))
    if mode == "SIGMOID_APPROXIMATION":
        return lambda a: (lambda x: x * _sigmoid(F32(1.702) * x))(_widen(a["x"]))
    import math

    erf = np.vectorize(math.erf, otypes=[np.float64])
    return lambda a: (lambda x: 0.5 * x * (1 + erf(x / np.sqrt(2)).astype(F32)))(_widen(a["x"]))


@kernel("cast")
def cast(op, ctx: BuildContext):
    """astype to the op's `dtype`; in fp32 mode a cast to fp16 stores float32 (no rounding)."""
    target = ctx.numerics.storage_for_name(str(static(op, "dtype")))
    return lambda a: np.asarray(a["x"]).astype(target)


@kernel("select")
def select(op, ctx: BuildContext):
    """where(cond, a, b) with numpy broadcasting."""
    return lambda a: np.where(a["cond"], a["a"], a["b"])
