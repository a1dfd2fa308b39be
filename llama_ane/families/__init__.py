"""The model families the exporter builds, one module each, keyed by their config.json model_type.

Each module holds what is its family's own: the traits by which its block differs from the Llama
block, the hooks that read its config.json fields and write them back for transformers, the names
its checkpoints give their tensors, and how llama.cpp stores it (see `base.Family`); the rest of the
package asks the registry (`FAMILIES`, `family`) rather than naming a model_type.

To add a family: write its module here (a `FAMILY = Family(...)` built from the traits and hooks it
needs, every other one left at the Llama block's default). The registry finds every module of this
package that defines FAMILY; nothing else names it. Nothing here imports torch, transformers or
another part of the package.
"""

from __future__ import annotations

import importlib
import pkgutil

from .base import MOE, Family, GGUFArch
from .fields import ConfigError, Fields, json_type

_HELPERS = {"base", "fields"}


def _discover() -> dict[str, Family]:
    """model_type -> its family, from every module of this package with a FAMILY: the Llama block
    first, the others by model_type."""
    found = []
    for info in pkgutil.iter_modules(__path__):
        if info.name not in _HELPERS and not info.name.startswith("_"):
            module = importlib.import_module(f"{__name__}.{info.name}")
            if isinstance(getattr(module, "FAMILY", None), Family):
                found.append(module.FAMILY)
    found.sort(key=lambda f: (f.model_type != "llama", f.model_type))
    return {f.model_type: f for f in found}


FAMILIES: dict[str, Family] = _discover()
PLAIN = Family("", "")  # the Llama block alone: what a config of a model_type built by hand computes with


def _supported() -> str:
    """The supported line, from the families' own labels, RoPE types and activations."""
    names = [f"'{t}'" + (f" ({f.label})" if f.label else "") for t, f in FAMILIES.items()]
    multimodal = [f.multimodal[0] for f in FAMILIES.values() if f.multimodal]
    default = ("default", "llama3", "linear")
    rope = [f"{t}: {' or '.join(f.rope_types)}" for t, f in FAMILIES.items() if f.rope_types != default]
    act = {}
    for t, f in FAMILIES.items():
        if f.activation != "silu":
            act.setdefault(f.activation, []).append(t)
    return (f"supported: model_type {', '.join(names[:-1])} and {names[-1]}, and the text model of a multimodal "
            f"checkpoint ({', '.join(repr(m) for m in multimodal)}: its text_config), with RoPE type default, linear "
            f"or llama3" + (f" ({'; '.join(rope)})" if rope else "") + ", silu MLP"
            + "".join(f" ({', '.join(ts)}: {a})" for a, ts in act.items()) + ", no MLP bias")


SUPPORTED_DESCRIPTION = _supported()

# Families transformers has that the export does not build, with what they need that it lacks
# (other model_types get the plain "unsupported" line).
REFUSED = {
    "qwen3_next": "Qwen3-Next's linear-attention (Gated DeltaNet) layers and " + MOE,
    "qwen2_moe": MOE, "qwen3_moe": MOE, "mixtral": MOE, "granitemoe": MOE,
    "granitemoehybrid": "Granite 4.0-H's Mamba-2 layers without attention beside them and " + MOE,
    "phimoe": MOE, "olmoe": MOE,
    "olmo": "OLMo 1's layer norm without weights",
    "phi": "Phi-1/Phi-2's parallel attention and MLP with LayerNorm and a GeLU MLP",
}


def family(model_type: str) -> Family:
    """The family of `model_type`; a ConfigError saying what is supported where the export builds none."""
    if model_type in REFUSED:
        raise ConfigError(f"unsupported model_type {model_type!r}: the export has no "
                          f"{REFUSED[model_type]}; {SUPPORTED_DESCRIPTION}")
    if model_type not in FAMILIES:
        raise ConfigError(f"unsupported model_type {model_type!r}; {SUPPORTED_DESCRIPTION}")
    return FAMILIES[model_type]


__all__ = ["FAMILIES", "PLAIN", "REFUSED", "SUPPORTED_DESCRIPTION", "ConfigError", "Family", "Fields", "GGUFArch",
           "family", "json_type"]
