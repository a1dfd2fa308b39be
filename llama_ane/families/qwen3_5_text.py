"""Qwen3.5's text model: a Gated DeltaNet (linear attention, delta_layers) in most layers; its
attention layers gate their output by a second half of q_proj (attn_output_gate), normalize each q
and k head, and rotate the first quarter of each head; every norm but the DeltaNet's own gated one
scales by (1 + w)."""

from __future__ import annotations

from typing import Any

from .base import Family
from .fields import ConfigError, Fields, filled

# Qwen3_5TextConfig's defaults, where config.json leaves a field out
DEFAULTS = {"head_dim": 256, "rms_norm_eps": 1e-6, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
            "linear_value_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
            "full_attention_interval": 4, "max_position_embeddings": 32768}
ROTARY = 0.25  # its partial_rotary_factor where neither config.json nor its rope_parameters gives one
# its own LlamaConfig fields: a manifest holds them only where they differ from their defaults
OWN_FIELDS = ("delta_layers", "delta_key_heads", "delta_value_heads", "delta_key_dim", "delta_value_dim",
              "attn_output_gate")
# its linear-attention layers: our name in model.layers.delta_net.DeltaLayer -> its name inside model.layers.N
DELTA_TENSORS = {
    "input_layernorm.weight": "input_layernorm.weight",
    "linear_attn.in_proj_qkv.weight": "linear_attn.in_proj_qkv.weight",
    "linear_attn.in_proj_z.weight": "linear_attn.in_proj_z.weight",
    "linear_attn.in_proj_b.weight": "linear_attn.in_proj_b.weight",
    "linear_attn.in_proj_a.weight": "linear_attn.in_proj_a.weight",
    "linear_attn.conv1d.weight": "linear_attn.conv1d.weight",
    "linear_attn.dt_bias": "linear_attn.dt_bias",
    "linear_attn.A_log": "linear_attn.A_log",
    "linear_attn.norm.weight": "linear_attn.norm.weight",
    "linear_attn.out_proj.weight": "linear_attn.out_proj.weight",
    "post_attention_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.gate_proj.weight": "mlp.gate_proj.weight",
    "mlp.up_proj.weight": "mlp.up_proj.weight",
    "mlp.down_proj.weight": "mlp.down_proj.weight",
}
# its output-gated attention: q_proj holds each head's query rows, then its gate's; ours are the
# queries (q_proj) and the gates (o_gate), each head's half of its rows
GATED_HALF = {"q_proj.weight": 0, "o_gate.weight": 1}


def prepare(f: Fields) -> dict[str, Any]:
    return filled(f.d, DEFAULTS)


def delta_fields(f: Fields) -> dict[str, Any]:
    """The linear-attention layers (those `layer_types` names "linear_attention"; without it every
    layer but each full_attention_interval-th, as Qwen3_5TextConfig fills it in) and their sizes."""
    layers = f.integer("num_hidden_layers")
    types = f.d.get("layer_types")
    if types is None:
        interval = f.integer("full_attention_interval")
        types = ["linear_attention" if (n + 1) % interval else "full_attention" for n in range(layers)]
    f.layer_types(types, ("linear_attention", "full_attention"))
    if f.boolean("attention_bias"):
        raise ConfigError(f"{f.origin}: attention_bias is true; Qwen3.5's attention and linear-attention "
                          "projections are exported without biases")
    return {"delta_layers": [n for n, t in enumerate(types) if t == "linear_attention"],
            "conv_kernel": f.integer("linear_conv_kernel_dim", minimum=2),
            "delta_key_heads": f.integer("linear_num_key_heads"), "delta_value_heads": f.integer("linear_num_value_heads"),
            "delta_key_dim": f.integer("linear_key_head_dim"), "delta_value_dim": f.integer("linear_value_head_dim"),
            "attn_output_gate": True}


def write(cfg: Any, d: dict[str, Any]) -> dict[str, Any]:
    """Qwen3_5TextConfig's names; its RoPE rotates partial_rotary_factor of a head."""
    d.update(layer_types=["linear_attention" if cfg.linear(n) else "full_attention"
                          for n in range(cfg.num_hidden_layers)],
             linear_conv_kernel_dim=cfg.conv_kernel, linear_num_key_heads=cfg.delta_key_heads,
             linear_num_value_heads=cfg.delta_value_heads, linear_key_head_dim=cfg.delta_key_dim,
             linear_value_head_dim=cfg.delta_value_dim,
             rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta,
                              "partial_rotary_factor": cfg.partial_rotary_factor})
    for name in ("mlp_bias", "sliding_window", "rope_theta", "rope_scaling"):
        d.pop(name, None)
    return d


FAMILY = Family("qwen3_5_text", "Qwen3_5", label="Qwen3.5's text model", module="qwen3_5",
                classes={"RotaryEmbedding": "Qwen3_5TextRotaryEmbedding"},
                multimodal=("qwen3_5", "Qwen3.5's text model: Gated DeltaNet and attention layers"), qk_norm=True,
                unit_offset_norms=True, partial_rotary_factor=ROTARY, own_fields=OWN_FIELDS, prepare=prepare,
                extras=delta_fields, write=write, delta_rule_module="transformers.models.qwen3_5.modeling_qwen3_5",
                delta_tensors=DELTA_TENSORS)
