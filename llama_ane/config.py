"""The model configuration, with Hugging Face field names.

`LlamaConfig.from_hf_dict` accepts a `config.json` dictionary (transformers 4 style, with
`rope_theta`/`rope_scaling`, or transformers 5 style, with `rope_parameters`), drops keys it does not
use, and validates that the checkpoint is one we can export.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from .errors import LlamaANEError

# model_type -> the prefix of its transformers classes (LlamaForCausalLM, Qwen2DecoderLayer, ...)
FAMILY_CLASS_PREFIX = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3",
                       "smollm3": "SmolLM3", "granite": "Granite", "olmo2": "Olmo2", "phi3": "Phi3",
                       "gemma3_text": "Gemma3", "gemma4_text": "Gemma4", "lfm2": "Lfm2", "qwen3_5_text": "Qwen3_5"}
FAMILY_MODULE = {"gemma3_text": "gemma3", "gemma4_text": "gemma4", "qwen3_5_text": "qwen3_5"}
# transformers' class of a family's part, where it is not the prefix's: Gemma 4's text classes
FAMILY_CLASS = {("gemma4_text", "DecoderLayer"): "Gemma4TextDecoderLayer",
                ("gemma4_text", "RotaryEmbedding"): "Gemma4TextRotaryEmbedding",
                ("qwen3_5_text", "RotaryEmbedding"): "Qwen3_5TextRotaryEmbedding"}  # transformers' module of a family, where it is not the model_type
SUPPORTED_MODEL_TYPES = tuple(FAMILY_CLASS_PREFIX)
LONGROPE_FAMILIES = ("phi3",)  # the families whose RoPE tables come from transformers' own rotary class
ROPE_TYPE_ALIASES = {"su": "longrope", "yarn": "longrope"}  # what Phi3Config reads as longrope
SUPPORTED_DESCRIPTION = (
    "supported: model_type 'llama' (Llama 2, 3, 3.1, 3.2, SmolLM2), 'mistral', 'qwen2' (Qwen2, Qwen2.5), "
    "'qwen3' (dense Qwen3), 'smollm3', 'granite' (dense Granite 3.x), 'olmo2' (OLMo 2), 'phi3' "
    "(Phi-3, Phi-3.5, Phi-4-mini), 'gemma3_text' (Gemma 3's text model), 'gemma4_text' (Gemma 4's text model), "
    "'lfm2' (LFM2) and 'qwen3_5_text' (Qwen3.5's text model), and the text model of a multimodal checkpoint "
    "('qwen3_5', 'gemma3', 'gemma4': its text_config), with RoPE type "
    "default, linear or "
    "llama3 (phi3: default or longrope), silu MLP (gemma3_text, gemma4_text: gelu_pytorch_tanh), no MLP bias"
)
# Families transformers has that the export does not build, with what they need that it lacks
# (other model_types get the plain "unsupported" line).
_MOE = "a mixture-of-experts MLP (routed experts)"
# Multimodal checkpoints whose text model is exported (their vision and audio towers are left out):
# model_type -> (its text_config's model_type, what that text model is)
MULTIMODAL = {"qwen3_5": ("qwen3_5_text", "Qwen3.5's text model: Gated DeltaNet and attention layers"),
              "gemma3": ("gemma3_text", "Gemma 3's text model"),
              "gemma4": ("gemma4_text", "Gemma 4's text model")}
# What transformers' composite model reads at the top level of its config.json where text_config lacks it
MULTIMODAL_TOP_LEVEL = ("bos_token_id", "eos_token_id", "pad_token_id")
REFUSED_FAMILIES = {
    "qwen3_next": "Qwen3-Next's linear-attention (Gated DeltaNet) layers and " + _MOE,
    "qwen2_moe": _MOE, "qwen3_moe": _MOE, "mixtral": _MOE, "granitemoe": _MOE, "granitemoehybrid": _MOE,
    "phimoe": _MOE, "olmoe": _MOE,
    "olmo": "OLMo 1's layer norm without weights",
    "phi": "Phi-1/Phi-2's parallel attention and MLP with LayerNorm and a GeLU MLP",
}

# What each family adds to the Llama block (transformers' own classes decide the same way):
# qwen2 always has a bias on q/k/v; llama and qwen3 put one on q/k/v/o when `attention_bias` is set
# (mistral's attention never has one); qwen3 normalizes each q and k head (q_norm, k_norm);
# smollm3 leaves RoPE out of some layers (NoPE: `no_rope_layers`, 0 where a layer has none);
# granite scales the embeddings, each residual branch, the attention scores and the logits;
# olmo2 normalizes the outputs of attention and MLP instead of their inputs (post_attention_layernorm,
# post_feedforward_layernorm) and q and k over the whole projection, all heads at once; phi3 stores
# q/k/v as one qkv_proj and gate/up as one gate_up_proj, and may rotate only the first
# partial_rotary_factor of each head.
FUSED_PROJECTIONS = ("phi3",)
QKV_BIAS_ALWAYS = ("qwen2",)
ATTENTION_BIAS_FLAG = ("llama", "qwen3", "smollm3", "granite", "olmo2", "gemma3_text")
QK_NORM = ("qwen3", "olmo2", "gemma3_text", "gemma4_text", "lfm2", "qwen3_5_text")
QK_NORM_ACROSS_HEADS = ("olmo2",)
POST_NORMS = ("olmo2",)
# gemma3_text (Gemma 3) normalizes both the input and the output of attention and of the MLP (four
# norms a layer), stores every norm weight as w for a scale of (1 + w), scales the embeddings by
# sqrt(hidden_size), uses a GeLU (tanh) MLP, an attention scale of query_pre_attn_scalar ** -0.5,
# and local RoPE (its own base, no scaling) on its sliding-window layers.
SANDWICH_NORMS = ("gemma3_text", "gemma4_text")
UNIT_OFFSET_NORMS = ("gemma3_text", "qwen3_5_text")
LOCAL_ROPE = ("gemma3_text",)
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
QWEN3_HEAD_DIM = 128  # transformers' Qwen3Config default when config.json has no head_dim
# Gemma 3's residual stream grows past fp16's 65504 in the published checkpoints (activations near
# 8e5), and its MLP's gate * up product overflows before down_proj. Every norm of a Gemma layer is
# scale invariant, so the stream (the embeddings and what the post-norms add to it) and the two
# branches' outputs before their post-norms (o_proj, up_proj) are carried times this power of two,
# with each norm's eps times its square: the same numbers in any precision (a power of two scales
# exactly), and finite in fp16.
STREAM_SCALE = {"gemma3_text": 2.0 ** -6, "gemma4_text": 2.0 ** -6}
# transformers' Gemma3TextConfig defaults, where config.json leaves a field out
GEMMA3_DEFAULTS = {"head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 4096,
                   "sliding_window_pattern": 6, "rms_norm_eps": 1e-6}
GEMMA3_ROPE = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}  # its default bases
# gemma4_text (Gemma 4) has Gemma 3's four norms a layer, stored as the weight itself (no 1 + w), and
# adds: an attention scale of 1 (q and k are normalized per head), a weightless norm of each v head,
# a per-layer input (PLE: a second, per-layer token embedding with a projection of the embeddings,
# fed into each layer after its MLP through a gate and a projection, then the layer's scalar),
# proportional partial RoPE on the global layers (only the first partial_rotary_factor of the
# frequencies rotate, the rest are zero), global layers that may take V from the K projection
# (attention_k_eq_v), and softcapped logits; E2B/E4B's global layers are wider than the sliding ones
# (global_head_dim, num_global_key_value_heads) and their last layers share earlier layers' K/V
# (num_kv_shared_layers). Its transformers defaults where config.json leaves a field out:
GEMMA4 = "gemma4_text"
GEMMA4_DEFAULTS = {"head_dim": 256, "sliding_window": 512, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
                   "hidden_size_per_layer_input": 256, "vocab_size_per_layer_input": 262_144,
                   "global_head_dim": 512}
# Gemma 4's own config fields: a manifest holds them only where they differ from their defaults (the
# Gemma 4 exports), so every other family's manifest reads as before and a host that does not know
# them refuses a Gemma 4 export by the field's name rather than run it wrong
GEMMA4_FIELDS = ("value_norm", "k_eq_v", "per_layer_input_size", "per_layer_vocab_size", "layer_scalar",
                 "final_logit_softcapping", "rope_proportion", "global_head_dim", "global_key_value_heads", "kv_shared_layers",
                 "double_wide_mlp")
GEMMA4_ROPE = {"full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                  "rope_theta": 1_000_000.0},
               "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}
# lfm2 (LFM2) puts a short convolution (conv_layers) in place of attention in most layers; its
# attention layers normalize each q and k head. Its config names some fields its own way, and
# transformers' Lfm2Config fills in the rest: the aliases and defaults below.
LFM2_ALIASES = {"norm_eps": "rms_norm_eps", "tie_embedding": "tie_word_embeddings",
                "block_ff_dim": "intermediate_size"}
LFM2_DEFAULTS = {"tie_word_embeddings": True, "rope_theta": 1_000_000.0, "rms_norm_eps": 1e-5}
# qwen3_5_text (Qwen3.5's text model) puts a Gated DeltaNet (linear attention, delta_layers) in most
# layers; its attention layers gate their output by a second half of q_proj (attn_output_gate),
# normalize each q and k head, and rotate the first quarter of each head; every norm but the
# DeltaNet's own gated one scales by (1 + w). Qwen3_5TextConfig's defaults, where config.json leaves a field out:
QWEN35 = "qwen3_5_text"
QWEN35_DEFAULTS = {"head_dim": 256, "rms_norm_eps": 1e-6, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
                   "linear_value_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
                   "full_attention_interval": 4, "max_position_embeddings": 32768}
QWEN35_ROTARY = 0.25  # its partial_rotary_factor where neither config.json nor its rope_parameters gives one
# Qwen3.5's own config fields: a manifest holds them only where they differ from their defaults, as GEMMA4_FIELDS
DELTA_FIELDS = ("delta_layers", "delta_key_heads", "delta_value_heads", "delta_key_dim",
                "delta_value_dim", "attn_output_gate")


class ConfigError(LlamaANEError, ValueError):
    """A checkpoint configuration we cannot export; the message says what and what is supported."""


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    model_type: str = "llama"
    qkv_bias: bool = False  # a bias on q_proj, k_proj and v_proj
    o_proj_bias: bool = False  # a bias on o_proj
    qk_norm: bool = False  # RMSNorm of q and k before RoPE: per head (weights (head_dim,)), or
    qk_norm_across_heads: bool = False  # over the whole projection (weights (q_channels,), (kv_channels,))
    post_norms: bool = False  # the attention and MLP outputs normalized before their residual add, not their inputs
    fused_projections: bool = False  # q/k/v stored as one qkv_proj, gate/up as one gate_up_proj (Phi-3)
    partial_rotary_factor: float = 1.0  # RoPE rotates the first rotary_dim channels of each head, the rest pass
    sliding_window: int | None = None  # the attention window when a layer uses one, else None
    sliding_layers: list[int] = field(default_factory=list)  # the layers that attend within sliding_window
    rope_local_theta: float | None = None  # the RoPE base of the sliding layers (None: rope_theta, as every layer)
    hidden_act: str = "silu"  # the MLP's gate activation: silu (SwiGLU) or gelu_pytorch_tanh (GeGLU)
    sandwich_norms: bool = False  # attention and MLP both have a norm before and after (Gemma 3)
    nope_layers: list[int] = field(default_factory=list)  # the layers that apply no RoPE to q and k
    conv_layers: list[int] = field(default_factory=list)  # the layers with a short convolution, not attention
    conv_kernel: int = 3  # the short convolution's kernel (LFM2's conv_L_cache, Qwen3.5's linear_conv_kernel_dim)
    conv_bias: bool = False  # biases on the short convolution's projections and kernel
    # Qwen3.5: the layers with a Gated DeltaNet (linear attention), not attention (its short
    # convolution's kernel is conv_kernel); its key and value heads and their widths; and whether
    # attention gates its output (q_proj's second half, through a sigmoid, before o_proj)
    delta_layers: list[int] = field(default_factory=list)
    delta_key_heads: int = 0
    delta_value_heads: int = 0
    delta_key_dim: int = 0
    delta_value_dim: int = 0
    attn_output_gate: bool = False
    # Gemma 4: the weightless norm of each v head, V from the K projection on the global layers, the
    # per-layer inputs' width (0: none) and vocabulary, each layer's stored scalar, the logits'
    # softcap (None: none), and the global layers' RoPE: proportional, the first rope_proportion of
    # its head_dim/2 frequencies rotating (1.0: all, as every other family)
    value_norm: bool = False
    k_eq_v: bool = False
    per_layer_input_size: int = 0
    per_layer_vocab_size: int = 0
    layer_scalar: bool = False
    final_logit_softcapping: float | None = None
    rope_proportion: float = 1.0
    # Gemma 4's global (not sliding) layers' head_dim and kv heads where they differ from the sliding
    # layers' (0: the same); see `at`
    global_head_dim: int = 0
    global_key_value_heads: int = 0
    # Gemma 4's KV-shared layers: the last kv_shared_layers layers compute no K/V and attend over the
    # K/V of the last earlier layer of their type (kv_producer); with double_wide_mlp their MLP is
    # twice as wide
    kv_shared_layers: int = 0
    double_wide_mlp: bool = False
    # Granite's multipliers: of the embeddings, of each attention and MLP output before its residual
    # add, the attention scale (None: 1/sqrt(head_dim)), and the divisor of the logits
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_scale: float | None = None
    logits_scaling: float = 1.0

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], origin: str = "config.json") -> "LlamaConfig":
        """Build and validate from a Hugging Face `config.json` dictionary. Every field is checked for
        its JSON type and range before use: `origin` (the file it came from) and the field are named
        in the ConfigError a wrong one raises."""
        if not isinstance(d, dict):
            raise ConfigError(f"{origin} holds {_json_type(d)}, not a JSON object of config fields")
        if d.get("model_type") in MULTIMODAL:
            d, origin = text_model_config(d, origin), f"{origin} text_config"
        f = _Fields(d, origin)
        model_type = d.get("model_type")
        if model_type in REFUSED_FAMILIES:
            raise ConfigError(f"unsupported model_type {model_type!r}: the export has no "
                              f"{REFUSED_FAMILIES[model_type]}; {SUPPORTED_DESCRIPTION}")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(f"unsupported model_type {model_type!r}; {SUPPORTED_DESCRIPTION}")
        gemma = model_type in SANDWICH_NORMS
        if model_type == GEMMA4:
            d = _gemma4_fields(f)
            f = _Fields(d, origin)
        elif gemma:
            _refuse_gemma3_fields(f)
            d = {**GEMMA3_DEFAULTS, "tie_word_embeddings": True, **{k: v for k, v in d.items() if v is not None}}
            f = _Fields(d, origin)
        if model_type == "lfm2":
            d = _lfm2_fields(f)
            f = _Fields(d, origin)
        if model_type == QWEN35:
            d = {**QWEN35_DEFAULTS, **{k: v for k, v in d.items() if v is not None}}
            f = _Fields(d, origin)
        act_field = "hidden_activation" if gemma else "hidden_act"
        act = d.get(act_field, "gelu_pytorch_tanh" if gemma else "silu")
        if act != ("gelu_pytorch_tanh" if gemma else "silu"):
            raise ConfigError(f"unsupported {act_field} {act!r}; {SUPPORTED_DESCRIPTION}")
        if f.boolean("mlp_bias"):
            raise ConfigError(f"mlp_bias is not supported; {SUPPORTED_DESCRIPTION}")
        biased = f.boolean("attention_bias") and model_type in ATTENTION_BIAS_FLAG
        required = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads"]
        missing = [k for k in required if d.get(k) is None]
        if missing:
            raise ConfigError(f"{origin} lacks {', '.join(missing)}")

        rope = f.mapping("rope_parameters")
        local_theta = None
        if model_type == GEMMA4:
            rope, local_theta = _gemma4_rope(f, rope)
        elif gemma:
            rope, local_theta = _gemma3_rope(f, rope)
        # as transformers 5 reads it: rope_parameters' base over a top-level rope_theta (checked all the same)
        top_theta = f.number("rope_theta", None)
        rope_theta = _Fields(rope, f"{origin} rope_parameters").number("rope_theta", None) or top_theta or 10000.0
        scaling = f.mapping("rope_scaling") or {k: v for k, v in rope.items() if k != "rope_theta"}
        scaling = _rope_scaling(scaling, origin, d, model_type) if scaling else None
        rotary = f.number("partial_rotary_factor", None) or _Fields(rope, f"{origin} rope_parameters").number(
            "partial_rotary_factor", QWEN35_ROTARY if model_type == QWEN35 else 1.0)

        eos_list = f.token_ids("eos_token_id")
        window, sliding = _sliding_window(f, model_type)
        hidden, heads = f.integer("hidden_size"), f.integer("num_attention_heads")
        head_dim = f.integer("head_dim", None)
        if head_dim is None and model_type == "qwen3":
            head_dim = QWEN3_HEAD_DIM
        elif head_dim is None:  # transformers derives it, which needs heads to divide the hidden size
            if hidden % heads:
                raise ConfigError(f"{origin}: hidden_size ({hidden}) is not a multiple of num_attention_heads "
                                  f"({heads}) and there is no head_dim; fix one of them or add head_dim")
            head_dim = hidden // heads
        cfg = cls(
            vocab_size=f.integer("vocab_size"),
            hidden_size=hidden,
            intermediate_size=f.integer("intermediate_size"),
            num_hidden_layers=f.integer("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=f.integer("num_key_value_heads", heads),
            head_dim=head_dim,
            rms_norm_eps=f.number("rms_norm_eps", 1e-5),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            max_position_embeddings=f.integer("max_position_embeddings", 2048),
            tie_word_embeddings=f.boolean("tie_word_embeddings"),
            bos_token_id=f.integer("bos_token_id", None, minimum=0),
            eos_token_id=eos_list,
            model_type=model_type,
            qkv_bias=biased or model_type in QKV_BIAS_ALWAYS,
            o_proj_bias=biased,
            qk_norm=model_type in QK_NORM,
            qk_norm_across_heads=model_type in QK_NORM_ACROSS_HEADS,
            post_norms=model_type in POST_NORMS,
            fused_projections=model_type in FUSED_PROJECTIONS,
            partial_rotary_factor=rotary,
            sliding_window=window,
            sliding_layers=sliding,
            rope_local_theta=local_theta,
            hidden_act=act,
            sandwich_norms=gemma,
            nope_layers=_nope_layers(f, model_type),
            **_conv_fields(f, model_type),
            **_delta_fields(f, model_type),
            **_multipliers(f, model_type),
            **_gemma4_extras(f, model_type),
        )
        cfg.validate()
        return cfg

    def validate(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        scales = ("embedding_multiplier", "residual_multiplier", "logits_scaling") + (
            ("attention_scale",) if self.attention_scale is not None else ())
        for name in ("rms_norm_eps", "rope_theta") + scales:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ConfigError(f"{name} must be a positive number, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for RoPE, got {self.head_dim}")
        for name in ("qk_norm", "qk_norm_across_heads", "post_norms", "fused_projections", "tie_word_embeddings",
                     "sandwich_norms", "conv_bias", "value_norm", "k_eq_v", "layer_scalar"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        layers = self.num_hidden_layers
        if not (isinstance(self.nope_layers, list)
                and all(type(n) is int and 0 <= n < layers for n in self.nope_layers)):
            raise ConfigError(f"nope_layers must be a list of layer indices below num_hidden_layers ({layers}), "
                              f"got {self.nope_layers!r}")
        if not (isinstance(self.conv_layers, list)
                and all(type(n) is int and 0 <= n < layers for n in self.conv_layers)):
            raise ConfigError(f"conv_layers must be a list of layer indices below num_hidden_layers ({layers}), "
                              f"got {self.conv_layers!r}")
        if isinstance(self.conv_kernel, bool) or not isinstance(self.conv_kernel, int) or self.conv_kernel < 2:
            raise ConfigError(f"conv_kernel must be an integer of at least 2, got {self.conv_kernel!r}")
        self._validate_delta()
        if not (isinstance(self.sliding_layers, list)
                and all(type(n) is int and 0 <= n < layers for n in self.sliding_layers)):
            raise ConfigError(f"sliding_layers must be a list of layer indices below num_hidden_layers ({layers}), "
                              f"got {self.sliding_layers!r}")
        if self.sliding_layers and (type(self.sliding_window) is not int or self.sliding_window <= 0):
            raise ConfigError(f"sliding_window must be a positive integer where sliding_layers are given, "
                              f"got {self.sliding_window!r}")
        if self.rope_local_theta is not None and (isinstance(self.rope_local_theta, bool) or not isinstance(
                self.rope_local_theta, (int, float)) or not 0 < self.rope_local_theta < math.inf):
            raise ConfigError(f"rope_local_theta must be a positive number or null, got {self.rope_local_theta!r}")
        for name in ("per_layer_input_size", "per_layer_vocab_size", "global_head_dim", "global_key_value_heads",
                     "kv_shared_layers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"{name} must be an integer >= 0, got {value!r}")
        if not isinstance(self.double_wide_mlp, bool):
            raise ConfigError(f"double_wide_mlp must be true or false, got {self.double_wide_mlp!r}")
        if self.kv_shared_layers:
            first = layers - self.kv_shared_layers
            missing = sorted({self.slides(n) for n in range(max(first, 0), layers)}
                             - {self.slides(n) for n in range(max(first, 0))})
            if first <= 0 or missing:
                raise ConfigError(f"kv_shared_layers {self.kv_shared_layers}: the KV-shared layers (from layer {first} "
                                  f"on) need an earlier layer of each of their types to take K/V from; lower "
                                  "num_kv_shared_layers")
        if self.global_head_dim % 2:
            raise ConfigError(f"global_head_dim must be even for RoPE, got {self.global_head_dim}")
        if self.global_key_value_heads and self.num_attention_heads % self.global_key_value_heads:
            raise ConfigError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                              f"global_key_value_heads ({self.global_key_value_heads})")
        if self.per_layer_input_size and not self.per_layer_vocab_size:
            raise ConfigError("per_layer_vocab_size must be positive where per_layer_input_size is")
        cap = self.final_logit_softcapping
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or not 0 < cap < math.inf):
            raise ConfigError(f"final_logit_softcapping must be a positive number or null, got {cap!r}")
        p = self.rope_proportion
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p <= 1:
            raise ConfigError(f"rope_proportion must be a number in [0, 1], got {p!r}")
        if self.hidden_act not in ACTIVATIONS:
            raise ConfigError(f"hidden_act must be one of {', '.join(ACTIVATIONS)}, got {self.hidden_act!r}")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, dict):
            raise ConfigError(f"rope_scaling must be an object or null, got {self.rope_scaling!r}")
        if isinstance(self.partial_rotary_factor, bool) or not isinstance(self.partial_rotary_factor, (int, float)):
            raise ConfigError(f"partial_rotary_factor must be a number, got {self.partial_rotary_factor!r}")
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim % 2 or not self.rotary_dim:
            raise ConfigError(f"partial_rotary_factor {self.partial_rotary_factor} rotates {self.rotary_dim} of "
                              f"head_dim {self.head_dim} channels; it must be in (0, 1] and rotate an even, "
                              "nonzero number of them")
        s = self.rope_scaling or {}
        for name in ("short_factor", "long_factor") if s.get("rope_type") == "longrope" else ():
            factors = s.get(name)
            if not isinstance(factors, list) or len(factors) != self.rotary_dim // 2:
                raise ConfigError(f"rope_scaling {name} is {_json_type(factors)}; it must list one number for "
                                  f"each rotated channel pair, rotary_dim / 2 = {self.rotary_dim // 2}")
        for name, ids in (("bos_token_id", [] if self.bos_token_id is None else [self.bos_token_id]),
                          ("eos_token_id", self.eos_token_id)):
            outside = [i for i in ids if not 0 <= i < self.vocab_size]
            if outside:  # the sampler would stop on (or the runtime feed) a token the model has no row for
                raise ConfigError(f"{name} {outside[0]} is outside the vocabulary (vocab_size {self.vocab_size})")

    def _validate_delta(self) -> None:
        """Qwen3.5's linear-attention fields (DELTA_FIELDS)."""
        layers = self.num_hidden_layers
        if not (isinstance(self.delta_layers, list)
                and all(type(n) is int and 0 <= n < layers for n in self.delta_layers)):
            raise ConfigError(f"delta_layers must be a list of layer indices below num_hidden_layers ({layers}), "
                              f"got {self.delta_layers!r}")
        if set(self.delta_layers) & set(self.conv_layers):
            raise ConfigError("a layer cannot be both in delta_layers and conv_layers: a model has short-convolution "
                              "or linear-attention layers")
        if not isinstance(self.attn_output_gate, bool):
            raise ConfigError(f"attn_output_gate must be true or false, got {self.attn_output_gate!r}")
        sizes = ("delta_key_heads", "delta_value_heads", "delta_key_dim", "delta_value_dim")
        for name in sizes:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"{name} must be an integer >= 0, got {value!r}")
        if not self.delta_layers:
            return
        for name in sizes:
            if not getattr(self, name):
                raise ConfigError(f"{name} must be positive where delta_layers are given")
        if self.delta_value_heads % self.delta_key_heads:
            raise ConfigError(f"linear_num_value_heads ({self.delta_value_heads}) must be a multiple of "
                              f"linear_num_key_heads ({self.delta_key_heads})")

    def rotary(self, layer: int) -> bool:
        """Whether decoder layer `layer` (0-based, in the whole model) rotates q and k."""
        return layer not in self.nope_layers

    def convolves(self, layer: int) -> bool:
        """Whether decoder layer `layer` keeps a short convolution's state and no K/V: LFM2's conv layers,
        and Qwen3.5's linear-attention layers (`linear`), whose Gated DeltaNet convolves q, k and v."""
        return layer in self.conv_layers or layer in self.delta_layers

    def linear(self, layer: int) -> bool:
        """Whether decoder layer `layer` is a linear-attention layer (Qwen3.5's Gated DeltaNet) rather than attention."""
        return layer in self.delta_layers

    def slides(self, layer: int) -> bool:
        """Whether decoder layer `layer` attends within `sliding_window` only (a query at position p
        to the keys in (p - window, p])."""
        return layer in self.sliding_layers

    def at(self, layer: int) -> "LlamaConfig":
        """The config decoder layer `layer` computes with: this one, but on a global layer of a model
        whose global layers are wider (Gemma 4's global_head_dim, global_key_value_heads) its
        head_dim and num_key_value_heads are theirs, and on a KV-shared layer with double_wide_mlp
        its intermediate_size is twice the others'."""
        change: dict[str, Any] = {}
        if self.wide_global and not self.slides(layer) and layer >= 0:
            change.update(head_dim=self.global_head_dim or self.head_dim, global_head_dim=0, global_key_value_heads=0,
                          num_key_value_heads=self.global_key_value_heads or self.num_key_value_heads)
        if self.double_wide_mlp and self.shares_kv(layer):
            change.update(intermediate_size=2 * self.intermediate_size, double_wide_mlp=False)
        return dataclasses.replace(self, **change) if change else self

    def shares_kv(self, layer: int) -> bool:
        """Whether decoder layer `layer` is a KV-shared layer (Gemma 4's last kv_shared_layers): it
        computes no K/V and keeps no cache, attending over its kv_producer's."""
        return bool(self.kv_shared_layers) and layer >= self.num_hidden_layers - self.kv_shared_layers

    def kv_producer(self, layer: int) -> int:
        """The layer whose K/V KV-shared layer `layer` attends over: the last layer before the
        KV-shared ones of the same type (sliding or global), as transformers' kv_sharing_modes."""
        first = self.num_hidden_layers - self.kv_shared_layers
        return max(n for n in range(first) if self.slides(n) == self.slides(layer))

    @property
    def wide_global(self) -> bool:
        """Whether the global layers' heads differ from the sliding layers' (see `at`): then the
        sliding layers' K/V must live in the ring, apart from the global layers' cache."""
        return bool(self.global_head_dim or self.global_key_value_heads)

    @property
    def global_layers(self) -> "LlamaConfig":
        """The config of the global (not sliding) layers (`at` of one): what the full cache and the
        cos/sin tables are sized by."""
        return self.at(next((n for n in range(self.num_hidden_layers) if not self.slides(n)), -1))

    def windowed(self, context_length: int) -> bool:
        """Whether an export of `context_length` positions needs the sliding layers' own masks: only
        where a query can be `sliding_window` or more past a key."""
        return bool(self.sliding_layers) and self.sliding_window < context_length

    def local_rope(self, layer: int) -> bool:
        """Whether decoder layer `layer` rotates with the local RoPE tables (Gemma 3's sliding layers)."""
        return self.rope_local_theta is not None and self.slides(layer)

    def check_context_length(self, context_length: int) -> None:
        """Every context length is exported as the model computes it: the sliding layers read their
        own mask (see `windowed`), so no length is refused for the window's sake."""

    @property
    def stream_scale(self) -> float:
        """The power of two the residual stream is carried at (STREAM_SCALE; 1 for most families)."""
        return STREAM_SCALE.get(self.model_type, 1.0)

    @property
    def stream_eps(self) -> float:
        """The eps of a norm that reads the scaled stream or a scaled branch output: rms_norm_eps times
        the scale's square, so the norm gives what the unscaled model does."""
        return self.rms_norm_eps * self.stream_scale ** 2

    @property
    def embedding_scale(self) -> float:
        """What the embedding rows are multiplied by: the family's multiplier, at the stream's scale."""
        return self.embedding_multiplier * self.stream_scale

    @property
    def layer_extras(self) -> tuple[str, ...]:
        """The decoder-layer parameters this family has beyond the Llama block's (names as in
        model.chunk.DecoderLayer): projection biases, the q/k norms and the norm after the MLP (whose
        block has no input_layernorm: `input_norm`)."""
        extras = ("q_proj.bias", "k_proj.bias", "v_proj.bias") if self.qkv_bias else ()
        extras += ("o_proj.bias",) if self.o_proj_bias else ()
        extras += ("q_norm.weight", "k_norm.weight") if self.qk_norm else ()
        extras += ("pre_feedforward_layernorm.weight",) if self.sandwich_norms else ()
        extras += ("post_feedforward_layernorm.weight",) if self.post_norms or self.sandwich_norms else ()
        extras += ("per_layer_input_gate.weight", "per_layer_projection.weight",
                   "post_per_layer_input_norm.weight") if self.per_layer_input_size else ()
        return extras + (("layer_scalar",) if self.layer_scalar else ())

    @property
    def per_layer_channels(self) -> int:
        """Channels of Gemma 4's per-layer inputs of all layers: num_hidden_layers * per_layer_input_size."""
        return self.num_hidden_layers * self.per_layer_input_size

    def value_from_key(self, layer: int) -> bool:
        """Whether decoder layer `layer` takes V from its K projection (Gemma 4's global layers with attention_k_eq_v)."""
        return self.k_eq_v and not self.slides(layer)

    @property
    def input_norm(self) -> bool:
        """Whether the layer normalizes its input (input_layernorm), the Llama block's pre-norm."""
        return not self.post_norms

    @property
    def q_norm_channels(self) -> int:
        return self.q_channels if self.qk_norm_across_heads else self.head_dim

    @property
    def k_norm_channels(self) -> int:
        return self.kv_channels if self.qk_norm_across_heads else self.head_dim

    @property
    def rotary_dim(self) -> int:
        """The channels of each head that RoPE rotates (as transformers: int(head_dim * partial_rotary_factor))."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def qkv_channels(self) -> int:
        """Rows of a fused qkv_proj: q's, then k's, then v's."""
        return self.q_channels + 2 * self.kv_channels

    @property
    def conv_channels(self) -> int:
        """Channels of a layer's short-convolution state: LFM2's hidden size, Qwen3.5's in_proj_qkv rows."""
        return self.delta_conv_channels if self.delta_layers else self.hidden_size

    @property
    def delta_conv_channels(self) -> int:
        """Rows of a Gated DeltaNet's in_proj_qkv (and channels of its convolution): q, k, then v."""
        return 2 * self.delta_key_heads * self.delta_key_dim + self.delta_value_heads * self.delta_value_dim

    @property
    def delta_value_channels(self) -> int:
        """A Gated DeltaNet's value heads times their width: in_proj_z's rows, out_proj's columns."""
        return self.delta_value_heads * self.delta_value_dim

    @property
    def gated_q_channels(self) -> int:
        """Rows of an output-gated attention's q_proj (Qwen3.5): each head's query, then its gate."""
        return 2 * self.q_channels

    @property
    def conv_in_channels(self) -> int:
        """Rows of a short convolution's in_proj: its gates B and C and its input x, hidden_size each."""
        return 3 * self.hidden_size

    @property
    def gate_up_channels(self) -> int:
        """Rows of a fused gate_up_proj: gate's, then up's."""
        return 2 * self.intermediate_size

    @property
    def query_scale(self) -> float:
        """The factor of the attention scores (folded into q): Granite's attention_multiplier, else 1/sqrt(head_dim)."""
        return self.head_dim ** -0.5 if self.attention_scale is None else self.attention_scale

    @property
    def kv_channels(self) -> int:
        """Channels of one layer's K (or V) cache: num_key_value_heads * head_dim."""
        return self.num_key_value_heads * self.head_dim

    @property
    def q_channels(self) -> int:
        return self.num_attention_heads * self.head_dim

    def transformers_config(self):
        """transformers' config object of this family (LlamaConfig, Qwen2Config, ...)."""
        from transformers import AutoConfig

        d = {k: v for k, v in self.to_hf_dict().items() if v is not None or k in ("rope_scaling", "sliding_window")}
        return AutoConfig.for_model(**d)

    def to_dict(self) -> dict[str, Any]:
        """Every field, but GEMMA4_FIELDS and DELTA_FIELDS only where they are not their defaults (the manifest's copy)."""
        own = GEMMA4_FIELDS + DELTA_FIELDS
        defaults = {f.name: f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
                    for f in dataclasses.fields(self) if f.name in own}
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in defaults or v != defaults[k]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "LlamaConfig":
        """Inverse of `to_dict` (the manifest's copy); unknown keys are dropped."""
        names = {f.name for f in dataclasses.fields(cls)}
        cfg = cls(**{k: v for k, v in d.items() if k in names})
        cfg.validate()
        return cfg

    def to_hf_dict(self) -> dict[str, Any]:
        """A transformers config dictionary of this family (`AutoConfig.for_model(**d)`, or the
        family's config class), for building the reference model."""
        ours = ("eos_token_id", "qkv_bias", "o_proj_bias", "qk_norm", "qk_norm_across_heads", "post_norms",
                "fused_projections", "sliding_window", "nope_layers", "sliding_layers", "rope_local_theta",
                "hidden_act", "sandwich_norms", "conv_layers", "conv_kernel", "conv_bias",
                "embedding_multiplier", "residual_multiplier", "attention_scale", "logits_scaling", "value_norm",
                "k_eq_v", "per_layer_input_size", "per_layer_vocab_size", "layer_scalar", "final_logit_softcapping",
                "rope_proportion", "global_head_dim", "global_key_value_heads", "kv_shared_layers", "double_wide_mlp"
                ) + DELTA_FIELDS
        d = {k: v for k, v in self.to_dict().items() if k not in ours}
        d["eos_token_id"] = self.eos_token_id[0] if len(self.eos_token_id) == 1 else (self.eos_token_id or None)
        d["hidden_act"] = self.hidden_act
        d["attention_bias"] = self.o_proj_bias
        d["mlp_bias"] = False
        d["sliding_window"] = self.sliding_window
        if self.sliding_layers and self.model_type != "mistral":
            d["layer_types"] = ["sliding_attention" if self.slides(n) else "full_attention"
                                for n in range(self.num_hidden_layers)]
        if self.model_type in ("qwen2", "qwen3"):
            d["use_sliding_window"] = self.sliding_window is not None
            d["max_window_layers"] = 0
        if self.model_type == "smollm3":
            d["no_rope_layers"] = [int(self.rotary(n)) for n in range(self.num_hidden_layers)]
            d["use_sliding_window"] = self.sliding_window is not None
        if self.model_type == GEMMA4:
            return self._gemma4_hf_dict(d)
        if self.sandwich_norms:  # Gemma 3's own names, its scales as the fields they come from
            del d["hidden_act"]
            d.update(hidden_activation=self.hidden_act, rope_local_base_freq=self.rope_local_theta,
                     query_pre_attn_scalar=_whole(self.query_scale ** -2), final_logit_softcapping=None,
                     attn_logit_softcapping=None, sliding_window=self.sliding_window or self.max_position_embeddings)
            if not self.sliding_layers:
                d["layer_types"] = ["full_attention"] * self.num_hidden_layers
        if self.model_type == "phi3":  # its config reads these at the top level
            d["original_max_position_embeddings"] = (self.rope_scaling or {}).get(
                "original_max_position_embeddings", self.max_position_embeddings)
        else:
            del d["partial_rotary_factor"]
        if self.model_type == "lfm2":  # the MLP width as it is (already adjusted), LFM2's own names
            d.update(layer_types=["conv" if self.convolves(n) else "full_attention"
                                  for n in range(self.num_hidden_layers)],
                     conv_L_cache=self.conv_kernel, conv_bias=self.conv_bias, block_auto_adjust_ff_dim=False,
                     norm_eps=self.rms_norm_eps)
            del d["hidden_act"], d["attention_bias"], d["mlp_bias"], d["sliding_window"], d["rms_norm_eps"]
        if self.model_type == QWEN35:  # Qwen3_5TextConfig's names; its RoPE rotates partial_rotary_factor of a head
            d.update(layer_types=["linear_attention" if self.linear(n) else "full_attention"
                                  for n in range(self.num_hidden_layers)],
                     linear_conv_kernel_dim=self.conv_kernel, linear_num_key_heads=self.delta_key_heads,
                     linear_num_value_heads=self.delta_value_heads, linear_key_head_dim=self.delta_key_dim,
                     linear_value_head_dim=self.delta_value_dim,
                     rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta,
                                      "partial_rotary_factor": self.partial_rotary_factor})
            for name in ("mlp_bias", "sliding_window", "rope_theta", "rope_scaling"):
                d.pop(name, None)
        if self.model_type == "granite":
            d.update(embedding_multiplier=self.embedding_multiplier, residual_multiplier=self.residual_multiplier,
                     attention_multiplier=self.query_scale, logits_scaling=self.logits_scaling)
        return d

    def _gemma4_hf_dict(self, d: dict[str, Any]) -> dict[str, Any]:
        """to_hf_dict of Gemma 4 (Gemma4TextConfig's names): the RoPE per layer type, the global
        layers' head sizes."""
        wide = self.global_layers
        full = {"rope_type": "proportional", "rope_theta": self.rope_theta, "partial_rotary_factor": self.rope_proportion,
                **({"factor": self.rope_scaling["factor"]} if self.rope_scaling else {})}
        for name in ("hidden_act", "mlp_bias", "rope_scaling", "partial_rotary_factor", "attention_bias"):
            d.pop(name, None)
        d.update(hidden_activation=self.hidden_act, sliding_window=self.sliding_window or self.max_position_embeddings,
                 layer_types=["sliding_attention" if self.slides(n) else "full_attention"
                              for n in range(self.num_hidden_layers)],
                 rope_parameters={"full_attention": full, "sliding_attention": {
                     "rope_type": "default", "rope_theta": self.rope_local_theta}},
                 global_head_dim=wide.head_dim, num_global_key_value_heads=wide.num_key_value_heads,
                 attention_k_eq_v=self.k_eq_v, num_kv_shared_layers=self.kv_shared_layers, enable_moe_block=False,
                 use_double_wide_mlp=self.double_wide_mlp,
                 hidden_size_per_layer_input=self.per_layer_input_size,
                 vocab_size_per_layer_input=self.per_layer_vocab_size or self.vocab_size,
                 final_logit_softcapping=self.final_logit_softcapping)
        return d


def _sliding_window(f: "_Fields", model_type: str) -> tuple[int | None, list[int]]:
    """The attention window and the layers that use it (None, []: every layer attends to everything),
    as transformers reads them: Mistral's `sliding_window` applies to every layer; Qwen's only with
    `use_sliding_window`, to the layers `layer_types` (or from `max_window_layers` on) names;
    SmolLM3's to its layers without RoPE; Gemma 3's to those `layer_types` (or all but every
    `sliding_window_pattern`-th layer) names."""
    window = f.integer("sliding_window", None)
    layers = f.integer("num_hidden_layers")
    if window is None or model_type == "llama":
        return None, []
    if model_type in ("qwen2", "qwen3", "smollm3") and not f.boolean("use_sliding_window"):
        return None, []
    types = f.d.get("layer_types")
    if types is not None and not (isinstance(types, list) and len(types) == layers and all(
            t in ("sliding_attention", "full_attention") for t in types)):
        raise ConfigError(f"{f.origin}: layer_types is {_json_type(types)}; it must list num_hidden_layers "
                          f"({layers}) entries, each \"sliding_attention\" or \"full_attention\"")
    if types is not None and model_type != "mistral":
        sliding = [n for n, t in enumerate(types) if t == "sliding_attention"]
    elif model_type in ("qwen2", "qwen3"):
        sliding = list(range(f.integer("max_window_layers", 28, minimum=0), layers))
    elif model_type == "smollm3":
        sliding = _nope_layers(f, model_type)
    elif model_type in SANDWICH_NORMS:
        pattern = f.integer("sliding_window_pattern")
        sliding = [n for n in range(layers) if (n + 1) % pattern]
    else:
        sliding = list(range(layers))
    return (window, sliding) if sliding else (None, [])


def text_model_config(d: dict[str, Any], origin: str = "config.json") -> dict[str, Any]:
    """The text model's config of a multimodal checkpoint's `d` (model_type of MULTIMODAL), as
    transformers' composite config class builds it: its text_config with the text config class's
    defaults filled in (a Hub text_config may list only the fields that differ from them), the token
    ids the composite keeps at its top level where text_config lacks them, and the composite's own
    tie_word_embeddings (which its ForConditionalGeneration ties the LM head by). A config without
    a text_config object, or whose text model is not the family's, is refused naming the field."""
    from transformers import AutoConfig

    model_type = d["model_type"]
    text_type, what = MULTIMODAL[model_type]
    text = d.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError(f"{origin}: model_type {model_type!r} is a multimodal checkpoint whose text model "
                          f"({what}, model_type {text_type!r}, weights under model.language_model.* or "
                          f"language_model.*) the export takes from text_config, which is {_json_type(text)} "
                          "(unsupported without it); restore the checkpoint's config.json, whose text_config is an "
                          "object of the text model's fields")
    if text.get("model_type", text_type) != text_type:
        raise ConfigError(f"{origin}: text_config.model_type is {_json_type(text['model_type'])}, but a "
                          f"{model_type!r} checkpoint's text model is {text_type!r} ({what}); set "
                          f"text_config.model_type to {text_type!r} or restore the checkpoint's config.json")
    top = {k: d[k] for k in MULTIMODAL_TOP_LEVEL if d.get(k) is not None and text.get(k) is None}
    try:
        composite = AutoConfig.for_model(**{**d, "text_config": {**text, **top, "model_type": text_type}})
        out = composite.get_text_config().to_dict()
    except Exception as e:  # transformers' checks raise anything from ValueError to its own errors
        why = " ".join(str(e).split())[:300]  # its strict checks name the field and what it must be
        raise ConfigError(f"{origin}: transformers cannot read the text_config of this {model_type!r} checkpoint "
                          f"({type(e).__name__}: {why}); fix that field or restore the checkpoint's "
                          "config.json") from None
    tie = getattr(composite, "tie_word_embeddings", None)
    return {**out, **top, "model_type": text_type, **({} if tie is None else {"tie_word_embeddings": tie})}


def _refuse_gemma3_fields(f: "_Fields") -> None:
    """Gemma 3 options the export does not build, refused by name (Gemma 2's softcapping is off in
    every Gemma 3 checkpoint; the embedding models attend both ways)."""
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if f.d.get(name) is not None:
            raise ConfigError(f"{f.origin}: {name} is {_json_type(f.d[name])}; the export does not do logit "
                              "softcapping (Gemma 3 leaves it null)")
    if f.boolean("use_bidirectional_attention"):
        raise ConfigError(f"{f.origin}: use_bidirectional_attention is true; the export builds causal language "
                          "models only")


def _gemma3_rope(f: "_Fields", rope: dict[str, Any]) -> tuple[dict[str, Any], float]:
    """Gemma 3's global RoPE parameters (rope_theta and its scaling, in the form the other families
    use) and the local base of its sliding layers, from transformers 5's `rope_parameters` per
    layer type or transformers 4's rope_theta / rope_scaling / rope_local_base_freq."""
    if "full_attention" in rope or "sliding_attention" in rope:
        local = _Fields(rope, f"{f.origin} rope_parameters").mapping("sliding_attention")
        lf = _Fields(local, f"{f.origin} rope_parameters.sliding_attention")
        if local.get("rope_type", local.get("type", "default")) != "default":
            raise ConfigError(f"{f.origin}: rope_parameters.sliding_attention has rope_type "
                              f"{local.get('rope_type')!r}; the sliding layers' RoPE must be the default one")
        full = _Fields(rope, f"{f.origin} rope_parameters").mapping("full_attention")
        full.setdefault("rope_theta", GEMMA3_ROPE["full_attention"])
        return full, lf.number("rope_theta", GEMMA3_ROPE["sliding_attention"])
    if f.number("rope_theta", None) is None:
        rope = {**rope, "rope_theta": GEMMA3_ROPE["full_attention"]}
    return rope, f.number("rope_local_base_freq", GEMMA3_ROPE["sliding_attention"])


def _gemma4_fields(f: "_Fields") -> dict[str, Any]:
    """Gemma 4's config.json with Gemma4TextConfig's defaults filled in (its layer types: every sixth
    layer global, the last one always; its RoPE per layer type), checked for what the export does not
    build, each refused by name."""
    d = {**GEMMA4_DEFAULTS, **{k: v for k, v in f.d.items() if v is not None}}
    g = _Fields(d, f.origin)
    refuse = lambda what: ConfigError(f"{f.origin}: {what}")  # noqa: E731
    if g.boolean("enable_moe_block"):
        raise refuse(f"enable_moe_block is true; the export has no {_MOE} (Gemma 4's MoE block)")
    # "vision": image tokens attend both ways, text causally; a text model has no image tokens
    if d.get("use_bidirectional_attention") not in (None, "vision"):
        raise refuse(f"use_bidirectional_attention is {_json_type(d['use_bidirectional_attention'])}; the "
                     "export builds causal language models only")
    if g.boolean("attention_bias"):
        raise refuse("attention_bias is true; the export builds Gemma 4's attention without biases")
    if d.get("attn_logit_softcapping") is not None:
        raise refuse("attn_logit_softcapping is set; the export does not softcap attention scores")
    layers = g.integer("num_hidden_layers")
    types = d.get("layer_types")
    if types is None:
        types = ["sliding_attention" if (n + 1) % 6 else "full_attention" for n in range(layers)]
    if isinstance(types, list) and types and types[-1] == "sliding_attention":
        types = [*types[:-1], "full_attention"]  # as Gemma4TextConfig forces it
    head_dim, kv_heads = g.integer("head_dim"), g.integer("num_key_value_heads", g.integer("num_attention_heads"))
    glob = _gemma4_global_heads(g, types, layers)
    if glob[1] != kv_heads and not g.boolean("attention_k_eq_v"):
        raise refuse(f"per_layer_config gives the global layers {glob[1]} kv heads where the sliding layers have "
                     f"{kv_heads} without attention_k_eq_v; the export builds other kv heads on the global layers "
                     "only as num_global_key_value_heads of an attention_k_eq_v model")
    g.integer("num_kv_shared_layers", 0, minimum=0)
    rope = d.get("rope_parameters") or {}
    if not isinstance(rope, dict) or (rope and not {"full_attention", "sliding_attention"} <= set(rope)):
        raise refuse(f"rope_parameters is {_json_type(rope)}; Gemma 4's has an object per layer type "
                     "(full_attention, sliding_attention)")
    rope = {kind: {**GEMMA4_ROPE[kind], **(rope.get(kind) or {})} for kind in GEMMA4_ROPE}
    # Gemma4TextConfig reads its RoPE from rope_parameters only (a top-level rope_theta is ignored)
    d = {k: v for k, v in d.items() if k not in ("rope_theta", "rope_scaling", "partial_rotary_factor")}
    return {**d, "layer_types": types, "rope_parameters": rope}


def _gemma4_global_heads(g: "_Fields", types: Any, layers: int) -> tuple[int, int]:
    """The head_dim and kv heads of Gemma 4's global layers: per_layer_config's overrides (every
    global layer's the same, none for a sliding layer), else global_head_dim and, where
    attention_k_eq_v is set, num_global_key_value_heads, as Gemma4TextConfig fills them in."""
    head_dim, kv_heads = g.integer("head_dim"), g.integer("num_key_value_heads", g.integer("num_attention_heads"))
    per_layer = g.d.get("per_layer_config")
    if per_layer is None:
        kv = g.integer("num_global_key_value_heads", None) if g.boolean("attention_k_eq_v") else None
        return g.integer("global_head_dim"), kv or kv_heads
    if not isinstance(per_layer, dict) or not isinstance(types, list):
        raise ConfigError(f"{g.origin}: per_layer_config is {_json_type(per_layer)}; it must be an object of layer "
                          "index -> head_dim / num_key_value_heads")
    try:  # keys as transformers writes them: the layer index, zero-padded ("04")
        per_layer = {int(k): v for k, v in per_layer.items()}
    except ValueError:
        raise ConfigError(f"{g.origin}: per_layer_config has keys {sorted(map(str, per_layer))}; they must be "
                          "layer indices") from None
    found = set()
    for n in range(layers):
        over = per_layer.get(n) or {}
        if not isinstance(over, dict) or set(over) - {"head_dim", "num_key_value_heads"}:
            raise ConfigError(f"{g.origin}: per_layer_config of layer {n} is {_json_type(over)}; the export reads "
                              "head_dim and num_key_value_heads there only")
        sizes = (over.get("head_dim", head_dim), over.get("num_key_value_heads", kv_heads))
        if n < len(types) and types[n] == "full_attention":
            found.add(sizes)
        elif sizes != (head_dim, kv_heads):
            raise ConfigError(f"{g.origin}: per_layer_config gives sliding layer {n} head_dim {sizes[0]} and "
                              f"{sizes[1]} kv heads; the export builds them with the config's own")
    if len(found) > 1:
        raise ConfigError(f"{g.origin}: per_layer_config gives the global layers different head sizes "
                          f"{sorted(found)}; the export builds one size for all of them")
    return found.pop() if found else (head_dim, kv_heads)


def _gemma4_rope(f: "_Fields", rope: dict[str, Any]) -> tuple[dict[str, Any], float]:
    """Gemma 4's global RoPE base (and a proportional RoPE's factor as linear scaling: it divides the
    same frequencies) and the local base of its sliding layers; the proportion goes to
    rope_proportion (_gemma4_extras)."""
    full, local = rope["full_attention"], rope["sliding_attention"]
    where = f"{f.origin} rope_parameters"
    if local.get("rope_type", "default") != "default":
        raise ConfigError(f"{where}.sliding_attention has rope_type {local.get('rope_type')!r}; the sliding "
                          "layers' RoPE must be the default one")
    if full.get("rope_type", "default") not in ("default", "proportional"):
        raise ConfigError(f"{where}.full_attention has rope_type {full.get('rope_type')!r}; the export builds "
                          "Gemma 4's global layers with the proportional (or default) RoPE")
    ff = _Fields(full, f"{where}.full_attention")
    out = {"rope_theta": ff.number("rope_theta")}
    factor = ff.number("factor", 1.0) if full.get("rope_type") == "proportional" else 1.0
    if factor != 1.0:
        out.update(rope_type="linear", factor=factor)
    return out, _Fields(local, f"{where}.sliding_attention").number("rope_theta")


def _gemma4_extras(f: "_Fields", model_type: str) -> dict[str, Any]:
    """Gemma 4's own fields (see LlamaConfig); none for the other families."""
    if model_type != GEMMA4:
        return {}
    full = f.d["rope_parameters"]["full_attention"]
    proportion = 1.0
    if full.get("rope_type") == "proportional":
        proportion = _Fields(full, f"{f.origin} rope_parameters.full_attention").number("partial_rotary_factor", 1.0)
    size = f.integer("hidden_size_per_layer_input", 0, minimum=0)
    head_dim, kv_heads = f.integer("head_dim"), f.integer("num_key_value_heads", f.integer("num_attention_heads"))
    glob = _gemma4_global_heads(f, f.d["layer_types"], f.integer("num_hidden_layers"))
    wide = {"global_head_dim": glob[0] if glob[0] != head_dim else 0,
            "global_key_value_heads": glob[1] if glob[1] != kv_heads else 0}
    shared = {"kv_shared_layers": f.integer("num_kv_shared_layers", 0), "double_wide_mlp": f.boolean("use_double_wide_mlp")}
    return {**wide, **shared, "value_norm": True, "k_eq_v": f.boolean("attention_k_eq_v"), "per_layer_input_size": size,
            "per_layer_vocab_size": f.integer("vocab_size_per_layer_input") if size else 0, "layer_scalar": True,
            "final_logit_softcapping": f.number("final_logit_softcapping", None), "rope_proportion": proportion}


def _multipliers(f: "_Fields", model_type: str) -> dict[str, float]:
    """Granite's scale factors (transformers' GraniteConfig defaults when absent: 1.0 each, the
    attention scale too, not 1/sqrt(head_dim)); Gemma 3's embedding scale sqrt(hidden_size) and
    attention scale query_pre_attn_scalar ** -0.5; none for the other families."""
    if model_type == GEMMA4:  # q and k are normalized: no scale
        return {"embedding_multiplier": f.integer("hidden_size") ** 0.5, "attention_scale": 1.0}
    if model_type in SANDWICH_NORMS:
        return {"embedding_multiplier": f.integer("hidden_size") ** 0.5,
                "attention_scale": f.number("query_pre_attn_scalar") ** -0.5}
    if model_type != "granite":
        return {}
    return {"embedding_multiplier": f.number("embedding_multiplier", 1.0),
            "residual_multiplier": f.number("residual_multiplier", 1.0),
            "attention_scale": f.number("attention_multiplier", 1.0),
            "logits_scaling": f.number("logits_scaling", 1.0)}


def _lfm2_fields(f: "_Fields") -> dict[str, Any]:
    """LFM2's config.json in the other families' field names: its aliases renamed, Lfm2Config's
    defaults filled in, and `intermediate_size` the MLP's real width, as transformers' Lfm2MLP
    computes it (block_auto_adjust_ff_dim: two thirds of it, times block_ffn_dim_multiplier, rounded
    up to a multiple of block_multiple_of)."""
    d = {LFM2_ALIASES.get(k, k): v for k, v in f.d.items()}
    d = {**LFM2_DEFAULTS, **{k: v for k, v in d.items() if v is not None or k == "block_ffn_dim_multiplier"}}
    if "rope_theta" in (d.get("rope_parameters") or {}):
        del d["rope_theta"]  # the base rope_parameters gives, not Lfm2Config's default
    g = _Fields(d, f.origin)
    width = g.integer("intermediate_size", 12288)
    if g.boolean("block_auto_adjust_ff_dim") if "block_auto_adjust_ff_dim" in d else True:
        width = int(2 * width / 3)
        if d.get("block_ffn_dim_multiplier", 1.0) is not None:
            multiple = g.integer("block_multiple_of", 256)
            width = multiple * ((int(g.number("block_ffn_dim_multiplier", 1.0) * width) + multiple - 1) // multiple)
    return {**d, "intermediate_size": width}


def _conv_fields(f: "_Fields", model_type: str) -> dict[str, Any]:
    """LFM2's conv layers (those `layer_types` names "conv", or all but `full_attn_idxs`), their
    kernel (conv_L_cache) and whether they have biases (conv_bias); none for the other families."""
    if model_type != "lfm2":
        return {}
    layers = f.integer("num_hidden_layers")
    types = f.d.get("layer_types")
    if types is None:
        full = f.d.get("full_attn_idxs")
        if not (isinstance(full, list) and all(type(n) is int and 0 <= n < layers for n in full)):
            raise ConfigError(f"{f.origin}: neither layer_types nor full_attn_idxs (the attention layers' "
                              "indices) says which layers are conv layers; add layer_types")
        types = ["full_attention" if n in full else "conv" for n in range(layers)]
    if not (isinstance(types, list) and len(types) == layers and all(t in ("conv", "full_attention") for t in types)):
        raise ConfigError(f"{f.origin}: layer_types is {_json_type(types)}; it must list num_hidden_layers "
                          f"({layers}) entries, each \"conv\" or \"full_attention\"")
    return {"conv_layers": [n for n, t in enumerate(types) if t == "conv"],
            "conv_kernel": f.integer("conv_L_cache", 3, minimum=2), "conv_bias": f.boolean("conv_bias")}


def _delta_fields(f: "_Fields", model_type: str) -> dict[str, Any]:
    """Qwen3.5's linear-attention layers (those `layer_types` names "linear_attention"; without it every
    layer but each full_attention_interval-th, as Qwen3_5TextConfig fills it in) and their sizes; none
    for the other families."""
    if model_type != QWEN35:
        return {}
    layers = f.integer("num_hidden_layers")
    types = f.d.get("layer_types")
    if types is None:
        interval = f.integer("full_attention_interval")
        types = ["linear_attention" if (n + 1) % interval else "full_attention" for n in range(layers)]
    if not (isinstance(types, list) and len(types) == layers
            and all(t in ("linear_attention", "full_attention") for t in types)):
        raise ConfigError(f"{f.origin}: layer_types is {_json_type(types)}; it must list num_hidden_layers "
                          f"({layers}) entries, each \"linear_attention\" or \"full_attention\"")
    if f.boolean("attention_bias"):
        raise ConfigError(f"{f.origin}: attention_bias is true; Qwen3.5's attention and linear-attention "
                          "projections are exported without biases")
    return {"delta_layers": [n for n, t in enumerate(types) if t == "linear_attention"],
            "conv_kernel": f.integer("linear_conv_kernel_dim", minimum=2),
            "delta_key_heads": f.integer("linear_num_key_heads"), "delta_value_heads": f.integer("linear_num_value_heads"),
            "delta_key_dim": f.integer("linear_key_head_dim"), "delta_value_dim": f.integer("linear_value_head_dim"),
            "attn_output_gate": True}


def _nope_layers(f: "_Fields", model_type: str) -> list[int]:
    """The layers without RoPE: SmolLM3's `no_rope_layers` holds 1 for each layer that rotates q and
    k and 0 for one that does not; without it, every `no_rope_layer_interval`-th layer has none (as
    transformers' SmolLM3Config fills it in)."""
    if model_type != "smollm3":
        return []
    layers = f.integer("num_hidden_layers")
    flags = f.d.get("no_rope_layers")
    if flags is None:
        interval = f.integer("no_rope_layer_interval", 4)
        return [n for n in range(layers) if (n + 1) % interval == 0]
    if not (isinstance(flags, list) and len(flags) == layers
            and all(type(v) is int and v in (0, 1) for v in flags)):
        raise ConfigError(f"{f.origin}: no_rope_layers is {_json_type(flags)}; it must be a list of "
                          f"num_hidden_layers ({layers}) entries, each 1 (the layer uses RoPE) or 0 (it does not)")
    return [n for n, v in enumerate(flags) if not v]


_MISSING = object()


def _json_type(value: Any) -> str:
    """How `value` reads in JSON, for error messages: 'the string "8"', 'a list', ..."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"the boolean {str(value).lower()}"
    if isinstance(value, str):
        return f"the string {value[:40]!r}"
    if isinstance(value, (int, float)):
        return repr(value)
    return {list: "a list", dict: "an object"}.get(type(value), f"a {type(value).__name__}")


class _Fields:
    """Typed reads of a config dictionary's fields: a field of the wrong JSON type or out of range
    raises a ConfigError naming `origin`, the field, what it is and what it must be. An absent field
    (or null) gives `default`; with no default it is an error."""

    def __init__(self, d: dict[str, Any], origin: str):
        self.d, self.origin = d, origin

    def _get(self, key: str, default: Any) -> Any:
        value = self.d.get(key)
        if value is None:
            if default is _MISSING:
                raise ConfigError(f"{self.origin} lacks {key}")
            return default
        return value

    def _refuse(self, key: str, value: Any, must: str) -> ConfigError:
        return ConfigError(f"{self.origin}: {key} is {_json_type(value)}; it must be {must}")

    def integer(self, key: str, default: Any = _MISSING, minimum: int = 1) -> Any:
        value = self._get(key, default)
        if value is default:
            return value
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self._refuse(key, value, "a positive integer" if minimum == 1 else f"an integer >= {minimum}")
        return value

    def number(self, key: str, default: Any = _MISSING) -> Any:
        value = self._get(key, default)
        if value is default:
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            raise self._refuse(key, value, "a positive number")
        return float(value)

    def boolean(self, key: str) -> bool:
        value = self._get(key, False)
        if not isinstance(value, bool):
            raise self._refuse(key, value, "true or false")
        return value

    def mapping(self, key: str) -> dict[str, Any]:
        value = self._get(key, {})
        if not isinstance(value, dict):
            raise self._refuse(key, value, "an object (or null)")
        return dict(value)

    def token_ids(self, key: str) -> list[int]:
        """A token id or a list of them (EOS may be either), as a list."""
        value = self._get(key, [])
        ids = value if isinstance(value, list) else [value]
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise self._refuse(key, value, "a token id or a list of token ids (integers >= 0)")
        return list(ids)


def _rope_scaling(scaling: dict[str, Any], origin: str, d: dict[str, Any], model_type: str) -> dict[str, Any] | None:
    """The checked `rope_scaling` (None for the default RoPE): its type supported and the numbers
    that type uses present and in range (a llama3 band with high_freq_factor <= low_freq_factor
    would divide by zero; longrope's factor lists numbers, its original context an integer)."""
    f = _Fields(scaling, f"{origin} rope_scaling")
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    longrope = model_type in LONGROPE_FAMILIES
    rope_type = ROPE_TYPE_ALIASES.get(rope_type, rope_type) if longrope else rope_type
    if rope_type not in (("default", "longrope") if longrope else ("default", "llama3", "linear")):
        raise ConfigError(f"unsupported RoPE scaling {rope_type!r} for model_type {model_type!r}; "
                          f"{SUPPORTED_DESCRIPTION}")
    if rope_type == "default":
        return None
    out = {k: v for k, v in scaling.items() if k not in ("type", "rope_theta", "partial_rotary_factor")}
    out["rope_type"] = rope_type
    if rope_type == "longrope":
        for name in ("short_factor", "long_factor"):
            factors = scaling.get(name)
            if not (isinstance(factors, list) and factors and all(
                    isinstance(x, (int, float)) and not isinstance(x, bool) and 0 < x < math.inf for x in factors)):
                raise f._refuse(name, factors, "a list of positive numbers, one for each rotated channel pair")
        out["original_max_position_embeddings"] = f.integer(  # Phi3Config's default where neither has it
            "original_max_position_embeddings", _Fields(d, origin).integer("original_max_position_embeddings", 4096))
        for name in ("factor", "attention_factor"):
            if f.number(name, None) is None:
                out.pop(name, None)
        return out
    out["factor"] = f.number("factor")
    if rope_type == "llama3":
        low, high = f.number("low_freq_factor", 1.0), f.number("high_freq_factor", 4.0)
        f.integer("original_max_position_embeddings", None)
        if high <= low:
            raise ConfigError(f"{origin} rope_scaling: high_freq_factor ({high}) must be above "
                              f"low_freq_factor ({low})")
    return out


def _whole(x: float) -> float | int:
    """`x` as an int where it is one (a config field transformers types as int), else as it is."""
    return int(round(x)) if abs(x - round(x)) < 1e-6 * max(1.0, abs(x)) else x


def transformers_class(model_type: str, part: str):
    """transformers' class `part` ("DecoderLayer", "RMSNorm", "RotaryEmbedding", ...) of a family, e.g.
    Qwen2DecoderLayer."""
    import importlib

    module = FAMILY_MODULE.get(model_type, model_type)
    modeling = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    return getattr(modeling, FAMILY_CLASS.get((model_type, part), FAMILY_CLASS_PREFIX[model_type] + part))


def inv_freq(cfg: LlamaConfig) -> "list[float]":
    """RoPE inverse frequencies [rotary_dim/2], with llama3 or linear scaling applied as transformers does."""
    d = cfg.rotary_dim
    base = [1.0 / (cfg.rope_theta ** (2 * i / d)) for i in range(d // 2)]
    if cfg.rope_proportion != 1.0:  # proportional (Gemma 4): the first pairs rotate, the others have frequency 0
        angles = int(cfg.rope_proportion * d // 2)
        base = [f if i < angles else 0.0 for i, f in enumerate(base)]
    s = cfg.rope_scaling
    if not s:
        return base
    if s["rope_type"] == "linear":
        return [f / float(s["factor"]) for f in base]
    # llama3: keep high frequencies, divide low ones by factor, smooth between.
    factor = float(s["factor"])
    low = float(s.get("low_freq_factor", 1.0))
    high = float(s.get("high_freq_factor", 4.0))
    old_ctx = float(s.get("original_max_position_embeddings", 8192))
    low_wavelen = old_ctx / low
    high_wavelen = old_ctx / high
    out = []
    for f in base:
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            out.append(f)
        elif wavelen > low_wavelen:
            out.append(f / factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append((1 - smooth) * f / factor + smooth * f)
    return out
