"""What every checkpoint reader gives: a `Checkpoint` (its config and a tensor getter by Hugging
Face name), what its header says of each tensor (`TensorInfo`), and the error for one we cannot read."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from ..config import LlamaConfig
from ..errors import LlamaANEError


class CheckpointError(LlamaANEError, ValueError):
    """A checkpoint we cannot read; the message says what is wrong and what to do."""


@dataclass(frozen=True)
class TensorInfo:
    """What a checkpoint's header says of one tensor, before any of its data is read: its shape
    (as Hugging Face lays it out) and its stored dtype (a safetensors or GGML type name)."""

    shape: tuple[int, ...]
    dtype: str


@dataclass
class Checkpoint:
    """A loaded checkpoint: its config, a tensor getter by HF name, and its tokenizer files.

    `get_rows(name, start, end)`, where the format allows it, reads rows start..end-1 of a tensor
    without the rest (safetensors slices); otherwise `rows` reads the tensor and slices it.
    """

    name: str
    config: LlamaConfig
    source: dict
    tokenizer_dir: Path
    get: Callable[[str], torch.Tensor]
    _tmp: list = field(default_factory=list, repr=False)
    get_rows: Callable[[str, int, int], torch.Tensor] | None = None
    tensors: dict[str, TensorInfo] = field(default_factory=dict, repr=False)

    def tensor(self, hf_name: str) -> torch.Tensor:
        try:
            return self.get(hf_name)
        except KeyError:
            raise self._missing(hf_name) from None

    def rows(self, hf_name: str, start: int, end: int) -> torch.Tensor:
        """Rows start..end-1 of tensor `hf_name` (e.g. a part of the vocabulary of an embedding table)."""
        if self.get_rows is None:
            return self.tensor(hf_name)[start:end]
        try:
            return self.get_rows(hf_name, start, end)
        except KeyError:
            raise self._missing(hf_name) from None

    def _missing(self, hf_name: str) -> CheckpointError:
        return CheckpointError(f"checkpoint {self.name} has no tensor {hf_name!r}; is it a complete LlamaForCausalLM?")
