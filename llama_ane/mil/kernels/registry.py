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
    """

    def __init__(self, numerics: Numerics, where: str, locations: dict[str, tuple[str, int]], cache: dict):
        self.numerics = numerics
        self.where = where
        self._locations = locations
        self._cache = cache  # shared by all functions of a package: weights live here once

    def _key(self, var, tag: str):
        location = self._locations.get(var.name)
        if location is not None and var.op is not None and var.op.op_type == "const":
            return ("blob", location, tag, self.numerics.precision)
        return ("var", id(var), tag)

    def is_const(self, var) -> bool:
        """True if the value of `var` is known when compiling (a const, or folded by coremltools)."""
        return var is not None and not isinstance(var, (list, tuple)) and var.val is not None

    def const(self, var) -> Any:
        """The value of const `var` in its storage dtype (cached; shared across functions by blob)."""
        return self.prepared(var, "storage", lambda v: v)

    def prepared(self, var, tag: str, prepare: Callable[[Any], Any]) -> Any:
        """`prepare(value of var)` computed once per weight and cached under `tag`."""
        key = self._key(var, tag)
        if key not in self._cache:
            value = var.val
            if isinstance(value, np.ndarray) or (np.isscalar(value) and not isinstance(value, str)):
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
