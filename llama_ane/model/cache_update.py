"""The cache updates: write a window's new K/V into a chunk's caches, run in the background while the
next chunk computes; each torch module with its MIL builder below it. No dynamic indexing: every
write is a one-hot matmul or a one-hot select.

    CacheUpdate   k_cache/v_cache (L,KV,1,T), k_new/v_new (L,KV,1,S), position (1,) int32
                  -> k_cache_out/v_cache_out (L,KV,1,T)
    SuffixUpdate  k_suffix/v_suffix (L*G,B,D,U), k_new/v_new (L,KV,1,B), suffix_positions (B,) int32
                  -> k_suffix_out/v_suffix_out (L*G,B,D,U)
    VerifyUpdate  k_cache/v_cache (L,KV,1,T), k_new/v_new (L,KV,1,W), slots (W,) int32
                  -> k_cache_out/v_cache_out (L,KV,1,T)

Sizes as in chunk.py. `suffix_positions[b] = positions[b] - prefix_length` is the slot branch b's
new K/V goes to; `slots[i]` the cache position of verify token i's K/V, or -1 to drop it (rejected
drafts, padding). One model holds the update of every chunk size ("decode_l3": a decode window of
a 3-layer chunk).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from ..config import LlamaConfig
from .functions import BRANCHES, VERIFY, Layout, cache_update_function, shape_of, tensor
from .layers import Graph, mb


class CacheUpdate(nn.Module):
    """Write a window's new K/V into a chunk's cache at `position .. position+S-1`.

    `onehot[s, t] = (t == position + s)`, `cache_out = cache * (1 - sum_s onehot[s]) + new @ onehot`.
    Positions >= T match no slot and are dropped (a last, padded prefill window may run past the end).
    """

    def __init__(self, context_length: int, window: int):
        super().__init__()
        self.register_buffer("slots", torch.arange(context_length, dtype=torch.int32).view(1, -1))
        self.register_buffer("offsets", torch.arange(window, dtype=torch.int32).view(-1, 1))

    def forward(self, k_cache, v_cache, k_new, v_new, position):
        onehot = (self.slots == (position + self.offsets)).to(k_cache.dtype)  # (S, T)
        keep = 1.0 - onehot.sum(dim=0)  # (T,)
        return k_cache * keep + torch.matmul(k_new, onehot), v_cache * keep + torch.matmul(v_new, onehot)


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


def build_cache_update(g: Graph, io: dict):
    """CacheUpdate, or, given `slots` (the "verify" update), VerifyUpdate."""
    def body(inputs):
        t = shape_of(io, "k_cache")[3]
        s = shape_of(io, "k_new")[3]
        if "slots" in inputs:
            where = mb.reshape(x=inputs["slots"], shape=[s, 1])  # (S,1)
        else:
            where = mb.add(x=inputs["position"], y=np.arange(s, dtype=np.int32).reshape(s, 1))  # (S,1)
        onehot = g.cast(mb.equal(x=np.arange(t, dtype=np.int32).reshape(1, t), y=where))  # (S,T)
        keep = mb.sub(x=g.scalar(1.0), y=mb.reduce_sum(x=onehot, axes=[0], keep_dims=False))  # (T,)
        return {f"{n}_cache_out": mb.add(x=mb.mul(x=inputs[f"{n}_cache"], y=keep),
                                         y=mb.matmul(x=inputs[f"{n}_new"], y=onehot)) for n in ("k", "v")}
    return body


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


def build_suffix_update(g: Graph, cfg: LlamaConfig, io: dict):
    """SuffixUpdate."""
    def body(inputs):
        rows, b, d, u = shape_of(io, "k_suffix")
        slot = mb.equal(x=np.arange(u, dtype=np.int32).reshape(1, 1, 1, u),
                        y=mb.reshape(x=inputs["suffix_positions"], shape=[1, b, 1, 1]))  # (1,B,1,U)
        out = {}
        for n in ("k", "v"):
            new = mb.expand_dims(x=mb.transpose(x=mb.reshape(x=inputs[f"{n}_new"], shape=[rows, d, b]), perm=[0, 2, 1]),
                                 axes=[3])  # (L*G,B,D,1)
            out[f"{n}_suffix_out"] = mb.select(cond=slot, a=new, b=inputs[f"{n}_suffix"])
        return out
    return body


def functions(cfg: LlamaConfig, layout: Layout, chunk_layers: list[int]) -> dict[str, dict]:
    """{function: io} of the cache-update model for chunks of `chunk_layers` layers each: per
    bucket the windows' updates (none with state caches, which the chunks write themselves), then
    the cascade's suffix updates and verify's."""
    d, kv, f, g = cfg.head_dim, cfg.kv_channels, layout.dtype, cfg.num_key_value_heads
    out = {}
    for fn, _, s, t in layout.windows():
        for n in chunk_layers if layout.kv_cache == "inputs" else ():
            out[cache_update_function(fn, n)] = {
                "inputs": [tensor("k_cache", [n, kv, 1, t], f), tensor("v_cache", [n, kv, 1, t], f),
                           tensor("k_new", [n, kv, 1, s], f), tensor("v_new", [n, kv, 1, s], f),
                           tensor("position", [1], "int32")],
                "outputs": [tensor("k_cache_out", [n, kv, 1, t], f), tensor("v_cache_out", [n, kv, 1, t], f)],
            }
    t, b, u, w = layout.context_length, layout.branch_width, layout.suffix_length, layout.verify_window
    for n in chunk_layers if b else ():
        out[cache_update_function(BRANCHES, n)] = {
            "inputs": [tensor("k_suffix", [n * g, b, d, u], f), tensor("v_suffix", [n * g, b, d, u], f),
                       tensor("k_new", [n, kv, 1, b], f), tensor("v_new", [n, kv, 1, b], f),
                       tensor("suffix_positions", [b], "int32")],
            "outputs": [tensor("k_suffix_out", [n * g, b, d, u], f), tensor("v_suffix_out", [n * g, b, d, u], f)],
        }
    for n in chunk_layers if w else ():
        out[cache_update_function(VERIFY, n)] = {
            "inputs": [tensor("k_cache", [n, kv, 1, t], f), tensor("v_cache", [n, kv, 1, t], f),
                       tensor("k_new", [n, kv, 1, w], f), tensor("v_new", [n, kv, 1, w], f),
                       tensor("slots", [w], "int32")],
            "outputs": [tensor("k_cache_out", [n, kv, 1, t], f), tensor("v_cache_out", [n, kv, 1, t], f)],
        }
    return out
