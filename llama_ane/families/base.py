"""What a model family is to the exporter: how its block differs from the Llama block, how its
config.json reads and writes, and how its checkpoints name their tensors.

A `Family` holds traits (each one's default is the Llama block's) and hooks (None: the family has
nothing of its own there). Hooks that read config.json take a `Fields` of it; those that write a
transformers config dictionary back, or read a GGUF file, take the LlamaConfig or the open file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from .fields import Fields

MOE = "a mixture-of-experts MLP (routed experts)"  # what the refused families (and Gemma 4's MoE block) need

# The Llama block's tensors, every family's unless it names them otherwise (Family.attention_names)
LAYER_TENSORS = {  # our name in DecoderLayer -> HF name inside model.layers.N
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "post_attention_layernorm.weight",
    "q_proj.weight": "self_attn.q_proj.weight",
    "k_proj.weight": "self_attn.k_proj.weight",
    "v_proj.weight": "self_attn.v_proj.weight",
    "o_proj.weight": "self_attn.o_proj.weight",
    "mlp.gate_proj.weight": "mlp.gate_proj.weight",
    "mlp.up_proj.weight": "mlp.up_proj.weight",
    "mlp.down_proj.weight": "mlp.down_proj.weight",
}
FAMILY_TENSORS = {  # what other families add, where their config has them (LlamaConfig.layer_extras)
    "q_proj.bias": "self_attn.q_proj.bias",
    "k_proj.bias": "self_attn.k_proj.bias",
    "v_proj.bias": "self_attn.v_proj.bias",
    "o_proj.bias": "self_attn.o_proj.bias",
    "q_norm.weight": "self_attn.q_norm.weight",
    "k_norm.weight": "self_attn.k_norm.weight",
    "pre_feedforward_layernorm.weight": "pre_feedforward_layernorm.weight",
    "post_feedforward_layernorm.weight": "post_feedforward_layernorm.weight",
    "per_layer_input_gate.weight": "per_layer_input_gate.weight",  # Gemma 4's per-layer input
    "per_layer_projection.weight": "per_layer_projection.weight",
    "post_per_layer_input_norm.weight": "post_per_layer_input_norm.weight",
    "layer_scalar": "layer_scalar",
    "sinks": "self_attn.sinks",  # attention sinks, one logit per query head
    "g_proj.weight": "self_attn.g_proj.weight",  # an output gate per query head
}


@dataclass(frozen=True)
class GGUFArch:
    """How llama.cpp stores a family: its general.architecture and the family's name for it, and
    what its convert script does to the weights and metadata."""

    name: str  # general.architecture
    label: str  # the models it holds, as the supported line names them
    permuted: bool = False  # q/k rows interleaved (LlamaModel and the converters derived from it)
    norm_offset: float = 0.0  # added to every norm weight (Gemma 3's (1 + w))
    squeezed_conv: bool = False  # the depthwise conv kernel's middle dimension dropped (LFM2's (C, 1, K) as (C, K))
    swa_heads: bool = False  # the head size is the sliding layers' (attention.key_length_swa, ...)
    partial_rope: bool = False  # rope.dimension_count may be below the head size (partial rotary)
    rope_freqs: str | None = None  # what a rope_freqs tensor is: "llama3" scaling, "proportional" (read by `read`)
    per_layer: tuple[str, ...] = ()  # metadata keys listed per layer, one entry a layer
    conv_kv: bool = False  # attention.head_count_kv listed per layer, 0 for each conv layer
    auto_tokenizer: bool = True  # transformers' AutoTokenizer reads its files (where its GGUF reader has the arch)
    read: Callable[[Any, dict[str, Any]], None] | None = None  # the file's own metadata into the config dict
    read_longrope: Callable[[Any, dict[str, Any], dict[str, Any]], dict[str, Any]] | None = None  # from factor tensors
    # a tensor the converter renames before its table maps it: the end of our name -> the converter's
    # (Falcon-H1's mamba.dt_bias, which it maps as mamba.dt_proj.bias)
    renamed: Mapping[str, str] = field(default_factory=dict)
    reshaped: Callable[[str, tuple[int, ...]], tuple[int, ...]] | None = None  # HF name, file's shape -> HF shape
    restore: Callable[[str, Any], Any] | None = None  # HF name, the file's values in the HF shape -> the HF values


@dataclass(frozen=True)
class Family:
    """One model_type the exporter builds."""

    model_type: str
    class_prefix: str  # of its transformers classes: LlamaForCausalLM, Qwen2DecoderLayer, ...
    label: str = ""  # the models it holds, as the supported line names them ("": the model_type says it)
    module: str = ""  # transformers' module of the family, where it is not the model_type
    classes: Mapping[str, str] = field(default_factory=dict)  # part -> transformers' class, where not prefix + part
    multimodal: tuple[str, str] | None = None  # the multimodal model_type whose text model it is, and what that is

    # the block
    activation: str = "silu"  # the MLP's gate activation, the only one it is exported with
    activation_field: str = "hidden_act"  # the config.json field that names it
    attention_bias_flag: bool = False  # attention_bias puts a bias on q, k, v and o
    qkv_bias: bool = False  # a bias on q, k and v always
    qk_norm: bool = False  # q and k normalized before RoPE, each head
    qk_norm_across_heads: bool = False  # or the whole projection at once
    post_norms: bool = False  # the attention and MLP outputs normalized, not their inputs
    sandwich_norms: bool = False  # attention and MLP both normalized before and after
    unit_offset_norms: bool = False  # norm weights stored as w for a scale of (1 + w)
    local_rope: bool = False  # the sliding layers rotate with their own RoPE base
    fused_projections: bool = False  # q/k/v stored as one qkv_proj, gate/up as one gate_up_proj
    stream_scale: float = 1.0  # the power of two the residual stream is carried at (LlamaConfig.stream_scale)
    head_dim: int | None = None  # where config.json has none (None: hidden_size / num_attention_heads)
    partial_rotary_factor: float = 1.0  # where neither config.json nor its rope_parameters gives one
    rope_types: tuple[str, ...] = ("default", "llama3", "linear")  # the RoPE scalings it is exported with
    rope_aliases: Mapping[str, str] = field(default_factory=dict)  # other names its config class reads as one
    own_fields: tuple[str, ...] = ()  # its LlamaConfig fields a manifest holds only where not their defaults
    # whether transformers' decoder layers on the checkpoint's weights are its whole network, so that
    # --quantize auto can measure its quality with them
    quality_model: bool = True
    # transformers' module whose chunked delta rule the reference runs token by token ("": none)
    delta_rule_module: str = ""

    # the sliding window
    window: bool = True  # whether sliding_window means anything to it
    window_flag: str | None = None  # the config.json field that turns the window on (None: always on)
    window_layer_types: bool = True  # layer_types names the sliding layers (else every layer slides)
    window_layers: Callable[[Fields, int], list[int]] | None = None  # the sliding layers where layer_types is absent
    other_layer_types: tuple[str, ...] = ()  # layer_types' other entries, layers without attention (LFM3's "conv")

    # hooks of config.json
    prepare: Callable[[Fields], dict[str, Any]] | None = None  # its config.json as the other families' fields
    rope: Callable[[Fields, dict[str, Any]], tuple[dict[str, Any], float]] | None = None  # global RoPE, local base
    extras: Callable[[Fields], dict[str, Any]] | None = None  # its own LlamaConfig fields
    write: Callable[[Any, dict[str, Any]], dict[str, Any]] | None = None  # LlamaConfig.to_hf_dict's own fields
    writes_rotary_factor: bool = False  # its transformers config reads partial_rotary_factor at the top level

    # checkpoints
    final_norm: str = "model.norm.weight"
    conv_names: Mapping[str, str] = field(default_factory=dict)  # ours -> its name in a conv layer ({}: LFM2's)
    attention_names: Mapping[str, str] = field(default_factory=dict)  # ours -> its own name in an attention layer
    # its linear-attention layers' tensors: our name in model.layers.delta_net.DeltaLayer -> its name inside
    # model.layers.N; and ours that it stores as parts, stacked by rows: ours -> ((its name, shape as
    # LlamaConfig attribute names, or None for rows the checkpoint may split as it likes), ...)
    # (OLMo-Hybrid's q, k and v projections, our in_proj_qkv)
    delta_tensors: Mapping[str, str] = field(default_factory=dict)
    delta_parts: Mapping[str, tuple[tuple[str, tuple[str, ...] | None], ...]] = field(default_factory=dict)
    # transformers' name of a tensor inside model.layers.N -> the name its checkpoints store it under, or
    # the names of the parts it concatenates (its conversion mapping), where they differ
    stored_names: Mapping[str, str | tuple[str, ...]] = field(default_factory=dict)
    # a Mamba-2 mixer's tensors in a layer of a config (model.layers.mamba2): our name -> its name inside
    # model.layers.N; and the factor folded into a decoder layer's tensor (our name; a list: one per row;
    # None: none), where the family's multipliers fold into its weights (Falcon-H1's)
    mamba_tensors: Callable[[Any], dict[str, str]] | None = None
    # buffers transformers' model class gives each decoder layer, which the reference (one layer at a time)
    # gives it too: buffer path in the layer -> the part (`classes`) of its module computing it from the config
    layer_buffers: Mapping[str, str] = field(default_factory=dict)
    weight_scale: Callable[[Any, str], float | list[float] | None] | None = None
    gguf: GGUFArch | None = None  # how llama.cpp stores it (None: no architecture of its own)

    @property
    def longrope(self) -> bool:
        """Whether its RoPE tables come from transformers' own rotary class (longrope)."""
        return "longrope" in self.rope_types
