"""What the manifest records about the tokenizer: files, BOS/EOS ids, chat template, special tokens."""

from __future__ import annotations

import json
from pathlib import Path

from ..config import LlamaConfig


def tokenizer_info(folder: Path, cfg: LlamaConfig, files: list[str]) -> dict:
    """Describe the tokenizer saved in `folder` (files copied there already)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    eos = list(cfg.eos_token_id)
    gen = folder / "generation_config.json"
    if gen.is_file():
        g = json.loads(gen.read_text()).get("eos_token_id")
        eos += [g] if isinstance(g, int) else list(g or [])
    if tok.eos_token_id is not None:
        eos.append(tok.eos_token_id)
    probe = "a"
    adds_bos = (tok.bos_token_id is not None
                and tok(probe).input_ids[:1] == [tok.bos_token_id]
                and tok(probe, add_special_tokens=False).input_ids[:1] != [tok.bos_token_id])
    specials = {t: tok.convert_tokens_to_ids(t) for t in tok.all_special_tokens}
    for added in tok.get_added_vocab().items():
        specials.setdefault(*added)
    return {
        "files": files,
        "bos_token_id": tok.bos_token_id if tok.bos_token_id is not None else cfg.bos_token_id,
        "eos_token_ids": sorted(set(int(e) for e in eos)),
        "add_bos_token": bool(adds_bos),
        "chat_template": tok.chat_template if isinstance(tok.chat_template, str) else None,
        "special_tokens": dict(sorted(specials.items(), key=lambda kv: kv[1])),
    }
