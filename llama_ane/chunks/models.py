"""The four exported models, as torch modules in the ANE layout.

    Embeddings   input_ids (1,S) int32, position (1,) int32
                 -> hidden_states (1,C,1,S), cos/sin (1,D,1,S), mask (1,1,S,T+S)
    BlockChunk   hidden_states, cos, sin, mask, k_cache/v_cache (L,KV,1,T)
                 -> hidden_states_out (1,C,1,S), k_new/v_new (L,KV,1,S)
    LMHead       hidden_states (1,C,1,S) -> logits_i (1,V_i,1,S), V_i <= 16384
    CacheUpdate  k_cache/v_cache (L,KV,1,T), k_new/v_new (L,KV,1,S), position (1,) int32
                 -> k_cache_out/v_cache_out (L,KV,1,T)

C = hidden size, D = head_dim, KV = num_key_value_heads * head_dim, T = context length,
S = query length (the prefill window or 1), L = layers in the chunk. The block chunks attend to the
cache (positions < `position`, the rest masked) plus the window itself; they never write the cache:
the cache-update model does that afterwards, asynchronously, with a one-hot matmul.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import LlamaConfig, inv_freq
from ..limits import MAX_DIM
from .layers import MASK_VALUE, MLP, RMSNorm, apply_rope, conv1x1, grouped_attention


class DecoderLayer(nn.Module):
    """One Llama decoder layer. The 1/sqrt(head_dim) scale is folded into q_proj's weights."""

    def __init__(self, cfg: LlamaConfig, context_length: int):
        super().__init__()
        self.cfg = cfg
        self.context_length = context_length
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.q_proj = conv1x1(cfg.hidden_size, cfg.q_channels)
        self.k_proj = conv1x1(cfg.hidden_size, cfg.kv_channels)
        self.v_proj = conv1x1(cfg.hidden_size, cfg.kv_channels)
        self.o_proj = conv1x1(cfg.q_channels, cfg.hidden_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    def project_qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Norm, projections and RoPE.

        x: (1,C,1,S); cos, sin: (1,D,1,S) -> q: (G,R,D,S), k, v: (G,D,S) for G kv heads with
        R query heads each.
        """
        c = self.cfg
        g, d = c.num_key_value_heads, c.head_dim
        r = c.num_attention_heads // g
        h = self.input_layernorm(x)
        cos, sin = cos.reshape(1, d, -1), sin.reshape(1, d, -1)
        q = apply_rope(self.q_proj(h).reshape(g * r, d, -1), cos, sin, d // 2).reshape(g, r, d, -1)
        k = apply_rope(self.k_proj(h).reshape(g, d, -1), cos, sin, d // 2)
        v = self.v_proj(h).reshape(g, d, -1)
        return q, k, v

    def forward(self, x, cos, sin, mask, k_cache, v_cache):
        """x: (1,C,1,S); cos, sin: (1,D,1,S); mask: (1,1,S,T+S); k_cache, v_cache: (1,KV,1,T).

        Returns x_out (1,C,1,S) and the window's k_new, v_new (1,KV,1,S) (k after RoPE).
        """
        c = self.cfg
        g, d = c.num_key_value_heads, c.head_dim
        q, k, v = self.project_qkv(x, cos, sin)
        heads = grouped_attention(q, k_cache.reshape(g, d, self.context_length),
                                  v_cache.reshape(g, d, self.context_length), k, v, mask,
                                  c.num_attention_heads // g, self.context_length)
        x = x + self.o_proj(heads.reshape(1, c.q_channels, 1, -1))
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, k.reshape(1, c.kv_channels, 1, -1), v.reshape(1, c.kv_channels, 1, -1)


class BlockChunk(nn.Module):
    """Decoder layers `first .. first+len(layers)-1` of the model, run in sequence."""

    def __init__(self, cfg: LlamaConfig, layer_indices: list[int], context_length: int):
        super().__init__()
        self.layer_indices = list(layer_indices)
        self.layers = nn.ModuleList(DecoderLayer(cfg, context_length) for _ in layer_indices)

    def forward(self, hidden_states, cos, sin, mask, k_cache, v_cache):
        k_out, v_out = [], []
        for i, layer in enumerate(self.layers):
            hidden_states, k, v = layer(hidden_states, cos, sin, mask, k_cache[i:i + 1], v_cache[i:i + 1])
            k_out.append(k)
            v_out.append(v)
        return hidden_states, torch.cat(k_out, dim=0), torch.cat(v_out, dim=0)


def rope_tables(cfg: LlamaConfig, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables (positions, D) in fp32, as transformers computes them (incl. llama3 scaling)."""
    freqs = torch.tensor(inv_freq(cfg), dtype=torch.float32)
    angles = torch.arange(positions, dtype=torch.float32)[:, None] * freqs[None, :]
    emb = torch.cat([angles, angles], dim=1)
    return emb.cos(), emb.sin()


class Embeddings(nn.Module):
    """Token lookup, RoPE tables and the attention mask for one window of S tokens.

    The RoPE tables are constants covering positions 0 .. T+S-1 (computed in fp32, stored in the
    export precision) and are read with a gather: fp16 cannot compute cos(position * freq) for large
    positions. Gathers are fine here; block chunks have none.
    """

    def __init__(self, cfg: LlamaConfig, context_length: int, window: int):
        super().__init__()
        self.window = window
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        cos, sin = rope_tables(cfg, context_length + window)
        self.register_buffer("cos_table", cos)
        self.register_buffer("sin_table", sin)
        self.register_buffer("cache_positions", torch.arange(context_length, dtype=torch.int32).view(1, 1, 1, -1))
        self.register_buffer("offsets", torch.arange(window, dtype=torch.int32))
        causal = torch.full((window, window), MASK_VALUE).triu(1)  # [query, key], built here, not in-graph
        self.register_buffer("window_mask", causal.view(1, 1, window, window))

    def forward(self, input_ids: torch.Tensor, position: torch.Tensor):
        hidden = self.embed_tokens(input_ids).transpose(1, 2).unsqueeze(2)  # (1,S,C) -> (1,C,1,S)
        pos = position + self.offsets  # (S,)
        cos = self.cos_table[pos].t().unsqueeze(0).unsqueeze(2)  # (S,D) -> (1,D,1,S)
        sin = self.sin_table[pos].t().unsqueeze(0).unsqueeze(2)
        cached = (self.cache_positions < position.view(1, 1, 1, 1)).to(hidden.dtype)  # (1,1,1,T)
        cache_mask = ((1.0 - cached) * MASK_VALUE).expand(1, 1, self.window, -1)
        mask = torch.cat([cache_mask, self.window_mask.to(hidden.dtype)], dim=3)  # (1,1,S,T+S)
        return hidden, cos.to(hidden.dtype), sin.to(hidden.dtype), mask


def vocab_splits(vocab_size: int, limit: int = MAX_DIM) -> list[int]:
    """Split the vocabulary into the fewest near-equal parts of at most `limit` rows each."""
    n = -(-vocab_size // limit)
    base, extra = divmod(vocab_size, n)
    return [base + (1 if i < extra else 0) for i in range(n)]


class LMHead(nn.Module):
    """Final norm and vocabulary projection, split so no dimension exceeds 16384.

    hidden_states (1,C,1,S) -> tuple of logits_i (1,V_i,1,S)
    """

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.splits = vocab_splits(cfg.vocab_size)
        self.heads = nn.ModuleList(conv1x1(cfg.hidden_size, n) for n in self.splits)

    def forward(self, hidden_states):
        h = self.norm(hidden_states)
        return tuple(head(h) for head in self.heads)


class CacheUpdate(nn.Module):
    """Write a window's new K/V into a chunk's cache at `position .. position+S-1`.

    The write is a one-hot matmul, not a dynamic slice: `onehot[s, t] = (t == position + s)`,
    `cache_out = cache * (1 - sum_s onehot[s]) + new @ onehot`. Positions >= T match no slot and are
    dropped (a last, padded prefill window may run past the end).
    """

    def __init__(self, context_length: int, window: int):
        super().__init__()
        self.register_buffer("slots", torch.arange(context_length, dtype=torch.int32).view(1, -1))
        self.register_buffer("offsets", torch.arange(window, dtype=torch.int32).view(-1, 1))

    def forward(self, k_cache, v_cache, k_new, v_new, position):
        onehot = (self.slots == (position + self.offsets)).to(k_cache.dtype)  # (S, T)
        keep = 1.0 - onehot.sum(dim=0)  # (T,)
        return k_cache * keep + torch.matmul(k_new, onehot), v_cache * keep + torch.matmul(v_new, onehot)
