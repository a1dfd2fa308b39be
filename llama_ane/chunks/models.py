"""The exported models, as torch modules in the ANE layout.

    Embeddings   input_ids (1,S) int32, position (1,) int32
                 -> hidden_states (1,C,1,S), cos/sin (1,D,1,S), mask (1,1,S,T+S)
    EmbeddingsPart  input_ids (1,S) int32, hidden_states (1,C,1,S) -> hidden_states_out (1,C,1,S)
                 (a later file of an embedding table cut by rows: adds the lookup of its rows)
    BlockChunk   hidden_states, cos, sin, mask, k_cache/v_cache (L,KV,1,T)
                 -> hidden_states_out (1,C,1,S), k_new/v_new (L,KV,1,S)
    LMHead       hidden_states (1,C,1,S) -> logits_j (1,V_j,1,S), V_j <= 16384 (all splits j, or a
                 file's group of them)
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
from .layers import MASK_VALUE, MLP, RMSNorm, apply_rope, conv1x1, grouped_attention, head_norm
from .plan import ROW_UNIT, even_parts


class DecoderLayer(nn.Module):
    """One decoder layer of the Llama family (Llama, Mistral, Qwen2 with q/k/v biases, Qwen3 with
    per-head q/k norms). The 1/sqrt(head_dim) scale is folded into q_proj's weights (into q_norm's
    where there is one)."""

    def __init__(self, cfg: LlamaConfig, context_length: int):
        super().__init__()
        self.cfg = cfg
        self.context_length = context_length
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.q_proj = conv1x1(cfg.hidden_size, cfg.q_channels, cfg.qkv_bias)
        self.k_proj = conv1x1(cfg.hidden_size, cfg.kv_channels, cfg.qkv_bias)
        self.v_proj = conv1x1(cfg.hidden_size, cfg.kv_channels, cfg.qkv_bias)
        self.o_proj = conv1x1(cfg.q_channels, cfg.hidden_size, cfg.o_proj_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    def project_qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Norm, projections (q/k/v biases, per-head q/k norms where the family has them) and RoPE.

        x: (1,C,1,S); cos, sin: (1,D,1,S) -> q: (G,R,D,S), k, v: (G,D,S) for G kv heads with
        R query heads each.
        """
        c = self.cfg
        g, d = c.num_key_value_heads, c.head_dim
        r = c.num_attention_heads // g
        h = self.input_layernorm(x)
        cos, sin = cos.reshape(1, d, -1), sin.reshape(1, d, -1)
        q, k = self.q_proj(h).reshape(g * r, d, -1), self.k_proj(h).reshape(g, d, -1)  # (H,D,S), (G,D,S)
        if c.qk_norm:
            q, k = head_norm(self.q_norm, q), head_norm(self.k_norm, k)
        q = apply_rope(q, cos, sin, d // 2).reshape(g, r, d, -1)
        k = apply_rope(k, cos, sin, d // 2)
        v = self.v_proj(h).reshape(g, d, -1)
        return q, k, v

    def forward(self, x, cos, sin, mask, k_cache, v_cache):
        """x: (1,C,1,S); cos, sin: (1,D,1,S); mask: (1,1,S,T+S); k_cache, v_cache: (1,KV,1,T).

        T is the context bucket in the exported programs; the torch backend may pass fewer cache
        positions (those holding tokens) with the mask cut to match. The mask decides: a longer cache
        (a state of the whole context read in a smaller bucket) is read up to the mask's T. Returns
        x_out (1,C,1,S) and the window's k_new, v_new (1,KV,1,S) (k after RoPE).
        """
        c = self.cfg
        g, d, t = c.num_key_value_heads, c.head_dim, mask.shape[-1] - mask.shape[-2]
        k_cache, v_cache = k_cache[..., :t], v_cache[..., :t]
        q, k, v = self.project_qkv(x, cos, sin)
        heads = grouped_attention(q, k_cache.reshape(g, d, t), v_cache.reshape(g, d, t), k, v, mask,
                                  c.num_attention_heads // g, t)
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


def lookup(table: nn.Embedding, input_ids: torch.Tensor, start: int, vocab_size: int) -> torch.Tensor:
    """Channels-first embeddings of `input_ids` (1,S) -> (1,C,1,S) from `table`, rows start..start+n-1
    of the vocabulary. A table of the whole vocabulary is a plain lookup; a part of it gives zeros
    for ids outside its rows (their lookup is clamped into range and multiplied by 0), so the parts'
    lookups add up to the whole one exactly."""
    n = table.num_embeddings
    if start == 0 and n == vocab_size:
        return table(input_ids).transpose(1, 2).unsqueeze(2)
    local = (input_ids - start).clamp(0, n - 1)
    hit = ((input_ids >= start) & (input_ids < start + n)).unsqueeze(2)  # (1,S,1)
    found = table(local)  # (1,S,C)
    return (found * hit.to(found.dtype)).transpose(1, 2).unsqueeze(2)


class Embeddings(nn.Module):
    """Token lookup, RoPE tables and the attention mask for one window of S tokens.

    The RoPE tables are constants covering positions 0 .. T+S-1 (computed in fp32, stored in the
    export precision) and are read with a gather: fp16 cannot compute cos(position * freq) for large
    positions. Gathers are fine here; block chunks have none. With `rows` < vocab_size, the table
    holds the first `rows` rows of the vocabulary and EmbeddingsPart files add the others.
    """

    def __init__(self, cfg: LlamaConfig, context_length: int, window: int, rows: int | None = None):
        super().__init__()
        self.window = window
        self.vocab_size = cfg.vocab_size
        self.embed_tokens = nn.Embedding(rows or cfg.vocab_size, cfg.hidden_size)
        cos, sin = rope_tables(cfg, context_length + window)
        self.register_buffer("cos_table", cos)
        self.register_buffer("sin_table", sin)
        self.register_buffer("cache_positions", torch.arange(context_length, dtype=torch.int32).view(1, 1, 1, -1))
        self.register_buffer("offsets", torch.arange(window, dtype=torch.int32))
        causal = torch.full((window, window), MASK_VALUE).triu(1)  # [query, key], built here, not in-graph
        self.register_buffer("window_mask", causal.view(1, 1, window, window))

    def forward(self, input_ids: torch.Tensor, position: torch.Tensor):
        hidden = lookup(self.embed_tokens, input_ids, 0, self.vocab_size)  # (1,C,1,S)
        pos = position + self.offsets  # (S,)
        cos = self.cos_table[pos].t().unsqueeze(0).unsqueeze(2)  # (S,D) -> (1,D,1,S)
        sin = self.sin_table[pos].t().unsqueeze(0).unsqueeze(2)
        cached = (self.cache_positions < position.view(1, 1, 1, 1)).to(hidden.dtype)  # (1,1,1,T)
        cache_mask = ((1.0 - cached) * MASK_VALUE).expand(1, 1, self.window, -1)
        mask = torch.cat([cache_mask, self.window_mask.to(hidden.dtype)], dim=3)  # (1,1,S,T+S)
        return hidden, cos.to(hidden.dtype), sin.to(hidden.dtype), mask


class EmbeddingsPart(nn.Module):
    """A later file of an embedding table cut by rows: adds the lookup of vocabulary rows
    start .. start+rows-1 to the hidden states of the files before it.

    input_ids (1,S) int32, hidden_states (1,C,1,S) -> hidden_states_out (1,C,1,S)
    """

    def __init__(self, cfg: LlamaConfig, start: int, rows: int):
        super().__init__()
        self.start, self.vocab_size = start, cfg.vocab_size
        self.embed_tokens = nn.Embedding(rows, cfg.hidden_size)

    def forward(self, input_ids: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states + lookup(self.embed_tokens, input_ids, self.start, self.vocab_size)


def vocab_splits(vocab_size: int, limit: int = MAX_DIM) -> list[int]:
    """Split the vocabulary into the fewest near-equal parts of at most `limit` rows each, cut at
    multiples of ROW_UNIT rows (the last part takes the remainder)."""
    parts = -(-vocab_size // limit)
    while max(b - a for a, b in even_parts(vocab_size, parts, ROW_UNIT)) > limit:
        parts += 1
    return [b - a for a, b in even_parts(vocab_size, parts, ROW_UNIT)]


class LMHead(nn.Module):
    """Final norm and vocabulary projection, split so no dimension exceeds 16384.

    hidden_states (1,C,1,S) -> tuple of logits_j (1,V_j,1,S), for the splits j in `heads` (default:
    all; an LM head cut into files computes a group of them in each)
    """

    def __init__(self, cfg: LlamaConfig, heads: list[int] | None = None):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        splits = vocab_splits(cfg.vocab_size)
        self.splits = [splits[j] for j in (heads if heads is not None else range(len(splits)))]
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
