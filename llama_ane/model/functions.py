"""The functions of the exported models: their names, and the sizes their tensor specs follow.

Every kind (embeddings.py, chunk.py, lm_head.py, cache_update.py) declares the inputs, outputs and
states of each of its functions from a `Layout`; `contract.specs.model_specs` collects them for the
manifest, which every consumer reads them back from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

from . import names as N

if TYPE_CHECKING:
    from ..config import LlamaConfig

# "prefill" runs the prefill window, "decode" one token, "decode_branches" one token for each of B
# branches over a shared prefix (cascade). Cache-update functions are named after these.
FUNCTIONS = ("prefill", "decode")
BRANCHES = "decode_branches"
# "verify" checks a tree of W drafted tokens in one window (speculative decoding, see chunk.py)
VERIFY = "verify"
# What decodes a token (manifest "decode_function", export --decode-function): "decode", functions of
# its own, or "prefill": no decode functions, a token runs as a prefill window of one real token (the
# padding's K/V lies past it, masked until overwritten, as a short last prefill window's does), so a
# model keeps one function per bucket and the Neural Engine one copy of its weights. Such an export's
# windows take their positions (S,) and their masks from the host (runtime/masks.py), so that the same
# function also runs a cascade step: B branches' tokens as B rows of one window (`cascades_in_window`).
DECODE_FUNCTIONS = ("decode", "prefill")

# How the chunks' K/V caches live (manifest "cache"."kind"): "inputs" are arrays passed in and a
# cache-update model writes each window's K/V back; "state" caches are Core ML states (iOS18,
# macOS15) that the chunk functions update themselves by a slice update at `position`.
KV_CACHE_KINDS = ("inputs", "state")

# A chunk's caches by name, each with the name of the window's new K/V it is written from: the
# full layers' (context-long) and, where the export has a ring, the sliding layers' (ring-long).
# The conv layers' state (LFM2's short convolutions: the last K-1 values each convolves over) is
# carried the same way, with the window's values it is taken from (layers.short_conv.conv_state_after);
# Qwen3.5's linear-attention layers' recurrent state with the state after the window (layers.delta_net).
CACHES = {**{N.cache(key): N.new(key) for key in N.KV_STEMS},
          **{c.state: c.new for c in N.CARRIED}}
RING_CACHES = N.RINGS
# The real tokens of a window (1,) int32, which a chunk writing its conv state itself (state caches)
# takes the state at: a padded prefill window's last ones are not the window's end.
WINDOW_TOKENS = N.WINDOW_TOKENS
# Qwen3.5's linear-attention layers' recurrent state (layers.delta_net): as a chunk's input or state,
# after the window, and each cascade branch's
DELTA_STATE, DELTA_NEW, DELTA_BRANCHES = N.DELTA_STATE, N.DELTA_NEW, N.DELTA_BRANCHES


def model_kind(model: str) -> str:
    """What a manifest model computes: "embeddings" (lookup of the first rows, RoPE, masks),
    "embeddings_part" (lookup of later rows, added to the hidden states), "chunk", "lm_head" or
    "cache_update"."""
    if model == "embeddings":
        return "embeddings"
    if model.startswith("embeddings_"):
        return "embeddings_part"
    if model.startswith("chunk_"):
        return "chunk"
    if model == "lm_head" or model.startswith("lm_head_"):
        return "lm_head"
    if model == "cache_update":
        return "cache_update"
    raise ValueError(f"no model kind for {model!r}")


@dataclass(frozen=True)
class Site:
    """Where a model sits in its export: what its functions are built with besides the config and
    their specs (the exporter's programs and the torch backend's modules alike, `model.kinds`)."""

    context_length: int
    prefill_length: int = 0
    suffix_length: int = 0
    branch_width: int = 0
    verify_window: int = 0
    ring: int = 0
    layers: tuple[int, ...] = ()  # a chunk's decoder layers
    rows: tuple[int, int] | None = None  # an embeddings file's vocabulary rows [start, end)
    head: bool = False  # a chunk that carries the LM head (--fold-lm-head)


def squarings(s: int) -> int:
    """How many factors (I + N^(2^i)) the delta rule's inverse over a window of S tokens needs: N^S = 0
    (layers.delta_net)."""
    return math.ceil(math.log2(s)) if s > 1 else 0


def delta_span(beta_scale: float) -> int:
    """Tokens per span of the delta rule's chunked form where beta is scaled by `beta_scale`
    (layers.delta_net.DeltaShape.span): SPAN where beta reaches past 1, else 0 (a window is one span)."""
    return SPAN if beta_scale > 1 else 0


SPAN = 4  # tokens per span of the delta rule where beta reaches 2 (layers.delta_net.DeltaShape.span)


def per_layer_rows(cfg: "LlamaConfig", rows: tuple[int, int]) -> tuple[int, int]:
    """[start, end) rows of Gemma 4's per-layer table in the embeddings file of vocabulary rows
    `rows`: the same rows, those the table has (it may have fewer than the vocabulary); a file of the
    whole vocabulary holds the whole table."""
    vp = cfg.per_layer_vocab_size
    if tuple(rows) == (0, cfg.vocab_size):
        return 0, vp
    return min(rows[0], vp), min(rows[1], vp)


def bucket_function(function: str, bucket: int, context_length: int) -> str:
    """Name of "prefill" or "decode" at context bucket `bucket` (the cache positions it reads): the
    plain name at the full context, else e.g. "decode_512". Only the models whose shapes hold the
    cache length (the embeddings' masks, the chunks, the cache updates) have bucketed functions; the
    LM head and the later embedding files run their plain function in every bucket."""
    return function if bucket == context_length else f"{function}_{bucket}"


def bucket_of(function: str, context_length: int) -> int:
    """The context bucket of a prefill or decode function named by `bucket_function`, or of its
    cache update (`cache_update_function`: "decode_512_l3", "decode_512_l1_r2")."""
    base, _, ring = function.rpartition("_r")
    if ring.isdigit() and "_l" in base:
        function = base
    base, _, layers = function.rpartition("_l")
    name = base if layers.isdigit() else function
    return int(name.rpartition("_")[2]) if base_function(name) != name else context_length


def base_function(function: str) -> str:
    """The function a bucketed one is a copy of ("decode_512" -> "decode"); others unchanged."""
    base, _, size = function.rpartition("_")
    return base if size.isdigit() and base in FUNCTIONS else function


def window_of(function: str, prefill_length: int) -> int:
    """Query length S of a prefill or decode function: the prefill window, or 1."""
    return prefill_length if function.startswith("prefill") else 1


def cache_update_function(function: str, layers: int, ring_layers: int = 0) -> str:
    """Name of the cache-update function for a chunk of `layers` layers in the full cache and
    `ring_layers` in the ring, e.g. "decode_l3", or "decode_l1_r2" where the chunk has a ring."""
    return f"{function}_l{layers}" + (f"_r{ring_layers}" if ring_layers else "")


def ring_length(cfg: "LlamaConfig", context_length: int, prefill_length: int) -> int:
    """Slots of the sliding layers' ring buffer, or 0 where they keep the full cache.

    Position p lives in slot p mod R. R holds the window plus a prefill window less one, so that
    a padded window's writes past its real tokens (a program writes all S columns) land only on
    slots whose positions no later query can see: a query at q >= p + n (n real tokens) sees
    positions > q - window, and the padding at p + s (s < S) overwrites position p + s - R <=
    q - window. Rounded up to CACHE_MULTIPLE. No ring where the window covers the context, or
    where the ring would not be shorter than the context.
    """
    from ..limits import CACHE_MULTIPLE

    if not cfg.windowed(context_length):
        return 0
    need = cfg.sliding_window + prefill_length - 1
    r = -(-need // CACHE_MULTIPLE) * CACHE_MULTIPLE
    return r if r < context_length else 0


def ring_rewind_limit(cfg: "LlamaConfig", ring: int, prefill_length: int) -> int:
    """How many cached tokens a ring of `ring` slots can forget and still serve the ones it keeps:
    the slots of forgotten positions (and of a window's padding after them) must lie outside the
    window of every later query. Rewinding further must start again from an empty cache."""
    return ring - cfg.sliding_window - prefill_length + 2


def chunk_rows(cfg: "LlamaConfig", layers: list[int], ring: int) -> tuple[list[int], list[int]]:
    """The chunk-local indices of decoder layers `layers` kept in the full cache and in the ring
    (the sliding layers, where the export has a ring: `ring` > 0); conv layers keep no K/V."""
    sliding = [i for i, n in enumerate(layers) if ring and cfg.slides(n) and not cfg.shares_kv(n)]
    return [i for i, n in enumerate(layers) if i not in sliding and cfg.attends(n) and not cfg.shares_kv(n)], \
        sliding


def shared_rows(cfg: "LlamaConfig", layers: list[int], ring: int) -> tuple[list[int], list[int]]:
    """The layers (model indices) outside a chunk of decoder layers `layers` whose K/V its KV-shared
    layers attend over (LlamaConfig.kv_producer): those kept in the full cache, those in the ring."""
    producers = sorted({cfg.kv_producer(n) for n in layers if cfg.shares_kv(n)} - set(layers))
    in_ring = [p for p in producers if ring and cfg.slides(p)]
    return [p for p in producers if p not in in_ring], in_ring


def conv_state_width(cfg: "LlamaConfig") -> int:
    """Columns of a conv layer's state as exports keep it: its K-1 values, right-aligned in a multiple
    of CACHE_MULTIPLE (see layers.short_conv)."""
    from ..limits import CACHE_MULTIPLE

    return -(-(cfg.conv_kernel - 1) // CACHE_MULTIPLE) * CACHE_MULTIPLE


def attention_rows(cfg: "LlamaConfig", layers: list[int]) -> list[int]:
    """The chunk-local indices of the attention layers among decoder layers `layers` (all but the
    conv layers and the KV-shared ones, which keep no K/V): their rows in the cascade's suffix caches."""
    return [i for i, n in enumerate(layers) if cfg.attends(n) and not cfg.shares_kv(n)]


def suffix_groups(cfg: "LlamaConfig", layers: list[int], ring: int) -> list[tuple[str, list[int], "LlamaConfig"]]:
    """The cascade's suffix caches of a chunk of decoder layers `layers`: (key, chunk-local rows,
    their layers' config) per pair. Key "k" names k_suffix/v_suffix and the branches' k_new/v_new,
    "k_ring" k_ring_suffix/v_ring_suffix and k_ring_new/v_ring_new. One pair of every attention
    layer, but where the global layers are wider than the sliding ones (LlamaConfig.wide_global,
    always with a ring): the global layers' pair, then the ring layers'."""
    if not cfg.wide_global:
        rows = attention_rows(cfg, layers)
        return [(N.kv("k"), rows, cfg)] if rows else []
    full, sliding = chunk_rows(cfg, layers, ring)
    return [(key, rows, at) for key, rows, at in ((N.kv("k"), full, cfg.global_layers), (N.kv("k", True), sliding, cfg))
            if rows]


def suffix_names(key: str) -> tuple[str, str, str, str]:
    """k_suffix, v_suffix, k_new, v_new of suffix_groups' `key` ("k" or "k_ring")."""
    v = N.kv("v", N.is_ring(key))
    return N.suffix(key), N.suffix(v), N.new(key), N.new(v)


def suffix_update_counts(cfg: "LlamaConfig", layers: list[int], ring: int) -> tuple[int, int]:
    """The layer counts a chunk's cascade suffix update is named by (cache_update_function): its
    attention layers', or (wide global layers) its global layers' and its ring layers'."""
    if not cfg.wide_global:
        return len(attention_rows(cfg, layers)), 0
    return tuple(len(rows) for rows in chunk_rows(cfg, layers, ring))


def conv_rows(cfg: "LlamaConfig", layers: list[int]) -> list[int]:
    """The chunk-local indices of the conv layers among decoder layers `layers`: their rows in the
    chunk's conv state."""
    return [i for i, n in enumerate(layers) if cfg.convolves(n)]


def tensor(name: str, shape: list[int], dtype: str) -> dict:
    """One tensor spec as the manifest records it."""
    return {"name": name, "shape": list(shape), "dtype": dtype}


def shape_of(io: dict, name: str, where: str = "inputs") -> list[int]:
    """The shape of tensor `name` among a function's `where` ("inputs", "outputs" or "states")."""
    return next(t["shape"] for t in io[where] if t["name"] == name)


@dataclass(frozen=True)
class Layout:
    """The sizes every function's tensors follow.

    T = `context_length`, the prefill window `prefill_length`; `dtype` is the manifest's float
    dtype ("float16"); `buckets` the context buckets (ascending, the last T; empty: T alone);
    B = `branch_width` branches of up to U = `suffix_length` tokens (0: no cascade); W =
    `verify_window` (0: no verify function); `kv_cache` one of KV_CACHE_KINDS.
    """

    context_length: int
    prefill_length: int
    dtype: str
    buckets: tuple[int, ...] = ()
    branch_width: int = 0
    suffix_length: int = 0
    verify_window: int = 0
    kv_cache: str = "inputs"
    ring: int = 0  # slots of the sliding layers' ring buffer (ring_length), 0: none
    decode_function: str = "decode"  # one of DECODE_FUNCTIONS: "prefill" leaves the decode functions out
    window_cascade: bool = False  # the cascade steps through the prefill window (cascades_in_window)

    @property
    def host_masks(self) -> bool:
        """The windows take positions (S,) and their masks from the host: where the prefill window decodes."""
        return self.decode_function == "prefill"

    @property
    def state_length(self) -> int:
        """Columns of a context-long state cache (`state_length`)."""
        return state_length(self.context_length, self.prefill_length, self.kv_cache, self.decode_function)

    def windows(self) -> Iterator[tuple[str, str, int, int]]:
        """(function, its base function, S, T) of every prefill and decode function: per bucket,
        prefill then decode (none where the prefill function decodes), smallest bucket first."""
        bases = FUNCTIONS if self.decode_function == "decode" else ("prefill",)
        for t in self.buckets or (self.context_length,):
            for base in bases:
                yield bucket_function(base, t, self.context_length), base, window_of(base, self.prefill_length), t

    def full_windows(self) -> Iterator[tuple[str, int]]:
        """(function, S) of the prefill and decode functions at the full context, which the models
        without a cache length (the LM head, later embedding files) run in every bucket."""
        for fn, base, s, _ in self.windows():
            if fn == base:
                yield fn, s

    def extra_windows(self) -> Iterator[tuple[str, int]]:
        """(function, S) of the cascade and verify functions of this export, in that order."""
        if self.branch_width and not self.window_cascade:
            yield BRANCHES, self.branch_width
        if self.verify_window:
            yield VERIFY, self.verify_window


def state_length(context_length: int, prefill_length: int, kv_cache: str, decode_function: str) -> int:
    """Columns of a context-long state cache: the context, and where a token runs the prefill window,
    that window less one more (rounded up to CACHE_MULTIPLE): a window at the context's last position
    writes its padding too. The functions read the first columns of their bucket only."""
    from ..limits import CACHE_MULTIPLE

    if kv_cache != "state" or decode_function != "prefill":
        return context_length
    return context_length + -(-(prefill_length - 1) // CACHE_MULTIPLE) * CACHE_MULTIPLE


def cascades_in_window(cfg: "LlamaConfig", decode_function: str, branch_width: int, ring: int,
                       prefill_length: int) -> bool:
    """Whether a cascade step runs as the prefill window (no "decode_branches" functions): where the
    prefill window decodes, the export has a cascade whose B branches fit in the window as its rows,
    and every layer attends over the one cache.
    Each branch's tokens then go to that cache, the branches' interleaved after the shared prefix,
    and each row's mask shows it the prefix and its own branch. Conv and linear-attention layers
    (their states run along the window's rows), a ring (its slots follow positions) and KV-shared
    layers keep the cascade function."""
    return (decode_function == "prefill" and 0 < branch_width <= prefill_length and not ring and not cfg.conv_layers
            and not cfg.recurrent_layers and not cfg.kv_shared_layers)


def window_masks(layout: Layout, s: int, t: int) -> dict[str, list[int]]:
    """The sliding twin's shape of the mask of a window of S queries over T cache positions: over
    the ring's slots where the export has one."""
    return {N.MASK: [1, 1, s, (layout.ring or t) + s]}


def layer_inputs(cfg: "LlamaConfig", layout: Layout, masks: dict[str, list[int]], s: int) -> list[dict]:
    """The inputs some layers read beyond the Llama block's, after the others, for a query of S: the
    sliding twin of each mask in `masks` (name -> the twin's shape) where the export needs one, and
    the local RoPE tables where the family has them. The embeddings output the same tensors, in
    this order."""
    f, d = layout.dtype, cfg.head_dim
    out = [tensor(f"sliding_{name}", shape, f) for name, shape in masks.items()] \
        if cfg.windowed(layout.context_length) else []
    if cfg.rope_local_theta is not None:
        out += [tensor(N.COS_LOCAL, [1, d, 1, s], f), tensor(N.SIN_LOCAL, [1, d, 1, s], f)]
    return out


def branch_masks(layout: Layout) -> dict[str, list[int]]:
    """The cascade's masks whose sliding twins its sliding layers read, with the twins' shapes: the
    prefix's per branch (1,1,B,T), or over the ring (1,1,B,R), as each branch's query sits at its
    own position, and the suffixes' (1,B,1,U+1)."""
    b, t, u = layout.branch_width, layout.ring or layout.context_length, layout.suffix_length
    return {N.PREFIX_MASK: [1, 1, b, t], N.SUFFIX_MASK: [1, b, 1, u + 1]}
