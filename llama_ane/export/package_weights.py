"""The weights of one package, read from the checkpoint only when its program asks for them.

A `PackageWeights` maps our parameter names (as in the torch modules: "layers.0.q_proj.weight",
"embed_tokens.weight", "heads.1.weight", "cos_table", ...) to arrays in the export dtype. It reads
the checkpoint tensor by tensor through the same pure mapping the torch backend uses (layer_tensor,
as_conv), keeps each array once (every function of the package shares it), and never touches a
tensor that belongs to another package.
"""

from __future__ import annotations

import numpy as np
import torch

from ..chunks.models import vocab_splits
from ..config import LlamaConfig
from .programs import rope_weights
from .weights import Checkpoint, as_conv, layer_tensor

ROW_BLOCK = 1 << 24  # elements converted at a time: bounds the fp32 temporary of a 1 GB table


def to_array(t: torch.Tensor, dtype: type) -> np.ndarray:
    """A checkpoint tensor (any float dtype) as a numpy array of `dtype`, via fp32, in row blocks."""
    out = np.empty(tuple(t.shape), dtype)
    rows = max(1, ROW_BLOCK // max(1, t[0].numel())) if t.dim() > 1 else t.shape[0]
    for start in range(0, t.shape[0], rows):
        out[start:start + rows] = t[start:start + rows].to(torch.float32).numpy().astype(dtype)
    return out


def model_hf_names(cfg: LlamaConfig, model: str, layers: list[int]) -> set[str]:
    """The checkpoint tensors a package of `model` reads (what lazy loading may touch)."""
    if model == "embeddings":
        return {"model.embed_tokens.weight"}
    if model == "lm_head":
        head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
        return {head, "model.norm.weight"}
    from .weights import LAYER_TENSORS
    return {f"model.layers.{n}.{hf}" for n in layers for hf in LAYER_TENSORS.values()}


class PackageWeights:
    """Callable: our parameter name -> array in the export dtype, read once from `ckpt`.

    Parameters
    ----------
    ckpt : the checkpoint (tensors are read lazily through `ckpt.tensor`).
    layers : HF layer indices of a block chunk, in order ("layers.j.*" is HF layer `layers[j]`).
    dtype : np.float16 or np.float32.
    rope_positions : rows of the RoPE tables the embeddings functions may read.
    """

    def __init__(self, ckpt: Checkpoint, dtype: type, layers: list[int] | None = None, rope_positions: int = 0):
        self.ckpt = ckpt
        self.cfg = ckpt.config
        self.dtype = dtype
        self.layers = list(layers or [])
        self.rope_positions = rope_positions
        self._arrays: dict[str, np.ndarray] = {}

    def __call__(self, name: str) -> np.ndarray:
        if name not in self._arrays:
            self._arrays[name] = self._read(name)
        return self._arrays[name]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for k, a in self._arrays.items() if not k.startswith("heads."))

    def _read(self, name: str) -> np.ndarray:
        if name.startswith("layers."):
            _, j, ours = name.split(".", 2)
            return to_array(layer_tensor(self.ckpt, self.layers[int(j)], ours), self.dtype)
        if name == "embed_tokens.weight":
            return to_array(self.ckpt.tensor("model.embed_tokens.weight"), self.dtype)
        if name in ("cos_table", "sin_table"):
            tables = rope_weights(self.cfg, self.rope_positions, self.dtype)
            self._arrays.update(tables)
            return tables[name]
        if name == "norm.weight":
            return to_array(self.ckpt.tensor("model.norm.weight"), self.dtype)
        if name.startswith("heads."):
            matrix = self("lm_head_matrix")
            i = int(name.split(".")[1])
            splits = vocab_splits(self.cfg.vocab_size)
            start = sum(splits[:i])
            return as_conv(torch.from_numpy(matrix[start:start + splits[i]])).numpy()
        if name == "lm_head_matrix":
            hf = "model.embed_tokens.weight" if self.cfg.tie_word_embeddings else "lm_head.weight"
            return to_array(self.ckpt.tensor(hf), self.dtype)
        raise KeyError(f"no weight {name!r} in this package")
