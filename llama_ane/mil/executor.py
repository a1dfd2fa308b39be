"""Execute the MIL program of a saved `.mlpackage` op by op with numpy.

`PackageExecutor(path, precision)` loads the package's program with coremltools one function at
a time, compiles each function into a flat list of steps (one numpy kernel per op, static
parameters resolved and const operands prepared once), keeps a single copy of each weight for all
functions of a multifunction package, and drops each function's coremltools program before the
next one loads. `run(function, inputs)` feeds numpy arrays with the function's declared shapes
and returns its outputs by name.

Precision: see `llama_ane.mil.numerics` (fp16 storage between ops with float32 accumulation,
or fp32 throughout).
"""

from __future__ import annotations

import contextlib
import gc
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping

import numpy as np
from coremltools.converters.mil.mil import types

from . import kernels  # noqa: F401  (registers the kernels)
from .kernels.registry import KERNELS, BuildContext, UnsupportedOpError
from .kernels.value_inference import has_value_inference, value_inference_kernel
from .numerics import FP16_TINY, Numerics
from .package import MilPackage, PackageError, _quiet

_CONTROL_FLOW = {"cond", "while_loop"}


class ExecutionError(RuntimeError):
    """A kernel failed or produced the wrong shape; the message names op, function and package."""


@dataclass
class _Step:
    op_type: str
    op_name: str
    kernel: Any
    template: dict[str, Any]
    single: list[tuple[str, int]]
    multi: list[tuple[str, list[tuple[bool, Any]]]]
    out_slots: list[int]
    out_dtypes: list[np.dtype]
    out_shapes: list[tuple[int, ...] | None]


@dataclass
class _Input:
    name: str
    slot: int
    dtype: np.dtype
    shape: tuple[int, ...] | None
    is_state: bool = False  # an iOS18 state: the caller's array, updated in place


@dataclass
class CompiledFunction:
    """One function, ready to run: its inputs, ordered steps and output slots."""

    name: str
    where: str
    inputs: list[_Input]
    steps: list[_Step]
    outputs: list[tuple[str, int | None, Any]]  # (name, slot, const value if the output is const)
    n_slots: int
    op_types: dict[str, int] = field(default_factory=dict)
    flush_subnormals: bool = False  # the ANE-numerics mode: fp16 results below 2^-14 become 0

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run on `feeds` (input name -> array of the declared shape); returns outputs by name.

        Float outputs come back in the storage dtype (float16 in fp16 mode, float32 in fp32 mode).
        A state input must be a writable array of its storage dtype: the function reads it and
        writes it in place (`coreml_update_state`), as Core ML updates an MLState.
        """
        values: list[Any] = [None] * self.n_slots
        missing = [i.name for i in self.inputs if i.name not in feeds]
        if missing:
            raise ExecutionError(
                f"{self.where}: missing inputs {missing}; it takes {[i.name for i in self.inputs]}"
            )
        for spec in self.inputs:
            value = np.asarray(feeds[spec.name])
            if spec.shape is not None and value.shape != spec.shape:
                raise ExecutionError(
                    f"{self.where}: input {spec.name!r} has shape {value.shape}, expected {spec.shape}"
                )
            if spec.is_state and (value is not feeds[spec.name] or value.dtype != spec.dtype
                                  or not value.flags.writeable):
                raise ExecutionError(f"{self.where}: state {spec.name!r} must be a writable {spec.dtype} "
                                     f"numpy array (it is updated in place), got {type(feeds[spec.name]).__name__} "
                                     f"of {value.dtype}")
            values[spec.slot] = value.astype(spec.dtype, copy=False)
        for step in self.steps:
            args = dict(step.template)
            for name, slot in step.single:
                args[name] = values[slot]
            for name, items in step.multi:
                args[name] = tuple(values[p] if is_slot else p for is_slot, p in items)
            try:
                result = step.kernel(args)
            except UnsupportedOpError:
                raise
            except Exception as exc:
                raise ExecutionError(
                    f"op {step.op_type!r} ({step.op_name}) in {self.where} failed: {type(exc).__name__}: {exc}"
                ) from exc
            if len(step.out_slots) == 1:
                result = (result,)
            for slot, dtype, shape, r in zip(step.out_slots, step.out_dtypes, step.out_shapes, result):
                arr = np.asarray(r)
                if arr.dtype != dtype:
                    arr = arr.astype(dtype)
                if self.flush_subnormals and arr.dtype == np.float16:
                    arr = np.where(np.abs(arr) < FP16_TINY, np.float16(0), arr)
                if shape is not None and arr.shape != shape:
                    raise ExecutionError(
                        f"op {step.op_type!r} ({step.op_name}) in {self.where} produced shape "
                        f"{arr.shape}, but coremltools' type inference says {shape}"
                    )
                values[slot] = arr
        return {name: (values[slot] if slot is not None else const) for name, slot, const in self.outputs}


def _static_shape(var) -> tuple[int, ...] | None:
    try:
        return tuple(int(d) for d in var.shape)
    except TypeError:  # symbolic dimension
        return None


def _compile_function(program_fn, name: str, package_name: str, numerics: Numerics,
                      locations: dict, cache: dict, widen_weights: bool = True,
                      constexprs: dict | None = None) -> CompiledFunction:
    where = f"function {name!r} of package {package_name!r}"
    ctx = BuildContext(numerics, where, locations, cache, widen_weights)
    slots: dict[int, int] = {}  # id(var) -> slot

    def slot_of(var) -> int:
        key = id(var)
        if key not in slots:
            slots[key] = len(slots)
        return slots[key]

    inputs = []
    for in_name, var in program_fn.inputs.items():
        if types.is_state(var.sym_type):  # a state<tensor>: described by the tensor it wraps
            tensor = var.sym_type.wrapped_type()
            inputs.append(_Input(in_name, slot_of(var), numerics.storage(tensor.get_primitive()),
                                 tuple(int(d) for d in tensor.get_shape()), is_state=True))
        else:
            inputs.append(_Input(in_name, slot_of(var), numerics.storage(var.dtype), _static_shape(var)))
    steps: list[_Step] = []
    op_types: dict[str, int] = {}
    for op in program_fn.operations:
        op_types[op.op_type] = op_types.get(op.op_type, 0) + 1
        if op.op_type == "const":
            continue
        if op.op_type.startswith("constexpr_"):
            if not all(child.op_type.startswith("constexpr_") for out in op.outputs for child in out.child_ops):
                ctx.decompress(op, (constexprs or {}).get(op.outputs[0].name))
            continue  # an op that only feeds constexprs (a scaled LUT's values) is decompressed by them
        if all(ctx.is_const(o) for o in op.outputs):
            continue  # folded at load time by coremltools' value inference
        if op.op_type in _CONTROL_FLOW or op.blocks:
            raise UnsupportedOpError(
                f"the mil backend does not run control flow: op {op.op_type!r} ({op.name}) in {where}; "
                "exports must not contain cond/while_loop"
            )
        factory = KERNELS.get(op.op_type)
        if factory is None and has_value_inference(op):
            factory = value_inference_kernel
        if factory is None:
            raise UnsupportedOpError(
                f"the mil backend has no kernel for op {op.op_type!r} ({op.name}) in {where}, and "
                "coremltools defines no value inference for it; add one in llama_ane/mil/kernels/"
            )
        try:
            kernel = factory(op, ctx)
        except UnsupportedOpError as exc:
            raise UnsupportedOpError(f"{exc} (in {where})") from exc
        template: dict[str, Any] = {}
        single: list[tuple[str, int]] = []
        multi: list[tuple[str, list[tuple[bool, Any]]]] = []
        owned = getattr(kernel, "owned_params", frozenset())
        for param, var in op.inputs.items():
            if param in owned:
                continue  # the kernel holds its own prepared copy
            if isinstance(var, (list, tuple)):
                multi.append((param, [(False, ctx.const(v)) if ctx.is_const(v) else (True, slot_of(v)) for v in var]))
            elif ctx.is_const(var):
                template[param] = ctx.const(var)
            else:
                single.append((param, slot_of(var)))
        if all(not any(s for s, _ in items) for _, items in multi):
            for param, items in multi:
                template[param] = tuple(p for _, p in items)
            multi = []
        steps.append(_Step(
            op_type=op.op_type,
            op_name=op.name,
            kernel=kernel,
            template=template,
            single=single,
            multi=multi,
            out_slots=[slot_of(o) for o in op.outputs],
            out_dtypes=[numerics.storage(o.dtype) for o in op.outputs],
            out_shapes=[_static_shape(o) for o in op.outputs],
        ))
    outputs = []
    for var in program_fn.outputs:
        if ctx.is_const(var):
            outputs.append((var.name, None, ctx.const(var)))
        else:
            outputs.append((var.name, slot_of(var), None))
    return CompiledFunction(name, where, inputs, steps, outputs, len(slots), op_types, numerics.ane)


@contextlib.contextmanager
def _young_collections() -> Iterator[None]:
    """Within the block, `gc.collect()` scans only the objects allocated since it began.

    The older objects are set aside with `gc.freeze` (a full collection in a process with torch
    loaded takes a quarter of a second). Not done when the process has frozen objects of its own:
    `gc.unfreeze` would release those too; collections are then full, slower, as correct.
    """
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _function_program(package: MilPackage, name: str):
    """The pymil `Program` of function `name` of `package` alone (its consts read from the blob)."""
    if len(package.function_names) == 1:
        program = package.program()
        package.release_program()  # held by the caller only, freed when it is done
        return program
    from coremltools import proto
    from coremltools.converters.mil.frontend.milproto.load import load_mil_proto

    spec = package.spec.mlProgram
    single = proto.MIL_pb2.Program(version=spec.version)
    single.functions[name].CopyFrom(package.function_spec(name))
    for key, value in spec.attributes.items():
        single.attributes[key].CopyFrom(value)
    with _quiet():
        try:
            return load_mil_proto(single, package.specification_version, os.fspath(package.weights_dir))
        except Exception as exc:
            raise PackageError(f"coremltools could not load function {name!r} of {package.name}: "
                               f"{type(exc).__name__}: {exc}") from exc


class PackageExecutor:
    """Every function of one `.mlpackage`, compiled for numpy execution.

    Parameters
    ----------
    path : Path or MilPackage
        The `.mlpackage`, or the package already opened (its spec is not read again).
    precision : {"fp16", "fp32"}
        Storage of fp16 tensors (see `llama_ane.mil.numerics`).
    ane_numerics : bool
        With precision "fp16": the Neural Engine's reported deviations too (`llama_ane.mil.numerics`).
    widen_weights : bool
        True (default): keep float32 copies of the contraction weights, the fastest to run.
        False: keep them as stored (fp16 in an fp16 package) and widen them block by block in each
        call, so the executor holds about one copy of the package's weights (streamed
        verification of large models). Outputs agree to float32 rounding (BLAS sums block by block).

    Raises
    ------
    UnsupportedOpError
        If any function uses an op this executor cannot run (the message names op and package).
    PackageError
        If the package cannot be read.
    """

    def __init__(self, path: Path | MilPackage, precision: str = "fp16", widen_weights: bool = True,
                 ane_numerics: bool = False):
        self.package = path if isinstance(path, MilPackage) else MilPackage(Path(path))
        self.numerics = Numerics(precision, ane_numerics)
        self._weights: dict = {}
        self.functions: dict[str, CompiledFunction] = {}
        # coremltools gives every function its own copy of the weights it reads, although the
        # functions share them in the blob: load and compile one function at a time, so only one
        # such copy exists beside the prepared weights (the later functions find theirs cached).
        # A pymil program is a graph of reference cycles, freed only by a collection: collect after
        # each function, scanning only the objects made since here.
        with _young_collections():
            for name in self.package.function_names:
                program = _function_program(self.package, name)
                self.functions[name] = _compile_function(
                    program.functions[name], name, self.package.name, self.numerics,
                    self.package.blob_locations(name), self._weights, widen_weights,
                    self.package.constexpr_sources(name),
                )
                # consts not in the blob are cached under their var's id(), valid only while this
                # program lives (the compiled steps hold their own references)
                for key in [k for k in self._weights if k[0] not in ("blob", "constexpr")
                            or k[0] == "constexpr" and isinstance(k[1], int)]:
                    del self._weights[key]
                del program
                gc.collect()

    @property
    def function_names(self) -> list[str]:
        return list(self.functions)

    def held_weight_bytes(self) -> int:
        """Bytes held for weights read from the package's weight blob (a shared weight counts once)."""
        return sum(
            v.nbytes for k, v in self._weights.items()
            if k[0] in ("blob", "constexpr") and k[-1] != "raw" and isinstance(v, np.ndarray)
        )

    def run(self, function: str, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run `function` ("main" for single-function packages) on `inputs`; outputs by name."""
        fn = self.functions.get(function)
        if fn is None:
            raise PackageError(
                f"package {self.package.name} has no function {function!r}; it has {self.function_names}"
            )
        return fn.run(inputs)
