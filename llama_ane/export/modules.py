"""Build the torch modules of an export from a checkpoint: the ones traced, and the torch backend."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..chunks.models import BlockChunk, CacheUpdate, Embeddings, LMHead
from .specs import chunk_model_name
from .weights import Checkpoint, chunk_state_dict, embeddings_state_dict, lm_head_state_dict


@dataclass
class ModelSet:
    """Every module of an export. Modules that depend on the window length S come per S; they
    share their weights (the embedding table) across S."""

    embeddings: dict[int, Embeddings]
    chunks: list[BlockChunk]
    lm_head: LMHead
    cache_update: dict[int, CacheUpdate]

    def to(self, dtype: torch.dtype, device: str | torch.device = "cpu") -> "ModelSet":
        for m in self.all_modules():
            m.to(device=device, dtype=dtype)
        for e in self.embeddings.values():  # index buffers stay int32
            e.cache_positions = e.cache_positions.to(torch.int32)
            e.offsets = e.offsets.to(torch.int32)
        for c in self.cache_update.values():
            c.slots = c.slots.to(torch.int32)
            c.offsets = c.offsets.to(torch.int32)
        return self

    def module(self, model: str, window: int) -> torch.nn.Module:
        """The module behind manifest model `model` for query length `window`."""
        if model == "embeddings":
            return self.embeddings[window]
        if model == "lm_head":
            return self.lm_head
        if model == "cache_update":
            return self.cache_update[window]
        names = [chunk_model_name(i) for i in range(len(self.chunks))]
        if model not in names:
            raise KeyError(f"no model {model!r} in this export")
        return self.chunks[names.index(model)]

    def all_modules(self) -> list[torch.nn.Module]:
        return [*self.embeddings.values(), *self.chunks, self.lm_head, *self.cache_update.values()]


@torch.no_grad()
def build_model_set(ckpt: Checkpoint, plan: list[list[int]], context_length: int,
                    windows: list[int]) -> ModelSet:
    """Instantiate and load all modules in fp32, in eval mode."""
    cfg = ckpt.config
    emb_state = embeddings_state_dict(ckpt)
    embeddings = {}
    for s in windows:
        e = Embeddings(cfg, context_length, s)
        e.load_state_dict(emb_state, strict=False)
        if embeddings:  # share the table across windows
            e.embed_tokens.weight = next(iter(embeddings.values())).embed_tokens.weight
        embeddings[s] = e.eval()
    chunks = []
    for layers in plan:
        chunk = BlockChunk(cfg, layers, context_length)
        chunk.load_state_dict(chunk_state_dict(ckpt, layers), strict=True)
        chunks.append(chunk.eval())
    head = LMHead(cfg)
    head.load_state_dict(lm_head_state_dict(ckpt, head.splits), strict=True)
    updates = {s: CacheUpdate(context_length, s).eval() for s in windows}
    return ModelSet(embeddings, chunks, head.eval(), updates)
