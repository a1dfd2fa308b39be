"""The Core ML backend (macOS only): runs the exported packages with Core ML, on the Neural Engine
by default.

Each package is compiled once to an .mlmodelc kept in `OUT/.compiled/` (named by the package's
sha256, so a changed package is recompiled) and loaded per function with
`coremltools.models.CompiledMLModel`.

A stateful export's caches (`--kv-cache state`) live in Core ML `MLState`s: one per cache the
pipeline hands in (keyed by its arrays), made from the package and filled from those arrays when
first seen, then updated by Core ML itself, shared by every function of the package.
`sync_states` copies them back into the arrays (before a prompt-cache file is written); the
least recently used beyond `HELD_STATES` per package are copied back and dropped.
"""

from __future__ import annotations

import platform
import shutil
from collections import OrderedDict
from pathlib import Path
from typing import Mapping

import numpy as np

from ...contract.manifest import check_package_io, function_entry, function_states
from ...mil.package import MilPackage
from ...precision import PRECISIONS
from .base import HELD_STATES, Backend, BackendError

COMPUTE_UNITS = ("CPU_AND_NE", "ALL", "CPU_ONLY", "CPU_AND_GPU")


class CoreMLBackend(Backend):
    name = "coreml"

    def __init__(self, export_dir: Path, manifest: dict, *, compute_units: str = "CPU_AND_NE"):
        if platform.system() != "Darwin":
            raise BackendError("the coreml backend needs macOS (Core ML cannot run predictions elsewhere); "
                               "use --backend torch or --backend mil")
        if compute_units not in COMPUTE_UNITS:
            raise BackendError(f"compute_units must be one of {', '.join(COMPUTE_UNITS)}, got {compute_units!r}")
        import coremltools as ct

        self.ct = ct
        self.export_dir = Path(export_dir)
        self.manifest = manifest
        self.compute_units = getattr(ct.ComputeUnit, compute_units)
        self.dtype = PRECISIONS[manifest["precision"]].numpy
        self._loaded: dict[tuple[str, str], object] = {}
        self._checked: set[str] = set()
        # (package file, id of the caller's k_cache array) -> (MLState, the caller's arrays by name)
        self._states: OrderedDict[tuple[str, int], tuple[object, dict[str, np.ndarray]]] = OrderedDict()

    def _compiled(self, file: str) -> Path:
        if file not in self._checked:  # the package's description must be what the manifest says
            check_package_io(self.manifest, file, MilPackage(self.export_dir / file).describe())
            self._checked.add(file)
        digest = self.manifest["files"][file][:16]
        target = self.export_dir / ".compiled" / f"{Path(file).stem}-{digest}.mlmodelc"
        if not target.exists():
            target.parent.mkdir(exist_ok=True)
            built = Path(self.ct.utils.compile_model(str(self.export_dir / file)))
            shutil.move(str(built), str(target))
        return target

    def _model(self, model: str, function: str, entry: dict):
        key = (entry["file"], entry["function_name"])
        if key not in self._loaded:
            kwargs = {"compute_units": self.compute_units}
            if self.manifest["multifunction"]:
                kwargs["function_name"] = entry["function_name"]
            try:
                self._loaded[key] = self.ct.models.CompiledMLModel(str(self._compiled(entry["file"])), **kwargs)
            except Exception as e:
                raise BackendError(f"Core ML could not load {entry['file']} ({model}/{function}): {e}") from e
        return self._loaded[key]

    def load_function(self, model: str, function: str) -> bool:
        self._model(model, function, function_entry(self.manifest, model, function))
        return True

    def predict(self, model: str, function: str, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        entry = function_entry(self.manifest, model, function)
        feed = {}
        for spec in entry["inputs"]:
            dtype = np.int32 if spec["dtype"] == "int32" else self.dtype
            feed[spec["name"]] = np.ascontiguousarray(inputs[spec["name"]], dtype=dtype)
        states = function_states(entry)
        try:
            mlmodel = self._model(model, function, entry)
            if states:
                out = mlmodel.predict(feed, state=self._state(mlmodel, entry, states, inputs))
            else:
                out = mlmodel.predict(feed)
        except BackendError:
            raise
        except Exception as e:
            raise BackendError(f"Core ML prediction failed for {model}/{function}: {e}") from e
        return {spec["name"]: np.asarray(out[spec["name"]]) for spec in entry["outputs"]}

    def _state(self, mlmodel, entry: dict, states: list[dict], inputs: Mapping[str, np.ndarray]):
        """The MLState standing for the caller's cache arrays in this package, made and filled from
        them the first time they are seen."""
        arrays = {spec["name"]: inputs[spec["name"]] for spec in states}
        key = (entry["file"], id(arrays[states[0]["name"]]))
        held = self._states.get(key)
        if held is None or any(held[1][name] is not a for name, a in arrays.items()):
            state = mlmodel.make_state()
            for name, a in arrays.items():
                state.write_state(name, np.ascontiguousarray(a, dtype=np.float16))
            held = self._states[key] = (state, arrays)
            same_file = [k for k in self._states if k[0] == key[0]]
            for old in same_file[:-HELD_STATES]:
                self._copy_back(*self._states.pop(old))
        self._states.move_to_end(key)
        return held[0]

    @staticmethod
    def _copy_back(state, arrays: dict[str, np.ndarray]) -> None:
        for name, a in arrays.items():
            a[...] = state.read_state(name)

    def sync_states(self) -> None:
        """Copy every MLState back into the cache arrays it stands for."""
        for state, arrays in self._states.values():
            self._copy_back(state, arrays)

    def release(self, model: str) -> None:
        """Unload the Core ML models of `model`'s package files (the compiled .mlmodelc stays on disk)."""
        files = {f["file"] for f in self.manifest["models"].get(model, {}).get("functions", {}).values()}
        for key in [k for k in self._loaded if k[0] in files]:
            del self._loaded[key]

    def close(self) -> None:
        self._loaded.clear()
        self._states.clear()
