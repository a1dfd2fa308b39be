"""The kernel registry: MIL op type -> a factory that turns one pymil op into a numpy callable.

A factory runs once per op when a function is compiled. It reads the op's static parameters
(`op.axes.val`, ...) and prepares its const operands (a conv weight as a float32 matrix, ...),
then returns a kernel: a callable taking `args`, a dict of every input name of the op to its
value (runtime values filled in per call, consts filled in once), and returning the op's
output array, or a tuple of arrays for ops with several outputs. The executor rounds each
output to the storage dtype of its var, which is where fp16 mode rounds (see `numerics`).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ..numerics import Numerics

Kernel = Callable[[dict[str, Any]], Any]
Factory = Callable[[Any, "BuildContext"], Kernel]

KERNELS: dict[str, Factory] = {}


def kernel(*op_types: str):
    """Register the decorated factory for each of `op_types`."""

    def register(factory: Factory) -> Factory:
        for op_type in op_types:
            KERNELS[op_type] = factory
        return factory

    return register


class UnsupportedOpError(NotImplementedError):
    """An op of the program has no kernel here; the message names the op and the package."""


class BuildContext:
    """What a factory may use while compiling one op.

    Attributes
    ----------
    numerics : Numerics
        The precision policy (storage dtypes, accumulation dtype).
    where : str
        "function F of package P", for error messages.
    widen_weights : bool
        True: contraction kernels keep float32 copies of their const weights (fastest, twice the
        memory of an fp16 package). False: weights stay in their storage dtype and are widened a
        block at a time in each call (one copy of the package's weights; the same products, summed
        block by block).
    """

    def __init__(self, numerics: Numerics, where: str, locations: dict[str, tuple[str, int]], cache: dict,
                 widen_weights: bool = True):
        self.numerics = numerics
        self.where = where
        self.widen_weights = widen_weights
        self._locations = locations
        self._cache = cache  # shared by all functions of a package: weights live here once
        self._decompressed: dict[int, tuple] = {}  # id(var) -> cache key of a constexpr op's output

    def _key(self, var, tag: str):
        if id(var) in self._decompressed:
            return self._decompressed[id(var)] + (tag,)
        location = self._locations.get(var.name)
        if location is not None and var.op is not None and var.op.op_type == "const":
            return ("blob", location, tag, self.numerics.precision)
        return ("var", id(var), tag)

    def decompress(self, op, source: tuple | None) -> None:
        """Make the outputs of constexpr `op` (a compressed weight) known consts, decompressed once
        per package: `source`, the blob entries it reads (`MilPackage.constexpr_sources`), is the
        same in every function that uses the weight, which then shares the dense array (and any
        float32 copy of it). Without a source, the value is this function's own."""
        base = ("constexpr", source if source is not None else id(op), self.numerics.precision)
        if base + (0, "raw") not in self._cache:
            value = op.materialized_val_inference()
            values = value if isinstance(value, tuple) else (value,)
            for i, v in enumerate(values):
                self._cache[base + (i, "raw")] = np.asarray(v)  # in the op's output dtype
        for i, out in enumerate(op.outputs):
            self._decompressed[id(out)] = base + (i,)

    def is_const(self, var) -> bool:
        """True if the value of `var` is known when compiling (a const, a decompressed weight, or
        folded by coremltools)."""
        if var is None or isinstance(var, (list, tuple)):
            return False
        return id(var) in self._decompressed or var.val is not None

    def const(self, var) -> Any:
        """The value of const `var` in its storage dtype (cached; shared across functions by blob)."""
        return self.prepared(var, "storage", lambda v: v)

    def prepared(self, var, tag: str, prepare: Callable[[Any], Any], as_stored: bool = False) -> Any:
        """`prepare(value of var)` computed once per weight and cached under `tag`. The value is in
        its storage dtype under the precision policy, or with `as_stored` in the dtype the package
        holds it in (fp16 weights stay fp16 even in fp32 mode, to be widened where used)."""
        key = self._key(var, tag)
        if key not in self._cache:
            value = self._cache[self._key(var, "raw")] if id(var) in self._decompressed else var.val
            if not as_stored and (isinstance(value, np.ndarray) or (np.isscalar(value) and not isinstance(value, str))):
                value = np.asarray(value, dtype=self.numerics.storage(var.dtype))
            self._cache[key] = prepare(value)
        return self._cache[key]

    def storage(self, var) -> np.dtype:
        """numpy dtype in which `var` is stored under this precision policy."""
        return self.numerics.storage(var.dtype)


def owns_consts(kernel: Kernel, op, ctx: "BuildContext", *params: str) -> Kernel:
    """Mark `params` of `op` whose const values `kernel` prepared itself (e.g. a float32 weight
    matrix): the executor then leaves them out of `args`, so no second copy of them is held."""
    kernel.owned_params = frozenset(p for p in params if ctx.is_const(op.inputs.get(p)))
    return kernel


def static(op, name: str, default: Any = None) -> Any:
    """The compile-time value of parameter `name` of `op` (python/numpy), or `default` if absent.

    Raises `UnsupportedOpError` if the parameter is bound to a runtime tensor: the kernels here
    require static attributes for these parameters, as Core ML's own op definitions do.
    """
    var = op.inputs.get(name)
    if var is None:
        return default
    if var.val is None:
        raise UnsupportedOpError(
            f"op {op.op_type!r} ({op.name}) has a runtime value for parameter {name!r}; "
            "the mil executor needs it constant"
        )
    return var.val
