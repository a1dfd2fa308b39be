"""The models of an export, their names and kinds, and the tensor names, shapes and dtypes of every
function (each kind declares its own, in llama_ane.model): collected once here, recorded in the
manifest, and read back from the manifest by every consumer. The function names come from
model.functions and are exported from here for the layers above."""

from __future__ import annotations

from ..config import LlamaConfig
from ..model.kinds import KINDS
from ..model.functions import (BRANCHES, CACHES, DECODE_FUNCTIONS, FUNCTIONS, KV_CACHE_KINDS, RING_CACHES, VERIFY, WINDOW_TOKENS, Layout, base_function, bucket_function,
                               attention_rows, bucket_of, cache_update_function, cascades_in_window, chunk_rows, conv_state_width, ring_length, ring_rewind_limit, state_length,
                               shared_rows, suffix_groups, suffix_names, suffix_update_counts, window_of,
                               model_kind)
from ..model.lm_head import vocab_splits

__all__ = ["BRANCHES", "CACHES", "DECODE_FUNCTIONS", "RING_CACHES", "FUNCTIONS", "KV_CACHE_KINDS", "VERIFY", "WINDOW_TOKENS", "base_function", "bucket_function", "bucket_of",
           "attention_rows", "cache_update_function", "cascades_in_window", "chunk_rows", "conv_state_width", "ring_length", "ring_rewind_limit", "state_length", "window_of", "chunk_model_name",
           "shared_rows", "suffix_groups", "suffix_names", "suffix_update_counts",
           "embeddings_model_name", "lm_head_model_name",
           "model_kind", "model_specs"]


def chunk_model_name(index: int) -> str:
    """Manifest model name of the index-th block chunk."""
    return f"chunk_{index}"


def embeddings_model_name(part: int) -> str:
    """Manifest model name of the part-th file of the embeddings: "embeddings", "embeddings_1", ..."""
    return "embeddings" if part == 0 else f"embeddings_{part}"


def lm_head_model_name(part: int) -> str:
    """Manifest model name of the part-th file of the LM head: "lm_head", "lm_head_1", ..."""
    return "lm_head" if part == 0 else f"lm_head_{part}"


def model_specs(cfg: LlamaConfig, plan: list[list[int]], context_length: int, prefill_length: int,
                float_dtype: str, branch_width: int = 0, suffix_length: int = 0,
                embedding_parts: int = 1, head_groups: list[list[int]] | None = None,
                kv_cache: str = "inputs", verify_window: int = 0,
                buckets: tuple[int, ...] = (), fold_head: bool = False,
                decode_function: str = "decode") -> dict[str, dict[str, dict]]:
    """{model: {function: {"inputs": [...], "outputs": [...]}}} for the whole export, each model's
    as its kind declares them (llama_ane.model.kinds).

    With `branch_width` B > 0, every model also gets a "decode_branches" function (cascade). The
    embedding table is cut into `embedding_parts` files: the first ("embeddings") looks up its
    rows and makes the RoPE tables and masks; each later one ("embeddings_1", ...) adds the lookup
    of its rows to the hidden states. `head_groups` lists the vocabulary splits each LM head file
    computes (default: all in "lm_head"); their outputs keep the global names logits_j. With
    `verify_window` W > 0, every model also gets a "verify" function (a token tree of W tokens).

    With `kv_cache="state"` the chunks' caches are states: prefill and decode need no cache-update
    function, and "cache_update" holds only the cascade's suffix updates (it is left out when there
    are none). State exports have no verify function (see ExportOptions).

    `buckets` are the context buckets (ascending, the last `context_length`): the embeddings, the
    chunks and the cache updates get prefill and decode functions per bucket (`bucket_function`),
    whose masks and caches hold that many positions. State caches keep one state of the full
    context, which every bucket's function reads the first positions of.

    With `fold_head` the last chunk carries the LM head (one group of every split): its functions
    output the logits_j in place of hidden_states_out, and there is no "lm_head" model.

    Where the sliding window is shorter than the context, the sliding layers keep a ring buffer of
    `ring_length` slots instead (model/chunk.py), in every bucket.

    With `decode_function="prefill"` there are no decode functions (nor their cache updates): a token
    runs the prefill function of its bucket (model.functions.DECODE_FUNCTIONS), whose embeddings take
    the window's positions and whose masks come from the host; the cascade steps through it too
    where `cascades_in_window` allows (then there are no "decode_branches" functions).
    """
    ring = ring_length(cfg, context_length, prefill_length)
    layout = Layout(context_length, prefill_length, float_dtype, tuple(buckets), branch_width, suffix_length,
                    verify_window, kv_cache, ring, decode_function,
                    cascades_in_window(cfg, decode_function, branch_width, ring, prefill_length))
    groups = head_groups or [list(range(len(vocab_splits(cfg.vocab_size))))]
    specs = {"embeddings": KINDS["embeddings"].functions(cfg, layout)}
    specs.update({embeddings_model_name(k): KINDS["embeddings_part"].functions(cfg, layout) for k in range(1, embedding_parts)})
    folded = [j for heads in groups for j in heads] if fold_head else None
    specs.update({chunk_model_name(i): KINDS["chunk"].functions(cfg, layout, layers, folded if i == len(plan) - 1 else None)
                  for i, layers in enumerate(plan)})
    if not fold_head:
        specs.update({lm_head_model_name(k): KINDS["lm_head"].functions(cfg, layout, heads) for k, heads in enumerate(groups)})
    updates = KINDS["cache_update"].functions(cfg, layout, plan)
    if updates:
        specs["cache_update"] = updates
    return specs
