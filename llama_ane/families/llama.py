"""Llama (Llama 2, 3, 3.1, 3.2, SmolLM2): the block every other family is told against. attention_bias
puts a bias on q, k, v and o; transformers' LlamaConfig has no sliding window."""

from __future__ import annotations

from .base import Family, GGUFArch

FAMILY = Family("llama", "Llama", label="Llama 2, 3, 3.1, 3.2, SmolLM2", attention_bias_flag=True,
                window=False,
                gguf=GGUFArch("llama", "Llama 2/3.x, Mistral, SmolLM2", permuted=True, rope_freqs="llama3"))
