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

Where the export has a ring (chunk.py), a chunk's update also writes its ring layers' K/V,
k_ring/v_ring (L_s,KV,1,R) from k_ring_new/v_ring_new, position p to slot p mod R (a window may
wrap around the ring's end; the one-hot needs no split), or verify token i to `ring_slots[i]`
(its slot, or -1). The function is named after both counts ("decode_l1_r2"; "_l0" where every
layer of the chunk is in the ring): one call per chunk and step, as without a ring.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from ..config import LlamaConfig
from . import names as N
from .functions import (BRANCHES, CACHES, VERIFY, Layout, Site, cache_update_function, chunk_rows, shape_of, suffix_groups,
                        suffix_names, suffix_update_counts, tensor)
from .layers import Graph, mb


def onehot_write(cache: torch.Tensor, new: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    """Write column s of new (L,KV,1,S) at column where[s] of cache (L,KV,1,T); where[s] matching no
    column (past T, or -1) drops it. `onehot[s, t] = (t == where[s])`,
    `cache_out = cache * (1 - sum_s onehot[s]) + new @ onehot`."""
    slots = torch.arange(cache.shape[-1], dtype=torch.int32, device=cache.device).view(1, -1)
    onehot = (slots == where.view(-1, 1)).to(cache.dtype)  # (S, T)
    return cache * (1.0 - onehot.sum(dim=0)) + torch.matmul(new, onehot)


def onehot_write_mil(g: Graph, cache, new, where, t: int):
    """onehot_write. cache: (L,KV,1,T); new: (L,KV,1,S); where: (S,1) int32 -> (L,KV,1,T)"""
    onehot = g.cast(mb.equal(x=np.arange(t, dtype=np.int32).reshape(1, t), y=where))  # (S,T)
    keep = mb.sub(x=g.scalar(1.0), y=mb.reduce_sum(x=onehot, axes=[0], keep_dims=False))  # (T,)
    return mb.add(x=mb.mul(x=cache, y=keep), y=mb.matmul(x=new, y=onehot))


def window_slots(position: torch.Tensor, s: int, ring: int = 0) -> torch.Tensor:
    """(S,1) int32: where a window of S at `position` goes, position + s, or its ring slot mod R."""
    where = position.view(1, 1).to(torch.int32) + torch.arange(s, dtype=torch.int32, device=position.device).view(-1, 1)
    return torch.remainder(where, ring) if ring else where


def window_slots_mil(position, s: int, ring: int = 0):
    """window_slots."""
    where = mb.add(x=position, y=np.arange(s, dtype=np.int32).reshape(s, 1))  # (S,1)
    return mb.mod(x=where, y=np.int32(ring)) if ring else where


class ChunkUpdate(nn.Module):
    """Write a window's new K/V into a chunk's caches: the full cache at `position .. position+S-1`
    (positions >= T are dropped: a last, padded prefill window may run past the end) and the
    ring, where the chunk has one, at those positions' slots mod R; or, given `slots` (the
    "verify" update), the accepted tokens' K/V, token i at `slots[i]` and `ring_slots[i]`, none
    where it is -1. Returns the caches it was given, written, in the order k_cache, v_cache,
    k_ring, v_ring."""

    def __init__(self, ring: int = 0):
        super().__init__()
        self.ring = ring

    def forward(self, k_cache=None, v_cache=None, k_new=None, v_new=None, position=None, k_ring=None, v_ring=None,
                k_ring_new=None, v_ring_new=None, slots=None, ring_slots=None):
        out = ()
        for cache, new, ring in ((k_cache, k_new, 0), (v_cache, v_new, 0), (k_ring, k_ring_new, self.ring),
                                 (v_ring, v_ring_new, self.ring)):
            if cache is None:
                continue
            if position is not None:
                where = window_slots(position, new.shape[-1], ring)
            else:
                where = ring_slots if ring else slots
            out += (onehot_write(cache, new, where),)
        return out


def build_cache_update(g: Graph, io: dict):
    """ChunkUpdate of the caches the function names (k_cache/v_cache, k_ring/v_ring)."""
    def body(inputs):
        out = {}
        for cache in (N.K_CACHE, N.V_CACHE, N.K_RING, N.V_RING):
            if cache not in inputs:
                continue
            new = CACHES[cache]
            t, s = shape_of(io, cache)[3], shape_of(io, new)[3]
            ring = t if N.is_ring(cache) else 0
            if N.SLOTS in inputs:
                where = mb.reshape(x=inputs[N.RING_SLOTS if ring else N.SLOTS], shape=[s, 1])  # (S,1)
            else:
                where = window_slots_mil(inputs[N.POSITION], s, ring)
            out[N.updated(cache)] = onehot_write_mil(g, inputs[cache], inputs[new], where, t)
        return out
    return body


class SuffixUpdate(nn.Module):
    """Write each branch's new K/V into its suffix cache at its own slot (a one-hot select, no indexing).

    k_suffix: (L*G,B,D,U); k_new: (L,KV,1,B); suffix_positions: (B,) int32 -> (L*G,B,D,U); where the
    global layers are wider, the ring layers' pair too (k_ring_suffix, k_ring_new: functions.suffix_groups).
    """

    def __init__(self, suffix_length: int):
        super().__init__()
        self.register_buffer("slots", torch.arange(suffix_length, dtype=torch.int32).view(1, 1, 1, -1))

    def forward(self, k_suffix=None, v_suffix=None, k_new=None, v_new=None, suffix_positions=None,
                k_ring_suffix=None, v_ring_suffix=None, k_ring_new=None, v_ring_new=None):
        slot = self.slots == suffix_positions.view(1, -1, 1, 1)  # (1,B,1,U) one-hot, bool

        def write(cache, new):
            new = new.reshape(cache.shape[0], cache.shape[2], -1).transpose(1, 2).unsqueeze(3)  # (L*G,B,D,1)
            return torch.where(slot, new, cache)  # one elementwise select: reads and writes the cache once
        pairs = ((k_suffix, k_new), (v_suffix, v_new), (k_ring_suffix, k_ring_new), (v_ring_suffix, v_ring_new))
        return tuple(write(cache, new) for cache, new in pairs if cache is not None)


def build_suffix_update(g: Graph, cfg: LlamaConfig, io: dict):
    """SuffixUpdate."""
    def body(inputs):
        b = shape_of(io, N.SUFFIX_POSITIONS)[0]
        u = next(t["shape"][3] for t in io["inputs"] if t["name"] in N.SUFFIXES)
        slot = mb.equal(x=np.arange(u, dtype=np.int32).reshape(1, 1, 1, u),
                        y=mb.reshape(x=inputs[N.SUFFIX_POSITIONS], shape=[1, b, 1, 1]))  # (1,B,1,U)
        out = {}
        for n in N.KV_STEMS:
            if N.suffix(n) not in inputs:
                continue
            rows, _, d, _ = shape_of(io, N.suffix(n))
            new = mb.expand_dims(x=mb.transpose(x=mb.reshape(x=inputs[N.new(n)], shape=[rows, d, b]), perm=[0, 2, 1]),
                                 axes=[3])  # (L*G,B,D,1)
            out[N.updated(N.suffix(n))] = mb.select(cond=slot, a=new, b=inputs[N.suffix(n)])
        return out
    return body


def _window_io(cfg: LlamaConfig, layout: Layout, rows: tuple[list[int], list[int]], s: int, t: int,
               where: list[dict]) -> dict:
    """The io of a chunk's update of a window of S: its caches (full over T positions, ring over R
    slots) and new K/V in, the caches out; `where` the int32 inputs saying where they go."""
    f = layout.dtype
    caches, new, out = [], [], []
    for n, names, width, kv in ((len(rows[0]), (N.K_CACHE, N.V_CACHE), t, cfg.global_layers.kv_channels),
                                (len(rows[1]), (N.K_RING, N.V_RING), layout.ring, cfg.kv_channels)):
        for name in names if n else ():
            caches.append(tensor(name, [n, kv, 1, width], f))
            new.append(tensor(CACHES[name], [n, kv, 1, s], f))
            out.append(tensor(N.updated(name), [n, kv, 1, width], f))
    return {"inputs": caches + new + where, "outputs": out}


def functions(cfg: LlamaConfig, layout: Layout, chunk_layers: list[list[int]]) -> dict[str, dict]:
    """{function: io} of the cache-update model for the chunks of decoder layers `chunk_layers`
    (their indices in the model): per bucket the windows' updates (none with state caches, which
    the chunks write themselves), then the cascade's suffix updates and verify's. Chunks with as
    many layers in the full cache and in the ring share their functions."""
    f = layout.dtype
    rows = {}  # (full, ring) counts -> the rows of one such chunk
    for layers in chunk_layers:
        full, ring = chunk_rows(cfg, layers, layout.ring)
        rows.setdefault((len(full), len(ring)), (full, ring))
    out = {}
    for fn, _, s, t in layout.windows():
        for (nf, nr), r in rows.items() if layout.kv_cache == "inputs" else ():
            if not nf + nr:  # a chunk of conv layers only keeps no K/V
                continue
            out[cache_update_function(fn, nf, nr)] = _window_io(cfg, layout, r, s, t,
                                                               [tensor(N.POSITION, [1], "int32")])
    t, b, u, w = layout.context_length, layout.branch_width, layout.suffix_length, layout.verify_window
    suffixes = {suffix_update_counts(cfg, layers, layout.ring): layers for layers in chunk_layers} \
        if b and not layout.window_cascade else {}
    for counts, layers in suffixes.items():
        if not sum(counts):  # a chunk of conv layers only has no suffix caches
            continue
        caches, new = [], []
        for key, r, at in suffix_groups(cfg, layers, layout.ring):
            names, g = suffix_names(key), at.num_key_value_heads
            caches += [tensor(name, [len(r) * g, b, at.head_dim, u], f) for name in names[:2]]
            new += [tensor(name, [len(r), at.kv_channels, 1, b], f) for name in names[2:]]
        out[cache_update_function(BRANCHES, *counts)] = {
            "inputs": caches + new + [tensor(N.SUFFIX_POSITIONS, [b], "int32")],
            "outputs": [dict(t, name=N.updated(t["name"])) for t in caches],
        }
    for (nf, nr), r in rows.items() if w else ():
        if not nf + nr:
            continue
        where = [tensor(N.SLOTS, [w], "int32")] + ([tensor(N.RING_SLOTS, [w], "int32")] if nr else [])
        out[cache_update_function(VERIFY, nf, nr)] = _window_io(cfg, layout, r, w, t, where)
    return out


def program(g: Graph, cfg: LlamaConfig, function: str, io: dict, site: Site):
    """The MIL builder of a cache-update function (model.kinds)."""
    return build_suffix_update(g, cfg, io) if function.startswith(BRANCHES) else build_cache_update(g, io)


def modules(weights, model: str, cfg: LlamaConfig, functions: dict[str, dict], site: Site,
            dtype: torch.dtype) -> dict[str, nn.Module]:
    """The torch module of each cache-update function: a cascade's suffix update, or a window of S
    at the positions of its bucket (and the ring's slots), or verify's. They hold no weights."""
    return {fn: SuffixUpdate(site.suffix_length) if any(t["name"] == N.K_SUFFIX for t in io["inputs"])
            else ChunkUpdate(site.ring) for fn, io in functions.items()}
