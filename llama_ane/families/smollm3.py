"""SmolLM3: the Llama block with some layers leaving RoPE out (NoPE); a sliding window only with
use_sliding_window, on the layers layer_types names, else on those without RoPE."""

from __future__ import annotations

from typing import Any

from .base import Family, GGUFArch
from .fields import ConfigError, Fields, json_type

NOPE_INTERVAL = 4  # llama.cpp's SmolLM3: every fourth layer without RoPE (no metadata key says so)


def nope_layers(f: Fields, layers: int) -> list[int]:
    """The layers without RoPE: `no_rope_layers` holds 1 for each layer that rotates q and k and 0
    for one that does not; without it, every `no_rope_layer_interval`-th layer has none (as
    transformers' SmolLM3Config fills it in)."""
    flags = f.d.get("no_rope_layers")
    if flags is None:
        interval = f.integer("no_rope_layer_interval", 4)
        return [n for n in range(layers) if (n + 1) % interval == 0]
    if not (isinstance(flags, list) and len(flags) == layers
            and all(type(v) is int and v in (0, 1) for v in flags)):
        raise ConfigError(f"{f.origin}: no_rope_layers is {json_type(flags)}; it must be a list of "
                          f"num_hidden_layers ({layers}) entries, each 1 (the layer uses RoPE) or 0 (it does not)")
    return [n for n, v in enumerate(flags) if not v]


def extras(f: Fields) -> dict[str, Any]:
    return {"nope_layers": nope_layers(f, f.integer("num_hidden_layers"))}


def write(cfg: Any, d: dict[str, Any]) -> dict[str, Any]:
    d["no_rope_layers"] = [int(cfg.rotary(n)) for n in range(cfg.num_hidden_layers)]
    d["use_sliding_window"] = cfg.sliding_window is not None
    return d


def read_gguf(g: Any, cfg: dict[str, Any]) -> None:
    cfg["no_rope_layer_interval"] = NOPE_INTERVAL


FAMILY = Family("smollm3", "SmolLM3", attention_bias_flag=True, window_flag="use_sliding_window",
                window_layers=nope_layers, extras=extras, write=write,
                gguf=GGUFArch("smollm3", "SmolLM3", permuted=True, read=read_gguf))
