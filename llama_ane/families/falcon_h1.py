"""Falcon-H1: every layer runs attention and a Mamba-2 mixer side by side (model.layers.mamba2), both on
the layer's normed input, their outputs summed, then a SwiGLU MLP. Its muP-style multipliers are
folded into the weights (`weight_scale`): the mixer's five over in_proj's rows (z, x, B, C, dt) and
its input's, attention's input multiplier into q, k and v and the key multiplier into k, each branch's
output multiplier into its last projection, the MLP's into gate_proj and down_proj. The embedding and
LM-head multipliers are Granite's (LlamaConfig.embedding_multiplier, logits_scaling).

A GGUF of it (llama.cpp's falcon-h1 architecture) holds its weights with every multiplier already folded
in, the embedding's and the LM head's too, and none of them in its metadata: it reads as the same model
with its multipliers 1. Its mixer's gated norm, where the file has one, runs after the gate, as llama.cpp
runs it; its A as -exp(A_log) (read back as log(-A)), D and A as (H, 1), the norm's weight as (groups,
width) and the conv kernel without its middle 1.

Refused by name: biases on the mixer's projections or on attention (no released model has them) and a
time-step limit other than none."""

from __future__ import annotations

import math
from typing import Any

from .base import Family, GGUFArch
from .fields import ConfigError, Fields

# its own LlamaConfig fields: a manifest holds them only where they differ from their defaults
OWN_FIELDS = ("mamba_layers", "mamba_gate", "mamba_multipliers")
# how its checkpoints name the Llama block's tensors: ours -> its name inside model.layers.N
ATTENTION_NAMES = {
    "post_attention_layernorm.weight": "pre_ff_layernorm.weight",
    "mlp.gate_proj.weight": "feed_forward.gate_proj.weight",
    "mlp.up_proj.weight": "feed_forward.up_proj.weight",
    "mlp.down_proj.weight": "feed_forward.down_proj.weight",
}
# its mixer's tensors (model.layers.mamba2.Mamba2Mixer under "mamba."): ours -> its name inside model.layers.N
MAMBA_TENSORS = {name: name for name in (
    "mamba.in_proj.weight", "mamba.conv1d.weight", "mamba.conv1d.bias", "mamba.dt_bias", "mamba.A_log", "mamba.D",
    "mamba.out_proj.weight")}
MAMBA_NORM = {"mamba.norm.weight": "mamba.norm.weight"}  # where mamba_rms_norm is true
# FalconH1Config's multipliers: name -> its default (a list: one factor per part)
MULTIPLIERS = {"attention_in_multiplier": 1.0, "key_multiplier": 1.0, "attention_out_multiplier": 1.0,
               "ssm_in_multiplier": 1.0, "ssm_out_multiplier": 1.0, "mlp_multipliers": [1.0, 1.0],
               "ssm_multipliers": [1.0] * 5}


def _multiplier(f: Fields, name: str, default: Any) -> Any:
    """One multiplier of config.json, checked: a positive number, or a list of len(default) of them."""
    value = f.d.get(name)
    if value is None:
        return default
    if isinstance(default, list):
        if not (isinstance(value, list) and len(value) == len(default) and all(
                not isinstance(v, bool) and isinstance(v, (int, float)) and 0 < v < math.inf for v in value)):
            raise f.refuse(name, value, f"a list of {len(default)} positive numbers")
        return [float(v) for v in value]
    return f.number(name)


def _float(value: Any) -> Any:
    """A number of config.json, as transformers writes one JSON has no literal for ({"__float__": "Infinity"})."""
    if isinstance(value, dict) and set(value) == {"__float__"}:
        try:
            return float(value["__float__"])
        except (TypeError, ValueError):
            return value
    return value


def mamba_fields(f: Fields) -> dict[str, Any]:
    """Every layer's mixer and its sizes (FalconH1Config's defaults where absent), where its gated norm
    sits, and the multipliers; refuses what the export does not build, by field name."""
    hidden, layers = f.integer("hidden_size"), f.integer("num_hidden_layers")
    heads = f.integer("mamba_n_heads", 128)
    expand = f.integer("mamba_expand", 2)
    inner = f.integer("mamba_d_ssm", None) or expand * hidden
    head_dim = f.d.get("mamba_d_head", "auto")
    head_dim = inner // heads if head_dim in ("auto", None) else f.integer("mamba_d_head")
    if head_dim * heads != inner:
        raise ConfigError(f"{f.origin}: mamba_n_heads ({heads}) times mamba_d_head ({head_dim}) is not mamba_d_ssm "
                          f"({inner}); fix one of them")
    groups = f.integer("mamba_n_groups", 1)
    if heads % groups:
        raise ConfigError(f"{f.origin}: mamba_n_heads ({heads}) must be a multiple of mamba_n_groups ({groups})")
    for name in ("mamba_proj_bias", "projectors_bias", "attention_bias"):
        if f.boolean(name):
            raise ConfigError(f"{f.origin}: {name} is true; Falcon-H1's mixer and attention projections are "
                              "exported without biases")
    limit = f.d.get("time_step_limit")
    if limit is not None and [_float(v) for v in limit or ()] != [0.0, math.inf]:
        raise f.refuse("time_step_limit", limit, "absent or [0.0, Infinity] (no limit): a clamped time step is "
                       "not exported")
    rms = f.d.get("mamba_rms_norm", False)
    before = f.d.get("mamba_norm_before_gate", True)
    for name, value in (("mamba_rms_norm", rms), ("mamba_norm_before_gate", before)):
        if not isinstance(value, bool):
            raise f.refuse(name, value, "true or false")
    lm_head = f.number("lm_head_multiplier", 1.0)
    return {"mamba_layers": list(range(layers)), "conv_kernel": f.integer("mamba_d_conv", 4, minimum=2),
            "conv_bias": f.d.get("mamba_conv_bias", True) is True,
            "delta_key_heads": groups, "delta_value_heads": heads, "delta_key_dim": f.integer("mamba_d_state", 256),
            "delta_value_dim": head_dim, "mamba_gate": ("before" if before else "after") if rms else None,
            "mamba_multipliers": {name: _multiplier(f, name, default) for name, default in MULTIPLIERS.items()},
            "embedding_multiplier": f.number("embedding_multiplier", 1.0), "logits_scaling": 1.0 / lm_head}


def weight_scale(cfg: Any, ours: str) -> float | list[float] | None:
    """The factor folded into our tensor `ours` of a decoder layer (a list: one per row), or None."""
    m = {**MULTIPLIERS, **cfg.mamba_multipliers}
    attention_in = m["attention_in_multiplier"]
    if ours == "mamba.in_proj.weight":
        z, x, b, c, dt = m["ssm_multipliers"]
        inner, states = cfg.delta_value_channels, cfg.delta_key_channels
        rows = [z] * inner + [x] * inner + [b] * states + [c] * states + [dt] * cfg.delta_value_heads
        return [r * m["ssm_in_multiplier"] for r in rows]
    return {"q_proj.weight": attention_in, "k_proj.weight": attention_in * m["key_multiplier"],
            "v_proj.weight": attention_in, "o_proj.weight": m["attention_out_multiplier"],
            "mamba.out_proj.weight": m["ssm_out_multiplier"], "mlp.gate_proj.weight": m["mlp_multipliers"][0],
            "mlp.down_proj.weight": m["mlp_multipliers"][1]}.get(ours)


def mamba_tensors(cfg: Any) -> dict[str, str]:
    """Its mixer's tensors in a layer of `cfg`: ours -> its name inside model.layers.N."""
    out = {**MAMBA_TENSORS, **(MAMBA_NORM if cfg.mamba_gate else {})}
    return out if cfg.conv_bias else {ours: hf for ours, hf in out.items() if ours != "mamba.conv1d.bias"}


def write(cfg: Any, d: dict[str, Any]) -> dict[str, Any]:
    """FalconH1Config's names."""
    m = {**MULTIPLIERS, **cfg.mamba_multipliers}
    d.update(mamba_d_ssm=cfg.delta_value_channels, mamba_n_heads=cfg.delta_value_heads,
             mamba_d_head=cfg.delta_value_dim, mamba_n_groups=cfg.delta_key_heads, mamba_d_state=cfg.delta_key_dim,
             mamba_d_conv=cfg.conv_kernel, mamba_conv_bias=cfg.conv_bias, mamba_proj_bias=False,
             projectors_bias=False, mamba_rms_norm=cfg.mamba_gate is not None,
             mamba_norm_before_gate=cfg.mamba_gate != "after", embedding_multiplier=cfg.embedding_multiplier,
             lm_head_multiplier=1.0 / cfg.logits_scaling, **m)
    for name in ("sliding_window",):
        d.pop(name, None)
    return d


def read_gguf(g: Any, cfg: dict[str, Any]) -> None:
    """The mixer's sizes from {arch}.ssm.* (its heads are ssm.time_step_rank), its conv bias and gated
    norm where the file holds them (the norm after the gate); the multipliers are in the weights."""
    ssm = lambda key: g.meta(f"{g.arch_name}.ssm.{key}")  # noqa: E731
    inner, heads = ssm("inner_size"), ssm("time_step_rank")
    if not heads or inner % heads:
        raise g.error(f"{g.path}: {g.arch_name}.ssm.inner_size ({inner}) is not a multiple of "
                      f"{g.arch_name}.ssm.time_step_rank ({heads}, the mixer's heads); convert the model again")
    norm = any(n.endswith(".ssm_norm.weight") for n in g.file_names)
    cfg.update(mamba_d_ssm=inner, mamba_n_heads=heads, mamba_d_head=inner // heads,
               mamba_n_groups=ssm("group_count"), mamba_d_state=ssm("state_size"), mamba_d_conv=ssm("conv_kernel"),
               mamba_conv_bias=any(n.endswith(".ssm_conv1d.bias") for n in g.file_names), mamba_rms_norm=norm,
               mamba_norm_before_gate=False)


FLAT = ("mamba.A_log", "mamba.D", "mamba.norm.weight")  # stored (H, 1), (H, 1) and (groups, width)


def gguf_shape(hf: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The HF shape of a tensor of the file's shape: A, D and the norm flat, the conv kernel (C, 1, K)."""
    if hf.endswith(FLAT):
        return (math.prod(shape),)
    if hf.endswith("mamba.conv1d.weight") and len(shape) == 2:
        return (shape[0], 1, shape[1])
    return shape


def gguf_restore(hf: str, w: Any) -> Any:
    """A_log from the file's A = -exp(A_log)."""
    if not hf.endswith("mamba.A_log"):
        return w
    import numpy as np

    return np.log(-w)


FAMILY = Family("falcon_h1", "FalconH1", label="Falcon-H1: attention and a Mamba-2 mixer side by side",
                window=False, own_fields=OWN_FIELDS, extras=mamba_fields, write=write,
                final_norm="model.final_layernorm.weight", attention_names=ATTENTION_NAMES,
                quality_model=False,  # embeddings and logits scaled outside the decoder layers
                mamba_tensors=mamba_tensors, weight_scale=weight_scale,
                classes={"MupVector": "compute_mup_vector"}, layer_buffers={"mamba.mup_vector": "MupVector"},
                gguf=GGUFArch("falcon-h1", "Falcon-H1", auto_tokenizer=False, renamed={"mamba.dt_bias": "mamba.dt_proj.bias"},
                              reshaped=gguf_shape, restore=gguf_restore, read=read_gguf))
