"""The torch backend: runs the very modules that the exporter traces, in fp32 or fp16, on CPU or CUDA.

It is the ground truth the converted programs are checked against. Weights come from the source
checkpoint recorded in the manifest (or one passed explicitly), through the same loader and
mapping the exporter uses.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

import numpy as np
import torch

from ...export.manifest import function_entry
from ...export.modules import build_model_set
from ...export.weights import Checkpoint, load_checkpoint, source_path
from .base import Backend, BackendError

DTYPES = {"fp32": torch.float32, "fp16": torch.float16}


class TorchBackend(Backend):
    name = "torch"

    def __init__(self, export_dir: Path | None, manifest: dict, *, precision: str = "fp32",
                 device: str = "cpu", checkpoint: Checkpoint | str | Path | None = None):
        if precision not in DTYPES:
            raise BackendError(f"torch backend precision must be fp32 or fp16, got {precision!r}")
        self.manifest = manifest
        self.device = torch.device(device)
        self.torch_dtype = DTYPES[precision]
        self.dtype = np.dtype(np.float32 if precision == "fp32" else np.float16)
        if not isinstance(checkpoint, Checkpoint):
            checkpoint = load_checkpoint(checkpoint if checkpoint is not None else source_path(manifest["source"]))
        self.checkpoint = checkpoint  # keeps a GGUF's extracted tokenizer folder alive
        plan = [c["layers"] for c in manifest["chunks"]]
        self.models = build_model_set(checkpoint, plan, manifest["context_length"], manifest["prefill_length"],
                                      manifest.get("branch_width", 0), manifest.get("suffix_length", 0))
        self.models.to(self.torch_dtype, self.device)

    def module(self, model: str, function: str) -> torch.nn.Module:
        """The module that was (or would be) traced for `function` of `model`."""
        try:
            return self.models.module(model, function)
        except KeyError as e:
            raise BackendError(f"torch backend: {e.args[0]}") from None

    @torch.no_grad()
    def predict(self, model: str, function: str, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        entry = function_entry(self.manifest, model, function)
        args = []
        for spec in entry["inputs"]:
            a = torch.from_numpy(np.ascontiguousarray(inputs[spec["name"]]))
            args.append(a.to(self.device, self.torch_dtype if a.is_floating_point() else torch.int32))
        outs = self.module(model, function)(*args)
        if isinstance(outs, torch.Tensor):
            outs = (outs,)
        return {spec["name"]: t.cpu().numpy() for spec, t in zip(entry["outputs"], outs)}
