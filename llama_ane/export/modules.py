"""Build the torch modules of an export from a checkpoint: the ones traced, and the torch backend."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch

from ..chunks.cascade import BranchChunk, BranchEmbeddings, SuffixUpdate
from ..chunks.models import BlockChunk, CacheUpdate, Embeddings, LMHead, vocab_splits
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


def _with_state(make: Callable[[], torch.nn.Module], state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """`make()` built on the meta device and given `state`'s tensors as its parameters.

    Nothing is initialised at random only to be overwritten, so building a model costs one copy
    of its weights, not two (a chunk of an 8B model is gigabytes in fp32). Only for modules whose
    every tensor is in the state dict (no buffers): strict loading checks the names.
    """
    with torch.device("meta"):
        module = make()
    module.load_state_dict(state, strict=True, assign=True)
    return module


@torch.no_grad()
def build_model(ckpt: Checkpoint, model: str, plan: list[list[int]], context_length: int, prefill_length: int,
                branch_width: int = 0, suffix_length: int = 0) -> dict[str, torch.nn.Module]:
    """The fp32 eval-mode modules of ONE manifest model, {function: module}, reading only its weights.

    `model` is "embeddings", "chunk_<i>" (HF layers `plan[i]`), "lm_head" or "cache_update" (no
    weights). Functions of one model share one module, or at least its weights. Raises KeyError
    for a model the plan does not have.
    """
    cfg = ckpt.config
    modules: dict[str, torch.nn.Module] = {}
    if model == "embeddings":
        embed = torch.nn.Embedding.from_pretrained(embeddings_state_dict(ckpt)["embed_tokens.weight"], freeze=False)
        # each function's module gets a one-row placeholder table, replaced by the shared one
        placeholder = dataclasses.replace(cfg, vocab_size=1)
        for fn in FUNCTIONS:
            e = Embeddings(placeholder, context_length, window_of(fn, prefill_length))
            e.embed_tokens = embed  # one table for every function
            modules[fn] = e
        if branch_width:
            modules[BRANCHES] = BranchEmbeddings(cfg, embed, context_length, branch_width, suffix_length)
    elif model == "lm_head":
        splits = vocab_splits(cfg.vocab_size)
        head = _with_state(lambda: LMHead(cfg), lm_head_state_dict(ckpt, splits))
        modules = {fn: head for fn in (*FUNCTIONS, *([BRANCHES] if branch_width else []))}
    elif model == "cache_update":
        for n in sorted({len(layers) for layers in plan}):  # one function per chunk size
            for fn in FUNCTIONS:
                modules[cache_update_function(fn, n)] = CacheUpdate(context_length, window_of(fn, prefill_length))
            if branch_width:
                modules[cache_update_function(BRANCHES, n)] = SuffixUpdate(cfg, n, suffix_length)
    else:
        names = {chunk_model_name(i): layers for i, layers in enumerate(plan)}
        if model not in names:
            raise KeyError(f"no model {model!r} in this export")
        layers = names[model]
        chunk = _with_state(lambda: BlockChunk(cfg, layers, context_length), chunk_state_dict(ckpt, layers))
        modules = {fn: chunk for fn in FUNCTIONS}
        if branch_width:
            modules[BRANCHES] = BranchChunk(chunk, suffix_length)
    for m in modules.values():
        m.eval()
    return modules


def model_names(plan: list[list[int]]) -> list[str]:
    """Every manifest model of an export with chunk plan `plan`, in pipeline order."""
    return ["embeddings", *(chunk_model_name(i) for i in range(len(plan))), "lm_head", "cache_update"]


def build_model_set(ckpt: Checkpoint, plan: list[list[int]], context_length: int, prefill_length: int,
                    branch_width: int = 0, suffix_length: int = 0) -> ModelSet:
    """Instantiate and load all modules in fp32, in eval mode (every model's weights at once)."""
    return ModelSet({(model, fn): module for model in model_names(plan)
                     for fn, module in build_model(ckpt, model, plan, context_length, prefill_length,
                                                   branch_width, suffix_length).items()})
