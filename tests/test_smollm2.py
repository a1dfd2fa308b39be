"""The embedded default model, SmolLM2-135M-Instruct (GGUF), against transformers, and its CLI export.

Slow (a real 135M model on CPU), but part of CI. The checkpoint is read once per module and shared by
the fp32 and fp16 torch backends; transformers reads the same GGUF file itself.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from llama_ane.checkpoint.loader import DEFAULT_GGUF, default_gguf_path

pytestmark = pytest.mark.slow

EXPORT_LIMIT_S = 180.0
GREEDY_TOKENS = 32
SCORE_TOKENS = 256
CONTEXT, WINDOW = 512, 64

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived",
    "def fibonacci(n):",
    "The three primary colors are",
    "Water boils at a temperature of",
]

PROSE = """\
The old lighthouse stood at the end of a narrow spit of land, where the river met the sea. For more
than a hundred years its lamp had turned through the night, warning fishing boats away from the rocks
that lay just below the surface at high tide. The keeper who lived there kept a logbook of every ship
that passed, every storm that blew in from the west, and every repair he made to the lens and the
clockwork that turned it.

In the spring the town council decided that the light would be replaced by an automatic beacon. The
keeper read the letter twice, folded it carefully, and put it in the drawer with the others. He had
expected it for years. Still, he walked down to the harbour that evening and sat on the wall, watching
the boats come in with their nets and their tired crews, and he wondered who would remember the names
he had written down.

Science, too, is a kind of record keeping. A careful experiment begins with a question, continues with
measurements that anyone could repeat, and ends with a result that is written down plainly, including
the parts that did not work. When other people read the notes, they can check the reasoning, find the
mistakes, and build something better. Progress is slow when each person starts from nothing, and much
faster when the notes are shared.

Cooking a good soup follows the same pattern. You start with onions softened in butter, add carrots and
celery, pour in stock, and let everything simmer until the vegetables are tender. Taste it, add salt,
and write down what you changed, so that next winter the soup is even better than this one.
"""


@pytest.fixture(scope="module")
def reference():
    """transformers' LlamaForCausalLM on the GGUF, float32, and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = os.path.dirname(default_gguf_path())
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=DEFAULT_GGUF, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=DEFAULT_GGUF)
    return model, tok


@pytest.fixture(scope="module")
def default_checkpoint():
    """What `llama_ane.load("default", backend="torch", ...)` builds: manifest, checkpoint, tokenizer folder."""
    from llama_ane.contract.plan import describe_checkpoint

    return describe_checkpoint(None, context_length=CONTEXT, prefill_length=WINDOW)


def torch_model(default_checkpoint, precision: str):
    from llama_ane.runtime.model import LlamaANEModel, make_backend

    manifest, checkpoint, folder = default_checkpoint
    backend = make_backend(None, manifest, "torch", precision=precision, checkpoint=checkpoint)
    return LlamaANEModel(folder, manifest, backend)


def test_default_model_is_read_like_transformers(default_checkpoint, reference):
    manifest, _, _ = default_checkpoint
    hf, tok = reference
    cfg = manifest["config"]
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "tie_word_embeddings", "max_position_embeddings"):
        assert cfg[key] == getattr(hf.config, key), key
    assert manifest["name"] == "SmolLM2-135M-Instruct" and manifest["source"]["kind"] == "default"
    records = manifest["tokenizer"]
    assert records["bos_token_id"] == tok.bos_token_id
    assert tok.eos_token_id in records["eos_token_ids"]
    assert records["chat_template"] == tok.chat_template and "<|im_start|>" in records["chat_template"]
    assert records["special_tokens"]["<|im_end|>"] == tok.convert_tokens_to_ids("<|im_end|>")


def test_fp32_greedy_tokens_match_transformers(default_checkpoint, reference):
    hf, tok = reference
    model = torch_model(default_checkpoint, "fp32")
    compared = 0
    for prompt in PROMPTS:
        ids = tok(prompt).input_ids
        assert model.encode(prompt) == ids
        with torch.no_grad():
            want = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                               max_new_tokens=GREEDY_TOKENS, do_sample=False)[0, len(ids):].tolist()
        got = model.generate(ids, max_new_tokens=GREEDY_TOKENS)
        print(f"{prompt!r}: {len(got.token_ids)} tokens, {got.finish_reason}: {got.text!r}")
        if got.finish_reason == "eos":  # transformers keeps the EOS token, llama_ane stops before it
            assert want[len(got.token_ids)] in model.eos_token_ids
            want = want[:len(got.token_ids)]
        assert got.token_ids == want, prompt
        compared += len(want)
    model.close()
    assert compared >= len(PROMPTS) * GREEDY_TOKENS * 0.6  # most prompts ran the full 32 tokens


def test_fp16_logits_on_english_prose(default_checkpoint, reference):
    """torch fp16 (the export's precision) against transformers fp32 over 256 tokens (4 prefill windows)."""
    hf, tok = reference
    ids = tok(PROSE).input_ids
    assert len(ids) >= SCORE_TOKENS
    ids = ids[:SCORE_TOKENS]
    model = torch_model(default_checkpoint, "fp16")
    assert model.backend.dtype == np.float16
    t0 = time.perf_counter()
    got = model.score(ids).astype(np.float64)
    seconds = time.perf_counter() - t0
    model.close()
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0].double().numpy()
    top1 = float(np.mean(got.argmax(-1) == want.argmax(-1)))
    cosine = float(np.mean(np.sum(got * want, -1) / (np.linalg.norm(got, axis=-1) * np.linalg.norm(want, axis=-1))))
    print(f"fp16 vs transformers fp32 over {len(ids)} tokens: top-1 {top1:.4f}, mean cosine {cosine:.6f}, "
          f"max |diff| {np.abs(got - want).max():.3f} (scored in {seconds:.0f} s)")
    assert np.isfinite(got).all()
    assert top1 >= 0.98
    assert cosine >= 0.999


def test_cli_export_of_the_default_model(tmp_path):
    """`llama-ane export` of SmolLM2, as a user runs it (with its parity check), in at most 3 minutes;
    the printed time is checked, and `info` reads the result."""
    out = tmp_path / "smollm2"
    cmd = [sys.executable, "-m", "llama_ane", "export", "-o", str(out), "--quiet"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, PYTHONWARNINGS="ignore"))
    wall = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "passed" in proc.stdout  # the parity check ran on the exported programs
    converted = re.search(r"converted in (\d+\.\d) s", proc.stdout)
    done = re.search(r"exported .* in (\d+\.\d) s", proc.stdout)  # the export's closing line
    assert converted and done, proc.stdout
    printed = float(done.group(1))
    print(f"llama-ane export of the default model: conversion {converted.group(1)} s, "
          f"total printed {printed:.1f} s (wall {wall:.1f} s with interpreter start)")
    assert float(converted.group(1)) <= printed <= wall
    assert printed <= EXPORT_LIMIT_S

    from click.testing import CliRunner

    from llama_ane.cli import main
    from llama_ane.export.validate import MAX_DIM, validate_export

    info = CliRunner().invoke(main, ["info", str(out)])
    assert info.exit_code == 0, info.stderr
    assert "SmolLM2-135M-Instruct" in info.stdout and "30 layers" in info.stdout and "sha256 verified" in info.stdout
    as_json = CliRunner().invoke(main, ["info", str(out), "--json"])
    printed = json.loads(as_json.stdout)
    traffic = printed.pop("decode_step_bytes")
    other = printed.pop("decode_step_bytes_other_kv_cache")["kv_cache"]
    resident = printed.pop("resident")  # what a runtime keeps wired for the functions it loads, modelled
    assert printed.pop("resident_bytes") == resident["resident_bytes"] >= printed.pop("weight_copy_bytes") > 0
    print(f"the default export: {resident['functions_loaded']} functions, {resident['copies']} copies of its weights")
    # one function a package: the Neural Engine keeps one copy of the weights (modelled, contract/resident.py)
    assert resident["runtime"] == "Core ML" and resident["copies"] <= 1.25
    manifest = printed
    assert manifest["cache"]["kind"] == "state" and other == "inputs"  # the default: states where they work
    assert validate_export(out) == manifest
    assert traffic["total"] == traffic["weights"] + traffic["cache_read"] + traffic["cache_update"]
    one_embedding_row = manifest["config"]["hidden_size"] * 2
    assert traffic["weights"] == sum(w["bytes"] for name, w in manifest["weights"].items()
                                     if name != "embeddings") + one_embedding_row
    assert manifest["lm_head"]["vocab_splits"] == [16384, 16384, 16384]
    dims = [d for m in manifest["models"].values() for f in m["functions"].values()
            for t in f["inputs"] + f["outputs"] for d in t["shape"]]
    assert max(dims) <= MAX_DIM
    assert sorted(p.name for p in tmp_path.iterdir()) == ["smollm2"]


def _document_of_at_least(tokenizer_encode, tokens: int) -> str:
    """benchmarks/document.txt followed by paragraphs of the held-out evaluation text, until the
    whole is at least `tokens` tokens long."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    text = (root / "benchmarks" / "document.txt").read_text().strip()
    for paragraph in (root / "llama_ane" / "eval_text.txt").read_text().split("\n\n"):
        if len(tokenizer_encode(text)) >= tokens:
            break
        text += "\n\n" + paragraph.strip()
    return text


def test_a_long_document_prompt_cache_is_reused_by_a_new_process(smollm2_export, tiny_export, tmp_path):
    """A >= 800-token document: the first `generate --prompt-cache` run prefills it and writes the
    file; a second run in a new process loads it, prefills (almost) nothing and answers the same;
    another export refuses the file."""
    import llama_ane

    encode = llama_ane.load(smollm2_export, backend="torch").encode
    document = _document_of_at_least(encode, 800)
    doc_file, cache = tmp_path / "doc.txt", tmp_path / "doc.npz"
    doc_file.write_text(document)

    def run(out):
        proc = subprocess.run([sys.executable, "-m", "llama_ane", "generate", str(out), "--prompt-file", str(doc_file),
                               "--question", "When was the lighthouse finished?",
                               "--question", "Who paid for the stone pier?",
                               "--prompt-cache", str(cache), "--max-new-tokens", "12", "--json"],
                              capture_output=True, text=True, timeout=900)
        return proc

    first = json.loads(run(smollm2_export).stdout)
    assert first["prefix_tokens"] >= 800 and first["reused_tokens"] == 0 and cache.is_file()
    proc = run(smollm2_export)
    assert proc.returncode == 0, proc.stderr[-2000:]
    second = json.loads(proc.stdout)
    print(f"document of {first['prefix_tokens']} tokens: prefill {first['prefill_seconds']} s without the cache, "
          f"{second['prefill_seconds']} s with it ({second['reused_tokens']} tokens reused)")
    assert second["reused_tokens"] >= second["prefix_tokens"] - 1
    assert second["prefill_seconds"] < 0.1 * first["prefill_seconds"]
    assert [b["token_ids"] for b in second["branches"]] == [b["token_ids"] for b in first["branches"]]
    refused = run(tiny_export)
    assert refused.returncode != 0 and "Error:" in refused.stderr and "Traceback" not in refused.stderr
