"""Attention of a few query rows over a KV cache in native code (native_attention.c), for the
torch backend's one-token steps and verify windows on a CPU.

`grouped_attention` (chunks/layers.py) through torch costs a verify window of S tree nodes about
S times a one-token step's attention: the products of a few rows run nearly row by row. The kernel
reads each kv head's cache once for all its R x S query rows, and computes every row's result the
same way whatever the number of rows, so a token's attention in a verify window is, to the bit,
what it is in a one-token step. The library is built and checked with the projections' kernel
(native_gemm); where it is not, `available()` is False and the torch form runs.
"""

from __future__ import annotations

import torch

from . import native_gemm


def available() -> bool:
    return native_gemm.available()


def supports(head_dim: int) -> bool:
    """Whether the kernel takes heads of `head_dim` channels (a multiple of 4)."""
    return head_dim % native_gemm.library().llama_ane_attention_channels() == 0


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_win: torch.Tensor,
           v_win: torch.Tensor, mask: torch.Tensor, group: int, cache_length: int) -> torch.Tensor:
    """`grouped_attention` (same arguments, same result) in native code, float32 on a CPU.

    q: (G, R, D, S), already scaled by 1/sqrt(D), any strides; k_cache, v_cache: (G, D, T), T =
    `cache_length`, positions contiguous (a cache cut to its filled positions is a view that is);
    k_win, v_win: (G, D, S); mask: (1, 1, S, T + S) additive, cache columns first. -> (G, R, D, S).
    On torch's threads.
    """
    g, r, d, s = q.shape
    if r != group or k_cache.shape[-1] != cache_length:
        raise ValueError(f"attend: q {tuple(q.shape)} and a cache of {k_cache.shape[-1]} positions do not match "
                         f"group {group} and cache_length {cache_length}")
    k_cache, v_cache = (c if c.stride(-1) == 1 else c.contiguous() for c in (k_cache, v_cache))
    k_win, v_win = k_win.contiguous(), v_win.contiguous()
    mask = mask.reshape(s, cache_length + s).contiguous()
    out = torch.empty(g, r, d, s, dtype=torch.float32)
    done = native_gemm.library().llama_ane_attend(
        q.data_ptr(), *q.stride(), k_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1),
        v_cache.data_ptr(), v_cache.stride(0), v_cache.stride(1), k_win.data_ptr(), v_win.data_ptr(),
        mask.data_ptr(), out.data_ptr(), g, r, d, s, cache_length, torch.get_num_threads())
    if done != 0:
        raise MemoryError(f"attend: no memory for the scores of {g * r * s} query rows over {cache_length + s} positions")
    return out
