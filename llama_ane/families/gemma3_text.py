"""Gemma 3's text model: both the input and the output of attention and of the MLP normalized (four
norms a layer), every norm weight stored as w for a scale of (1 + w), the embeddings scaled by
sqrt(hidden_size), a GeLU (tanh) MLP, an attention scale of query_pre_attn_scalar ** -0.5, each q
and k head normalized, and local RoPE (its own base, no scaling) on its sliding-window layers."""

from __future__ import annotations

from typing import Any

from .base import Family, GGUFArch
from .fields import ConfigError, Fields, filled, json_type, layer_type_rope

# transformers' Gemma3TextConfig defaults, where config.json leaves a field out
DEFAULTS = {"head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 4096, "sliding_window_pattern": 6,
            "rms_norm_eps": 1e-6, "tie_word_embeddings": True}
ROPE = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}  # its default bases
# Gemma's residual stream grows past fp16's 65504 in the published checkpoints (activations near
# 8e5), and its MLP's gate * up product overflows before down_proj. Every norm of a Gemma layer is
# scale invariant, so the stream (the embeddings and what the post-norms add to it) and the two
# branches' outputs before their post-norms (o_proj, up_proj) are carried times this power of two,
# with each norm's eps times its square: the same numbers in any precision (a power of two scales
# exactly), and finite in fp16.
STREAM_SCALE = 2.0 ** -6
SWA_PATTERN = 6  # llama.cpp's Gemma 3: every sixth layer global, the rest sliding, where the file says nothing
LOCAL_THETA = 10_000.0  # and the sliding layers' RoPE base
LAYERS_27B = 62  # the one Gemma 3 whose attention scale llama.cpp takes from hidden_size / heads


def prepare(f: Fields) -> dict[str, Any]:
    """Gemma3TextConfig's defaults filled in, and the options the export does not build refused by
    name (Gemma 2's softcapping is off in every Gemma 3 checkpoint; the embedding models attend both ways)."""
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if f.d.get(name) is not None:
            raise ConfigError(f"{f.origin}: {name} is {json_type(f.d[name])}; the export does not do logit "
                              "softcapping (Gemma 3 leaves it null)")
    if f.boolean("use_bidirectional_attention"):
        raise ConfigError(f"{f.origin}: use_bidirectional_attention is true; the export builds causal language "
                          "models only")
    return filled(f.d, DEFAULTS)


def rope(f: Fields, rope: dict[str, Any]) -> tuple[dict[str, Any], float]:
    """The global RoPE parameters (rope_theta and its scaling, in the form the other families use)
    and the local base of the sliding layers, from transformers 5's `rope_parameters` per layer type
    or transformers 4's rope_theta / rope_scaling / rope_local_base_freq."""
    if "full_attention" in rope or "sliding_attention" in rope:
        return layer_type_rope(f, rope, ROPE["full_attention"], ROPE["sliding_attention"])
    if f.number("rope_theta", None) is None:
        rope = {**rope, "rope_theta": ROPE["full_attention"]}
    return rope, f.number("rope_local_base_freq", ROPE["sliding_attention"])


def window_pattern(f: Fields, layers: int) -> list[int]:
    """The sliding layers where layer_types does not name them: all but every sliding_window_pattern-th."""
    pattern = f.integer("sliding_window_pattern")
    return [n for n in range(layers) if (n + 1) % pattern]


def scales(f: Fields) -> dict[str, Any]:
    """The embedding scale sqrt(hidden_size) and the attention scale query_pre_attn_scalar ** -0.5."""
    return {"embedding_multiplier": f.integer("hidden_size") ** 0.5,
            "attention_scale": f.number("query_pre_attn_scalar") ** -0.5}


def whole(x: float) -> float | int:
    """`x` as an int where it is one (a config field transformers types as int), else as it is."""
    return int(round(x)) if abs(x - round(x)) < 1e-6 * max(1.0, abs(x)) else x


def write(cfg: Any, d: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's own names, its scales as the fields they come from."""
    del d["hidden_act"]
    d.update(hidden_activation=cfg.hidden_act, rope_local_base_freq=cfg.rope_local_theta,
             query_pre_attn_scalar=whole(cfg.query_scale ** -2), final_logit_softcapping=None,
             attn_logit_softcapping=None, sliding_window=cfg.sliding_window or cfg.max_position_embeddings)
    if not cfg.sliding_layers:
        d["layer_types"] = ["full_attention"] * cfg.num_hidden_layers
    return d


def read_gguf(g: Any, cfg: dict[str, Any]) -> None:
    """The sliding layers (the file's pattern, else llama.cpp's every-sixth-global), their RoPE base
    (rope.freq_base_swa, else llama.cpp's 10000), and the attention scale, which no key holds:
    llama.cpp uses the head size but for the 27B model, whose scale is hidden / heads."""
    m = lambda key, default=None: g.meta(f"gemma3.{key}", default)  # noqa: E731
    layers = cfg["num_hidden_layers"]
    cfg["hidden_activation"] = "gelu_pytorch_tanh"
    cfg["rope_local_base_freq"] = m("rope.freq_base_swa", LOCAL_THETA)
    cfg["query_pre_attn_scalar"] = (cfg["hidden_size"] // cfg["num_attention_heads"]
                                    if layers == LAYERS_27B else cfg["head_dim"])
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):  # the config refuses them by name
        if (value := m(key)) is not None:
            cfg[key] = value
    window = m("attention.sliding_window")
    pattern = g.meta_list("gemma3.attention.sliding_window_pattern")
    if pattern is not None and len(pattern) == 1 and not isinstance(pattern[0], bool):
        pattern = [(n + 1) % pattern[0] != 0 for n in range(layers)]
    elif pattern is None:
        pattern = [(n + 1) % SWA_PATTERN != 0 for n in range(layers)]
    if len(pattern) != layers:
        raise g.error(f"{g.path}: gemma3.attention.sliding_window_pattern lists {len(pattern)} layers, "
                      f"the model has {layers}; convert the model again")
    if not window:
        pattern = [False] * layers
    cfg["sliding_window"] = window or cfg["max_position_embeddings"]
    cfg["layer_types"] = ["sliding_attention" if s else "full_attention" for s in pattern]


FAMILY = Family("gemma3_text", "Gemma3", label="Gemma 3's text model", module="gemma3",
                multimodal=("gemma3", "Gemma 3's text model"),
                activation="gelu_pytorch_tanh", activation_field="hidden_activation", attention_bias_flag=True,
                qk_norm=True, sandwich_norms=True, unit_offset_norms=True, local_rope=True, stream_scale=STREAM_SCALE,
                window_layers=window_pattern, prepare=prepare, rope=rope, extras=scales, write=write,
                gguf=GGUFArch("gemma3", "Gemma 3's text model", norm_offset=1.0, read=read_gguf))
