"""Build the torch modules of an export from a checkpoint: the ones traced, and the torch backend."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..chunks.cascade import BranchChunk, BranchEmbeddings, SuffixUpdate
from ..chunks.models import BlockChunk, CacheUpdate, Embeddings, LMHead
from .specs import BRANCHES, FUNCTIONS, cache_update_function, chunk_model_name, window_of
from .weights import Checkpoint, chunk_state_dict, embeddings_state_dict, lm_head_state_dict


@dataclass
class ModelSet:
    """The module behind every (model, function) of an export. Functions of one model share weights."""

    modules: dict[tuple[str, str], torch.nn.Module]

    def module(self, model: str, function: str) -> torch.nn.Module:
        try:
            return self.modules[(model, function)]
        except KeyError:
            raise KeyError(f"no function {function!r} of model {model!r} in this export") from None

    def to(self, dtype: torch.dtype, device: str | torch.device = "cpu") -> "ModelSet":
        """Cast floating weights and buffers (index buffers stay int32) and move them."""
        for m in {id(m): m for m in self.modules.values()}.values():
            m.to(device=device, dtype=dtype)
        return self


@torch.no_grad()
def build_model_set(ckpt: Checkpoint, plan: list[list[int]], context_length: int, prefill_length: int,
                    branch_width: int = 0, suffix_length: int = 0) -> ModelSet:
    """Instantiate and load all modules in fp32, in eval mode."""
    cfg = ckpt.config
    functions = list(FUNCTIONS) + ([BRANCHES] if branch_width else [])
    modules: dict[tuple[str, str], torch.nn.Module] = {}

    embed = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size)
    embed.weight.copy_(embeddings_state_dict(ckpt)["embed_tokens.weight"])
    for fn in FUNCTIONS:
        e = Embeddings(cfg, context_length, window_of(fn, prefill_length))
        e.embed_tokens = embed  # one table for every function
        modules[("embeddings", fn)] = e
    if branch_width:
        modules[("embeddings", BRANCHES)] = BranchEmbeddings(cfg, embed, context_length, branch_width, suffix_length)

    for i, layers in enumerate(plan):
        chunk = BlockChunk(cfg, layers, context_length)
        chunk.load_state_dict(chunk_state_dict(ckpt, layers), strict=True)
        name, n = chunk_model_name(i), len(layers)
        for fn in FUNCTIONS:
            modules[(name, fn)] = chunk
            modules[("cache_update", cache_update_function(fn, n))] = CacheUpdate(
                context_length, window_of(fn, prefill_length))
        if branch_width:
            modules[(name, BRANCHES)] = BranchChunk(chunk, suffix_length)
            modules[("cache_update", cache_update_function(BRANCHES, n))] = SuffixUpdate(cfg, n, suffix_length)

    head = LMHead(cfg)
    head.load_state_dict(lm_head_state_dict(ckpt, head.splits), strict=True)
    for fn in functions:
        modules[("lm_head", fn)] = head
    for m in modules.values():
        m.eval()
    return ModelSet(modules)
