"""Phi-3 (Phi-3, Phi-3.5, Phi-4-mini): q/k/v stored as one qkv_proj and gate/up as one gate_up_proj,
RoPE that may rotate only the first partial_rotary_factor of each head, and longrope scaling (its
tables come from transformers' own rotary class)."""

from __future__ import annotations

import math
from typing import Any

from .base import Family, GGUFArch

ROPE_ALIASES = {"su": "longrope", "yarn": "longrope"}  # what Phi3Config reads as longrope
# our name -> (its fused tensor, the LlamaConfig sizes of the rows before ours, the size of ours): its rows are ours
FUSED_TENSORS = {
    "q_proj.weight": ("self_attn.qkv_proj.weight", (), "q_channels"),
    "k_proj.weight": ("self_attn.qkv_proj.weight", ("q_channels",), "kv_channels"),
    "v_proj.weight": ("self_attn.qkv_proj.weight", ("q_channels", "kv_channels"), "kv_channels"),
    "mlp.gate_proj.weight": ("mlp.gate_up_proj.weight", (), "intermediate_size"),
    "mlp.up_proj.weight": ("mlp.gate_up_proj.weight", ("intermediate_size",), "intermediate_size"),
}
FUSED_SHAPES = {"self_attn.qkv_proj.weight": ("qkv_channels", "hidden_size"),  # its fused tensors' shapes
                "mlp.gate_up_proj.weight": ("gate_up_channels", "hidden_size")}


def write(cfg: Any, d: dict[str, Any]) -> dict[str, Any]:
    """Phi3Config reads the original context at the top level."""
    d["original_max_position_embeddings"] = (cfg.rope_scaling or {}).get(
        "original_max_position_embeddings", cfg.max_position_embeddings)
    return d


def read_gguf(g: Any, cfg: dict[str, Any]) -> None:
    cfg["original_max_position_embeddings"] = g.meta("phi3.rope.scaling.original_context_length",
                                                     cfg["max_position_embeddings"])
    if window := g.meta("phi3.attention.sliding_window", 0):  # 0: none (Phi-4-mini)
        cfg["sliding_window"] = window


def read_gguf_longrope(g: Any, cfg: dict[str, Any], tensors: dict[str, Any]) -> dict[str, Any]:
    """longrope from its factor tensors; the attention factor only where the file's differs from the
    one transformers derives from the two context lengths (as llama.cpp's convert does)."""
    if len(tensors) != 2:
        raise g.error(f"{g.path} has only one of rope_factors_long/rope_factors_short; convert the model again")
    out: dict[str, Any] = {"rope_type": "longrope"}
    out.update({hf: [float(x) for x in g.aux_values(t)] for hf, t in tensors.items()})
    orig = g.meta("phi3.rope.scaling.original_context_length", cfg["max_position_embeddings"])
    scale = cfg["max_position_embeddings"] / orig
    derived = math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1 else 1.0
    attn = g.meta("phi3.rope.scaling.attn_factor", None)
    if attn is not None and not math.isclose(attn, derived, rel_tol=1e-6):
        out["attention_factor"] = attn
    return out


FAMILY = Family("phi3", "Phi3", label="Phi-3, Phi-3.5, Phi-4-mini", fused_projections=True,
                rope_types=("default", "longrope"), rope_aliases=ROPE_ALIASES,
                write=write, writes_rotary_factor=True, quality_model=False,  # fused projections
                gguf=GGUFArch("phi3", "Phi-3, Phi-3.5, Phi-4-mini", partial_rope=True, read=read_gguf,
                              read_longrope=read_gguf_longrope))
