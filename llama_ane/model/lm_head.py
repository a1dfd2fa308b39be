"""The LM head: the final norm and the vocabulary projection, split by vocabulary rows so no dimension
exceeds 16384; the torch module with its MIL builder below it.

    LMHead  hidden_states (1,C,1,S) -> logits_j (1,V_j,1,S), V_j <= 16384 (all splits j, or a
            file's group of them; split j's weight is "heads.j.weight" in the programs)
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import LlamaConfig
from ..limits import MAX_DIM
from . import names as N
from .functions import Layout, Site, tensor
from .layers import Graph, RMSNorm, conv1x1, conv_mil, mb, rms_norm_mil, softcap, softcap_mil, with_state

ROW_UNIT = 64  # vocabulary parts are cut at multiples of this many rows (a LUT group divides them)


def even_parts(count: int, parts: int, unit: int = 1) -> list[tuple[int, int]]:
    """[start, end) ranges of `count` items cut into `parts` consecutive near-equal parts, each
    boundary a multiple of `unit` (the last part takes the remainder)."""
    units = -(-count // unit)
    base, extra = divmod(units, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(min(count, bounds[-1] + (base + (1 if i < extra else 0)) * unit))
    return list(zip(bounds[:-1], bounds[1:]))


def vocab_splits(vocab_size: int, limit: int = MAX_DIM) -> list[int]:
    """Split the vocabulary into the fewest near-equal parts of at most `limit` rows each, cut at
    multiples of ROW_UNIT rows (the last part takes the remainder)."""
    parts = -(-vocab_size // limit)
    while max(b - a for a, b in even_parts(vocab_size, parts, ROW_UNIT)) > limit:
        parts += 1
    return [b - a for a, b in even_parts(vocab_size, parts, ROW_UNIT)]


class LMHead(nn.Module):
    """Final norm and vocabulary projection for the splits j in `heads` (default: all; an LM head
    cut into files computes a group of them in each).

    hidden_states (1,C,1,S) -> tuple of logits_j (1,V_j,1,S), softcapped where the family caps them
    (Gemma 4: cap * tanh(logits / cap), one logit at a time, so each split on its own)
    """

    def __init__(self, cfg: LlamaConfig, heads: list[int] | None = None):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.stream_eps)
        splits = vocab_splits(cfg.vocab_size)
        self.splits = [splits[j] for j in (heads if heads is not None else range(len(splits)))]
        self.heads = nn.ModuleList(conv1x1(cfg.hidden_size, n) for n in self.splits)
        self.logits_scale = 1.0 / cfg.logits_scaling
        self.cap = cfg.final_logit_softcapping

    def forward(self, hidden_states):
        h = self.norm(hidden_states)
        if self.logits_scale != 1.0:  # Granite divides the logits: the same as scaling their input
            h = h * self.logits_scale
        return tuple(softcap(head(h), self.cap) for head in self.heads)


def build_lm_head(g: Graph, cfg: LlamaConfig, io: dict):
    """LMHead of the splits the function's outputs name (logits_j; a chunk carrying the head has
    other outputs too)."""
    def body(inputs):
        h = rms_norm_mil(g, inputs[N.HIDDEN_STATES], "norm.weight", cfg.stream_eps, cfg.hidden_size)
        if cfg.logits_scaling != 1.0:
            h = mb.mul(x=h, y=g.scalar(1.0 / cfg.logits_scaling))
        return {name: softcap_mil(g, conv_mil(g, h, f"heads.{j}.weight"), cfg.final_logit_softcapping)
                for name, j in ((t["name"], N.logits_split(t["name"])) for t in io["outputs"]) if j is not None}
    return body


def logits_outputs(cfg: LlamaConfig, layout: Layout, heads: list[int], s: int) -> list[dict]:
    """The logits_j (1,V_j,1,S) outputs of vocabulary splits `heads` for a window of S tokens."""
    splits = vocab_splits(cfg.vocab_size)
    return [tensor(N.logits(j), [1, splits[j], 1, s], layout.dtype) for j in heads]


def functions(cfg: LlamaConfig, layout: Layout, heads: list[int]) -> dict[str, dict]:
    """{function: io} of an LM head file computing vocabulary splits `heads`: hidden_states
    (1,C,1,S) -> its logits_j (1,V_j,1,S), one function for every bucket (it reads no cache)."""
    return {fn: {"inputs": [tensor(N.HIDDEN_STATES, [1, cfg.hidden_size, 1, s], layout.dtype)],
                 "outputs": logits_outputs(cfg, layout, heads, s)}
            for fn, s in (*layout.full_windows(), *layout.extra_windows())}


def program(g: Graph, cfg: LlamaConfig, function: str, io: dict, site: Site):
    """The MIL builder of an LM head file's functions (model.kinds)."""
    return build_lm_head(g, cfg, io)


def heads_of(io: dict) -> list[int]:
    """The vocabulary splits a function's logits_j outputs are."""
    return [j for j in (N.logits_split(o["name"]) for o in io["outputs"]) if j is not None]


def head_module(weights, model: str, cfg: LlamaConfig, io: dict, dtype: torch.dtype) -> LMHead:
    """The LMHead of the splits function `io` outputs, with `weights`' rows of them."""
    heads = heads_of(io)
    return with_state(lambda: LMHead(cfg, heads), weights.head(model, heads, dtype))


def modules(weights, model: str, cfg: LlamaConfig, functions: dict[str, dict], site: Site,
            dtype: torch.dtype) -> dict[str, nn.Module]:
    """The torch module of an LM head file, for each of its functions."""
    head = head_module(weights, model, cfg, next(iter(functions.values())), dtype)
    return {fn: head for fn in functions}
