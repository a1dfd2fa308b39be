"""Shared-prefix cascade decoding: B branches decode one token each over one prefix cache.

Per decoder layer, inside the graph:
  1. all B queries attend to the shared prefix cache as one multi-query attention (the prefix K/V
     is read once for every branch), giving the attention state (v_p, s_p);
  2. each query attends to its own suffix cache plus its own new key, giving (v_s, s_s);
  3. the two states are merged with the log-sum-exp operator:
         v = (v_p * e^(s_p - m) + v_s * e^(s_s - m)) / (e^(s_p - m) + e^(s_s - m)),  m = max(s_p, s_s)

Shapes (G kv heads, R query heads per kv head, D head_dim, T context, U suffix length, B branches,
L layers in the chunk, C hidden, KV = G*D):
    BranchEmbeddings  input_ids (1,B) int32, positions (B,) int32, prefix_length (1,) int32
                      -> hidden_states (1,C,1,B), cos/sin (1,D,1,B),
                         prefix_mask (1,1,1,T), suffix_mask (1,B,1,U+1)
    BranchChunk       hidden_states, cos, sin, prefix_mask, suffix_mask, k_cache/v_cache (L,KV,1,T),
                      k_suffix/v_suffix (L*G,B,D,U) -> hidden_states_out (1,C,1,B), k_new/v_new (L,KV,1,B)
    SuffixUpdate      k_suffix/v_suffix, k_new/v_new, suffix_positions (B,) int32 -> k_suffix_out/v_suffix_out

`positions[b]` is branch b's absolute position (prefix_length + its suffix tokens so far), and
`suffix_positions[b] = positions[b] - prefix_length` the slot its new K/V is written to.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import LlamaConfig
from .layers import MASK_VALUE
from .models import BlockChunk, DecoderLayer, lookup, rope_tables


def prefix_state(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor):
    """Attention state of all queries over the shared prefix.

    q: (G,R,D,B) scaled; k, v: (G,D,T); mask: (1,1,1,T) -> v_p (G,R,D,B), s_p (G,R,1,B) (natural log)
    """
    scores = torch.matmul(q.transpose(2, 3), k.unsqueeze(1)) + mask  # (G,R,B,T): one read of k for all B
    m = scores.amax(dim=3, keepdim=True)
    p = torch.exp(scores - m)
    denom = p.sum(dim=3, keepdim=True)  # (G,R,B,1)
    out = torch.matmul(v.unsqueeze(1), p.transpose(2, 3)) / denom.transpose(2, 3)
    return out, (m + torch.log(denom)).transpose(2, 3)


def suffix_state(q: torch.Tensor, k_suffix: torch.Tensor, v_suffix: torch.Tensor, k_self: torch.Tensor,
                 v_self: torch.Tensor, mask: torch.Tensor, suffix_length: int):
    """Attention state of each branch's query over its own suffix cache and its own new key.

    q: (G,R,D,B) scaled; k_suffix, v_suffix: (G,B,D,U); k_self, v_self: (G,D,B);
    mask: (1,B,1,U+1), the last column for the new key itself -> v_s (G,R,D,B), s_s (G,R,1,B)
    """
    qb = q.permute(0, 3, 1, 2)  # (G,B,R,D)
    ks = k_self.transpose(1, 2).unsqueeze(3)  # (G,B,D,1)
    vs = v_self.transpose(1, 2).unsqueeze(3)
    scores = torch.cat([torch.matmul(qb, k_suffix), torch.matmul(qb, ks)], dim=3) + mask  # (G,B,R,U+1)
    m = scores.amax(dim=3, keepdim=True)
    p = torch.exp(scores - m)
    denom = p.sum(dim=3, keepdim=True)  # (G,B,R,1)
    out = (torch.matmul(v_suffix, p[..., :suffix_length].transpose(2, 3))
           + torch.matmul(vs, p[..., suffix_length:].transpose(2, 3)))  # (G,B,D,R)
    out = out / denom.transpose(2, 3)
    return out.permute(0, 3, 2, 1), (m + torch.log(denom)).permute(0, 2, 3, 1)


def merge_states(v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor) -> torch.Tensor:
    """The log-sum-exp merge of two attention states over disjoint key sets.

    v_a, v_b: (..., D, B); s_a, s_b: (..., 1, B) natural-log LSE -> (..., D, B)
    """
    m = torch.maximum(s_a, s_b)
    w_a = torch.exp(s_a - m)
    w_b = torch.exp(s_b - m)
    return (v_a * w_a + v_b * w_b) / (w_a + w_b)


def branch_layer(layer: DecoderLayer, x, cos, sin, prefix_mask, suffix_mask, k_cache, v_cache,
                 k_suffix, v_suffix, suffix_length: int):
    """One decoder layer for B branch queries (same weights as the layer's own forward).

    x: (1,C,1,B); k_cache, v_cache: (1,KV,1,T); k_suffix, v_suffix: (G,B,D,U)
    -> x_out (1,C,1,B), k_new, v_new (1,KV,1,B)
    """
    c = layer.cfg
    g, d, t = c.num_key_value_heads, c.head_dim, k_cache.shape[-1]  # T, or the filled prefix (torch backend)
    q, k, v = layer.project_qkv(x, cos, sin)
    v_p, s_p = prefix_state(q, k_cache.reshape(g, d, t), v_cache.reshape(g, d, t), prefix_mask)
    v_s, s_s = suffix_state(q, k_suffix, v_suffix, k, v, suffix_mask, suffix_length)
    heads = merge_states(v_p, s_p, v_s, s_s)  # (G,R,D,B)
    x = x + layer.o_proj(heads.reshape(1, c.q_channels, 1, -1))
    x = x + layer.mlp(layer.post_attention_layernorm(x))
    return x, k.reshape(1, c.kv_channels, 1, -1), v.reshape(1, c.kv_channels, 1, -1)


class BranchChunk(nn.Module):
    """The "decode_branches" function of a block chunk: shares every weight with `chunk`."""

    def __init__(self, chunk: BlockChunk, suffix_length: int):
        super().__init__()
        self.chunk = chunk
        self.suffix_length = suffix_length

    def forward(self, hidden_states, cos, sin, prefix_mask, suffix_mask, k_cache, v_cache, k_suffix, v_suffix):
        g = self.chunk.layers[0].cfg.num_key_value_heads
        k_out, v_out = [], []
        for i, layer in enumerate(self.chunk.layers):
            hidden_states, k, v = branch_layer(
                layer, hidden_states, cos, sin, prefix_mask, suffix_mask, k_cache[i:i + 1], v_cache[i:i + 1],
                k_suffix[i * g:(i + 1) * g], v_suffix[i * g:(i + 1) * g], self.suffix_length)
            k_out.append(k)
            v_out.append(v)
        return hidden_states, torch.cat(k_out, dim=0), torch.cat(v_out, dim=0)


class BranchEmbeddings(nn.Module):
    """Token lookup, per-branch RoPE, and the prefix and suffix masks for B branch tokens."""

    def __init__(self, cfg: LlamaConfig, embed_tokens: nn.Embedding, context_length: int, branches: int,
                 suffix_length: int):
        super().__init__()
        self.embed_tokens = embed_tokens  # all of the vocabulary, or its first rows (see Embeddings)
        self.vocab_size = cfg.vocab_size
        cos, sin = rope_tables(cfg, context_length + suffix_length + 1)
        self.register_buffer("cos_table", cos)
        self.register_buffer("sin_table", sin)
        self.register_buffer("prefix_slots", torch.arange(context_length, dtype=torch.int32).view(1, 1, 1, -1))
        self.register_buffer("suffix_slots", torch.arange(suffix_length, dtype=torch.int32).view(1, 1, 1, -1))
        self.register_buffer("self_column", torch.zeros(1, branches, 1, 1))

    def forward(self, input_ids, positions, prefix_length):
        hidden = lookup(self.embed_tokens, input_ids, 0, self.vocab_size)  # (1,C,1,B)
        cos = self.cos_table[positions].t().unsqueeze(0).unsqueeze(2)  # (1,D,1,B)
        sin = self.sin_table[positions].t().unsqueeze(0).unsqueeze(2)
        in_prefix = (self.prefix_slots < prefix_length.view(1, 1, 1, 1)).to(hidden.dtype)
        prefix_mask = (1.0 - in_prefix) * MASK_VALUE  # (1,1,1,T)
        filled = (positions - prefix_length).view(1, -1, 1, 1)  # suffix tokens each branch has cached
        in_suffix = (self.suffix_slots < filled).to(hidden.dtype)  # (1,B,1,U)
        suffix_mask = torch.cat([(1.0 - in_suffix) * MASK_VALUE, self.self_column.to(hidden.dtype)], dim=3)
        return hidden, cos.to(hidden.dtype), sin.to(hidden.dtype), prefix_mask, suffix_mask


class SuffixUpdate(nn.Module):
    """Write each branch's new K/V into its suffix cache at its own slot (a one-hot select, no indexing).

    k_suffix: (L*G,B,D,U); k_new: (L,KV,1,B); suffix_positions: (B,) int32 -> (L*G,B,D,U)
    """

    def __init__(self, cfg: LlamaConfig, layers: int, suffix_length: int):
        super().__init__()
        self.rows, self.head_dim = layers * cfg.num_key_value_heads, cfg.head_dim
        self.register_buffer("slots", torch.arange(suffix_length, dtype=torch.int32).view(1, 1, 1, -1))

    def forward(self, k_suffix, v_suffix, k_new, v_new, suffix_positions):
        slot = self.slots == suffix_positions.view(1, -1, 1, 1)  # (1,B,1,U) one-hot, bool

        def write(cache, new):
            new = new.reshape(self.rows, self.head_dim, -1).transpose(1, 2).unsqueeze(3)  # (L*G,B,D,1)
            return torch.where(slot, new, cache)  # one elementwise select: reads and writes the cache once
        return write(k_suffix, k_new), write(v_suffix, v_new)
