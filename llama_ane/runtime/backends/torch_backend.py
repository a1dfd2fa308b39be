"""The torch backend: runs the torch modules of `llama_ane.model`, in fp32 or fp16, on CPU or CUDA.

They are the reference the exported MIL programs are written from, op for op, and the ground
truth those programs are checked against. Weights come from the export's own packages (compressed
weights decompressed as Core ML does: a copied export needs nothing else), or, given `checkpoint`,
from that checkpoint through the same loader and mapping the exporter uses. The modules of each
manifest model are built on first use, reading only that model's weights, and dropped by
`release`, so streamed scoring holds one model at a time.

With `direct_cache` (the default) the pipeline writes new K/V into the caches in place and passes
each chunk only the cache positions that hold tokens (see runtime/pipeline.py); with
`direct_cache=False` it runs the cache-update modules in the background, as a device does.

Everything runs on plain torch ops: nothing is compiled at import or load.
"""

from __future__ import annotations

import functools
import inspect
import threading
from pathlib import Path
from typing import Mapping

import numpy as np
import torch

from ...checkpoint.loader import Checkpoint, load_checkpoint
from ...contract.manifest import check_package_io, function_entry, function_states
from ...mil.package import MilPackage
from ...precision import PRECISIONS
from .base import Backend, BackendError
from ...contract.specs import CACHES
from .torch_modules import CheckpointWeights, ExportWeights, build_model

DTYPES = {name: p.torch for name, p in PRECISIONS.items()}


@functools.lru_cache(maxsize=None)
def _argument_names(module_class: type) -> tuple[tuple[str, bool], ...]:
    """The parameters of a module class's forward (the manifest names of its inputs), each with
    whether it has a default (an input some exports leave out), read once per class rather than on
    every step."""
    params = list(inspect.signature(module_class.forward).parameters.values())[1:]  # without self
    return tuple((p.name, p.default is not inspect.Parameter.empty) for p in params)


class TorchBackend(Backend):
    name = "torch"

    def __init__(self, export_dir: Path | None, manifest: dict, *, precision: str = "fp32",
                 device: str = "cpu", checkpoint: Checkpoint | str | Path | None = None,
                 weights_precision: str | None = None, direct_cache: bool = True):
        """`weights_precision` ("fp16"): round the checkpoint's weights and the RoPE tables to it
        before computing in `precision`, as an export in that precision stores them."""
        self.direct_cache = direct_cache
        if precision not in DTYPES or weights_precision not in (None, *DTYPES):
            raise BackendError(f"torch backend precision must be fp32 or fp16, got {precision!r}")
        self.round_to = DTYPES[weights_precision] if weights_precision else None
        self.manifest = manifest
        self.device = torch.device(device)
        self.torch_dtype = DTYPES[precision]
        self.dtype = PRECISIONS[precision].numpy
        if checkpoint is not None and not isinstance(checkpoint, Checkpoint):
            checkpoint = load_checkpoint(checkpoint)
        if checkpoint is None and export_dir is None:
            raise BackendError("the torch backend needs an export folder or a checkpoint to read weights from")
        self.checkpoint = checkpoint  # keeps a GGUF's extracted tokenizer folder alive
        self.weights = CheckpointWeights(checkpoint) if checkpoint is not None else ExportWeights(export_dir, manifest)
        self._built: dict[str, dict[str, torch.nn.Module]] = {}  # model -> {function: module}, built on use
        self._lock = threading.Lock()  # cache updates run on worker threads: build each model once

    def module(self, model: str, function: str) -> torch.nn.Module:
        """The module behind `function` of `model`, built on first use with only its weights."""
        with self._lock:
            if model not in self._built:
                if self.checkpoint is None:  # the export's own weights: its packages must be what the manifest says
                    for file in {f["file"] for f in self.manifest["models"].get(model, {}).get("functions", {}).values()}:
                        check_package_io(self.manifest, file, MilPackage(self.weights.folder / file).describe())
                try:
                    modules = build_model(self.weights, self.manifest, model, self.torch_dtype, self.round_to)
                except KeyError as e:
                    raise BackendError(f"torch backend: {e.args[0]}") from None
                for mod in {id(x): x for x in modules.values()}.values():
                    mod.to(device=self.device, dtype=self.torch_dtype)  # index buffers stay int32
                self._built[model] = modules
            built = self._built[model]
            if function not in built:
                raise BackendError(f"torch backend: no function {function!r} of model {model!r} in this export")
            return built[function]

    def prepare(self, models: list[str]) -> None:
        """Build the modules of `models` now rather than on first use (so a first step is not
        timed with the loading)."""
        for model in models:
            self.module(model, next(iter(self.manifest["models"][model]["functions"])))

    def release(self, model: str) -> None:
        """Drop the modules (and weights) of `model`; they are rebuilt from the checkpoint on next use."""
        with self._lock:
            self._built.pop(model, None)

    def close(self) -> None:
        with self._lock:
            self._built.clear()

    @torch.no_grad()
    def predict(self, model: str, function: str, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run the module of `function` of `model` on `inputs`, taken by the names of its forward's
        parameters (the manifest's names). A function whose caches are states (--kv-cache state)
        runs the same module: its outputs are returned with the window's K/V (k_new, v_new, and
        k_ring_new, v_ring_new where the chunk has a ring), which the program would write into its
        states and the pipeline writes into the caches."""
        entry = function_entry(self.manifest, model, function)
        module = self.module(model, function)
        args = {}
        for name, optional in _argument_names(type(module)):
            if optional and name not in inputs:  # an input only some exports have (a sliding mask)
                continue
            a = torch.from_numpy(inputs[name])  # views (a cache cut to its filled positions) as they are
            args[name] = a.to(self.device, self.torch_dtype if a.is_floating_point() else torch.int32)
        outs = module(**args)
        if isinstance(outs, torch.Tensor):
            outs = (outs,)
        names = [spec["name"] for spec in entry["outputs"]]
        states = function_states(entry)
        if states and len(outs) == len(names) + len(states):  # the new K/V the program writes into its states
            names += [CACHES[spec["name"]] for spec in states]
        return {name: t.cpu().numpy() for name, t in zip(names, outs)}
