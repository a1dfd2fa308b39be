"""LFM3: LFM2's short-convolution layers beside attention layers, each layer's operator and MLP with
norms on both sides (sandwich norms), attention as Qwen3's (q and k normalized per head) with a
sigmoid gate per query head on its output (g_proj), and sliding-window attention layers beside the
global ones (layer_types: "conv", "sliding_attention", "full_attention"), each attention type with
its own RoPE: the sliding layers' default one, the global layers' proportional one (the first
partial_rotary_factor of the frequencies rotate, the rest are zero). Its MLP is as wide as
intermediate_size says (no LFM2 adjustment).

llama.cpp has no LFM3 architecture: a GGUF file is refused by its general.architecture."""

from __future__ import annotations

from typing import Any

from .base import Family
from .fields import ConfigError, Fields, filled, json_type, layer_type_rope

ALIASES = {"norm_eps": "rms_norm_eps"}  # Lfm3Config's attribute_map
THETA = 1_000_000.0  # Lfm3Config.default_theta: a layer type's base where its rope_parameters gives none
# Lfm3Config's defaults, where config.json leaves a field out
DEFAULTS = {"tie_word_embeddings": True, "rms_norm_eps": 1e-5, "head_dim": 128, "sliding_window": 256,
            "conv_L_cache": 7, "use_sandwich_norm": True, "use_attention_gate": True}
ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {"rope_type": "proportional", "rope_theta": THETA, "partial_rotary_factor": 0.5}}
KINDS = ("conv", "sliding_attention", "full_attention")
NORMS_AND_MLP = {  # our name -> its name inside model.layers.N, conv and attention layers alike
    "input_layernorm.weight": "operator_norm.weight",
    "post_attention_layernorm.weight": "post_operator_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffn_norm.weight",
    "mlp.gate_proj.weight": "feed_forward.w1.weight",
    "mlp.up_proj.weight": "feed_forward.w3.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
}
ATTENTION_NAMES = {**NORMS_AND_MLP, "g_proj.weight": "self_attn.gate_proj.weight"}  # as its checkpoints store it
STORED = {f"self_attn.g_proj.{p}": f"self_attn.gate_proj.{p}" for p in ("weight", "bias")}  # Lfm3Attention's -> its checkpoints'
CONV_NAMES = {**NORMS_AND_MLP, **{name: name for name in ("conv.in_proj.weight", "conv.conv.weight",
                                                          "conv.out_proj.weight")}}


def default_layer_types(layers: int) -> list[str]:
    """Lfm3Config's layer types where config.json has none: every fourth layer from the third global,
    every fourth from the fifth sliding, the rest conv."""
    return ["full_attention" if n % 4 == 2 else "sliding_attention" if n % 4 == 0 and n else "conv"
            for n in range(layers)]


def prepare(f: Fields) -> dict[str, Any]:
    """config.json in the other families' field names (norm_eps as rms_norm_eps), Lfm3Config's defaults
    filled in (its layer types, its RoPE per layer type), and what the export does not build refused
    by name. Lfm3Config reads its RoPE from rope_parameters only (a top-level rope_theta is ignored)."""
    d = filled({ALIASES.get(k, k): v for k, v in f.d.items()}, DEFAULTS)
    g = Fields(d, f.origin)
    if not g.boolean("use_sandwich_norm"):
        raise ConfigError(f"{f.origin}: use_sandwich_norm is false; the export builds LFM3's layers with their "
                          "norms on both sides of the operator and the MLP only (use_sandwich_norm true)")
    types = d.get("layer_types")
    if types is None:
        types = default_layer_types(g.integer("num_hidden_layers"))
    g.layer_types(types, KINDS)
    if "sliding_attention" in types and "sliding_window" in f.d and f.d["sliding_window"] is None:
        raise ConfigError(f"{f.origin}: sliding_window is null; the export builds LFM3's sliding_attention layers "
                          "with a window (Lfm3Config's default is 256): set sliding_window")
    rope = d.get("rope_parameters")
    rope = dict(ROPE) if rope is None else rope
    if not isinstance(rope, dict) or any(not isinstance(rope.get(t), dict) for t in set(types) - {"conv"}):
        raise ConfigError(f"{f.origin}: rope_parameters is {json_type(rope)}; LFM3's has an object for each "
                          "attention layer type its layer_types lists (full_attention, sliding_attention)")
    d = {k: v for k, v in d.items() if k not in ("rope_theta", "rope_scaling", "partial_rotary_factor")}
    return {**d, "layer_types": types, "rope_parameters": {t: rope.get(t, ROPE[t]) for t in ROPE}}


def rope(f: Fields, rope: dict[str, Any]) -> tuple[dict[str, Any], float]:
    """The global layers' base (a proportional RoPE's factor as linear scaling: it divides the same
    frequencies) and the sliding layers' base; the proportion goes to rope_proportion (`extras`)."""
    full, local = layer_type_rope(f, rope, THETA, THETA)
    kind = full.get("rope_type", "default")
    where = f"{f.origin} rope_parameters.full_attention"
    if kind not in ("default", "proportional"):
        raise ConfigError(f"{where} has rope_type {kind!r}; the export builds LFM3's global layers with the "
                          "proportional (or default) RoPE")
    if kind == "default" and full.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError(f"{where} has rope_type 'default' with partial_rotary_factor "
                          f"{full['partial_rotary_factor']!r}; the export builds a part of the frequencies rotating "
                          "on LFM3's global layers as the proportional RoPE only")
    ff = Fields(full, where)
    out = {"rope_theta": ff.number("rope_theta")}
    factor = ff.number("factor", 1.0) if kind == "proportional" else 1.0
    if factor != 1.0:
        out.update(rope_type="linear", factor=factor)
    return out, local


def extras(f: Fields) -> dict[str, Any]:
    """The conv layers, their kernel (conv_L_cache) and biases (conv_bias), the attention gate
    (use_attention_gate) and the global layers' proportion of rotating frequencies."""
    types, full = f.d["layer_types"], f.d["rope_parameters"]["full_attention"]
    proportion = 1.0
    if full.get("rope_type") == "proportional":
        proportion = Fields(full, f"{f.origin} rope_parameters.full_attention").number("partial_rotary_factor", 1.0)
    return {"conv_layers": [n for n, t in enumerate(types) if t == "conv"],
            "conv_kernel": f.integer("conv_L_cache", minimum=2), "conv_bias": f.boolean("conv_bias"),
            "attn_head_gate": f.boolean("use_attention_gate"), "rope_proportion": proportion}


def write(cfg: Any, d: dict[str, Any]) -> dict[str, Any]:
    """Lfm3Config's names: the layer types, the RoPE per layer type, the conv layers' kernel and biases,
    the gate and the norms."""
    full = {"rope_type": "proportional", "rope_theta": cfg.rope_theta, "partial_rotary_factor": cfg.rope_proportion,
            **({"factor": cfg.rope_scaling["factor"]} if cfg.rope_scaling else {})}
    local = cfg.rope_local_theta if cfg.rope_local_theta is not None else cfg.rope_theta
    for name in ("hidden_act", "mlp_bias", "rope_theta", "rope_scaling", "partial_rotary_factor", "rms_norm_eps"):
        d.pop(name, None)
    d.update(layer_types=["conv" if cfg.convolves(n) else "sliding_attention" if cfg.slides(n) else "full_attention"
                          for n in range(cfg.num_hidden_layers)],
             rope_parameters={"full_attention": full, "sliding_attention": {"rope_type": "default", "rope_theta": local}},
             conv_L_cache=cfg.conv_kernel, conv_bias=cfg.conv_bias, norm_eps=cfg.rms_norm_eps,
             use_sandwich_norm=True, use_attention_gate=cfg.attn_head_gate)
    return d


FAMILY = Family("lfm3", "Lfm3", label="LFM3", attention_bias_flag=True, qk_norm=True, sandwich_norms=True,
                other_layer_types=("conv",), prepare=prepare, rope=rope, extras=extras, write=write,
                final_norm="model.embedding_norm.weight", attention_names=ATTENTION_NAMES, conv_names=CONV_NAMES,
                stored_names=STORED, quality_model=False)  # the measuring model has attention layers only, and model.norm
