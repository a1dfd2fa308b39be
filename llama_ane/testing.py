"""Tiny random Llama checkpoints for tests, notebooks and fixtures.

`make_tiny_checkpoint` writes a complete Hugging Face folder (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json) built by transformers itself, so every test exercises the
same loading code as a real checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .config import FAMILY_CLASS_PREFIX

TINY_CONFIG: dict[str, Any] = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
    "initializer_range": 0.15,
    "hidden_act": "silu",
}

_CORPUS = """The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with
a single step. Numbers like 12, 345 and 6789 appear in text; so do questions? And answers!
The Neural Engine runs small models quickly and with little power. Caches hold keys and values.
"""

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tiny_tokenizer(path: Path, vocab_size: int = 320) -> int:
    """Train a byte-level BPE tokenizer on a fixed corpus and save it in `path`.

    Returns the tokenizer's vocabulary size (special tokens included).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   unk_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))
    return len(fast)


def make_tiny_checkpoint(path: str | Path, seed: int = 0, **config_overrides: Any) -> Path:
    """Write a tiny random checkpoint with a real tokenizer to `path`: LlamaForCausalLM, or with
    `model_type="qwen2"` ("qwen3", "mistral") that family's own class.

    `config_overrides` replace fields of `TINY_CONFIG` (Hugging Face names), e.g.
    `num_key_value_heads=4` for MHA, `tie_word_embeddings=True`, or a llama3 `rope_scaling` dict.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    vocab = make_tiny_tokenizer(path)
    cfg = dict(TINY_CONFIG, vocab_size=vocab, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    cfg.update(config_overrides)
    if cfg["model_type"] != "llama":  # another family: its own model class (Qwen2ForCausalLM, ...)
        cfg["architectures"] = [f"{FAMILY_CLASS_PREFIX[cfg['model_type']]}ForCausalLM"]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg)).eval()
    with torch.no_grad():  # norms away from 1, biases and attention sinks away from 0, so they are really exercised
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.uniform_(-0.5, 0.5)
            elif name.endswith(".sinks"):
                p.uniform_(-1.0, 2.0)
    model.save_pretrained(str(path), safe_serialization=True)
    # save_pretrained may write the transformers-5 form; keep the plain HF fields we were given too.
    written = json.loads((path / "config.json").read_text())
    written.update({k: v for k, v in cfg.items() if k not in written})
    (path / "config.json").write_text(json.dumps(written, indent=2))
    return path
