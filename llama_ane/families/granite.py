"""Granite (dense Granite 3.x): the Llama block scaling the embeddings, each residual branch, the
attention scores and the logits."""

from __future__ import annotations

from typing import Any

from .base import Family, GGUFArch
from .fields import Fields


def multipliers(f: Fields) -> dict[str, Any]:
    """Its scale factors (transformers' GraniteConfig defaults when absent: 1.0 each, the attention
    scale too, not 1/sqrt(head_dim))."""
    return {"embedding_multiplier": f.number("embedding_multiplier", 1.0),
            "residual_multiplier": f.number("residual_multiplier", 1.0),
            "attention_scale": f.number("attention_multiplier", 1.0),
            "logits_scaling": f.number("logits_scaling", 1.0)}


def write(cfg: Any, d: dict[str, Any]) -> dict[str, Any]:
    d.update(embedding_multiplier=cfg.embedding_multiplier, residual_multiplier=cfg.residual_multiplier,
             attention_multiplier=cfg.query_scale, logits_scaling=cfg.logits_scaling)
    return d


def read_gguf(g: Any, cfg: dict[str, Any]) -> None:
    """Its multipliers, written by llama.cpp's convert script as *_scale keys where set; an absent
    attention scale is llama.cpp's default 1/sqrt(head_dim), the others 1."""
    m = lambda key: g.meta(f"granite.{key}", None)  # noqa: E731
    cfg["embedding_multiplier"] = m("embedding_scale") or 1.0
    cfg["residual_multiplier"] = m("residual_scale") or 1.0
    cfg["attention_multiplier"] = m("attention.scale") or cfg["head_dim"] ** -0.5
    cfg["logits_scaling"] = m("logit_scale") or 1.0


FAMILY = Family("granite", "Granite", label="dense Granite 3.x", attention_bias_flag=True,
                extras=multipliers, write=write,
                quality_model=False,  # embeddings and logits scaled outside the decoder layers
                gguf=GGUFArch("granite", "dense Granite 3.x", permuted=True, read=read_gguf))
