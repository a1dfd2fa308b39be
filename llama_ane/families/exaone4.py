"""EXAONE 4.0: OLMo 2's placement of the norms (outputs of attention and MLP normalized) with q and
k normalized per head, and, where the config has a sliding window, sliding layers with RoPE between
global layers without it (NoPE); without a window every layer is global and rotates."""

from __future__ import annotations

from typing import Any

from .base import Family
from .fields import ConfigError, Fields, json_type


def window_pattern(f: Fields, layers: int) -> list[int]:
    """The sliding layers where layer_types does not name them: all but every
    sliding_window_pattern-th, as Exaone4Config fills layer_types in. A pattern of "L"/"G" letters
    needs layer_types (transformers cannot read it without)."""
    pattern = f.d.get("sliding_window_pattern", 4)
    if isinstance(pattern, str):
        raise ConfigError(f"{f.origin}: sliding_window_pattern is {json_type(pattern)} and there is no "
                          "layer_types; add layer_types (one 'sliding_attention' or 'full_attention' a layer)")
    period = f.integer("sliding_window_pattern", 4)
    return [n for n in range(layers) if (n + 1) % period]


def extras(f: Fields) -> dict[str, Any]:
    """The global layers leave RoPE out wherever the config has a window (Exaone4Attention)."""
    if f.d.get("sliding_window") is None:
        return {}
    layers = f.integer("num_hidden_layers")
    types = f.d.get("layer_types")
    sliding = set(window_pattern(f, layers) if types is None else
                  [n for n, t in enumerate(types) if t == "sliding_attention"])
    return {"nope_layers": [n for n in range(layers) if n not in sliding]}


def write(cfg: Any, d: dict[str, Any]) -> dict[str, Any]:
    """Exaone4Config's window and layer types: a window (and so the global layers' NoPE) only where
    some layer leaves RoPE out."""
    windowed = bool(cfg.nope_layers)
    d.update(sliding_window=(cfg.sliding_window or cfg.max_position_embeddings) if windowed else None,
             layer_types=["sliding_attention" if cfg.slides(n) else "full_attention"
                          for n in range(cfg.num_hidden_layers)])
    return d


FAMILY = Family("exaone4", "Exaone4", label="EXAONE 4.0", qk_norm=True, post_norms=True, window_layers=window_pattern,
                extras=extras, write=write)
