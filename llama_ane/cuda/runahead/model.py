"""A GPU engine with random weights in a real checkpoint's shapes, built on the device (for
timing models too large to instantiate in transformers on the host, e.g. Llama-3.1-8B)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

# Llama-3.1-8B's config.json (the fields the engine reads)
LLAMA31_8B = dict(model_type="llama", hidden_size=4096, intermediate_size=14336,
                  num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                  head_dim=128, vocab_size=128256, rms_norm_eps=1e-5, rope_theta=500000.0,
                  max_position_embeddings=131072,
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8192})

# a few layers of the same kind, small enough for CPU dry runs of the multi-process benchmark
TINY_LLAMA = dict(model_type="llama", hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=512,
                  rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=8192)


class _RandomCheckpoint:
    """Stands in for a ``LlamaForCausalLM``: ``config``, ``state_dict()``, ``model.rotary_emb``."""

    def __init__(self, config, state: dict, rotary) -> None:
        self.config = config
        self._state = state
        self.model = SimpleNamespace(rotary_emb=rotary)

    def state_dict(self) -> dict:
        return self._state


def random_engine(shape: dict = LLAMA31_8B, *, device="cuda", dtype=torch.bfloat16,
                  seed: int = 0, page_size: int = 16):
    """A :class:`GPUEngine` whose weights are N(0, 0.02) draws made on ``device`` (norms 1)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from ..engine import GPUEngine

    cfg = LlamaConfig(**{k: v for k, v in shape.items() if k != "model_type"})
    gen = torch.Generator(device=device).manual_seed(seed)
    h, inter, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads

    def rand(*size):
        return torch.randn(*size, device=device, dtype=dtype, generator=gen) * 0.02

    state = {"model.embed_tokens.weight": rand(cfg.vocab_size, h),
             "lm_head.weight": rand(cfg.vocab_size, h),
             "model.norm.weight": torch.ones(h, device=device, dtype=dtype)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        state.update({
            p + "input_layernorm.weight": torch.ones(h, device=device, dtype=dtype),
            p + "post_attention_layernorm.weight": torch.ones(h, device=device, dtype=dtype),
            p + "self_attn.q_proj.weight": rand(hq * d, h),
            p + "self_attn.k_proj.weight": rand(hkv * d, h),
            p + "self_attn.v_proj.weight": rand(hkv * d, h),
            p + "self_attn.o_proj.weight": rand(h, hq * d),
            p + "mlp.gate_proj.weight": rand(inter, h),
            p + "mlp.up_proj.weight": rand(inter, h),
            p + "mlp.down_proj.weight": rand(h, inter)})
    rotary = LlamaRotaryEmbedding(cfg)
    return GPUEngine(_RandomCheckpoint(cfg, state, rotary), dtype=dtype, page_size=page_size,
                     device=device)
