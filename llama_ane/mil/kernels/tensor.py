"""Data movement: reshape family, transpose, slicing, concat/split/stack, gather, fill, pad, ...

These ops move or select values without arithmetic, so they are exact in any precision. Static
shapes come from coremltools' own type inference (each loaded op carries its output shape);
slice and gather semantics reuse coremltools' helpers (`solve_slice_by_index_slice`,
`compute_gather`).
"""

from __future__ import annotations

import numpy as np
from coremltools.converters.mil.mil.ops.defs._utils import (
    compute_gather,
    get_squeeze_axes,
    solve_slice_by_index_slice,
)

from .registry import BuildContext, kernel, static


@kernel("reshape", "expand_dims", "squeeze", "flatten2d", "reshape_like")
def reshape_to_output(op, ctx: BuildContext):
    """Every op of this family yields x's elements (C order) in the inferred static output shape."""
    shape = tuple(int(d) for d in op.outputs[0].shape)
    return lambda a: np.reshape(a["x"], shape)


@kernel("transpose")
def transpose(op, ctx: BuildContext):
    perm = tuple(int(p) for p in static(op, "perm"))
    return lambda a: np.transpose(a["x"], perm)


@kernel("identity")
def identity(op, ctx: BuildContext):
    return lambda a: a["x"]


def _slice_params(op):
    rank = op.x.rank
    return dict(
        stride=static(op, "stride"),
        begin_mask=static(op, "begin_mask"),
        end_mask=static(op, "end_mask"),
        squeeze_mask=static(op, "squeeze_mask"),
        squeeze_axes=tuple(get_squeeze_axes(static(op, "squeeze_mask"), rank)),
    )


@kernel("slice_by_index")
def slice_by_index(op, ctx: BuildContext):
    """x[begin:end:stride] per axis with MIL's begin/end/squeeze masks; begin/end may be runtime."""
    p = _slice_params(op)
    shape = tuple(op.x.shape)

    def solve(begin, end):
        stride = None if p["stride"] is None else [int(s) for s in p["stride"]]
        return solve_slice_by_index_slice(
            shape, begin, end, stride, p["begin_mask"], p["end_mask"], p["squeeze_mask"]
        )

    squeeze = p["squeeze_axes"]

    def finish(x, slices):
        y = x[slices]
        return np.squeeze(y, axis=squeeze) if squeeze else y

    if ctx.is_const(op.begin) and ctx.is_const(op.end):
        slices = solve(op.begin.val, op.end.val)
        return lambda a: finish(a["x"], slices)
    return lambda a: finish(a["x"], solve(np.asarray(a["begin"]), np.asarray(a["end"])))


@kernel("slice_by_size")
def slice_by_size(op, ctx: BuildContext):
    """x[begin : begin + size] per axis (size -1: to the end); begin may be a runtime tensor."""
    shape = tuple(int(d) for d in op.x.shape)

    def slices(begin, size):
        out = []
        for dim, b, s in zip(shape, begin, size):
            b = int(b) + dim if int(b) < 0 else int(b)
            out.append(slice(b, None) if int(s) < 0 else slice(b, b + int(s)))
        return tuple(out)

    if ctx.is_const(op.begin) and ctx.is_const(op.size):
        fixed = slices(op.begin.val, op.size.val)
        return lambda a: a["x"][fixed]
    return lambda a: a["x"][slices(np.asarray(a["begin"]), np.asarray(a["size"]))]


@kernel("slice_update")
def slice_update(op, ctx: BuildContext):
    """A copy of x with x[slices] = update (slices as slice_by_index)."""
    p = _slice_params(op)
    shape = tuple(op.x.shape)

    def run(a):
        stride = None if p["stride"] is None else [int(s) for s in p["stride"]]
        slices = solve_slice_by_index_slice(
            shape, np.asarray(a["begin"]), np.asarray(a["end"]), stride,
            p["begin_mask"], p["end_mask"], p["squeeze_mask"],
        )
        out = np.array(a["x"], copy=True)
        target_shape = out[slices].shape
        out[slices] = np.reshape(a["update"], target_shape)
        return out

    return run


@kernel("read_state")
def read_state(op, ctx: BuildContext):
    """The value of a state input, copied: later writes to the state do not change it."""
    return lambda a: np.array(a["input"], copy=True)


@kernel("coreml_update_state")
def coreml_update_state(op, ctx: BuildContext):
    """Write `value` into the state (the caller's array, in place) and return it (the loaded form of
    write_state)."""
    def run(a):
        np.copyto(a["state"], a["value"], casting="same_kind")
        return a["value"]

    return run


@kernel("concat")
def concat(op, ctx: BuildContext):
    """Concatenate `values` along `axis`; interleave=True alternates slices of equal inputs."""
    axis = int(static(op, "axis"))
    interleave = bool(static(op, "interleave", False))
    out_shape = tuple(int(d) for d in op.outputs[0].shape)
    if interleave:
        ax = axis % len(out_shape)
        return lambda a: np.stack(a["values"], axis=ax + 1).reshape(out_shape)
    return lambda a: np.concatenate(a["values"], axis=axis)


@kernel("stack")
def stack(op, ctx: BuildContext):
    axis = int(static(op, "axis"))
    return lambda a: np.stack(a["values"], axis=axis)


@kernel("split")
def split(op, ctx: BuildContext):
    """Split x along `axis` into the output sizes coremltools inferred (num_splits or split_sizes)."""
    axis = int(static(op, "axis"))
    sizes = [int(o.shape[axis]) for o in op.outputs]
    cuts = list(np.cumsum(sizes)[:-1])
    return lambda a: tuple(np.split(a["x"], cuts, axis=axis))


@kernel("tile")
def tile(op, ctx: BuildContext):
    reps = tuple(int(r) for r in static(op, "reps"))
    return lambda a: np.tile(a["x"], reps)


@kernel("reverse")
def reverse(op, ctx: BuildContext):
    axes = static(op, "axes")
    axes = tuple(range(op.x.rank)) if axes is None else tuple(int(x) for x in axes)
    return lambda a: np.flip(a["x"], axis=axes)


@kernel("gather")
def gather(op, ctx: BuildContext):
    """x taken at `indices` along `axis` (negative indices count from the end), with batch_dims."""
    axis = int(static(op, "axis", 0))
    batch_dims = int(static(op, "batch_dims", 0))
    return lambda a: compute_gather(a["x"], np.asarray(a["indices"]).astype(np.int64), axis, batch_dims)


@kernel("gather_along_axis")
def gather_along_axis(op, ctx: BuildContext):
    axis = int(static(op, "axis", 0))
    return lambda a: np.take_along_axis(a["x"], np.asarray(a["indices"]).astype(np.int64), axis=axis)


@kernel("fill")
def fill(op, ctx: BuildContext):
    shape = tuple(int(d) for d in op.outputs[0].shape)
    return lambda a: np.full(shape, a["value"])


@kernel("fill_like")
def fill_like(op, ctx: BuildContext):
    shape = tuple(int(d) for d in op.outputs[0].shape)
    return lambda a: np.full(shape, a["value"])


@kernel("range_1d")
def range_1d(op, ctx: BuildContext):
    return lambda a: np.arange(a["start"], a["end"], a["step"])


@kernel("pad")
def pad(op, ctx: BuildContext):
    """Pad the last len(pad)/2 axes: mode constant (constant_val), reflect or replicate."""
    mode = str(static(op, "mode", "constant"))
    rank = op.x.rank
    np_mode = {"constant": "constant", "reflect": "reflect", "replicate": "edge"}[mode]

    def run(a):
        p = [int(v) for v in np.asarray(a["pad"]).reshape(-1)]
        widths = [(0, 0)] * (rank - len(p) // 2) + [(p[2 * i], p[2 * i + 1]) for i in range(len(p) // 2)]
        if np_mode == "constant":
            return np.pad(a["x"], widths, mode="constant", constant_values=a.get("constant_val", 0))
        return np.pad(a["x"], widths, mode=np_mode)

    return run


@kernel("band_part")
def band_part(op, ctx: BuildContext):
    """Keep x[..., i, j] where (lower < 0 or i - j <= lower) and (upper < 0 or j - i <= upper)."""
    lower = int(static(op, "lower", -1))
    upper = int(static(op, "upper", -1))
    rows, cols = int(op.x.shape[-2]), int(op.x.shape[-1])
    i = np.arange(rows)[:, None]
    j = np.arange(cols)[None, :]
    keep = np.ones((rows, cols), dtype=bool)
    if lower >= 0:
        keep &= i - j <= lower
    if upper >= 0:
        keep &= j - i <= upper
    return lambda a: np.where(keep, a["x"], np.zeros((), dtype=np.asarray(a["x"]).dtype))


@kernel("cumsum")
def cumsum(op, ctx: BuildContext):
    """Cumulative sum along `axis` (float32 accumulation), optionally exclusive and/or reversed."""
    axis = int(static(op, "axis", 0))
    exclusive = bool(static(op, "exclusive", False))
    reverse_ = bool(static(op, "reverse", False))

    def run(a):
        x = np.asarray(a["x"])
        x = x.astype(np.float32) if x.dtype == np.float16 else x
        if reverse_:
            x = np.flip(x, axis)
        y = np.cumsum(x, axis=axis)
        if exclusive:
            y = y - x
        return np.flip(y, axis) if reverse_ else y

    return run


@kernel("shape")
def shape(op, ctx: BuildContext):
    return lambda a: np.asarray(np.shape(a["x"]), dtype=np.int32)
