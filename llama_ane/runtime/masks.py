"""The attention masks of an export whose windows take them from the host (the prefill window decodes:
model.functions.DECODE_FUNCTIONS), made here as the embeddings make them in-graph for the others.

A window of S rows reads T cache columns, then its own S columns: "mask" (1,1,S,T+S), additive (0
where a row sees a column, MASK_VALUE where not), and where the sliding window is shorter than the
context its twin "sliding_mask" that also hides the keys `sliding_window` or more positions before
each row (over the ring's R slots where the sliding layers keep one: (1,1,S,R+S)).

Two layouts of the cache:

* a sequence: column j holds position j, the `position` first ones are written; the window's rows
  sit at position, position + 1, ... and see the written columns and the rows before them;
* a cascade step (`branch_masks`): the shared prefix in its first P columns, then each step's B
  branch tokens side by side (branch b's i-th token in column P + i*B + b, at position P + i); row
  b sees the prefix, its own branch's tokens and itself, nothing of the other branches.
"""

from __future__ import annotations

import numpy as np

from ..config import LlamaConfig
from ..model.embeddings import window_mask
from ..model.layers import MASK_VALUE
from ..model.names import MASK, SLIDING_MASK


def _additive(keep: np.ndarray, dtype) -> np.ndarray:
    return np.where(keep, 0.0, MASK_VALUE).astype(dtype)


def held_positions(position: int, ring: int) -> np.ndarray:
    """(R,) the position each ring slot holds with `position` tokens written (slot p mod R holds the
    latest such p below `position`), negative where the slot was never written."""
    slots = np.arange(ring)
    return position - 1 - (position + ring - 1 - slots) % ring


class HostMasks:
    """The masks of one export's windows (see the module docstring). `ring`: the sliding layers'
    ring slots (0: none); `dtype`: the backend's float dtype."""

    def __init__(self, cfg: LlamaConfig, context_length: int, ring: int, dtype):
        self.window = cfg.sliding_window if cfg.windowed(context_length) else None
        self.ring, self.dtype = ring, dtype

    def window_masks(self, position: int, s: int, t: int) -> dict[str, np.ndarray]:
        """{"mask"[, "sliding_mask"]} of a window of S rows at `position` over T cache columns."""
        rows = position + np.arange(s)[:, None]  # (S,1) each row's position
        cols = np.arange(t)[None, :]
        out = {MASK: np.concatenate([_additive(np.broadcast_to(cols < position, (s, t)), self.dtype),
                                       window_mask(s).reshape(s, s).astype(self.dtype)], axis=1)}
        if self.window is not None:
            held = held_positions(position, self.ring)[None, :] if self.ring else np.where(cols < position, cols, -1)
            keep = (held >= 0) & (rows - held < self.window)
            out[SLIDING_MASK] = np.concatenate([_additive(keep, self.dtype),
                                                  window_mask(s, self.window).reshape(s, s).astype(self.dtype)], axis=1)
        return {name: m.reshape(1, 1, *m.shape) for name, m in out.items()}

    def branch_masks(self, prefix: int, width: int, seen: np.ndarray, steps: int, s: int,
                     t: int) -> dict[str, np.ndarray]:
        """{"mask"[, "sliding_mask"]} of a cascade step: rows 0..B-1 the branches (B = `width`), each
        at position prefix + seen[b] and seeing its tokens of the last seen[b] of the `steps` steps
        written (a branch may have taken its slot after the group began); rows from B on see only
        themselves (padding). No ring: the cascade runs in the window only where the cache is one
        (model.functions.cascades_in_window)."""
        cols = np.arange(t)
        lane = np.where(cols >= prefix, (cols - prefix) % width, -1)  # the branch a column belongs to
        step = np.where(cols >= prefix, (cols - prefix) // width, -1)
        rows = np.arange(s)[:, None]
        seen_rows = np.zeros((s, 1), np.int64)
        seen_rows[:width, 0] = np.minimum(np.asarray(seen), steps)
        mine = (lane[None, :] == rows) & (step[None, :] >= steps - seen_rows) & (step[None, :] < steps)
        keep = ((cols[None, :] < prefix) | mine) & (rows < width)
        own = np.eye(s, dtype=bool)
        out = {MASK: keep}
        if self.window is not None:
            # each column's position as its row sees it: a branch's tokens count from the step it began
            held = np.where(cols[None, :] < prefix, cols[None, :], prefix + step[None, :] - (steps - seen_rows))
            out[SLIDING_MASK] = keep & (prefix + seen_rows - held < self.window)
        return {name: np.concatenate([_additive(m, self.dtype), _additive(own, self.dtype)], axis=1)
                .reshape(1, 1, s, t + s) for name, m in out.items()}
