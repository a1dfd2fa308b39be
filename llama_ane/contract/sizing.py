"""Which weights go into which file: decoder layers into block chunks, and the rows of the
vocabulary matrices (embedding table, LM head) into as many files as the target's limit needs."""

from __future__ import annotations

import math
from typing import Callable

from ..config import LlamaConfig
from ..errors import InvalidArgumentError
from ..limits import weight_budget
from ..model.lm_head import ROW_UNIT, even_parts


def layer_shapes(cfg: LlamaConfig, layer: int = -1) -> dict[str, tuple[int, ...]]:
    """Every weight of decoder layer `layer` of `cfg`'s family (its name in model.layers.attention.DecoderLayer,
    or model.layers.short_conv.ConvLayer where the layer convolves; without `layer`, an attention layer's)
    and its shape: (out, in) for the projections, (out,) for their biases, (C,) or (head_dim,) for
    the norms, (C, kernel) for a short convolution's kernel."""
    cfg = cfg.at(layer)
    c, q, kv, i = cfg.hidden_size, cfg.q_channels, cfg.kv_channels, cfg.intermediate_size
    if cfg.linear(layer):  # Qwen3.5's Gated DeltaNet (model.layers.delta_net.DeltaLayer)
        h, qc, vc = cfg.delta_value_heads, cfg.delta_conv_channels, cfg.delta_value_channels
        return {"input_layernorm.weight": (c,), "linear_attn.in_proj_qkv.weight": (qc, c),
                "linear_attn.in_proj_z.weight": (vc, c), "linear_attn.in_proj_b.weight": (h, c),
                "linear_attn.in_proj_a.weight": (h, c), "linear_attn.conv1d.weight": (qc, cfg.conv_kernel),
                "linear_attn.dt_bias": (h,), "linear_attn.A_log": (h,), "linear_attn.norm.weight": (cfg.delta_value_dim,),
                "linear_attn.out_proj.weight": (c, vc), "post_attention_layernorm.weight": (c,),
                "mlp.gate_proj.weight": (i, c), "mlp.up_proj.weight": (i, c), "mlp.down_proj.weight": (c, i)}
    if not cfg.attends(layer):
        shapes = {"input_layernorm.weight": (c,), "conv.in_proj.weight": (3 * c, c),
                  "conv.conv.weight": (c, cfg.conv_kernel), "conv.out_proj.weight": (c, c),
                  "post_attention_layernorm.weight": (c,), "mlp.gate_proj.weight": (i, c),
                  "mlp.up_proj.weight": (i, c), "mlp.down_proj.weight": (c, i)}
        if cfg.sandwich_norms:  # the operator's and the MLP's outputs normalized too (LFM3)
            shapes.update({"pre_feedforward_layernorm.weight": (c,), "post_feedforward_layernorm.weight": (c,)})
        biases = {"conv.in_proj.bias": (3 * c,), "conv.conv.bias": (c,), "conv.out_proj.bias": (c,)}
        return {**shapes, **(biases if cfg.conv_bias else {})}
    shapes = {"input_layernorm.weight": (c,), "q_proj.weight": (q, c), "k_proj.weight": (kv, c),
              "v_proj.weight": (kv, c), "o_proj.weight": (c, q), "post_attention_layernorm.weight": (c,),
              "mlp.gate_proj.weight": (i, c), "mlp.up_proj.weight": (i, c), "mlp.down_proj.weight": (c, i)}
    extra = {"q_proj.bias": (q,), "k_proj.bias": (kv,), "v_proj.bias": (kv,), "o_proj.bias": (c,),
             "q_norm.weight": (cfg.q_norm_channels,), "k_norm.weight": (cfg.k_norm_channels,),
             "pre_feedforward_layernorm.weight": (c,), "post_feedforward_layernorm.weight": (c,),
             "per_layer_input_gate.weight": (cfg.per_layer_input_size, c),
             "per_layer_projection.weight": (c, cfg.per_layer_input_size),
             "post_per_layer_input_norm.weight": (c,), "layer_scalar": (1,), "sinks": (cfg.num_attention_heads,),
             "g_proj.weight": (cfg.num_attention_heads, c)}
    shapes.update({name: extra[name] for name in cfg.layer_extras})
    if cfg.attn_output_gate:  # Qwen3.5's output gate, the second half of its q_proj
        shapes["o_gate.weight"] = (q, c)
    if cfg.value_from_key(layer):  # V from the K projection (Gemma 4's global layers)
        del shapes["v_proj.weight"]
    if cfg.shares_kv(layer):  # Gemma 4's KV-shared layers compute no K/V
        shapes = {k: v for k, v in shapes.items() if k not in ("k_proj.weight", "v_proj.weight", "k_norm.weight")}
    if cfg.mamba(layer):  # Falcon-H1's Mamba-2 mixer beside attention (model.layers.mamba2.Mamba2Mixer)
        h, qc, vc = cfg.delta_value_heads, cfg.delta_conv_channels, cfg.delta_value_channels
        shapes.update({"mamba.in_proj.weight": (cfg.mamba_in_channels, c), "mamba.conv1d.weight": (qc, cfg.conv_kernel),
                       "mamba.dt_bias": (h,), "mamba.A_log": (h,), "mamba.D": (h,), "mamba.out_proj.weight": (c, vc)})
        shapes.update({"mamba.conv1d.bias": (qc,)} if cfg.conv_bias else {})
        shapes.update({"mamba.norm.weight": (vc,)} if cfg.mamba_gate else {})
    return shapes if cfg.input_norm else {k: v for k, v in shapes.items() if k != "input_layernorm.weight"}


def weight_part(name: str) -> str | None:
    """The part of the model a parameter belongs to, for compression: "embeddings" (the token
    table), "attention" (q/k/v/o projections), "mlp", "lm_head" (the vocabulary heads), or None
    (norms, RoPE tables, the gate per attention head, one row a head: never compressed). `name` as
    in the modules: "layers.3.q_proj.weight"."""
    if name == "embed_tokens.weight":
        return "embeddings"
    if name.startswith("heads."):
        return "lm_head"
    if name.endswith(".g_proj.weight"):  # (heads, C): too few rows for a LUT group, and a few KB
        return None
    if name.startswith("layers.") and (name.endswith("proj.weight") or name.endswith(".o_gate.weight")
                                       or name.rsplit(".", 2)[-2] in ("in_proj_qkv", "in_proj_z")):
        return "mlp" if ".mlp." in name else "attention"
    return None


def layer_weight_bytes(cfg: LlamaConfig, bytes_per_weight: int = 2,
                       stored: Callable[[str, tuple[int, ...]], int] | None = None, layer: int | None = None) -> int:
    """Weight bytes of decoder layer `layer` (projections, MLP, two norms; without `layer`, the
    largest kind of layer the model has): dense at `bytes_per_weight`, or as `stored(name, shape)`
    says (compressed weights)."""
    if layer is None:
        return max(layer_weight_bytes(cfg, bytes_per_weight, stored, n)
                   for n in {-1, *cfg.conv_layers[:1], *cfg.delta_layers[:1], *cfg.mamba_layers[:1]})  # an
        # attention layer's, a conv layer's, a linear-attention layer's, a Mamba-2 layer's
    shapes = layer_shapes(cfg, layer)
    if stored is None:
        return sum(math.prod(shape) for shape in shapes.values()) * bytes_per_weight
    return sum(stored(name, shape) for name, shape in shapes.items())


def plan_chunks(cfg: LlamaConfig, layers_per_chunk: int | None = None, *,
                target: str = "iOS18", bytes_per_weight: int = 2, layer_bytes: int | None = None) -> list[list[int]]:
    """Group layer indices into chunks.

    With `layers_per_chunk` K, chunks hold K layers and the last one the remainder (5 layers at
    K=2 -> [0,1], [2,3], [4]). Without it, K is the most layers whose weights fit the target's
    weight budget (`limits.weight_budget`: the file limit `inspect --strict` enforces, less room for
    the program), and the layers are spread evenly over the fewest chunks that K allows. Every
    layer lands in exactly one chunk. `layer_bytes` replaces the dense bytes of a layer (compressed
    weights).
    """
    n = cfg.num_hidden_layers
    if layers_per_chunk is not None:
        if layers_per_chunk < 1:
            raise InvalidArgumentError(f"--layers-per-chunk must be at least 1, got {layers_per_chunk}")
        k = min(layers_per_chunk, n)
        return [list(range(s, min(s + k, n))) for s in range(0, n, k)]
    per_layer = layer_bytes or layer_weight_bytes(cfg, bytes_per_weight)
    k = max(1, min(n, weight_budget(target) // per_layer))
    return [list(range(a, b)) for a, b in even_parts(n, -(-n // k))]


def vocab_row_ranges(rows: int, row_bytes: int, budget: int, fixed_bytes: int = 0) -> list[tuple[int, int]]:
    """[start, end) row ranges of a (rows, C) table cut into the fewest near-equal files whose bytes
    (`fixed_bytes` of other weights each, plus its rows) fit `budget`; boundaries at ROW_UNIT rows."""
    files = max(1, -(-(rows * row_bytes + fixed_bytes) // budget))
    while max(b - a for a, b in even_parts(rows, files, ROW_UNIT)) * row_bytes + fixed_bytes > budget:
        files += 1
    return even_parts(rows, files, ROW_UNIT)


def group_heads(splits: list[int], row_bytes: int, budget: int, fixed_bytes: int = 0) -> list[list[int]]:
    """The LM head's vocabulary splits (rows per head) grouped, consecutive and near-equal in count,
    into the fewest files whose bytes fit `budget`; returns each file's head indices."""
    if max(splits) * row_bytes + fixed_bytes > budget:
        raise ValueError(f"a head of {max(splits)} rows ({max(splits) * row_bytes} bytes) does not fit "
                         f"one file of {budget} bytes")
    files = max(1, -(-(sum(splits) * row_bytes + fixed_bytes) // budget))
    while True:
        groups = [list(range(a, b)) for a, b in even_parts(len(splits), files)]
        if all(sum(splits[i] for i in g) * row_bytes + fixed_bytes <= budget for g in groups):
            return groups
        files += 1
