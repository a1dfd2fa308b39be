"""The Swift fixtures generator: its tokenizer cases are what HF tokenizers says, round-trip, and
cover what the Swift tests rely on (>= 200 strings, byte fallback, special tokens); and the
fixtures committed under swift_host/Tests/LlamaANETests/Fixtures are what it writes."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

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
                           "byte_level_digits_nfc", "qwen2_byte_level", "gemma_sentencepiece"}
    assert min(counts.values()) >= 200
    tok, cases = _load(tmp_path / "tokenizers" / "smollm2")
    for case in cases:  # byte-level BPE is lossless too
        assert tok.decode(case["ids"], skip_special_tokens=False) == case["text"]
    special = next(c for c in cases if c["text"] == "<|im_start|>")
    assert special["ids"] == [tok.token_to_id("<|im_start|>")]


def test_generation_fixture_is_python_generation(tmp_path):
    """generation.json holds what Python's loop and sampler give: branch 0 is the single generation
    (its seed is the request's), every finish reason is in the shared vocabulary, the cases end in
    each of them, and some sample with min-p and a repetition penalty."""
    from llama_ane.runtime.sampling import FINISH_REASONS, SeededRandom

    data = sf.write_generation_fixture(tmp_path / "generation.json")
    assert json.loads((tmp_path / "generation.json").read_text())["cases"] == data["cases"]
    assert data["finish_reasons"] == list(FINISH_REASONS)
    for case in data["cases"]:
        if case["branches"] and case["finish_reason"] != "context":  # the branches run with room to spare
            first = case["branches"][0]
            assert (first["tokens"], first["finish_reason"]) == (case["tokens"], case["finish_reason"])
        assert case["finish_reason"] in FINISH_REASONS
        assert len(case["tokens"]) <= case["max_new_tokens"] and data["eos"] not in case["tokens"]
    assert {c["finish_reason"] for c in data["cases"]} == set(FINISH_REASONS)
    assert any(c["min_p"] > 0 for c in data["cases"]) and any(c["repetition_penalty"] != 1 for c in data["cases"])
    g = data["generators"][0]
    rng = SeededRandom(int(g["seed"]))
    assert [str(rng.next()) for _ in g["next"]] == g["next"]


FIXTURES = Path(__file__).resolve().parent.parent / "swift_host" / "Tests" / "LlamaANETests" / "Fixtures"
# Floats (bigram tables, sampled chances, fp16 weights) are compared within these: another numpy or
# BLAS build may round float32 results differently in the last bits, which the Swift tests' own
# tolerances absorb. Ids, texts, names, shapes and flags are compared exactly.
FLOAT_RTOL, FLOAT_ATOL = 1e-5, 1e-6
# Logits the mil backend computed through fp16 programs: numpy's fp16 reductions round by the CPU
# (export_gemma3's came out up to 0.012 apart on two machines), so they are held to the tolerance the
# Swift tests compare Core ML's logits with (FamilyExportTests: 0.05). The tokens they pick are compared exactly.
LOGITS_RTOL, LOGITS_ATOL = 0.0, 0.05
# Manifest fields that record the tools, the run or the bytes rather than what the Swift tests read.
IGNORED_MANIFEST_FIELDS = {"created_by", "files", "source"}
REGENERATE = "regenerate them: python tests/swift_fixtures.py swift_host/Tests/LlamaANETests/Fixtures"


def _json_differences(got: Any, want: Any, where: str, tolerance: tuple[float, float] = (FLOAT_RTOL, FLOAT_ATOL)
                      ) -> list[str]:
    """Where `got` differs from `want`: floats beyond the tolerance (the logits' under a "logits"
    key), anything else not equal."""
    if isinstance(want, dict) and isinstance(got, dict):
        if set(got) != set(want):
            return [f"{where}: keys {sorted(set(got) ^ set(want))} differ"]
        return [d for k in want for d in _json_differences(
            got[k], want[k], f"{where}.{k}", (LOGITS_RTOL, LOGITS_ATOL) if k == "logits" else tolerance)]
    if isinstance(want, list) and isinstance(got, list):
        if len(got) != len(want):
            return [f"{where}: {len(got)} items, committed {len(want)}"]
        return [d for i, (g, w) in enumerate(zip(got, want))
                for d in _json_differences(g, w, f"{where}[{i}]", tolerance)]
    if isinstance(want, float) and isinstance(got, (int, float)) and not isinstance(got, bool):
        rtol, atol = tolerance
        return [] if math.isclose(got, want, rel_tol=rtol, abs_tol=atol) else [f"{where}: {got} != {want}"]
    return [] if (type(got), got) == (type(want), want) else [f"{where}: {got!r} != {want!r}"]


def _file_differences(got: Path, want: Path, rel: Path) -> list[str]:
    """How a generated fixture file differs from the committed one."""
    import numpy as np

    if rel.suffix == ".json":
        g, w = (json.loads(p.read_text("utf-8")) for p in (got, want))
        if rel.name == "manifest.json":  # an export's manifest
            g, w = ({k: v for k, v in m.items() if k not in IGNORED_MANIFEST_FIELDS} for m in (g, w))
        return _json_differences(g, w, str(rel))
    if rel.name == "weight.bin":
        g, w = got.read_bytes(), want.read_bytes()
        if len(g) != len(w):
            return [f"{rel}: {len(g)} bytes, committed {len(w)}"]
        a, b = (np.frombuffer(x[: len(x) // 2 * 2], np.float16).astype(np.float32) for x in (g, w))
        close = np.isclose(a, b, rtol=FLOAT_RTOL, atol=FLOAT_ATOL, equal_nan=True)
        return [] if close.all() else [f"{rel}: {int((~close).sum())} fp16 values differ"]
    if rel.suffix == ".mlmodel":  # the program; its metadata records the tool versions
        from coremltools.proto import Model_pb2

        specs = []
        for p in (got, want):
            spec = Model_pb2.Model()
            spec.ParseFromString(p.read_bytes())
            spec.description.ClearField("metadata")
            specs.append(spec)
        return [] if specs[0] == specs[1] else [f"{rel}: the programs differ"]
    return [] if got.read_bytes() == want.read_bytes() else [f"{rel}: contents differ"]


def _files(root: Path) -> list[Path]:
    return sorted(p.relative_to(root) for p in root.rglob("*") if p.is_file())


def test_fixture_comparison_tolerates_floats_and_tool_versions_only():
    """The comparison of the committed fixtures: ids and texts exactly, floats within the tolerance,
    an export manifest's tool versions, provenance and hashes not at all."""
    want = {"ids": [1, 2], "text": "a b", "p": 0.25, "created_by": {"torch": "1"}}
    assert _json_differences({**want, "p": 0.25 * (1 + FLOAT_RTOL / 2)}, want, "x") == []
    assert _json_differences({**want, "p": 0.2501}, want, "x") == ["x.p: 0.2501 != 0.25"]
    assert _json_differences({**want, "ids": [1, 3]}, want, "x") == ["x.ids[1]: 3 != 2"]
    assert _json_differences({**want, "text": "a  b"}, want, "x") == ["x.text: 'a  b' != 'a b'"]
    steps = {"steps": [{"tokens": [4], "logits": [2.123046875, -0.5]}]}  # an fp16 program's, a few steps off
    assert _json_differences({"steps": [{"tokens": [4], "logits": [2.125, -0.5]}]}, steps, "x") == []
    assert _json_differences({"steps": [{"tokens": [4], "logits": [2.2, -0.5]}]}, steps, "x") == [
        "x.steps[0].logits[0]: 2.2 != 2.123046875"]
    assert _json_differences({"steps": [{"tokens": [5], "logits": [2.125, -0.5]}]}, steps, "x") == [
        "x.steps[0].tokens[0]: 5 != 4"]
    assert _json_differences({**want, "ids": [1.0, 2]}, want, "x") == ["x.ids[0]: 1.0 != 1"]
    assert _json_differences({**want, "created_by": {"torch": "2"}}, want, "x") == ["x.created_by.torch: '2' != '1'"]


def test_manifest_comparison_ignores_versions_and_hashes(tmp_path):
    manifest = json.loads((FIXTURES / "export" / "manifest.json").read_text("utf-8"))
    (tmp_path / "want").mkdir()
    (tmp_path / "want" / "manifest.json").write_text(json.dumps(manifest))
    changed = dict(manifest, created_by={"coremltools": "0"}, files={k: "0" * 64 for k in manifest["files"]})
    (tmp_path / "got.json").write_text(json.dumps(changed))
    rel = Path("export/manifest.json")
    assert _file_differences(tmp_path / "got.json", tmp_path / "want" / "manifest.json", rel) == []
    (tmp_path / "got.json").write_text(json.dumps(dict(changed, prefill_length=manifest["prefill_length"] + 1)))
    assert _file_differences(tmp_path / "got.json", tmp_path / "want" / "manifest.json", rel) == [
        f"{rel}.prefill_length: {manifest['prefill_length'] + 1} != {manifest['prefill_length']}"]


# Tokenizers whose BPE the generator trains: `tokenizers`' trainer breaks ties between equally
# frequent pairs in no fixed order, so a new training may merge differently. Their committed cases
# are checked against their committed tokenizer.json instead, and the rest of the file compared.
TRAINED_HERE = ("llama2_sentencepiece", "metaspace_bpe", "gemma_sentencepiece")


def _trained_tokenizer_differences(generated: Path, committed: Path, rel: Path) -> list[str]:
    """A trained tokenizer's fixture: the same case texts, each case's ids and decoded text what HF
    tokenizers gives with the committed tokenizer.json, and that file the same but for the trained
    vocabulary and merges."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(committed / "tokenizer.json"))
    got_cases = json.loads((generated / "cases.json").read_text("utf-8"))["cases"]
    want_cases = json.loads((committed / "cases.json").read_text("utf-8"))["cases"]
    problems = _json_differences([c["text"] for c in got_cases], [c["text"] for c in want_cases], f"{rel}/cases.json texts")
    for i, case in enumerate(want_cases):
        ids = tok.encode(case["text"]).ids
        now = {"text": case["text"], "ids": ids, "ids_without_special": tok.encode(case["text"], add_special_tokens=False).ids,
               "decoded": tok.decode(ids, skip_special_tokens=False)}
        problems += _json_differences(now, case, f"{rel}/cases.json.cases[{i}]")
    shapes = []
    for folder in (generated, committed):
        data = json.loads((folder / "tokenizer.json").read_text("utf-8"))
        data["model"] = {**data["model"], "vocab": len(data["model"]["vocab"]), "merges": None}
        shapes.append(data)
    return problems + _json_differences(shapes[0], shapes[1], f"{rel}/tokenizer.json")


@pytest.mark.slow
@pytest.mark.export
def test_committed_swift_fixtures_are_what_the_generator_writes(tmp_path):
    """`swift test` reads the committed fixtures; regenerated, they must come out the same.

    The generator runs in a process of its own, as it is run to write them."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", "import sys, swift_fixtures; swift_fixtures.write_swift_fixtures(sys.argv[1])",
                           str(tmp_path)], cwd=Path(sf.__file__).parent, capture_output=True, text=True, timeout=3000)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _files(tmp_path) == _files(FIXTURES), REGENERATE
    trained = [Path("tokenizers") / name for name in TRAINED_HERE]
    problems = [d for rel in trained for d in _trained_tokenizer_differences(tmp_path / rel, FIXTURES / rel, rel)]
    problems += [d for rel in _files(FIXTURES) if rel.parent not in trained
                 for d in _file_differences(tmp_path / rel, FIXTURES / rel, rel)]
    assert not problems, "\n".join(problems[:20]) + f"\n{REGENERATE}"


def test_family_chat_templates_render_as_transformers(tmp_path):
    """The family templates' renderings in chat_templates.json (jinja2, as the Swift tests compare
    with) are what transformers' apply_chat_template gives with each template's BOS and EOS."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    path = tmp_path / "chat.json"
    sf.write_chat_template_cases(path, "")
    templates = {t["name"]: t for t in json.loads(path.read_text("utf-8"))["templates"]}
    names = set(sf.family_templates())
    assert names >= {"gemma3_style", "smollm3_style", "phi3_style", "granite_style", "olmo2_style",
                     "family_gemma3_text", "family_smollm3", "family_granite", "family_olmo2", "family_phi3",
                     "family_mistral"}
    checked = raised = 0
    for name in sorted(names):
        t = templates[name]
        hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(sf.qwen2_tokenizer_json())),
                                     bos_token=t["bos_token"] or None, eos_token=t["eos_token"])
        for case in t["cases"]:
            if "error" in case:
                with pytest.raises(Exception, match="alternate"):
                    hf.apply_chat_template(case["messages"], chat_template=t["template"], tokenize=False,
                                           add_generation_prompt=case["add_generation_prompt"], **case["extra"])
                raised += 1
                continue
            want = hf.apply_chat_template(case["messages"], chat_template=t["template"], tokenize=False,
                                          add_generation_prompt=case["add_generation_prompt"], **case["extra"])
            assert case["rendered"] == want, name
            checked += 1
    assert checked >= len(names) * len(sf.CHAT_CONVERSATIONS) and raised > 0
    smol = templates["smollm3_style"]["cases"]
    assert any("Reasoning Mode: /no_think" in c["rendered"] for c in smol)
    assert any("Reasoning Mode: /think" in c["rendered"] for c in smol)


def test_swift_knows_every_config_field_the_exporter_writes():
    """The manifest's config holds LlamaConfig's fields; Swift refuses a field it does not know, so
    its list (ModelConfigFields.swift) must name each of them."""
    import dataclasses
    import re

    from llama_ane.config import LlamaConfig

    source = (Path(__file__).resolve().parent.parent / "swift_host" / "Sources" / "LlamaANE" / "Manifest"
              / "ModelConfigFields.swift").read_text("utf-8")
    from llama_ane.config import DELTA_FIELDS, GEMMA4_FIELDS
    from llama_ane.testing import TINY_CONFIG

    known = set(re.findall(r'^\s+"([a-z_0-9]+)",$', source, re.M))
    refused = set(re.findall(r'^\s+"([a-z_0-9]+)": "[^"]+",$', source, re.M))  # exports the host refuses by name
    # Gemma 4's and Qwen3.5's fields (written for those families' exports only) included: the host runs
    # those exports; Falcon-H1's it refuses
    assert refused == {"mamba_layers", "mamba_gate", "mamba_multipliers"} and not known & refused
    assert known | refused == {f.name for f in dataclasses.fields(LlamaConfig)} \
        and set(GEMMA4_FIELDS) <= known and set(DELTA_FIELDS) <= known, \
        "teach the Swift host the new config fields (or that they are gone) in ModelConfigFields.swift"
    gemma3 = LlamaConfig.from_hf_dict({**TINY_CONFIG, "vocab_size": 320, "model_type": "gemma3_text"}).to_dict()
    assert not set(gemma3) - known  # the other families' manifests hold only fields the host knows


def test_gemma_style_tokenizer_cases_match_transformers(tmp_path):
    """The Gemma-style fixture: transformers' tokenizer of it and `tokenizers` agree on >= 200 strings;
    <bos> in front, no dummy prefix (a leading space is its own ▁), turn markers one special id each,
    byte fallback lossless."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    gemma = sf._gemma_variant(sf._llama2_tokenizer())
    count = sf._write_cases(tmp_path, gemma, sf.GEMMA_SPECIALS, 7)
    tok, cases = _load(tmp_path)
    hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(gemma)), bos_token="<bos>",
                                 eos_token="<eos>", unk_token="<unk>", pad_token="<pad>")
    assert count == len(cases) >= 200
    for case in cases:
        assert hf(case["text"]).input_ids == case["ids"] == tok.encode(case["text"]).ids, case["text"]
        assert case["ids"][:1] == [2]
        if not any(s in case["text"] for s in sf.GEMMA_SPECIALS):
            assert tok.decode(case["ids_without_special"]) == case["text"]
    assert tok.encode("hi", add_special_tokens=False).ids != tok.encode(" hi", add_special_tokens=False).ids
    turn = hf("<start_of_turn>user\nHi<end_of_turn>", add_special_tokens=False).input_ids
    assert turn[0] == 4 and turn[-1] == 5
