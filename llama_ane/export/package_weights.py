"""The weights of one package, read from the checkpoint only when its program asks for them.

A `PackageWeights` maps our parameter names (as in the torch modules: "layers.0.q_proj.weight",
"embed_tokens.weight", "heads.1.weight", "cos_table", ...) to arrays in the export dtype. It reads
the checkpoint tensor by tensor through the same pure mapping the torch backend uses (layer_tensor,
as_conv) and never touches a tensor that belongs to another package. Each name is read once: the
program builder keeps what it was given (or its compressed form) for every function; only what
several names share (the LM head matrix the heads are cut from, the pair of RoPE tables) is kept
here.
"""

from __future__ import annotations

import numpy as np
import torch

from ..model.lm_head import vocab_splits
from ..config import LlamaConfig
from ..contract.specs import model_kind
from ..model.embeddings import per_layer_rows, rope_weights
from ..checkpoint.loader import Checkpoint, CheckpointError
from ..checkpoint.mapping import (PER_LAYER_TENSORS, as_conv, final_norm, final_norm_name, layer_sources, layer_tensor,
                                  layer_tensors, per_layer_state_dict)

ROW_BLOCK = 1 << 24  # elements converted at a time: bounds the fp32 temporary of a 1 GB table


def to_array(t: torch.Tensor, dtype: type, name: str = "a weight") -> np.ndarray:
    """A checkpoint tensor (any float dtype) as a numpy array of `dtype`, via fp32, in row blocks.

    Each block is checked for NaN and infinity as it is converted (the one pass over the weights an
    export makes, verified or not): such a weight exports without complaint and then breaks
    sampling. `name` (the checkpoint's tensor) is named in the CheckpointError.
    """
    out = np.empty(tuple(t.shape), dtype)
    rows = max(1, ROW_BLOCK // max(1, t[0].numel())) if t.dim() > 1 else t.shape[0]
    for start in range(0, t.shape[0], rows):
        block = t[start:start + rows].to(torch.float32).numpy()
        with np.errstate(over="ignore"):  # an overflow is found just below, and named
            out[start:start + rows] = block.astype(dtype)
        if not np.isfinite(out[start:start + rows]).all():
            raise _not_finite(block, dtype, name)
    return out


def rows_array(ckpt: Checkpoint, hf_name: str, rows: tuple[int, int], dtype: type) -> np.ndarray:
    """Rows [start, end) of checkpoint tensor `hf_name` as a numpy array of `dtype` (to_array), read
    from the checkpoint a block of rows at a time: a large table (Gemma 4's per-layer table, 4.7 GB
    in fp16 at E2B) is never held whole, in its own dtype or in fp32."""
    start, end = rows
    if ckpt.get_rows is None:  # a format read whole anyway
        return to_array(ckpt.rows(hf_name, start, end), dtype, hf_name)
    first = ckpt.rows(hf_name, start, min(end, start + 1))
    step = max(1, ROW_BLOCK // max(1, first[0].numel()))
    out = np.empty((end - start, *first.shape[1:]), dtype)
    for a in range(start, end, step):
        out[a - start:min(end, a + step) - start] = to_array(ckpt.rows(hf_name, a, min(end, a + step)), dtype, hf_name)
    return out


def _not_finite(block: np.ndarray, dtype: type, name: str) -> CheckpointError:
    """The error for a block with NaN/inf after its cast: in the checkpoint, or made by the cast."""
    if not np.isfinite(block).all():
        kind = "NaN" if np.isnan(block).any() else "infinite"
        return CheckpointError(f"tensor {name!r} holds {kind} values; the checkpoint is damaged: "
                               "download it again")
    largest = float(np.abs(block).max())
    return CheckpointError(f"tensor {name!r} has values up to {largest:.4g}, beyond {np.dtype(dtype).name}'s "
                           f"range ({float(np.finfo(dtype).max):.0f}); export it with --precision fp32")


def model_hf_names(cfg: LlamaConfig, model: str, layers: list[int], rows: tuple[int, int] | None = None) -> set[str]:
    """The checkpoint tensors a package of `model` reads (what lazy loading may touch); a chunk with
    vocabulary `rows` carries the LM head."""
    kind = model_kind(model)
    head = {"model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight", final_norm_name(cfg)}
    if kind in ("embeddings", "embeddings_part") and cfg.per_layer_input_size:  # Gemma 4's per-layer inputs too
        return {"model.embed_tokens.weight"} | {hf for hf, _ in PER_LAYER_TENSORS.values()}
    if kind in ("embeddings", "embeddings_part"):
        return {"model.embed_tokens.weight"}
    if kind == "lm_head":
        return head
    return {f"model.layers.{n}.{hf}" for n in layers for hf in layer_sources(cfg, n)} | (head if rows else set())


class PackageWeights:
    """Callable: our parameter name -> array in the export dtype, read once from `ckpt`.

    Parameters
    ----------
    ckpt : the checkpoint (tensors are read lazily through `ckpt.tensor`).
    layers : HF layer indices of a block chunk, in order ("layers.j.*" is HF layer `layers[j]`).
    dtype : np.float16 or np.float32.
    rope_positions : rows of the RoPE tables the embeddings functions may read.
    context_length : the tokens the export holds (longrope picks its factors for a sequence that long).
    rows : [start, end) vocabulary rows of an embeddings or LM head file: "embed_tokens.weight" is
        those rows of the table, and only the rows of the heads inside them are read.
    """

    def __init__(self, ckpt: Checkpoint, dtype: type, layers: list[int] | None = None, rope_positions: int = 0,
                 rows: tuple[int, int] | None = None, context_length: int | None = None):
        self.ckpt = ckpt
        self.cfg = ckpt.config
        self.dtype = dtype
        self.layers = list(layers or [])
        self.rope_positions, self.context_length = rope_positions, context_length
        self.rows = rows or (0, self.cfg.vocab_size)
        self._arrays: dict[str, np.ndarray] = {}

    def __call__(self, name: str) -> np.ndarray:
        if name in self._arrays:
            return self._arrays[name]
        return self._read(name)

    def _read(self, name: str) -> np.ndarray:
        if name.startswith("layers."):
            _, j, ours = name.split(".", 2)
            layer = self.layers[int(j)]
            return to_array(layer_tensor(self.ckpt, layer, ours), self.dtype,
                            f"model.layers.{layer}.{layer_tensors(self.cfg, layer)[ours]}")
        if name == "embed_tokens.weight":
            return to_array(self.ckpt.rows("model.embed_tokens.weight", *self.rows), self.dtype,
                            "model.embed_tokens.weight")
        if name == "embed_tokens_per_layer.weight":  # this file's rows of Gemma 4's per-layer table
            return rows_array(self.ckpt, PER_LAYER_TENSORS[name][0], per_layer_rows(self.cfg, self.rows), self.dtype)
        if name in PER_LAYER_TENSORS:
            return to_array(per_layer_state_dict(self.ckpt, torch.float32, (name,))[name], self.dtype,
                            PER_LAYER_TENSORS[name][0])
        if name in ("cos_table", "sin_table"):
            tables = rope_weights(self.cfg, self.rope_positions, self.dtype, self.context_length)
            self._arrays.update(tables)  # made together, read one at a time
            return tables[name]
        if name == "norm.weight":
            return to_array(final_norm(self.ckpt), self.dtype, final_norm_name(self.cfg))
        if name.startswith("heads."):  # heads.j: vocabulary split j, inside this file's rows
            if "lm_head_matrix" not in self._arrays:  # read once, cut into every head
                self._arrays["lm_head_matrix"] = self._read("lm_head_matrix")
            matrix = self._arrays["lm_head_matrix"]
            j = int(name.split(".")[1])
            splits = vocab_splits(self.cfg.vocab_size)
            start = sum(splits[:j]) - self.rows[0]
            if start < 0 or start + splits[j] > len(matrix):
                raise KeyError(f"{name} is not inside this file's vocabulary rows {self.rows}")
            return as_conv(torch.from_numpy(matrix[start:start + splits[j]])).numpy()
        if name == "lm_head_matrix":  # this file's rows of the (tied or untied) output matrix
            hf = "model.embed_tokens.weight" if self.cfg.tie_word_embeddings else "lm_head.weight"
            return to_array(self.ckpt.rows(hf, *self.rows), self.dtype, hf)
        raise KeyError(f"no weight {name!r} in this package")
