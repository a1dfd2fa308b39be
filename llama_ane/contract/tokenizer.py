"""What the manifest records about the tokenizer: files, BOS/EOS ids, chat template, special tokens."""

from __future__ import annotations

from pathlib import Path

from ..checkpoint.loader import TOKENIZER_FILES, CheckpointError, read_json
from ..config import LlamaConfig


def check_tokenizer(folder: Path, cfg: LlamaConfig) -> None:
    """Load the tokenizer in `folder` and hold it against the model, before anything is converted:
    its JSON files must parse, transformers must load it, and every token id it can produce (added
    tokens included) and every EOS id of generation_config.json must be a row of the model's
    vocabulary, or generation would index past the embedding table. Raises CheckpointError naming
    the file or the token."""
    present = [name for name in TOKENIZER_FILES if (folder / name).is_file()]
    if "tokenizer.json" not in present and "tokenizer.model" not in present:
        raise CheckpointError(f"{folder} has no tokenizer.json or tokenizer.model; add the tokenizer files")
    for name in present:
        if name.endswith(".json"):
            read_json(folder / name, "tokenizer files")
    eos = _generation_eos(folder)
    tok = _load(folder)
    vocab = tok.get_vocab()
    if not vocab:
        raise CheckpointError(f"the tokenizer in {folder} has no tokens; restore its tokenizer files")
    token, top = max(vocab.items(), key=lambda kv: kv[1])
    if top >= cfg.vocab_size:
        raise CheckpointError(f"the tokenizer in {folder} has token {token!r} with id {top}, but the model's "
                              f"vocab_size is {cfg.vocab_size}; the tokenizer and the weights do not belong together")
    if any(not 0 <= e < cfg.vocab_size for e in eos):
        raise CheckpointError(f"{folder / 'generation_config.json'}: eos_token_id {eos} is outside the model's "
                              f"vocabulary (vocab_size {cfg.vocab_size})")


def _generation_eos(folder: Path) -> list[int]:
    """The EOS ids generation_config.json adds (none without the file)."""
    gen = folder / "generation_config.json"
    if not gen.is_file():
        return []
    data = read_json(gen, "generation_config.json")
    if not isinstance(data, dict):
        raise CheckpointError(f"{gen} is not a JSON object; restore the checkpoint's generation_config.json")
    g = data.get("eos_token_id")
    ids = [] if g is None else [g] if not isinstance(g, list) else g
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise CheckpointError(f"{gen}: eos_token_id is {g!r}; it must be a token id or a list of them")
    return list(ids)


def _load(folder: Path):
    """transformers' tokenizer for `folder`; a tokenizer it cannot build is a CheckpointError."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except Exception as e:  # tokenizers and transformers raise anything from ValueError to their own types
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise CheckpointError(f"the tokenizer in {folder} cannot be loaded ({type(e).__name__}: {first}); "
                              "restore the checkpoint's tokenizer files") from None


def tokenizer_info(folder: Path, cfg: LlamaConfig, files: list[str]) -> dict:
    """Describe the tokenizer saved in `folder` (files copied there already)."""
    tok = _load(folder)
    eos = list(cfg.eos_token_id) + _generation_eos(folder)
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
