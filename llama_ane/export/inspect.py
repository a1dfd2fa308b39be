"""Static inspection of exported programs: I/O, op histogram, weight bytes, largest dimension,
and every ANE rule violation (`ane_rules`).

Reads only the protobuf specs (no weights are loaded and nothing runs), so it is fast and works
on any OS. PATH is an export folder (the manifest names the packages, their roles and the
deployment target) or a single .mlpackage (its role is guessed from its name: chunk_*,
embeddings, lm_head, cache_update).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import LlamaANEError
from ..mil.package import MilPackage
from ..contract.manifest import check_package_io
from ..contract.specs import model_kind
from .ane_rules import (
    FunctionSummary,
    OpInfo,
    TensorInfo,
    Violation,
    check_compression,
    check_states,
    check_file_size,
    check_function,
    platform_of,
)

# MIL DataType enum name -> (numpy-style name, bytes per element; sub-byte types as fractions)
_DTYPES = {
    "BOOL": ("bool", 1), "STRING": ("string", 0), "FLOAT16": ("float16", 2), "BFLOAT16": ("bfloat16", 2),
    "FLOAT32": ("float32", 4), "FLOAT64": ("float64", 8), "INT8": ("int8", 1), "INT16": ("int16", 2),
    "INT32": ("int32", 4), "INT64": ("int64", 8), "UINT8": ("uint8", 1), "UINT16": ("uint16", 2),
    "UINT32": ("uint32", 4), "UINT64": ("uint64", 8), "INT4": ("int4", 0.5), "UINT4": ("uint4", 0.5),
    "UINT2": ("uint2", 0.25), "UINT1": ("uint1", 0.125), "UINT3": ("uint3", 0.375), "UINT6": ("uint6", 0.75),
    "FLOAT8E4M3FN": ("float8e4m3fn", 1), "FLOAT8E5M2": ("float8e5m2", 1),
}


class InspectError(LlamaANEError, RuntimeError):
    """PATH is neither an export folder nor an .mlpackage."""


@dataclass
class FunctionReport:
    """One function: its I/O, op histogram (consts counted apart), weight bytes, largest dimension."""

    function: str
    model: str | None
    role: str
    inputs: list
    outputs: list
    op_histogram: dict[str, int]
    const_count: int
    weight_bytes: int  # as stored: dense weights, and the codes and LUTs or scales of compressed ones
    dense_weight_bytes: int  # the same weights decompressed
    largest_dim: int
    largest_dim_tensor: str

    def to_dict(self) -> dict:
        return {
            "function": self.function, "model": self.model, "role": self.role,
            "inputs": [_desc_dict(d) for d in self.inputs], "outputs": [_desc_dict(d) for d in self.outputs],
            "op_histogram": self.op_histogram, "const_count": self.const_count,
            "weight_bytes": self.weight_bytes, "dense_weight_bytes": self.dense_weight_bytes,
            "largest_dim": self.largest_dim, "largest_dim_tensor": self.largest_dim_tensor,
        }


@dataclass
class PackageReport:
    file: str
    size_bytes: int
    functions: list[FunctionReport]

    def to_dict(self) -> dict:
        return {"file": self.file, "size_bytes": self.size_bytes, "functions": [f.to_dict() for f in self.functions]}


@dataclass
class InspectReport:
    """Everything `llama-ane inspect` prints; `violations` is empty for a clean export."""

    path: str
    target: str
    target_source: str  # "manifest" | "option" | "default"
    packages: list[PackageReport]
    violations: list[Violation] = field(default_factory=list)
    device_paths: dict[str, str] = field(default_factory=dict)  # part -> its forms and how the ANE runs them

    def to_dict(self) -> dict:
        return {
            "path": self.path, "target": self.target, "target_source": self.target_source,
            "packages": [p.to_dict() for p in self.packages],
            "violations": [v.to_dict() for v in self.violations],
            "device_paths": self.device_paths,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def format_text(self) -> str:
        lines = [f"{self.path} (target {self.target}, from {self.target_source})"]
        for pkg in self.packages:
            lines.append(f"\n{pkg.file}  {pkg.size_bytes / 1e6:.1f} MB")
            for fn in pkg.functions:
                label = f"{fn.model}/{fn.function}" if fn.model else fn.function
                dense = (f" ({fn.dense_weight_bytes / 1e6:.2f} MB dense)"
                         if fn.dense_weight_bytes != fn.weight_bytes else "")
                lines.append(f"  {label}  [{fn.role}]  weights {fn.weight_bytes / 1e6:.2f} MB{dense}, "
                             f"largest dim {fn.largest_dim} ({fn.largest_dim_tensor})")
                for kind, descs in (("in ", fn.inputs), ("out", fn.outputs)):
                    for d in descs:
                        state = " state" if d.is_state else ""
                        lines.append(f"    {kind} {d.name:<20} {str(list(d.shape)):<22} {d.dtype}{state}")
                ops = ", ".join(f"{k} {v}" for k, v in sorted(fn.op_histogram.items(), key=lambda kv: (-kv[1], kv[0])))
                lines.append(f"    ops ({sum(fn.op_histogram.values())} + {fn.const_count} const): {ops}")
        if any(p != "fp16" for p in self.device_paths.values()):
            lines.append("\ncompressed weights (just-in-time: the ANE reads them compressed; at-load: fp16 once "
                         "loaded, see docs/quantization.md):")
            lines.extend(f"  {part:<11} {p}" for part, p in self.device_paths.items())
        if self.violations:
            lines.append(f"\n{len(self.violations)} ANE rule violation(s):")
            lines.extend(f"  {v}" for v in self.violations)
        else:
            lines.append("\nno ANE rule violations")
        return "\n".join(lines)


def _desc_dict(d) -> dict:
    return {"name": d.name, "shape": list(d.shape), "dtype": d.dtype, "is_state": d.is_state}


def _tensor_type(value_type) -> tuple[tuple[int, ...], str, float]:
    """(shape, dtype name, bytes per element) of a MIL ValueType; unknown dims count as 0."""
    if value_type.WhichOneof("type") == "stateType":
        value_type = value_type.stateType.wrappedType
    if value_type.WhichOneof("type") != "tensorType":
        return (), "other", 0
    t = value_type.tensorType
    enum = type(t).DESCRIPTOR.fields_by_name["dataType"].enum_type.values_by_number[t.dataType].name
    name, size = _DTYPES.get(enum, (enum.lower(), 0))
    shape = tuple(int(d.constant.size) if d.WhichOneof("dimension") == "constant" else 0 for d in t.dimensions)
    return shape, name, size


def _bytes(value_type) -> int:
    """Bytes of a tensor of MIL ValueType `value_type` (sub-byte elements packed)."""
    shape, _, size = _tensor_type(value_type)
    n = 1
    for d in shape:
        n *= d
    return int(-(-n * size // 1))


def _walk_ops(block):
    """Every op of `block` and of the blocks nested in it (cond/while bodies)."""
    for op in block.operations:
        yield op
        for nested in op.blocks:
            yield from _walk_ops(nested)


def summarize_function(package: MilPackage, function: str, role: str) -> tuple[FunctionSummary, dict]:
    """A `FunctionSummary` for the rules plus the statistics of the report."""
    fn_spec = package.function_spec(function)
    block = package.block_spec(function)
    inputs, outputs = package.io(function)
    tensors: dict[str, TensorInfo] = {}
    for inp in fn_spec.inputs:
        shape, dtype, _ = _tensor_type(inp.type)
        tensors[inp.name] = TensorInfo(inp.name, shape, dtype, "input")
    const_names: set[str] = set()
    blobs: dict[tuple[str, int], int] = {}  # blob entry -> bytes as stored
    dense: dict[tuple[str, int], int] = {}  # blob entry (a const's, or a constexpr's first input's) -> dense bytes
    dense_of: dict[str, tuple[str, int]] = {}  # a constexpr's output -> its entry in `dense`
    feeds: dict[str, str] = {}  # a constexpr's output read only to make another's -> that other output
    histogram: Counter = Counter()
    ops: list[OpInfo] = []
    for op in _walk_ops(block):
        is_const = op.type == "const"
        compressed = op.type.startswith("constexpr_")  # a compile-time weight decompressed at load
        if is_const:
            const_names.add(op.outputs[0].name)
            value = op.attributes["val"]
            if value.WhichOneof("value") == "blobFileValue":
                key = (value.blobFileValue.fileName, int(value.blobFileValue.offset))
                blobs[key] = dense[key] = _bytes(op.outputs[0].type)
        else:
            histogram[op.type] += 1
        if compressed:
            # iOS18 forms bind their data as inputs, the iOS16 forms hold it as attributes
            values = [b.value for arg in op.inputs.values() for b in arg.arguments if b.WhichOneof("binding") == "value"]
            values += [v for k, v in sorted(op.attributes.items()) if k != "name"]
            entries = [(v.blobFileValue.fileName, int(v.blobFileValue.offset), v.type)
                       for v in values if v.WhichOneof("value") == "blobFileValue"]
            for file, offset, value_type in entries:
                blobs[(file, offset)] = _bytes(value_type)
            for arg in op.inputs.values():  # a constexpr fed by another (a scaled LUT's values): one dense weight
                for b in arg.arguments:
                    if b.WhichOneof("binding") == "name" and b.name in dense_of:
                        dense.pop(dense_of.pop(b.name), None)
                        feeds[b.name] = op.outputs[0].name
            if entries:
                dense[entries[0][:2]] = _bytes(op.outputs[0].type)
                dense_of[op.outputs[0].name] = entries[0][:2]
            const_names.update(out.name for out in op.outputs)
        for out in op.outputs:
            shape, dtype, _ = _tensor_type(out.type)
            tensors[out.name] = TensorInfo(out.name, shape, dtype, "const" if is_const or compressed else "op")
        const_params = {}
        for param, arg in op.inputs.items():
            names = [b.name for b in arg.arguments if b.WhichOneof("binding") == "name"]
            const_params[param] = all(n in const_names for n in names)
            for n in names:
                if n in tensors:
                    tensors[n].consumers.add(op.type)
        if not is_const:
            ops.append(OpInfo(op.type, op.outputs[0].name if op.outputs else op.type, const_params))
    for name in feeds:  # what reads a weight's intermediate value is what reads the weight
        final = name
        while final in feeds:
            final = feeds[final]
        tensors[name].consumers = tensors[final].consumers
    for name in block.outputs:
        if name in tensors and tensors[name].kind == "op":
            tensors[name].kind = "output"
    largest = max(tensors.values(), key=lambda t: max(t.shape, default=0), default=None)
    summary = FunctionSummary(package.name, function, role, inputs, outputs, list(tensors.values()), ops)
    stats = {
        "op_histogram": dict(histogram),
        "const_count": len(const_names),
        "weight_bytes": sum(blobs.values()),
        "dense_weight_bytes": sum(dense.values()),
        "largest_dim": max(largest.shape, default=0) if largest else 0,
        "largest_dim_tensor": largest.name if largest else "",
    }
    return summary, stats


def role_of_model(model: str, manifest: dict | None) -> str:
    """The role of a manifest model (or a package stem without a manifest): "embeddings" (every
    file of the table), "chunk", "lm_head" (every file of the head), "cache_update" or "unknown"."""
    if manifest is not None and any(c["model"] == model for c in manifest.get("chunks", [])):
        return "chunk"
    try:
        kind = model_kind(model)
    except ValueError:
        return "unknown"
    if kind == "chunk" and manifest is not None:
        return "unknown"  # named like a chunk but not one of the manifest's
    return "embeddings" if kind == "embeddings_part" else kind


def _declared_states(manifest: dict | None, path: Path, function: str) -> list[dict] | None:
    """The states the manifest declares for `function` of the package at `path` (None without a
    manifest or when the manifest does not name this function)."""
    if manifest is None:
        return None
    for entry in manifest["models"].values():
        for fn in entry["functions"].values():
            if fn["file"] == Path(path).name and (fn.get("function_name") or "main") == function:
                return fn.get("states", [])
    return None


def inspect_package(path: Path, *, target: str = "iOS18", models: dict[str, str] | None = None,
                    manifest: dict | None = None) -> tuple[PackageReport, list[Violation]]:
    """Report and violations of one .mlpackage.

    `models` maps function name -> manifest model name; with `manifest` they give each function
    its role. Without them the role is guessed from the file name (chunk_*, embeddings, ...).
    """
    package = MilPackage(Path(path))
    if manifest is not None:
        check_package_io(manifest, Path(path).name, package.describe())
    functions = []
    violations: list[Violation] = []
    stem = Path(path).name.removesuffix(".mlpackage")
    for function in package.function_names:
        model = (models or {}).get(function)
        role = role_of_model(model, manifest) if model else role_of_model(stem, None)
        summary, stats = summarize_function(package, function, role)
        functions.append(FunctionReport(function, model, role, summary.inputs, summary.outputs, **stats))
        violations.extend(check_function(summary))
        violations.extend(check_compression(summary, target))
        violations.extend(check_states(summary, target, _declared_states(manifest, path, function)))
    size = package.size_bytes()
    violations.extend(check_file_size(package.name, size, target))
    return PackageReport(package.name, size, functions), violations


def inspect_asset(path: Path, models: dict[str, str] | None = None,
                  precision: str | None = "fp16") -> tuple[PackageReport, list[Violation]]:
    """Report and violations of one Core AI asset (.aimodel), parsed back with coreai-core's
    bindings: functions and I/O (states last among the inputs, marked as Core ML's are), op counts,
    the largest dimension, fp16 I/O, no dynamic ops."""
    from ..mil.package import TensorDesc
    from .coreai import structure

    found, broken = structure(path, precision)
    ops = {k: v for k, v in found["operations"].items() if k != "coreai.constant"}
    largest, where = found["largest_dim"]
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    functions = [FunctionReport(fn, (models or {}).get(fn), model_kind((models or {}).get(fn) or path.stem),
                                [TensorDesc(n, tuple(s), d) for n, (d, s) in io["inputs"].items()]
                                + [TensorDesc(n, tuple(s), d, is_state=True) for n, (d, s) in io["states"].items()],
                                [TensorDesc(n, tuple(s), d) for n, (d, s) in io["outputs"].items()],
                                ops, found["operations"].get("coreai.constant", 0), size, size, largest, where)
                 for fn, io in found["functions"].items()]
    violations = [Violation(rule, path.name, fn, msg) for rule, fn, msg in broken]
    return PackageReport(path.name, size, functions), violations + check_file_size(path.name, size, "coreai")


def inspect_path(path: str | Path, *, target: str | None = None) -> InspectReport:
    """Inspect an export folder (via its manifest) or a single .mlpackage."""
    path = Path(path)
    if path.suffix == ".aimodel":
        pkg, violations = inspect_asset(path)
        return InspectReport(str(path), "coreai", "default", [pkg], violations)
    if path.suffix == ".mlpackage" or (path / "Manifest.json").is_file():
        t = target or "iOS18"
        pkg, violations = inspect_package(path, target=t)
        return InspectReport(str(path), t, "option" if target else "default", [pkg], violations)
    manifest_file = path / "manifest.json"
    if not manifest_file.is_file():
        raise InspectError(f"{path} is neither an export folder (no manifest.json) nor an .mlpackage")
    from ..contract.manifest import read_manifest

    manifest = read_manifest(path, check_hashes=False)
    if target:
        t, source = target, "option"
    else:
        t, source = manifest.get("deployment_target", "iOS18"), "manifest"
    # file -> {function_name -> model}; every file with the role its models have in the manifest
    files: dict[str, dict[str, str]] = {}
    for model, entry in manifest["models"].items():
        for fn in entry["functions"].values():
            files.setdefault(fn["file"], {})[fn.get("function_name") or "main"] = model
    from ..quantize.auto import device_paths

    report = InspectReport(str(path), t, source, [], device_paths=device_paths(manifest.get("quantization", {})))
    for file, models in files.items():
        if t == "coreai":  # a Core AI export: its .aimodel programs, read back by coreai-core
            pkg, violations = inspect_asset(path / file, models, manifest.get("precision"))
        else:
            pkg, violations = inspect_package(path / file, target=t, models=models, manifest=manifest)
        report.packages.append(pkg)
        report.violations.extend(violations)
    return report


__all__ = ["InspectError", "InspectReport", "inspect_package", "inspect_path", "platform_of"]
