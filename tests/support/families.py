"""The family checkpoints the tests make: the case table of tests/test_families.py (name -> checkpoint
overrides of TINY_CONFIG), each family's small chat template and the maker that writes a checkpoint
with it; LFM2's checkpoint of tests/test_lfm2.py and Gemma 4's published E-series configs."""

from __future__ import annotations

import json

from llama_ane.testing import make_tiny_checkpoint


def longrope(pairs: int) -> dict:
    """A longrope rope_scaling with distinct short and long factors for `pairs` rotated channel pairs."""
    return {"type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(pairs)],
            "long_factor": [1.5 + 2.0 * i for i in range(pairs)]}


GEMMA = {"model_type": "gemma3_text", "hidden_activation": "gelu_pytorch_tanh", "head_dim": 32,
         "query_pre_attn_scalar": 24, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
         "rms_norm_eps": 1e-6}

# Gemma 4's text model: per-layer inputs, proportional partial RoPE on the global layers, softcapped logits
GEMMA4 = {"model_type": "gemma4_text", "hidden_activation": "gelu_pytorch_tanh", "head_dim": 32, "global_head_dim": 32,
          "num_hidden_layers": 4, "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": 320,
          "final_logit_softcapping": 30.0, "rms_norm_eps": 1e-6,
          "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]}

LFM2 = {"model_type": "lfm2", "tie_word_embeddings": True, "intermediate_size": 96, "block_multiple_of": 16,
        "block_ffn_dim_multiplier": 1.5, "conv_L_cache": 3, "rope_theta": 1_000_000.0}

# LFM3: LFM2's conv layers with sandwich norms, a gate per attention head, sliding layers beside the global ones
LFM3 = {"model_type": "lfm3", "intermediate_size": 96, "conv_L_cache": 3}

# Qwen3.5's text model: Gated DeltaNet layers beside output-gated attention with a quarter of each head
# rotated; value heads 32 wide, as the ANE keeps a state
QWEN35 = {"model_type": "qwen3_5_text", "head_dim": 32, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
          "linear_key_head_dim": 16, "linear_value_head_dim": 32, "num_hidden_layers": 4}

# OLMo-Hybrid: Gated DeltaNet layers (their own q, k, v projections, beta in [0, 2]) beside OLMo 3's
# attention layers (heads hidden_size / num_attention_heads = 32 wide); value heads 32 wide, as the ANE
# keeps a state
OLMO_HYBRID = {"model_type": "olmo_hybrid", "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
               "linear_num_key_heads": 2, "linear_num_value_heads": 4,
               "linear_key_head_dim": 16, "linear_value_head_dim": 32, "num_hidden_layers": 4}

# Falcon-H1: attention and a Mamba-2 mixer in every layer, its muP multipliers away from 1 (in the range
# of the published ones), heads 32 wide (the state (H*N, 1, P) as the ANE keeps it), two heads per group
FALCON_H1 = {"model_type": "falcon_h1", "head_dim": 32, "mamba_d_ssm": 128, "mamba_n_heads": 4, "mamba_d_head": 32,
             "mamba_n_groups": 2, "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_chunk_size": 16,
             "embedding_multiplier": 5.0, "lm_head_multiplier": 2.5, "attention_in_multiplier": 0.7,
             "key_multiplier": 0.5, "attention_out_multiplier": 0.8, "ssm_in_multiplier": 1.25,
             "ssm_out_multiplier": 0.6, "ssm_multipliers": [0.7, 1.3, 0.9, 1.1, 0.8], "mlp_multipliers": [0.9, 0.6]}

# name -> checkpoint overrides (TINY_CONFIG: hidden 64, 3 layers, 4 query heads, 2 kv heads: GQA)
CASES = {
    "smollm3_tied": {"model_type": "smollm3", "tie_word_embeddings": True, "head_dim": 32,
                     "no_rope_layers": [1, 0, 1]},
    "smollm3_untied_mha": {"model_type": "smollm3", "num_key_value_heads": 4, "head_dim": 32,
                           "no_rope_layer_interval": 2, "attention_bias": True},
    # Granite 3.x's multipliers, in the range of the published ones (embedding 12, residual 0.22,
    # attention 1/64 or 1/128 for head_dim 128, logits 8 or 16), scaled to these sizes
    "granite_tied": {"model_type": "granite", "tie_word_embeddings": True, "head_dim": 32,
                     "embedding_multiplier": 12.0, "residual_multiplier": 0.22, "attention_multiplier": 0.05,
                     "logits_scaling": 8.0},
    "granite_untied_mha": {"model_type": "granite", "num_key_value_heads": 4, "embedding_multiplier": 6.0,
                           "residual_multiplier": 0.5, "attention_multiplier": 0.125, "logits_scaling": 2.0,
                           "attention_bias": True},
    "olmo2_untied": {"model_type": "olmo2", "head_dim": 32},
    "olmo2_tied_mha_attention_bias": {"model_type": "olmo2", "num_key_value_heads": 4, "tie_word_embeddings": True,
                                      "attention_bias": True},
    # EXAONE 4.0: OLMo 2's norm placement, per-head q/k norms; with a window, the global layers leave RoPE
    # out (a window shorter than the 150 tokens compared); without one, every layer global and rotating,
    # with llama3 RoPE scaling as the published models have
    "exaone4_tied_gqa": {"model_type": "exaone4", "head_dim": 32, "tie_word_embeddings": True, "sliding_window": 40,
                         "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},
    "exaone4_untied_mha_no_window": {"model_type": "exaone4", "num_key_value_heads": 4, "sliding_window": None,
                                     "layer_types": ["full_attention"] * 3, "rope_scaling": {
                                         "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
    # Granite SWA: Granite's multipliers, sliding layers (windows shorter than the 150 tokens compared), a
    # sink logit per query head; the default layout (every fourth layer global, from the first) with the
    # global layer leaving RoPE out; and global and sliding layers with their own bases, biases, MHA
    "granite_swa_tied_gqa": {"model_type": "granite_swa", "tie_word_embeddings": True, "head_dim": 32,
                             "embedding_multiplier": 12.0, "residual_multiplier": 0.22, "attention_multiplier": 0.05,
                             "logits_scaling": 8.0, "sliding_window": 40, "layer_rope_theta": [0, 10_000.0, 10_000.0]},
    "granite_swa_untied_mha": {"model_type": "granite_swa", "num_key_value_heads": 4, "num_hidden_layers": 4,
                               "attention_bias": True, "attention_multiplier": 0.125, "sliding_window": 24,
                               "layer_rope_theta": [500_000.0, 10_000.0, 10_000.0, 10_000.0]},
    # OLMo 3: OLMo 2's block with sliding layers, windows shorter than the 150 tokens compared; each layer
    # type with its own RoPE base (as transformers reads a top-level rope_theta: the global layers' only),
    # and the default layout (every fourth layer global) with a linear RoPE factor on the global layers
    "olmo3_tied_gqa": {"model_type": "olmo3", "head_dim": 32, "tie_word_embeddings": True, "sliding_window": 40,
                       "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},
    "olmo3_untied_mha_attention_bias": {"model_type": "olmo3", "num_key_value_heads": 4, "num_hidden_layers": 4,
                                        "attention_bias": True, "sliding_window": 24, "rope_parameters": {
                                            "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                               "rope_theta": 500_000.0},
                                            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}},
    # Phi-3.5/Phi-4-mini style: fused projections, partial rotary, longrope; a 256-token context is
    # just within an original context of 256 (short factors, though the tables run past it) and past
    # one of 64 (long factors)
    "phi3_untied_longrope_short": {"model_type": "phi3", "hidden_size": 128, "head_dim": 32,
                                   "partial_rotary_factor": 0.75,
                                   "max_position_embeddings": 8192, "original_max_position_embeddings": 256,
                                   "rope_scaling": longrope(12)},
    "phi3_tied_mha_longrope_long": {"model_type": "phi3", "num_key_value_heads": 4, "tie_word_embeddings": True,
                                    "partial_rotary_factor": 0.5, "max_position_embeddings": 4096,
                                    "original_max_position_embeddings": 64, "rope_scaling": longrope(4)},
    "phi3_plain": {"model_type": "phi3", "head_dim": 32},  # Phi-3-mini-4k style: full rotary, no scaling
    # Gemma 3: sliding layers (local RoPE base) between global ones (linear scaling, as the 4B's), windows
    # shorter than the 150 tokens compared so they matter; a Mistral window shorter than the context
    "gemma3_tied_gqa": dict(GEMMA, tie_word_embeddings=True, sliding_window=40,
                            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                            rope_scaling={"rope_type": "linear", "factor": 8.0}),
    "gemma3_untied_mha": dict(GEMMA, tie_word_embeddings=False, num_key_value_heads=4, sliding_window=24,
                              sliding_window_pattern=2),
    "mistral_window": {"model_type": "mistral", "head_dim": 32, "sliding_window": 48},
    # Gemma 4: GQA with the global layers' V from their K projection (attention_k_eq_v), tied; MHA with V
    # of its own, untied, a RoPE factor on the global layers; both with windows shorter than the 150
    # tokens compared
    "gemma4_tied_gqa_k_eq_v": dict(GEMMA4, tie_word_embeddings=True, attention_k_eq_v=True, sliding_window=24),
    "gemma4_untied_mha": dict(GEMMA4, tie_word_embeddings=False, num_key_value_heads=4, sliding_window=40,
                              rope_parameters={
                                  "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5,
                                                     "rope_theta": 1_000_000.0, "factor": 4.0},
                                  "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}),
    # Gemma 4 E2B/E4B's shape: global layers with wider heads (global_head_dim) and, V from K, fewer kv
    # heads (num_global_key_value_heads) than the sliding ones, which keep theirs in the ring
    "gemma4_wide_global": dict(GEMMA4, tie_word_embeddings=True, attention_k_eq_v=True, sliding_window=24,
                               global_head_dim=64, num_global_key_value_heads=1),
    # and E2B/E4B's KV-shared layers: the last 2 of 4 take K/V from layers 0 (sliding) and 1 (global),
    # with double-wide MLPs
    "gemma4_kv_shared": dict(GEMMA4, tie_word_embeddings=False, attention_k_eq_v=True, sliding_window=24,
                             global_head_dim=64, num_global_key_value_heads=1, num_kv_shared_layers=2,
                             use_double_wide_mlp=True),
    # LFM2: short-convolution layers beside attention layers (chunks of conv layers only, too), the
    # MLP's width adjusted as Lfm2MLP does
    "lfm2_tied_gqa": dict(LFM2, head_dim=32, layer_types=["conv", "full_attention", "conv"]),
    "lfm2_tied_mha_conv_bias": dict(LFM2, num_key_value_heads=4, num_hidden_layers=4, conv_bias=True,
                                    layer_types=["conv", "conv", "full_attention", "conv"]),
    # LFM3: conv, global and sliding layers (windows shorter than the 150 tokens compared), the global
    # layers' proportional RoPE (half the frequencies rotating, as its default); MHA, untied, biases on
    # the conv and attention projections, the default layout over five layers with a quarter of the
    # frequencies rotating and a factor; and one without the attention gate
    "lfm3_tied_gqa": dict(LFM3, head_dim=32, tie_word_embeddings=True, sliding_window=40, num_hidden_layers=4,
                          layer_types=["conv", "full_attention", "sliding_attention", "conv"]),
    "lfm3_untied_mha_bias": dict(LFM3, num_key_value_heads=4, tie_word_embeddings=False, num_hidden_layers=5,
                                 conv_bias=True, attention_bias=True, sliding_window=24, rope_parameters={
                                     "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                        "rope_theta": 500_000.0, "factor": 2.0},
                                     "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}),
    "lfm3_no_gate": dict(LFM3, head_dim=32, tie_word_embeddings=True, use_attention_gate=False, sliding_window=40,
                         layer_types=["sliding_attention", "conv", "full_attention"]),
    # Qwen3.5: linear-attention layers beside attention ones (a chunk of linear layers only, too), GQA
    # attention and two value heads per key head; MHA attention, one value head per key head, untied,
    # the layers as full_attention_interval lays them out
    "qwen35_tied_gqa": dict(QWEN35, tie_word_embeddings=True,
                            layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"]),
    "qwen35_untied_mha": dict(QWEN35, tie_word_embeddings=False, num_key_value_heads=4, linear_num_value_heads=2,
                              full_attention_interval=2),
    # OLMo-Hybrid: linear-attention layers beside a rotating GQA attention layer, two value heads per key
    # head, tied; the default layout (every fourth layer attention) without RoPE (a null rope_theta, as
    # the released models), MHA with biases, one value head per key head, beta in [0, 1], untied
    "olmo_hybrid_tied_gqa": dict(OLMO_HYBRID, tie_word_embeddings=True,
                                 layer_types=["linear_attention", "full_attention", "linear_attention",
                                              "linear_attention"]),
    # Falcon-H1: GQA, tied, the gated norm before the gate over two groups; MHA, untied, the norm after the
    # gate; and no norm (the gate alone), one group
    "falcon_h1_tied_gqa": dict(FALCON_H1, tie_word_embeddings=True, mamba_rms_norm=True,
                               mamba_norm_before_gate=True),
    "falcon_h1_untied_mha": dict(FALCON_H1, tie_word_embeddings=False, num_key_value_heads=4, mamba_rms_norm=True,
                                 mamba_norm_before_gate=False),
    "falcon_h1_no_norm": dict(FALCON_H1, tie_word_embeddings=False, mamba_rms_norm=False, mamba_n_groups=1),
    "olmo_hybrid_untied_mha_nope": dict(OLMO_HYBRID, tie_word_embeddings=False, num_key_value_heads=2,
                                        linear_num_value_heads=2, attention_bias=True, rope_theta=None,
                                        linear_allow_neg_eigval=False),
}

# A small chat template per family, in the style of its own (the tiny tokenizer's specials stand in
# for the family's role markers): what the export must carry and apply as transformers does.
TEMPLATES = {
    "smollm3": ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"),
    "granite": ("{% for m in messages %}<|im_start|>{{ m['role'] }}<|im_end|>{{ m['content'] }}<|endoftext|>\n"
                "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant<|im_end|>{% endif %}"),
    "olmo2": ("<|endoftext|>{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"),
    # EXAONE 4.0 style: a marker opening each turn and one closing it ([|user|] ... [|endofturn|])
    "exaone4": ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"),
    "granite_swa": ("{% for m in messages %}<|im_start|>{{ m['role'] }}<|im_end|>{{ m['content'] }}<|endoftext|>\n"
                    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant<|im_end|>{% endif %}"),
    "olmo3": ("<|endoftext|>{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"),
    "falcon_h1": ("<|endoftext|>{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                  "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"),
    "olmo_hybrid": ("<|endoftext|>{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}\n"
                    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"),
    "phi3": ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|endoftext|>\n{% endfor %}"
             "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"),
    "gemma3_text": ("{% for m in messages %}{% set role = 'model' if m['role'] == 'assistant' "
                    "else m['role'] %}<|im_start|>{{ role }}\n{{ m['content'] | trim }}<|im_end|>\n{% endfor %}"
                    "{% if add_generation_prompt %}<|im_start|>model\n{% endif %}"),
    # Gemma 4 style: a system turn of its own, the assistant as "model", contents trimmed, and a turn
    # that closes with the end marker only when it is not the last (generation continues it)
    "gemma4_text": ("{% for m in messages %}{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
                    "<|im_start|>{{ role }}\n{{ m['content'] | trim }}{% if not loop.last or m['role'] != 'assistant' %}"
                    "<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>model\n{% endif %}"),
    "lfm2": ("<|endoftext|>{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
             "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"),
    "lfm3": ("<|endoftext|>{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
             "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"),
    # Qwen3.5 style: ChatML turns, the assistant's turn opening with an empty thinking block (thinking off)
    "qwen3_5_text": ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                     "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n\n</think>\n\n{% endif %}"),
    "mistral": ("{% for m in messages %}{% if m['role'] == 'user' %}<|im_start|> {{ m['content'] }} "
                "<|im_end|>{% else %}{{ m['content'] }}<|endoftext|>{% endif %}{% endfor %}"),
}


def make_family_checkpoint(path, **overrides):
    """A tiny checkpoint of `overrides["model_type"]` with the family's chat template."""
    folder = make_tiny_checkpoint(path, **overrides)
    config = folder / "tokenizer_config.json"
    tok = json.loads(config.read_text())
    tok["chat_template"] = TEMPLATES[overrides["model_type"]]
    config.write_text(json.dumps(tok, indent=2))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    return folder


# LFM2's checkpoint of tests/test_lfm2.py (conv_L_cache 3: its kernel K)
LFM2_CHECKPOINT = {"model_type": "lfm2", "layer_types": ["conv", "full_attention", "conv"], "intermediate_size": 96,
                   "block_multiple_of": 16, "block_ffn_dim_multiplier": 1.5, "conv_L_cache": 3, "tie_word_embeddings": True}


def gemma4_e(hidden: int, inter: int, layers: int, kv: int, pattern: int, shared: int, double_wide: bool) -> dict:
    """A Gemma 4 E-series text config as its checkpoint's config.json gives it."""
    return dict(GEMMA4, vocab_size=262_144, vocab_size_per_layer_input=262_144, hidden_size=hidden,
                intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=kv,
                head_dim=256, global_head_dim=512, hidden_size_per_layer_input=256, sliding_window=512,
                max_position_embeddings=131_072, num_kv_shared_layers=shared, use_double_wide_mlp=double_wide,
                layer_types=(["sliding_attention"] * (pattern - 1) + ["full_attention"]) * (layers // pattern))


E2B, E4B = gemma4_e(1536, 6144, 35, 1, 5, 20, True), gemma4_e(2560, 10240, 42, 2, 6, 18, False)
