"""Run coremltools' own `value_inference` of an op on runtime values.

coremltools defines, for many ops, a numpy `value_inference` used to fold constants at compile
time; it reads its operands as `self.<input>.val`. For an op without a kernel in this package,
the executor binds the runtime values to a shallow copy of the op (so the method sees them as
its inputs' values) and calls the op class's own method. Ops whose value inference declines
(returns None or raises NotImplementedError) are reported as unsupported.
"""

from __future__ import annotations

from coremltools.converters.mil.mil.operation import Operation

from .registry import BuildContext, UnsupportedOpError


class _Bound:
    """A stand-in for a pymil Var whose value is a runtime array; other attributes delegate."""

    __slots__ = ("_var", "val", "sym_val")

    def __init__(self, var, value):
        self._var = var
        self.val = value
        self.sym_val = value

    def __getattr__(self, name):
        return getattr(self._var, name)


def has_value_inference(op) -> bool:
    return type(op).value_inference is not Operation.value_inference


def value_inference_kernel(op, ctx: BuildContext):
    """A kernel calling `type(op).value_inference` on a copy of `op` bound to the runtime values."""
    cls = type(op)
    base = dict(op.__dict__)
    runtime = [name for name, var in op.inputs.items() if not ctx.is_const(var)]

    def run(a):
        bound_inputs = dict(base["_input_vars"])
        clone = object.__new__(cls)
        clone.__dict__.update(base)
        for name in runtime:
            var = op.inputs[name]
            if isinstance(var, (list, tuple)):
                value = tuple(_Bound(v, x) for v, x in zip(var, a[name]))
            else:
                value = _Bound(var, a[name])
            bound_inputs[name] = value
            clone.__dict__[name] = value
        clone.__dict__["_input_vars"] = bound_inputs
        try:
            result = cls.value_inference(clone)
        except NotImplementedError as exc:
            result, reason = None, str(exc)
        else:
            reason = "it returned no value"
        if result is None:
            raise UnsupportedOpError(
                f"coremltools' value inference of op {op.op_type!r} ({op.name}) in {ctx.where} "
                f"cannot run on these inputs ({reason}); add a kernel in llama_ane/mil/kernels/"
            )
        return result

    return run
