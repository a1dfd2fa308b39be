"""The "verify" function: a token tree of W drafted tokens checked in one window (speculative decoding).

A window holds a tree: token 0 is the root (the last sampled token, not cached yet), every other
token is a drafted continuation of its parent. Each token attends to the cache and to its
ancestors in the tree (and itself), nothing else: the tree mask. This is DeFT's tree attention
over one shared prefix: the cache, which every node of the tree continues, is read once for all W
queries (one matmul against the cache for the whole window), and the tree's own K/V are masked
per node, so several candidate continuations that share prefixes are verified together.

The block chunks' "verify" function is their window function at S = W (the same BlockChunk, the
same weights): only the mask the embeddings build differs. The chunks never write the cache; once
the runtime knows which path of the tree was accepted, the cache update writes only those
tokens' K/V, at consecutive positions, and drops the others.

    VerifyEmbeddings  input_ids (1,W) int32, position (1,) int32, depths (W,) int32,
                      tree_mask (1,1,W,W) additive -> hidden_states (1,C,1,W), cos/sin (1,D,1,W),
                      mask (1,1,W,T+W)
    VerifyUpdate      k_cache/v_cache (L,KV,1,T), k_new/v_new (L,KV,1,W), slots (W,) int32
                      -> k_cache_out/v_cache_out (L,KV,1,T)

`position` is the number of cached tokens; token i sits at position + depths[i] (its RoPE row).
`tree_mask[0,0,i,j]` is 0 where token j is token i or one of its ancestors, MASK_VALUE elsewhere.
`slots[i]` is the cache position token i's K/V goes to, or -1 to drop it (rejected drafts, padding).
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import LlamaConfig
from .layers import MASK_VALUE
from .models import lookup, rope_tables


class VerifyEmbeddings(nn.Module):
    """Token lookup, RoPE rows at each token's tree position, and the cache + tree mask."""

    def __init__(self, cfg: LlamaConfig, embed_tokens: nn.Embedding, context_length: int, window: int):
        super().__init__()
        self.embed_tokens = embed_tokens  # all of the vocabulary, or its first rows (see Embeddings)
        self.vocab_size = cfg.vocab_size
        cos, sin = rope_tables(cfg, context_length + window)
        self.register_buffer("cos_table", cos)
        self.register_buffer("sin_table", sin)
        self.register_buffer("cache_positions", torch.arange(context_length, dtype=torch.int32).view(1, 1, 1, -1))

    def forward(self, input_ids, position, depths, tree_mask):
        """The window may hold fewer than W tokens when run eagerly (the torch backend): every
        size is read from the inputs."""
        hidden = lookup(self.embed_tokens, input_ids, 0, self.vocab_size)  # (1,C,1,W)
        pos = position + depths  # (W,)
        cos = self.cos_table[pos].t().unsqueeze(0).unsqueeze(2)  # (W,D) -> (1,D,1,W)
        sin = self.sin_table[pos].t().unsqueeze(0).unsqueeze(2)
        cached = (self.cache_positions < position.view(1, 1, 1, 1)).to(hidden.dtype)  # (1,1,1,T)
        cache_mask = ((1.0 - cached) * MASK_VALUE).expand(1, 1, tree_mask.shape[2], -1)
        mask = torch.cat([cache_mask, tree_mask.to(hidden.dtype)], dim=3)  # (1,1,W,T+W)
        return hidden, cos.to(hidden.dtype), sin.to(hidden.dtype), mask


class VerifyUpdate(nn.Module):
    """Write the accepted tokens' K/V into a chunk's cache: token i at `slots[i]`, none where it is -1.

    The same one-hot matmul as CacheUpdate with the slots given instead of position + offsets:
    `onehot[i, t] = (t == slots[i])`, `cache_out = cache * (1 - sum_i onehot[i]) + new @ onehot`.
    """

    def __init__(self, context_length: int):
        super().__init__()
        self.register_buffer("positions", torch.arange(context_length, dtype=torch.int32).view(1, -1))

    def forward(self, k_cache, v_cache, k_new, v_new, slots):
        onehot = (self.positions == slots.view(-1, 1)).to(k_cache.dtype)  # (W, T)
        keep = 1.0 - onehot.sum(dim=0)  # (T,)
        return k_cache * keep + torch.matmul(k_new, onehot), v_cache * keep + torch.matmul(v_new, onehot)

