"""Bytes one step of an export moves, from the manifest alone: the weights every step reads, the
K/V the chunks read, and what writing the new K/V reads and writes.

Decode is bound by memory traffic: each token reads every chunk's weights and the LM head's once,
and, because every shape is static, each chunk reads its whole cache: all the positions of the
context bucket that runs (`bucket_for`: the smallest of the manifest's `context_buckets` holding
the filled positions, else `context_length`), masked or not. With caches passed as inputs (the
default), the cache-update model rewrites that cache through a one-hot matmul: it reads it and
writes it again. With caches in Core ML states (`--kv-cache state`) the chunk writes only the
window's columns of each state (a slice update). A cascade step ("decode_branches") reads the
prefix cache once for all branches plus every branch's whole suffix cache, and its cache update
rewrites the suffix caches. The embeddings model reads one row of its table per token.

Sliding layers with a ring buffer (manifest cache.sliding) read their whole ring of R slots in
every step and bucket, whatever the context; writing it reads and rewrites the ring (a one-hot
write: the cache-update model's, or with states the chunk's own, as a window may wrap around it).

The conv and linear-attention layers keep fixed-size states instead of K/V (LFM2's conv states,
cache.conv; Qwen3.5's recurrent states, cache.delta), read whole by every step, a cascade's
per-branch states too; what each step reads and writes of them is its layer kind's
(`layer_costs.STATE_KINDS`).

Gemma 4 adds three reads, each counted from the manifest's tensor specs by name:
  * KV-shared layers: a chunk whose layers attend over another chunk's K/V takes its producers'
    rows as inputs named "shared_" + the producer's tensor (shared_k_cache, shared_k_ring, and in
    the cascade shared_k_suffix, ...). They are cache reads of their own, a second program reading
    the same bytes, counted as their producer's tensor is (a main cache up to the bucket, a ring or
    suffix whole); writing them is the producer's cache update, counted there once.
  * per-kind widths: the global layers' cache and the sliding layers' ring have their own channels
    (cache.channels, cache.sliding.channels); every byte count here takes each tensor's own shape.
  * per-layer inputs (`per_layer_table`): every embeddings file holding rows of the per-layer table
    reads one row of it per token, and the last file reads its projection of the embedding whole;
    the per-layer inputs passed to each chunk are window tensors (`window_io_bytes`).

`device_model` turns these bytes, with the calls of a step, into modelled time per chip.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..config import LlamaConfig
from ..model import names as N
from ..model.functions import RING_CACHES, per_layer_rows
from .layer_costs import DTYPE_BYTES, STATE_KINDS, STATE_WRITES, STATES, nbytes, state_kind
from .manifest import decode_function, function_states, kv_cache_kind

MAIN_CACHES = (N.K_CACHE, N.V_CACHE)  # (layers, kv channels, 1, context): read up to the bucket that runs
SUFFIX_CACHES = (N.K_SUFFIX, N.V_SUFFIX, N.K_RING_SUFFIX, N.V_RING_SUFFIX)  # a cascade's per-branch caches: read whole
# RING_CACHES: the sliding layers' ring buffers (R slots), read whole
# STATES: the fixed-size states of the conv and linear-attention layers (layer_costs.STATE_KINDS), read whole
CACHES = MAIN_CACHES + SUFFIX_CACHES + RING_CACHES + STATES
SHARED = N.SHARED_PREFIX  # a KV-shared chunk's input of its producer's tensor: "shared_" + the producer's name


@dataclass(frozen=True)
class StepTraffic:
    """Bytes of one decode step (one token through every model)."""

    weights: int  # chunks and LM head as stored, plus one embedding row (and Gemma 4's per-layer rows and projection)
    weights_dense: int  # the same weights decompressed (what a device that decompresses at load reads)
    cache_read: int  # the chunks reading their K/V caches (and the conv and recurrent states)
    cache_update: int  # writing the new K/V: the cache-update model reading and rewriting the caches,
    #                    or (state caches) the slice update writing one column of each state; writing
    #                    the conv states (the chunk's conv_new, or its one-hot write of the state); and
    #                    writing the recurrent states (delta_new, or the state) whole

    @property
    def total(self) -> int:
        return self.weights + self.cache_read + self.cache_update

    @property
    def total_dense(self) -> int:
        return self.weights_dense + self.cache_read + self.cache_update

    def tokens_per_s_bound(self, bandwidth_gb_s: float, dense: bool = False) -> float:
        """The bandwidth-bound decode rate at `bandwidth_gb_s` (10^9 bytes/s): an upper bound."""
        return bandwidth_gb_s * 1e9 / (self.total_dense if dense else self.total)

    def to_dict(self) -> dict:
        return {**asdict(self), "total": self.total, "total_dense": self.total_dense}


def _own_name(name: str) -> str:
    """The name of the producer's tensor a KV-shared input copies ("shared_k_ring" -> "k_ring"); others as they are."""
    return name[len(SHARED):] if name.startswith(SHARED) else name


def _cache_bytes(spec: dict, attended: int) -> int:
    """Bytes of a cache tensor as one step reads it: a main cache (or a KV-shared chunk's rows of
    one) up to `attended` positions, a ring or suffix cache whole."""
    if _own_name(spec["name"]) in MAIN_CACHES:
        return nbytes(spec) // spec["shape"][-1] * attended
    return nbytes(spec)


def _chunk_caches(manifest: dict, chunk: dict, function: str, shared: bool = False) -> list[dict]:
    """The caches a chunk's `function` keeps (inputs or states); `shared`: also its KV-shared
    layers' inputs of other chunks' caches, which it reads but does not write."""
    fn = manifest["models"][chunk["model"]]["functions"][function]
    return [t for t in fn["inputs"] + function_states(fn) if (_own_name(t["name"]) if shared else t["name"]) in CACHES]


def bucket_for(manifest: dict, filled: int) -> int:
    """The cache positions a step reads with `filled` positions cached: the smallest of the
    manifest's `context_buckets` holding them, else the whole `context_length` (static shapes
    read every position, masked or not)."""
    fits = [b for b in manifest.get("context_buckets") or [] if b >= filled]
    return min(fits) if fits else manifest["context_length"]


def window_tokens(manifest: dict, function: str) -> int:
    """Tokens one step of `function` computes (its query length S, padding included)."""
    fn = manifest["models"][manifest["chunks"][0]["model"]]["functions"][function]
    return next(t["shape"][-1] for t in fn["inputs"] if t["name"] == N.HIDDEN_STATES)


def ring_bytes(manifest: dict) -> int:
    """Bytes of the sliding layers' ring buffers, K and V of every such layer (0 without a ring):
    what they hold and read per step, whatever the context length."""
    sliding = manifest["cache"].get("sliding")
    if not sliding:
        return 0
    return (2 * len(sliding["layers"]) * sliding.get("channels", manifest["cache"]["channels"]) * sliding["length"]
            * DTYPE_BYTES[manifest["cache"]["dtype"]])


def state_bytes(manifest: dict) -> tuple[int, ...]:
    """Bytes of the fixed-size states of each kind in `layer_costs.STATE_KINDS` (the conv states,
    cache.conv: L_c layers x C channels x W columns; the linear-attention layers' recurrent states,
    cache.delta: L_d layers x H heads of Dk x Dv), 0 for a kind the export lacks: what every step
    reads whole, whatever the context length."""
    return tuple(k.state_bytes(manifest["cache"]) for k in STATE_KINDS)


@dataclass(frozen=True)
class PerLayerTable:
    """Gemma 4's per-layer input weights in the embeddings files (never compressed): the table of
    `vocab` rows x `channels` (every layer's P channels), cut by the files' vocabulary rows, and
    the projection of the embedding (hidden -> channels, and its norm of P) in the last file."""

    vocab: int
    channels: int  # num_hidden_layers x P, the per_layer_inputs output's channels
    row_bytes: int  # one row of the table
    rows: dict[str, tuple[int, int]]  # {embeddings model: (start, end)} of the files that hold rows of the table
    projection_model: str
    projection_bytes: int

    @property
    def table_bytes(self) -> int:
        return self.vocab * self.row_bytes

    @property
    def step_bytes(self) -> int:
        """Bytes one token reads: a row of the table in every file holding rows (each looks its
        part up, clamped into its rows), and the projection whole."""
        return len(self.rows) * self.row_bytes + self.projection_bytes


def per_layer_table(manifest: dict) -> PerLayerTable | None:
    """The per-layer table of an export with per-layer inputs (Gemma 4), else None: its width and
    dtype from the embeddings' "per_layer_inputs" output, its rows per file from the manifest's
    vocabulary ranges."""
    first = manifest["embeddings"]["models"][0]
    spec = next((t for t in manifest["models"][first]["functions"][decode_function(manifest)]["outputs"]
                 if t["name"] == N.PER_LAYER_INPUTS), None)
    if spec is None:
        return None
    cfg = LlamaConfig.from_dict(manifest["config"])
    width, size = spec["shape"][1], DTYPE_BYTES[spec["dtype"]]
    rows = {model: per_layer_rows(cfg, tuple(r))
            for model, r in zip(manifest["embeddings"]["models"], manifest["embeddings"]["vocab_ranges"])}
    return PerLayerTable(vocab=cfg.per_layer_vocab_size, channels=width, row_bytes=width * size,
                         rows={model: r for model, r in rows.items() if r[1] > r[0]},
                         projection_model=manifest["embeddings"]["models"][-1],
                         projection_bytes=(cfg.hidden_size * width + cfg.per_layer_input_size) * size)


def weight_read_bytes(manifest: dict, dense: bool = False) -> int:
    """Weight bytes one step reads: every chunk and LM head file as the Neural Engine reads it
    (compressed where it decompresses just in time; `dense`: all decompressed), one embedding
    row per token (the table is looked up, not streamed) and, with per-layer inputs, what
    `per_layer_table` says a token reads of them."""
    weights = manifest.get("weights", {})
    stepped = [c["model"] for c in manifest["chunks"]] + list(manifest["lm_head"]["models"])
    row = manifest["config"]["hidden_size"] * DTYPE_BYTES[manifest["cache"]["dtype"]]
    table = per_layer_table(manifest)
    row += table.step_bytes if table else 0
    if dense:
        return sum(weights.get(m, {}).get("dense_bytes", 0) for m in stepped) + row
    # "read_bytes": forms the Neural Engine decompresses at load count at their dense size (quantize.schemes)
    return sum(weights.get(m, {}).get("read_bytes", weights.get(m, {}).get("bytes", 0)) for m in stepped) + row


def kv_read_bytes(manifest: dict, attended: int, function: str | None = None) -> int:
    """K/V bytes the chunks read in one step of `function` (default: a decoded token's): the main caches up to `attended`
    positions (`bucket_for`), the rings, a cascade's suffix caches, the conv states and the
    recurrent states whole, and KV-shared layers' inputs of other chunks' caches as those caches
    are read."""
    function = function or decode_function(manifest)
    return sum(_cache_bytes(t, attended) for chunk in manifest["chunks"]
               for t in _chunk_caches(manifest, chunk, function, shared=True))


def kv_write_bytes(manifest: dict, attended: int, function: str | None = None, kv_cache: str | None = None) -> int:
    """Bytes of writing one step's new K/V, with the caches as exported (`kv_cache=None`) or as the
    other kind would keep them ("inputs" or "state").

    A cascade step's cache update reads and rewrites the suffix caches (the prefix is only read);
    a single-sequence window writes the main caches: the cache-update model reads and rewrites
    them up to `attended` positions ("inputs"), or the chunk writes the window's columns of each
    state ("state"). The fixed-size states are written as their layer kind says
    (`layer_costs.STATE_KINDS`' write_bytes)."""
    kind = kv_cache or kv_cache_kind(manifest)
    function = function or decode_function(manifest)
    tokens = window_tokens(manifest, function)
    total = 0
    for chunk in manifest["chunks"]:
        caches = _chunk_caches(manifest, chunk, function)
        total += sum(state_kind(t["name"]).write_bytes(t, tokens, kind) for t in caches if t["name"] in STATES)
        caches = [t for t in caches if t["name"] not in STATES]
        suffix = [t for t in caches if t["name"] in SUFFIX_CACHES]
        if suffix:
            total += sum(2 * nbytes(t) for t in suffix)
        elif kind == "state":
            total += sum(2 * nbytes(t) if t["name"] in RING_CACHES else
                         nbytes(t) // t["shape"][-1] * tokens for t in caches)
        else:
            total += sum(2 * _cache_bytes(t, attended) for t in caches)
    return total


def decode_step_traffic(manifest: dict, kv_cache: str | None = None, filled: int | None = None) -> StepTraffic:
    """What one "decode" step of the export at `manifest` reads and writes with `filled` positions
    cached before it (None: the context's last step), with its caches as they are (`kv_cache=None`)
    or as the other kind would keep them ("inputs" or "state"): the weights and the cache reads are
    the same, only the writing of the new K/V differs. The bucket that runs holds the filled
    positions and the new token's."""
    attended = bucket_for(manifest, manifest["context_length"] if filled is None else filled + 1)
    return StepTraffic(weights=weight_read_bytes(manifest), weights_dense=weight_read_bytes(manifest, dense=True),
                       cache_read=kv_read_bytes(manifest, attended),
                       cache_update=kv_write_bytes(manifest, attended, kv_cache=kv_cache))


def window_io_bytes(manifest: dict, function: str) -> int:
    """Bytes of the tensors passed between the models in one step of `function` ("decode", or
    "verify": a token tree of W tokens): every input and output of the embeddings, chunk and LM
    head functions but the caches and KV-shared inputs of caches, the conv states and their
    conv_new, and the recurrent states and their delta_new (counted by `kv_read_bytes` and
    `kv_write_bytes`) (hidden states, RoPE rows, masks, the window's real tokens,
    new K/V, Gemma 4's per-layer inputs and shared new K/V, logits). Added to
    `decode_step_traffic(manifest).total` it gives the bytes of a step of that function: the weights
    and caches are read once per step whatever the window, the window's own tensors grow with it."""
    models = [*manifest["embeddings"]["models"], *(c["model"] for c in manifest["chunks"]),
              *manifest["lm_head"]["models"]]
    total = 0
    for model in models:
        fn = manifest["models"][model]["functions"][function]
        total += sum(nbytes(t) for t in fn["inputs"] + fn["outputs"]
                     if _own_name(t["name"]) not in CACHES and t["name"] not in STATE_WRITES)
    return total
