"""The model configuration, with Hugging Face field names.

`LlamaConfig.from_hf_dict` accepts a `config.json` dictionary (transformers 4 style, with
`rope_theta`/`rope_scaling`, or transformers 5 style, with `rope_parameters`), drops keys it does not
use, and validates that the checkpoint is one we can export. What one family reads, writes or adds
to the Llama block is its module's in llama_ane.families; this module asks it by model_type.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from .families import FAMILIES, PLAIN, SUPPORTED_DESCRIPTION, Family, family
from .families.fields import ConfigError, Fields, json_type

# The families' traits as tables, for what reads them so (each family's module holds its own)
FAMILY_CLASS_PREFIX = {t: f.class_prefix for t, f in FAMILIES.items()}
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)
# Multimodal checkpoints whose text model is exported (their vision and audio towers are left out):
# model_type -> (its text_config's model_type, what that text model is)
MULTIMODAL = {f.multimodal[0]: (t, f.multimodal[1]) for t, f in FAMILIES.items() if f.multimodal}
# What transformers' composite model reads at the top level of its config.json where text_config lacks it
MULTIMODAL_TOP_LEVEL = ("bos_token_id", "eos_token_id", "pad_token_id")
UNIT_OFFSET_NORMS = tuple(t for t, f in FAMILIES.items() if f.unit_offset_norms)
ACTIVATIONS = tuple(dict.fromkeys(f.activation for f in FAMILIES.values()))
GEMMA4_FIELDS = FAMILIES["gemma4_text"].own_fields
DELTA_FIELDS = FAMILIES["qwen3_5_text"].own_fields
# fields of a layer variant no family default has, written (like the families' own) only where set
VARIANT_FIELDS = ("attention_sinks", "attn_head_gate", "delta_beta_scale", "delta_norm_eps")
OWN_FIELDS = tuple(name for f in FAMILIES.values() for name in f.own_fields) + VARIANT_FIELDS  # see LlamaConfig.to_dict


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
    # the Gated DeltaNet's variant: beta's scale (OLMo-Hybrid's allow_neg_eigval: 2, beta in [0, 2]) and
    # its gated norm's eps (None: rms_norm_eps; OLMo-Hybrid's 1e-5)
    delta_beta_scale: float = 1.0
    delta_norm_eps: float | None = None
    # Falcon-H1: the layers with a Mamba-2 mixer beside their attention (both read the layer's normed
    # input, their outputs summed), its sizes those of the Gated DeltaNet's fields (delta_key_heads: its
    # groups of B and C, delta_key_dim: its state size N, delta_value_heads/dim: its heads and their
    # width), its convolution's kernel conv_kernel and bias conv_bias; where its gated norm sits
    # (model.layers.mamba2.GATES: None, "before" or "after" the gate); and its multipliers, folded into
    # the weights (families.falcon_h1.weight_scale)
    mamba_layers: list[int] = field(default_factory=list)
    mamba_gate: str | None = None
    mamba_multipliers: dict[str, Any] = field(default_factory=dict)
    # a learned logit per query head beside each softmax's keys (GPT-OSS's, Granite SWA's sinks): it takes
    # a share of the probability and attends to nothing
    attention_sinks: bool = False
    # a sigmoid gate per query head on attention's output, from the layer's normed input (LFM3's
    # g_proj): each head's values scaled by one number a token before o_proj
    attn_head_gate: bool = False
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
            raise ConfigError(f"{origin} holds {json_type(d)}, not a JSON object of config fields")
        if d.get("model_type") in MULTIMODAL:
            d, origin = text_model_config(d, origin), f"{origin} text_config"
        f = Fields(d, origin)
        model_type = d.get("model_type")
        fam = family(model_type)
        if fam.prepare is not None:
            d = fam.prepare(f)
            f = Fields(d, origin)
        act = d.get(fam.activation_field, fam.activation)
        if act != fam.activation:
            raise ConfigError(f"unsupported {fam.activation_field} {act!r}; {SUPPORTED_DESCRIPTION}")
        if f.boolean("mlp_bias"):
            raise ConfigError(f"mlp_bias is not supported; {SUPPORTED_DESCRIPTION}")
        biased = f.boolean("attention_bias") and fam.attention_bias_flag
        required = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads"]
        missing = [k for k in required if d.get(k) is None]
        if missing:
            raise ConfigError(f"{origin} lacks {', '.join(missing)}")

        rope = f.mapping("rope_parameters")
        local_theta = None
        if fam.rope is not None:
            rope, local_theta = fam.rope(f, rope)
        # as transformers 5 reads it: rope_parameters' base over a top-level rope_theta (checked all the same)
        top_theta = f.number("rope_theta", None)
        rope_theta = Fields(rope, f"{origin} rope_parameters").number("rope_theta", None) or top_theta or 10000.0
        scaling = f.mapping("rope_scaling") or {k: v for k, v in rope.items() if k != "rope_theta"}
        scaling = _rope_scaling(scaling, origin, d, fam) if scaling else None
        rotary = f.number("partial_rotary_factor", None) or Fields(rope, f"{origin} rope_parameters").number(
            "partial_rotary_factor", fam.partial_rotary_factor)

        eos_list = f.token_ids("eos_token_id")
        window, sliding = _sliding_window(f, fam)
        hidden, heads = f.integer("hidden_size"), f.integer("num_attention_heads")
        head_dim = f.integer("head_dim", None) or fam.head_dim
        if head_dim is None:  # transformers derives it, which needs heads to divide the hidden size
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
            qkv_bias=biased or fam.qkv_bias,
            o_proj_bias=biased,
            qk_norm=fam.qk_norm,
            qk_norm_across_heads=fam.qk_norm_across_heads,
            post_norms=fam.post_norms,
            fused_projections=fam.fused_projections,
            partial_rotary_factor=rotary,
            sliding_window=window,
            sliding_layers=sliding,
            rope_local_theta=local_theta,
            hidden_act=act,
            sandwich_norms=fam.sandwich_norms,
            **(fam.extras(f) if fam.extras is not None else {}),
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
                     "sandwich_norms", "conv_bias", "value_norm", "k_eq_v", "layer_scalar", "attention_sinks",
                     "attn_head_gate"):
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
                raise ConfigError(f"rope_scaling {name} is {json_type(factors)}; it must list one number for "
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
        if not (isinstance(self.mamba_layers, list)
                and all(type(n) is int and 0 <= n < layers for n in self.mamba_layers)):
            raise ConfigError(f"mamba_layers must be a list of layer indices below num_hidden_layers ({layers}), "
                              f"got {self.mamba_layers!r}")
        if set(self.mamba_layers) & (set(self.delta_layers) | set(self.conv_layers)):
            raise ConfigError("a layer in mamba_layers has attention beside its mixer: it cannot be in delta_layers "
                              "or conv_layers")
        if self.mamba_gate not in (None, "before", "after"):
            raise ConfigError(f"mamba_gate must be null, \"before\" or \"after\", got {self.mamba_gate!r}")
        if not isinstance(self.mamba_multipliers, dict):
            raise ConfigError(f"mamba_multipliers must be an object, got {self.mamba_multipliers!r}")
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
        if not self.recurrent_layers:
            return
        for name in sizes:
            if not getattr(self, name):
                raise ConfigError(f"{name} must be positive where delta_layers or mamba_layers are given")
        for name in ("delta_beta_scale",) + (("delta_norm_eps",) if self.delta_norm_eps is not None else ()):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ConfigError(f"{name} must be a positive number, got {value!r}")
        if self.delta_value_heads % self.delta_key_heads:
            raise ConfigError(f"linear_num_value_heads ({self.delta_value_heads}) must be a multiple of "
                              f"linear_num_key_heads ({self.delta_key_heads})")

    def rotary(self, layer: int) -> bool:
        """Whether decoder layer `layer` (0-based, in the whole model) rotates q and k."""
        return layer not in self.nope_layers

    def convolves(self, layer: int) -> bool:
        """Whether decoder layer `layer` keeps a short convolution's state: LFM2's conv layers, Qwen3.5's
        linear-attention layers (`linear`), whose Gated DeltaNet convolves q, k and v, and Falcon-H1's
        layers (`mamba`), whose Mamba-2 mixer convolves x, B and C."""
        return layer in self.conv_layers or layer in self.delta_layers or layer in self.mamba_layers

    def attends(self, layer: int) -> bool:
        """Whether decoder layer `layer` has attention (and so a K/V cache, unless it shares one): every
        layer but LFM2's conv layers and the linear-attention layers (a Mamba-2 layer has it beside)."""
        return layer not in self.conv_layers and layer not in self.delta_layers

    def mamba(self, layer: int) -> bool:
        """Whether decoder layer `layer` has a Mamba-2 mixer beside its attention (Falcon-H1)."""
        return layer in self.mamba_layers

    def recurrent(self, layer: int) -> bool:
        """Whether decoder layer `layer` keeps a recurrent state (delta_state): a Gated DeltaNet's or a Mamba-2 mixer's."""
        return layer in self.delta_layers or layer in self.mamba_layers

    @property
    def recurrent_layers(self) -> list[int]:
        """The layers that keep a recurrent state, in order."""
        return sorted(set(self.delta_layers) | set(self.mamba_layers))

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
    def family(self) -> Family:
        """The traits and hooks of this config's model_type (llama_ane.families)."""
        return FAMILIES.get(self.model_type, PLAIN)

    @property
    def stream_scale(self) -> float:
        """The power of two the residual stream is carried at (Family.stream_scale; 1 for most families)."""
        return self.family.stream_scale

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
        model.layers.attention.DecoderLayer): projection biases, the q/k norms and the norm after the
        MLP (whose block has no input_layernorm: `input_norm`)."""
        extras = ("q_proj.bias", "k_proj.bias", "v_proj.bias") if self.qkv_bias else ()
        extras += ("o_proj.bias",) if self.o_proj_bias else ()
        extras += ("q_norm.weight", "k_norm.weight") if self.qk_norm else ()
        extras += ("pre_feedforward_layernorm.weight",) if self.sandwich_norms else ()
        extras += ("post_feedforward_layernorm.weight",) if self.post_norms or self.sandwich_norms else ()
        extras += ("per_layer_input_gate.weight", "per_layer_projection.weight",
                   "post_per_layer_input_norm.weight") if self.per_layer_input_size else ()
        extras += ("sinks",) if self.attention_sinks else ()
        extras += ("g_proj.weight",) if self.attn_head_gate else ()
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
        return self.delta_conv_channels if self.recurrent_layers else self.hidden_size

    @property
    def delta_conv_channels(self) -> int:
        """Rows of a Gated DeltaNet's in_proj_qkv (and channels of its convolution): q, k, then v."""
        return 2 * self.delta_key_heads * self.delta_key_dim + self.delta_value_heads * self.delta_value_dim

    @property
    def delta_key_channels(self) -> int:
        """Rows of a Gated DeltaNet's q (or k) projection: its key heads times their width."""
        return self.delta_key_heads * self.delta_key_dim

    @property
    def delta_value_channels(self) -> int:
        """A Gated DeltaNet's value heads times their width: in_proj_z's rows, out_proj's columns."""
        return self.delta_value_heads * self.delta_value_dim

    @property
    def mamba_in_channels(self) -> int:
        """Rows of a Mamba-2 mixer's in_proj: z (its heads times their width), x, B and C (the channels
        its convolution runs over), then dt (one a head)."""
        return self.delta_value_channels + self.delta_conv_channels + self.delta_value_heads

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
        """Every field, but the families' own fields (OWN_FIELDS) only where they are not their defaults (the
        manifest's copy)."""
        defaults = {f.name: f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
                    for f in dataclasses.fields(self) if f.name in OWN_FIELDS}
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
                "embedding_multiplier", "residual_multiplier", "attention_scale", "logits_scaling") + OWN_FIELDS
        fam = self.family
        d = {k: v for k, v in self.to_dict().items() if k not in ours}
        d["eos_token_id"] = self.eos_token_id[0] if len(self.eos_token_id) == 1 else (self.eos_token_id or None)
        d["hidden_act"] = self.hidden_act
        d["attention_bias"] = self.o_proj_bias
        d["mlp_bias"] = False
        d["sliding_window"] = self.sliding_window
        if self.sliding_layers and fam.window_layer_types:
            d["layer_types"] = ["sliding_attention" if self.slides(n) else "full_attention"
                                for n in range(self.num_hidden_layers)]
        if not fam.writes_rotary_factor:
            del d["partial_rotary_factor"]
        return d if fam.write is None else fam.write(self, d)


def _sliding_window(f: Fields, fam: Family) -> tuple[int | None, list[int]]:
    """The attention window and the layers that use it (None, []: every layer attends to everything),
    as transformers reads them: where the family has a window at all (Family.window) and its flag
    turns it on (Qwen's, SmolLM3's use_sliding_window), the layers `layer_types` names (not
    Mistral's, whose window is every layer's), else the family's own (Family.window_layers), else
    every layer."""
    window = f.integer("sliding_window", None)
    layers = f.integer("num_hidden_layers")
    if window is None or not fam.window:
        return None, []
    if fam.window_flag is not None and not f.boolean(fam.window_flag):
        return None, []
    types = f.d.get("layer_types")
    if types is not None:
        f.layer_types(types, ("sliding_attention", "full_attention", *fam.other_layer_types))
    if types is not None and fam.window_layer_types:
        sliding = [n for n, t in enumerate(types) if t == "sliding_attention"]
    elif fam.window_layers is not None:
        sliding = fam.window_layers(f, layers)
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
                          f"language_model.*) the export takes from text_config, which is {json_type(text)} "
                          "(unsupported without it); restore the checkpoint's config.json, whose text_config is an "
                          "object of the text model's fields")
    if text.get("model_type", text_type) != text_type:
        raise ConfigError(f"{origin}: text_config.model_type is {json_type(text['model_type'])}, but a "
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


def _rope_scaling(scaling: dict[str, Any], origin: str, d: dict[str, Any], fam: Family) -> dict[str, Any] | None:
    """The checked `rope_scaling` (None for the default RoPE): its type one the family is exported with
    and the numbers that type uses present and in range (a llama3 band with high_freq_factor <=
    low_freq_factor would divide by zero; longrope's factor lists numbers, its original context an integer)."""
    f = Fields(scaling, f"{origin} rope_scaling")
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if fam.rope_aliases:
        rope_type = fam.rope_aliases.get(rope_type, rope_type)
    if rope_type not in fam.rope_types:
        raise ConfigError(f"unsupported RoPE scaling {rope_type!r} for model_type {fam.model_type!r}; "
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
                raise f.refuse(name, factors, "a list of positive numbers, one for each rotated channel pair")
        out["original_max_position_embeddings"] = f.integer(  # Phi3Config's default where neither has it
            "original_max_position_embeddings", Fields(d, origin).integer("original_max_position_embeddings", 4096))
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


def transformers_class(model_type: str, part: str):
    """transformers' class `part` ("DecoderLayer", "RMSNorm", "RotaryEmbedding", ...) of a family, e.g.
    Qwen2DecoderLayer."""
    import importlib

    fam = FAMILIES[model_type]
    module = fam.module or model_type
    modeling = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    return getattr(modeling, fam.classes.get(part, fam.class_prefix + part))


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
