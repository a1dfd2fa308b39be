"""Tensor names, shapes and dtypes of every exported function: written once here, recorded in the
manifest, and read back from the manifest by every consumer."""

from __future__ import annotations

from ..chunks.models import vocab_splits
from ..config import LlamaConfig

# function name -> query length S; "prefill" uses the export's prefill window
FUNCTIONS = ("prefill", "decode")


def window_of(function: str, prefill_length: int) -> int:
    return prefill_length if function.startswith("prefill") else 1


def chunk_model_name(index: int) -> str:
    """Manifest model name of the index-th block chunk."""
    return f"chunk_{index}"


def cache_update_function(function: str, layers: int) -> str:
    """Name of the cache-update function for a chunk of `layers` layers, e.g. "decode_l3"."""
    return f"{function}_l{layers}"


def _t(name: str, shape: list[int], dtype: str) -> dict:
    return {"name": name, "shape": list(shape), "dtype": dtype}


def model_specs(cfg: LlamaConfig, plan: list[list[int]], context_length: int, prefill_length: int,
                float_dtype: str) -> dict[str, dict[str, dict]]:
    """{model: {function: {"inputs": [...], "outputs": [...]}}} for the whole export."""
    c, d, kv, t, f = cfg.hidden_size, cfg.head_dim, cfg.kv_channels, context_length, float_dtype
    specs: dict[str, dict[str, dict]] = {"embeddings": {}, "lm_head": {}, "cache_update": {}}
    for i in range(len(plan)):
        specs[chunk_model_name(i)] = {}
    for fn in FUNCTIONS:
        s = window_of(fn, prefill_length)
        specs["embeddings"][fn] = {
            "inputs": [_t("input_ids", [1, s], "int32"), _t("position", [1], "int32")],
            "outputs": [_t("hidden_states", [1, c, 1, s], f), _t("cos", [1, d, 1, s], f),
                        _t("sin", [1, d, 1, s], f), _t("mask", [1, 1, s, t + s], f)],
        }
        for i, layers in enumerate(plan):
            n = len(layers)
            specs[chunk_model_name(i)][fn] = {
                "inputs": [_t("hidden_states", [1, c, 1, s], f), _t("cos", [1, d, 1, s], f),
                           _t("sin", [1, d, 1, s], f), _t("mask", [1, 1, s, t + s], f),
                           _t("k_cache", [n, kv, 1, t], f), _t("v_cache", [n, kv, 1, t], f)],
                "outputs": [_t("hidden_states_out", [1, c, 1, s], f),
                            _t("k_new", [n, kv, 1, s], f), _t("v_new", [n, kv, 1, s], f)],
            }
            specs["cache_update"][cache_update_function(fn, n)] = {
                "inputs": [_t("k_cache", [n, kv, 1, t], f), _t("v_cache", [n, kv, 1, t], f),
                           _t("k_new", [n, kv, 1, s], f), _t("v_new", [n, kv, 1, s], f),
                           _t("position", [1], "int32")],
                "outputs": [_t("k_cache_out", [n, kv, 1, t], f), _t("v_cache_out", [n, kv, 1, t], f)],
            }
        specs["lm_head"][fn] = {
            "inputs": [_t("hidden_states", [1, c, 1, s], f)],
            "outputs": [_t(f"logits_{j}", [1, v, 1, s], f) for j, v in enumerate(vocab_splits(cfg.vocab_size))],
        }
    return specs
