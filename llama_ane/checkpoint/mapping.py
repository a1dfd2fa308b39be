"""The pure HF -> ANE weight mapping: HF tensor names to our module parameter names.

Nothing here opens a file: it renames and reshapes tensors read through `Checkpoint.tensor`.
Linear (out, in) -> Conv2d (out, in, 1, 1), the attention scale folded into q (q_proj or q_norm), the LM head
split over the vocabulary. Each tensor is read, mapped in float32 and cast to `dtype` on its own,
so building a model in fp16 never holds its float32 copy.
"""

from __future__ import annotations

import torch

from ..config import LlamaConfig
from ..families.base import FAMILY_TENSORS, LAYER_TENSORS
from ..families.gemma4_text import PER_LAYER_TENSORS
from ..families.lfm2 import CONV_BIASES, CONV_TENSORS
from ..families.phi3 import FUSED_SHAPES, FUSED_TENSORS
from ..families.qwen3_5_text import GATED_HALF
from .tensors import Checkpoint, CheckpointError, TensorInfo


HF_LAYER_NAMES = {**LAYER_TENSORS, **FAMILY_TENSORS}
SHAPES = {  # our DecoderLayer name -> its HF shape, as LlamaConfig attributes (Linear weights are (out, in))
    "input_layernorm.weight": ("hidden_size",),
    "post_attention_layernorm.weight": ("hidden_size",),
    "q_proj.weight": ("q_channels", "hidden_size"),
    "k_proj.weight": ("kv_channels", "hidden_size"),
    "v_proj.weight": ("kv_channels", "hidden_size"),
    "o_proj.weight": ("hidden_size", "q_channels"),
    "mlp.gate_proj.weight": ("intermediate_size", "hidden_size"),
    "mlp.up_proj.weight": ("intermediate_size", "hidden_size"),
    "mlp.down_proj.weight": ("hidden_size", "intermediate_size"),
    "q_proj.bias": ("q_channels",),
    "k_proj.bias": ("kv_channels",),
    "v_proj.bias": ("kv_channels",),
    "o_proj.bias": ("hidden_size",),
    "q_norm.weight": ("q_norm_channels",),
    "k_norm.weight": ("k_norm_channels",),
    "pre_feedforward_layernorm.weight": ("hidden_size",),
    "post_feedforward_layernorm.weight": ("hidden_size",),
    "conv.in_proj.weight": ("conv_in_channels", "hidden_size"),
    "conv.conv.weight": ("hidden_size", 1, "conv_kernel"),
    "conv.out_proj.weight": ("hidden_size", "hidden_size"),
    "conv.in_proj.bias": ("conv_in_channels",),
    "conv.conv.bias": ("hidden_size",),
    "conv.out_proj.bias": ("hidden_size",),
    "per_layer_input_gate.weight": ("per_layer_input_size", "hidden_size"),
    "per_layer_projection.weight": ("hidden_size", "per_layer_input_size"),
    "post_per_layer_input_norm.weight": ("hidden_size",),
    "layer_scalar": (1,),
    "sinks": ("num_attention_heads",),
    "g_proj.weight": ("num_attention_heads", "hidden_size"),
    "o_gate.weight": ("q_channels", "hidden_size"),
    "linear_attn.in_proj_qkv.weight": ("delta_conv_channels", "hidden_size"),
    "linear_attn.in_proj_z.weight": ("delta_value_channels", "hidden_size"),
    "linear_attn.in_proj_b.weight": ("delta_value_heads", "hidden_size"),
    "linear_attn.in_proj_a.weight": ("delta_value_heads", "hidden_size"),
    "linear_attn.conv1d.weight": ("delta_conv_channels", 1, "conv_kernel"),
    "linear_attn.dt_bias": ("delta_value_heads",),
    "linear_attn.A_log": ("delta_value_heads",),
    "linear_attn.norm.weight": ("delta_value_dim",),
    "linear_attn.out_proj.weight": ("hidden_size", "delta_value_channels"),
    "mamba.in_proj.weight": ("mamba_in_channels", "hidden_size"),
    "mamba.conv1d.weight": ("delta_conv_channels", 1, "conv_kernel"),
    "mamba.conv1d.bias": ("delta_conv_channels",),
    "mamba.dt_bias": ("delta_value_heads",),
    "mamba.A_log": ("delta_value_heads",),
    "mamba.D": ("delta_value_heads",),
    "mamba.norm.weight": ("delta_value_channels",),
    "mamba.out_proj.weight": ("hidden_size", "delta_value_channels"),
}
GATED_Q_SHAPE = ("gated_q_channels", "hidden_size")  # an output-gated attention's q_proj (queries and gates)
GLOBAL_SHAPES = {  # HF name -> shape, outside the decoder layers
    "model.embed_tokens.weight": ("vocab_size", "hidden_size"),
    "model.norm.weight": ("hidden_size",),
    "lm_head.weight": ("vocab_size", "hidden_size"),
}
DERIVED = {"q_channels": "num_attention_heads*head_dim", "kv_channels": "num_key_value_heads*head_dim",
           "q_norm_channels": "head_dim, or num_attention_heads*head_dim across heads",
           "k_norm_channels": "head_dim, or num_key_value_heads*head_dim across heads",
           "qkv_channels": "(num_attention_heads+2*num_key_value_heads)*head_dim",
           "gate_up_channels": "2*intermediate_size", "conv_in_channels": "3*hidden_size",
           "conv_kernel": "conv_L_cache", "per_layer_input_size": "hidden_size_per_layer_input",
           "per_layer_vocab_size": "vocab_size_per_layer_input",
           "per_layer_channels": "num_hidden_layers*hidden_size_per_layer_input",
           "gated_q_channels": "2*num_attention_heads*head_dim",
           "delta_conv_channels": "2*linear_num_key_heads*linear_key_head_dim+linear_num_value_heads*linear_value_head_dim",
           "delta_key_channels": "linear_num_key_heads*linear_key_head_dim",
           "delta_value_channels": "linear_num_value_heads*linear_value_head_dim",
           "delta_value_heads": "linear_num_value_heads", "delta_value_dim": "linear_value_head_dim",
           "mamba_in_channels": "2*mamba_d_ssm+2*mamba_n_groups*mamba_d_state+mamba_n_heads"}
KV_TENSORS = ("k_proj.weight", "v_proj.weight", "k_norm.weight")  # what a KV-shared layer has none of
SCALED = ("q_proj.weight", "q_proj.bias")  # what the attention scale is folded into (no q_norm)
RESIDUAL_SCALED = ("o_proj.weight", "o_proj.bias", "mlp.down_proj.weight")  # the residual branches' outputs
# Where the stream scale (LlamaConfig.stream_scale) goes in a block with norms before and after its
# branches: into what the post-norms add to the stream, and into each branch's output before its
# post-norm (o_proj's, and the MLP's through up_proj: gelu(gate) * up is where fp16 overflows)
STREAM_SCALED = ("post_attention_layernorm.weight", "post_feedforward_layernorm.weight", "o_proj.weight",
                 "o_proj.bias", "mlp.up_proj.weight", "post_per_layer_input_norm.weight")
# What reads the stream into something not scale invariant (Gemma 4's per-layer input gate, before its
# GeLU): the stream scale is undone in its weights
STREAM_UNSCALED = ("per_layer_input_gate.weight",)
CONV_WEIGHTS = ("per_layer_input_gate.weight", "per_layer_projection.weight", "o_gate.weight",  # Linear weights
                "linear_attn.in_proj_qkv.weight", "linear_attn.in_proj_z.weight", "linear_attn.in_proj_b.weight",
                "linear_attn.in_proj_a.weight")  # not named *proj.weight
DEPTHWISE = ("conv.conv.weight", "linear_attn.conv1d.weight", "mamba.conv1d.weight")  # depthwise Conv1d kernels (C, 1, K)
PLAIN_NORMS = ("linear_attn.norm.weight",)  # Qwen3.5's gated norm scales by w, its other norms by (1 + w)


def layer_tensors(cfg: LlamaConfig, layer: int = -1) -> dict[str, str]:
    """Our parameter names of decoder layer `layer` (a DecoderLayer, or a ConvLayer where the layer
    convolves) -> HF names inside model.layers.N, for `cfg`'s family. Without `layer`, an attention layer's."""
    if cfg.linear(layer):  # linear-attention layers (a tensor stored as parts: its first part's name)
        return {**cfg.family.delta_tensors, **{ours: parts[0][0] for ours, parts in cfg.family.delta_parts.items()}}
    if not cfg.attends(layer):  # LFM2's conv layers (a family's own names of them: LFM3's)
        return {**(cfg.family.conv_names or CONV_TENSORS), **(CONV_BIASES if cfg.conv_bias else {})}
    block = {ours: hf for ours, hf in LAYER_TENSORS.items() if cfg.input_norm or ours != "input_layernorm.weight"}
    if cfg.value_from_key(layer):  # Gemma 4's global layers: V from the K projection
        del block["v_proj.weight"]
    if cfg.fused_projections:
        block.update({ours: fused[0] for ours, fused in FUSED_TENSORS.items()})
    out = {**block, **{ours: FAMILY_TENSORS[ours] for ours in cfg.layer_extras}}
    if cfg.shares_kv(layer):  # Gemma 4's KV-shared layers compute no K/V
        out = {ours: hf for ours, hf in out.items() if ours not in KV_TENSORS}
    if cfg.attn_output_gate:
        out["o_gate.weight"] = out["q_proj.weight"]
    names = cfg.family.attention_names  # a family's own names of the Llama block's tensors (LFM2's)
    out = {ours: names.get(ours, hf) for ours, hf in out.items()} if names else out
    if cfg.mamba(layer):  # Falcon-H1: a Mamba-2 mixer beside attention
        out.update(cfg.family.mamba_tensors(cfg))
    return out


def layer_sources(cfg: LlamaConfig, layer: int) -> list[str]:
    """Every HF name inside model.layers.N that decoder layer `layer` reads: layer_tensors', and each
    part of a tensor stored as parts."""
    parts = cfg.family.delta_parts if cfg.linear(layer) else {}
    return [hf for ours, hf in layer_tensors(cfg, layer).items() if ours not in parts] + [
        hf for stacked in parts.values() for hf, _ in stacked]


def expected_tensors(cfg: LlamaConfig) -> dict[str, tuple[str, ...]]:
    """Every HF tensor an export of `cfg` reads -> its shape as LlamaConfig attribute names (None for a
    part whose rows the checkpoint may split as it likes: `check_tensors` checks the parts' total)."""
    shapes = {"model.embed_tokens.weight": GLOBAL_SHAPES["model.embed_tokens.weight"]}
    for n in range(cfg.num_hidden_layers):
        parts = cfg.family.delta_parts if cfg.linear(n) else {}
        shapes.update({f"model.layers.{n}.{hf}": FUSED_SHAPES.get(hf) or SHAPES[ours]
                       for ours, hf in layer_tensors(cfg, n).items() if ours not in parts})
        shapes.update({f"model.layers.{n}.{hf}": dims for stacked in parts.values() for hf, dims in stacked})
        if cfg.attn_output_gate and not cfg.linear(n):
            shapes[f"model.layers.{n}.self_attn.q_proj.weight"] = GATED_Q_SHAPE
    shapes[final_norm_name(cfg)] = GLOBAL_SHAPES["model.norm.weight"]
    if cfg.per_layer_input_size:
        shapes.update(dict(PER_LAYER_TENSORS.values()))
    return shapes | ({} if cfg.tie_word_embeddings else {"lm_head.weight": GLOBAL_SHAPES["lm_head.weight"]})


def expected_shape(cfg: LlamaConfig, name: str, dims: tuple) -> tuple[int, ...]:
    """The shape of HF tensor `name` whose dims expected_tensors gives: its layer's config's sizes
    (LlamaConfig.at: a global layer of Gemma 4 may have wider heads)."""
    parts = name.split(".")
    at = cfg.at(int(parts[2])) if parts[:2] == ["model", "layers"] else cfg
    return tuple(d if isinstance(d, int) else getattr(at, d) for d in dims)


def final_norm_name(cfg: LlamaConfig) -> str:
    """The checkpoint's name of the final norm (LFM2 calls it the embedding norm)."""
    return cfg.family.final_norm


def check_tensors(cfg: LlamaConfig, tensors: dict[str, TensorInfo], checkpoint: str, dtypes: tuple[str, ...],
                  allowed: str) -> None:
    """Refuse a checkpoint whose tensors do not match `cfg`, from their headers alone (no data read):
    a missing tensor, one stored as a type other than `dtypes` (`allowed` says which in words), or
    one of another shape than the config gives it, each named with what it is and what it must be."""
    for name, dims in expected_tensors(cfg).items():
        info = tensors.get(name)
        if info is None:
            if name == "lm_head.weight":
                raise CheckpointError(f"checkpoint {checkpoint} has no tensor 'lm_head.weight' (its config has an "
                                      "untied LM head); if the head is the embedding table, set "
                                      "tie_word_embeddings to true")
            raise CheckpointError(f"checkpoint {checkpoint} has no tensor {name!r}; is it a complete "
                                  f"{cfg.model_type} checkpoint?")
        if info.dtype not in dtypes:
            raise CheckpointError(f"checkpoint {checkpoint}: tensor {name!r} is stored as {info.dtype}; "
                                  f"only {allowed} weights can be exported (dequantize the checkpoint first)")
        if dims is None:
            continue
        want = expected_shape(cfg, name, dims)
        if info.shape != want:
            formula = ", ".join(str(DERIVED.get(d, d)) for d in dims)
            raise CheckpointError(f"checkpoint {checkpoint}: tensor {name!r} has shape {list(info.shape)}, but the "
                                  f"config gives it {list(want)} ({formula}); the weights and the config do "
                                  "not belong together")
    for n in cfg.delta_layers:  # parts of free rows: their total is the tensor the config gives
        for ours, stacked in cfg.family.delta_parts.items():
            if all(dims is None for _, dims in stacked):
                names = [f"model.layers.{n}.{hf}" for hf, _ in stacked]
                got = [sum(tensors[x].shape[0] for x in names), *tensors[names[0]].shape[1:]]
                want = list(expected_shape(cfg, names[0], SHAPES[ours]))
                formula = ", ".join(str(DERIVED.get(d, d)) for d in SHAPES[ours])
                if got != want:
                    raise CheckpointError(f"checkpoint {checkpoint}: tensors {names} stack to shape {got}, but the "
                                          f"config gives {want} ({formula}); the weights and the config do not "
                                          "belong together")
    layers = {int(parts[2]) for name in tensors if (parts := name.split(".", 3))[:2] == ["model", "layers"]
              and len(parts) > 3 and parts[2].isdigit()}
    if layers and max(layers) >= cfg.num_hidden_layers:
        raise CheckpointError(f"checkpoint {checkpoint} has tensors of layer {max(layers)}, but num_hidden_layers "
                              f"is {cfg.num_hidden_layers}; the weights and the config do not belong together")


def as_conv(w: torch.Tensor) -> torch.Tensor:
    """Linear weight (out, in) -> 1x1 Conv2d weight (out, in, 1, 1)."""
    return w.reshape(w.shape[0], w.shape[1], 1, 1)


def layer_tensor(ckpt: Checkpoint, layer: int, ours: str) -> torch.Tensor:
    """One DecoderLayer parameter (our name, e.g. "q_proj.weight") from HF `model.layers.{layer}.*`, in fp32.

    The attention scale (LlamaConfig.query_scale) is folded into q: into q_proj (weight and bias),
    or, where q is RMS-normalized after the projection (Qwen3), into q_norm's weight; Granite's
    residual_multiplier into the last projection of each residual branch (o_proj, down_proj);
    Gemma's norm weights w become the (1 + w) they scale by, and its stream scale goes where
    STREAM_SCALED says; a family's own multipliers where its weight_scale says (Falcon-H1's).
    """
    cfg = ckpt.config
    hf = f"model.layers.{layer}.{layer_tensors(cfg, layer)[ours]}"
    parts = cfg.family.delta_parts.get(ours) if cfg.linear(layer) else None
    if parts:  # stored as parts, stacked by rows (OLMo-Hybrid's q, k and v projections)
        w = torch.cat([ckpt.tensor(f"model.layers.{layer}.{name}").to(torch.float32) for name, _ in parts])
    elif cfg.fused_projections and ours in FUSED_TENSORS:  # our rows of the fused projection, read alone
        _, before, size = FUSED_TENSORS[ours]
        start = sum(getattr(cfg, b) for b in before)
        w = ckpt.rows(hf, start, start + getattr(cfg, size)).to(torch.float32)
    else:
        w = ckpt.tensor(hf).to(torch.float32)
    if cfg.attn_output_gate and ours in GATED_HALF:  # (H*2*D, C): each head's queries, then its gates
        w = w.reshape(cfg.num_attention_heads, 2, cfg.head_dim, -1)[:, GATED_HALF[ours]].reshape(cfg.q_channels, -1)
    if ours.endswith("proj.weight") or ours in CONV_WEIGHTS:
        w = as_conv(w)
    if ours in DEPTHWISE:  # the depthwise Conv1d's (C, 1, K) as a Conv2d's (C, 1, 1, K)
        w = w.reshape(w.shape[0], 1, 1, w.shape[-1])
    if ours.endswith("norm.weight") and ours not in PLAIN_NORMS:
        w = norm_weight(cfg, w)
    if cfg.sandwich_norms and ours in STREAM_SCALED:
        w = w * cfg.stream_scale
    if ours in STREAM_UNSCALED:
        w = w / cfg.stream_scale
    if ours == "q_norm.weight" or (ours in SCALED and not cfg.qk_norm):
        w = w * cfg.query_scale
    if ours in RESIDUAL_SCALED and cfg.residual_multiplier != 1.0:
        w = w * cfg.residual_multiplier
    scale = cfg.family.weight_scale(cfg, ours) if cfg.family.weight_scale else None
    if isinstance(scale, list):  # one factor per row (Falcon-H1's mixer in_proj)
        w = w * torch.tensor(scale, dtype=w.dtype).reshape(-1, *[1] * (w.dim() - 1))
    elif scale is not None and scale != 1.0:
        w = w * scale
    return w


def norm_weight(cfg: LlamaConfig, w: torch.Tensor) -> torch.Tensor:
    """A norm's weight as the norm multiplies by it: Gemma stores w for a scale of (1 + w)."""
    return w + 1.0 if cfg.family.unit_offset_norms else w


def final_norm(ckpt: Checkpoint) -> torch.Tensor:
    """The final norm's weight (model.norm) as the LM head multiplies by it, in fp32."""
    return norm_weight(ckpt.config, ckpt.tensor(final_norm_name(ckpt.config)).to(torch.float32))


def layer_state_dict(ckpt: Checkpoint, layer: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """One DecoderLayer's state dict from HF `model.layers.{layer}.*`, in `dtype`."""
    return {ours: layer_tensor(ckpt, layer, ours).to(dtype) for ours in layer_tensors(ckpt.config, layer)}


def chunk_state_dict(ckpt: Checkpoint, layers: list[int], dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """A BlockChunk's state dict for HF layers `layers`, in `dtype`."""
    return {f"layers.{j}.{k}": v for j, layer in enumerate(layers)
            for k, v in layer_state_dict(ckpt, layer, dtype).items()}


def embeddings_state_dict(ckpt: Checkpoint, dtype: torch.dtype = torch.float32,
                          rows: tuple[int, int] | None = None) -> dict[str, torch.Tensor]:
    """The embedding table (vocab, hidden), or its rows [start, end), in `dtype`."""
    name = "model.embed_tokens.weight"
    table = ckpt.tensor(name) if rows is None else ckpt.rows(name, *rows)
    return {"embed_tokens.weight": table.to(dtype)}


def per_layer_state_dict(ckpt: Checkpoint, dtype: torch.dtype = torch.float32,
                         names: tuple[str, ...] = tuple(PER_LAYER_TENSORS),
                         table_rows: tuple[int, int] | None = None) -> dict[str, torch.Tensor]:
    """Gemma 4's per-layer input weights `names` (of PER_LAYER_TENSORS) as model.embeddings.PerLayerInputs
    holds them, in `dtype`, each read alone; of the per-layer table only rows `table_rows` [start, end)
    (default: all). Empty where the model has none."""
    if not ckpt.config.per_layer_input_size:
        return {}
    table = "embed_tokens_per_layer.weight"
    out = {ours: (ckpt.rows(PER_LAYER_TENSORS[ours][0], *table_rows) if ours == table and table_rows
                  else ckpt.tensor(PER_LAYER_TENSORS[ours][0])).to(dtype) for ours in names}
    if "per_layer_model_projection.weight" in out:
        out["per_layer_model_projection.weight"] = as_conv(out["per_layer_model_projection.weight"])
    return out


def lm_head_state_dict(ckpt: Checkpoint, splits: list[int], dtype: torch.dtype = torch.float32,
                       heads: list[int] | None = None) -> dict[str, torch.Tensor]:
    """LMHead's state dict in `dtype`: final norm and the (tied or untied) output matrix split by rows
    into `splits`; with `heads`, only those splits (heads.0 is split heads[0], ...), read alone."""
    name = "model.embed_tokens.weight" if ckpt.config.tie_word_embeddings else "lm_head.weight"
    heads = list(range(len(splits))) if heads is None else heads
    starts = [sum(splits[:j]) for j in range(len(splits) + 1)]
    first = starts[heads[0]]
    w = ckpt.rows(name, first, starts[heads[-1] + 1]).to(dtype)
    out = {"norm.weight": final_norm(ckpt).to(dtype)}
    for i, j in enumerate(heads):
        out[f"heads.{i}.weight"] = as_conv(w[starts[j] - first:starts[j + 1] - first])
    return out
