"""Contractions: conv, matmul, linear, einsum. Operands are widened to float32 and the products
accumulated in float32 (BLAS); the executor then rounds the result to the output's storage dtype.

Const weights are held as float32 copies, or, when the build context says not to widen them
(`BuildContext.widen_weights`), in their storage dtype and widened a block of rows at a time in
each call: one copy of an fp16 package's weights instead of a float32 one, the same products
(summed by BLAS block by block, so float32 rounding may differ).

Layouts follow the MIL op definitions: conv x (N, C_in, *spatial), weight
(C_out, C_in / groups, *kernel), bias (C_out,); matmul/linear as numpy matmul with MIL's
transpose flags; einsum as `numpy.einsum` with size-1 batch dimensions broadcast.
"""

from __future__ import annotations

import numpy as np
from coremltools.converters.mil.mil.ops.defs._utils import aggregated_pad

from .registry import BuildContext, kernel, owns_consts, static

F32 = np.float32


def _f32(x):
    return np.asarray(x, dtype=F32)


_MAX_LOOPED_BATCH = 256


def batched_matmul(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """numpy matmul semantics (broadcast batch dims), computed as one BLAS gemm per batch element.

    numpy's own batched matmul takes a slow non-BLAS path for many broadcast or thin shapes
    (a (1, C, 1) activation against a (C_out, C) weight is ~80x slower than the 2-D product),
    which dominates a decode step; looping 2-D products over the batch avoids it.
    """
    if x.ndim < 2 or y.ndim < 2 or (x.ndim == 2 and y.ndim == 2):
        return np.matmul(x, y)
    batch = np.broadcast_shapes(x.shape[:-2], y.shape[:-2])
    count = int(np.prod(batch))
    if count > _MAX_LOOPED_BATCH:
        return np.matmul(x, y)
    xb = np.broadcast_to(x, batch + x.shape[-2:])
    yb = np.broadcast_to(y, batch + y.shape[-2:])
    out = np.empty(batch + (x.shape[-2], y.shape[-1]), dtype=np.result_type(x, y))
    for index in np.ndindex(*batch):
        np.matmul(xb[index], yb[index], out=out[index])
    return out


_WIDEN_BLOCK = 1 << 22  # weight elements widened to float32 at a time (16 MB)


def weight_matmul(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """w (M, K) @ x (..., K, P) -> float32 (..., M, P); a w stored narrower than float32 is widened
    _WIDEN_BLOCK elements' worth of rows at a time."""
    if w.dtype == F32:
        return batched_matmul(w, x)
    rows = max(1, _WIDEN_BLOCK // max(1, w.shape[1]))
    out = np.empty(x.shape[:-2] + (w.shape[0], x.shape[-1]), F32)
    for r in range(0, w.shape[0], rows):
        out[..., r:r + rows, :] = batched_matmul(w[r:r + rows].astype(F32), x)
    return out


def const_weight(var, ctx: BuildContext, tag: str, shape: tuple[int, ...]):
    """The const `var` reshaped to `shape`: float32, or in its storage dtype when weights are not widened."""
    if ctx.widen_weights:
        return ctx.prepared(var, f"f32_{tag}", lambda w: _f32(w).reshape(shape))
    return ctx.prepared(var, f"stored_{tag}", lambda w: np.asarray(w).reshape(shape), as_stored=True)


@kernel("conv")
def conv(op, ctx: BuildContext):
    """(N, C_in, *S) x (C_out, C_in/g, *K) -> (N, C_out, *S_out); a 1x1 stride-1 conv is one matmul."""
    x_shape = tuple(op.x.shape)
    w_shape = tuple(op.weight.shape)
    spatial = len(x_shape) - 2
    strides = tuple(int(s) for s in static(op, "strides", [1] * spatial))
    dilations = tuple(int(d) for d in static(op, "dilations", [1] * spatial))
    groups = int(static(op, "groups", 1))
    pad_type = str(static(op, "pad_type", "valid"))
    custom = static(op, "pad", [0] * 2 * spatial)
    kernel_shape = w_shape[2:]
    totals = aggregated_pad(
        pad_type, kernel_shape, input_shape=x_shape[2:], strides=strides, dilations=dilations,
        custom_pad=list(custom),
    )
    if pad_type == "custom":
        pads = [(int(custom[2 * i]), int(custom[2 * i + 1])) for i in range(spatial)]
    elif pad_type == "same_lower":
        pads = [(t - t // 2, t // 2) for t in totals]
    else:  # "same" puts the odd element after; "valid" is all zeros
        pads = [(t // 2, t - t // 2) for t in totals]
    out_shape = tuple(op.outputs[0].shape)
    c_out = w_shape[0]
    pointwise = (
        groups == 1 and all(k == 1 for k in kernel_shape) and all(s == 1 for s in strides)
        and all(p == (0, 0) for p in pads)
    )

    weight_is_const = ctx.is_const(op.weight)
    bias_var = op.inputs.get("bias")
    has_bias = bias_var is not None  # the kernels keep no pymil Var: it would keep the whole program alive
    bias = None
    if has_bias:
        bias = ctx.prepared(bias_var, "f32", _f32) if ctx.is_const(bias_var) else None

    if pointwise:
        w2 = const_weight(op.weight, ctx, "2d", (c_out, -1)) if weight_is_const else None
        bias_col = None if bias is None else bias.reshape(c_out, 1)

        def run(a):
            w = w2 if w2 is not None else _f32(a["weight"]).reshape(c_out, -1)
            x = _f32(a["x"]).reshape(x_shape[0], x_shape[1], -1)
            y = weight_matmul(w, x)
            if has_bias:
                y += bias_col if bias_col is not None else _f32(a["bias"]).reshape(c_out, 1)
            return y.reshape(out_shape)

        return owns_consts(run, op, ctx, "weight", "bias")

    cin_g = w_shape[1]
    cout_g = c_out // groups
    wg = (
        ctx.prepared(op.weight, "f32_groups", lambda w: _f32(w).reshape(groups, cout_g, -1))
        if weight_is_const else None
    )

    def run_general(a):
        x = _f32(a["x"])
        if any(p != (0, 0) for p in pads):
            x = np.pad(x, [(0, 0), (0, 0)] + pads)
        eff = [(k - 1) * d + 1 for k, d in zip(kernel_shape, dilations)]
        # windows: (N, C_in, *S_out_full, *eff) -> take dilation and stride steps
        win = np.lib.stride_tricks.sliding_window_view(x, eff, axis=tuple(range(2, 2 + spatial)))
        index = (slice(None), slice(None)) + tuple(slice(None, None, s) for s in strides) + tuple(
            slice(None, None, d) for d in dilations
        )
        win = win[index]  # (N, C_in, *S_out, *K)
        n = x.shape[0]
        s_out = win.shape[2 : 2 + spatial]
        # -> (N, groups, C_in/g, *S_out, *K) -> (N, groups, S_out..., C_in/g * K)
        win = win.reshape((n, groups, cin_g) + s_out + tuple(kernel_shape))
        perm = (0, 1) + tuple(range(3, 3 + spatial)) + (2,) + tuple(range(3 + spatial, 3 + 2 * spatial))
        cols = win.transpose(perm).reshape((n, groups, int(np.prod(s_out)), -1))
        w = wg if wg is not None else _f32(a["weight"]).reshape(groups, cout_g, -1)
        y = np.einsum("ngpk,gok->ngop", cols, w, optimize=True)  # (N, g, C_out/g, P)
        y = y.reshape((n, c_out) + s_out)
        if has_bias:
            b = bias if bias is not None else _f32(a["bias"])
            y += b.reshape((1, c_out) + (1,) * spatial)
        return y

    return owns_consts(run_general, op, ctx, "weight", "bias")


@kernel("matmul")
def matmul(op, ctx: BuildContext):
    """numpy matmul (batch-broadcast) of x and y after MIL's optional transposes of the last two axes."""
    tx = bool(static(op, "transpose_x", False))
    ty = bool(static(op, "transpose_y", False))

    def side(var, flag, name):
        if ctx.is_const(var):
            value = ctx.prepared(var, f"f32_t{int(flag)}", lambda v: np.ascontiguousarray(
                np.swapaxes(_f32(v), -1, -2) if flag and np.ndim(v) > 1 else _f32(v)))
            return lambda a: value
        if flag:
            return lambda a: np.swapaxes(_f32(a[name]), -1, -2) if np.ndim(a[name]) > 1 else _f32(a[name])
        return lambda a: _f32(a[name])

    get_x = side(op.x, tx, "x")
    get_y = side(op.y, ty, "y")
    def run(a):
        return batched_matmul(get_x(a), get_y(a))

    return owns_consts(run, op, ctx, "x", "y")


@kernel("linear")
def linear(op, ctx: BuildContext):
    """x (..., D_in) @ weight (D_out, D_in)^T + bias (D_out,)."""
    w = const_weight(op.weight, ctx, "2d", tuple(op.weight.shape)) if ctx.is_const(op.weight) else None
    has_bias = op.inputs.get("bias") is not None

    def run(a):
        x, weight = _f32(a["x"]), w if w is not None else _f32(a["weight"])
        if weight.dtype == F32:
            y = batched_matmul(x, weight.T)
        else:  # widened a block of output features at a time
            rows = max(1, _WIDEN_BLOCK // max(1, weight.shape[1]))
            y = np.empty(x.shape[:-1] + (weight.shape[0],), F32)
            for r in range(0, weight.shape[0], rows):
                y[..., r:r + rows] = batched_matmul(x, weight[r:r + rows].astype(F32).T)
        if has_bias:
            y += _f32(a["bias"])
        return y

    return owns_consts(run, op, ctx, "weight")


@kernel("einsum")
def einsum(op, ctx: BuildContext):
    """numpy einsum in float32; size-1 dims of a label are broadcast to the other operand's size."""
    equation = str(static(op, "equation"))
    lhs = equation.split("->")[0].split(",")
    shapes = [tuple(v.shape) for v in op.values]
    sizes: dict[str, int] = {}
    for labels, shape in zip(lhs, shapes):
        for label, dim in zip(labels, shape):
            sizes[label] = max(sizes.get(label, 1), int(dim))
    targets = [tuple(sizes[label] for label in labels) for labels in lhs]

    def run(a):
        operands = [
            np.broadcast_to(_f32(v), t) if v.shape != t else _f32(v) for v, t in zip(a["values"], targets)
        ]
        return np.einsum(equation, *operands, optimize=len(operands) > 2)

    return run
