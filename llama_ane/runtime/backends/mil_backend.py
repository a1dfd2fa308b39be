"""The mil backend: runs the exported .mlpackage programs themselves, op by op with numpy.

Core ML cannot predict off macOS, but the saved MIL program can still be executed faithfully
(`llama_ane.mil`). This is what lets Linux CI check the artifact users ship rather than only the
torch source it was converted from. Packages load lazily on first use, once each, until released
(`release`); the functions of a multifunction package share one copy of its weights.
"""

from __future__ import annotations

import gc
import threading
from pathlib import Path
from typing import Mapping

import numpy as np

from ...contract.manifest import check_package_io, function_entry, function_states
from .base import Backend, BackendError


class MilBackend(Backend):
    """Execute an export's packages with the numpy MIL executor.

    Parameters
    ----------
    export_dir : Path
        The export folder (holds manifest.json and the .mlpackage files).
    manifest : dict
        Its parsed manifest.
    precision : {"fp16", "fp32"}
        "fp16" stores fp16 tensors in half precision between ops, as the ANE does (float32
        accumulation inside each op); "fp32" holds them in float32 (see `llama_ane.mil.numerics`).
        Float outputs come back in that dtype.
    ane_numerics : bool
        With "fp16": the Neural Engine's reported deviations too (softplus's collapse, silu's error
        near 0, subnormals flushed; `llama_ane.mil.numerics`).
    widen_weights : bool
        True (default): float32 copies of the weights, fastest. False: weights stay as stored and
        are widened per call, about one copy of a package in memory (the streamed parity gate).
    """

    name = "mil"

    def __init__(self, export_dir: Path, manifest: dict, *, precision: str = "fp16", widen_weights: bool = True,
                 ane_numerics: bool = False):
        if precision not in ("fp16", "fp32"):
            raise BackendError(f"the mil backend computes in 'fp16' or 'fp32', not {precision!r}")
        if ane_numerics and (precision != "fp16" or manifest.get("precision", "fp16") != "fp16"):
            raise BackendError("ane_numerics applies the Neural Engine's fp16 deviations: it needs an fp16 export "
                               "run with precision 'fp16'")
        self.ane_numerics = ane_numerics
        self.export_dir = Path(export_dir)
        self.manifest = manifest
        self.precision = precision
        self.widen_weights = widen_weights
        half = manifest.get("precision", "fp16") == "fp16" and precision == "fp16"
        self.dtype = np.dtype(np.float16 if half else np.float32)
        self._executors: dict[str, object] = {}
        self._lock = threading.Lock()

    def _executor(self, file: str):
        """The compiled executor of package `file`, loaded on first use (thread-safe)."""
        with self._lock:
            if file not in self._executors:
                from ...mil import MilPackage, PackageError, PackageExecutor, UnsupportedOpError

                path = self.export_dir / file
                if not path.exists():
                    raise BackendError(f"{path} is missing; the export is incomplete, re-run `llama-ane export`")
                try:
                    # the description first: a package that disagrees with the manifest is refused
                    # before its weights are read
                    package = MilPackage(path)
                    check_package_io(self.manifest, file, package.describe())
                    self._executors[file] = PackageExecutor(package, precision=self.precision,
                                                           widen_weights=self.widen_weights,
                                                           ane_numerics=self.ane_numerics)
                except (UnsupportedOpError, PackageError) as exc:
                    raise BackendError(f"the mil backend cannot run {file}: {exc}") from exc
            return self._executors[file]

    def predict(self, model: str, function: str, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run manifest function `function` of `model`; returns every output the manifest names.
        States (a stateful export's caches) are the arrays in `inputs`, written in place."""
        entry = function_entry(self.manifest, model, function)
        executor = self._executor(entry["file"])
        feed = {}
        for spec in entry["inputs"]:
            if spec["name"] not in inputs:
                raise BackendError(f"{model}/{function} needs input {spec['name']!r}; got {sorted(inputs)}")
            dtype = np.int32 if spec["dtype"] == "int32" else self.dtype
            feed[spec["name"]] = np.asarray(inputs[spec["name"]], dtype=dtype)
        for spec in function_states(entry):  # the caller's cache arrays, updated in place
            if spec["name"] not in inputs:
                raise BackendError(f"{model}/{function} needs state {spec['name']!r}; got {sorted(inputs)}")
            feed[spec["name"]] = inputs[spec["name"]]
        from ...mil import ExecutionError, UnsupportedOpError

        try:
            out = executor.run(entry.get("function_name") or "main", feed)
        except (ExecutionError, UnsupportedOpError) as exc:
            raise BackendError(f"mil backend, {model}/{function}: {exc}") from exc
        missing = [s["name"] for s in entry["outputs"] if s["name"] not in out]
        if missing:
            raise BackendError(
                f"{entry['file']} ({model}/{function}) has no outputs {missing} that the manifest names; "
                "the package and manifest.json disagree: re-export"
            )
        return {s["name"]: out[s["name"]] for s in entry["outputs"]}

    def release(self, model: str) -> None:
        """Drop the executors (and so the prepared weights) of the package files `model`'s functions
        live in. Keyed by file, as the executors are: a file shared with another model is dropped
        too and reloads on that model's next use."""
        files = {f["file"] for f in self.manifest["models"].get(model, {}).get("functions", {}).values()}
        with self._lock:
            dropped = [self._executors.pop(file, None) for file in files]
        if any(x is not None for x in dropped):
            # an executor's compiled steps refer to one another, so its weights are freed only at a
            # collection: collect now, so that streamed scoring holds one package's weights at a time
            del dropped
            gc.collect()

    def close(self) -> None:
        with self._lock:
            self._executors.clear()
