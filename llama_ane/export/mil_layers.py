"""The decoder's building blocks written with coremltools' MIL builder, op for op the torch modules
of `llama_ane.chunks` (the reference they are checked against).

Building MIL directly instead of tracing torch modules lets the exporter read every weight once,
straight from the checkpoint in the export dtype, and share it between the functions of a package:
a const created with the same `weight_id` in several functions is written to the weight blob once.

Every helper takes and returns MIL vars in the layouts the torch modules use (see their
docstrings); sizes are Python ints, so every shape is static.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
from coremltools.converters.mil import Builder as mb

from ..chunks.layers import MASK_VALUE
from ..config import LlamaConfig
from ..quantize import Compression
from .compressed import Payload, compress, constexpr

Weights = Callable[[str], np.ndarray]  # our parameter name -> array in the export dtype


@dataclass
class Graph:
    """What every helper needs: the float dtype of the program and where its weights come from.

    `weight(name)` makes a const of parameter `name` whose blob entry is shared by every function
    of the package that uses the same name, or, when `compressions(name)` says so, the constexpr
    op that decompresses it (see compressed.py). Each weight is read (and compressed) once for all
    functions; a compressed weight's dense array is not kept. `ios18`: the program's opset has
    the grouped and blockwise constexpr ops.
    """

    dtype: type  # np.float16 or np.float32
    weights: Weights
    compressions: Callable[[str], Compression | None] = lambda name: None
    ios18: bool = True
    importance: Callable[[str], np.ndarray | None] = lambda name: None
    _values: dict[str, np.ndarray | Payload] = field(default_factory=dict)

    def scalar(self, value: float):
        return self.dtype(value)

    def const(self, value: np.ndarray, name: str):
        return mb.const(val=np.asarray(value, self.dtype), name=name)

    def weight(self, name: str):
        if name not in self._values:
            c = self.compressions(name)
            self._values[name] = (self.weights(name) if c is None
                                  else compress(self.weights(name), c, self.importance(name)))
        value = self._values[name]
        if isinstance(value, Payload):
            return constexpr(name, value, self.ios18)
        var = mb.const(val=value, name=name.replace(".", "_"))
        var.op.weight_id = name
        return var

    def slice(self, x, begin: list[int], end: list[int]):
        return mb.slice_by_index(x=x, begin=np.array(begin, np.int32), end=np.array(end, np.int32))


def rms_norm(g: Graph, x, weight: str, eps: float, channels: int):
    """RMSNorm over channels, pre-scaled by 1/max|x| so no square overflows fp16 (see RMSNorm).

    x: (B, C, 1, S) -> (B, C, 1, S)
    """
    m = mb.maximum(x=mb.reduce_max(x=mb.abs(x=x), axes=[1], keep_dims=True), y=g.scalar(1e-4))
    inv_m = mb.inverse(x=m)
    y = mb.mul(x=x, y=inv_m)
    var = mb.add(x=mb.reduce_mean(x=mb.mul(x=y, y=y), axes=[1], keep_dims=True),
                 y=mb.mul(x=mb.mul(x=inv_m, y=g.scalar(eps)), y=inv_m))
    w = mb.reshape(x=g.weight(weight), shape=[1, channels, 1, 1])
    return mb.mul(x=mb.mul(x=y, y=mb.rsqrt(x=var)), y=w)


def conv(g: Graph, x, weight: str, bias: str | None = None):
    """1x1 conv (the ANE's matmul), with the conv's own per-channel `bias` where the projection has
    one (Qwen2's q/k/v). x: (1, C_in, 1, S) -> (1, C_out, 1, S)"""
    if bias is None:
        return mb.conv(x=x, weight=g.weight(weight))
    return mb.conv(x=x, weight=g.weight(weight), bias=g.weight(bias))


def projection(g: Graph, cfg: LlamaConfig, prefix: str, name: str, x):
    """Layer projection `name` ("q_proj", ...) of x (1,C_in,1,S) -> (1,C_out,1,S), with its bias if
    the family has one (LlamaConfig.layer_extras)."""
    bias = f"{name}.bias" if f"{name}.bias" in cfg.layer_extras else None
    return conv(g, x, f"{prefix}{name}.weight", bias and prefix + bias)


def head_norm(g: Graph, x, weight: str, eps: float, heads: int, d: int, s: int):
    """RMSNorm of each head over head_dim (Qwen3's q_norm/k_norm; layers.head_norm), fp16-safe as
    rms_norm. x: (H, D, S) -> (H, D, S)"""
    y = rms_norm(g, mb.reshape(x=x, shape=[heads, d, 1, s]), weight, eps, d)
    return mb.reshape(x=y, shape=[heads, d, s])


def rope(g: Graph, x, cos, sin, heads: int, d: int, s: int):
    """x*cos + rotate_half(x)*sin. x: (H, D, S); cos, sin: (1, D, S) -> (H, D, S)"""
    half = d // 2
    upper = g.slice(x, [0, half, 0], [heads, d, s])
    lower = g.slice(x, [0, 0, 0], [heads, half, s])
    rotated = mb.concat(values=[mb.mul(x=upper, y=g.scalar(-1.0)), lower], axis=1)
    return mb.add(x=mb.mul(x=x, y=cos), y=mb.mul(x=rotated, y=sin))


def project_qkv(g: Graph, cfg: LlamaConfig, prefix: str, x, cos, sin, s: int):
    """Norm, projections (with biases, per-head q/k norms where the family has them) and RoPE of one
    layer (DecoderLayer.project_qkv).

    x: (1,C,1,S); cos, sin: (1,D,1,S) -> q (G,R,D,S), k, v (G,D,S)
    """
    gk, d, h = cfg.num_key_value_heads, cfg.head_dim, cfg.num_attention_heads
    hn = rms_norm(g, x, f"{prefix}input_layernorm.weight", cfg.rms_norm_eps, cfg.hidden_size)
    cos3, sin3 = mb.reshape(x=cos, shape=[1, d, s]), mb.reshape(x=sin, shape=[1, d, s])
    q = mb.reshape(x=projection(g, cfg, prefix, "q_proj", hn), shape=[h, d, s])
    k = mb.reshape(x=projection(g, cfg, prefix, "k_proj", hn), shape=[gk, d, s])
    if cfg.qk_norm:
        q = head_norm(g, q, f"{prefix}q_norm.weight", cfg.rms_norm_eps, h, d, s)
        k = head_norm(g, k, f"{prefix}k_norm.weight", cfg.rms_norm_eps, gk, d, s)
    q, k = rope(g, q, cos3, sin3, h, d, s), rope(g, k, cos3, sin3, gk, d, s)
    v = mb.reshape(x=projection(g, cfg, prefix, "v_proj", hn), shape=[gk, d, s])
    return mb.reshape(x=q, shape=[gk, h // gk, d, s]), k, v


def finish_layer(g: Graph, cfg: LlamaConfig, prefix: str, x, heads, s: int):
    """Output projection, residual, MLP and residual. heads: (G,R,D,S) -> x_out (1,C,1,S)"""
    x = mb.add(x=x, y=projection(g, cfg, prefix, "o_proj", mb.reshape(x=heads, shape=[1, cfg.q_channels, 1, s])))
    h = rms_norm(g, x, f"{prefix}post_attention_layernorm.weight", cfg.rms_norm_eps, cfg.hidden_size)
    gate = mb.silu(x=conv(g, h, f"{prefix}mlp.gate_proj.weight"))
    up = conv(g, h, f"{prefix}mlp.up_proj.weight")
    return mb.add(x=x, y=conv(g, mb.mul(x=gate, y=up), f"{prefix}mlp.down_proj.weight"))


def layer_cache(g: Graph, cfg: LlamaConfig, cache, i: int, t: int):
    """Layer i's slice of a chunk cache (L,KV,1,T) as (G,1,D,T)."""
    one = g.slice(cache, [i, 0, 0, 0], [i + 1, cfg.kv_channels, 1, t])
    return mb.reshape(x=one, shape=[cfg.num_key_value_heads, 1, cfg.head_dim, t])


def grouped_attention(g: Graph, q, kc, vc, kw, vw, mask, t: int, s: int, shape_gr: tuple[int, int]):
    """Softmax attention over the cache and the window (layers.grouped_attention).

    q: (G,R,D,S); kc, vc: (G,1,D,T); kw, vw: (G,1,D,S); mask: (1,1,S,T+S) -> (G,R,D,S)
    """
    gk, r = shape_gr
    scores = mb.concat(values=[mb.matmul(x=q, y=kc, transpose_x=True), mb.matmul(x=q, y=kw, transpose_x=True)],
                       axis=3)  # (G,R,S,T+S)
    p = mb.softmax(x=mb.add(x=scores, y=mask), axis=3)
    p_cache = g.slice(p, [0, 0, 0, 0], [gk, r, s, t])
    p_win = g.slice(p, [0, 0, 0, t], [gk, r, s, t + s])
    return mb.add(x=mb.matmul(x=vc, y=p_cache, transpose_y=True), y=mb.matmul(x=vw, y=p_win, transpose_y=True))


def decoder_layer(g: Graph, cfg: LlamaConfig, prefix: str, x, cos, sin, mask, k_cache, v_cache, i: int,
                  t: int, s: int):
    """One decoder layer over a window of S tokens (DecoderLayer.forward).

    x: (1,C,1,S); k_cache, v_cache: the chunk's (L,KV,1,T), of which layer i is read
    -> x_out (1,C,1,S), k_new, v_new (1,KV,1,S)
    """
    gk, d, r = cfg.num_key_value_heads, cfg.head_dim, cfg.num_attention_heads // cfg.num_key_value_heads
    q, k, v = project_qkv(g, cfg, prefix, x, cos, sin, s)
    heads = grouped_attention(g, q, layer_cache(g, cfg, k_cache, i, t), layer_cache(g, cfg, v_cache, i, t),
                              mb.reshape(x=k, shape=[gk, 1, d, s]), mb.reshape(x=v, shape=[gk, 1, d, s]),
                              mask, t, s, (gk, r))
    x = finish_layer(g, cfg, prefix, x, heads, s)
    return x, mb.reshape(x=k, shape=[1, cfg.kv_channels, 1, s]), mb.reshape(x=v, shape=[1, cfg.kv_channels, 1, s])


def _softmax_state(scores, axis_len_axis: int = 3):
    """exp(scores - max) and its max and sum over the last axis (keep_dims)."""
    m = mb.reduce_max(x=scores, axes=[axis_len_axis], keep_dims=True)
    p = mb.exp(x=mb.sub(x=scores, y=m))
    return p, m, mb.reduce_sum(x=p, axes=[axis_len_axis], keep_dims=True)


def prefix_state(q, k, v, mask):
    """Attention state of all branch queries over the shared prefix (cascade.prefix_state).

    q: (G,R,D,B); k, v: (G,1,D,T); mask: (1,1,1,T) -> v_p (G,R,D,B), s_p (G,R,1,B)
    """
    p, m, denom = _softmax_state(mb.add(x=mb.matmul(x=q, y=k, transpose_x=True), y=mask))  # (G,R,B,T)
    out = mb.real_div(x=mb.matmul(x=v, y=p, transpose_y=True), y=mb.transpose(x=denom, perm=[0, 1, 3, 2]))
    return out, mb.transpose(x=mb.add(x=m, y=mb.log(x=denom)), perm=[0, 1, 3, 2])


def suffix_state(g: Graph, q, k_suffix, v_suffix, k_self, v_self, mask, gr: tuple[int, int], b: int, u: int):
    """Attention state of each branch's query over its own suffix and new key (cascade.suffix_state).

    q: (G,R,D,B); k_suffix, v_suffix: (G,B,D,U); k_self, v_self: (G,D,B); mask: (1,B,1,U+1)
    -> v_s (G,R,D,B), s_s (G,R,1,B)
    """
    gk, r = gr
    qb = mb.transpose(x=q, perm=[0, 3, 1, 2])  # (G,B,R,D)
    ks = mb.expand_dims(x=mb.transpose(x=k_self, perm=[0, 2, 1]), axes=[3])  # (G,B,D,1)
    vs = mb.expand_dims(x=mb.transpose(x=v_self, perm=[0, 2, 1]), axes=[3])
    scores = mb.concat(values=[mb.matmul(x=qb, y=k_suffix), mb.matmul(x=qb, y=ks)], axis=3)  # (G,B,R,U+1)
    p, m, denom = _softmax_state(mb.add(x=scores, y=mask))
    out = mb.add(x=mb.matmul(x=v_suffix, y=g.slice(p, [0, 0, 0, 0], [gk, b, r, u]), transpose_y=True),
                 y=mb.matmul(x=vs, y=g.slice(p, [0, 0, 0, u], [gk, b, r, u + 1]), transpose_y=True))  # (G,B,D,R)
    out = mb.real_div(x=out, y=mb.transpose(x=denom, perm=[0, 1, 3, 2]))
    return (mb.transpose(x=out, perm=[0, 3, 2, 1]),
            mb.transpose(x=mb.add(x=m, y=mb.log(x=denom)), perm=[0, 2, 3, 1]))


def merge_states(v_a, s_a, v_b, s_b):
    """The log-sum-exp merge of two attention states (cascade.merge_states)."""
    m = mb.maximum(x=s_a, y=s_b)
    w_a = mb.exp(x=mb.sub(x=s_a, y=m))
    w_b = mb.exp(x=mb.sub(x=s_b, y=m))
    return mb.real_div(x=mb.add(x=mb.mul(x=v_a, y=w_a), y=mb.mul(x=v_b, y=w_b)), y=mb.add(x=w_a, y=w_b))


def branch_layer(g: Graph, cfg: LlamaConfig, prefix: str, x, cos, sin, prefix_mask, suffix_mask, k_cache, v_cache,
                 k_suffix, v_suffix, i: int, t: int, b: int, u: int):
    """One decoder layer for B branch queries over a shared prefix (cascade.branch_layer).

    x: (1,C,1,B); k_cache, v_cache: (L,KV,1,T); k_suffix, v_suffix: (L*G,B,D,U), rows of layer i read
    -> x_out (1,C,1,B), k_new, v_new (1,KV,1,B)
    """
    gk, d, r = cfg.num_key_value_heads, cfg.head_dim, cfg.num_attention_heads // cfg.num_key_value_heads
    q, k, v = project_qkv(g, cfg, prefix, x, cos, sin, b)
    v_p, s_p = prefix_state(q, layer_cache(g, cfg, k_cache, i, t), layer_cache(g, cfg, v_cache, i, t), prefix_mask)
    rows = ([i * gk, 0, 0, 0], [(i + 1) * gk, b, d, u])
    v_s, s_s = suffix_state(g, q, g.slice(k_suffix, *rows), g.slice(v_suffix, *rows), k, v, suffix_mask,
                            (gk, r), b, u)
    x = finish_layer(g, cfg, prefix, x, merge_states(v_p, s_p, v_s, s_s), b)
    return x, mb.reshape(x=k, shape=[1, cfg.kv_channels, 1, b]), mb.reshape(x=v, shape=[1, cfg.kv_channels, 1, b])


def mask_from(g: Graph, keep):
    """Additive mask from a bool `keep`: 0 where True, MASK_VALUE (large, finite) where False."""
    dtype = "fp16" if g.dtype == np.float16 else "fp32"
    return mb.mul(x=mb.sub(x=g.scalar(1.0), y=mb.cast(x=keep, dtype=dtype)), y=g.scalar(MASK_VALUE))


__all__ = ["Graph", "rms_norm", "conv", "decoder_layer", "branch_layer", "mask_from"]
