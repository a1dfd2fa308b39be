"""Gemma 4's text model: Gemma 3's four norms a layer, stored as the weight itself (no 1 + w), and an
attention scale of 1 (q and k are normalized per head), a weightless norm of each v head, a
per-layer input (PLE: a second, per-layer token embedding with a projection of the embeddings, fed
into each layer after its MLP through a gate and a projection, then the layer's scalar),
proportional partial RoPE on the global layers (only the first partial_rotary_factor of the
frequencies rotate, the rest are zero), global layers that may take V from the K projection
(attention_k_eq_v), and softcapped logits; E2B/E4B's global layers are wider than the sliding ones
(global_head_dim, num_global_key_value_heads) and their last layers share earlier layers' K/V
(num_kv_shared_layers)."""

from __future__ import annotations

from typing import Any

from .base import MOE, Family, GGUFArch
from .fields import ConfigError, Fields, filled, json_type
from .gemma3_text import LOCAL_THETA, STREAM_SCALE, window_pattern

# transformers' Gemma4TextConfig defaults, where config.json leaves a field out
DEFAULTS = {"head_dim": 256, "sliding_window": 512, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
            "hidden_size_per_layer_input": 256, "vocab_size_per_layer_input": 262_144, "global_head_dim": 512}
# Its own LlamaConfig fields: a manifest holds them only where they differ from their defaults (the
# Gemma 4 exports), so every other family's manifest reads as before and a host that does not know
# them refuses a Gemma 4 export by the field's name rather than run it wrong
OWN_FIELDS = ("value_norm", "k_eq_v", "per_layer_input_size", "per_layer_vocab_size", "layer_scalar",
              "final_logit_softcapping", "rope_proportion", "global_head_dim", "global_key_value_heads",
              "kv_shared_layers", "double_wide_mlp")
ROPE = {"full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}
UNROTATED = 1e30  # llama.cpp's rope_freqs divisor for the dims its proportional RoPE leaves alone
# its per-layer inputs, in the embeddings model: our name -> (its name, its shape)
PER_LAYER_TENSORS = {
    "embed_tokens_per_layer.weight": ("model.embed_tokens_per_layer.weight", ("per_layer_vocab_size",
                                                                             "per_layer_channels")),
    "per_layer_model_projection.weight": ("model.per_layer_model_projection.weight",
                                          ("per_layer_channels", "hidden_size")),
    "per_layer_projection_norm.weight": ("model.per_layer_projection_norm.weight", ("per_layer_input_size",)),
}


def prepare(f: Fields) -> dict[str, Any]:
    """Its config.json with Gemma4TextConfig's defaults filled in (its layer types: every sixth
    layer global, the last one always; its RoPE per layer type), checked for what the export does not
    build, each refused by name."""
    d = filled(f.d, DEFAULTS)
    g = Fields(d, f.origin)
    refuse = lambda what: ConfigError(f"{f.origin}: {what}")  # noqa: E731
    if g.boolean("enable_moe_block"):
        raise refuse(f"enable_moe_block is true; the export has no {MOE} (Gemma 4's MoE block)")
    # "vision": image tokens attend both ways, text causally; a text model has no image tokens
    if d.get("use_bidirectional_attention") not in (None, "vision"):
        raise refuse(f"use_bidirectional_attention is {json_type(d['use_bidirectional_attention'])}; the "
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
    glob = global_heads(g, types, layers)
    if glob[1] != kv_heads and not g.boolean("attention_k_eq_v"):
        raise refuse(f"per_layer_config gives the global layers {glob[1]} kv heads where the sliding layers have "
                     f"{kv_heads} without attention_k_eq_v; the export builds other kv heads on the global layers "
                     "only as num_global_key_value_heads of an attention_k_eq_v model")
    g.integer("num_kv_shared_layers", 0, minimum=0)
    rope = d.get("rope_parameters") or {}
    if not isinstance(rope, dict) or (rope and not {"full_attention", "sliding_attention"} <= set(rope)):
        raise refuse(f"rope_parameters is {json_type(rope)}; Gemma 4's has an object per layer type "
                     "(full_attention, sliding_attention)")
    rope = {kind: {**ROPE[kind], **(rope.get(kind) or {})} for kind in ROPE}
    # Gemma4TextConfig reads its RoPE from rope_parameters only (a top-level rope_theta is ignored)
    d = {k: v for k, v in d.items() if k not in ("rope_theta", "rope_scaling", "partial_rotary_factor")}
    return {**d, "layer_types": types, "rope_parameters": rope}


def global_heads(g: Fields, types: Any, layers: int) -> tuple[int, int]:
    """The head_dim and kv heads of the global layers: per_layer_config's overrides (every global
    layer's the same, none for a sliding layer), else global_head_dim and, where attention_k_eq_v is
    set, num_global_key_value_heads, as Gemma4TextConfig fills them in."""
    head_dim, kv_heads = g.integer("head_dim"), g.integer("num_key_value_heads", g.integer("num_attention_heads"))
    per_layer = g.d.get("per_layer_config")
    if per_layer is None:
        kv = g.integer("num_global_key_value_heads", None) if g.boolean("attention_k_eq_v") else None
        return g.integer("global_head_dim"), kv or kv_heads
    if not isinstance(per_layer, dict) or not isinstance(types, list):
        raise ConfigError(f"{g.origin}: per_layer_config is {json_type(per_layer)}; it must be an object of layer "
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
            raise ConfigError(f"{g.origin}: per_layer_config of layer {n} is {json_type(over)}; the export reads "
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


def rope(f: Fields, rope: dict[str, Any]) -> tuple[dict[str, Any], float]:
    """The global RoPE base (and a proportional RoPE's factor as linear scaling: it divides the same
    frequencies) and the local base of the sliding layers; the proportion goes to rope_proportion
    (`extras`)."""
    full, local = rope["full_attention"], rope["sliding_attention"]
    where = f"{f.origin} rope_parameters"
    if local.get("rope_type", "default") != "default":
        raise ConfigError(f"{where}.sliding_attention has rope_type {local.get('rope_type')!r}; the sliding "
                          "layers' RoPE must be the default one")
    if full.get("rope_type", "default") not in ("default", "proportional"):
        raise ConfigError(f"{where}.full_attention has rope_type {full.get('rope_type')!r}; the export builds "
                          "Gemma 4's global layers with the proportional (or default) RoPE")
    ff = Fields(full, f"{where}.full_attention")
    out = {"rope_theta": ff.number("rope_theta")}
    factor = ff.number("factor", 1.0) if full.get("rope_type") == "proportional" else 1.0
    if factor != 1.0:
        out.update(rope_type="linear", factor=factor)
    return out, Fields(local, f"{where}.sliding_attention").number("rope_theta")


def extras(f: Fields) -> dict[str, Any]:
    """Its embedding scale sqrt(hidden_size), no attention scale (q and k are normalized), and its
    own fields (see LlamaConfig)."""
    scales = {"embedding_multiplier": f.integer("hidden_size") ** 0.5, "attention_scale": 1.0}
    full = f.d["rope_parameters"]["full_attention"]
    proportion = 1.0
    if full.get("rope_type") == "proportional":
        proportion = Fields(full, f"{f.origin} rope_parameters.full_attention").number("partial_rotary_factor", 1.0)
    size = f.integer("hidden_size_per_layer_input", 0, minimum=0)
    head_dim, kv_heads = f.integer("head_dim"), f.integer("num_key_value_heads", f.integer("num_attention_heads"))
    glob = global_heads(f, f.d["layer_types"], f.integer("num_hidden_layers"))
    wide = {"global_head_dim": glob[0] if glob[0] != head_dim else 0,
            "global_key_value_heads": glob[1] if glob[1] != kv_heads else 0}
    shared = {"kv_shared_layers": f.integer("num_kv_shared_layers", 0), "double_wide_mlp": f.boolean("use_double_wide_mlp")}
    return {**scales, **wide, **shared, "value_norm": True, "k_eq_v": f.boolean("attention_k_eq_v"),
            "per_layer_input_size": size, "per_layer_vocab_size": f.integer("vocab_size_per_layer_input") if size else 0,
            "layer_scalar": True, "final_logit_softcapping": f.number("final_logit_softcapping", None),
            "rope_proportion": proportion}


def write(cfg: Any, d: dict[str, Any]) -> dict[str, Any]:
    """Gemma4TextConfig's names: the RoPE per layer type, the global layers' head sizes."""
    wide = cfg.global_layers
    full = {"rope_type": "proportional", "rope_theta": cfg.rope_theta, "partial_rotary_factor": cfg.rope_proportion,
            **({"factor": cfg.rope_scaling["factor"]} if cfg.rope_scaling else {})}
    for name in ("hidden_act", "mlp_bias", "rope_scaling", "partial_rotary_factor", "attention_bias"):
        d.pop(name, None)
    d.update(hidden_activation=cfg.hidden_act, sliding_window=cfg.sliding_window or cfg.max_position_embeddings,
             layer_types=["sliding_attention" if cfg.slides(n) else "full_attention"
                          for n in range(cfg.num_hidden_layers)],
             rope_parameters={"full_attention": full, "sliding_attention": {
                 "rope_type": "default", "rope_theta": cfg.rope_local_theta}},
             global_head_dim=wide.head_dim, num_global_key_value_heads=wide.num_key_value_heads,
             attention_k_eq_v=cfg.k_eq_v, num_kv_shared_layers=cfg.kv_shared_layers, enable_moe_block=False,
             use_double_wide_mlp=cfg.double_wide_mlp,
             hidden_size_per_layer_input=cfg.per_layer_input_size,
             vocab_size_per_layer_input=cfg.per_layer_vocab_size or cfg.vocab_size,
             final_logit_softcapping=cfg.final_logit_softcapping)
    return d


def read_gguf(g: Any, cfg: dict[str, Any]) -> None:
    """Its layers as llama.cpp's converter writes them: the sliding ones by
    attention.sliding_window_pattern, with head size key_length_swa and the kv head count of their
    type, the global ones with key_length and theirs; the last shared_kv_layers layers share K/V,
    their MLPs twice as wide where feed_forward_length says so; per-layer inputs of
    embedding_length_per_layer_input; V from K where a global layer has no attn_v; and the global
    layers' proportional RoPE from the rope_freqs tensor (1 rotated, 1e30 not)."""
    m = lambda key, default=g.REQUIRED: g.meta(f"gemma4.{key}", default)  # noqa: E731
    layers, key = cfg["num_hidden_layers"], "gemma4.attention.sliding_window_pattern"
    pattern = g.meta_list(key)
    if pattern is None or len(pattern) != layers or not all(isinstance(p, bool) for p in pattern):
        raise g.error(f"{g.path}: {key} must list a bool for each of the {layers} layers, got {pattern}; "
                      "convert the model again")
    if g.field("gemma4.expert_count") is not None:
        raise g.error(f"{g.path} is a Gemma 4 MoE (gemma4.expert_count), which llama-ane does not export",
                      supported=True)
    types = ["sliding_attention" if p else "full_attention" for p in pattern]
    counts = list(zip(types, g.kv_heads(cfg["num_attention_heads"])))
    kv = dict(counts)
    if len(set(counts)) != len(kv):
        raise g.error(f"{g.path}: gemma4.attention.head_count_kv gives layers of one type different counts",
                      supported=True)
    shared, ff = m("attention.shared_kv_layers", 0), g.per_layer("feed_forward_length")
    double = [ff[0] * (2 if n >= layers - shared else 1) for n in range(layers)]
    if ff != [ff[0]] * layers and ff != double:
        raise g.error(f"{g.path}: gemma4.feed_forward_length {ff} is neither one width nor twice it on the last "
                      f"{shared} (KV-shared) layers", supported=True)
    global_dim = m("attention.key_length")
    if m("attention.value_length", global_dim) != global_dim or m("rope.dimension_count", global_dim) != global_dim:
        raise g.error(f"{g.path}: gemma4's global layers have a value length or rope.dimension_count unlike their "
                      f"key_length {global_dim}", supported=True)
    full: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.pop("rope_theta")}
    if (v := g.rope_freqs()) is not None:
        rotated = int((v == 1.0).sum())
        if len(v) != global_dim // 2 or not (v[:rotated] == 1.0).all() or (v[rotated:] < UNROTATED).any():
            raise g.error(f"{g.path}: rope_freqs is not Gemma 4's proportional RoPE ({global_dim // 2} values, 1 "
                          "for each rotated frequency, then 1e30)", supported=True)
        full.update(rope_type="proportional", partial_rotary_factor=rotated / (global_dim // 2))
    if cfg.pop("rope_scaling", None) is not None:  # llama.cpp's Gemma 4 has none (no key holds a factor)
        raise g.error(f"{g.path}: gemma4.rope.scaling.* is set, which Gemma 4 files do not have", supported=True)
    v_layers = [n for n, t in enumerate(types) if t == "full_attention" and n < layers - shared]
    k_eq_v = {f"blk.{n}.attn_v.weight" not in g.file_names for n in v_layers}
    if len(k_eq_v) > 1:
        raise g.error(f"{g.path}: some global layers have attn_v and some do not", supported=True)
    per_layer = m("embedding_length_per_layer_input", 0)
    cfg.update(
        hidden_activation="gelu_pytorch_tanh", layer_types=types, sliding_window=m("attention.sliding_window"),
        num_key_value_heads=kv.get("sliding_attention", cfg["num_key_value_heads"]), global_head_dim=global_dim,
        num_global_key_value_heads=kv.get("full_attention", cfg["num_key_value_heads"]),
        attention_k_eq_v=k_eq_v == {True}, num_kv_shared_layers=shared, intermediate_size=ff[0],
        use_double_wide_mlp=ff != [ff[0]] * layers, hidden_size_per_layer_input=per_layer,
        vocab_size_per_layer_input=(int(g.reader_tensor("per_layer_token_embd.weight").shape[1])
                                    if per_layer else cfg["vocab_size"]),
        final_logit_softcapping=m("final_logit_softcapping", None),
        rope_parameters={"full_attention": full, "sliding_attention": {
            "rope_type": "default", "rope_theta": m("rope.freq_base_swa", LOCAL_THETA)}})


FAMILY = Family("gemma4_text", "Gemma4", label="Gemma 4's text model", module="gemma4",
                classes={"DecoderLayer": "Gemma4TextDecoderLayer", "RotaryEmbedding": "Gemma4TextRotaryEmbedding"},
                multimodal=("gemma4", "Gemma 4's text model"), activation="gelu_pytorch_tanh",
                activation_field="hidden_activation", qk_norm=True, sandwich_norms=True, stream_scale=STREAM_SCALE,
                own_fields=OWN_FIELDS, window_layers=window_pattern, prepare=prepare, rope=rope, extras=extras,
                write=write,
                gguf=GGUFArch("gemma4", "Gemma 4's text model", swa_heads=True, rope_freqs="proportional",
                              per_layer=("attention.head_count_kv", "feed_forward_length"), auto_tokenizer=False,
                              read=read_gguf))
