"""Qwen2 (Qwen2, Qwen2.5): a bias on q, k and v always; a sliding window only with use_sliding_window,
on the layers layer_types names (or from max_window_layers on)."""

from __future__ import annotations

from typing import Any

from .base import Family, GGUFArch
from .fields import Fields


def max_window_layers(f: Fields, layers: int) -> list[int]:
    """The sliding layers where layer_types does not name them: from max_window_layers on (its default 28)."""
    return list(range(f.integer("max_window_layers", 28, minimum=0), layers))


def write_window(cfg: Any, d: dict[str, Any]) -> dict[str, Any]:
    """The window as Qwen's config classes read it: on where the config has one, from the first layer."""
    d["use_sliding_window"] = cfg.sliding_window is not None
    d["max_window_layers"] = 0
    return d


FAMILY = Family("qwen2", "Qwen2", label="Qwen2, Qwen2.5", qkv_bias=True, window_flag="use_sliding_window",
                window_layers=max_window_layers,
                write=write_window, gguf=GGUFArch("qwen2", "Qwen2, Qwen2.5"))
