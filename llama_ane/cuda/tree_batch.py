"""Attention over a tree of shared prefixes behind one plan: the flattened tree kernel, or the
two-level cascade where the tree is one.

A tree in which no node below the root is seen by two queries (a shared prompt and private
branches: few-shot examples, parallel samples) is exactly the two-level cascade's case: the root is
the shared prefix and every query's path below it is its own suffix. There the cascade's dedicated
kernels win; where nodes below the root are shared (speculative token trees) the tree kernel
reads each of them once and wins on most trees. ``path="auto"`` picks by that structure
(``benchmarks/tree_gpu.py`` measures both on each kind of tree).
"""

from __future__ import annotations

from typing import Sequence

import torch

from . import ops
from .cascade import SharedPrefixBatch
from .tree import build_tree_plan, cascade_tables, shares_below_root

PATHS = ("auto", "tree", "cascade")


class TreeBatch:
    """Plan once per tree, run per layer: every query attends to its node and its ancestors.

    Parameters
    ----------
    parents, node_slots, query_nodes : the tree as for :func:`~llama_ane.cuda.tree.build_tree_plan`
        (node tokens as KV-cache slots ``page * page_size + offset``)
    num_qo_heads, num_kv_heads, head_dim, page_size : attention shape
    path : ``"auto"`` (cascade when no node below the root is shared and the tree can be one),
        ``"tree"`` or ``"cascade"``
    """

    def __init__(self, parents: Sequence[int], node_slots: Sequence[Sequence[int]],
                 query_nodes: Sequence[int], *, num_qo_heads: int, num_kv_heads: int,
                 head_dim: int, page_size: int, path: str = "auto",
                 device: torch.device | str = "cuda") -> None:
        if path not in PATHS:
            raise ValueError(f"path must be one of {PATHS}, got {path!r}")
        tables = None
        if path == "cascade" or path == "auto" and not shares_below_root(parents, query_nodes):
            tables = cascade_tables(parents, node_slots, query_nodes, page_size)
        if path == "auto":
            path = "cascade" if tables is not None else "tree"
        if path == "cascade" and tables is None:
            raise ValueError("the cascade path needs one root above every query and node tokens "
                             "that fill KV pages from their first slot; use path='tree'")
        self.path = path
        device = torch.device(device)
        if path == "tree":
            self.plan = build_tree_plan(parents, node_slots, query_nodes,
                                        group=num_qo_heads // num_kv_heads,
                                        num_kv_heads=num_kv_heads, device=device)
        else:
            prefix_pages, prefix_len, indptr, indices, last = tables

            def i32(values):
                return torch.tensor(values, dtype=torch.int32, device=device)

            self.plan = SharedPrefixBatch(num_qo_heads, num_kv_heads, head_dim, page_size,
                                          device=device, path="cascade")
            self.plan.plan(i32(prefix_pages), prefix_len, i32(indptr), i32(indices), i32(last))

    def run(self, q: torch.Tensor, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``q`` [n_queries, num_qo_heads, head_dim] -> ``o`` (same shape) and natural-log
        ``lse`` [n_queries, num_qo_heads]."""
        if self.path == "tree":
            return ops.tree_attention(q, kv_cache, self.plan)
        return self.plan.run(q, kv_cache)
