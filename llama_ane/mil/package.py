"""Open a saved `.mlpackage` on any OS: its model spec, functions, weights and MIL program.

coremltools can read a package's protobuf spec and turn its MIL program back into a pymil
`Program` on Linux (`coremltools.converters.mil.frontend.milproto.load`); it only lacks the
Core ML runtime that would execute it. This module wraps that loading and adds what the executor
and the inspector need beyond it: where each const's bytes live in the weight blob (so functions
of a multifunction package share one copy) and per-function I/O descriptions.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import LlamaANEError

WEIGHTS_SUBDIR = Path("Data") / "com.apple.CoreML" / "weights"

# MultiArray dataType enum names in the Core ML spec -> numpy dtypes
_ARRAY_DTYPES = {
    "FLOAT16": np.dtype(np.float16),
    "FLOAT32": np.dtype(np.float32),
    "DOUBLE": np.dtype(np.float64),
    "INT32": np.dtype(np.int32),
    "INT8": np.dtype(np.int8),
}


class PackageError(LlamaANEError, RuntimeError):
    """A package could not be read; the message names the package and what to do."""


@dataclass(frozen=True)
class TensorDesc:
    """One input or output of a function as the package describes it.

    `shape` is the static shape; `dtype` a numpy dtype name ("float16", "int32", ...);
    `is_state` marks iOS18 state inputs (read-write buffers).
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    is_state: bool = False


def _quiet():
    """Silence coremltools' logging and prints while it loads a program (it is chatty)."""
    stack = contextlib.ExitStack()
    stack.enter_context(contextlib.redirect_stdout(io.StringIO()))
    logger = logging.getLogger("coremltools")
    previous = logger.level
    logger.setLevel(logging.ERROR)
    stack.callback(logger.setLevel, previous)
    return stack


def _feature_desc(feature) -> TensorDesc:
    kind = feature.type.WhichOneof("Type")
    is_state = kind == "stateType"
    array = feature.type.stateType.arrayType if is_state else feature.type.multiArrayType
    if kind not in ("multiArrayType", "stateType"):
        return TensorDesc(feature.name, (), kind or "unknown", False)
    dtype_name = array.DESCRIPTOR.fields_by_name["dataType"].enum_type.values_by_number[array.dataType].name
    dtype = _ARRAY_DTYPES.get(dtype_name)
    return TensorDesc(
        name=feature.name,
        shape=tuple(int(d) for d in array.shape),
        dtype=dtype.name if dtype is not None else dtype_name.lower(),
        is_state=is_state,
    )


def read_spec(path: Path):
    """The protobuf model spec (`Model_pb2.Model`) of the package at `path`, read without writing.

    coremltools' `load_spec` opens a package through its ModelPackage class, which writes the
    package's Manifest.json back when it is done (a new file: a new inode and times), so every
    reader changed the package and its sha256 had to be computed again. This reads the root model
    that Manifest.json names, and nothing else."""
    from coremltools.proto import Model_pb2

    path = Path(path)
    try:
        manifest = json.loads((path / "Manifest.json").read_text())
        entry = manifest["itemInfoEntries"][manifest["rootModelIdentifier"]]
        relative = Path(entry["path"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise PackageError(f"{path}/Manifest.json does not name the package's model ({type(exc).__name__}: "
                           f"{exc}); re-export it") from exc
    data = path / "Data"
    spec_file = data / relative
    if relative.is_absolute() or ".." in relative.parts or not spec_file.is_file():
        raise PackageError(f"{path}/Manifest.json names the model {str(relative)!r}, which is not a file in "
                           f"{data}; re-export it")
    try:
        return Model_pb2.Model.FromString(spec_file.read_bytes())
    except Exception as exc:  # the protobuf reader gives terse errors (DecodeError and others)
        raise PackageError(f"cannot read the model spec of {path}: {exc}") from exc


class MilPackage:
    """A saved `.mlpackage` holding an mlprogram (one function or several).

    Parameters
    ----------
    path : Path
        The `.mlpackage` directory.

    Attributes
    ----------
    spec : Model_pb2.Model
        The protobuf model spec (ops, attributes, blob references; weights stay on disk).
    function_names : list[str]
        Functions in the package ("main" for single-function packages).
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        if not (self.path / "Manifest.json").is_file():
            raise PackageError(
                f"{self.path} is not an .mlpackage (no Manifest.json). Pass a folder saved by "
                "coremltools' MLModel.save or ct.utils.save_multifunction."
            )
        self.spec = read_spec(self.path)
        if self.spec.WhichOneof("Type") != "mlProgram":
            raise PackageError(
                f"{self.path} holds a neural network model, not an mlprogram; re-export with "
                "convert_to='mlprogram'."
            )
        self.weights_dir = self.path / WEIGHTS_SUBDIR
        self.function_names = list(self.spec.mlProgram.functions.keys())
        self._program = None

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def specification_version(self) -> int:
        return int(self.spec.specificationVersion)

    def function_spec(self, function: str):
        """The MIL protobuf `Function` of `function`; a clear error if the package lacks it."""
        functions = self.spec.mlProgram.functions
        if function not in functions:
            raise PackageError(
                f"package {self.name} has no function {function!r}; it has {sorted(functions)}"
            )
        return functions[function]

    def block_spec(self, function: str):
        """The main block of `function` for the opset it was written for."""
        fn = self.function_spec(function)
        return fn.block_specializations[fn.opset]

    def io(self, function: str) -> tuple[list[TensorDesc], list[TensorDesc]]:
        """(inputs, outputs) of `function` as declared in the model description; its states (iOS18)
        come last among the inputs, marked `is_state`."""
        self.function_spec(function)
        desc = self.spec.description
        for fdesc in desc.functions:
            if fdesc.name == function:
                return ([_feature_desc(f) for f in fdesc.input] + [_feature_desc(f) for f in fdesc.state],
                        [_feature_desc(f) for f in fdesc.output])
        # single-function packages describe their one function at the top level
        inputs = [_feature_desc(f) for f in desc.input] + [_feature_desc(f) for f in desc.state]
        return inputs, [_feature_desc(f) for f in desc.output]

    def describe(self) -> dict[str, tuple[list[TensorDesc], list[TensorDesc]]]:
        """Every function's (inputs, outputs), as `io` gives them: what a manifest's specs are
        compared with before the package runs."""
        return {fn: self.io(fn) for fn in self.function_names}

    def blob_locations(self, function: str) -> dict[str, tuple[str, int]]:
        """Map const output name -> (blob file name, byte offset) for consts stored in the weight blob.

        Functions of a multifunction package that share a weight point at the same location,
        so this is the key under which the executor keeps one copy.
        """
        out: dict[str, tuple[str, int]] = {}
        for op in self.block_spec(function).operations:
            if op.type != "const" or "val" not in op.attributes:
                continue
            value = op.attributes["val"]
            if value.WhichOneof("value") == "blobFileValue":
                blob = value.blobFileValue
                out[op.outputs[0].name] = (blob.fileName.split("/")[-1], int(blob.offset))
        return out

    def constexpr_sources(self, function: str) -> dict[str, tuple]:
        """Map the output name of each constexpr op (a compressed weight) whose data all lives in
        the weight blob -> (op type, ((input, blob file, offset), ...)): the same key in every
        function that decompresses the same weight. The iOS18 forms bind their data as inputs,
        the iOS16 forms hold it as attributes; both count. An input that is the output of another
        such op (a scaled LUT's values) counts as that op's key."""
        out: dict[str, tuple] = {}
        for op in self.block_spec(function).operations:
            if not op.type.startswith("constexpr_"):
                continue
            values, chained = [], []
            for param, binding in sorted(op.inputs.items()):
                args = list(binding.arguments)
                one = args[0] if len(args) == 1 else None
                if one is not None and one.WhichOneof("binding") == "name" and one.name in out:
                    chained.append((param, out[one.name]))
                    continue
                values.append((param, one.value if one is not None and one.WhichOneof("binding") == "value" else None))
            values += [(k, v) for k, v in sorted(op.attributes.items()) if k != "name"]
            blobs = [(param, v.blobFileValue.fileName.split("/")[-1], int(v.blobFileValue.offset))
                     for param, v in values if v is not None and v.WhichOneof("value") == "blobFileValue"]
            if blobs and all(v is not None for _, v in values):
                out[op.outputs[0].name] = (op.type, tuple(blobs) + tuple(chained))
        return out

    def program(self):
        """The pymil `Program` of all functions, loaded once (weights are read from the blob)."""
        if self._program is None:
            from coremltools.converters.mil.frontend.milproto import load as milproto

            with _quiet():
                try:
                    self._program = milproto.load(
                        self.spec,
                        specification_version=self.specification_version,
                        file_weights_dir=os.fspath(self.weights_dir),
                    )
                except Exception as exc:
                    raise PackageError(
                        f"coremltools could not load the MIL program of {self.name}: "
                        f"{type(exc).__name__}: {exc}"
                    ) from exc
        return self._program

    def release_program(self) -> None:
        """Drop the pymil program (and its copies of the weights) once it is no longer needed."""
        self._program = None

    def size_bytes(self) -> int:
        """Bytes on disk of every regular file in the package."""
        return sum(p.stat().st_size for p in self.path.rglob("*") if p.is_file())
