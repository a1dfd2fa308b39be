"""Reductions and normalisations: reduce_*, softmax, layer_norm. All accumulate in float32.

reduce_* take `axes` (None: all axes) and `keep_dims`; reduce_argmax/argmin take `axis` and give
int32. softmax is max-subtracted over `axis`. layer_norm normalises over `axes` with the biased
variance, then applies optional gamma and beta, as the MIL definition states.
"""

from __future__ import annotations

import numpy as np

from .registry import BuildContext, kernel, owns_consts, static

F32 = np.float32


def _f32(x):
    return np.asarray(x, dtype=F32) if np.asarray(x).dtype != np.float64 else np.asarray(x)


def _axes(op):
    axes = static(op, "axes")
    return None if axes is None else tuple(int(a) for a in np.atleast_1d(axes))


_REDUCE = {
    "reduce_sum": lambda x, ax, k: np.sum(x, axis=ax, keepdims=k),
    "reduce_mean": lambda x, ax, k: np.mean(x, axis=ax, keepdims=k),
    "reduce_max": lambda x, ax, k: np.max(x, axis=ax, keepdims=k),
    "reduce_min": lambda x, ax, k: np.min(x, axis=ax, keepdims=k),
    "reduce_prod": lambda x, ax, k: np.prod(x, axis=ax, keepdims=k),
    "reduce_sum_square": lambda x, ax, k: np.sum(x * x, axis=ax, keepdims=k),
    "reduce_l1_norm": lambda x, ax, k: np.sum(np.abs(x), axis=ax, keepdims=k),
    "reduce_l2_norm": lambda x, ax, k: np.sqrt(np.sum(x * x, axis=ax, keepdims=k)),
    "reduce_log_sum": lambda x, ax, k: np.log(np.sum(x, axis=ax, keepdims=k)),
    "reduce_log_sum_exp": lambda x, ax, k: _logsumexp(x, ax, k),
}


def _logsumexp(x, axes, keep):
    m = np.max(x, axis=axes, keepdims=True)
    out = np.log(np.sum(np.exp(x - m), axis=axes, keepdims=True)) + m
    return out if keep else np.squeeze(out, axis=axes if axes is not None else None)


@kernel(*_REDUCE)
def reduce(op, ctx: BuildContext):
    """Reduce x over `axes` in float32 (ints: in their own dtype)."""
    fn = _REDUCE[op.op_type]
    axes = _axes(op)
    keep = bool(static(op, "keep_dims", False))

    def run(a):
        x = np.asarray(a["x"])
        if x.dtype == np.float16:
            x = x.astype(F32)
        return fn(x, axes, keep)

    return run


@kernel("reduce_argmax", "reduce_argmin")
def arg_reduce(op, ctx: BuildContext):
    """Index of the max (min) along `axis` as int32; first occurrence wins, as in numpy."""
    axis = int(static(op, "axis", -1))
    keep = bool(static(op, "keep_dims", False))
    fn = np.argmax if op.op_type == "reduce_argmax" else np.argmin

    def run(a):
        out = fn(a["x"], axis=axis).astype(np.int32)
        return np.expand_dims(out, axis) if keep else out

    return run


@kernel("softmax")
def softmax(op, ctx: BuildContext):
    """exp(x - max) / sum over `axis`, in float32."""
    axis = int(static(op, "axis", -1))

    def run(a):
        x = _f32(a["x"])
        e = np.exp(x - np.max(x, axis=axis, keepdims=True))
        return e / np.sum(e, axis=axis, keepdims=True)

    return run


@kernel("layer_norm")
def layer_norm(op, ctx: BuildContext):
    """(x - mean) / sqrt(var + eps) * gamma + beta over `axes` (biased variance), in float32."""
    axes = _axes(op)
    eps = F32(static(op, "epsilon", 1e-5))
    gamma_var, beta_var = op.inputs.get("gamma"), op.inputs.get("beta")
    gamma = None if gamma_var is None else ctx.prepared(gamma_var, "f32", _f32)
    beta = None if beta_var is None else ctx.prepared(beta_var, "f32", _f32)

    def run(a):
        x = _f32(a["x"])
        mean = np.mean(x, axis=axes, keepdims=True)
        centred = x - mean
        var = np.mean(centred * centred, axis=axes, keepdims=True)
        y = centred / np.sqrt(var + eps)
        if gamma is not None:
            y = y * gamma
        if beta is not None:
            y = y + beta
        return y

    return owns_consts(run, op, ctx, "gamma", "beta")
