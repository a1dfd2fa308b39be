"""Granite SWA: dense Granite's multipliers with sliding-window layers (three of every four by
default), a learned sink logit per query head in every attention layer, and a RoPE base per layer
(`layer_rope_theta`, 0 for a layer without RoPE)."""

from __future__ import annotations

from typing import Any

from . import granite
from .base import Family
from .fields import ConfigError, Fields, filled, json_type

DEFAULTS = {"sliding_window": 128}  # GraniteSWAConfig's, where config.json leaves it out


def prepare(f: Fields) -> dict[str, Any]:
    return filled(f.d, DEFAULTS)


def window_pattern(f: Fields, layers: int) -> list[int]:
    """The sliding layers where layer_types does not name them: all but every fourth, from the first."""
    return [n for n in range(layers) if n % 4]


def _sliding(f: Fields) -> set[int]:
    layers = f.integer("num_hidden_layers")
    types = f.d.get("layer_types")
    return set(window_pattern(f, layers) if types is None else
               [n for n, t in enumerate(types) if t == "sliding_attention"])


def _thetas(f: Fields) -> list[float]:
    """layer_rope_theta, one base a layer (0: no RoPE), or the global base on every layer."""
    layers = f.integer("num_hidden_layers")
    thetas = f.d.get("layer_rope_theta")
    if thetas is None:
        return [None] * layers
    if not (isinstance(thetas, list) and len(thetas) == layers and all(
            isinstance(t, (int, float)) and not isinstance(t, bool) and t >= 0 for t in thetas)):
        what = f"a list of {len(thetas)}" if isinstance(thetas, list) else json_type(thetas)
        raise ConfigError(f"{f.origin}: layer_rope_theta is {what}; it must list num_hidden_layers "
                          f"({layers}) RoPE bases, each a number >= 0 (0: the layer has no RoPE)")
    return [float(t) for t in thetas]


def rope(f: Fields, rope: dict[str, Any]) -> tuple[dict[str, Any], float | None]:
    """The global layers' base (rope_theta) and the sliding layers' (None: the same), from
    layer_rope_theta: each kind of layer rotates with one base, or leaves RoPE out."""
    thetas, sliding = _thetas(f), _sliding(f)
    base = Fields(rope, f"{f.origin} rope_parameters").number("rope_theta", None) or f.number("rope_theta", 10000.0)
    kinds = []
    for name, layers in (("global", [t for n, t in enumerate(thetas) if n not in sliding]),
                         ("sliding", [t for n, t in enumerate(thetas) if n in sliding])):
        turning = {base if t is None else t for t in layers if t != 0}
        if len(turning) > 1:
            raise ConfigError(f"{f.origin}: layer_rope_theta gives the {name} layers the bases {sorted(turning)}; "
                              f"the export rotates each kind of layer with one base")
        kinds.append(turning.pop() if turning else base)
    full, local = kinds
    return {**rope, "rope_theta": full}, (None if local == full else local)


def extras(f: Fields) -> dict[str, Any]:
    """Granite's multipliers, the sinks, and the layers whose layer_rope_theta is 0 (no RoPE)."""
    return {**granite.multipliers(f), "attention_sinks": True,
            "nope_layers": [n for n, t in enumerate(_thetas(f)) if t == 0]}


def write(cfg: Any, d: dict[str, Any]) -> dict[str, Any]:
    """GraniteSWAConfig's multipliers, layer types and a base per layer."""
    d = granite.write(cfg, d)
    local = cfg.rope_local_theta if cfg.rope_local_theta is not None else cfg.rope_theta
    d.update(sliding_window=cfg.sliding_window or cfg.max_position_embeddings,
             layer_types=["sliding_attention" if cfg.slides(n) else "full_attention"
                          for n in range(cfg.num_hidden_layers)],
             layer_rope_theta=[0.0 if not cfg.rotary(n) else local if cfg.slides(n) else cfg.rope_theta
                               for n in range(cfg.num_hidden_layers)])
    return d


FAMILY = Family("granite_swa", "GraniteSWA", label="Granite SWA", attention_bias_flag=True, rope_types=("default",),
                window_layers=window_pattern, prepare=prepare, rope=rope, extras=extras, write=write,
                quality_model=False)  # embeddings and logits scaled outside the decoder layers
