"""CUDA path: Triton shared-prefix attention kernels, their torch references and a decode engine.

Submodules (each imported on first use, so ``import llama_ane.cuda`` needs neither a GPU nor
triton; only launching a kernel does):

* ``kernels``    pure ``@triton.jit`` kernels
* ``ops``        checked wrappers: batch_decode, shared_prefix_attention (paged or ordered
                 pages), merge_state(s), merge_state_in_place, tree_attention
* ``cascade``    SharedPrefixBatch (two-level cascade with auto-dispatch: built once, then
                 plan per batch and run per layer), cascade_attention (one shot)
* ``cost_model`` the cascade-or-decode model; ``splits`` the split-KV heuristics
* ``tree``       DeFT-style tree plans; ``tree_batch`` TreeBatch (tree kernel or cascade per tree)
* ``reference``  torch references; ``lse`` LSE conventions
* ``engine``     a small Llama decode engine that uses the kernels
* ``runahead``   KV-Runahead: parallel prefill of one prompt across processes (torch.distributed)
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "batch_decode": "ops",
    "shared_prefix_attention": "ops",
    "merge_state": "ops",
    "merge_state_in_place": "ops",
    "merge_states": "ops",
    "tree_attention": "ops",
    "SharedPrefixBatch": "cascade",
    "cascade_attention": "cascade",
    "CostModel": "cost_model",
    "build_tree_plan": "tree",
    "TreeBatch": "tree_batch",
    "lse_base2_to_natural": "lse",
    "lse_natural_to_base2": "lse",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'llama_ane.cuda' has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
