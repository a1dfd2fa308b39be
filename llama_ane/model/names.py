"""Tensor names of the pipeline roles, as docs/manifest.md defines them: the one place the exporter
and the runtime take them from, and the twin of the Swift host's `TensorNames`
(swift_host/Sources/LlamaANE/Runtime/TensorNames.swift).

Shapes and dtypes always come from the manifest; only these names are shared knowledge between the
exporter and a host. Both sides check themselves against one committed table,
swift_host/Tests/LlamaANETests/Fixtures/tensor_names.json (tests/test_tensor_names.py and the Swift
host's TensorNamesTests): every name here, and what the functions below make of given inputs.

Names made from others: a cache update's output `X_out` is the new value of its input `X`
(`updated`); a chunk's output of a window's new K/V is its cache's `new` name (k_cache -> k_new,
k_ring -> k_ring_new); a cascade branch's suffix cache is `suffix` of it (k_cache -> k_suffix);
a KV-shared layer's input of its producer's tensor is `shared` of that tensor's name; an LM head's
outputs are `logits(j)` for each vocabulary split j.
"""

from __future__ import annotations

from dataclasses import dataclass

# the embeddings' int32 inputs: a window's tokens and its first position, or (host masks, cascade) each
# row's position; the cascade's prefix length and the suffix slot each branch's update writes
INPUT_IDS = "input_ids"
POSITION = "position"
POSITIONS = "positions"
PREFIX_LENGTH = "prefix_length"
SUFFIX_POSITIONS = "suffix_positions"
# the verify window's per-token tree depths (W,), its additive tree mask (1, 1, W, W) and the cache
# slots (W,) its cache update writes the accepted tokens to (and their slots in the ring)
DEPTHS = "depths"
TREE_MASK = "tree_mask"
SLOTS = "slots"
RING_SLOTS = "ring_slots"
# the masks a chunk's window function reads: over the cache and the window, and the sliding layers'
# twin (where the prefill window decodes the host makes them, runtime/masks.py); the cascade's over
# the prefix and over each branch's suffix
MASK = "mask"
SLIDING_MASK = "sliding_mask"
HOST_MASKS = (MASK, SLIDING_MASK)
PREFIX_MASK = "prefix_mask"
SLIDING_PREFIX_MASK = "sliding_prefix_mask"
SUFFIX_MASK = "suffix_mask"
SLIDING_SUFFIX_MASK = "sliding_suffix_mask"
# the RoPE tables (and the sliding layers' own where their base differs)
COS, SIN = "cos", "sin"
COS_LOCAL, SIN_LOCAL = "cos_local", "sin_local"
HIDDEN_STATES = "hidden_states"
HIDDEN_STATES_OUT = "hidden_states_out"
# a chunk's caches: the full layers' K/V (context-long), the sliding layers' ring (R slots)
K_CACHE, V_CACHE = "k_cache", "v_cache"
K_CACHE_OUT, V_CACHE_OUT = "k_cache_out", "v_cache_out"  # the cache update's (`updated`)
K_RING, V_RING = "k_ring", "v_ring"
RINGS = (K_RING, V_RING)
# a window's new K/V the chunk returns (`new`), and a cascade's suffix caches (`suffix`)
K_NEW, V_NEW, K_RING_NEW, V_RING_NEW = "k_new", "v_new", "k_ring_new", "v_ring_new"
K_SUFFIX, V_SUFFIX, K_RING_SUFFIX, V_RING_SUFFIX = "k_suffix", "v_suffix", "k_ring_suffix", "v_ring_suffix"
# the conv layers' state (cache.conv): the chunk's input or state, the window's values the chunk
# returns (input caches), the window's real tokens from which a chunk writes its state itself (state
# caches, and the linear-attention layers' every window function), the cascade branches' own states
CONV_STATE = "conv_state"
CONV_NEW = "conv_new"
WINDOW_TOKENS = "window_tokens"
CONV_BRANCHES = "conv_branches"
# the linear-attention layers' recurrent state (cache.delta): the chunk's input or state, the state
# after the window the chunk returns (input caches; in the cascade each branch's), the branches' own
DELTA_STATE = "delta_state"
DELTA_NEW = "delta_new"
DELTA_BRANCHES = "delta_branches"
# the chunk caches a host holds: the full caches, the rings, the conv and recurrent states
CACHES = (K_CACHE, V_CACHE, K_RING, V_RING, CONV_STATE, DELTA_STATE)
# Gemma 4's per-layer inputs: every layer's, which the embeddings output (a later embeddings file reads
# and completes them, as per_layer_inputs_out), and a chunk's own layers' rows
PER_LAYER_INPUTS = "per_layer_inputs"
PER_LAYER_INPUTS_OUT = "per_layer_inputs_out"
PER_LAYER_INPUT = "per_layer_input"
SHARED_PREFIX = "shared_"  # a KV-shared layer's input of its producer's tensor
LOGITS_PREFIX = "logits_"  # an LM head's output of vocabulary split j
UPDATED_SUFFIX = "_out"  # a cache update's output X_out is the new value of its input X
NEW_SUFFIX = "_new"  # a chunk's output of the window's new K/V of a cache
SUFFIX_SUFFIX = "_suffix"  # a cascade branch's suffix cache of a cache's K/V


def updated(name: str) -> str:
    """The cache update's output that is the new value of its input `name` (k_cache -> k_cache_out)."""
    return name + UPDATED_SUFFIX


def shared(name: str) -> str:
    """A KV-shared chunk's input of its producer's tensor `name` (k_cache -> shared_k_cache)."""
    return SHARED_PREFIX + name


def logits(split: int) -> str:
    """The LM head's output of vocabulary split `split` (logits_0, logits_1, ...)."""
    return f"{LOGITS_PREFIX}{split}"


def logits_split(name: str) -> int | None:
    """The vocabulary split an LM head output `name` holds (logits_j -> j), None for any other name."""
    rest = name.removeprefix(LOGITS_PREFIX)
    return int(rest) if rest != name and rest.isdigit() else None


def kv(which: str, ring: bool = False) -> str:
    """The key K or V (`which` "k" or "v") of the full caches ("k", "v") or the ring ("k_ring",
    "v_ring"): what a host's cache dict holds them by, and the stem of every name of them."""
    if which not in ("k", "v"):
        raise ValueError(f"a K/V tensor is 'k' or 'v', got {which!r}")
    return which + ("_ring" if ring else "")


def new(key: str) -> str:
    """The chunk's output of a window's new K/V of the cache of stem `key` (`kv`): k -> k_new,
    k_ring -> k_ring_new."""
    return key + NEW_SUFFIX


def suffix(key: str) -> str:
    """A cascade's suffix cache of the cache of stem `key` (`kv`): k -> k_suffix, k_ring -> k_ring_suffix."""
    return key + SUFFIX_SUFFIX


def cache(key: str) -> str:
    """The chunk's cache of stem `key` (`kv`): k -> k_cache, k_ring -> k_ring (a ring is named by its stem)."""
    return key if key.endswith("_ring") else key + "_cache"


# the stems of a chunk's K/V (`kv`): the full caches' K and V, the ring's; and their suffix caches
KV_STEMS = (kv("k"), kv("v"), kv("k", ring=True), kv("v", ring=True))
SUFFIXES = tuple(suffix(key) for key in KV_STEMS)


def is_ring(name: str) -> bool:
    """Whether cache `name` (or its stem) is a sliding layers' ring, read whole in every bucket."""
    return name in RINGS or name.removesuffix(SUFFIX_SUFFIX) in RINGS


@dataclass(frozen=True)
class CarriedState:
    """A state a host carries beside the K/V caches for layers that keep none (docs/manifest.md),
    the twin of the Swift host's `CarriedState`: its names and how it moves on.

    `key` is its manifest cache section (cache.conv, cache.delta) and a host's key for its array.
    `after_window`, `after_branch_step` and `copy_to_branches` name its carry rules, those of the
    Swift host's `StateCarry.Operation`: a conv state moves on by a window's values
    ("afterWindow", "afterBranchStep") and is copied along its branch axis ("copyToBranches"); a
    recurrent state becomes the chunk's ("replace") and is copied per branch as layer-major rows
    ("copyToBranchRows")."""

    key: str
    state: str  # the chunk's state: an input the host moves on, or a Core ML state
    new: str  # what the chunk returns for the host: a window's values, or the state after it
    branches: str  # the cascade branches' own states
    after_window: str
    after_branch_step: str
    copy_to_branches: str


CONV = CarriedState("conv", CONV_STATE, CONV_NEW, CONV_BRANCHES, "afterWindow", "afterBranchStep", "copyToBranches")
DELTA = CarriedState("delta", DELTA_STATE, DELTA_NEW, DELTA_BRANCHES, "replace", "replace", "copyToBranchRows")
CARRIED = (CONV, DELTA)
