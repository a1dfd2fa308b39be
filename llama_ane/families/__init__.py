"""The model families the exporter builds, one module each, keyed by their config.json model_type.

Each module holds what is its family's own: the traits by which its block differs from the Llama
block, the hooks that read its config.json fields and write them back for transformers, the names
its checkpoints give their tensors, and how llama.cpp stores it (see `base.Family`); the rest of the
package asks the registry (`FAMILIES`, `family`) rather than naming a model_type.

To add a family: write its module here (a `FAMILY = Family(...)` built from the traits and hooks it
needs, every other one left at the Llama block's default), add it to the registry below, and name it
in SUPPORTED_DESCRIPTION. Nothing here imports torch, transformers or another part of the package.
"""

from __future__ import annotations

from . import (gemma3_text, gemma4_text, granite, lfm2, llama, mistral, olmo2, phi3, qwen2, qwen3, qwen3_5_text,
               smollm3)
from .base import MOE, Family, GGUFArch
from .fields import ConfigError, Fields, json_type

# model_type -> its family, in the order the supported lines name them
FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    llama.FAMILY, mistral.FAMILY, qwen2.FAMILY, qwen3.FAMILY, smollm3.FAMILY, granite.FAMILY, olmo2.FAMILY,
    phi3.FAMILY, gemma3_text.FAMILY, lfm2.FAMILY, gemma4_text.FAMILY, qwen3_5_text.FAMILY)}
PLAIN = Family("", "")  # the Llama block alone: what a config of a model_type built by hand computes with

SUPPORTED_DESCRIPTION = (
    "supported: model_type 'llama' (Llama 2, 3, 3.1, 3.2, SmolLM2), 'mistral', 'qwen2' (Qwen2, Qwen2.5), "
    "'qwen3' (dense Qwen3), 'smollm3', 'granite' (dense Granite 3.x), 'olmo2' (OLMo 2), 'phi3' "
    "(Phi-3, Phi-3.5, Phi-4-mini), 'gemma3_text' (Gemma 3's text model), 'gemma4_text' (Gemma 4's text model), "
    "'lfm2' (LFM2) and 'qwen3_5_text' (Qwen3.5's text model), and the text model of a multimodal checkpoint "
    "('qwen3_5', 'gemma3', 'gemma4': its text_config), with RoPE type "
    "default, linear or "
    "llama3 (phi3: default or longrope), silu MLP (gemma3_text, gemma4_text: gelu_pytorch_tanh), no MLP bias"
)
# Families transformers has that the export does not build, with what they need that it lacks
# (other model_types get the plain "unsupported" line).
REFUSED = {
    "qwen3_next": "Qwen3-Next's linear-attention (Gated DeltaNet) layers and " + MOE,
    "qwen2_moe": MOE, "qwen3_moe": MOE, "mixtral": MOE, "granitemoe": MOE, "granitemoehybrid": MOE,
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
