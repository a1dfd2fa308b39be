"""Planning tree attention: KV-guided grouping over a flattened, evenly split tree KV (DeFT).

A decoding tree is a set of nodes, each holding some tokens of KV (the prompt at the root, shared
few-shot examples or draft tokens below it); every query sits at a node and attends to the tokens of
that node and of all its ancestors. Reading the KV per query re-reads shared nodes once per query.
Instead the plan:

1. flattens the tree's tokens in depth-first order into one list and cuts it into equal blocks of
   ``block_tokens`` (a block may span several small nodes; a long node spans several blocks), so
   the work per program is even whatever the node sizes;
2. gives each block the queries that see at least one of its tokens (KV-guided grouping: the block
   is loaded once for all of them), with a bitmask per (block, query) of the tokens it may see;
3. cuts each block's query list into work items of at most ``block_m // group`` queries;
4. orders the (block, query) partial states by query so that one varlen merge finishes.

``shares_below_root`` and ``cascade_tables`` tell when a tree is really a two-level cascade (one
root, private paths below it) and give its page tables (``tree_batch.TreeBatch`` runs either).

Pure Python + torch (for the final device tensors): the plan is built and checked on any machine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .splits import prefix_block_m

BLOCK_TOKEN_CHOICES = (128, 256, 512, 1024)


@dataclass
class TreePlan:
    """Device tensors (int32) and sizes for ``ops.tree_attention``; ``host`` keeps plain lists."""

    tok_loc: torch.Tensor
    item_tok_start: torch.Tensor
    item_tok_len: torch.Tensor
    item_pair_start: torch.Tensor
    item_nq: torch.Tensor
    item_full: torch.Tensor
    pair_query: torch.Tensor
    pair_slot: torch.Tensor
    mask: torch.Tensor
    query_indptr: torch.Tensor
    n_queries: int
    n_items: int
    n_pairs: int
    block_tokens: int
    mask_words: int
    block_m: int
    group: int
    host: dict

    @property
    def tokens_read(self) -> int:
        """KV tokens the kernel reads per kv head (each block once per work item)."""
        return sum(self.host["item_tok_len"])


def _dfs_order(parents: Sequence[int]) -> list[int]:
    children: list[list[int]] = [[] for _ in parents]
    roots = []
    for n, p in enumerate(parents):
        if p < 0:
            roots.append(n)
        else:
            if p >= n:
                raise ValueError(f"node {n} has parent {p}: nodes must come after their parent")
            children[p].append(n)
    order, stack = [], list(reversed(roots))
    while stack:
        n = stack.pop()
        order.append(n)
        stack.extend(reversed(children[n]))
    return order


def choose_block_tokens(total_tokens: int, row_chunks: int, num_kv_heads: int,
                        num_sms: int) -> int:
    """Largest block size that still gives every SM a program.

    Smaller blocks add parallelism but also partial states (fp32, written and merged), which cost
    more than the KV itself once the KV is small (GQA), so blocks are only as small as filling
    the GPU needs.
    """
    for bt in reversed(BLOCK_TOKEN_CHOICES):
        if -(-total_tokens // bt) * row_chunks * num_kv_heads >= num_sms:
            return bt
    return BLOCK_TOKEN_CHOICES[0]


def build_tree_plan(parents: Sequence[int], node_slots: Sequence[Sequence[int]],
                    query_nodes: Sequence[int], *, group: int, num_kv_heads: int,
                    block_tokens: int | None = None, block_m: int | None = None,
                    num_sms: int | None = None,
                    device: torch.device | str = "cpu") -> TreePlan:
    """Build the work list of tree attention.

    Parameters
    ----------
    parents : parent index of every node, -1 for a root; parents come before children
    node_slots : per node, its tokens as global KV-cache slots (``page * page_size + offset``)
    query_nodes : per query, the node it sits at (it sees that node and its ancestors)
    group : query heads per kv head (``num_qo_heads // num_kv_heads``)
    num_kv_heads : kv heads (only used to choose ``block_tokens``)
    block_tokens : tokens per flattened block (multiple of 32); default from the tree's size
    block_m : row tile of the kernel (16..128); ``block_m // group`` queries per work item;
        default: the smallest tile that holds every query's rows, so shared blocks are read once
    num_sms : multiprocessors of the GPU (only used to choose ``block_tokens``); default: read
        from ``device``, which must then be a CUDA device
    """
    if len(node_slots) != len(parents):
        raise ValueError(f"{len(parents)} parents but {len(node_slots)} node_slots")
    if block_m is None:
        block_m = prefix_block_m(len(query_nodes) * group)
    if block_m % group or block_m < group:
        raise ValueError(f"block_m {block_m} must be a multiple of group {group}")
    order = _dfs_order(parents)
    # ancestor-or-self sets as bit sets over node ids
    anc = [0] * len(parents)
    for n in range(len(parents)):
        anc[n] = (anc[parents[n]] if parents[n] >= 0 else 0) | (1 << n)
    # descendant queries of every node: the queries that need any of its tokens
    users: list[list[int]] = [[] for _ in parents]
    for qi, qn in enumerate(query_nodes):
        if not 0 <= qn < len(parents):
            raise ValueError(f"query {qi} sits at node {qn}, which does not exist")
        a, n = anc[qn], 0
        while a:
            if a & 1:
                users[n].append(qi)
            a >>= 1
            n += 1

    tok_loc: list[int] = []
    tok_node: list[int] = []
    for n in order:
        tok_loc.extend(int(s) for s in node_slots[n])
        tok_node.extend([n] * len(node_slots[n]))
    total = len(tok_loc)
    if block_tokens is None:
        row_chunks = -(-len(query_nodes) * group // block_m)
        if num_sms is None:
            device = torch.device(device)
            if device.type != "cuda":
                raise ValueError("choosing block_tokens needs the GPU's multiprocessor count: "
                                 "pass num_sms or block_tokens, or a CUDA device")
            num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        block_tokens = choose_block_tokens(total, row_chunks, num_kv_heads, num_sms)
    if block_tokens % 32:
        raise ValueError(f"block_tokens must be a multiple of 32, got {block_tokens}")
    words = block_tokens // 32
    per_item = block_m // group

    item_tok_start, item_tok_len, item_pair_start, item_nq, item_full = [], [], [], [], []
    pair_query: list[int] = []
    pair_mask: list[list[int]] = []
    for t0 in range(0, total, block_tokens):
        tlen = min(block_tokens, total - t0)
        # runs of one node inside the block: (node, first, end) in block coordinates
        runs, j = [], 0
        while j < tlen:
            n = tok_node[t0 + j]
            e = j
            while e < tlen and tok_node[t0 + e] == n:
                e += 1
            runs.append((n, j, e))
            j = e
        queries = sorted({qi for n, _, _ in runs for qi in users[n]})
        masks, full_rows = [], []
        for qi in queries:
            bits = 0
            for n, a, e in runs:
                if (anc[query_nodes[qi]] >> n) & 1:
                    bits |= ((1 << (e - a)) - 1) << a
            masks.append([((bits >> (32 * w)) & 0xFFFFFFFF) for w in range(words)])
            full_rows.append(bits == (1 << tlen) - 1)
        for c in range(0, len(queries), per_item):
            item_tok_start.append(t0)
            item_tok_len.append(tlen)
            item_pair_start.append(len(pair_query))
            item_nq.append(len(queries[c:c + per_item]))
            item_full.append(int(all(full_rows[c:c + per_item])))
            pair_query.extend(queries[c:c + per_item])
            pair_mask.extend(masks[c:c + per_item])

    # partial states ordered by query, then by block: each query's slots are contiguous
    by_query = sorted(range(len(pair_query)), key=lambda p: (pair_query[p], p))
    pair_slot = [0] * len(pair_query)
    for slot, p in enumerate(by_query):
        pair_slot[p] = slot
    counts = [0] * len(query_nodes)
    for qi in pair_query:
        counts[qi] += 1
    query_indptr = [0]
    for c in counts:
        query_indptr.append(query_indptr[-1] + c)

    def as_i32(values, shape=None) -> torch.Tensor:
        t = torch.tensor(values, dtype=torch.int64).reshape(shape if shape else (-1,))
        # bit patterns >= 2^31 wrap to negative int32, which the kernel's shifts read back as bits
        t = torch.where(t >= 2 ** 31, t - 2 ** 32, t)
        return t.to(torch.int32).to(device)

    host = dict(tok_loc=tok_loc, item_tok_start=item_tok_start, item_tok_len=item_tok_len,
                item_pair_start=item_pair_start, item_nq=item_nq, item_full=item_full,
                pair_query=pair_query, pair_slot=pair_slot, mask=pair_mask,
                query_indptr=query_indptr)
    return TreePlan(
        tok_loc=as_i32(tok_loc), item_tok_start=as_i32(item_tok_start),
        item_tok_len=as_i32(item_tok_len), item_pair_start=as_i32(item_pair_start),
        item_nq=as_i32(item_nq), item_full=as_i32(item_full), pair_query=as_i32(pair_query),
        pair_slot=as_i32(pair_slot),
        mask=as_i32(pair_mask if pair_mask else [[0] * words], (-1,)),
        query_indptr=as_i32(query_indptr), n_queries=len(query_nodes),
        n_items=len(item_tok_start), n_pairs=len(pair_query), block_tokens=block_tokens,
        mask_words=words, block_m=block_m, group=group, host=host)


def shares_below_root(parents: Sequence[int], query_nodes: Sequence[int]) -> bool:
    """True if some node that is not a root is the node or an ancestor of two or more queries."""
    seen: set[int] = set()
    for qn in query_nodes:
        chain, n = set(), qn
        while parents[n] >= 0:
            chain.add(n)
            n = parents[n]
        if chain & seen:
            return True
        seen |= chain
    return False


def _pages(slots: Sequence[int], page_size: int) -> list[int] | None:
    """The pages holding ``slots`` in order from the start of a page, or None if they do not."""
    pages: list[int] = []
    for i, s in enumerate(slots):
        if s % page_size != i % page_size:
            return None
        if i % page_size == 0:
            pages.append(s // page_size)
        elif s // page_size != pages[-1]:
            return None
    return pages


def cascade_tables(parents: Sequence[int], node_slots: Sequence[Sequence[int]],
                   query_nodes: Sequence[int], page_size: int):
    """The tree as a two-level cascade, or None where it is not one.

    Returns ``(prefix_pages, prefix_len, suffix_indptr, suffix_indices, suffix_last)`` as lists:
    the root's tokens are the prefix, each query's path below the root (root side first) its
    suffix. Needs a single root above every query and node tokens that fill pages from their
    first slot on (always true for page size 1).
    """
    roots = {_root(parents, qn) for qn in query_nodes}
    if len(roots) != 1:
        return None
    root = roots.pop()
    prefix_pages = _pages(node_slots[root], page_size)
    if prefix_pages is None:
        return None
    indptr, indices, last = [0], [], []
    for qn in query_nodes:
        chain, n = [], qn
        while n != root:
            chain.append(n)
            n = parents[n]
        slots = [s for m in reversed(chain) for s in node_slots[m]]
        pages = _pages(slots, page_size)
        if pages is None:
            return None
        indices.extend(pages)
        indptr.append(len(indices))
        last.append(len(slots) - (len(pages) - 1) * page_size if pages else 0)
    return prefix_pages, len(node_slots[root]), indptr, indices, last


def _root(parents: Sequence[int], n: int) -> int:
    while parents[n] >= 0:
        n = parents[n]
    return n
