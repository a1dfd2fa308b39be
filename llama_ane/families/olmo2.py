"""OLMo 2: the outputs of attention and MLP normalized instead of their inputs
(post_attention_layernorm, post_feedforward_layernorm), and q and k over the whole projection,
all heads at once."""

from __future__ import annotations

from typing import Any

from .base import Family, GGUFArch


def read_gguf(g: Any, cfg: dict[str, Any]) -> None:
    """An 'olmo2' file with a sliding window is OLMo 3 (llama.cpp writes both as one architecture):
    its sliding layers from the file's pattern, each layer type's RoPE base from rope.freq_base and
    rope.freq_base_swa."""
    window = g.meta("olmo2.attention.sliding_window", None)
    if window is None:
        return
    layers = cfg["num_hidden_layers"]
    pattern = g.meta_list("olmo2.attention.sliding_window_pattern")
    if pattern is None or len(pattern) != layers or not all(isinstance(p, bool) for p in pattern):
        raise g.error(f"{g.path}: an 'olmo2' file with a sliding window (OLMo 3) must list "
                      f"olmo2.attention.sliding_window_pattern for its {layers} layers, one true or false each; "
                      "convert the model again")
    full = {"rope_type": "default", "rope_theta": cfg.pop("rope_theta"), **cfg.pop("rope_scaling", {})}
    sliding = {"rope_type": "default", "rope_theta": g.meta("olmo2.rope.freq_base_swa", full["rope_theta"])}
    cfg.update(model_type="olmo3", sliding_window=window,
               layer_types=["sliding_attention" if s else "full_attention" for s in pattern],
               rope_parameters={"full_attention": full, "sliding_attention": sliding})


FAMILY = Family("olmo2", "Olmo2", label="OLMo 2", attention_bias_flag=True, qk_norm=True,
                qk_norm_across_heads=True, post_norms=True,
                gguf=GGUFArch("olmo2", "OLMo 2", read=read_gguf))
