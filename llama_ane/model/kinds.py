"""The kinds of model an export holds (`functions.model_kind`), each with what makes its functions:
the specs of their inputs, outputs and states, the MIL builder of each function and the torch
modules that run them. The manifest's specs (contract.specs), the exporter's programs
(export.programs) and the torch backend's modules (runtime.backends.torch_modules) all go through
`KINDS`, so a new kind of model is one module here and one row below."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from . import cache_update, chunk, embeddings, lm_head
from .functions import model_kind


@dataclass(frozen=True)
class Kind:
    functions: Callable[..., dict[str, dict]]  # the specs of its functions, from the export's Layout
    program: Callable  # (Graph, config, function, io, Site) -> the MIL builder of that function
    modules: Callable  # (weights, model, config, {function: io}, Site, dtype) -> {function: torch module}


KINDS = {
    "embeddings": Kind(embeddings.functions, embeddings.program, embeddings.modules),
    "embeddings_part": Kind(embeddings.part_functions, embeddings.part_program, embeddings.part_modules),
    "chunk": Kind(chunk.functions, chunk.program, chunk.modules),
    "lm_head": Kind(lm_head.functions, lm_head.program, lm_head.modules),
    "cache_update": Kind(cache_update.functions, cache_update.program, cache_update.modules),
}


def kind_of(model: str) -> Kind:
    """The kind of manifest model `model` ("embeddings", "chunk_0", "lm_head_1", ...)."""
    return KINDS[model_kind(model)]


__all__ = ["KINDS", "Kind", "kind_of"]
