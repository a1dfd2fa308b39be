"""The Swift fixtures generator: its tokenizer cases are what HF tokenizers says, round-trip, and
cover what the Swift tests rely on (>= 200 strings, byte fallback, special tokens)."""

from __future__ import annotations

import json

import pytest

import swift_fixtures as sf


def _load(folder):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(folder / "tokenizer.json")), json.loads((folder / "cases.json").read_text("utf-8"))["cases"]


def test_llama2_style_tokenizer_cases(tmp_path):
    llama2 = sf._llama2_tokenizer()
    count = sf._write_cases(tmp_path, llama2, ["<s>", "</s>", "<unk>"], seed=2)
    tok, cases = _load(tmp_path)
    assert count == len(cases) >= 200
    assert llama2["model"]["byte_fallback"] and "<0xF0>" in llama2["model"]["vocab"]
    specials = ("<s>", "</s>", "<unk>")
    for case in cases:
        assert tok.encode(case["text"]).ids == case["ids"]
        assert case["ids"][:1] == [1], "the post-processor adds BOS"
        if not any(s in case["text"] for s in specials):
            # SentencePiece-style BPE with byte fallback loses nothing: decode(encode(x)) == x.
            assert tok.decode(case["ids_without_special"]) == case["text"]
    emoji = next(c for c in cases if c["text"] == "😀")
    pieces = [tok.id_to_token(i) for i in emoji["ids_without_special"]]
    assert pieces[-4:] == ["<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]
    texts = [c["text"] for c in cases]
    assert any("  " in t for t in texts) and any(c.isdigit() for t in texts for c in t)
    assert any("<s>" in t for t in texts)


def test_chat_template_cases_match_jinja(tmp_path):
    path = tmp_path / "chat.json"
    sf.write_chat_template_cases(path, "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    templates = json.loads(path.read_text("utf-8"))["templates"]
    assert {t["name"] for t in templates} >= {"smollm2", "llama2_chat", "multiline_blocks", "qwen2_chatml",
                                              "qwen3_chatml"}
    llama2 = next(t for t in templates if t["name"] == "llama2_chat")
    assert llama2["cases"][len(sf.CHAT_EXTRAS) + 1]["rendered"].startswith("<s>[INST] <<SYS>>\nYou are terse.")


def test_qwen2_style_tokenizer_cases_match_transformers(tmp_path):
    """The Qwen2-style fixture: `tokenizers` and transformers' tokenizer agree on >= 200 strings; no
    BOS; ChatML specials are single special ids, <tool_call> a single non-special one; lossless."""
    from transformers import AutoTokenizer

    sf.save_qwen2_tokenizer(tmp_path / "hf")
    hf = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    count = sf._write_cases(tmp_path / "cases", sf.qwen2_tokenizer_json(), sf.QWEN2_SPECIALS + sf.QWEN2_PLAIN_ADDED, 6)
    tok, cases = _load(tmp_path / "cases")
    assert count == len(cases) >= 200
    assert hf.bos_token_id is None
    for case in cases:
        assert hf(case["text"]).input_ids == case["ids"] == tok.encode(case["text"]).ids, case["text"]
        assert case["ids"] == case["ids_without_special"]  # nothing added around the text
        assert tok.decode(case["ids"], skip_special_tokens=False) == __import__("unicodedata").normalize("NFC", case["text"])
    assert hf("<|im_start|><tool_call>").input_ids == [hf.convert_tokens_to_ids("<|im_start|>"),
                                                       hf.convert_tokens_to_ids("<tool_call>")]
    assert hf.decode(hf("<tool_call>x<|im_end|>").input_ids, skip_special_tokens=True) == "<tool_call>x"


def test_qwen_chatml_fixtures_render_as_transformers(tmp_path):
    """The jinja2 renderings the Swift tests compare with are what transformers' apply_chat_template gives."""
    from transformers import AutoTokenizer

    sf.save_qwen2_tokenizer(tmp_path)
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    path = tmp_path / "chat.json"
    sf.write_chat_template_cases(path, "")
    templates = {t["name"]: t for t in json.loads(path.read_text("utf-8"))["templates"]}
    checked = 0
    for name in ("qwen2_chatml", "qwen3_chatml"):
        for case in templates[name]["cases"]:
            want = hf.apply_chat_template(case["messages"], chat_template=templates[name]["template"], tokenize=False,
                                          add_generation_prompt=case["add_generation_prompt"], **case["extra"])
            assert case["rendered"] == want
            checked += 1
    assert checked >= 2 * 3 * len(sf.CHAT_CONVERSATIONS)
    thinking = [c for c in templates["qwen3_chatml"]["cases"] if c["extra"] and c["messages"][-1]["role"] == "user"]
    assert thinking and thinking[0]["rendered"].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


@pytest.mark.slow
def test_all_tokenizer_fixtures(tmp_path):
    counts = sf.write_tokenizer_fixtures(tmp_path)
    assert set(counts) == {"smollm2", "llama2_sentencepiece", "metaspace_bpe", "byte_level_split",
                           "byte_level_digits_nfc", "qwen2_byte_level"}
    assert min(counts.values()) >= 200
    tok, cases = _load(tmp_path / "tokenizers" / "smollm2")
    for case in cases:  # byte-level BPE is lossless too
        assert tok.decode(case["ids"], skip_special_tokens=False) == case["text"]
    special = next(c for c in cases if c["text"] == "<|im_start|>")
    assert special["ids"] == [tok.token_to_id("<|im_start|>")]


def test_generation_fixture_is_python_generation(tmp_path):
    """generation.json holds what Python's loop and sampler give: branch 0 is the single generation
    (its seed is the request's), every finish reason is in the shared vocabulary, and the cases end
    in eos, length and context."""
    from llama_ane.runtime.sampling import FINISH_REASONS, SeededRandom

    data = sf.write_generation_fixture(tmp_path / "generation.json")
    assert json.loads((tmp_path / "generation.json").read_text())["cases"] == data["cases"]
    assert data["finish_reasons"] == list(FINISH_REASONS)
    for case in data["cases"]:
        first = case["branches"][0]
        if case["finish_reason"] != "context":  # the branches run with room to spare
            assert (first["tokens"], first["finish_reason"]) == (case["tokens"], case["finish_reason"])
        assert case["finish_reason"] in FINISH_REASONS
        assert len(case["tokens"]) <= case["max_new_tokens"] and data["eos"] not in case["tokens"]
    assert {c["finish_reason"] for c in data["cases"]} >= {"eos", "length", "context"}
    g = data["generators"][0]
    rng = SeededRandom(int(g["seed"]))
    assert [str(rng.next()) for _ in g["next"]] == g["next"]
