"""Causal attention of a slab of queries over the K/V of every token up to the slab's end.

Process ``r`` of KV-Runahead holds the queries of tokens ``[start, end)`` and the keys/values of
tokens ``[0, end)``: the prefix it received and its own slab. Query ``i`` (token ``start + i``)
sees keys ``j <= start + i``: a causal mask aligned to the bottom-right corner of the
``[end - start, end]`` score matrix. Three ways to compute it:

* ``torch``: scaled_dot_product_attention with an explicit boolean mask (any device; the CPU path);
* ``sdpa``: scaled_dot_product_attention with torch's lower-right causal bias (flash kernels on
  the GPU, the K/V gathered from the pages into one contiguous tensor);
* ``triton``: the prefix ``[0, start)`` is a shared prefix for every query of the slab, so the
  project's shared-prefix kernel reads it straight from the paged cache (the ordered-pages
  variant: one bulk tensor copy per key block); the slab's own causal
  square runs in torch's flash kernel (which also returns its LSE); the two states are merged
  with the project's merge kernel.

Shapes: ``q`` [c, Hq, D]; ``k_own``/``v_own`` [c, Hkv, D] (the slab's own K/V); ``cache`` one
layer's pages ``[pages, 2, page_size, Hkv, D]`` holding tokens ``[0, end)`` in page order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

METHODS = ("torch", "sdpa", "triton")


def gather_kv(cache: torch.Tensor, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of tokens ``[0, end)`` as contiguous ``[end, Hkv, D]`` tensors."""
    _, _, ps, hkv, d = cache.shape
    n_pages = -(-end // ps)
    k = cache[:n_pages, 0].reshape(n_pages * ps, hkv, d)[:end]
    v = cache[:n_pages, 1].reshape(n_pages * ps, hkv, d)[:end]
    return k, v


def _heads_first(x: torch.Tensor, group: int) -> torch.Tensor:
    """[T, H, D] -> [1, H * group, T, D] (kv heads repeated for the query heads they serve)."""
    x = x.transpose(0, 1)
    if group > 1:
        x = x.repeat_interleave(group, dim=0)
    return x.unsqueeze(0)


def offset_causal_torch(q, cache, start: int, end: int, scale: float) -> torch.Tensor:
    """Reference path: an explicit mask over all ``end`` keys. Returns ``[c, Hq, D]``."""
    k, v = gather_kv(cache, end)
    c = q.shape[0]
    group = q.shape[1] // k.shape[1]
    mask = torch.arange(end, device=q.device)[None, :] <= \
        (start + torch.arange(c, device=q.device))[:, None]
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], _heads_first(k, group),
                                       _heads_first(v, group), attn_mask=mask, scale=scale)
    return o[0].transpose(0, 1)


def offset_causal_sdpa(q, cache, start: int, end: int, scale: float) -> torch.Tensor:
    """torch's lower-right causal bias (flash attention on the GPU). Returns ``[c, Hq, D]``."""
    from torch.nn.attention.bias import causal_lower_right

    k, v = gather_kv(cache, end)
    c = q.shape[0]
    group = q.shape[1] // k.shape[1]
    if start == 0:
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], _heads_first(k, group),
                                           _heads_first(v, group), is_causal=True, scale=scale)
    else:
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], _heads_first(k, group),
                                           _heads_first(v, group),
                                           attn_mask=causal_lower_right(c, end), scale=scale)
    return o[0].transpose(0, 1)


def causal_with_lse(q, k, v, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal flash attention of a square block with its natural-log LSE (CUDA, fp16/bf16).

    Returns ``o`` [T, Hq, D] and ``lse`` [T, Hq] float32.
    """
    group = q.shape[1] // k.shape[1]
    out = torch.ops.aten._scaled_dot_product_flash_attention(
        q.transpose(0, 1)[None], _heads_first(k, group), _heads_first(v, group), 0.0, True,
        False, scale=scale)
    o, lse = out[0], out[1]
    return o[0].transpose(0, 1), lse[0].transpose(0, 1).contiguous()


def offset_causal_triton(q, k_own, v_own, cache, start: int, scale: float) -> torch.Tensor:
    """Shared-prefix kernel over the paged prefix + flash over the slab + merge. ``[c, Hq, D]``."""
    from .. import ops

    o_own, lse_own = causal_with_lse(q, k_own, v_own, scale)
    if start == 0:
        return o_own
    # the received prefix is the cache's first pages in order: bulk tensor copies where they fit
    o_pre, lse_pre = ops.shared_prefix_attention(q.contiguous(), cache, None, start,
                                                 sm_scale=scale)
    o, _ = ops.merge_state(o_pre, lse_pre, o_own.contiguous(), lse_own)
    return o


def offset_causal(method: str, q, k_own, v_own, cache, start: int, scale: float) -> torch.Tensor:
    """Dispatch to one of :data:`METHODS`; ``cache`` must already hold the slab's own K/V."""
    end = start + q.shape[0]
    if method == "torch":
        return offset_causal_torch(q, cache, start, end, scale)
    if method == "sdpa":
        return offset_causal_sdpa(q, cache, start, end, scale)
    if method == "triton":
        return offset_causal_triton(q, k_own, v_own, cache, start, scale)
    raise ValueError(f"attention method must be one of {METHODS}, got {method!r}")
