"""Attention layers in the ANE layout: softmax attention of grouped query heads over a K/V cache, the
cascade's attention states, and the Llama-family decoder layer around them. Each torch piece (what
the torch backend runs) has its MIL builder (`*_mil`, what the exporter saves) beside it, op for op.

    grouped_attention    q (G,R,D,S), k_cache/v_cache (G,D,T), the window's k/v (G,D,S),
                         mask (1,1,S,T+S) -> heads (G,R,D,S); grouped_attention_mil
    prefix_state, suffix_state, merge_states
                         the cascade's attention: every branch query over the shared prefix, each
                         over its own suffix and new key, the two states merged (log-sum-exp)
    DecoderLayer         the decoder layer: norm, q/k/v projections (q/k norms, RoPE),
                         grouped_attention, o_proj, residual, norm, MLP, residual;
                         decoder_layer_read_mil over a window
    branch_layer         the same layer, with the same weights, for B branch queries of one token
                         each (the cascade); branch_layer_mil

C = hidden size, D = head_dim, G kv heads with R query heads each, KV = G*D, T = the cache positions
a step reads (the context bucket, or a ring's R slots), S = the window, B branches with suffixes of
up to U tokens. Activations are channels-first (1, C, 1, S), as in `ops`; attention is computed per
head with matmuls over the channel axis.

States. An attention layer keeps its K and V, one row per layer in its chunk's caches (their specs:
chunk._caches): k_cache/v_cache (L,KV,1,T) over the context or, for a sliding layer where the
export has a ring (functions.ring_length), k_ring/v_ring (L_s,KV,1,R). A window reads the cache and
does not write it: it returns its own K/V (k after RoPE), k_new/v_new (L,KV,1,S), which the
cache-update model writes at `position` with a one-hot matmul (cache_update.py); with state caches
the chunk writes them itself (chunk.write_window_mil: a slice update at `position`, and a one-hot
write at the ring's slots (position + s) mod R). Cache positions at or past `position` are masked
(MASK_VALUE), so a step attends to what earlier steps wrote and to its own window. The cascade
reads the prefix's caches and each branch's suffix cache k_suffix/v_suffix (L*G,B,D,U), and returns
every layer's new K/V for the suffix caches. Gemma 4's KV-shared layers keep none: they read their
producer's.

Costs: `contract.layer_costs.Attention` (the keys a query reads, 4 flops per query channel per
key); `traffic` counts a step's reads of these caches (k_cache/v_cache up to the bucket that runs,
rings and suffix caches whole) and their writes. The projections and the MLP are weights.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from ...config import LlamaConfig
from .mamba2 import Mamba2Mixer, mamba_shape
from .ops import (MLP, Graph, RMSNorm, activation, activation_mil, apply_rope, apply_rope_mil, conv1x1, conv_mil,
                  head_norm, head_norm_mil, mb, mlp_mil, rms_norm_mil)

MASK_VALUE = -1.0e4  # large negative but finite: -inf turns a fully masked fp16 row into NaN
GROUPED_ROWS = 64  # up to this many query rows (R x S), one matmul per kv head (see grouped_attention)


def grouped_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_win: torch.Tensor,
                      v_win: torch.Tensor, mask: torch.Tensor, group: int, cache_length: int,
                      sink: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax attention of all heads over the cache and the current window, grouped for GQA.

    q: (G, R, D, S): R = `group` query heads per kv head, already scaled by 1/sqrt(D);
    k_cache, v_cache: (G, D, T) with T = `cache_length`; k_win, v_win: (G, D, S);
    mask: (1, 1, S, T + S) additive, cache columns first; sink: (G, R, 1, 1) or None, each head's
    sink logit, one more column of the softmax that attends to nothing. -> (G, R, D, S).

    The cache is neither transposed nor concatenated: the scores are, and the probabilities are
    split again at T. The exported programs multiply with a broadcast batch dim (G, R); run
    eagerly, torch would copy each kv head R times for that, so a small window (R x S up to
    `GROUPED_ROWS` query rows: decoding, verify windows) stacks its R heads' rows instead: per kv
    head one (R*S, D) x (D, T) product for the scores and one (R*S, T) x (T, D) for the values,
    each reading the cache once (the values as the right-hand side: BLAS runs the few rows of a
    verify window faster that way round than as (D, T) x (T, R*S)). Larger windows (prefill)
    keep the broadcast form, which spreads better over threads. Same arithmetic either way.
    """
    g, r, d, s = q.shape
    if torch.jit.is_tracing() or r * s > GROUPED_ROWS:
        qt = q.transpose(2, 3)  # (G, R, S, D)
        kc, vc, kw, vw = (x.unsqueeze(1) for x in (k_cache, v_cache, k_win, v_win))  # (G, 1, D, *)
        scores = torch.cat([torch.matmul(qt, kc), torch.matmul(qt, kw)], dim=3) + mask  # (G, R, S, T+S)
        p = torch.softmax(with_sink(scores, sink), dim=3)
        return (torch.matmul(vc, p[..., :cache_length].transpose(2, 3))
                + torch.matmul(vw, p[..., cache_length:cache_length + s].transpose(2, 3)))
    rows = q.transpose(2, 3).reshape(g, r * s, d)  # (G, R*S, D)
    scores = torch.cat([torch.bmm(rows, k_cache), torch.bmm(rows, k_win)], dim=2).view(g, r, s, -1) + mask
    p = torch.softmax(with_sink(scores, sink), dim=3).view(g, r * s, -1)  # (G, R*S, T+S[+1])
    out = torch.bmm(p[..., :cache_length], v_cache.transpose(1, 2))  # (G, R*S, D)
    out = out.baddbmm_(p[..., cache_length:cache_length + s], v_win.transpose(1, 2))
    return out.view(g, r, s, d).transpose(2, 3)


def with_sink(scores: torch.Tensor, sink: torch.Tensor | None) -> torch.Tensor:
    """scores (..., K) with each head's sink logit (G,R,1,1) as column K, where there is one."""
    if sink is None:
        return scores
    return torch.cat([scores, sink.expand(*scores.shape[:-1], 1).to(scores.dtype)], dim=-1)


def sink_mil(g: Graph, prefix: str, gr: tuple[int, int], rows: int):
    """The layer's sinks (`prefix`sinks, (H,)) as (G,R,rows,1), one per query head and row."""
    gk, r = gr
    sink = mb.reshape(x=g.weight(f"{prefix}sinks"), shape=[gk, r, 1, 1])
    return sink if rows == 1 else mb.add(x=sink, y=g.const(np.zeros((1, 1, rows, 1)), f"{prefix}sink_rows"))


def grouped_attention_mil(g: Graph, q, kc, vc, kw, vw, mask, t: int, s: int, shape_gr: tuple[int, int], sink=None):
    """grouped_attention in its broadcast form.

    q: (G,R,D,S); kc, vc: (G,1,D,T); kw, vw: (G,1,D,S); mask: (1,1,S,T+S); sink: (G,R,S,1) or None
    -> (G,R,D,S)
    """
    gk, r = shape_gr
    scores = mb.concat(values=[mb.matmul(x=q, y=kc, transpose_x=True), mb.matmul(x=q, y=kw, transpose_x=True)],
                       axis=3)  # (G,R,S,T+S)
    scores = mb.add(x=scores, y=mask)
    if sink is not None:
        scores = mb.concat(values=[scores, sink], axis=3)
    p = mb.softmax(x=scores, axis=3)
    p_cache = g.slice(p, [0, 0, 0, 0], [gk, r, s, t])
    p_win = g.slice(p, [0, 0, 0, t], [gk, r, s, t + s])
    return mb.add(x=mb.matmul(x=vc, y=p_cache, transpose_y=True), y=mb.matmul(x=vw, y=p_win, transpose_y=True))


# The cascade's attention (chunk.BranchChunk): B branch queries attend to one shared prefix and
# each to its own suffix, and the two attention states are merged with the log-sum-exp operator:
#     v = (v_p * e^(s_p - m) + v_s * e^(s_s - m)) / (e^(s_p - m) + e^(s_s - m)),  m = max(s_p, s_s)


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


def _softmax_state_mil(scores, axis_len_axis: int = 3):
    """exp(scores - max) and its max and sum over the last axis (keep_dims)."""
    m = mb.reduce_max(x=scores, axes=[axis_len_axis], keep_dims=True)
    p = mb.exp(x=mb.sub(x=scores, y=m))
    return p, m, mb.reduce_sum(x=p, axes=[axis_len_axis], keep_dims=True)


def prefix_state_mil(q, k, v, mask):
    """prefix_state. q: (G,R,D,B); k, v: (G,1,D,T); mask: (1,1,1,T) -> v_p (G,R,D,B), s_p (G,R,1,B)"""
    p, m, denom = _softmax_state_mil(mb.add(x=mb.matmul(x=q, y=k, transpose_x=True), y=mask))  # (G,R,B,T)
    out = mb.real_div(x=mb.matmul(x=v, y=p, transpose_y=True), y=mb.transpose(x=denom, perm=[0, 1, 3, 2]))
    return out, mb.transpose(x=mb.add(x=m, y=mb.log(x=denom)), perm=[0, 1, 3, 2])


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


def suffix_state_mil(g: Graph, q, k_suffix, v_suffix, k_self, v_self, mask, gr: tuple[int, int], b: int, u: int):
    """suffix_state. q: (G,R,D,B); k_suffix, v_suffix: (G,B,D,U); k_self, v_self: (G,D,B);
    mask: (1,B,1,U+1) -> v_s (G,R,D,B), s_s (G,R,1,B)
    """
    gk, r = gr
    qb = mb.transpose(x=q, perm=[0, 3, 1, 2])  # (G,B,R,D)
    ks = mb.expand_dims(x=mb.transpose(x=k_self, perm=[0, 2, 1]), axes=[3])  # (G,B,D,1)
    vs = mb.expand_dims(x=mb.transpose(x=v_self, perm=[0, 2, 1]), axes=[3])
    scores = mb.concat(values=[mb.matmul(x=qb, y=k_suffix), mb.matmul(x=qb, y=ks)], axis=3)  # (G,B,R,U+1)
    p, m, denom = _softmax_state_mil(mb.add(x=scores, y=mask))
    out = mb.add(x=mb.matmul(x=v_suffix, y=g.slice(p, [0, 0, 0, 0], [gk, b, r, u]), transpose_y=True),
                 y=mb.matmul(x=vs, y=g.slice(p, [0, 0, 0, u], [gk, b, r, u + 1]), transpose_y=True))  # (G,B,D,R)
    out = mb.real_div(x=out, y=mb.transpose(x=denom, perm=[0, 1, 3, 2]))
    return (mb.transpose(x=out, perm=[0, 3, 2, 1]),
            mb.transpose(x=mb.add(x=m, y=mb.log(x=denom)), perm=[0, 2, 3, 1]))


def merge_states(v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor,
                 sink: torch.Tensor | None = None) -> torch.Tensor:
    """The log-sum-exp merge of two attention states over disjoint key sets, and of the heads'
    sink logits where there are some (a third state whose value is zero).

    v_a, v_b: (..., D, B); s_a, s_b: (..., 1, B) natural-log LSE; sink: (..., 1, 1) -> (..., D, B)
    """
    m = torch.maximum(s_a, s_b)
    if sink is not None:
        m = torch.maximum(m, sink)
    w_a = torch.exp(s_a - m)
    w_b = torch.exp(s_b - m)
    total = w_a + w_b if sink is None else w_a + w_b + torch.exp(sink - m)
    return (v_a * w_a + v_b * w_b) / total


def merge_states_mil(v_a, s_a, v_b, s_b, sink=None):
    """merge_states. sink: (G,R,1,1) or None"""
    m = mb.maximum(x=s_a, y=s_b)
    if sink is not None:
        m = mb.maximum(x=m, y=sink)
    w_a = mb.exp(x=mb.sub(x=s_a, y=m))
    w_b = mb.exp(x=mb.sub(x=s_b, y=m))
    weighted = mb.add(x=mb.mul(x=v_a, y=w_a), y=mb.mul(x=v_b, y=w_b))  # before the sum: the ops' order names them
    total = mb.add(x=w_a, y=w_b)
    if sink is not None:
        total = mb.add(x=total, y=mb.exp(x=mb.sub(x=sink, y=m)))
    return mb.real_div(x=weighted, y=total)


class DecoderLayer(nn.Module):
    """Decoder layer `layer` of the Llama family (Llama, Mistral, Qwen2 with q/k/v biases, Qwen3 with
    per-head q/k norms, SmolLM3 with layers without RoPE, OLMo 2 with norms after attention and MLP
    and q/k norms across heads, Gemma 3 with norms before and after both and a GeGLU MLP, Qwen3.5 and
    LFM3 with their output gates). The
    attention scale is folded into q_proj's weights (into q_norm's where there is one). The norms
    over the hidden size use `stream_eps` (see LlamaConfig.stream_scale)."""

    def __init__(self, cfg: LlamaConfig, context_length: int, layer: int = 0):
        super().__init__()
        self.cfg = cfg
        self.context_length = context_length
        self.rotary = cfg.rotary(layer)
        self.slides, self.local_rope = cfg.slides(layer), cfg.local_rope(layer)
        eps = cfg.stream_eps
        if cfg.input_norm:
            self.input_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.q_proj = conv1x1(cfg.hidden_size, cfg.q_channels, cfg.qkv_bias)
        self.shares_kv = cfg.shares_kv(layer)  # Gemma 4's KV-shared layers: no K/V of their own
        if not self.shares_kv:
            self.k_proj = conv1x1(cfg.hidden_size, cfg.kv_channels, cfg.qkv_bias)
        self.value_from_key = cfg.value_from_key(layer)
        if not self.value_from_key and not self.shares_kv:
            self.v_proj = conv1x1(cfg.hidden_size, cfg.kv_channels, cfg.qkv_bias)
        self.o_proj = conv1x1(cfg.q_channels, cfg.hidden_size, cfg.o_proj_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.q_norm_channels, cfg.rms_norm_eps)
        if cfg.qk_norm and not self.shares_kv:
            self.k_norm = RMSNorm(cfg.k_norm_channels, cfg.rms_norm_eps)
        if cfg.value_norm:
            self.v_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, scale=False)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
        if cfg.sandwich_norms:
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps)
        if cfg.post_norms or cfg.sandwich_norms:
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps)
        if cfg.per_layer_input_size:  # Gemma 4's per-layer input, after the MLP
            self.per_layer_input_gate = conv1x1(cfg.hidden_size, cfg.per_layer_input_size)
            self.per_layer_projection = conv1x1(cfg.per_layer_input_size, cfg.hidden_size)
            self.post_per_layer_input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # of an unscaled value
        if cfg.layer_scalar:
            self.layer_scalar = nn.Parameter(torch.ones(1))
        if cfg.attn_output_gate:  # Qwen3.5: the heads gated by sigmoid(o_gate(h)) before o_proj
            self.o_gate = conv1x1(cfg.hidden_size, cfg.q_channels)
        if cfg.attn_head_gate:  # LFM3: each head scaled by sigmoid(g_proj(h)), one gate a head
            self.g_proj = conv1x1(cfg.hidden_size, cfg.num_attention_heads)
        if cfg.attention_sinks:
            self.sinks = nn.Parameter(torch.zeros(cfg.num_attention_heads))
        if cfg.mamba(layer):  # Falcon-H1: a Mamba-2 mixer beside attention, on the same normed input
            self.mamba = Mamba2Mixer(cfg.hidden_size, mamba_shape(cfg))

    def sink(self) -> torch.Tensor | None:
        """The heads' sink logits as (G,R,1,1), where the layer has sinks."""
        if not self.cfg.attention_sinks:
            return None
        g = self.cfg.num_key_value_heads
        return self.sinks.reshape(g, -1, 1, 1)

    def rope(self, cos, sin, cos_local, sin_local):
        """The RoPE tables this layer rotates with: the local ones on a local layer (Gemma 3's sliding layers)."""
        return (cos_local, sin_local) if self.local_rope else (cos, sin)

    def attention_mask(self, mask, sliding_mask):
        """The mask this layer attends with: the sliding one on a sliding layer, where the export has one."""
        return sliding_mask if self.slides and sliding_mask is not None else mask

    def normed(self, x: torch.Tensor) -> torch.Tensor:
        """The layer's input as attention reads it: normalized, where the family norms it first."""
        return self.input_layernorm(x) if self.cfg.input_norm else x

    def gated(self, h: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
        """The attention heads (G,R,D,S) times sigmoid(o_gate(h)) where the layer gates its output
        (Qwen3.5), or times sigmoid(g_proj(h)), one gate a head over its D channels (LFM3), else as
        they are; h: the normed input (1,C,1,S)."""
        if self.cfg.attn_head_gate:
            g, r = heads.shape[:2]
            return heads * torch.sigmoid(self.g_proj(h)).reshape(g, r, 1, -1)
        if not self.cfg.attn_output_gate:
            return heads
        return heads * torch.sigmoid(self.o_gate(h)).reshape(heads.shape)

    def project_qkv(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, shared=None):
        """Projections of the normed input h (`normed`) (q/k/v biases, per-head q/k norms where the
        family has them) and RoPE.

        h: (1,C,1,S); cos, sin: (1,D,1,S) -> q: (G,R,D,S), k, v: (G,D,S) for G kv heads with
        R query heads each. A KV-shared layer projects q only: k, v are `shared` (its producer's
        (1,KV,1,S)).
        """
        c = self.cfg
        g, d = c.num_key_value_heads, c.head_dim
        r = c.num_attention_heads // g
        cos, sin = cos.reshape(1, d, -1), sin.reshape(1, d, -1)
        if shared is not None:
            q = self.q_norm(self.q_proj(h)) if c.qk_norm_across_heads else self.q_proj(h)
            q = q.reshape(g * r, d, -1)
            if c.qk_norm and not c.qk_norm_across_heads:
                q = head_norm(self.q_norm, q)
            if self.rotary:
                q = apply_rope(q, cos, sin, c.rotary_dim // 2, d - c.rotary_dim)
            return q.reshape(g, r, d, -1), shared[0].reshape(g, d, -1), shared[1].reshape(g, d, -1)
        q, k = self.q_proj(h), self.k_proj(h)  # (1,H*D,1,S), (1,G*D,1,S)
        v = (k if self.value_from_key else self.v_proj(h)).reshape(g, d, -1)
        if c.value_norm:
            v = head_norm(self.v_norm, v)
        if c.qk_norm_across_heads:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.reshape(g * r, d, -1), k.reshape(g, d, -1)  # (H,D,S), (G,D,S)
        if c.qk_norm and not c.qk_norm_across_heads:
            q, k = head_norm(self.q_norm, q), head_norm(self.k_norm, k)
        if self.rotary:
            half, rest = c.rotary_dim // 2, d - c.rotary_dim
            q, k = apply_rope(q, cos, sin, half, rest), apply_rope(k, cos, sin, half, rest)
        return q.reshape(g, r, d, -1), k, v

    def finish(self, x: torch.Tensor, heads: torch.Tensor, per_layer_input: torch.Tensor | None = None,
               beside: torch.Tensor | None = None) -> torch.Tensor:
        """Output projection, residual, MLP and residual (then Gemma 4's per-layer input and layer
        scalar). heads: (G,R,D,S); per_layer_input: (1,P,1,S); beside: what a mixer beside attention
        adds to its output (1,C,1,S) -> x_out (1,C,1,S)"""
        attention = self.o_proj(heads.reshape(1, self.cfg.q_channels, 1, -1))
        if beside is not None:
            attention = attention + beside
        if self.cfg.sandwich_norms:
            x = x + self.post_attention_layernorm(attention)
            x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
            return self.per_layer(x, per_layer_input)
        if self.cfg.post_norms:
            x = x + self.post_attention_layernorm(attention)
            return x + self.post_feedforward_layernorm(self.mlp(x))
        x = x + attention
        return x + self.mlp(self.post_attention_layernorm(x))

    def per_layer(self, x: torch.Tensor, per_layer_input: torch.Tensor | None) -> torch.Tensor:
        """Gemma 4's end of a layer: the per-layer input through its gate and projection, normalized
        and added (where the model has per-layer inputs), then the layer's scalar. x: (1,C,1,S)"""
        if self.cfg.per_layer_input_size:
            gated = activation(self.per_layer_input_gate(x), self.cfg.hidden_act) * per_layer_input
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return x * self.layer_scalar if self.cfg.layer_scalar else x

    def forward(self, x, cos, sin, mask, k_cache, v_cache, per_layer_input=None, shared=None, side=None):
        """x: (1,C,1,S); cos, sin: (1,D,1,S); mask: (1,1,S,T+S); k_cache, v_cache: (1,KV,1,T).

        T is the context bucket in the exported programs; the torch backend may pass fewer cache
        positions (those holding tokens) with the mask cut to match. The mask decides: a longer cache
        (a state of the whole context read in a smaller bucket) is read up to the mask's T. Returns
        x_out (1,C,1,S) and the window's k_new, v_new (1,KV,1,S) (k after RoPE). A KV-shared layer
        reads its producer's caches and its window's K/V (`shared`, (1,KV,1,S) each). `side` (the
        normed input -> (1,C,1,S)) runs a mixer beside attention (Falcon-H1's Mamba-2), its output added
        to attention's.
        """
        c = self.cfg
        g, d, t = c.num_key_value_heads, c.head_dim, mask.shape[-1] - mask.shape[-2]
        k_cache, v_cache = k_cache[..., :t], v_cache[..., :t]
        h = self.normed(x)
        beside = side(h) if side else None
        q, k, v = self.project_qkv(h, cos, sin, shared)
        heads = grouped_attention(q, k_cache.reshape(g, d, t), v_cache.reshape(g, d, t), k, v, mask,
                                  c.num_attention_heads // g, t, self.sink())
        x = self.finish(x, self.gated(h, heads), per_layer_input, beside)
        return x, k.reshape(1, c.kv_channels, 1, -1), v.reshape(1, c.kv_channels, 1, -1)


def _projection_mil(g: Graph, cfg: LlamaConfig, prefix: str, name: str, x):
    """Layer projection `name` ("q_proj", ...) of x (1,C_in,1,S) -> (1,C_out,1,S), with its bias if
    the family has one (LlamaConfig.layer_extras)."""
    bias = f"{name}.bias" if f"{name}.bias" in cfg.layer_extras else None
    return conv_mil(g, x, f"{prefix}{name}.weight", bias and prefix + bias)


def normed_mil(g: Graph, cfg: LlamaConfig, prefix: str, x):
    """DecoderLayer.normed. x: (1,C,1,S) -> (1,C,1,S)"""
    return rms_norm_mil(g, x, f"{prefix}input_layernorm.weight", cfg.stream_eps, cfg.hidden_size) \
        if cfg.input_norm else x


def gated_mil(g: Graph, cfg: LlamaConfig, prefix: str, hn, heads, s: int):
    """DecoderLayer.gated. hn: the normed input (1,C,1,S); heads: (G,R,D,S) -> (G,R,D,S)"""
    gk, d = cfg.num_key_value_heads, cfg.head_dim
    if cfg.attn_head_gate:  # (1,H,1,S) as (G,R,1,S), broadcast over each head's D channels
        gate = mb.sigmoid(x=conv_mil(g, hn, f"{prefix}g_proj.weight"))
        return mb.mul(x=heads, y=mb.reshape(x=gate, shape=[gk, cfg.num_attention_heads // gk, 1, s]))
    if not cfg.attn_output_gate:
        return heads
    gate = mb.sigmoid(x=conv_mil(g, hn, f"{prefix}o_gate.weight"))
    return mb.mul(x=heads, y=mb.reshape(x=gate, shape=[gk, cfg.num_attention_heads // gk, d, s]))


def project_qkv_mil(g: Graph, cfg: LlamaConfig, prefix: str, hn, cos, sin, s: int, layer: int, shared=None):
    """DecoderLayer.project_qkv of the layer under `prefix` ("layers.0."), decoder layer `layer` of the model.
    hn: the normed input (1,C,1,S); cos, sin: (1,D,1,S) -> q (G,R,D,S), k, v (G,D,S); a KV-shared
    layer's k, v are `shared` (its producer's, (1,KV,1,S))"""
    cfg = cfg.at(layer)
    gk, d, h = cfg.num_key_value_heads, cfg.head_dim, cfg.num_attention_heads
    cos3, sin3 = mb.reshape(x=cos, shape=[1, d, s]), mb.reshape(x=sin, shape=[1, d, s])
    if shared is not None:
        q = _projection_mil(g, cfg, prefix, "q_proj", hn)
        if cfg.qk_norm_across_heads:
            q = rms_norm_mil(g, q, f"{prefix}q_norm.weight", cfg.rms_norm_eps, cfg.q_channels)
        q = mb.reshape(x=q, shape=[h, d, s])
        if cfg.qk_norm and not cfg.qk_norm_across_heads:
            q = head_norm_mil(g, q, f"{prefix}q_norm.weight", cfg.rms_norm_eps, h, d, s)
        if cfg.rotary(layer):
            q = apply_rope_mil(g, q, cos3, sin3, h, d, s, cfg.rotary_dim)
        k, v = (mb.reshape(x=t, shape=[gk, d, s]) for t in shared)
        return mb.reshape(x=q, shape=[gk, h // gk, d, s]), k, v
    q, k = _projection_mil(g, cfg, prefix, "q_proj", hn), _projection_mil(g, cfg, prefix, "k_proj", hn)
    k_projected = k
    if cfg.qk_norm_across_heads:
        q = rms_norm_mil(g, q, f"{prefix}q_norm.weight", cfg.rms_norm_eps, cfg.q_channels)
        k = rms_norm_mil(g, k, f"{prefix}k_norm.weight", cfg.rms_norm_eps, cfg.kv_channels)
    q, k = mb.reshape(x=q, shape=[h, d, s]), mb.reshape(x=k, shape=[gk, d, s])
    if cfg.qk_norm and not cfg.qk_norm_across_heads:
        q = head_norm_mil(g, q, f"{prefix}q_norm.weight", cfg.rms_norm_eps, h, d, s)
        k = head_norm_mil(g, k, f"{prefix}k_norm.weight", cfg.rms_norm_eps, gk, d, s)
    if cfg.rotary(layer):
        q = apply_rope_mil(g, q, cos3, sin3, h, d, s, cfg.rotary_dim)
        k = apply_rope_mil(g, k, cos3, sin3, gk, d, s, cfg.rotary_dim)
    v = k_projected if cfg.value_from_key(layer) else _projection_mil(g, cfg, prefix, "v_proj", hn)
    v = mb.reshape(x=v, shape=[gk, d, s])
    if cfg.value_norm:
        v = head_norm_mil(g, v, None, cfg.rms_norm_eps, gk, d, s)
    return mb.reshape(x=q, shape=[gk, h // gk, d, s]), k, v


def finish_mil(g: Graph, cfg: LlamaConfig, prefix: str, x, heads, s: int, per_layer_input=None, beside=None):
    """DecoderLayer.finish. heads: (G,R,D,S); per_layer_input: (1,P,1,S); beside: (1,C,1,S) -> x_out (1,C,1,S)"""
    attention = _projection_mil(g, cfg, prefix, "o_proj", mb.reshape(x=heads, shape=[1, cfg.q_channels, 1, s]))
    if beside is not None:
        attention = mb.add(x=attention, y=beside)
    c, eps, act = cfg.hidden_size, cfg.stream_eps, cfg.hidden_act
    if cfg.post_norms or cfg.sandwich_norms:
        x = mb.add(x=x, y=rms_norm_mil(g, attention, f"{prefix}post_attention_layernorm.weight", eps, c))
        h = rms_norm_mil(g, x, f"{prefix}pre_feedforward_layernorm.weight", eps, c) if cfg.sandwich_norms else x
        x = mb.add(x=x, y=rms_norm_mil(g, mlp_mil(g, h, f"{prefix}mlp.", act),
                                       f"{prefix}post_feedforward_layernorm.weight", eps, c))
        return per_layer_mil(g, cfg, prefix, x, per_layer_input)
    x = mb.add(x=x, y=attention)
    h = rms_norm_mil(g, x, f"{prefix}post_attention_layernorm.weight", eps, c)
    return mb.add(x=x, y=mlp_mil(g, h, f"{prefix}mlp.", act))


def per_layer_mil(g: Graph, cfg: LlamaConfig, prefix: str, x, per_layer_input):
    """DecoderLayer.per_layer. x: (1,C,1,S); per_layer_input: (1,P,1,S) -> (1,C,1,S)"""
    if cfg.per_layer_input_size:
        gated = mb.mul(x=activation_mil(g, conv_mil(g, x, f"{prefix}per_layer_input_gate.weight"), cfg.hidden_act),
                       y=per_layer_input)
        x = mb.add(x=x, y=rms_norm_mil(g, conv_mil(g, gated, f"{prefix}per_layer_projection.weight"),
                                       f"{prefix}post_per_layer_input_norm.weight", cfg.rms_norm_eps, cfg.hidden_size))
    return mb.mul(x=x, y=g.weight(f"{prefix}layer_scalar")) if cfg.layer_scalar else x

def decoder_layer_read_mil(g: Graph, cfg: LlamaConfig, prefix: str, x, cos, sin, mask, k_rows, v_rows, t: int,
                           s: int, layer: int, per_layer_input=None, shared=None, side=None):
    """DecoderLayer.forward over a window of S tokens (decoder layer `layer` of the model).

    x: (1,C,1,S); k_rows, v_rows: the layer's cache as (G,1,D,T) (T: the bucket's positions, or the
    ring's slots) -> x_out (1,C,1,S), k_new, v_new (1,KV,1,S); side: as DecoderLayer.forward's
    """
    cfg = cfg.at(layer)
    gk, d, r = cfg.num_key_value_heads, cfg.head_dim, cfg.num_attention_heads // cfg.num_key_value_heads
    hn = normed_mil(g, cfg, prefix, x)
    beside = side(hn) if side else None
    q, k, v = project_qkv_mil(g, cfg, prefix, hn, cos, sin, s, layer, shared)
    heads = grouped_attention_mil(g, q, k_rows, v_rows,
                                  mb.reshape(x=k, shape=[gk, 1, d, s]), mb.reshape(x=v, shape=[gk, 1, d, s]),
                                  mask, t, s, (gk, r),
                                  sink_mil(g, prefix, (gk, r), s) if cfg.attention_sinks else None)
    x = finish_mil(g, cfg, prefix, x, gated_mil(g, cfg, prefix, hn, heads, s), s, per_layer_input, beside)
    return x, mb.reshape(x=k, shape=[1, cfg.kv_channels, 1, s]), mb.reshape(x=v, shape=[1, cfg.kv_channels, 1, s])


def branch_layer(layer: DecoderLayer, x, cos, sin, prefix_mask, suffix_mask, k_cache, v_cache,
                 k_suffix, v_suffix, suffix_length: int, per_layer_input=None, shared=None, side=None):
    """One decoder layer for B branch queries (same weights as the layer's own forward).

    x: (1,C,1,B); k_cache, v_cache: (1,KV,1,T); k_suffix, v_suffix: (G,B,D,U)
    -> x_out (1,C,1,B), k_new, v_new (1,KV,1,B)
    """
    c = layer.cfg
    g, d, t = c.num_key_value_heads, c.head_dim, k_cache.shape[-1]  # T, the filled prefix (torch backend), or R
    h = layer.normed(x)
    beside = side(h) if side else None  # a mixer beside attention, each branch from its own states
    q, k, v = layer.project_qkv(h, cos, sin, shared)  # a KV-shared layer: its producer's caches and K/V
    v_p, s_p = prefix_state(q, k_cache.reshape(g, d, t), v_cache.reshape(g, d, t), prefix_mask)
    v_s, s_s = suffix_state(q, k_suffix, v_suffix, k, v, suffix_mask, suffix_length)
    x = layer.finish(x, layer.gated(h, merge_states(v_p, s_p, v_s, s_s, layer.sink())), per_layer_input, beside)
    return x, k.reshape(1, c.kv_channels, 1, -1), v.reshape(1, c.kv_channels, 1, -1)


def branch_layer_mil(g: Graph, cfg: LlamaConfig, prefix: str, x, cos, sin, prefix_mask, suffix_mask, k_rows,
                     v_rows, k_suffix, v_suffix, i: int, b: int, u: int, layer: int, per_layer_input=None, shared=None,
                     side=None):
    """branch_layer of decoder layer `layer`. x: (1,C,1,B); k_rows, v_rows: the layer's prefix cache
    (G,1,D,T) or ring (G,1,D,R); k_suffix, v_suffix: (L*G,B,D,U), rows of chunk layer i read
    -> x_out (1,C,1,B), k_new, v_new (1,KV,1,B)
    """
    cfg = cfg.at(layer)
    gk, d, r = cfg.num_key_value_heads, cfg.head_dim, cfg.num_attention_heads // cfg.num_key_value_heads
    hn = normed_mil(g, cfg, prefix, x)
    beside = side(hn) if side else None
    q, k, v = project_qkv_mil(g, cfg, prefix, hn, cos, sin, b, layer, shared)
    v_p, s_p = prefix_state_mil(q, k_rows, v_rows, prefix_mask)
    rows = ([i * gk, 0, 0, 0], [(i + 1) * gk, b, d, u])
    v_s, s_s = suffix_state_mil(g, q, g.slice(k_suffix, *rows), g.slice(v_suffix, *rows), k, v, suffix_mask,
                                (gk, r), b, u)
    sink = sink_mil(g, prefix, (gk, r), 1) if cfg.attention_sinks else None
    x = finish_mil(g, cfg, prefix, x, gated_mil(g, cfg, prefix, hn, merge_states_mil(v_p, s_p, v_s, s_s, sink), b),
                   b, per_layer_input, beside)
    return x, mb.reshape(x=k, shape=[1, cfg.kv_channels, 1, b]), mb.reshape(x=v, shape=[1, cfg.kv_channels, 1, b])
