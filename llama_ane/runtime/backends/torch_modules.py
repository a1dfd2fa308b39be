"""Build the torch modules behind each (model, function) of an export: what the torch backend
runs, and the reference the exported programs are checked against.

Everything about the layout (chunks, the embedding table's files, the LM head's files, windows)
is read from the manifest, so the modules are those of this export whatever options made it. The
weights come from one of two sources with the same three methods:

  * `CheckpointWeights`: the source checkpoint through the pure HF -> ANE mapping (what the
    exported weights were made from);
  * `ExportWeights`: the packages themselves, compressed weights decompressed as Core ML defines
    it (exactly what the export ships; a copied export needs nothing else).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ...checkpoint.loader import Checkpoint
from ...checkpoint.mapping import (chunk_state_dict, embeddings_state_dict, layer_tensors,
                                   lm_head_state_dict, per_layer_state_dict)
from ...model.embeddings import per_layer_names, per_layer_rows
from ...model.functions import Site, model_kind
from ...model.kinds import KINDS
from ...model.lm_head import vocab_splits
from ...config import LlamaConfig
from ...contract.manifest import model_names, ring_of


class CheckpointWeights:
    """Module weights read from the source checkpoint (tensor by tensor, straight into `dtype`)."""

    def __init__(self, ckpt: Checkpoint):
        self.ckpt = ckpt

    def table(self, model: str, rows: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
        """Rows [start, end) of the embedding table, (rows, C)."""
        return embeddings_state_dict(self.ckpt, dtype, rows)["embed_tokens.weight"]

    def rope(self, model: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The RoPE tables (positions, D) to use instead of the modules' own float32 ones, if any."""
        return None

    def per_layer(self, model: str, rows: tuple[int, int], project: bool, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Gemma 4's per-layer input weights (PerLayerInputs' state dict) of the embeddings file of
        vocabulary rows `rows`: its rows of the per-layer table, and the projection where it `project`s."""
        cfg = self.ckpt.config
        return per_layer_state_dict(self.ckpt, dtype, per_layer_names(cfg, rows, project), per_layer_rows(cfg, rows))

    def chunk(self, model: str, layers: list[int], dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """A BlockChunk's state dict ("layers.j.q_proj.weight", ...) for HF layers `layers`."""
        return chunk_state_dict(self.ckpt, layers, dtype)

    def head(self, model: str, heads: list[int], dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """An LMHead's state dict for vocabulary splits `heads` ("heads.i" is split heads[i])."""
        return lm_head_state_dict(self.ckpt, vocab_splits(self.ckpt.config.vocab_size), dtype, heads)


class ExportWeights:
    """Module weights read from an export's packages: the weights it ships, decompressed.

    The exporter names every weight after the module parameter it stands for (dots as
    underscores, see model.layers.ops.Graph.weight), so a module's state dict is read by name.
    """

    def __init__(self, folder: Path, manifest: dict):
        self.folder, self.manifest = Path(folder), manifest

    def _read(self, model: str, names: list[str], dtype: torch.dtype) -> dict[str, torch.Tensor]:
        from ...mil.weights import read_weights

        entry = next(iter(self.manifest["models"][model]["functions"].values()))
        values = read_weights(self.folder / entry["file"], entry["function_name"],
                              [n.replace(".", "_") for n in names])
        return {n: torch.from_numpy(values[n.replace(".", "_")]).to(dtype) for n in names}

    def table(self, model: str, rows: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
        return self._read(model, ["embed_tokens.weight"], dtype)["embed_tokens.weight"]

    def per_layer(self, model: str, rows: tuple[int, int], project: bool, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        cfg = LlamaConfig.from_dict(self.manifest["config"])
        return self._read(model, per_layer_names(cfg, rows, project), dtype)

    def rope(self, model: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The RoPE tables as the export stores them (computed in float32, kept in its precision)."""
        tables = self._read(model, ["cos_table", "sin_table"], torch.float32)
        return tables["cos_table"], tables["sin_table"]

    def chunk(self, model: str, layers: list[int], dtype: torch.dtype) -> dict[str, torch.Tensor]:
        cfg = LlamaConfig.from_dict(self.manifest["config"])
        return self._read(model, [f"layers.{j}.{name}" for j, n in enumerate(layers) for name in layer_tensors(cfg, n)],
                          dtype)

    def head(self, model: str, heads: list[int], dtype: torch.dtype) -> dict[str, torch.Tensor]:
        state = self._read(model, ["norm.weight", *(f"heads.{j}.weight" for j in heads)], dtype)
        return {"norm.weight": state["norm.weight"], **{f"heads.{i}.weight": state[f"heads.{j}.weight"]
                                                         for i, j in enumerate(heads)}}


@torch.no_grad()
def build_model(weights: CheckpointWeights | ExportWeights | Checkpoint, manifest: dict, model: str,
                dtype: torch.dtype = torch.float32, round_to: torch.dtype | None = None) -> dict[str, torch.nn.Module]:
    """The eval-mode modules of ONE manifest model, {function: module}, reading only its weights.

    Functions of one model share one module, or at least its weights. Weights are read straight
    into `dtype` (buffers such as the RoPE tables are made in float32; cast the modules to move
    them); a bare Checkpoint means CheckpointWeights. With `round_to` (e.g. float16), checkpoint
    weights and the modules' own RoPE tables are first rounded to it, as an export in that
    precision stores them, then computed in `dtype`. Raises KeyError for a model the manifest
    does not have.
    """
    if round_to is not None and round_to != dtype:
        modules = build_model(weights, manifest, model, round_to)
        for module in {id(m): m for m in modules.values()}.values():
            for name, buffer in list(module.named_buffers()):
                if buffer.is_floating_point() and buffer.dtype != round_to:  # RoPE tables kept in float32
                    owner = module.get_submodule(name.rpartition(".")[0]) if "." in name else module
                    setattr(owner, name.rpartition(".")[2], buffer.to(round_to))
            module.to(dtype)
        return modules
    if isinstance(weights, Checkpoint):
        weights = CheckpointWeights(weights)
    cfg = LlamaConfig.from_dict(manifest["config"])
    m = manifest
    if model not in model_names(m):
        raise KeyError(f"no model {model!r} in this export")
    functions = m["models"][model]["functions"]  # each function's module follows its specs
    kind = model_kind(model)
    rows = m["embeddings"]["vocab_ranges"][m["embeddings"]["models"].index(model)] \
        if kind in ("embeddings", "embeddings_part") else None
    layers = next((c["layers"] for c in m["chunks"] if c["model"] == model), ())
    site = Site(m["context_length"], m["prefill_length"], m.get("suffix_length", 0), m.get("branch_width", 0),
                m.get("verify_window", 0), ring_of(m), tuple(layers), None if rows is None else tuple(rows),
                head=m["lm_head"].get("folded_into") == model)
    modules = KINDS[kind].modules(weights, model, cfg, functions, site, dtype)
    for module in modules.values():
        module.eval()
    return modules


__all__ = ["build_model"]
