"""The MIL program of each exported model, built from its specs and its weights, and saved.

One program per package. On multifunction targets (iOS18, macOS15) it holds every function of the
model (prefill, decode, decode_branches, ...) and each weight is a const whose `weight_id` is its
parameter name, so the functions share one copy in the weight blob without any deduplication pass.
On older targets each function becomes a program of its own.

The graphs come from the builders in `llama_ane.model` (each kind's in `model.kinds`), written op for op like the torch modules
beside them; they are built in the export dtype and saved with no graph passes, so what is saved is
what was built. The mil executor runs them and `verify` compares them with the torch modules.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Function, Program

from ..config import LlamaConfig
from ..model.functions import Site
from ..model.kinds import kind_of
from ..model.layers import Graph, Weights
from ..precision import mil_type
from ..quantize import Compression
from .compressed import Payload, compress, constexpr


@dataclass
class CompressedGraph(Graph):
    """A Graph whose weights are stored as `compressions(name)` says: the constexpr op that
    decompresses it (see compressed.py), or dense where it says None. Each weight is compressed
    once for all functions; its dense array is not kept. `ios18`: the program's opset has the
    grouped and blockwise constexpr ops; `importance(name)` weighs the input channels of a LUT fit."""

    compressions: Callable[[str], Compression | None] = lambda name: None
    ios18: bool = True
    importance: Callable[[str], Any] = lambda name: None

    def load(self, name: str) -> Any:
        c = self.compressions(name)
        return self.weights(name) if c is None else compress(self.weights(name), c, self.importance(name))

    def weight(self, name: str):
        value = self.value(name)
        if isinstance(value, Payload):
            return constexpr(name, value, self.ios18)
        return super().weight(name)


def _placeholders(io: dict) -> dict:
    """The function's inputs, then its states (read-write buffers of iOS18 programs)."""
    inputs = {t["name"]: mb.placeholder(shape=t["shape"], dtype=mil_type(t["dtype"])) for t in io["inputs"]}
    inputs.update({t["name"]: mb.state_tensor_placeholder(shape=t["shape"], dtype=mil_type(t["dtype"]))
                   for t in io.get("states", [])})
    return inputs


def _named(var, name: str):
    """Give a function output the name the manifest uses for it."""
    var.name = name
    var.op.name = name
    return var


def build_program(model: str, functions: dict[str, dict], cfg: LlamaConfig, weights: Weights, *, dtype: type,
                  opset, layers: list[int], context_length: int, suffix_length: int,
                  rows: tuple[int, int] | None = None, compressions=lambda name: None,
                  importance=lambda name: None, multifunction: bool = True) -> Program:
    """A Program with one function per entry of `functions` ({function: io spec}) of `model`
    (without `multifunction`, its one function is "main", the name single-function packages use);
    `compressions(name)` gives the Compression of a parameter (None: dense), `importance(name)` the
    weights of its input channels in a LUT fit (None: equal)."""
    import coremltools as ct
    from coremltools.converters.mil.mil import Builder

    if not multifunction and len(functions) != 1:
        raise ValueError(f"a single-function package holds one function, not {list(functions)}")
    # ops not named explicitly are named from a per-process counter (as ct.convert, which also
    # resets it first): from zero, a program's bytes do not depend on what the process built before
    Builder.name_count.clear()
    g = CompressedGraph(dtype, weights, compressions=compressions, ios18=opset >= ct.target.iOS18,
                        importance=importance)
    prog = Program()
    site = Site(context_length, suffix_length=suffix_length, layers=tuple(layers), rows=rows)
    for fn, io in functions.items():
        body = kind_of(model).program(g, cfg, fn, io, site)
        with Function(_placeholders(io), opset_version=opset) as func:
            outs = body(func.inputs)
            func.set_outputs([_named(outs[t["name"]], t["name"]) for t in io["outputs"]])
        prog.add_function(fn if multifunction else "main", func)
    prog.default_function_name = list(functions)[-1] if multifunction else "main"
    return prog


def save_program(prog: Program, path: Path, specification_version: int, multifunction: bool) -> None:
    """Serialize `prog` as an .mlpackage at `path`, with no graph passes, written in place.

    coremltools writes the weight blob to a temporary folder and copies it into the package; the
    caller points `tempfile.tempdir` into the export's own partial folder so nothing is left in /tmp.
    """
    import coremltools as ct
    from coremltools.converters.mil.converter import mil_convert

    prog.skip_all_passes = True
    prog.export_as_multifunction = multifunction
    with _no_pass_pipelines():
        mil_convert(prog, convert_from="milinternal", convert_to="mlprogram",
                    specification_version=specification_version, compute_units=ct.ComputeUnit.CPU_ONLY,
                    skip_model_load=True, package_dir=os.fspath(path))
    make_reproducible(path)


def make_reproducible(path: Path) -> None:
    """Rewrite what coremltools saves differently on every run, so one input gives one hash: the
    model spec's protobuf maps are serialized in a fixed order, and the package's item identifiers
    (random UUIDs) are derived from the item paths."""
    import json
    import uuid

    from coremltools.proto import Model_pb2

    spec_file = path / "Data" / "com.apple.CoreML" / "model.mlmodel"
    spec = Model_pb2.Model.FromString(spec_file.read_bytes())
    spec_file.write_bytes(spec.SerializeToString(deterministic=True))
    manifest_file = path / "Manifest.json"
    manifest = json.loads(manifest_file.read_text())
    ids = {old: str(uuid.uuid5(uuid.NAMESPACE_URL, f"llama-ane:{entry['path']}")).upper()
           for old, entry in manifest["itemInfoEntries"].items()}
    manifest["itemInfoEntries"] = {ids[k]: v for k, v in sorted(manifest["itemInfoEntries"].items(),
                                                                  key=lambda kv: ids[kv[0]])}
    manifest["rootModelIdentifier"] = ids[manifest["rootModelIdentifier"]]
    manifest_file.write_text(json.dumps(manifest, indent=4, sort_keys=True) + "\n")


@contextlib.contextmanager
def _no_pass_pipelines():
    """Skip coremltools' pass pipelines: with every pass skipped they would still validate the whole
    program after each of ~100 passes (most of the time of saving a 30-layer chunk). The program is
    still validated once, when it is serialized."""
    from coremltools.converters.mil.mil.passes.pass_pipeline import PassPipelineManager

    real = PassPipelineManager.apply_pipeline
    PassPipelineManager.apply_pipeline = staticmethod(lambda prog, pipeline: None)
    try:
        yield
    finally:
        PassPipelineManager.apply_pipeline = staticmethod(real)


__all__ = ["build_program", "save_program", "make_reproducible"]
