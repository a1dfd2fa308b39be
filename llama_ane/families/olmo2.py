"""OLMo 2: the outputs of attention and MLP normalized instead of their inputs
(post_attention_layernorm, post_feedforward_layernorm), and q and k over the whole projection,
all heads at once."""

from __future__ import annotations

from typing import Any

from .base import Family, GGUFArch


def read_gguf(g: Any, cfg: dict[str, Any]) -> None:
    if g.meta("olmo2.attention.sliding_window", None) is not None:
        raise g.error(f"{g.path} is an 'olmo2' file with sliding-window layers (OLMo 3), which llama-ane does "
                      "not export", supported=True)


FAMILY = Family("olmo2", "Olmo2", attention_bias_flag=True, qk_norm=True, qk_norm_across_heads=True, post_norms=True,
                gguf=GGUFArch("olmo2", "OLMo 2", read=read_gguf))
