"""Reusable caches, prompt-cache files, chat, context shift, and the torch backend's direct cache
(in-place writes, attention over the filled positions) against the cache-update modules."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

import llama_ane
from llama_ane.runtime.chat import Chat
from llama_ane.runtime.kv_cache import PromptCacheError, common_prefix
from llama_ane.runtime.model import LlamaANEModel, shift_limit, shifted

from conftest import no_eos


@pytest.fixture(scope="module")
def models(tiny_export):
    """The tiny export on the torch backend, with direct caches (the default) and with the cache-update modules."""
    direct = llama_ane.load(tiny_export, backend="torch")
    modules = llama_ane.load(tiny_export, backend="torch", direct_cache=False)
    assert direct.pipeline.direct and not modules.pipeline.direct
    yield direct, modules
    direct.close()
    modules.close()


def ids(model, n: int, seed: int = 0) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, model.manifest["config"]["vocab_size"], n)]




def test_direct_cache_gives_the_numbers_of_the_cache_update_modules(models):
    direct, modules = models
    x = ids(direct, 150)
    np.testing.assert_allclose(direct.score(x), modules.score(x), atol=1e-5)
    with no_eos(direct), no_eos(modules):
        a = direct.generate(x[:70], max_new_tokens=20)
        b = modules.generate(x[:70], max_new_tokens=20)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 20
    prefix, conts = x[:90], [x[90:95], x[95:97], x[97:98]]
    for got, want in zip(direct.score_branches(prefix, conts), modules.score_branches(prefix, conts)):
        np.testing.assert_allclose(got, want, atol=1e-5)
    a = direct.generate_branches(prefix, conts, max_new_tokens=8)
    b = modules.generate_branches(prefix, conts, max_new_tokens=8)
    assert [r.token_ids for r in a.branches] == [r.token_ids for r in b.branches]


@pytest.mark.parametrize("which", ["direct", "modules"])
def test_a_cache_prefills_only_what_it_does_not_hold(models, which):
    """Five turns on one cache: each prefills only the tokens the cache lacks, and its greedy tokens
    equal those of prefilling the whole conversation from nothing."""
    model = models[0] if which == "direct" else models[1]
    cache = model.make_cache()
    conversation: list[int] = []
    with no_eos(model):
        for turn in range(5):
            conversation += ids(model, 25, seed=turn)
            held = list(cache.tokens)
            r = model.generate(conversation, max_new_tokens=6, cache=cache)
            fresh = model.generate(conversation, max_new_tokens=6)
            assert r.token_ids == fresh.token_ids
            assert r.reused_tokens == min(common_prefix(held, conversation), len(conversation) - 1)
            if turn:  # all of the previous turn but its last generated token (never fed back) was reused
                assert r.prefilled_tokens == 25 + 1
            assert cache.tokens == conversation + r.token_ids[:-1]
            conversation += r.token_ids
    # a prompt that diverges keeps only the common prefix
    r = model.generate(conversation[:40] + ids(model, 5, seed=99), max_new_tokens=2, cache=cache)
    assert r.reused_tokens == 40


def test_a_prompt_cache_file_is_reused_and_tied_to_its_export(models, tiny_checkpoint, tmp_path):
    model = models[0]
    doc, q1, q2 = ids(model, 200, seed=1), ids(model, 8, seed=2), ids(model, 6, seed=3)
    cache = model.make_cache()
    model.generate(doc, max_new_tokens=1, cache=cache)
    path = model.save_cache(cache, tmp_path / "doc.npz")
    assert [p.name for p in tmp_path.iterdir()] == ["doc.npz"]

    again = LlamaANEModel(model.folder, model.manifest, model.backend)  # a second model object on the export
    loaded = again.load_cache(path)
    assert loaded.tokens == doc
    with no_eos(model), no_eos(again):
        r = again.generate(doc + q1, max_new_tokens=8, cache=loaded)
        want = model.generate(doc + q1, max_new_tokens=8)
    assert r.token_ids == want.token_ids and r.reused_tokens == 200 and r.prefilled_tokens == 8
    out = again.generate_branches(doc, [q1, q2], max_new_tokens=6, cache=again.load_cache(path))
    alone = model.generate_branches(doc, [q1, q2], max_new_tokens=6)
    assert out.stats.reused_tokens == 199  # the prefix's last token runs again for its logits
    assert [b.token_ids for b in out.branches] == [b.token_ids for b in alone.branches]

    other = llama_ane.load(tiny_checkpoint(num_hidden_layers=5, head_dim=32), backend="torch", context_length=256,
                           prefill_length=64, layers_per_chunk=2)
    with pytest.raises(PromptCacheError, match="made by another export"):
        other.load_cache(path)
    (tmp_path / "junk.npz").write_bytes(b"not a cache")
    with pytest.raises(PromptCacheError, match="not a usable llama-ane prompt-cache file"):
        model.load_cache(tmp_path / "junk.npz")
    other.close()


def test_shift_keeps_the_first_tokens_and_the_most_recent():
    tokens = list(range(100))
    assert shifted(tokens, 4, 10) == [0, 1, 2, 3, 94, 95, 96, 97, 98, 99]
    assert shifted(tokens[:8], 4, 10) == tokens[:8]
    assert shift_limit(256, 10) == 10 + 123
    with pytest.raises(Exception, match="cannot shift the context"):
        shift_limit(256, 255)


def test_generation_goes_on_past_the_context_with_shift(models):
    model = models[0]
    context = model.manifest["context_length"]
    prompt = ids(model, context - 16, seed=4)
    cache = model.make_cache()
    with no_eos(model):
        r = model.generate(prompt, max_new_tokens=60, cache=cache, overflow="shift", keep=10)
        stopped = model.generate(prompt, max_new_tokens=60)
    assert stopped.finish_reason == "context" and len(stopped.token_ids) == 17
    assert r.shifts == 1 and len(r.token_ids) == 60 and r.finish_reason == "length"
    assert r.token_ids[:17] == stopped.token_ids  # the same tokens until the shift
    fed = prompt + r.token_ids[:-1]
    kept = cache.tokens
    assert kept[:10] == prompt[:10] and kept[10:] == fed[len(fed) - (len(kept) - 10):]
    assert len(kept) < context
    # a prompt longer than the context is shifted the same way
    long = ids(model, context + 50, seed=5)
    with no_eos(model):
        r = model.generate(long, max_new_tokens=3, overflow="shift", keep=10)
    assert r.shifts == 1 and r.prompt_tokens == shift_limit(context, 10)


def test_chat_turns_prefill_only_their_new_tokens(models):
    """Each turn's prompt is the whole conversation through the chat template; only its new tokens
    are prefilled, and the reply equals generating from that whole prompt with no cache."""
    model = models[0]
    chat = Chat(model, system="You are terse.", max_new_tokens=5)
    assert chat.keep > 0
    with no_eos(model):
        for turn, text in enumerate(["Hello there", "What is a cache?", "And a value?", "Thanks", "Bye"]):
            before = len(chat.cache.tokens)
            r = chat.send(text)
            prompt = chat.cache.tokens[:r.prompt_tokens]
            assert r.token_ids == model.generate(prompt, max_new_tokens=5).token_ids
            if turn:
                assert r.reused_tokens == before and r.prefilled_tokens == r.prompt_tokens - before
    assert [m["role"] for m in chat.messages] == ["system"] + ["user", "assistant"] * 5
    chat.reset()
    assert chat.cache.tokens == [] and len(chat.messages) == 1


def test_cli_prompt_cache_is_created_then_reused(tiny_export, tmp_path):
    """Two `generate --prompt-cache` runs in new processes: the second prefills only the new tokens."""
    cache = tmp_path / "doc.npz"
    doc = "The quick brown fox jumps over the lazy dog. " * 6

    def run(prompt):
        proc = subprocess.run([sys.executable, "-m", "llama_ane", "generate", str(tiny_export), "--prompt", prompt,
                               "--prompt-cache", str(cache), "--max-new-tokens", "4", "--json", "--raw"],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return json.loads(proc.stdout)

    first = run(doc)
    assert first["reused_tokens"] == 0 and cache.is_file()
    second = run(doc + " Question: what jumps?")
    assert second["reused_tokens"] >= first["prompt_tokens"] - 1
    proc = subprocess.run([sys.executable, "-m", "llama_ane", "generate", str(tiny_export), "--prompt", "x",
                           "--prompt-cache", str(tmp_path / "missing-dir" / "c.npz")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "Error:" in proc.stderr
