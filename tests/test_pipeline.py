"""The chunked pipeline: windows, the context limit, asynchronous cache updates and their failures,
and streaming generation on top of it."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import llama_ane
from llama_ane.runtime.backends.base import Backend
from llama_ane.runtime.pipeline import CacheUpdateError, ContextFullError, Pipeline

CONTEXT, WINDOW = 64, 16


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    """A 5-layer tiny model in 3 chunks, context 64, prefill window 16, on the torch backend."""
    model = llama_ane.load(tiny_checkpoint(num_hidden_layers=5), backend="torch", context_length=CONTEXT,
                           prefill_length=WINDOW, layers_per_chunk=2)
    yield model
    model.close()


class StubBackend(Backend):
    """Runs a real backend, records every call, and lets a test break or delay the cache updates."""

    def __init__(self, inner: Backend, fail_update_at: int | None = None, update_delay: float = 0.0,
                 hang: threading.Event | None = None):
        self.inner = inner
        self.name = "stub"
        self.dtype = inner.dtype
        self.fail_update_at = fail_update_at
        self.update_delay = update_delay
        self.hang = hang
        self.calls: list[tuple] = []  # (event, model, function, position or None, time, k cache)
        self.updates = 0
        self.lock = threading.Lock()

    def predict(self, model, function, inputs):
        pos = int(inputs["position"][0]) if "position" in inputs else \
            int(inputs["positions"][0]) if "positions" in inputs else None  # the window's first row's
        if model != "cache_update":
            self.calls.append(("run", model, function, pos, time.perf_counter(), inputs.get("k_cache")))
            return self.inner.predict(model, function, inputs)
        with self.lock:
            n = self.updates
            self.updates += 1
        if self.hang is not None:
            self.hang.wait(30)
        if self.fail_update_at is not None and n >= self.fail_update_at:
            raise RuntimeError("simulated cache-update failure")
        time.sleep(self.update_delay)
        out = self.inner.predict(model, function, inputs)
        self.calls.append(("updated", model, function, pos, time.perf_counter(), out["k_cache_out"]))
        return out


def call_within(fn, seconds: float = 60.0):
    """Run fn in a daemon thread; fail (rather than hang the suite) if it does not return in time."""
    box: dict = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed back to the test
            box["error"] = e
    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"did not return within {seconds} s (a hang)"
    if "error" in box:
        raise box["error"]
    return box["value"]


def ids(n: int, seed: int = 0) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 320, n)]


# ---- windows and the context ------------------------------------------------------------------------------------

def test_windows_and_cache_positions(tiny):
    stub = StubBackend(tiny.backend)
    p = Pipeline(stub, tiny.manifest)
    logits = p.prefill(ids(40), all_logits=True)
    p.run_window([5])
    p.wait()
    assert logits.shape == (40, 320) and p.position == 41
    emb = [(fn, pos) for ev, model, fn, pos, *_ in stub.calls if ev == "run" and model == "embeddings"]
    assert emb == [("prefill", 0), ("prefill", 16), ("prefill", 32), ("prefill", 40)]  # a token runs the window
    chunks = [c["model"] for c in tiny.manifest["chunks"]]
    assert chunks == ["chunk_0", "chunk_1", "chunk_2"]
    updates = [(fn, pos) for ev, model, fn, pos, *_ in stub.calls if ev == "updated"]
    assert sorted(updates) == sorted([("prefill_l2", p0) for p0 in (0, 16, 32, 40) for _ in range(2)]
                                     + [("prefill_l1", p0) for p0 in (0, 16, 32, 40)])
    p.close()


def test_a_chunk_waits_for_its_own_cache_update(tiny):
    """Chunk i at window w+1 reads the very cache its update from window w wrote, after it landed."""
    stub = StubBackend(tiny.backend, update_delay=0.05)
    p = Pipeline(stub, tiny.manifest)
    p.prefill(ids(48))
    p.wait()
    updates = [(t, k) for ev, model, fn, pos, t, k in stub.calls if ev == "updated"]
    assert len(updates) == 3 * 3
    for chunk in (c["model"] for c in tiny.manifest["chunks"]):
        runs = [(t, k) for ev, model, fn, pos, t, k in stub.calls if ev == "run" and model == chunk]
        assert len(runs) == 3  # windows at 0, 16, 32
        assert not runs[0][1].any()  # the first window sees an empty cache
        for w, (start, k_cache) in enumerate(runs[1:], 1):
            written = [t for t, k in updates if k is k_cache]
            assert len(written) == 1 and written[0] < start, f"{chunk} window {w} did not wait for its update"
    p.close()


def test_decoding_past_the_context_is_an_error(tiny):
    p = Pipeline(tiny.backend, tiny.manifest)
    p.prefill(ids(CONTEXT - 2))
    p.run_window([7])
    p.run_window([8])
    assert p.position == CONTEXT
    with pytest.raises(ContextFullError, match=f"context is full: {CONTEXT} \\+ 1 tokens exceed .* {CONTEXT}"):
        p.run_window([9])
    p.close()


def test_prefill_longer_than_the_context(tiny):
    p = Pipeline(tiny.backend, tiny.manifest)
    with pytest.raises(ContextFullError, match=f"{CONTEXT + 1} tokens do not fit"):
        p.prefill(ids(CONTEXT + 1))
    assert p.position == 0  # refused before running anything
    p.prefill(ids(30))
    with pytest.raises(ContextFullError, match="30 are cached"):
        p.prefill(ids(CONTEXT - 29))
    p.close()


@pytest.mark.parametrize("n", [0, WINDOW + 1])
def test_window_size_limits(tiny, n):
    p = Pipeline(tiny.backend, tiny.manifest)
    with pytest.raises(ValueError, match=f"1..{WINDOW}"):
        p.run_window(ids(n))
    p.close()


def test_generation_stops_when_the_context_is_full(tiny, monkeypatch):
    monkeypatch.setattr(type(tiny), "eos_token_ids", property(lambda self: []))  # nothing ends it earlier
    prompt = ids(CONTEXT - 4)
    result = tiny.generate(prompt, max_new_tokens=50)
    assert result.finish_reason == "context"
    assert len(result.token_ids) == CONTEXT - len(prompt) + 1  # the last one needs no cache slot


def test_score_resets_the_cache(tiny):
    x = ids(40, seed=5)
    a = tiny.score(x)
    tiny.generate(ids(10, seed=6), max_new_tokens=5)
    np.testing.assert_array_equal(tiny.score(x), a)


def test_window_split_does_not_change_the_logits(tiny):
    """Scoring in windows of 16 or token by token (decode functions) gives the same logits."""
    x = ids(20, seed=7)
    windows = tiny.score(x)
    p = tiny.pipeline
    p.reset()
    steps = np.stack([p.run_window([t])[0] for t in x])
    p.wait()
    np.testing.assert_allclose(steps, windows, atol=1e-4)


# ---- asynchronous cache update failures ----------------------------------------------------------------------

@pytest.mark.parametrize("fail_at", [0, 4])
def test_failed_cache_update_raises_instead_of_hanging(tiny, fail_at):
    stub = StubBackend(tiny.backend, fail_update_at=fail_at)
    p = Pipeline(stub, tiny.manifest)
    with pytest.raises(CacheUpdateError, match="cache update of chunk_\\d failed: simulated cache-update failure"):
        call_within(lambda: p.prefill(ids(48)))
    try:  # other chunks' updates failed too: close may report them, but must return
        call_within(p.close)
    except CacheUpdateError:
        pass


def test_the_pipeline_recovers_after_a_failed_update(tiny):
    """Once the backend works again, the next sequence must not see the old failure."""
    stub = StubBackend(tiny.backend, fail_update_at=0)
    model = llama_ane.runtime.model.LlamaANEModel(tiny.folder, tiny.manifest, stub)
    with pytest.raises(CacheUpdateError):
        call_within(lambda: model.score(ids(48)))
    stub.fail_update_at = None
    x = ids(40, seed=5)
    np.testing.assert_allclose(call_within(lambda: model.score(x)), tiny.score(x), atol=1e-5)
    model.close()


def test_failed_cache_update_in_the_last_window_surfaces_from_score(tiny):
    """One window, then score() waits for the updates: the failure must reach the caller."""
    stub = StubBackend(tiny.backend, fail_update_at=0)
    model = llama_ane.runtime.model.LlamaANEModel(tiny.folder, tiny.manifest, stub)
    with pytest.raises(CacheUpdateError, match="simulated"):
        call_within(lambda: model.score(ids(10)))


def test_stuck_cache_update_times_out(tiny):
    release = threading.Event()
    stub = StubBackend(tiny.backend, hang=release)
    p = Pipeline(stub, tiny.manifest)
    p.updates.timeout_s = 0.5
    try:
        with pytest.raises(CacheUpdateError, match="did not finish in"):
            call_within(lambda: p.prefill(ids(40)), seconds=30)
    finally:
        release.set()
    call_within(p.close)


def test_cache_update_error_through_generate(tiny):
    stub = StubBackend(tiny.backend, fail_update_at=3)
    model = llama_ane.runtime.model.LlamaANEModel(tiny.folder, tiny.manifest, stub)
    with pytest.raises(CacheUpdateError):
        call_within(lambda: model.generate(ids(20), max_new_tokens=10))


# ---- streaming generation -----------------------------------------------------------------------------------------

def test_stream_events_make_up_the_text(tiny):
    events = []
    result = tiny.generate("The quick brown fox", max_new_tokens=20, on_token=events.append, raw=True)
    assert [e.token_id for e in events] == result.token_ids
    assert "".join(e.text for e in events) == result.text
    full = tiny.tokenizer.decode(result.token_ids, skip_special_tokens=True)
    # a UTF-8 sequence still open at the end is withheld (byte-level BPE of a random model)
    assert result.text == full or (full.endswith("\ufffd") and full.startswith(result.text))
    assert result.prompt_tokens == len(tiny.encode("The quick brown fox"))
    # one decode step per token after the first, plus the step that produced EOS, if any
    assert result.decoded_tokens == len(result.token_ids) - 1 + (result.finish_reason == "eos")
    assert result.prefill_seconds > 0


def test_stop_string_cuts_the_text(tiny, monkeypatch):
    monkeypatch.setattr(type(tiny), "eos_token_ids", property(lambda self: []))  # 24 tokens of text
    full = tiny.generate("Numbers like", max_new_tokens=24, raw=True)
    text = full.text
    assert full.finish_reason == "length" and len(text.strip()) >= 8, text
    stop = text[len(text) // 2: len(text) // 2 + 2]
    cut = text.index(stop)
    events = []
    got = tiny.generate("Numbers like", max_new_tokens=24, stop=[stop], on_token=events.append, raw=True)
    assert got.finish_reason == "stop"
    assert got.text == text[:cut]
    assert "".join(e.text for e in events) == text[:cut]
    assert got.token_ids == full.token_ids[:len(got.token_ids)]


def test_a_string_prompt_is_one_user_turn_by_default(tiny):
    """A string is wrapped by the chat template (as `encode(..., chat=True)`); `raw=True` feeds it
    as plain text; token ids are fed as given."""
    wrapped, plain = tiny.encode("hi", chat=True), tiny.encode("hi")
    assert len(wrapped) > len(plain)
    assert tiny.prompt_ids("hi") == wrapped and tiny.prompt_ids("hi", raw=True) == plain
    assert tiny.prompt_ids(plain) == tiny.prompt_ids(plain, raw=True) == plain
    default = tiny.generate("hi", max_new_tokens=4)
    assert default.prompt_tokens == len(wrapped)
    assert default.token_ids == tiny.generate(wrapped, max_new_tokens=4).token_ids
    assert tiny.generate("hi", max_new_tokens=4, raw=True).prompt_tokens == len(plain)
    assert tiny.generate(plain, max_new_tokens=4).prompt_tokens == len(plain)
    assert [e.token_id for e in tiny.stream("hi", max_new_tokens=4)] == default.token_ids
    assert tiny.last_result.prompt_tokens == len(wrapped)


def test_without_a_chat_template_a_string_prompt_is_plain_text(tiny, monkeypatch):
    monkeypatch.setitem(tiny.manifest["tokenizer"], "chat_template", None)
    assert not tiny.has_chat_template
    assert tiny.generate("hi", max_new_tokens=2).prompt_tokens == len(tiny.encode("hi"))
    with pytest.raises(ValueError, match="no chat template"):
        tiny.encode("hi", chat=True)  # only an explicit request for the template is refused


def test_branch_prompts_follow_the_chat_template_rule(tiny):
    """generate_branches: each branch's `prefix + continuation` is one user turn and the shared
    prefix is the rendered branches' longest common token prefix; with n, the prefix is one user
    turn; raw, token ids or no template: plain tokens."""
    from llama_ane.runtime.cascade import split_shared_prefix

    doc, questions = "Caches hold recent keys.\n\n", ["What do caches hold?", "Why?"]
    prefix, own = tiny._branch_ids(doc, questions, None, raw=False)
    assert (prefix, own) == split_shared_prefix([tiny.encode(doc + q, chat=True) for q in questions])
    assert [prefix + o for o in own] == [tiny.encode(doc + q, chat=True) for q in questions]
    assert tiny._branch_ids(doc, None, 3, raw=False) == (tiny.encode(doc, chat=True), [[], [], []])
    plain = tiny.encode(doc)
    tail = [list(tiny.tokenizer(q, add_special_tokens=False).input_ids) for q in questions]
    assert tiny._branch_ids(doc, questions, None, raw=True) == (plain, tail)
    assert tiny._branch_ids(plain, questions, None, raw=False) == (plain, tail)  # ids are never wrapped
    assert tiny._branch_ids(doc, None, 2, raw=True) == (plain, [[], []])
    with pytest.raises(ValueError, match="token-id continuations"):
        tiny._branch_ids(doc, [tail[0]], None, raw=False)


def test_max_new_tokens_must_be_positive(tiny):
    with pytest.raises(ValueError, match="max_new_tokens"):
        tiny.generate("x", max_new_tokens=0)


def test_eos_stops_generation(tiny, monkeypatch):
    """Make the greedy continuation's 3rd token an EOS id: generation stops there, without it."""
    prompt = ids(12, seed=9)
    full = tiny.generate(prompt, max_new_tokens=8)
    assert len(full.token_ids) == 8, "the random model emitted EOS: pick another prompt"
    monkeypatch.setattr(type(tiny), "eos_token_ids", property(lambda self: [full.token_ids[2]]))
    first = full.token_ids.index(full.token_ids[2])
    got = tiny.generate(prompt, max_new_tokens=8)
    assert got.finish_reason == "eos"
    assert got.token_ids == full.token_ids[:first]
