"""How the host carries the states kept beside the K/V caches (`names.CARRIED`: the conv layers'
`cache.conv` and the linear-attention layers' `cache.delta`), by the manifest's carry rules, as the
Swift host's `PipelineWiring.carry` and `StateCarry` do.

The manifest says how each chunk function carries each state by what it reads and returns
(docs/manifest.md): a function reading the state as an input returns what the host takes the next
state from (`FROM_OUTPUT`); one holding it as a Core ML state writes it itself from `window_tokens`
(`IN_STATE`); a cascade function reads the branches' own states and returns each branch's
(`BRANCHES`). The state's kind says how it moves (`CarriedState`'s rules, run by `move`).
"""

from __future__ import annotations

import numpy as np

from ..contract.manifest import REEXPORT, ManifestError
from ..model.names import WINDOW_TOKENS, CarriedState

NONE, FROM_OUTPUT, IN_STATE, BRANCHES = "none", "from_output", "in_state", "branches"


def carry_mode(entry: dict, carried: CarriedState, label: str) -> str:
    """How function `entry` (a manifest function, `label` naming it) carries `carried`: NONE where
    it reads no such state. A function that reads the state as an input must return its new value,
    and one that holds it as a state must read `window_tokens` and return nothing for it."""
    inputs = {t["name"] for t in entry["inputs"]}
    states = {t["name"] for t in entry.get("states", [])}
    returns = any(t["name"] == carried.new for t in entry["outputs"])
    if carried.state in inputs:
        mode = FROM_OUTPUT
    elif carried.branches in inputs:
        mode = BRANCHES
    elif carried.state in states:
        if WINDOW_TOKENS not in inputs:
            raise ManifestError(f"{label} holds {carried.state} as a state but does not read {WINDOW_TOKENS}: {REEXPORT}")
        mode = IN_STATE
    else:
        return NONE
    if returns != (mode != IN_STATE):
        raise ManifestError(f"{label} {'returns' if returns else 'does not return'} {carried.new}, but its {carried.state} "
                            f"is {'a state it writes itself' if mode == IN_STATE else 'carried by the host from it'}: {REEXPORT}")
    return mode


def move(operation: str, target: np.ndarray, source: np.ndarray, n: int = 1) -> np.ndarray:
    """The state `target` moved on by `operation` (a `CarriedState` rule) reading `source`:

    "afterWindow": a conv state (L, C, 1, W) by a window's values (L, C, 1, S): the last W values of
      [state, values] up to the n-th real one;
    "afterBranchStep": each branch's conv state (L, C, B, W) by its one value (L, C, 1, B);
    "replace": `source` itself (a recurrent state after a window or a step), of `target`'s shape."""
    if operation == "afterWindow":
        return np.concatenate([target.astype(source.dtype, copy=False), source], axis=-1)[..., n:n + target.shape[-1]].copy()
    if operation == "afterBranchStep":
        return np.concatenate([target[..., 1:], source.reshape(*target.shape[:3], 1)], axis=-1)
    if operation == "replace":
        if source.shape != target.shape:
            raise ValueError(f"a state of shape {source.shape} cannot replace one of shape {target.shape}")
        return np.array(source, target.dtype)
    raise ValueError(f"no carry rule {operation!r}")


def branch_copies(operation: str, state: np.ndarray, width: int) -> np.ndarray:
    """The `width` cascade branches' own states, each a copy of the prefix's `state` (L, C, 1, W):
    "copyToBranches" along the branch axis (L, C, B, W), "copyToBranchRows" as layer-major rows
    (L*B, C, 1, W)."""
    if operation == "copyToBranches":
        return np.repeat(state, width, axis=2)
    if operation == "copyToBranchRows":
        return np.repeat(state, width, axis=0)
    raise ValueError(f"no branch copy rule {operation!r}")
