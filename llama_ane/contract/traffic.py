"""Bytes one decode step moves, from the manifest alone: the weights every step reads, the KV
cache the chunks read, and what the cache-update model reads and writes.

Decode is bound by memory traffic: each token reads every chunk's weights and the LM head's once,
and, because every shape is static, each chunk reads its whole cache (all `context_length`
positions, masked or not). With caches passed as inputs (the default), the cache-update model
rewrites that cache through a one-hot matmul: it reads it and writes it again. With caches in
Core ML states (`--kv-cache state`) the chunk writes only the new token's column of each state (a
slice update). The embeddings model reads one row of its table. Dividing a
bandwidth by the total gives an upper bound on tokens/s: a bound, not a measurement (compute,
dispatch and the ANE's own caches are left out).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .manifest import function_states, kv_cache_kind

DTYPE_BYTES = {"float16": 2, "float32": 4, "int32": 4}


@dataclass(frozen=True)
class StepTraffic:
    """Bytes of one decode step (one token through every model)."""

    weights: int  # chunks and LM head as stored, plus one embedding row
    weights_dense: int  # the same weights decompressed (what a device that decompresses at load reads)
    cache_read: int  # the chunks reading their K/V caches
    cache_update: int  # writing the new K/V: the cache-update model reading and rewriting the caches,
    #                    or (state caches) the slice update writing one column of each state

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


def _nbytes(spec: dict) -> int:
    n = 1
    for d in spec["shape"]:
        n *= d
    return n * DTYPE_BYTES[spec["dtype"]]


def decode_step_traffic(manifest: dict, kv_cache: str | None = None) -> StepTraffic:
    """What one "decode" step of the export at `manifest` reads and writes, with its caches as they
    are (`kv_cache=None`) or as the other kind would keep them ("inputs" or "state"): the weights
    and the cache reads are the same, only the writing of the new K/V differs."""
    weights = manifest.get("weights", {})
    stepped = [c["model"] for c in manifest["chunks"]] + list(manifest["lm_head"]["models"])
    row = manifest["config"]["hidden_size"] * DTYPE_BYTES[manifest["cache"]["dtype"]]
    kind = kv_cache or kv_cache_kind(manifest)
    read, update = 0, 0
    for chunk in manifest["chunks"]:
        fn = manifest["models"][chunk["model"]]["functions"]["decode"]
        caches = [t for t in fn["inputs"] + function_states(fn) if t["name"] in ("k_cache", "v_cache")]
        read += sum(_nbytes(t) for t in caches)
        if kind == "state":  # a slice update writes one column (the position) of each state
            update += sum(_nbytes(t) // t["shape"][-1] for t in caches)
        else:  # the cache-update model reads each cache and writes it whole
            update += sum(2 * _nbytes(t) for t in caches)
    return StepTraffic(
        weights=sum(weights.get(m, {}).get("bytes", 0) for m in stepped) + row,
        weights_dense=sum(weights.get(m, {}).get("dense_bytes", 0) for m in stepped) + row,
        cache_read=read, cache_update=update)


def window_io_bytes(manifest: dict, function: str) -> int:
    """Bytes of the tensors passed between the models in one step of `function` ("decode", or
    "verify": a token tree of W tokens): every input and output of the embeddings, chunk and LM
    head functions but the caches (hidden states, RoPE rows, masks, new K/V, logits). Added to
    `decode_step_traffic(manifest).total` it gives the bytes of a step of that function: the weights
    and caches are read once per step whatever the window, the window's own tensors grow with it."""
    models = [*manifest["embeddings"]["models"], *(c["model"] for c in manifest["chunks"]),
              *manifest["lm_head"]["models"]]
    total = 0
    for model in models:
        fn = manifest["models"][model]["functions"][function]
        total += sum(_nbytes(t) for t in fn["inputs"] + fn["outputs"] if t["name"] not in ("k_cache", "v_cache"))
    return total
