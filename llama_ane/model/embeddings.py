"""The embeddings models: token lookup, RoPE rows and attention masks, each torch module with its MIL
builder below it.

    Embeddings        input_ids (1,S) int32, position (1,) int32
                      -> hidden_states (1,C,1,S), cos/sin (1,D,1,S), mask (1,1,S,T+S)
    WindowEmbeddings  input_ids (1,S) int32, positions (S,) int32 -> hidden_states (1,C,1,S), cos/sin (1,D,1,S)
                      (where the prefill window decodes: each row at its own position, the masks
                      made by the host)
    EmbeddingsPart    input_ids (1,S) int32, hidden_states (1,C,1,S) -> hidden_states_out (1,C,1,S)
                      (a later file of an embedding table cut by rows: adds the lookup of its rows;
                      Gemma 4's also per_layer_inputs -> per_layer_inputs_out, see below)
    BranchEmbeddings  input_ids (1,B) int32, positions (B,) int32, prefix_length (1,) int32
                      -> hidden_states (1,C,1,B), cos/sin (1,D,1,B),
                         prefix_mask (1,1,1,T), suffix_mask (1,B,1,U+1)
    VerifyEmbeddings  input_ids (1,W) int32, position (1,) int32, depths (W,) int32,
                      tree_mask (1,1,W,W) additive -> hidden_states (1,C,1,W), cos/sin (1,D,1,W),
                      mask (1,1,W,T+W)

C = hidden size, D = head_dim, T = the cache positions (the context bucket), S = query length (the
prefill window or 1), B branches with suffixes of up to U tokens, W the verify window. The RoPE
tables are constants read with a gather (fp16 cannot compute cos(position * freq) for large
positions); gathers are fine here, block chunks have none. `position` is the number of cached
tokens; a branch's `positions[b]` its absolute position; a tree token i sits at position +
depths[i], and `tree_mask[0,0,i,j]` is 0 where token j is token i or one of its ancestors.

Where the model's sliding window is shorter than the context (LlamaConfig.windowed), each also
outputs the sliding twin of its masks ("sliding_mask", or "sliding_prefix_mask" (1,1,B,T) and
"sliding_suffix_mask" (1,B,1,U+1)): the same mask that also hides every key `sliding_window` or
more positions before its query. A family with local RoPE (Gemma 3) also gets "cos_local" and
"sin_local" (1,D,1,S); its tables hold the global columns, then the local ones.

Where the sliding layers keep a ring buffer of R slots (functions.ring_length), the sliding masks'
cache columns are the ring's slots, not positions: (1,1,S,R+S), (1,1,B,R). Slot j holds the latest
position h < `position` with h = j (mod R), h_j = position - 1 - ((position + R - 1 - j) mod R)
(negative: never written), and is visible to a query at q where h_j >= 0 and q - h_j < window.
Keys keep the rotation they were written with, so the slots' order does not matter.

Gemma 4's per-layer inputs (PLE, LlamaConfig.per_layer_input_size P) are made here too, where the
token is looked up: "per_layer_inputs" (1,L*P,1,S), the last output of every function, layer n's P
channels at rows n*P..: the token's row of the per-layer table (times sqrt(P)) plus the normalized
projection of its embedding (per layer), times 1/sqrt(2). Each chunk reads its layers' rows.
Where the embedding table is cut by rows, the per-layer table is cut by the same rows
(per_layer_rows): each file's per_layer_inputs (a part's per_layer_inputs_out) adds its rows' lookup
to the files' before it, and the last file, where the embedding is whole, holds the projection and
its norm and gives the per-layer inputs; the files before it give the table's lookup so far.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

import dataclasses

from ..config import LlamaConfig, inv_freq
from . import names as N
from .functions import (BRANCHES, VERIFY, Layout, Site, branch_masks, bucket_of, layer_inputs, per_layer_rows, shape_of,
                        tensor, window_masks, window_of)
from .layers import MASK_VALUE, Graph, RMSNorm, conv1x1, conv_mil, mb, rms_norm_mil, with_state


def rope_tables(cfg: LlamaConfig, positions: int,
                context_length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables (positions, D) in fp32, as transformers computes them (incl. llama3 scaling).

    Longrope (Phi-3) takes its frequencies and attention factor from transformers' own longrope
    function, the one its rotary embedding class calls: the long factors when a sequence of
    `context_length` tokens (the most the export holds; default `positions`) passes
    original_max_position_embeddings, as transformers decides for a sequence that long, else the
    short ones; cos and sin are scaled by the attention factor. With partial rotary the channels
    past rotary_dim pass unrotated (cos 1, sin 0)."""
    scale = 1.0
    if (cfg.rope_scaling or {}).get("rope_type") == "longrope":
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        freqs, scale = ROPE_INIT_FUNCTIONS["longrope"](cfg.transformers_config(), None,
                                                       seq_len=context_length or positions)
        freqs = freqs.to(torch.float32)
    else:
        freqs = torch.tensor(inv_freq(cfg), dtype=torch.float32)
    angles = torch.arange(positions, dtype=torch.float32)[:, None] * freqs[None, :]
    emb = torch.cat([angles, angles], dim=1)
    cos, sin = emb.cos(), emb.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    rest = cfg.head_dim - cfg.rotary_dim
    if rest:
        cos = torch.cat([cos, torch.ones(positions, rest)], dim=1)
        sin = torch.cat([sin, torch.zeros(positions, rest)], dim=1)
    return cos, sin


def stored_rope_tables(cfg: LlamaConfig, positions: int,
                       context_length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The cos, sin tables the embeddings read: rope_tables, with the local RoPE's columns after
    them for a family with a local base ((positions, D + D_local): one gather reads both). D is the
    global layers' head_dim (LlamaConfig.global_layers), D_local the sliding layers'."""
    cos, sin = rope_tables(cfg.global_layers, positions, context_length)
    if cfg.rope_local_theta is None:
        return cos, sin
    local = dataclasses.replace(cfg, rope_theta=cfg.rope_local_theta, rope_scaling=None, rope_proportion=1.0)
    cos_local, sin_local = rope_tables(local, positions, context_length)
    return torch.cat([cos, cos_local], dim=1), torch.cat([sin, sin_local], dim=1)


def rope_weights(cfg: LlamaConfig, positions: int, dtype: type,
                 context_length: int | None = None) -> dict[str, np.ndarray]:
    """The programs' cos/sin tables (stored_rope_tables): computed in fp32, stored in the export dtype."""
    cos, sin = stored_rope_tables(cfg, positions, context_length)
    return {"cos_table": cos.numpy().astype(dtype), "sin_table": sin.numpy().astype(dtype)}


def lookup(table: nn.Embedding, input_ids: torch.Tensor, start: int, vocab_size: int,
           scale: float = 1.0) -> torch.Tensor:
    """Channels-first embeddings of `input_ids` (1,S) -> (1,C,1,S) from `table`, rows start..start+n-1
    of the vocabulary. A table of the whole vocabulary is a plain lookup; a part of it gives zeros
    for ids outside its rows (their lookup is clamped into range and multiplied by 0), so the parts'
    lookups add up to the whole one exactly. `scale` multiplies the rows (LlamaConfig.embedding_scale)."""
    if scale != 1.0:
        return lookup(table, input_ids, start, vocab_size) * scale
    n = table.num_embeddings
    if start == 0 and n == vocab_size:
        return table(input_ids).transpose(1, 2).unsqueeze(2)
    local = (input_ids - start).clamp(0, n - 1)
    hit = ((input_ids >= start) & (input_ids < start + n)).unsqueeze(2)  # (1,S,1)
    found = table(local)  # (1,S,C)
    return (found * hit.to(found.dtype)).transpose(1, 2).unsqueeze(2)


def lookup_mil(g: Graph, input_ids, rows: tuple[int, int], vocab_size: int, scale: float = 1.0,
               name: str = "embed_tokens.weight"):
    """lookup of input_ids (1,S) in vocabulary rows [start, end) of table `name` -> (1,C,1,S)."""
    if scale != 1.0:
        return mb.mul(x=lookup_mil(g, input_ids, rows, vocab_size, name=name), y=g.scalar(scale))
    table = g.weight(name)
    start, end = rows
    if start == 0 and end == vocab_size:
        found = mb.gather(x=table, indices=input_ids, axis=0)  # (1,S,C)
    else:
        local = mb.minimum(x=mb.maximum(x=mb.sub(x=input_ids, y=np.int32(start)), y=np.int32(0)),
                           y=np.int32(end - start - 1))
        hit = mb.logical_and(x=mb.greater_equal(x=input_ids, y=np.int32(start)), y=mb.less(x=input_ids, y=np.int32(end)))
        hit = mb.expand_dims(x=g.cast(hit), axes=[2])  # (1,S,1)
        found = mb.mul(x=mb.gather(x=table, indices=local, axis=0), y=hit)
    return mb.expand_dims(x=mb.transpose(x=found, perm=[0, 2, 1]), axes=[2])  # (1,S,C) -> (1,C,1,S)


class PerLayerInputs(nn.Module):
    """Gemma 4's per-layer inputs of a window: input_ids (1,S), the (stream-scaled) embeddings
    hidden (1,C,1,S) -> (1,L*P,1,S).

    transformers normalizes the projection times 1/sqrt(C) of the unscaled embeddings; the norm is
    scale invariant but for its eps, so the projection of the stream (times stream_scale * sqrt(C)
    that) is normalized with eps times that factor's square instead.

    An embedding table cut by rows cuts the per-layer table by the same rows (per_layer_rows): each
    file looks up its rows (`rows`, the file's vocabulary rows) and adds them to the `tokens` of the
    files before it; only the last file (`project`), where the embedding is whole, projects it and
    gives the per-layer inputs. The others give the per-layer table's lookup so far (times sqrt(P)).
    """

    def __init__(self, cfg: LlamaConfig, rows: tuple[int, int] | None = None, project: bool = True):
        super().__init__()
        self.layers, self.size = cfg.num_hidden_layers, cfg.per_layer_input_size
        self.vocab_size = cfg.vocab_size  # ids past the per-layer table's rows look up zeros
        self.start, end = per_layer_rows(cfg, rows or (0, cfg.vocab_size))
        self.embed_tokens_per_layer = (nn.Embedding(end - self.start, cfg.per_layer_channels)
                                       if end > self.start else None)  # none: a file past the table's rows
        self.project = project
        if project:
            self.per_layer_model_projection = conv1x1(cfg.hidden_size, cfg.per_layer_channels)
            self.per_layer_projection_norm = RMSNorm(cfg.per_layer_input_size, per_layer_eps(cfg))

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor,
                tokens: torch.Tensor | None = None) -> torch.Tensor:
        s = input_ids.shape[1]
        if self.embed_tokens_per_layer is not None:
            found = lookup(self.embed_tokens_per_layer, input_ids, self.start, self.vocab_size, self.size ** 0.5)
            tokens = found if tokens is None else tokens + found
        if not self.project:
            return tokens
        projected = self.per_layer_model_projection(hidden).reshape(self.layers, self.size, 1, s)
        projected = self.per_layer_projection_norm(projected).reshape(1, self.layers * self.size, 1, s)
        return (projected + tokens) * 2 ** -0.5


def per_layer_names(cfg: LlamaConfig, rows: tuple[int, int], project: bool) -> tuple[str, ...]:
    """The parameters of the PerLayerInputs of the embeddings file of vocabulary rows `rows`: its
    rows of the per-layer table (where it has any), and the projection and its norm where it `project`s."""
    start, end = per_layer_rows(cfg, rows)
    return (("embed_tokens_per_layer.weight",) if end > start else ()) + (
        ("per_layer_model_projection.weight", "per_layer_projection_norm.weight") if project else ())


def per_layer_eps(cfg: LlamaConfig) -> float:
    """The eps of the per-layer projection's norm over the stream's projection (see PerLayerInputs)."""
    return cfg.rms_norm_eps * (cfg.stream_scale * cfg.hidden_size ** 0.5) ** 2


def per_layer_inputs_mil(g: Graph, cfg: LlamaConfig, input_ids, hidden, s: int,
                         rows: tuple[int, int] | None = None, tokens=None):
    """PerLayerInputs of the embeddings file of vocabulary rows `rows` (default: all), after the
    files before it gave `tokens`. input_ids (1,S), hidden (1,C,1,S) -> (1,L*P,1,S)"""
    layers, p = cfg.num_hidden_layers, cfg.per_layer_input_size
    rows = rows or (0, cfg.vocab_size)
    start, end = per_layer_rows(cfg, rows)
    if end > start:
        found = lookup_mil(g, input_ids, (start, end), cfg.vocab_size, p ** 0.5, "embed_tokens_per_layer.weight")
        tokens = found if tokens is None else mb.add(x=tokens, y=found)
    if rows[1] < cfg.vocab_size:  # not the last file: the table's lookup so far
        return tokens
    projected = mb.reshape(x=conv_mil(g, hidden, "per_layer_model_projection.weight"), shape=[layers, p, 1, s])
    projected = rms_norm_mil(g, projected, "per_layer_projection_norm.weight", per_layer_eps(cfg), p)
    projected = mb.reshape(x=projected, shape=[1, layers * p, 1, s])
    return mb.mul(x=mb.add(x=projected, y=tokens), y=g.scalar(2 ** -0.5))


def _per_layer(module: nn.Module, input_ids: torch.Tensor, hidden: torch.Tensor) -> tuple:
    """The per-layer inputs output (one-tuple) of an embeddings module whose model has them, else ()."""
    return () if module.per_layer is None else (module.per_layer(input_ids, hidden),)


def _per_layer_output(cfg: LlamaConfig, layout: Layout, s: int) -> list[dict]:
    """The embeddings functions' per_layer_inputs output (1,L*P,1,S), where the model has them."""
    return [tensor(N.PER_LAYER_INPUTS, [1, cfg.per_layer_channels, 1, s], layout.dtype)] \
        if cfg.per_layer_input_size else []


def mask_from_mil(g: Graph, keep):
    """Additive mask from a bool `keep`: 0 where True, MASK_VALUE (large, finite) where False."""
    return mb.mul(x=mb.sub(x=g.scalar(1.0), y=g.cast(keep)), y=g.scalar(MASK_VALUE))


def _rope_rows_mil(g: Graph, cfg: LlamaConfig, positions, s: int) -> dict:
    """The RoPE rows of `positions` (S,) int32: {"cos", "sin"} (1,D,1,S), and "cos_local",
    "sin_local" where the tables hold local columns too."""
    d, dl, local = cfg.global_layers.head_dim, cfg.head_dim, cfg.rope_local_theta is not None
    out = {}
    for name in (N.COS, N.SIN):
        rows = mb.transpose(x=mb.gather(x=g.weight(f"{name}_table"), indices=positions, axis=0), perm=[1, 0])
        if local:  # (D+D_local,S): the global rows, then the local ones
            out[f"{name}_local"] = mb.reshape(x=g.slice(rows, [d, 0], [d + dl, s]), shape=[1, dl, 1, s])
            rows = g.slice(rows, [0, 0], [d, s])
        out[name] = mb.reshape(x=rows, shape=[1, d, 1, s])
    return out


def _rope_rows(cfg: LlamaConfig, cos_table: torch.Tensor, sin_table: torch.Tensor, positions: torch.Tensor,
               dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """_rope_rows_mil in torch: positions (S,) -> {"cos", "sin"[, "cos_local", "sin_local"]} (1,D,1,S)."""
    d, out = cfg.global_layers.head_dim, {}
    for name, table in ((N.COS, cos_table), (N.SIN, sin_table)):
        rows = table[positions].t().unsqueeze(0).unsqueeze(2).to(dtype)  # (S,D) -> (1,D,1,S), or 2D
        out[name] = rows[:, :d]
        if cfg.rope_local_theta is not None:
            out[f"{name}_local"] = rows[:, d:]
    return out


def _extras(cfg: LlamaConfig, rope: dict, sliding: dict) -> tuple:
    """The outputs after the Llama ones, in layer_inputs' order: the sliding masks, the local tables."""
    return tuple(sliding.values()) + ((rope[N.COS_LOCAL], rope[N.SIN_LOCAL]) if N.COS_LOCAL in rope else ())


def _outputs(io: dict, name: str) -> bool:
    """Whether a function outputs tensor `name`."""
    return any(t["name"] == name for t in io["outputs"])


def near(query_pos: torch.Tensor, key_pos: torch.Tensor, window: int) -> torch.Tensor:
    """Where a key is inside its query's sliding window: query - key < window (bool, broadcast)."""
    return (query_pos - key_pos) < window


def near_mil(query_pos, key_pos, window: int):
    """near."""
    return mb.less(x=mb.sub(x=query_pos, y=key_pos), y=np.int32(window))


def window_mask(s: int, window: int | None = None) -> np.ndarray:
    """The additive mask (1,1,S,S) of a window of S consecutive queries over themselves: causal,
    and with `window`, also hiding keys `window` or more positions before the query."""
    i, k = np.arange(s)[:, None], np.arange(s)[None, :]
    keep = (k <= i) & ((i - k < window) if window else True)
    return np.where(keep, 0.0, MASK_VALUE).astype(np.float32).reshape(1, 1, s, s)


def held_positions(position: torch.Tensor, ring: int) -> torch.Tensor:
    """(1,1,1,R) int32: the position each of R ring slots holds with `position` tokens cached (see
    the module docstring); negative where the slot was never written."""
    slots = torch.arange(ring, dtype=torch.int32, device=position.device).view(1, 1, 1, -1)
    p = position.view(1, 1, 1, 1).to(torch.int32)
    return p - 1 - torch.remainder(p + (ring - 1) - slots, ring)


def held_positions_mil(position, ring: int):
    """held_positions. position: (1,) int32 -> (1,1,1,R) int32"""
    p = mb.reshape(x=position, shape=[1, 1, 1, 1])
    back = np.arange(ring - 1, -1, -1, dtype=np.int32).reshape(1, 1, 1, ring)  # R - 1 - j
    return mb.sub(x=mb.sub(x=p, y=np.int32(1)), y=mb.mod(x=mb.add(x=p, y=back), y=np.int32(ring)))


def sliding_keep(cfg: LlamaConfig, position: torch.Tensor, queries: torch.Tensor, cache_positions: torch.Tensor,
                 ring: int) -> torch.Tensor:
    """(1,1,N,T) or (1,1,N,R) bool: the cache columns queries at `queries` (1,1,N,1) see in a sliding
    layer: the cached positions (or the ring's slots' held positions) inside their windows."""
    if ring:
        held = held_positions(position, ring)
        return (held >= 0) & near(queries, held, cfg.sliding_window)
    cached = cache_positions < position.view(1, 1, 1, 1)
    return cached & near(queries, cache_positions, cfg.sliding_window)


def sliding_keep_mil(cfg: LlamaConfig, position, queries, t: int, ring: int):
    """sliding_keep. queries: (1,1,N,1) int32 -> (1,1,N,T) or (1,1,N,R) bool"""
    if ring:
        held = held_positions_mil(position, ring)
        return mb.logical_and(x=mb.greater_equal(x=held, y=np.int32(0)),
                              y=near_mil(queries, held, cfg.sliding_window))
    keys = np.arange(t, dtype=np.int32).reshape(1, 1, 1, t)
    return mb.logical_and(x=_cached_mil(position, t), y=near_mil(queries, keys, cfg.sliding_window))


def _ring_of(io: dict, name: str, t: int) -> int:
    """The ring's slots a function's sliding mask `name` covers (0: the cache positions, T)."""
    shape = shape_of(io, name, "outputs")
    cols = shape[3] - (shape[2] if name == N.SLIDING_MASK else 0)
    return 0 if cols == t else cols


def _cached_mil(position, t: int):
    """(1,1,1,T) bool: the cache positions below `position`."""
    return mb.less(x=np.arange(t, dtype=np.int32).reshape(1, 1, 1, t), y=mb.reshape(x=position, shape=[1, 1, 1, 1]))


def _cache_mask_mil(g: Graph, position, t: int):
    """(1,1,1,T): 0 at the cache positions below `position`, MASK_VALUE from it on."""
    return mask_from_mil(g, _cached_mil(position, t))


def _sliding_cache_mask_mil(g: Graph, cfg: LlamaConfig, position, queries, t: int, n: int, ring: int):
    """(1,1,N,T), or (1,1,N,R) over a ring: the cache mask of N queries at positions `queries` (N,)
    int32, also hiding the keys outside each query's sliding window."""
    return mask_from_mil(g, sliding_keep_mil(cfg, position, mb.reshape(x=queries, shape=[1, 1, n, 1]), t, ring))


class Embeddings(nn.Module):
    """Token lookup, RoPE tables and the attention mask for one window of S tokens.

    The RoPE tables cover positions 0 .. T+S-1 (computed in fp32, stored in the export precision).
    With `rows` < vocab_size, the table holds the first `rows` rows of the vocabulary and
    EmbeddingsPart files add the others.
    """

    def __init__(self, cfg: LlamaConfig, context_length: int, window: int, rows: int | None = None,
                 windowed: bool | None = None, ring: int = 0):
        """`windowed`: whether to output the sliding mask (default: cfg.windowed(context_length));
        `ring`: the sliding layers' ring slots (0: they read the cache's positions)."""
        super().__init__()
        self.window = window
        self.vocab_size, self.embedding_scale = cfg.vocab_size, cfg.embedding_scale
        self.embed_tokens = nn.Embedding(rows or cfg.vocab_size, cfg.hidden_size)
        self.cfg, self.ring = cfg, ring
        self.windowed = cfg.windowed(context_length) if windowed is None else windowed
        cos, sin = stored_rope_tables(cfg, context_length + window, context_length)
        self.register_buffer("cos_table", cos)
        self.register_buffer("sin_table", sin)
        self.register_buffer("cache_positions", torch.arange(context_length, dtype=torch.int32).view(1, 1, 1, -1))
        self.register_buffer("offsets", torch.arange(window, dtype=torch.int32))
        # [query, key], built here, not in-graph
        self.register_buffer("window_mask", torch.from_numpy(window_mask(window)))
        self.register_buffer("sliding_window_mask", torch.from_numpy(window_mask(window, cfg.sliding_window)))
        self.per_layer = None  # PerLayerInputs where the model has them, given by whoever builds it with weights

    def forward(self, input_ids: torch.Tensor, position: torch.Tensor):
        hidden = lookup(self.embed_tokens, input_ids, 0, self.vocab_size, self.embedding_scale)  # (1,C,1,S)
        s = input_ids.shape[1]  # the window, or its first s rows (a token decoded unpadded: the same numbers)
        pos = position + self.offsets[:s]  # (S,)
        rope = _rope_rows(self.cfg, self.cos_table, self.sin_table, pos, hidden.dtype)
        cached = self.cache_positions < position.view(1, 1, 1, 1)  # (1,1,1,T)
        cache_mask = ((1.0 - cached.to(hidden.dtype)) * MASK_VALUE).expand(1, 1, s, -1)
        mask = torch.cat([cache_mask, self.window_mask[..., :s, :s].to(hidden.dtype)], dim=3)  # (1,1,S,T+S)
        sliding = {}
        if self.windowed:
            keep = sliding_keep(self.cfg, position, pos.view(1, 1, -1, 1), self.cache_positions, self.ring)  # (1,1,S,T|R)
            sliding[N.SLIDING_MASK] = torch.cat([(1.0 - keep.to(hidden.dtype)) * MASK_VALUE,
                                                 self.sliding_window_mask[..., :s, :s].to(hidden.dtype)], dim=3)
        return ((hidden, rope[N.COS], rope[N.SIN], mask) + _extras(self.cfg, rope, sliding)
                + _per_layer(self, input_ids, hidden))


def build_embeddings(g: Graph, cfg: LlamaConfig, io: dict, rows: tuple[int, int]):
    """Embeddings, masking the cache positions of the function's context bucket; a function taking
    `positions` (S,) (WindowEmbeddings) makes the RoPE rows of those and no masks."""
    def body(inputs):
        s = shape_of(io, N.INPUT_IDS)[1]
        if N.POSITIONS in inputs:
            hidden = lookup_mil(g, inputs[N.INPUT_IDS], rows, cfg.vocab_size, cfg.embedding_scale)
            out = {N.HIDDEN_STATES: hidden, **_rope_rows_mil(g, cfg, inputs[N.POSITIONS], s)}
            if cfg.per_layer_input_size:
                out[N.PER_LAYER_INPUTS] = per_layer_inputs_mil(g, cfg, inputs[N.INPUT_IDS], hidden, s, rows)
            return out
        mask = shape_of(io, N.MASK, "outputs")
        t = mask[3] - mask[2]
        hidden = lookup_mil(g, inputs[N.INPUT_IDS], rows, cfg.vocab_size, cfg.embedding_scale)
        pos = mb.add(x=inputs[N.POSITION], y=np.arange(s, dtype=np.int32))  # (S,)
        rope = _rope_rows_mil(g, cfg, pos, s)
        cache_mask = _cache_mask_mil(g, inputs[N.POSITION], t)
        if s > 1:
            cache_mask = mb.tile(x=cache_mask, reps=[1, 1, s, 1])
        mask = mb.concat(values=[cache_mask, g.const(window_mask(s), "window_mask")], axis=3)
        out = {N.HIDDEN_STATES: hidden, **rope, N.MASK: mask}
        if _outputs(io, N.SLIDING_MASK):
            sliding = _sliding_cache_mask_mil(g, cfg, inputs[N.POSITION], pos, t, s, _ring_of(io, N.SLIDING_MASK, t))
            out[N.SLIDING_MASK] = mb.concat(
                values=[sliding, g.const(window_mask(s, cfg.sliding_window), "sliding_window_mask")], axis=3)
        if cfg.per_layer_input_size:
            out[N.PER_LAYER_INPUTS] = per_layer_inputs_mil(g, cfg, inputs[N.INPUT_IDS], hidden, s, rows)
        return out
    return body


class WindowEmbeddings(Embeddings):
    """Token lookup and the RoPE rows of a window whose queries sit at `positions` (S,) int32, any
    positions (a cascade step's rows share theirs); the host makes its masks (runtime/masks.py).

    input_ids (1,S) int32, positions (S,) int32 -> hidden_states (1,C,1,S), cos/sin (1,D,1,S)
    (and the local tables, and per-layer inputs, where the family has them)."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor):
        hidden = lookup(self.embed_tokens, input_ids, 0, self.vocab_size, self.embedding_scale)  # (1,C,1,S)
        rope = _rope_rows(self.cfg, self.cos_table, self.sin_table, positions[:input_ids.shape[1]], hidden.dtype)
        return (hidden, rope[N.COS], rope[N.SIN]) + _extras(self.cfg, rope, {}) + _per_layer(self, input_ids, hidden)


class EmbeddingsPart(nn.Module):
    """A later file of an embedding table cut by rows: adds the lookup of vocabulary rows
    start .. start+rows-1 to the hidden states of the files before it.

    input_ids (1,S) int32, hidden_states (1,C,1,S) -> hidden_states_out (1,C,1,S)

    Gemma 4's (`per_layer`, a PerLayerInputs of the same rows): also per_layer_inputs (1,L*P,1,S),
    the files before it's lookup of the per-layer table -> per_layer_inputs_out, with its rows
    added, and in the last file the per-layer inputs themselves.
    """

    def __init__(self, cfg: LlamaConfig, start: int, rows: int):
        super().__init__()
        self.start, self.vocab_size, self.embedding_scale = start, cfg.vocab_size, cfg.embedding_scale
        self.embed_tokens = nn.Embedding(rows, cfg.hidden_size)
        self.per_layer = None  # PerLayerInputs of its rows where the model has them

    def forward(self, input_ids: torch.Tensor, hidden_states: torch.Tensor,
                per_layer_inputs: torch.Tensor | None = None):
        hidden = hidden_states + lookup(self.embed_tokens, input_ids, self.start, self.vocab_size,
                                        self.embedding_scale)
        if self.per_layer is None:
            return hidden
        return hidden, self.per_layer(input_ids, hidden, per_layer_inputs)


def build_embeddings_part(g: Graph, cfg: LlamaConfig, rows: tuple[int, int]):
    """EmbeddingsPart of vocabulary rows `rows`."""
    def body(inputs):
        hidden = mb.add(x=inputs[N.HIDDEN_STATES],
                        y=lookup_mil(g, inputs[N.INPUT_IDS], rows, cfg.vocab_size, cfg.embedding_scale))
        out = {N.HIDDEN_STATES_OUT: hidden}
        if cfg.per_layer_input_size:
            tokens = inputs[N.PER_LAYER_INPUTS]
            found = per_layer_inputs_mil(g, cfg, inputs[N.INPUT_IDS], hidden, int(hidden.shape[3]), rows, tokens)
            out[N.PER_LAYER_INPUTS_OUT] = mb.identity(x=found) if found is tokens else found
        return out
    return body


class BranchEmbeddings(nn.Module):
    """Token lookup, per-branch RoPE, and the prefix and suffix masks for B branch tokens (the
    cascade's "decode_branches"); `positions[b] - prefix_length` suffix tokens of branch b are cached."""

    def __init__(self, cfg: LlamaConfig, embed_tokens: nn.Embedding, context_length: int, branches: int,
                 suffix_length: int, ring: int = 0):
        super().__init__()
        self.embed_tokens = embed_tokens  # all of the vocabulary, or its first rows (see Embeddings)
        self.vocab_size, self.embedding_scale = cfg.vocab_size, cfg.embedding_scale
        self.cfg, self.windowed, self.ring = cfg, cfg.windowed(context_length), ring
        cos, sin = stored_rope_tables(cfg, context_length + suffix_length + 1, context_length)
        self.register_buffer("cos_table", cos)
        self.register_buffer("sin_table", sin)
        self.register_buffer("prefix_slots", torch.arange(context_length, dtype=torch.int32).view(1, 1, 1, -1))
        self.register_buffer("suffix_slots", torch.arange(suffix_length, dtype=torch.int32).view(1, 1, 1, -1))
        self.register_buffer("self_column", torch.zeros(1, branches, 1, 1))
        self.per_layer = None  # as Embeddings'

    def forward(self, input_ids, positions, prefix_length):
        hidden = lookup(self.embed_tokens, input_ids, 0, self.vocab_size, self.embedding_scale)  # (1,C,1,B)
        rope = _rope_rows(self.cfg, self.cos_table, self.sin_table, positions, hidden.dtype)  # (1,D,1,B)
        in_prefix = self.prefix_slots < prefix_length.view(1, 1, 1, 1)
        prefix_mask = (1.0 - in_prefix.to(hidden.dtype)) * MASK_VALUE  # (1,1,1,T)
        filled = (positions - prefix_length).view(1, -1, 1, 1)  # suffix tokens each branch has cached
        in_suffix = self.suffix_slots < filled  # (1,B,1,U)
        own = self.self_column.to(hidden.dtype)
        suffix_mask = torch.cat([(1.0 - in_suffix.to(hidden.dtype)) * MASK_VALUE, own], dim=3)
        sliding = {}
        if self.windowed:  # each branch's query at positions[b]; suffix slot u at prefix_length + u
            w = self.cfg.sliding_window
            # (1,1,B,T), or over the ring (1,1,B,R): a suffix long enough pushes prefix positions out
            # of a branch's window, and its query's position hides them like any other
            keep = sliding_keep(self.cfg, prefix_length, positions.view(1, 1, -1, 1), self.prefix_slots, self.ring)
            sliding[N.SLIDING_PREFIX_MASK] = (1.0 - keep.to(hidden.dtype)) * MASK_VALUE
            keep = in_suffix & near(filled, self.suffix_slots, w)  # (1,B,1,U)
            sliding[N.SLIDING_SUFFIX_MASK] = torch.cat([(1.0 - keep.to(hidden.dtype)) * MASK_VALUE, own], dim=3)
        return ((hidden, rope[N.COS], rope[N.SIN], prefix_mask, suffix_mask) + _extras(self.cfg, rope, sliding)
                + _per_layer(self, input_ids, hidden))


def build_branch_embeddings(g: Graph, cfg: LlamaConfig, io: dict, context_length: int, suffix_length: int,
                            rows: tuple[int, int]):
    """BranchEmbeddings."""
    def body(inputs):
        b = shape_of(io, N.INPUT_IDS)[1]
        t, u = context_length, suffix_length
        hidden = lookup_mil(g, inputs[N.INPUT_IDS], rows, cfg.vocab_size, cfg.embedding_scale)
        rope = _rope_rows_mil(g, cfg, inputs[N.POSITIONS], b)
        plen = mb.reshape(x=inputs[N.PREFIX_LENGTH], shape=[1, 1, 1, 1])
        prefix_slots, suffix_slots = (np.arange(n, dtype=np.int32).reshape(1, 1, 1, n) for n in (t, u))
        in_prefix = mb.less(x=prefix_slots, y=plen)  # (1,1,1,T)
        filled = mb.reshape(x=mb.sub(x=inputs[N.POSITIONS], y=inputs[N.PREFIX_LENGTH]), shape=[1, b, 1, 1])
        in_suffix = mb.less(x=suffix_slots, y=filled)  # (1,B,1,U)
        own = g.const(np.zeros((1, b, 1, 1)), "self_column")
        out = {N.HIDDEN_STATES: hidden, **rope, N.PREFIX_MASK: mask_from_mil(g, in_prefix),
               N.SUFFIX_MASK: mb.concat(values=[mask_from_mil(g, in_suffix), own], axis=3)}
        if _outputs(io, N.SLIDING_PREFIX_MASK):
            w = cfg.sliding_window
            query = mb.reshape(x=inputs[N.POSITIONS], shape=[1, 1, b, 1])
            ring = _ring_of(io, N.SLIDING_PREFIX_MASK, t)
            out[N.SLIDING_PREFIX_MASK] = mask_from_mil(g, sliding_keep_mil(
                cfg, inputs[N.PREFIX_LENGTH], query, t, ring))  # (1,1,B,T) or (1,1,B,R)
            keep = mb.logical_and(x=in_suffix, y=near_mil(filled, suffix_slots, w))  # (1,B,1,U)
            out[N.SLIDING_SUFFIX_MASK] = mb.concat(values=[mask_from_mil(g, keep), own], axis=3)
        if cfg.per_layer_input_size:
            out[N.PER_LAYER_INPUTS] = per_layer_inputs_mil(g, cfg, inputs[N.INPUT_IDS], hidden, b, rows)
        return out
    return body


class VerifyEmbeddings(nn.Module):
    """Token lookup, RoPE rows at each token's tree position, and the cache + tree mask (the
    "verify" function of speculative decoding; see chunk.py)."""

    def __init__(self, cfg: LlamaConfig, embed_tokens: nn.Embedding, context_length: int, window: int,
                 ring: int = 0):
        super().__init__()
        self.embed_tokens = embed_tokens  # all of the vocabulary, or its first rows (see Embeddings)
        self.vocab_size, self.embedding_scale = cfg.vocab_size, cfg.embedding_scale
        self.cfg, self.windowed, self.ring = cfg, cfg.windowed(context_length), ring
        cos, sin = stored_rope_tables(cfg, context_length + window, context_length)
        self.register_buffer("cos_table", cos)
        self.register_buffer("sin_table", sin)
        self.register_buffer("cache_positions", torch.arange(context_length, dtype=torch.int32).view(1, 1, 1, -1))
        self.per_layer = None  # as Embeddings'

    def forward(self, input_ids, position, depths, tree_mask):
        """The window may hold fewer than W tokens when run eagerly (the torch backend): every
        size is read from the inputs."""
        hidden = lookup(self.embed_tokens, input_ids, 0, self.vocab_size, self.embedding_scale)  # (1,C,1,W)
        pos = position + depths  # (W,)
        rope = _rope_rows(self.cfg, self.cos_table, self.sin_table, pos, hidden.dtype)  # (1,D,1,W)
        cached = self.cache_positions < position.view(1, 1, 1, 1)  # (1,1,1,T)
        cache_mask = ((1.0 - cached.to(hidden.dtype)) * MASK_VALUE).expand(1, 1, tree_mask.shape[2], -1)
        tree = tree_mask.to(hidden.dtype)
        mask = torch.cat([cache_mask, tree], dim=3)  # (1,1,W,T+W)
        sliding = {}
        if self.windowed:  # a tree token at depth d sits at position + d
            w = self.cfg.sliding_window
            keep = sliding_keep(self.cfg, position, pos.view(1, 1, -1, 1), self.cache_positions, self.ring)  # (1,1,W,T|R)
            far = (1.0 - near(depths.view(1, 1, -1, 1), depths.view(1, 1, 1, -1), w).to(hidden.dtype)) * MASK_VALUE
            sliding[N.SLIDING_MASK] = torch.cat([(1.0 - keep.to(hidden.dtype)) * MASK_VALUE, tree + far], dim=3)
        return ((hidden, rope[N.COS], rope[N.SIN], mask) + _extras(self.cfg, rope, sliding)
                + _per_layer(self, input_ids, hidden))


def build_verify_embeddings(g: Graph, cfg: LlamaConfig, io: dict, context_length: int, rows: tuple[int, int]):
    """VerifyEmbeddings."""
    def body(inputs):
        w = shape_of(io, N.INPUT_IDS)[1]
        hidden = lookup_mil(g, inputs[N.INPUT_IDS], rows, cfg.vocab_size, cfg.embedding_scale)
        pos = mb.add(x=inputs[N.POSITION], y=inputs[N.DEPTHS])  # (W,)
        rope = _rope_rows_mil(g, cfg, pos, w)
        cache_mask = mb.tile(x=_cache_mask_mil(g, inputs[N.POSITION], context_length), reps=[1, 1, w, 1])
        out = {N.HIDDEN_STATES: hidden, **rope, N.MASK: mb.concat(values=[cache_mask, inputs[N.TREE_MASK]], axis=3)}
        if _outputs(io, N.SLIDING_MASK):
            sliding = _sliding_cache_mask_mil(g, cfg, inputs[N.POSITION], pos, context_length, w,
                                              _ring_of(io, N.SLIDING_MASK, context_length))
            depths = inputs[N.DEPTHS]
            near_tree = near_mil(mb.reshape(x=depths, shape=[1, 1, w, 1]), mb.reshape(x=depths, shape=[1, 1, 1, w]),
                                 cfg.sliding_window)
            tree = mb.add(x=inputs[N.TREE_MASK], y=mask_from_mil(g, near_tree))
            out[N.SLIDING_MASK] = mb.concat(values=[sliding, tree], axis=3)
        if cfg.per_layer_input_size:
            out[N.PER_LAYER_INPUTS] = per_layer_inputs_mil(g, cfg, inputs[N.INPUT_IDS], hidden, w, rows)
        return out
    return body


def functions(cfg: LlamaConfig, layout: Layout) -> dict[str, dict]:
    """{function: io} of the (first) embeddings file: a window function per bucket, then the
    cascade's and verify's."""
    c, d, f = cfg.hidden_size, cfg.global_layers.head_dim, layout.dtype
    out = {}
    for fn, _, s, t in layout.windows():
        if layout.host_masks:  # positions in, no masks out: the host makes them (runtime/masks.py)
            out[fn] = {"inputs": [tensor(N.INPUT_IDS, [1, s], "int32"), tensor(N.POSITIONS, [s], "int32")],
                       "outputs": [tensor(N.HIDDEN_STATES, [1, c, 1, s], f), tensor(N.COS, [1, d, 1, s], f),
                                   tensor(N.SIN, [1, d, 1, s], f)]
                       + layer_inputs(cfg, layout, {}, s) + _per_layer_output(cfg, layout, s)}
            continue
        out[fn] = {
            "inputs": [tensor(N.INPUT_IDS, [1, s], "int32"), tensor(N.POSITION, [1], "int32")],
            "outputs": [tensor(N.HIDDEN_STATES, [1, c, 1, s], f), tensor(N.COS, [1, d, 1, s], f),
                        tensor(N.SIN, [1, d, 1, s], f), tensor(N.MASK, [1, 1, s, t + s], f)]
            + layer_inputs(cfg, layout, window_masks(layout, s, t), s) + _per_layer_output(cfg, layout, s),
        }
    t, b, u, w = layout.context_length, layout.branch_width, layout.suffix_length, layout.verify_window
    if b and not layout.window_cascade:
        out[BRANCHES] = {
            "inputs": [tensor(N.INPUT_IDS, [1, b], "int32"), tensor(N.POSITIONS, [b], "int32"),
                       tensor(N.PREFIX_LENGTH, [1], "int32")],
            "outputs": [tensor(N.HIDDEN_STATES, [1, c, 1, b], f), tensor(N.COS, [1, d, 1, b], f),
                        tensor(N.SIN, [1, d, 1, b], f), tensor(N.PREFIX_MASK, [1, 1, 1, t], f),
                        tensor(N.SUFFIX_MASK, [1, b, 1, u + 1], f)] + layer_inputs(cfg, layout, branch_masks(layout), b)
            + _per_layer_output(cfg, layout, b),
        }
    if w:
        out[VERIFY] = {
            "inputs": [tensor(N.INPUT_IDS, [1, w], "int32"), tensor(N.POSITION, [1], "int32"),
                       tensor(N.DEPTHS, [w], "int32"), tensor(N.TREE_MASK, [1, 1, w, w], f)],
            "outputs": [tensor(N.HIDDEN_STATES, [1, c, 1, w], f), tensor(N.COS, [1, d, 1, w], f),
                        tensor(N.SIN, [1, d, 1, w], f), tensor(N.MASK, [1, 1, w, t + w], f)]
            + layer_inputs(cfg, layout, window_masks(layout, w, t), w) + _per_layer_output(cfg, layout, w),
        }
    return out


def part_functions(cfg: LlamaConfig, layout: Layout) -> dict[str, dict]:
    """{function: io} of a later embeddings file: input_ids (1,S) and the hidden states so far ->
    hidden_states_out (1,C,1,S), one function for every bucket (it reads no cache); Gemma 4's also
    per_layer_inputs (1,L*P,1,S) so far -> per_layer_inputs_out."""
    c, f = cfg.hidden_size, layout.dtype
    out = {}
    for fn, s in (*layout.full_windows(), *layout.extra_windows()):
        out[fn] = {"inputs": [tensor(N.INPUT_IDS, [1, s], "int32"), tensor(N.HIDDEN_STATES, [1, c, 1, s], f)],
                   "outputs": [tensor(N.HIDDEN_STATES_OUT, [1, c, 1, s], f)]}
        if cfg.per_layer_input_size:
            out[fn]["inputs"].append(tensor(N.PER_LAYER_INPUTS, [1, cfg.per_layer_channels, 1, s], f))
            out[fn]["outputs"].append(tensor(N.PER_LAYER_INPUTS_OUT, [1, cfg.per_layer_channels, 1, s], f))
    return out


def program(g: Graph, cfg: LlamaConfig, function: str, io: dict, site: Site):
    """The MIL builder of the first embeddings file's `function` (model.kinds)."""
    if function == BRANCHES:
        return build_branch_embeddings(g, cfg, io, site.context_length, site.suffix_length, site.rows)
    if function == VERIFY:
        return build_verify_embeddings(g, cfg, io, site.context_length, site.rows)
    return build_embeddings(g, cfg, io, site.rows)


def part_program(g: Graph, cfg: LlamaConfig, function: str, io: dict, site: Site):
    """The MIL builder of a later embeddings file's functions (model.kinds)."""
    return build_embeddings_part(g, cfg, site.rows)


def _table(weights, model: str, cfg: LlamaConfig, site: Site, dtype: torch.dtype) -> tuple[nn.Embedding, nn.Module | None]:
    """An embeddings file's rows of the table, and Gemma 4's per-layer inputs of those rows (one
    module for every function; the last file projects the whole embedding), or None."""
    start, end = site.rows
    table = nn.Embedding.from_pretrained(weights.table(model, (start, end), dtype), freeze=False)
    if not cfg.per_layer_input_size:
        return table, None
    last = end == cfg.vocab_size
    return table, with_state(lambda: PerLayerInputs(cfg, (start, end), last),
                             weights.per_layer(model, (start, end), last, dtype))


def modules(weights, model: str, cfg: LlamaConfig, functions: dict[str, dict], site: Site,
            dtype: torch.dtype) -> dict[str, nn.Module]:
    """The torch modules of the first embeddings file, {function: module}, each following its
    specs `functions[function]`, with `weights`' table (runtime.backends.torch_modules)."""
    table, per_layer = _table(weights, model, cfg, site, dtype)
    out: dict[str, nn.Module] = {}
    for fn, io in functions.items():
        if fn == BRANCHES:
            out[fn] = BranchEmbeddings(cfg, table, site.context_length, site.branch_width, site.suffix_length,
                                       site.ring)
        elif fn == VERIFY:
            out[fn] = VerifyEmbeddings(cfg, table, site.context_length, site.verify_window, site.ring)
        else:  # a one-row placeholder table, replaced by the shared one
            sliding = any(o["name"] == N.SLIDING_MASK for o in io["outputs"])
            kind = WindowEmbeddings if any(i["name"] == N.POSITIONS for i in io["inputs"]) else Embeddings
            e = kind(cfg, bucket_of(fn, site.context_length), window_of(fn, site.prefill_length), rows=1,
                     windowed=sliding, ring=site.ring)
            e.embed_tokens = table
            out[fn] = e
    stored = weights.rope(model)
    for module in out.values():
        if stored is not None:  # the tables the export holds (one size for every function)
            module.cos_table, module.sin_table = stored
        module.per_layer = per_layer
    return out


def part_modules(weights, model: str, cfg: LlamaConfig, functions: dict[str, dict], site: Site,
                 dtype: torch.dtype) -> dict[str, nn.Module]:
    """The torch module of a later embeddings file, for each of its functions."""
    table, per_layer = _table(weights, model, cfg, site, dtype)
    part = EmbeddingsPart(cfg, site.rows[0], 1)
    part.embed_tokens = table  # the one-row placeholder replaced by the part's rows
    part.per_layer = per_layer
    return {fn: part for fn in functions}
