"""Tensor names, shapes and dtypes of every exported function: written once here, recorded in the
manifest, and read back from the manifest by every consumer."""

from __future__ import annotations

from ..chunks.models import vocab_splits
from ..config import LlamaConfig

# "prefill" runs the prefill window, "decode" one token, "decode_branches" one token for each of B
# branches over a shared prefix (cascade). Cache-update functions are named after these.
FUNCTIONS = ("prefill", "decode")
BRANCHES = "decode_branches"


def window_of(function: str, prefill_length: int, branch_width: int = 0) -> int:
    """Query length S of a function: the prefill window, 1, or the branch width B."""
    if function.startswith("prefill"):
        return prefill_length
    if function.startswith(BRANCHES):
        return branch_width
    return 1


def chunk_model_name(index: int) -> str:
    """Manifest model name of the index-th block chunk."""
    return f"chunk_{index}"


def cache_update_function(function: str, layers: int) -> str:
    """Name of the cache-update function for a chunk of `layers` layers, e.g. "decode_l3"."""
    return f"{function}_l{layers}"


def _t(name: str, shape: list[int], dtype: str) -> dict:
    return {"name": name, "shape": list(shape), "dtype": dtype}


def model_specs(cfg: LlamaConfig, plan: list[list[int]], context_length: int, prefill_length: int,
                float_dtype: str, branch_width: int = 0, suffix_length: int = 0) -> dict[str, dict[str, dict]]:
    """{model: {function: {"inputs": [...], "outputs": [...]}}} for the whole export.

    With `branch_width` B > 0, every model also gets a "decode_branches" function (cascade).
    """
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
    if branch_width:
        add_branch_specs(specs, cfg, plan, context_length, f, branch_width, suffix_length)
    return specs


def add_branch_specs(specs: dict, cfg: LlamaConfig, plan: list[list[int]], context_length: int, f: str,
                     b: int, u: int) -> None:
    """The "decode_branches" functions (see chunks/cascade.py for their semantics)."""
    c, d, kv, t, g = cfg.hidden_size, cfg.head_dim, cfg.kv_channels, context_length, cfg.num_key_value_heads
    specs["embeddings"][BRANCHES] = {
        "inputs": [_t("input_ids", [1, b], "int32"), _t("positions", [b], "int32"),
                   _t("prefix_length", [1], "int32")],
        "outputs": [_t("hidden_states", [1, c, 1, b], f), _t("cos", [1, d, 1, b], f), _t("sin", [1, d, 1, b], f),
                    _t("prefix_mask", [1, 1, 1, t], f), _t("suffix_mask", [1, b, 1, u + 1], f)],
    }
    for i, layers in enumerate(plan):
        n = len(layers)
        specs[chunk_model_name(i)][BRANCHES] = {
            "inputs": [_t("hidden_states", [1, c, 1, b], f), _t("cos", [1, d, 1, b], f), _t("sin", [1, d, 1, b], f),
                       _t("prefix_mask", [1, 1, 1, t], f), _t("suffix_mask", [1, b, 1, u + 1], f),
                       _t("k_cache", [n, kv, 1, t], f), _t("v_cache", [n, kv, 1, t], f),
                       _t("k_suffix", [n * g, b, d, u], f), _t("v_suffix", [n * g, b, d, u], f)],
            "outputs": [_t("hidden_states_out", [1, c, 1, b], f),
                        _t("k_new", [n, kv, 1, b], f), _t("v_new", [n, kv, 1, b], f)],
        }
        specs["cache_update"][cache_update_function(BRANCHES, n)] = {
            "inputs": [_t("k_suffix", [n * g, b, d, u], f), _t("v_suffix", [n * g, b, d, u], f),
                       _t("k_new", [n, kv, 1, b], f), _t("v_new", [n, kv, 1, b], f),
                       _t("suffix_positions", [b], "int32")],
            "outputs": [_t("k_suffix_out", [n * g, b, d, u], f), _t("v_suffix_out", [n * g, b, d, u], f)],
        }
    specs["lm_head"][BRANCHES] = {
        "inputs": [_t("hidden_states", [1, c, 1, b], f)],
        "outputs": [_t(f"logits_{j}", [1, v, 1, b], f) for j, v in enumerate(vocab_splits(cfg.vocab_size))],
    }
