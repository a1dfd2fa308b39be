"""Torch references for every CUDA-path op: plain softmax attention on gathered K/V, in float32.

They run on any device (CPU included) and are what the Triton kernels are tested against. They are
written for clarity, not speed: loops over requests, explicit masks, no fused kernels.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch


def gather_paged(kv_cache: torch.Tensor, pages: torch.Tensor, length: int) -> tuple[torch.Tensor,
                                                                                    torch.Tensor]:
    """Contiguous ``(k, v)``, each ``[length, num_kv_heads, head_dim]``, of one paged sequence.

    ``kv_cache`` is NHD ``[pages, 2, page_size, Hkv, D]``; ``pages`` lists the sequence's pages.
    """
    page_size = kv_cache.shape[2]
    seq = kv_cache[pages.long()]  # [n_pages, 2, page_size, Hkv, D]
    k = seq[:, 0].reshape(-1, *kv_cache.shape[3:])[:length]
    v = seq[:, 1].reshape(-1, *kv_cache.shape[3:])[:length]
    assert k.shape[0] == length, f"{pages.numel()} pages of {page_size} hold fewer than {length}"
    return k, v


def gather_slots(kv_cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(k, v)`` of arbitrary tokens given by global slot ``page * page_size + offset``."""
    page_size = kv_cache.shape[2]
    slots = slots.long()
    return (kv_cache[slots // page_size, 0, slots % page_size],
            kv_cache[slots // page_size, 1, slots % page_size])


def attention_state(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float,
                    mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention state of queries against one key set, by an explicit softmax in float32.

    Parameters
    ----------
    q : [n, Hq, D]
    k, v : [L, Hkv, D] (Hq a multiple of Hkv: query head h uses kv head h // (Hq / Hkv))
    mask : optional bool [n, L], True where the query may attend

    Returns
    -------
    o : [n, Hq, D] float32 (zeros where a query sees no key)
    lse : [n, Hq] float32, natural log (-inf where a query sees no key)
    """
    n, hq, d = q.shape
    group = hq // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1)  # [L, Hq, D]
    vf = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->nhl", q.float(), kf) * sm_scale
    if mask is not None:
        scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    if scores.shape[-1] == 0:
        return torch.zeros(n, hq, d, device=q.device), lse
    p = torch.exp(scores - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    o = torch.einsum("nhl,lhd->nhd", p, vf)
    return o, lse


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    sm_scale: float) -> torch.Tensor:
    """Textbook ``softmax(q k^T * scale) v`` in float64 for one query set ``[n, Hq, D]``."""
    group = q.shape[1] // k.shape[1]
    kf = k.double().repeat_interleave(group, dim=1)
    vf = v.double().repeat_interleave(group, dim=1)
    w = torch.softmax(torch.einsum("nhd,lhd->nhl", q.double(), kf) * sm_scale, dim=-1)
    return torch.einsum("nhl,lhd->nhd", w, vf)


def request_lengths(indptr: torch.Tensor, last_page_len: torch.Tensor,
                    page_size: int) -> list[int]:
    counts = (indptr[1:] - indptr[:-1]).tolist()
    return [(c - 1) * page_size + int(last) if c > 0 else 0
            for c, last in zip(counts, last_page_len.tolist())]


def batch_decode_ref(q: torch.Tensor, kv_cache: torch.Tensor, indptr: torch.Tensor,
                     indices: torch.Tensor, last_page_len: torch.Tensor,
                     sm_scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of :func:`ops.batch_decode`: each request's query against its own pages."""
    sm_scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
    lengths = request_lengths(indptr, last_page_len, kv_cache.shape[2])
    outs, lses = [], []
    for b, length in enumerate(lengths):
        k, v = gather_paged(kv_cache, indices[indptr[b]:indptr[b + 1]], length)
        o, lse = attention_state(q[b:b + 1], k, v, sm_scale)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def shared_prefix_ref(q: torch.Tensor, kv_cache: torch.Tensor, prefix_indices: torch.Tensor,
                      prefix_len: int, sm_scale: float | None = None) -> tuple[torch.Tensor,
                                                                               torch.Tensor]:
    """Reference of :func:`ops.shared_prefix_attention`: all queries against one sequence."""
    sm_scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
    k, v = gather_paged(kv_cache, prefix_indices, prefix_len)
    return attention_state(q, k, v, sm_scale)


def merge_state_ref(v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor,
                    s_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(v_a, s_a) (+) (v_b, s_b)`` with natural-log LSE, in float32."""
    return merge_states_ref(torch.stack([v_a, v_b], 1), torch.stack([s_a, s_b], 1))


def merge_states_ref(v: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """N-ary merge of ``v[rows, n, H, D]`` with ``s[rows, n, H]`` over axis 1, in float32."""
    s = s.float()
    lse = torch.logsumexp(s, dim=1)
    w = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[:, None])
    return (w[..., None] * v.float()).sum(1), lse


def cascade_ref(q: torch.Tensor, kv_cache: torch.Tensor, prefix_indices: torch.Tensor,
                prefix_len: int, suffix_indptr: torch.Tensor, suffix_indices: torch.Tensor,
                suffix_last_page_len: torch.Tensor,
                sm_scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each request's query against prefix + its own suffix, as one softmax (no merge)."""
    sm_scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
    kp, vp = gather_paged(kv_cache, prefix_indices, prefix_len)
    group = q.shape[1] // kp.shape[1]
    kp = kp.float().repeat_interleave(group, dim=1)
    vp = vp.float().repeat_interleave(group, dim=1)
    # prefix scores of all queries at once; the softmax below still runs over prefix + suffix
    prefix_scores = torch.einsum("nhd,lhd->nhl", q.float(), kp) * sm_scale
    lengths = request_lengths(suffix_indptr, suffix_last_page_len, kv_cache.shape[2])
    outs, lses = [], []
    for b, length in enumerate(lengths):
        ks, vs = gather_paged(kv_cache, suffix_indices[suffix_indptr[b]:suffix_indptr[b + 1]],
                              length)
        ks = ks.float().repeat_interleave(group, dim=1)
        vs = vs.float().repeat_interleave(group, dim=1)
        scores = torch.cat([prefix_scores[b],
                            torch.einsum("hd,lhd->hl", q[b].float(), ks) * sm_scale], dim=-1)
        lse = torch.logsumexp(scores, dim=-1)
        p = torch.softmax(scores, dim=-1)
        outs.append(torch.einsum("hl,lhd->hd", p[:, :prefix_len], vp)
                    + torch.einsum("hl,lhd->hd", p[:, prefix_len:], vs))
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)


def tree_ref(q: torch.Tensor, kv_cache: torch.Tensor, parents: Sequence[int],
             node_slots: Sequence[Sequence[int]], query_nodes: Sequence[int],
             sm_scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Tree attention: query ``i`` sees the tokens of node ``query_nodes[i]`` and its ancestors.

    ``node_slots[n]`` lists node ``n``'s tokens as global cache slots (``page * page_size +
    offset``); ``parents[n]`` is -1 for a root.
    """
    sm_scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
    outs, lses = [], []
    for i, node in enumerate(query_nodes):
        path = []
        while node >= 0:
            path.append(node)
            node = parents[node]
        slots = [s for n in reversed(path) for s in node_slots[n]]
        k, v = gather_slots(kv_cache, torch.tensor(slots, dtype=torch.long, device=q.device))
        o, lse = attention_state(q[i:i + 1], k, v, sm_scale)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def tree_plan_ref(q: torch.Tensor, kv_cache: torch.Tensor, plan,
                  sm_scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Execute a :class:`~llama_ane.cuda.tree.TreePlan` step by step in torch, as the kernel does.

    Checks the plan itself (grouping, bitmasks, slots, reduction order) on any device.
    """
    sm_scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
    h = plan.host
    n_pairs = len(h["pair_query"])
    o_part = torch.zeros(n_pairs, q.shape[1], q.shape[2], device=q.device)
    lse_part = torch.full((n_pairs, q.shape[1]), float("-inf"), device=q.device)
    tok_loc = torch.tensor(h["tok_loc"], dtype=torch.long, device=q.device)
    for it in range(len(h["item_tok_start"])):
        t0, tlen = h["item_tok_start"][it], h["item_tok_len"][it]
        k, v = gather_slots(kv_cache, tok_loc[t0:t0 + tlen])
        p0, nq = h["item_pair_start"][it], h["item_nq"][it]
        pairs = list(range(p0, p0 + nq))
        queries = [h["pair_query"][p] for p in pairs]
        mask = torch.tensor([[bool((h["mask"][p][j // 32] >> (j % 32)) & 1) for j in range(tlen)]
                             for p in pairs], device=q.device)
        o, lse = attention_state(q[queries], k, v, sm_scale, mask)
        slots = [h["pair_slot"][p] for p in pairs]
        o_part[slots] = o
        lse_part[slots] = lse
    indptr = h["query_indptr"]
    outs, lses = [], []
    for i in range(len(indptr) - 1):
        o, lse = merge_states_ref(o_part[None, indptr[i]:indptr[i + 1]],
                                  lse_part[None, indptr[i]:indptr[i + 1]])
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)
