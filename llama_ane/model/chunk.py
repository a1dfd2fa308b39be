"""The block chunks: a few decoder layers each (the layer kinds themselves are in `layers`), with the
cascade's branch function and the verify window next to their base; each torch module with its MIL
builder below it.

    BlockChunk   hidden_states, cos, sin, mask, k_cache/v_cache (L,KV,1,T)
                 -> hidden_states_out (1,C,1,S), k_new/v_new (L,KV,1,S)
    BranchChunk  hidden_states, cos, sin, prefix_mask, suffix_mask, k_cache/v_cache (L,KV,1,T),
                 k_suffix/v_suffix (L*G,B,D,U) -> hidden_states_out (1,C,1,B), k_new/v_new (L,KV,1,B)

C = hidden size, D = head_dim, G kv heads, KV = G*D, T = the cache positions (the context bucket),
S = query length (the prefill window or 1), L = layers in the chunk, B branches with suffixes of up
to U tokens. The chunks attend to the cache (positions < `position`, the rest masked) plus the
window itself; they never write the cache: the cache-update model does that afterwards,
asynchronously, with a one-hot matmul. With state caches (`kv_cache="state"`) the window
functions write their K/V into the states themselves instead.

Cascade ("decode_branches"): B branches decode one token each over one shared prefix cache. Per
layer, inside the graph, all B queries attend to the prefix as one multi-query attention (the
prefix K/V is read once for every branch), each query attends to its own suffix cache plus its
own new key, and the two attention states are merged with the log-sum-exp operator
(layers.attention.merge_states). The result equals decoding each branch alone.

Verify ("verify"): a token tree of W drafted tokens checked in one window (speculative decoding,
DeFT's tree attention over one shared prefix). It is the window function at S = W, the same
BlockChunk with the same weights: only the mask the embeddings build differs (each token attends
to the cache and to its ancestors in the tree). The cache is read once for all W queries; once
the runtime knows which path was accepted, the cache update writes only those tokens' K/V.

Sliding-window layers (Mistral, Qwen2 and Gemma 3's local layers) read a mask of their own that
also hides the keys `sliding_window` or more positions before each query: "sliding_mask" beside
"mask" ("sliding_prefix_mask" and "sliding_suffix_mask" in the cascade), made by the embeddings
with the others, and an input only where the window is shorter than the context
(LlamaConfig.windowed). Families with a local RoPE base (Gemma 3) also read the local tables
"cos_local" and "sin_local" in their sliding layers.

Where the export has a ring (functions.ring_length: R slots, the window and a prefill window
rounded up to 32), the sliding layers keep their K/V there instead of in the context-long cache,
so it does not grow with the context: k_ring/v_ring (L_s,KV,1,R) beside k_cache/v_cache
(L_f,KV,1,T), L_f + L_s = L (either may be absent), and the window functions return the ring
layers' new K/V as k_ring_new/v_ring_new (position p goes to slot p mod R). Their sliding masks
cover the ring's slots (see embeddings.py). The cascade reads the prefix's ring like its cache and
returns every layer's new K/V for the suffix caches, as without a ring.

Where Gemma 4's global layers are wider than its sliding ones (LlamaConfig.wide_global: their own
head_dim and kv heads, LlamaConfig.at), the export always has a ring: k_cache/v_cache hold the
global layers' K/V and k_ring/v_ring the sliding layers', each in its own width, cos/sin are the
global layers' tables and cos_local/sin_local the sliding layers'. The cascade then keeps a pair of
suffix caches per kind (functions.suffix_groups): k_suffix/v_suffix and k_new/v_new of the global
layers, k_ring_suffix/v_ring_suffix and k_ring_new/v_ring_new of the sliding ones.

Gemma 4's KV-shared layers (LlamaConfig.shares_kv) project q only and keep no cache: each attends
over the cache and the window's K/V of its producer (LlamaConfig.kv_producer). A producer in the
same chunk is read where it is; one in an earlier chunk comes as inputs after the others
(functions.shared_rows): shared_k_cache/shared_v_cache (P,KV,1,T) or shared_k_ring/shared_v_ring
(P,KV,1,R), its window's K/V shared_k_new/shared_v_new (or shared_k_ring_new/...) (P,KV,1,S) and, in
the cascade, its suffix caches shared_k_suffix/shared_v_suffix (or shared_k_ring_suffix/...). The
runtime hands them over from the producer's chunk, so these exports keep their caches as inputs.

Conv layers (LFM2's short convolutions, layers.short_conv.ConvLayer) keep no K/V: a chunk with any reads
their state conv_state (L_c,C,1,W: functions.conv_state_width) after its other inputs and returns the window's values
conv_new (L_c,C,1,S), from which the runtime takes the next state at the window's last real token
(layers.short_conv.conv_state_after). The state does not depend on the context bucket.
Qwen3.5's linear-attention layers (layers.delta_net.DeltaLayer) have conv_state rows too (LlamaConfig.conv_channels
wide: their q, k and v channels) and a recurrent state besides: delta_state (L_d,H*Dk,1,Dv), read last
with window_tokens, and delta_new, the state after the window's real tokens (state caches: written
in place). The cascade reads each branch's, delta_branches (L_d*B,H*Dk,1,Dv), and returns them after
its token as delta_new.
Gemma 4's layers end with a per-layer input: every function of a chunk reads "per_layer_input"
(1,L*P,1,S), its layers' rows of the embeddings' per_layer_inputs (layer i's P rows at i*P), after
the inputs above; a layer gates it by its own output, projects it back to C channels, normalizes
and adds it, then multiplies by the layer's scalar. Its global layers may take V from the K
projection (before k's norm), and every V head is normalized without a weight.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from ..config import LlamaConfig
from . import lm_head
from . import names as N
from .cache_update import onehot_write_mil, window_slots_mil
from .functions import (BRANCHES, CACHES, RING_CACHES, VERIFY, WINDOW_TOKENS, Layout, Site, branch_masks, chunk_rows,
                        conv_rows, conv_state_width, layer_inputs, shape_of, shared_rows, suffix_groups, suffix_names,
                        tensor, window_masks)
from .layers import Graph, mb, stack_mil, with_state
from .layers.attention import DecoderLayer, branch_layer, branch_layer_mil, decoder_layer_read_mil
from .layers.delta_net import (DELTA_BRANCHES, DELTA_NEW, DELTA_STATE, DeltaLayer, delta_layer_mil, delta_rows,
                               delta_shape)
from .layers.mamba2 import mamba2_mixer_mil, mamba_shape
from .layers.short_conv import ConvLayer, conv_layer_mil, conv_state_after_mil


def per_layer_slice_mil(g: Graph, cfg: LlamaConfig, inputs: dict, i: int, s: int):
    """Chunk layer i's per-layer input (1,P,1,S) of the chunk's (1,L*P,1,S), or None where the model has none."""
    p = cfg.per_layer_input_size
    return g.slice(inputs[N.PER_LAYER_INPUT], [0, i * p, 0, 0], [1, (i + 1) * p, 1, s]) if p else None


def _layer_cache_mil(g: Graph, cfg: LlamaConfig, cache, i: int, t: int):
    """Layer i's slice of a chunk cache (L,KV,1,T) as (G,1,D,T)."""
    one = g.slice(cache, [i, 0, 0, 0], [i + 1, cfg.kv_channels, 1, t])
    return mb.reshape(x=one, shape=[cfg.num_key_value_heads, 1, cfg.head_dim, t])


class BlockChunk(nn.Module):
    """Decoder layers `first .. first+len(layers)-1` of the model, run in sequence; with `ring` > 0
    its sliding layers read and return their K/V in the ring (see the module docstring)."""

    def __init__(self, cfg: LlamaConfig, layer_indices: list[int], context_length: int, ring: int = 0):
        super().__init__()
        self.layer_indices = list(layer_indices)
        self.layers = nn.ModuleList(
            DeltaLayer(cfg.hidden_size, cfg.intermediate_size, delta_shape(cfg)) if cfg.linear(n)
            else ConvLayer(cfg.hidden_size, cfg.intermediate_size, cfg.conv_kernel, cfg.stream_eps, cfg.conv_bias,
                           cfg.sandwich_norms)
            if not cfg.attends(n) else DecoderLayer(cfg.at(n), context_length, n) for n in layer_indices)
        self.conv = conv_rows(cfg, self.layer_indices)  # the conv layers' and the linear-attention layers'
        self.delta = delta_rows(cfg, self.layer_indices)
        full, sliding = chunk_rows(cfg, self.layer_indices, ring)
        # per layer: which cache it reads ("cache" or "ring") and its row there
        self.rows = {**{i: ("cache", j) for j, i in enumerate(full)}, **{i: ("ring", j) for j, i in enumerate(sliding)}}
        self.full, self.sliding = full, sliding
        groups = suffix_groups(cfg, self.layer_indices, ring)  # the cascade's suffix caches
        # KV-shared layers: chunk layer i -> where its producer's K/V are: ("local", its chunk index),
        # or, in another chunk, ("cache" or "ring", its row in the shared inputs)
        local = {n: i for i, n in enumerate(self.layer_indices)}
        outside = shared_rows(cfg, self.layer_indices, ring)
        where = {p: (kind, j) for kind, rows in zip(("cache", "ring"), outside) for j, p in enumerate(rows)}
        self.producer = {i: ("local", local[p]) if p in local else where[p]
                         for i, n in enumerate(layer_indices) if cfg.shares_kv(n) for p in [cfg.kv_producer(n)]}
        self.suffix_keys = [key for key, _, _ in groups]
        self.suffix_rows = {i: (key, j) for key, rows, _ in groups for j, i in enumerate(rows)}

    def layer_caches(self, i: int, caches: dict):
        """Layer i's (k, v) rows (1,KV,1,*) of `caches` {"cache": (k, v), "ring": (k, v)}."""
        where, j = self.rows[i]
        k, v = caches[where]
        return k[j:j + 1], v[j:j + 1]

    def split(self, ks: list, vs: list) -> tuple:
        """Per-layer new K/V as the window functions return them: k_new, v_new of the full layers,
        then k_ring_new, v_ring_new of the ring's, each pair only where the chunk has such layers."""
        out = ()
        for rows in (self.full, self.sliding):
            if rows:
                out += (torch.cat([ks[i] for i in rows], dim=0), torch.cat([vs[i] for i in rows], dim=0))
        return out

    def run(self, hidden_states, cos, sin, mask, sliding_mask, cos_local, sin_local, caches, conv_state=None,
            per_layer_input=None, shared=None, delta_state=None, window_tokens=None):
        """The layers over a window; returns the hidden states, each layer's new k, v (None on a
        conv or linear-attention layer), the conv layers' window values (conv_new) and the
        linear-attention layers' states after the window's `window_tokens` real tokens (delta_new),
        each None where the chunk has none."""
        ks, vs, gated, states = [], [], [], []
        for i, layer in enumerate(self.layers):
            if isinstance(layer, DeltaLayer):
                j, d = self.conv.index(i), self.delta.index(i)
                hidden_states, g, new = layer(hidden_states, conv_state[j:j + 1], delta_state[d:d + 1], window_tokens)
                gated.append(g)
                states.append(new)
                ks.append(None)
                vs.append(None)
                continue
            if isinstance(layer, ConvLayer):
                j = self.conv.index(i)
                hidden_states, g = layer(hidden_states, conv_state[j:j + 1])
                gated.append(g)
                ks.append(None)
                vs.append(None)
                continue
            if i in self.producer:  # a KV-shared layer: its producer's caches and window K/V
                layer_caches, window = self.shared_kv(i, caches, shared, ks, vs)
            else:
                layer_caches, window = self.layer_caches(i, caches), None
            side = self.mixer(i, conv_state, delta_state, window_tokens, gated, states)
            hidden_states, k, v = layer(hidden_states, *layer.rope(cos, sin, cos_local, sin_local),
                                        layer.attention_mask(mask, sliding_mask), *layer_caches,
                                        self.per_layer_slice(per_layer_input, i), window, side)
            ks.append(k)
            vs.append(v)
        return (hidden_states, ks, vs, (torch.cat(gated, dim=0) if gated else None),
                torch.cat(states, dim=0) if states else None)

    def mixer(self, i: int, conv_state, delta_state, n, gated: list, states: list, rows: int = 1):
        """Chunk layer i's Mamba-2 mixer beside its attention as DecoderLayer's `side` (None where it has
        none), reading its rows of the conv and recurrent states (`rows` of each per layer: the
        cascade's branches) and appending its window values and new state to `gated` and `states`."""
        layer = self.layers[i]
        if not hasattr(layer, "mamba"):
            return None
        j, d = self.conv.index(i), self.delta.index(i)

        def side(h):
            y, g, new = layer.mamba(h, conv_state[j:j + 1], delta_state[d * rows:(d + 1) * rows], n)
            gated.append(g)
            states.append(new)
            return y
        return side

    def shared_kv(self, i: int, caches: dict, shared: dict | None, ks: list, vs: list):
        """KV-shared chunk layer i's producer's (k, v) cache rows and (k, v) of this window: from
        the producer in this chunk (its caches, what it just computed), or from the shared inputs
        {"cache": (k, v), "ring": (k, v), "cache_new": ..., "ring_new": ...} (rows per shared_where)."""
        where, j = self.producer[i]
        if where == "local":
            return self.layer_caches(j, caches), (ks[j], vs[j])
        (k, v), (k_new, v_new) = shared[where], shared[f"{where}_new"]
        return (k[j:j + 1], v[j:j + 1]), (k_new[j:j + 1], v_new[j:j + 1])

    def per_layer_slice(self, per_layer_input, i: int):
        """Chunk layer i's (1,P,1,S) of the chunk's per-layer inputs (1,L*P,1,S), or None where there are none."""
        if per_layer_input is None:
            return None
        p = per_layer_input.shape[1] // len(self.layers)
        return per_layer_input[:, i * p:(i + 1) * p]

    def forward(self, hidden_states, cos, sin, mask, k_cache=None, v_cache=None, sliding_mask=None, cos_local=None,
                sin_local=None, k_ring=None, v_ring=None, conv_state=None, per_layer_input=None, shared_k_cache=None,
                shared_v_cache=None, shared_k_ring=None, shared_v_ring=None, shared_k_new=None, shared_v_new=None,
                shared_k_ring_new=None, shared_v_ring_new=None, delta_state=None, window_tokens=None):
        shared = {"cache": (shared_k_cache, shared_v_cache), "ring": (shared_k_ring, shared_v_ring),
                  "cache_new": (shared_k_new, shared_v_new), "ring_new": (shared_k_ring_new, shared_v_ring_new)}
        hidden_states, ks, vs, conv_new, delta_new = self.run(
            hidden_states, cos, sin, mask, sliding_mask, cos_local, sin_local,
            {"cache": (k_cache, v_cache), "ring": (k_ring, v_ring)}, conv_state, per_layer_input, shared, delta_state,
            window_tokens)
        return ((hidden_states, *self.split(ks, vs)) + (() if conv_new is None else (conv_new,))
                + (() if delta_new is None else (delta_new,)))


def layer_rope_mil(cfg: LlamaConfig, inputs: dict, layer: int):
    """DecoderLayer.rope: the cos and sin inputs decoder layer `layer` rotates with."""
    return (inputs[N.COS_LOCAL], inputs[N.SIN_LOCAL]) if cfg.local_rope(layer) else (inputs[N.COS], inputs[N.SIN])


def layer_mask_mil(cfg: LlamaConfig, inputs: dict, layer: int, name: str):
    """DecoderLayer.attention_mask: mask input `name` ("mask", "prefix_mask", "suffix_mask"), or its
    sliding twin ("sliding_" + name) on a sliding layer of an export that has one."""
    sliding = f"sliding_{name}"
    return inputs[sliding] if cfg.slides(layer) and sliding in inputs else inputs[name]


def read_states_mil(inputs: dict, io: dict) -> dict:
    """`inputs` with each state replaced by its value (read_state): what the body computes from."""
    return {**inputs, **{t["name"]: mb.read_state(input=inputs[t["name"]]) for t in io.get("states", [])}}


def write_window_mil(states: dict, values: dict, new: dict, position, window: int) -> None:
    """Write a window's K/V into the cache states at `position`.

    states: the "k_cache"/"v_cache" state inputs; values: their values as read at the start
    (L,KV,1,T); new: "k_cache"/"v_cache" -> the window's (L,KV,1,S); position: int32 (1,). A slice
    update of columns [position, position + S), then the state is written back.
    """
    for name, state in states.items():
        layers, channels, one, _ = values[name].shape
        begin = mb.concat(values=[np.zeros(3, np.int32), position], axis=0)
        end = mb.add(x=begin, y=np.array([layers, channels, one, window], np.int32))
        mb.coreml_update_state(state=state, value=mb.slice_update(x=values[name], update=new[name],
                                                                   begin=begin, end=end))


def _ring_of(io: dict) -> int:
    """The ring's slots a chunk function reads (0: no ring), its own or a KV-shared layer's producer's."""
    ring = [t["shape"][3] for t in io["inputs"] + io.get("states", []) if t["name"] in (N.K_RING, N.shared(N.K_RING))]
    return ring[0] if ring else 0


def _layer_reads_mil(g: Graph, cfg: LlamaConfig, values: dict, layers: list[int], ring: int, t: int):
    """Per chunk layer: its (k, v) cache rows as (G,1,D,T) or, in the ring, (G,1,D,R)."""
    full, sliding = chunk_rows(cfg, layers, ring)
    reads = {}
    for rows, (k, v), width in ((full, (N.K_CACHE, N.V_CACHE), t), (sliding, RING_CACHES, ring)):
        for j, i in enumerate(rows):
            at = cfg.at(layers[i])
            reads[i] = (_layer_cache_mil(g, at, values[k], j, width), _layer_cache_mil(g, at, values[v], j, width))
    return reads, full, sliding


def build_chunk(g: Graph, cfg: LlamaConfig, io: dict, layers: list[int]):
    """BlockChunk of decoder layers `layers` (their indices in the model) over a window, attending to
    the cache positions of its context bucket (and the ring's slots); when the caches are states
    (of the whole context: a bucket reads their first positions through static slices), the
    window's K/V is written into them at `position` instead of being returned: a slice update in
    the full cache, a one-hot write at the slots (position + s) mod R in the ring (a window may
    wrap around its end)."""
    def body(inputs):
        mask = shape_of(io, N.MASK)
        s, context_length = shape_of(io, N.HIDDEN_STATES)[3], mask[3] - mask[2]
        ring = _ring_of(io)
        values = read_states_mil(inputs, io)
        reads, full, sliding = _layer_reads_mil(g, cfg, values, layers, ring, context_length)
        x, ks, vs, gated, states = inputs[N.HIDDEN_STATES], [], [], [], []
        for i, n in enumerate(layers):
            if cfg.linear(n):
                x, gx, state = delta_layer_mil(g, x, _conv_state_row_mil(g, cfg, values[N.CONV_STATE], len(gated)),
                                               _delta_state_row_mil(g, cfg, values[DELTA_STATE], len(states)),
                                               inputs[WINDOW_TOKENS], f"layers.{i}.", cfg.hidden_size, delta_shape(cfg), s)
                gated.append(gx)
                states.append(state)
                ks.append(None)
                vs.append(None)
                continue
            if not cfg.attends(n):
                x, gx = conv_layer_mil(g, x, _conv_state_row_mil(g, cfg, values[N.CONV_STATE], len(gated)),
                                       f"layers.{i}.", cfg.hidden_size, cfg.conv_kernel, cfg.stream_eps, s,
                                       cfg.conv_bias, cfg.sandwich_norms)
                gated.append(gx)
                ks.append(None)
                vs.append(None)
                continue
            cos, sin = layer_rope_mil(cfg, inputs, n)
            rows, width, shared = reads.get(i), context_length if i in full else ring, None
            if cfg.shares_kv(n):  # its producer's caches and window K/V
                rows, width, shared, _ = _producer_mil(g, cfg, values, layers, ring, (reads, full, ks, vs), n,
                                                       context_length, s)
            side = _mixer_mil(g, cfg, n, i, values.get(N.CONV_STATE), values.get(DELTA_STATE),
                              inputs.get(WINDOW_TOKENS), gated, states, s)
            x, k, v = decoder_layer_read_mil(g, cfg, f"layers.{i}.", x, cos, sin,
                                             layer_mask_mil(cfg, inputs, n, N.MASK), *rows, width, s, n,
                                             per_layer_slice_mil(g, cfg, inputs, i, s), shared, side)
            ks.append(k)
            vs.append(v)
        new = {N.CONV_STATE: stack_mil(gated)} if gated else {}
        if states:
            new[DELTA_STATE] = stack_mil(states)
        for rows, (k, v) in ((full, (N.K_CACHE, N.V_CACHE)), (sliding, RING_CACHES)):
            if rows:
                new[k], new[v] = stack_mil([ks[i] for i in rows]), stack_mil([vs[i] for i in rows])
        if io.get("states"):
            full_new = {n: new[n] for n in (N.K_CACHE, N.V_CACHE) if n in new}
            write_window_mil({n: inputs[n] for n in full_new}, values, full_new, inputs[N.POSITION], s)
            where = window_slots_mil(inputs[N.POSITION], s, ring) if sliding else None
            for n in RING_CACHES if sliding else ():
                mb.coreml_update_state(state=inputs[n], value=onehot_write_mil(g, values[n], new[n], where, ring))
            if gated:  # the state after the window's real tokens
                mb.coreml_update_state(state=inputs[N.CONV_STATE], value=conv_state_after_mil(
                    g, values[N.CONV_STATE], new[N.CONV_STATE], inputs[WINDOW_TOKENS], cfg.conv_kernel, s))
            if states:  # computed after the window's real tokens
                mb.coreml_update_state(state=inputs[DELTA_STATE], value=new[DELTA_STATE])
            return {N.HIDDEN_STATES_OUT: x}
        return {N.HIDDEN_STATES_OUT: x, **{CACHES[n]: value for n, value in new.items()}}
    return body


def _producer_mil(g: Graph, cfg: LlamaConfig, inputs: dict, layers: list[int], ring: int, local: tuple, n: int,
                  t: int, s: int):
    """KV-shared decoder layer `n`'s producer (BlockChunk.shared_kv): its (k, v) cache rows as
    (G,1,D,T) (or over the ring's R slots), that width, its (k, v) of this window (1,KV,1,S), and
    where it is: ("local", chunk index) or (shared input kind "cache"/"ring", row). `local`: the
    chunk's (reads, full rows, ks, vs) so far."""
    reads, full, ks, vs = local
    p = cfg.kv_producer(n)
    if p in layers:
        j = layers.index(p)
        return reads[j], (t if j in full else ring), (ks[j], vs[j]), ("local", j)
    rows_full, rows_ring = shared_rows(cfg, layers, ring)
    kind, rows, width = ("cache", rows_full, t) if p in rows_full else ("ring", rows_ring, ring)
    j, at, stems = rows.index(p), cfg.at(p), [N.kv(kv, kind == "ring") for kv in "kv"]
    cache = tuple(_layer_cache_mil(g, at, inputs[N.shared(N.cache(key))], j, width) for key in stems)
    new = tuple(g.slice(inputs[N.shared(N.new(key))], [j, 0, 0, 0], [j + 1, at.kv_channels, 1, s]) for key in stems)
    return cache, width, new, (kind, j)


def _mixer_mil(g: Graph, cfg: LlamaConfig, n: int, i: int, conv_state, delta_state, tokens, gated: list,
               states: list, s: int, branches: int = 0):
    """BlockChunk.mixer: decoder layer n's (chunk layer i's) Mamba-2 mixer as the `side` of its
    attention (None where it has none), over a window (`tokens` real) or, with `branches` B, the
    cascade's branches (conv_state (L_c,Q,B,W), delta_state (L_d*B,H*N,1,P))."""
    if not cfg.mamba(n):
        return None
    conv = g.slice(conv_state, [len(gated), 0, 0, 0],
                   [len(gated) + 1, cfg.conv_channels, max(branches, 1), conv_state_width(cfg)])
    state = _delta_state_row_mil(g, cfg, delta_state, len(states), max(branches, 1))

    def side(hn):
        y, gx, new = mamba2_mixer_mil(g, hn, conv, state, None if branches else tokens, f"layers.{i}.mamba.",
                                      mamba_shape(cfg), s)
        gated.append(gx)
        states.append(new)
        return y
    return side


def _conv_state_row_mil(g: Graph, cfg: LlamaConfig, conv_state, j: int):
    """Row j of a chunk's conv state (L_c,C,1,W) as (1,C,1,W) (C: LlamaConfig.conv_channels)."""
    return g.slice(conv_state, [j, 0, 0, 0], [j + 1, cfg.conv_channels, 1, conv_state_width(cfg)])


def _delta_state_row_mil(g: Graph, cfg: LlamaConfig, states, j: int, rows: int = 1):
    """Rows j*rows .. (j+1)*rows of a chunk's linear-attention states (L_d*rows, H*Dk, 1, Dv)."""
    net = delta_shape(cfg)
    return g.slice(states, [j * rows, 0, 0, 0], [(j + 1) * rows, net.v_heads * net.dk, 1, net.dv])


class BranchChunk(nn.Module):
    """The "decode_branches" function of a block chunk: shares every weight with `chunk`."""

    def __init__(self, chunk: BlockChunk, suffix_length: int):
        super().__init__()
        self.chunk = chunk
        self.suffix_length = suffix_length

    def forward(self, hidden_states, cos, sin, prefix_mask, suffix_mask, k_cache=None, v_cache=None, k_suffix=None,
                v_suffix=None, sliding_prefix_mask=None, sliding_suffix_mask=None, cos_local=None, sin_local=None,
                k_ring=None, v_ring=None, conv_branches=None, per_layer_input=None, k_ring_suffix=None,
                v_ring_suffix=None, shared_k_cache=None, shared_v_cache=None, shared_k_ring=None, shared_v_ring=None,
                shared_k_new=None, shared_v_new=None, shared_k_ring_new=None, shared_v_ring_new=None,
                shared_k_suffix=None, shared_v_suffix=None, shared_k_ring_suffix=None, shared_v_ring_suffix=None,
                delta_branches=None):
        caches = {"cache": (k_cache, v_cache), "ring": (k_ring, v_ring)}
        suffixes = {N.kv("k"): (k_suffix, v_suffix), N.kv("k", ring=True): (k_ring_suffix, v_ring_suffix)}
        shared = {"cache": (shared_k_cache, shared_v_cache), "ring": (shared_k_ring, shared_v_ring),
                  "cache_new": (shared_k_new, shared_v_new), "ring_new": (shared_k_ring_new, shared_v_ring_new),
                  "cache_suffix": (shared_k_suffix, shared_v_suffix),
                  "ring_suffix": (shared_k_ring_suffix, shared_v_ring_suffix)}
        new = {key: ([], []) for key in self.chunk.suffix_keys}
        own = {}  # chunk layer -> (k, v) of this step, for the KV-shared layers after it
        gated, states, b = [], [], hidden_states.shape[3]
        for i, layer in enumerate(self.chunk.layers):
            if isinstance(layer, DeltaLayer):  # each branch from its own states (1,Q,B,W), (B,H*Dk,1,Dv)
                j, d = len(gated), len(states)
                hidden_states, g, new_state = layer(hidden_states, conv_branches[j:j + 1],
                                                    delta_branches[d * b:(d + 1) * b], None)
                gated.append(g)
                states.append(new_state)
                continue
            if isinstance(layer, ConvLayer):  # each branch from its own state (1,C,B,K-1)
                j = len(gated)
                hidden_states, g = layer(hidden_states, conv_branches[j:j + 1])
                gated.append(g)
                continue
            side = self.chunk.mixer(i, conv_branches, delta_branches, None, gated, states, b)
            g, window = layer.cfg.num_key_value_heads, None
            if i in self.chunk.producer:  # a KV-shared layer: its producer's prefix, suffix and K/V
                where, j = self.chunk.producer[i]
                if where == "local":
                    key, a = self.chunk.suffix_rows[j]
                    prefix, (ks, vs), window = self.chunk.layer_caches(j, caches), suffixes[key], own[j]
                else:
                    (k, v), (ks, vs), window = shared[where], shared[f"{where}_suffix"], shared[f"{where}_new"]
                    prefix, a, window = (k[j:j + 1], v[j:j + 1]), j, tuple(t[j:j + 1] for t in window)
            else:
                key, a = self.chunk.suffix_rows[i]  # its suffix caches, and its rows there
                prefix, (ks, vs) = self.chunk.layer_caches(i, caches), suffixes[key]
            hidden_states, k, v = branch_layer(
                layer, hidden_states, *layer.rope(cos, sin, cos_local, sin_local),
                layer.attention_mask(prefix_mask, sliding_prefix_mask),
                layer.attention_mask(suffix_mask, sliding_suffix_mask), *prefix,
                ks[a * g:(a + 1) * g], vs[a * g:(a + 1) * g], self.suffix_length,
                self.chunk.per_layer_slice(per_layer_input, i), window, side)
            if i in self.chunk.producer:
                continue
            own[i] = (k, v)
            new[key][0].append(k)
            new[key][1].append(v)
        out = tuple(torch.cat(rows, dim=0) for key in self.chunk.suffix_keys for rows in new[key])
        return ((hidden_states, *out) + ((torch.cat(gated, dim=0),) if gated else ())
                + ((torch.cat(states, dim=0),) if states else ()))


def build_branch_chunk(g: Graph, cfg: LlamaConfig, io: dict, layers: list[int], context_length: int,
                       suffix_length: int):
    """BranchChunk of decoder layers `layers` (the prefix caches, states or inputs, are only read)."""
    def body(inputs):
        b = shape_of(io, N.HIDDEN_STATES)[3]
        inputs = read_states_mil(inputs, io)
        ring = _ring_of(io)
        reads, full, _ = _layer_reads_mil(g, cfg, inputs, layers, ring, context_length)
        groups = suffix_groups(cfg, layers, ring)
        where = {i: (key, j) for key, rows, _ in groups for j, i in enumerate(rows)}
        new = {key: ([], []) for key, _, _ in groups}
        own_k, own_v = {}, {}  # chunk layer -> its K/V of this step, for the KV-shared layers after it
        x, gated, states = inputs[N.HIDDEN_STATES], [], []
        for i, n in enumerate(layers):
            if not cfg.attends(n):  # each branch from its own conv state (1,Q,B,W), a linear-attention layer's
                # from its own recurrent state too (B,H*Dk,1,Dv)
                conv = g.slice(inputs[N.CONV_BRANCHES], [len(gated), 0, 0, 0],
                               [len(gated) + 1, cfg.conv_channels, b, conv_state_width(cfg)])
                if cfg.linear(n):
                    x, gx, state = delta_layer_mil(g, x, conv, _delta_state_row_mil(g, cfg, inputs[DELTA_BRANCHES],
                                                                                   len(states), b),
                                                   None, f"layers.{i}.", cfg.hidden_size, delta_shape(cfg), b)
                    states.append(state)
                else:
                    x, gx = conv_layer_mil(g, x, conv, f"layers.{i}.", cfg.hidden_size, cfg.conv_kernel,
                                           cfg.stream_eps, b, cfg.conv_bias, cfg.sandwich_norms)
                gated.append(gx)
                continue
            cos, sin = layer_rope_mil(cfg, inputs, n)
            rows, shared = reads.get(i), None
            if cfg.shares_kv(n):  # its producer's prefix, suffix caches and K/V of this step
                rows, _, shared, (kind, j) = _producer_mil(g, cfg, inputs, layers, ring, (reads, full, own_k, own_v),
                                                           n, context_length, b)
                if kind == "local":
                    key, j = where[j]
                    suffix = tuple(inputs[name] for name in suffix_names(key)[:2])
                else:
                    suffix = tuple(inputs[N.shared(N.suffix(N.kv(kv, kind == "ring")))] for kv in "kv")
            else:
                key, j = where[i]
                suffix = tuple(inputs[name] for name in suffix_names(key)[:2])
            side = _mixer_mil(g, cfg, n, i, inputs.get(N.CONV_BRANCHES), inputs.get(DELTA_BRANCHES), None, gated,
                              states, b, branches=b)
            x, k, v = branch_layer_mil(g, cfg, f"layers.{i}.", x, cos, sin, layer_mask_mil(cfg, inputs, n, N.PREFIX_MASK),
                                       layer_mask_mil(cfg, inputs, n, N.SUFFIX_MASK), *rows, *suffix, j, b,
                                       suffix_length, n, per_layer_slice_mil(g, cfg, inputs, i, b), shared, side)
            if cfg.shares_kv(n):
                continue
            own_k[i], own_v[i] = k, v
            new[key][0].append(k)
            new[key][1].append(v)
        out = {N.HIDDEN_STATES_OUT: x}
        for key, (ks, vs) in new.items():
            _, _, k_new, v_new = suffix_names(key)
            out.update({k_new: stack_mil(ks), v_new: stack_mil(vs)})
        return {**out, **({N.CONV_NEW: stack_mil(gated)} if gated else {}),
                **({DELTA_NEW: stack_mil(states)} if states else {})}
    return body


def _cache_io(io: dict, layout: Layout) -> dict:
    """A chunk function's io with its k_cache/v_cache inputs moved to "states" when the caches are
    states: the function reads them (one state of the whole context, whatever its bucket) and,
    unless it is the cascade's, writes its window at `position` (so it also takes position and no
    longer outputs k_new/v_new)."""
    if layout.kv_cache == "inputs":
        return io
    caches = [t for t in io["inputs"] if t["name"] in CACHES]
    inputs = [t for t in io["inputs"] if t not in caches]
    outputs = io["outputs"]
    if not any(t["name"] == N.SUFFIX_MASK for t in inputs):  # single-sequence windows write their K/V
        inputs.append(tensor(N.POSITION, [1], "int32"))
        if any(t["name"] == N.CONV_STATE for t in caches):  # and their conv state, after the real tokens
            inputs.append(tensor(WINDOW_TOKENS, [1], "int32"))
        outputs = [t for t in outputs if t["name"] not in CACHES.values()]
    for state in caches:
        if state["name"] not in RING_CACHES + (N.CONV_STATE, DELTA_STATE):  # the ring is R slots in every bucket,
            # the conv state K-1 values, the recurrent state one per layer
            state["shape"][3] = layout.state_length
    return {"inputs": inputs, "states": caches, "outputs": outputs}


def functions(cfg: LlamaConfig, layout: Layout, layers: list[int] | int,
              heads: list[int] | None = None) -> dict[str, dict]:
    """{function: io} of a chunk of decoder layers `layers` (their indices in the model; a count n:
    layers 0..n-1): a window function per bucket, then the cascade's and verify's (state exports
    have no verify function). The last chunk may carry the LM head (`heads`: the vocabulary splits
    it computes, see `carry_head`)."""
    out = _functions(cfg, layout, layers)
    return carry_head(cfg, layout, out, heads) if heads else out


def carry_head(cfg: LlamaConfig, layout: Layout, functions: dict[str, dict], heads: list[int]) -> dict[str, dict]:
    """The functions of a chunk carrying the LM head (--fold-lm-head): each outputs the logits_j of
    vocabulary splits `heads` (its hidden states through the final norm and the heads) in place of
    hidden_states_out, first, then what else it outputs. One Core ML call per step fewer."""
    out = {}
    for fn, io in functions.items():
        s = shape_of(io, N.HIDDEN_STATES_OUT, "outputs")[3]
        rest = [t for t in io["outputs"] if t["name"] != N.HIDDEN_STATES_OUT]
        out[fn] = {**io, "outputs": lm_head.logits_outputs(cfg, layout, heads, s) + rest}
    return out


def carries_head(io: dict) -> bool:
    """Whether a chunk function outputs logits (the last chunk carrying the LM head)."""
    return any(N.logits_split(t["name"]) is not None for t in io["outputs"])


def with_head(g: Graph, cfg: LlamaConfig, io: dict, body):
    """`body` (a chunk function's builder) followed, when the function carries the LM head, by the
    head on its hidden states (lm_head.build_lm_head): the logits_j in place of hidden_states_out."""
    if not carries_head(io):
        return body
    head = lm_head.build_lm_head(g, cfg, io)

    def headed(inputs):
        out = dict(body(inputs))
        out.update(head({N.HIDDEN_STATES: out.pop(N.HIDDEN_STATES_OUT)}))
        return out
    return headed


class HeadedChunk(nn.Module):
    """A BlockChunk carrying the LM head: the chunk's window, then `head` on its hidden states.
    Returns the logits_j, then the window's k_new, v_new."""

    def __init__(self, chunk: BlockChunk, head: nn.Module):
        super().__init__()
        self.chunk, self.head = chunk, head

    def forward(self, hidden_states, cos, sin, mask, k_cache=None, v_cache=None, sliding_mask=None, cos_local=None,
                sin_local=None, k_ring=None, v_ring=None, conv_state=None, per_layer_input=None, shared_k_cache=None,
                shared_v_cache=None, shared_k_ring=None, shared_v_ring=None, shared_k_new=None, shared_v_new=None,
                shared_k_ring_new=None, shared_v_ring_new=None, delta_state=None, window_tokens=None):
        hidden_states, *new = self.chunk(hidden_states, cos, sin, mask, k_cache, v_cache, sliding_mask, cos_local,
                                         sin_local, k_ring, v_ring, conv_state, per_layer_input, shared_k_cache,
                                         shared_v_cache, shared_k_ring, shared_v_ring, shared_k_new, shared_v_new,
                                         shared_k_ring_new, shared_v_ring_new, delta_state, window_tokens)
        return (*self.head(hidden_states), *new)


class HeadedBranchChunk(nn.Module):
    """A BranchChunk carrying the LM head (the cascade function of a HeadedChunk's chunk)."""

    def __init__(self, branches: BranchChunk, head: nn.Module):
        super().__init__()
        self.branches, self.head = branches, head

    def forward(self, hidden_states, cos, sin, prefix_mask, suffix_mask, k_cache=None, v_cache=None, k_suffix=None,
                v_suffix=None, sliding_prefix_mask=None, sliding_suffix_mask=None, cos_local=None, sin_local=None,
                k_ring=None, v_ring=None, conv_branches=None, per_layer_input=None, k_ring_suffix=None,
                v_ring_suffix=None, shared_k_cache=None, shared_v_cache=None, shared_k_ring=None, shared_v_ring=None,
                shared_k_new=None, shared_v_new=None, shared_k_ring_new=None, shared_v_ring_new=None,
                shared_k_suffix=None, shared_v_suffix=None, shared_k_ring_suffix=None, shared_v_ring_suffix=None,
                delta_branches=None):
        hidden_states, *new = self.branches(hidden_states, cos, sin, prefix_mask, suffix_mask, k_cache, v_cache,
                                            k_suffix, v_suffix, sliding_prefix_mask, sliding_suffix_mask,
                                            cos_local, sin_local, k_ring, v_ring, conv_branches, per_layer_input,
                                            k_ring_suffix, v_ring_suffix, shared_k_cache, shared_v_cache,
                                            shared_k_ring, shared_v_ring, shared_k_new, shared_v_new,
                                            shared_k_ring_new, shared_v_ring_new, shared_k_suffix, shared_v_suffix,
                                            shared_k_ring_suffix, shared_v_ring_suffix, delta_branches)
        return (*self.head(hidden_states), *new)


def _caches(cfg: LlamaConfig, layout: Layout, layers: list[int], t: int, s: int) -> tuple[list[dict], list[dict]]:
    """A window function's cache inputs (full layers over T positions, ring layers over its R
    slots) and its new K/V outputs (S columns each), each pair only where the chunk has such layers."""
    f = layout.dtype
    full, sliding = chunk_rows(cfg, layers, layout.ring)
    inputs, outputs = [], []
    for rows, names, width, kv in ((full, (N.K_CACHE, N.V_CACHE), t, cfg.global_layers.kv_channels),
                                   (sliding, RING_CACHES, layout.ring, cfg.kv_channels)):
        for name in names if rows else ():
            inputs.append(tensor(name, [len(rows), kv, 1, width], f))
            outputs.append(tensor(CACHES[name], [len(rows), kv, 1, s], f))
    return inputs, outputs


def _shared_io(cfg: LlamaConfig, layout: Layout, layers: list[int], t: int, s: int, suffix: bool = False) -> list[dict]:
    """The K/V a chunk's KV-shared layers read from producers in other chunks (functions.shared_rows),
    after its other inputs: their caches (shared_k_cache (P,KV,1,T), or shared_k_ring over the ring's
    R slots), the window's K/V they computed (shared_k_new, shared_k_ring_new (P,KV,1,S)) and, in the
    cascade (`suffix`), their suffix caches (shared_k_suffix, shared_k_ring_suffix (P*G,B,D,U))."""
    caches, new, suffixes, f = [], [], [], layout.dtype
    for rows, kind, width in zip(shared_rows(cfg, layers, layout.ring), ("cache", "ring"), (t, layout.ring)):
        if not rows:
            continue
        at = cfg.at(rows[0])
        for key in (N.kv(kv, kind == "ring") for kv in "kv"):
            caches.append(tensor(N.shared(N.cache(key)), [len(rows), at.kv_channels, 1, width], f))
            new.append(tensor(N.shared(N.new(key)), [len(rows), at.kv_channels, 1, s], f))
            suffixes.append(tensor(N.shared(N.suffix(key)), [len(rows) * at.num_key_value_heads, s, at.head_dim,
                                                            layout.suffix_length], f))
    return caches + new + (suffixes if suffix else [])


def _per_layer_io(cfg: LlamaConfig, layout: Layout, layers: list[int], s: int) -> list[dict]:
    """A chunk function's per-layer inputs (Gemma 4): its layers' slices of the embeddings'
    per_layer_inputs, (1, L*P, 1, S), where the model has them."""
    p = cfg.per_layer_input_size
    return [tensor(N.PER_LAYER_INPUT, [1, len(layers) * p, 1, s], layout.dtype)] if p else []


def _conv_io(cfg: LlamaConfig, layout: Layout, layers: list[int], s: int) -> tuple[list[dict], list[dict]]:
    """A window function's conv state input and the window values it outputs (see the module
    docstring), where the chunk has conv layers."""
    rows = conv_rows(cfg, layers)
    if not rows:
        return [], []
    c, f = cfg.conv_channels, layout.dtype
    return ([tensor(N.CONV_STATE, [len(rows), c, 1, conv_state_width(cfg)], f)],
            [tensor(N.CONV_NEW, [len(rows), c, 1, s], f)])


def _delta_io(cfg: LlamaConfig, layout: Layout, layers: list[int], branches: int = 0) -> tuple[list[dict], list[dict]]:
    """A window function's linear-attention states (L_d,H*Dk,1,Dv) in and after the window out, and
    with input caches the window's real tokens they are taken at (state caches read them for the
    conv state too: _cache_io); the cascade's (`branches` B) per-branch states (L_d*B,H*Dk,1,Dv) in
    and out. Empty where the chunk has no linear-attention layers."""
    rows = delta_rows(cfg, layers)
    if not rows:
        return [], []
    _, channels, _, width = delta_shape(cfg).state_shape
    f, n = layout.dtype, len(rows) * max(branches, 1)
    if branches:
        return [tensor(DELTA_BRANCHES, [n, channels, 1, width], f)], [tensor(DELTA_NEW, [n, channels, 1, width], f)]
    tokens = [tensor(WINDOW_TOKENS, [1], "int32")] if layout.kv_cache == "inputs" else []
    return [tensor(DELTA_STATE, [n, channels, 1, width], f)] + tokens, [tensor(DELTA_NEW, [n, channels, 1, width], f)]


def _functions(cfg: LlamaConfig, layout: Layout, layers: list[int] | int) -> dict[str, dict]:
    """chunk.functions without the LM head."""
    layers = list(range(layers)) if isinstance(layers, int) else list(layers)
    c, d, f = cfg.hidden_size, cfg.global_layers.head_dim, layout.dtype
    out = {}
    for fn, _, s, t in layout.windows():
        caches, new = _caches(cfg, layout, layers, t, s)
        conv_state, conv_new = _conv_io(cfg, layout, layers, s)
        delta_state, delta_new = _delta_io(cfg, layout, layers)
        out[fn] = _cache_io({
            "inputs": [tensor(N.HIDDEN_STATES, [1, c, 1, s], f), tensor(N.COS, [1, d, 1, s], f),
                       tensor(N.SIN, [1, d, 1, s], f), tensor(N.MASK, [1, 1, s, t + s], f)] + caches
            + layer_inputs(cfg, layout, window_masks(layout, s, t), s) + _per_layer_io(cfg, layout, layers, s)
            + conv_state + _shared_io(cfg, layout, layers, t, s) + delta_state,
            "outputs": [tensor(N.HIDDEN_STATES_OUT, [1, c, 1, s], f)] + new + conv_new + delta_new,
        }, layout)
    t, b, u, w = layout.context_length, layout.branch_width, layout.suffix_length, layout.verify_window
    if b and not layout.window_cascade:
        convs, suffixes, new = len(conv_rows(cfg, layers)), [], []
        delta_branches, delta_new = _delta_io(cfg, layout, layers, b)
        for key, rows, at in suffix_groups(cfg, layers, layout.ring):
            names, g = suffix_names(key), at.num_key_value_heads
            suffixes += [tensor(name, [len(rows) * g, b, at.head_dim, u], f) for name in names[:2]]
            new += [tensor(name, [len(rows), at.kv_channels, 1, b], f) for name in names[2:]]
        out[BRANCHES] = _cache_io({
            "inputs": [tensor(N.HIDDEN_STATES, [1, c, 1, b], f), tensor(N.COS, [1, d, 1, b], f),
                       tensor(N.SIN, [1, d, 1, b], f), tensor(N.PREFIX_MASK, [1, 1, 1, t], f),
                       tensor(N.SUFFIX_MASK, [1, b, 1, u + 1], f)] + _caches(cfg, layout, layers, t, b)[0] + suffixes
            + layer_inputs(cfg, layout, branch_masks(layout), b) + _per_layer_io(cfg, layout, layers, b)
            # each branch's own conv state, a copy of the prefix's at its first token
            + ([tensor(N.CONV_BRANCHES, [convs, cfg.conv_channels, b, conv_state_width(cfg)], f)] if convs else [])
            + _shared_io(cfg, layout, layers, t, b, suffix=True) + delta_branches,
            # every attention layer's new K/V: the suffix caches hold them all
            "outputs": [tensor(N.HIDDEN_STATES_OUT, [1, c, 1, b], f)] + new
            + ([tensor(N.CONV_NEW, [convs, cfg.conv_channels, 1, b], f)] if convs else []) + delta_new,
        }, layout)
    if w:
        caches, new = _caches(cfg, layout, layers, t, w)
        out[VERIFY] = {
            "inputs": [tensor(N.HIDDEN_STATES, [1, c, 1, w], f), tensor(N.COS, [1, d, 1, w], f),
                       tensor(N.SIN, [1, d, 1, w], f), tensor(N.MASK, [1, 1, w, t + w], f)] + caches
            + layer_inputs(cfg, layout, window_masks(layout, w, t), w) + _per_layer_io(cfg, layout, layers, w)
            + _shared_io(cfg, layout, layers, t, w),
            "outputs": [tensor(N.HIDDEN_STATES_OUT, [1, c, 1, w], f)] + new,
        }
    return out


def program(g: Graph, cfg: LlamaConfig, function: str, io: dict, site: Site):
    """The MIL builder of a chunk's `function` (model.kinds); the last chunk may carry the LM head."""
    layers = list(site.layers)
    if function == BRANCHES:
        return with_head(g, cfg, io, build_branch_chunk(g, cfg, io, layers, site.context_length, site.suffix_length))
    return with_head(g, cfg, io, build_chunk(g, cfg, io, layers))


def modules(weights, model: str, cfg: LlamaConfig, functions: dict[str, dict], site: Site,
            dtype: torch.dtype) -> dict[str, nn.Module]:
    """The torch modules of a chunk: one BlockChunk for its window functions (the verify window too:
    the tree is in its mask), a BranchChunk on it for the cascade, each with the LM head after it
    where the chunk carries the head."""
    layers = list(site.layers)
    block = with_state(lambda: BlockChunk(cfg, layers, site.context_length, site.ring),
                       weights.chunk(model, layers, dtype))
    out: dict[str, nn.Module] = {fn: block for fn in functions}
    if BRANCHES in functions:
        out[BRANCHES] = BranchChunk(block, site.suffix_length)
    if site.head:
        head = lm_head.head_module(weights, model, cfg, next(iter(functions.values())), dtype)
        out = {fn: HeadedBranchChunk(module, head) if fn == BRANCHES else HeadedChunk(module, head)
               for fn, module in out.items()}
    return out
