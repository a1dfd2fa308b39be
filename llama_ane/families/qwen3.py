"""Qwen3 (dense): Qwen2's window, a bias on q, k, v and o where attention_bias is set, each q and k
head normalized (q_norm, k_norm), and a head_dim of 128 where config.json has none."""

from __future__ import annotations

from .base import Family, GGUFArch
from .qwen2 import max_window_layers, write_window

HEAD_DIM = 128  # transformers' Qwen3Config default

FAMILY = Family("qwen3", "Qwen3", label="dense Qwen3", attention_bias_flag=True, qk_norm=True, head_dim=HEAD_DIM,
                window_flag="use_sliding_window", window_layers=max_window_layers, write=write_window,
                gguf=GGUFArch("qwen3", "dense Qwen3"))
