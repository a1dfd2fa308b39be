"""Tensor names, shapes and dtypes of every exported function: written once here, recorded in the
manifest, and read back from the manifest by every consumer."""

from __future__ import annotations

from ..chunks.models import vocab_splits
from ..config import LlamaConfig

# "prefill" runs the prefill window, "decode" one token, "decode_branches" one token for each of B
# branches over a shared prefix (cascade). Cache-update functions are named after these.
FUNCTIONS = ("prefill", "decode")
BRANCHES = "decode_branches"
# "verify" checks a tree of W drafted tokens in one window (speculative decoding, chunks/verify.py)
VERIFY = "verify"

# How the chunks' K/V caches live (manifest "cache"."kind"): "inputs" are arrays passed in and a
# cache-update model writes each window's K/V back; "state" caches are Core ML states (iOS18,
# macOS15) that the chunk functions update themselves by a slice update at `position`.
KV_CACHE_KINDS = ("inputs", "state")


def bucket_function(function: str, bucket: int, context_length: int) -> str:
    """Name of "prefill" or "decode" at context bucket `bucket` (the cache positions it reads): the
    plain name at the full context, else e.g. "decode_512". Only the models whose shapes hold the
    cache length (the embeddings' masks, the chunks, the cache updates) have bucketed functions; the
    LM head and the later embedding files run their plain function in every bucket."""
    return function if bucket == context_length else f"{function}_{bucket}"


def bucket_of(function: str, context_length: int) -> int:
    """The context bucket of a prefill or decode function named by `bucket_function`, or of its
    cache update (`cache_update_function`: "decode_512_l3")."""
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


def chunk_model_name(index: int) -> str:
    """Manifest model name of the index-th block chunk."""
    return f"chunk_{index}"


def embeddings_model_name(part: int) -> str:
    """Manifest model name of the part-th file of the embeddings: "embeddings", "embeddings_1", ..."""
    return "embeddings" if part == 0 else f"embeddings_{part}"


def lm_head_model_name(part: int) -> str:
    """Manifest model name of the part-th file of the LM head: "lm_head", "lm_head_1", ..."""
    return "lm_head" if part == 0 else f"lm_head_{part}"


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


def cache_update_function(function: str, layers: int) -> str:
    """Name of the cache-update function for a chunk of `layers` layers, e.g. "decode_l3"."""
    return f"{function}_l{layers}"


def _t(name: str, shape: list[int], dtype: str) -> dict:
    return {"name": name, "shape": list(shape), "dtype": dtype}


def _cache_io(io: dict, kv_cache: str) -> dict:
    """A chunk function's io with its k_cache/v_cache inputs moved to "states" when the caches are
    states: the function reads them and, unless it is the cascade's, writes its window at
    `position` (so it also takes position and no longer outputs k_new/v_new)."""
    if kv_cache == "inputs":
        return io
    caches = [t for t in io["inputs"] if t["name"] in ("k_cache", "v_cache")]
    inputs = [t for t in io["inputs"] if t not in caches]
    outputs = io["outputs"]
    if not any(t["name"] == "k_suffix" for t in inputs):  # single-sequence windows write their K/V
        inputs.append(_t("position", [1], "int32"))
        outputs = [t for t in outputs if t["name"] not in ("k_new", "v_new")]
    return {"inputs": inputs, "states": caches, "outputs": outputs}


def model_specs(cfg: LlamaConfig, plan: list[list[int]], context_length: int, prefill_length: int,
                float_dtype: str, branch_width: int = 0, suffix_length: int = 0,
                embedding_parts: int = 1, head_groups: list[list[int]] | None = None,
                kv_cache: str = "inputs", verify_window: int = 0,
                buckets: tuple[int, ...] = ()) -> dict[str, dict[str, dict]]:
    """{model: {function: {"inputs": [...], "outputs": [...]}}} for the whole export.

    With `branch_width` B > 0, every model also gets a "decode_branches" function (cascade). The
    embedding table is cut into `embedding_parts` files: the first ("embeddings") looks up its
    rows and makes the RoPE tables and masks; each later one ("embeddings_1", ...) adds the lookup
    of its rows to the hidden states. `head_groups` lists the vocabulary splits each LM head file
    computes (default: all in "lm_head"); their outputs keep the global names logits_j. With
    `verify_window` W > 0, every model also gets a "verify" function (a token tree of W tokens).

    With `kv_cache="state"` the chunks' caches are states (see `_cache_io`): prefill and decode
    need no cache-update function, and "cache_update" holds only the cascade's suffix updates (it
    is left out when there are none). State exports have no verify function (see ExportOptions).

    `buckets` are the context buckets (ascending, the last `context_length`): the embeddings, the
    chunks and the cache updates get prefill and decode functions per bucket (`bucket_function`),
    whose masks and caches hold that many positions. State caches keep one state of the full
    context, which every bucket's function reads the first positions of.
    """
    c, d, kv, t, f = cfg.hidden_size, cfg.head_dim, cfg.kv_channels, context_length, float_dtype
    groups = head_groups or [list(range(len(vocab_splits(cfg.vocab_size))))]
    specs: dict[str, dict[str, dict]] = {embeddings_model_name(k): {} for k in range(embedding_parts)}
    specs.update({chunk_model_name(i): {} for i in range(len(plan))})
    specs.update({lm_head_model_name(k): {} for k in range(len(groups))})
    specs["cache_update"] = {}
    for base, t in ((fn, t) for t in (buckets or (context_length,)) for fn in FUNCTIONS):
        fn, s = bucket_function(base, t, context_length), window_of(base, prefill_length)
        specs["embeddings"][fn] = {
            "inputs": [_t("input_ids", [1, s], "int32"), _t("position", [1], "int32")],
            "outputs": [_t("hidden_states", [1, c, 1, s], f), _t("cos", [1, d, 1, s], f),
                        _t("sin", [1, d, 1, s], f), _t("mask", [1, 1, s, t + s], f)],
        }
        if fn == base:
            add_embedding_part_specs(specs, embedding_parts, fn, c, s, f)
        for i, layers in enumerate(plan):
            n = len(layers)
            specs[chunk_model_name(i)][fn] = _cache_io({
                "inputs": [_t("hidden_states", [1, c, 1, s], f), _t("cos", [1, d, 1, s], f),
                           _t("sin", [1, d, 1, s], f), _t("mask", [1, 1, s, t + s], f),
                           _t("k_cache", [n, kv, 1, t], f), _t("v_cache", [n, kv, 1, t], f)],
                "outputs": [_t("hidden_states_out", [1, c, 1, s], f),
                            _t("k_new", [n, kv, 1, s], f), _t("v_new", [n, kv, 1, s], f)],
            }, kv_cache)
            if kv_cache == "state":
                for state in specs[chunk_model_name(i)][fn]["states"]:  # one state of the full context
                    state["shape"][3] = context_length
                continue
            specs["cache_update"][cache_update_function(fn, n)] = {
                "inputs": [_t("k_cache", [n, kv, 1, t], f), _t("v_cache", [n, kv, 1, t], f),
                           _t("k_new", [n, kv, 1, s], f), _t("v_new", [n, kv, 1, s], f),
                           _t("position", [1], "int32")],
                "outputs": [_t("k_cache_out", [n, kv, 1, t], f), _t("v_cache_out", [n, kv, 1, t], f)],
            }
        if fn == base:
            add_lm_head_specs(specs, cfg, groups, fn, s, f)
    if branch_width:
        add_branch_specs(specs, cfg, plan, context_length, f, branch_width, suffix_length, embedding_parts, groups,
                         kv_cache)
    if verify_window:
        add_verify_specs(specs, cfg, plan, context_length, f, verify_window, embedding_parts, groups)
    if not specs["cache_update"]:
        del specs["cache_update"]
    return specs


def add_embedding_part_specs(specs: dict, parts: int, fn: str, c: int, s: int, f: str) -> None:
    """The later embedding files' function `fn`: input_ids (1,S) and the hidden states so far ->
    hidden_states_out (1,C,1,S)."""
    for k in range(1, parts):
        specs[embeddings_model_name(k)][fn] = {
            "inputs": [_t("input_ids", [1, s], "int32"), _t("hidden_states", [1, c, 1, s], f)],
            "outputs": [_t("hidden_states_out", [1, c, 1, s], f)],
        }


def add_lm_head_specs(specs: dict, cfg: LlamaConfig, groups: list[list[int]], fn: str, s: int, f: str) -> None:
    """Each LM head file's function `fn`: hidden_states (1,C,1,S) -> its logits_j (1,V_j,1,S)."""
    splits = vocab_splits(cfg.vocab_size)
    for k, heads in enumerate(groups):
        specs[lm_head_model_name(k)][fn] = {
            "inputs": [_t("hidden_states", [1, cfg.hidden_size, 1, s], f)],
            "outputs": [_t(f"logits_{j}", [1, splits[j], 1, s], f) for j in heads],
        }


def add_branch_specs(specs: dict, cfg: LlamaConfig, plan: list[list[int]], context_length: int, f: str,
                     b: int, u: int, embedding_parts: int, head_groups: list[list[int]],
                     kv_cache: str = "inputs") -> None:
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
        specs[chunk_model_name(i)][BRANCHES] = _cache_io({
            "inputs": [_t("hidden_states", [1, c, 1, b], f), _t("cos", [1, d, 1, b], f), _t("sin", [1, d, 1, b], f),
                       _t("prefix_mask", [1, 1, 1, t], f), _t("suffix_mask", [1, b, 1, u + 1], f),
                       _t("k_cache", [n, kv, 1, t], f), _t("v_cache", [n, kv, 1, t], f),
                       _t("k_suffix", [n * g, b, d, u], f), _t("v_suffix", [n * g, b, d, u], f)],
            "outputs": [_t("hidden_states_out", [1, c, 1, b], f),
                        _t("k_new", [n, kv, 1, b], f), _t("v_new", [n, kv, 1, b], f)],
        }, kv_cache)
        specs["cache_update"][cache_update_function(BRANCHES, n)] = {
            "inputs": [_t("k_suffix", [n * g, b, d, u], f), _t("v_suffix", [n * g, b, d, u], f),
                       _t("k_new", [n, kv, 1, b], f), _t("v_new", [n, kv, 1, b], f),
                       _t("suffix_positions", [b], "int32")],
            "outputs": [_t("k_suffix_out", [n * g, b, d, u], f), _t("v_suffix_out", [n * g, b, d, u], f)],
        }
    add_embedding_part_specs(specs, embedding_parts, BRANCHES, c, b, f)
    add_lm_head_specs(specs, cfg, head_groups, BRANCHES, b, f)


def add_verify_specs(specs: dict, cfg: LlamaConfig, plan: list[list[int]], context_length: int, f: str,
                     w: int, embedding_parts: int, head_groups: list[list[int]]) -> None:
    """The "verify" functions (see chunks/verify.py for their semantics): the embeddings take the
    tree (depths, tree_mask), the chunks and the LM head are their window functions at S = W, and
    the cache update writes the accepted tokens at the given slots."""
    c, d, kv, t = cfg.hidden_size, cfg.head_dim, cfg.kv_channels, context_length
    specs["embeddings"][VERIFY] = {
        "inputs": [_t("input_ids", [1, w], "int32"), _t("position", [1], "int32"), _t("depths", [w], "int32"),
                   _t("tree_mask", [1, 1, w, w], f)],
        "outputs": [_t("hidden_states", [1, c, 1, w], f), _t("cos", [1, d, 1, w], f), _t("sin", [1, d, 1, w], f),
                    _t("mask", [1, 1, w, t + w], f)],
    }
    for i, layers in enumerate(plan):
        n = len(layers)
        specs[chunk_model_name(i)][VERIFY] = {
            "inputs": [_t("hidden_states", [1, c, 1, w], f), _t("cos", [1, d, 1, w], f), _t("sin", [1, d, 1, w], f),
                       _t("mask", [1, 1, w, t + w], f),
                       _t("k_cache", [n, kv, 1, t], f), _t("v_cache", [n, kv, 1, t], f)],
            "outputs": [_t("hidden_states_out", [1, c, 1, w], f),
                        _t("k_new", [n, kv, 1, w], f), _t("v_new", [n, kv, 1, w], f)],
        }
        specs["cache_update"][cache_update_function(VERIFY, n)] = {
            "inputs": [_t("k_cache", [n, kv, 1, t], f), _t("v_cache", [n, kv, 1, t], f),
                       _t("k_new", [n, kv, 1, w], f), _t("v_new", [n, kv, 1, w], f), _t("slots", [w], "int32")],
            "outputs": [_t("k_cache_out", [n, kv, 1, t], f), _t("v_cache_out", [n, kv, 1, t], f)],
        }
    add_embedding_part_specs(specs, embedding_parts, VERIFY, c, w, f)
    add_lm_head_specs(specs, cfg, head_groups, VERIFY, w, f)
