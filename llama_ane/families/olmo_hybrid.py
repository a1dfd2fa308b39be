"""OLMo-Hybrid: Gated DeltaNet (linear-attention) layers, three of every four by default, beside OLMo 3's
attention layers (outputs of attention and MLP normalized, q and k normalized over the whole
projection, no sliding window). Its linear-attention layers are Qwen3.5's (model.layers.delta_net)
with their inputs normalized, q, k and v projected apart (the rows of our in_proj_qkv), beta scaled
by 2 (linear_allow_neg_eigval: beta in [0, 2]) and the gated norm's eps fixed at 1e-5. A config whose
RoPE base is null rotates nothing (as the released models): every attention layer is then NoPE.

llama.cpp has no OLMo-Hybrid architecture: a GGUF of one is refused as any unknown architecture is."""

from __future__ import annotations

from typing import Any

from .base import Family
from .fields import ConfigError, Fields, filled

# OlmoHybridConfig's defaults, where config.json leaves a field out (the linear-attention widths
# follow from others: `delta_fields`)
DEFAULTS = {"rms_norm_eps": 1e-6, "max_position_embeddings": 65536, "linear_conv_kernel_dim": 4}
GATE_EPS = 1e-5  # its gated norm's eps (OlmoHybridGatedDeltaNet's o_norm, FLA's default), whatever rms_norm_eps
NEG_EIGVAL_SCALE = 2.0  # beta's scale with linear_allow_neg_eigval
PATTERN = 4  # where layer_types is absent: every fourth layer attention, the rest linear

# How its checkpoints store its layers (transformers' conversion mapping for olmo_hybrid, which
# save_pretrained writes): the norms before attention and MLP as attention_layer_norm and
# feedforward_layer_norm, the convolution's kernel as one part each for q, k and v.
# transformers' name inside model.layers.N -> the stored name, or the parts it concatenates
STORED_NAMES = {
    "input_layernorm.weight": "attention_layer_norm.weight",
    "post_attention_layernorm.weight": "feedforward_layer_norm.weight",
    "linear_attn.conv1d.weight": ("linear_attn.q_conv1d.weight", "linear_attn.k_conv1d.weight",
                                  "linear_attn.v_conv1d.weight"),
}
# its linear-attention layers: our name in model.layers.delta_net.DeltaLayer -> its stored name inside model.layers.N
DELTA_TENSORS = {
    "input_layernorm.weight": STORED_NAMES["input_layernorm.weight"],
    "linear_attn.in_proj_z.weight": "linear_attn.g_proj.weight",
    "linear_attn.in_proj_b.weight": "linear_attn.b_proj.weight",
    "linear_attn.in_proj_a.weight": "linear_attn.a_proj.weight",
    "linear_attn.dt_bias": "linear_attn.dt_bias",
    "linear_attn.A_log": "linear_attn.A_log",
    "linear_attn.norm.weight": "linear_attn.o_norm.weight",
    "linear_attn.out_proj.weight": "linear_attn.o_proj.weight",
    "post_attention_layernorm.weight": STORED_NAMES["post_attention_layernorm.weight"],
    "mlp.gate_proj.weight": "mlp.gate_proj.weight",
    "mlp.up_proj.weight": "mlp.up_proj.weight",
    "mlp.down_proj.weight": "mlp.down_proj.weight",
}
# ours stored as parts stacked by rows (q, k, then v: the channels its convolution runs over), with
# their shapes as LlamaConfig attribute names: in_proj_qkv its q, k and v projections; the kernel its
# q, k and v kernels, of any rows (None: transformers' save_pretrained splits the kernel in three
# equal parts, which its loading concatenates back; their total is checked)
_KEYS, _VALUES = "delta_key_channels", "delta_value_channels"
DELTA_PARTS = {
    "linear_attn.in_proj_qkv.weight": tuple((f"linear_attn.{p}_proj.weight", (rows, "hidden_size"))
                                            for p, rows in (("q", _KEYS), ("k", _KEYS), ("v", _VALUES))),
    "linear_attn.conv1d.weight": tuple((name, None) for name in STORED_NAMES["linear_attn.conv1d.weight"]),
}
# its attention layers: the norm of attention's output (OLMo 3's post_attention_layernorm) as stored
ATTENTION_NAMES = {"post_attention_layernorm.weight": STORED_NAMES["post_attention_layernorm.weight"]}


def prepare(f: Fields) -> dict[str, Any]:
    """Its defaults filled in; a null RoPE base kept (as a top-level rope_theta: null, RoPE's other
    fields dropped: nothing rotates)."""
    d = filled(f.d, DEFAULTS)
    if without_rope(f):
        d.pop("rope_parameters", None)
        d.update(rope_theta=None, rope_scaling=None)
    return d


def layer_types(f: Fields) -> list[str]:
    """`layer_types`, or OlmoHybridConfig's default: every fourth layer attention (the last one where
    there are fewer than four)."""
    layers = f.integer("num_hidden_layers")
    types = f.d.get("layer_types")
    if types is None:
        types = ["full_attention" if n % PATTERN == PATTERN - 1 else "linear_attention" for n in range(layers)]
        if "full_attention" not in types:
            types[-1] = "full_attention"
    f.layer_types(types, ("linear_attention", "full_attention"))
    if len(set(types)) < 2:
        raise ConfigError(f"{f.origin}: layer_types lists only \"{types[0]}\" layers; OLMo-Hybrid has both "
                          "\"linear_attention\" and \"full_attention\" layers")
    return types


def without_rope(f: Fields) -> bool:
    """Whether the config's RoPE base is null (rope_theta, at the top or in rope_parameters): then
    OlmoHybridModel has no rotary embedding."""
    rope = f.d.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" in rope:
        return rope["rope_theta"] is None
    return "rope_theta" in f.d and f.d["rope_theta"] is None


def delta_fields(f: Fields) -> dict[str, Any]:
    """The linear-attention layers and their sizes (OlmoHybridConfig's defaults where absent), beta's
    scale, the gated norm's eps, and the NoPE attention layers."""
    types = layer_types(f)
    heads, hidden = f.integer("num_attention_heads"), f.integer("hidden_size")
    k_heads = f.integer("linear_num_key_heads", heads)
    v_heads = f.integer("linear_num_value_heads", heads)
    dk = f.integer("linear_key_head_dim", int(0.75 * hidden / k_heads))
    allow = f.d.get("linear_allow_neg_eigval", True)
    if not isinstance(allow, bool):
        raise f.refuse("linear_allow_neg_eigval", allow, "true or false")
    if "head_dim" in f.d and f.d["head_dim"] is not None and f.d["head_dim"] != hidden // heads:
        raise ConfigError(f"{f.origin}: head_dim is {f.d['head_dim']}; OLMo-Hybrid's attention heads are "
                          f"hidden_size / num_attention_heads ({hidden // heads}) wide: drop head_dim")
    attention = [n for n, t in enumerate(types) if t == "full_attention"]
    return {"delta_layers": [n for n, t in enumerate(types) if t == "linear_attention"],
            "conv_kernel": f.integer("linear_conv_kernel_dim", minimum=2),
            "delta_key_heads": k_heads, "delta_value_heads": v_heads, "delta_key_dim": dk,
            "delta_value_dim": f.integer("linear_value_head_dim", 2 * dk),
            "delta_beta_scale": NEG_EIGVAL_SCALE if allow else 1.0, "delta_norm_eps": GATE_EPS,
            "nope_layers": attention if without_rope(f) else []}


def write(cfg: Any, d: dict[str, Any]) -> dict[str, Any]:
    """OlmoHybridConfig's names; a null RoPE base where no layer rotates."""
    attention = [n for n in range(cfg.num_hidden_layers) if not cfg.linear(n)]
    rotates = any(cfg.rotary(n) for n in attention)
    d.update(layer_types=["linear_attention" if cfg.linear(n) else "full_attention"
                          for n in range(cfg.num_hidden_layers)],
             linear_conv_kernel_dim=cfg.conv_kernel, linear_num_key_heads=cfg.delta_key_heads,
             linear_num_value_heads=cfg.delta_value_heads, linear_key_head_dim=cfg.delta_key_dim,
             linear_value_head_dim=cfg.delta_value_dim, linear_allow_neg_eigval=cfg.delta_beta_scale != 1.0,
             rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta if rotates else None,
                              **(cfg.rope_scaling or {})})
    for name in ("mlp_bias", "sliding_window", "rope_theta", "rope_scaling", "head_dim"):
        d.pop(name, None)
    return d


FAMILY = Family("olmo_hybrid", "OlmoHybrid", label="OLMo-Hybrid: Gated DeltaNet and OLMo 3 attention layers",
                classes={"DecoderLayer": "OlmoHybridAttentionDecoderLayer",
                         "LinearDecoderLayer": "OlmoHybridLinearAttentionDecoderLayer"},
                attention_bias_flag=True, qk_norm=True, qk_norm_across_heads=True, post_norms=True, window=False,
                prepare=prepare, extras=delta_fields, write=write,
                delta_rule_module="transformers.models.olmo_hybrid.modeling_olmo_hybrid",
                quality_model=False,  # two transformers classes of decoder layer: --quantize auto cannot measure it
                attention_names=ATTENTION_NAMES, delta_tensors=DELTA_TENSORS,
                delta_parts=DELTA_PARTS, stored_names=STORED_NAMES)
