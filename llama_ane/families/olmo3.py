"""OLMo 3: OLMo 2's block (outputs of attention and MLP normalized, q and k over the whole
projection) with sliding-window layers, three of every four by default, each layer type with its
own RoPE (transformers' `rope_parameters` per layer type).

llama.cpp writes OLMo 3 as general.architecture 'olmo2' with a sliding window; the olmo2 family's
GGUF reader gives such a file this model_type."""

from __future__ import annotations

from typing import Any

from .base import Family
from .fields import Fields, filled, layer_type_rope

THETA = 500_000.0  # Olmo3Config.default_theta, each layer type's base where none is given
DEFAULTS = {"sliding_window": 4096}  # Olmo3Config's, where config.json leaves it out
PATTERN = 4  # where layer_types is absent: every fourth layer global, the rest sliding


def prepare(f: Fields) -> dict[str, Any]:
    return filled(f.d, DEFAULTS)


def window_pattern(f: Fields, layers: int) -> list[int]:
    return [n for n in range(layers) if (n + 1) % PATTERN]


def rope(f: Fields, rope: dict[str, Any]) -> tuple[dict[str, Any], float | None]:
    """The global RoPE and the sliding layers' base (None where they rotate as the global layers do).
    A top-level rope_theta and rope_scaling are the global layers' only, as Olmo3Config reads them:
    the sliding layers keep the default base."""
    if "full_attention" in rope or "sliding_attention" in rope:
        full, local = layer_type_rope(f, rope, THETA, THETA)
    else:
        full, local = {**rope, "rope_theta": f.number("rope_theta", None) or rope.get("rope_theta") or THETA}, THETA
    scaling = f.mapping("rope_scaling") or full
    scaled = scaling.get("rope_type", scaling.get("type", "default")) != "default"
    return full, (None if local == full["rope_theta"] and not scaled else local)

def write(cfg: Any, d: dict[str, Any]) -> dict[str, Any]:
    """Olmo3Config's RoPE per layer type, and its window on every layer type list."""
    full = {"rope_type": "default", "rope_theta": cfg.rope_theta, **(cfg.rope_scaling or {})}
    local = cfg.rope_local_theta if cfg.rope_local_theta is not None else cfg.rope_theta
    for name in ("rope_theta", "rope_scaling"):
        d.pop(name, None)
    d.update(rope_parameters={"full_attention": full, "sliding_attention": {"rope_type": "default",
                                                                              "rope_theta": local}},
             sliding_window=cfg.sliding_window or cfg.max_position_embeddings,
             layer_types=["sliding_attention" if cfg.slides(n) else "full_attention"
                          for n in range(cfg.num_hidden_layers)])
    return d


FAMILY = Family("olmo3", "Olmo3", label="OLMo 3", attention_bias_flag=True, qk_norm=True, qk_norm_across_heads=True,
                post_norms=True, window_layers=window_pattern, prepare=prepare, rope=rope,
                write=write)
