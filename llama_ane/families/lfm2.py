"""LFM2 (LFM2, LFM2.5): a short convolution (conv_layers) in place of attention in most layers; its
attention layers normalize each q and k head. Its config and checkpoints name some fields and
tensors their own way."""

from __future__ import annotations

from typing import Any

from .base import Family, GGUFArch
from .fields import ConfigError, Fields

# config.json's own names of the other families' fields, and Lfm2Config's defaults
ALIASES = {"norm_eps": "rms_norm_eps", "tie_embedding": "tie_word_embeddings", "block_ff_dim": "intermediate_size"}
DEFAULTS = {"tie_word_embeddings": True, "rope_theta": 1_000_000.0, "rms_norm_eps": 1e-5}
CONV_TENSORS = {  # our name in model.layers.short_conv.ConvLayer -> its name inside model.layers.N (a conv layer)
    "input_layernorm.weight": "operator_norm.weight",
    "conv.in_proj.weight": "conv.in_proj.weight",
    "conv.conv.weight": "conv.conv.weight",
    "conv.out_proj.weight": "conv.out_proj.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "feed_forward.w1.weight",
    "mlp.up_proj.weight": "feed_forward.w3.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
}
CONV_BIASES = {"conv.in_proj.bias": "conv.in_proj.bias", "conv.conv.bias": "conv.conv.bias",
               "conv.out_proj.bias": "conv.out_proj.bias"}  # where conv_bias is set
# its attention layers: the Llama block's names where it has its own (its norms and MLP as in its
# conv layers, the output projection, the per-head q/k norms)
ATTENTION_NAMES = {ours: CONV_TENSORS[ours] for ours in
                   ("input_layernorm.weight", "post_attention_layernorm.weight", "mlp.gate_proj.weight",
                    "mlp.up_proj.weight", "mlp.down_proj.weight")}
ATTENTION_NAMES.update({"o_proj.weight": "self_attn.out_proj.weight", "q_norm.weight": "self_attn.q_layernorm.weight",
                        "k_norm.weight": "self_attn.k_layernorm.weight"})


def prepare(f: Fields) -> dict[str, Any]:
    """config.json in the other families' field names: its aliases renamed, Lfm2Config's defaults
    filled in, and `intermediate_size` the MLP's real width, as transformers' Lfm2MLP computes it
    (block_auto_adjust_ff_dim: two thirds of it, times block_ffn_dim_multiplier, rounded up to a
    multiple of block_multiple_of)."""
    d = {ALIASES.get(k, k): v for k, v in f.d.items()}
    d = {**DEFAULTS, **{k: v for k, v in d.items() if v is not None or k == "block_ffn_dim_multiplier"}}
    if "rope_theta" in (d.get("rope_parameters") or {}):
        del d["rope_theta"]  # the base rope_parameters gives, not Lfm2Config's default
    g = Fields(d, f.origin)
    width = g.integer("intermediate_size", 12288)
    if g.boolean("block_auto_adjust_ff_dim") if "block_auto_adjust_ff_dim" in d else True:
        width = int(2 * width / 3)
        if d.get("block_ffn_dim_multiplier", 1.0) is not None:
            multiple = g.integer("block_multiple_of", 256)
            width = multiple * ((int(g.number("block_ffn_dim_multiplier", 1.0) * width) + multiple - 1) // multiple)
    return {**d, "intermediate_size": width}


def conv_fields(f: Fields) -> dict[str, Any]:
    """The conv layers (those `layer_types` names "conv", or all but `full_attn_idxs`), their kernel
    (conv_L_cache) and whether they have biases (conv_bias)."""
    layers = f.integer("num_hidden_layers")
    types = f.d.get("layer_types")
    if types is None:
        full = f.d.get("full_attn_idxs")
        if not (isinstance(full, list) and all(type(n) is int and 0 <= n < layers for n in full)):
            raise ConfigError(f"{f.origin}: neither layer_types nor full_attn_idxs (the attention layers' "
                              "indices) says which layers are conv layers; add layer_types")
        types = ["full_attention" if n in full else "conv" for n in range(layers)]
    f.layer_types(types, ("conv", "full_attention"))
    return {"conv_layers": [n for n, t in enumerate(types) if t == "conv"],
            "conv_kernel": f.integer("conv_L_cache", 3, minimum=2), "conv_bias": f.boolean("conv_bias")}


def write(cfg: Any, d: dict[str, Any]) -> dict[str, Any]:
    """The MLP width as it is (already adjusted), LFM2's own names."""
    d.update(layer_types=["conv" if cfg.convolves(n) else "full_attention" for n in range(cfg.num_hidden_layers)],
             conv_L_cache=cfg.conv_kernel, conv_bias=cfg.conv_bias, block_auto_adjust_ff_dim=False,
             norm_eps=cfg.rms_norm_eps)
    del d["hidden_act"], d["attention_bias"], d["mlp_bias"], d["sliding_window"], d["rms_norm_eps"]
    return d


def read_gguf(g: Any, cfg: dict[str, Any]) -> None:
    """The conv layers (head_count_kv 0, as llama.cpp reads them), their kernel (shortconv.l_cache),
    biases where the file holds them, and the MLP width as written (already adjusted: llama.cpp's
    converter writes the width Lfm2MLP computes)."""
    kv = g.kv_heads(cfg["num_attention_heads"])
    cfg["layer_types"] = ["full_attention" if n else "conv" for n in kv]
    cfg["conv_L_cache"] = g.meta("lfm2.shortconv.l_cache")
    cfg["conv_bias"] = any(n.endswith("shortconv.in_proj.bias") for n in g.file_names)
    cfg["block_auto_adjust_ff_dim"] = False


FAMILY = Family("lfm2", "Lfm2", label="LFM2", qk_norm=True, prepare=prepare, extras=conv_fields, write=write,
                quality_model=False,  # the measuring model has attention layers only, and model.norm
                final_norm="model.embedding_norm.weight", attention_names=ATTENTION_NAMES,
                gguf=GGUFArch("lfm2", "LFM2, LFM2.5", squeezed_conv=True, conv_kv=True, read=read_gguf))
