"""`llama-ane serve`: the OpenAI client against a live server on a tiny export with cascade branches.

Each server runs in a thread of this process (uvicorn on 127.0.0.1, a free port) over one model
loaded once (torch, fp32), so model calls can be counted by wrapping the backend's predict.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import jsonschema
import numpy as np
import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx2")  # the HTTP client the openai package uses
uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("starlette")
pytest.importorskip("llguidance")

import llama_ane  # noqa: E402
from llama_ane.contract.manifest import window_cascade  # noqa: E402
from llama_ane.runtime.sampling import SamplingParams  # noqa: E402
from llama_ane.serve.app import create_app, serve_in_thread  # noqa: E402
from llama_ane.serve.options import ServeOptions  # noqa: E402
from llama_ane.serve.pricing import BATCH, WINDOW, Prices  # noqa: E402
from llama_ane.serve.scheduler import Finished, Request, Scheduler, Token  # noqa: E402

from conftest import no_eos  # noqa: E402

# a tools-capable template in the Hermes style: tools listed in a system turn, calls as <tool_call> JSON
TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools; call one as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>\n"
    "{% for tool in tools %}{{ tool.function | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n"
    "{% if message.tool_calls %}{% for call in message.tool_calls %}<tool_call>{{ call.function | tojson }}"
    "</tool_call>{% endfor %}{% else %}{{ message.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
DOCUMENT = ("The quick brown fox jumps over the lazy dog. Numbers like 12, 345 and 6789 appear in text; so do "
            "questions? And answers! The Neural Engine runs small models quickly and with little power. ") * 4
QUESTIONS = ["Who jumps?", "What runs?", "Which numbers?", "Is it quick?", "And the dog?", "What power?",
             "So do what?", "How small?"]


def _export(tiny_checkpoint, tmp_path_factory, **options):
    from llama_ane.api import export_model

    # a context that holds the ~440-token documents and, through the prefill window, 8 branches' answers
    return export_model(tiny_checkpoint(num_hidden_layers=3, head_dim=32), tmp_path_factory.mktemp("serve") / "tiny",
                        context_length=1024, prefill_length=64, layers_per_chunk=2, branch_width=8, suffix_length=64,
                        progress=False, verify=False, **options)


@pytest.fixture(scope="module")
def export(tiny_checkpoint, tmp_path_factory):
    """The default: the branches step through the prefill window, side by side in the one cache."""
    return _export(tiny_checkpoint, tmp_path_factory)


@pytest.fixture(scope="module")
def decode_model(tiny_checkpoint, tmp_path_factory):
    """An export with a decode function and the cascade's function, with its suffix caches."""
    m = llama_ane.load(_export(tiny_checkpoint, tmp_path_factory, decode_function="decode"), backend="torch",
                       precision="fp32")
    yield m
    m.close()


@pytest.fixture(scope="module")
def model(export):
    m = llama_ane.load(export, backend="torch", precision="fp32")
    m.calls = 0
    predict = m.backend.predict

    def counted(*args, **kwargs):
        m.calls += 1
        return predict(*args, **kwargs)
    m.backend.predict = counted
    yield m
    m.close()


@contextlib.contextmanager
def serving(model, **options):
    """A live server on 127.0.0.1 (a free port) in a thread; yields its base URL."""
    options.setdefault("chat_template", TOOLS_TEMPLATE)
    with serve_in_thread(create_app(model, ServeOptions(**options))) as url:
        yield url


def client(url: str, key: str = "none") -> "openai.OpenAI":
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)


def chat_ids(model, messages, tools=None) -> list[int]:
    return list(model.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                                    return_dict=False, chat_template=TOOLS_TEMPLATE))


def metrics(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics").text
    return {k: float(v) for k, v in (line.split() for line in text.splitlines() if not line.startswith("#"))}


@pytest.mark.export
def test_models_chat_and_completions_equal_generate(model):
    messages = [{"role": "user", "content": "Name a river."}]
    with no_eos(model), serving(model) as url:
        c = client(url)
        assert [m.id for m in c.models.list().data] == [model.manifest["name"]]
        r = c.chat.completions.create(model="x", messages=messages, max_tokens=10, temperature=0)
        alone = model.generate(chat_ids(model, messages), max_new_tokens=10)
        assert r.choices[0].message.content == alone.text
        assert r.choices[0].finish_reason == "length"
        assert r.usage.completion_tokens == 10 and r.usage.prompt_tokens == len(chat_ids(model, messages))
        r = c.completions.create(model="x", prompt="The quick brown", max_tokens=8, temperature=0)
        assert r.choices[0].text == model.generate("The quick brown", max_new_tokens=8, raw=True).text
        assert r.usage.total_tokens == r.usage.prompt_tokens + 8


@pytest.mark.export
def test_streaming_stop_seed_and_n(model):
    messages = [{"role": "user", "content": "Tell a story."}]
    with no_eos(model), serving(model) as url:
        c = client(url)
        whole = c.chat.completions.create(model="x", messages=messages, max_tokens=16, temperature=0)
        text = whole.choices[0].message.content
        chunks = list(c.chat.completions.create(model="x", messages=messages, max_tokens=16, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
        assert chunks[-1].usage.completion_tokens == 16

        stop = text[len(text) // 2:len(text) // 2 + 2]  # a stop string known to occur in the answer
        cut = c.chat.completions.create(model="x", messages=messages, max_tokens=16, temperature=0, stop=[stop])
        assert cut.choices[0].message.content == text[:text.find(stop)]
        assert cut.choices[0].finish_reason == "stop"

        sampled = [c.completions.create(model="x", prompt="Once", max_tokens=12, temperature=1.0, seed=seed)
                   .choices[0].text for seed in (7, 7, 8)]
        assert sampled[0] == sampled[1] and sampled[0] != sampled[2]
        n = c.completions.create(model="x", prompt="Once", max_tokens=12, temperature=1.0, seed=7, n=3)
        assert len(n.choices) == 3 and len({ch.text for ch in n.choices}) > 1
        assert n.usage.completion_tokens == 36


@pytest.mark.export
def test_logprobs_with_top_alternatives(model):
    with serving(model) as url:
        r = client(url).chat.completions.create(model="x", messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                                temperature=0, logprobs=True, top_logprobs=3)
    entries = r.choices[0].logprobs.content
    assert len(entries) == r.usage.completion_tokens
    for e in entries:
        tops = [t.logprob for t in e.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert e.logprob == pytest.approx(tops[0]) and e.token == e.top_logprobs[0].token  # greedy: the top one
        assert np.exp(tops).sum() <= 1.0 + 1e-6


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "pet": {"enum": ["cat", "dog"]}},
          "required": ["name", "age", "pet"], "additionalProperties": False}


@pytest.mark.export
def test_json_schema_output_validates_even_from_a_random_model(model):
    with serving(model) as url:
        c = client(url)
        for seed in (0, 1):
            r = c.chat.completions.create(
                model="x", messages=[{"role": "user", "content": "A person, as JSON."}], max_tokens=48,
                temperature=1.0, seed=seed,
                response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
            jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
            assert r.choices[0].finish_reason == "stop"


@pytest.mark.export
def test_forced_tool_call(model):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"enum": ["Oslo", "Lima"]}},
                                                              "required": ["city"], "additionalProperties": False}}},
             {"type": "function", "function": {"name": "noop", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    forced = {"type": "function", "function": {"name": "get_weather"}}
    with serving(model) as url:
        r = client(url).chat.completions.create(model="x", messages=messages, tools=tools, max_tokens=32,
                                                tool_choice=forced)
        chunks = list(client(url).chat.completions.create(model="x", messages=messages, tools=tools, max_tokens=32,
                                                          tool_choice=forced, stream=True))
    [streamed] = chunks[-1].choices[0].delta.tool_calls  # a streamed call comes whole in the last chunk
    assert chunks[-1].choices[0].finish_reason == "tool_calls" and streamed.function.name == "get_weather"
    jsonschema.validate(json.loads(streamed.function.arguments), tools[0]["function"]["parameters"])
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), tools[0]["function"]["parameters"])
    assert r.usage.prompt_tokens == len(chat_ids(model, messages, tools))  # the template rendered the tools


@pytest.mark.export
def test_bad_requests_get_4xx_and_the_server_keeps_serving(model):
    with serving(model, max_tokens_limit=64, api_key="secret") as url:
        h = {"Authorization": "Bearer secret"}
        def post(path, body, headers=h):
            return httpx.post(url + path, json=body, headers=headers, timeout=60)
        ok = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        cases = [
            (post("/v1/chat/completions", ok, {}), 401, None),
            (httpx.post(url + "/v1/chat/completions", content=b"{not json", headers=h), 400, None),
            (post("/v1/chat/completions", {"max_tokens": 4}), 400, None),
            (post("/v1/chat/completions", {**ok, "messages": []}), 400, "messages"),
            (post("/v1/chat/completions", {**ok, "temperature": 5}), 400, "temperature"),
            (post("/v1/chat/completions", {**ok, "max_tokens": 65}), 400, "max_tokens"),
            (post("/v1/chat/completions", {**ok, "messages": [{"role": "user", "content": "fox " * 600}]}), 400,
             "messages"),
            (post("/v1/chat/completions", {**ok, "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
             400, "tool_choice"),
            (post("/v1/chat/completions", {**ok, "response_format": {"type": "json_schema", "json_schema": {
                "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}}), 400, None),
            (post("/v1/completions", {"prompt": [5, 10 ** 6], "max_tokens": 4}), 400, "prompt"),
            (post("/v1/completions", {"prompt": "x", "max_tokens": 4, "n": 99}), 400, "n"),
            (post("/v1/nothing", ok), 404, None),
            (httpx.get(url + "/v1/chat/completions", headers=h), 405, None),
            (httpx.get(url + "/metrics"), 401, None),
            (httpx.post(url + "/v1/completions", content=b"x" * (5 * 2**20), headers=h), 413, None),
        ]
        for response, status, param in cases:
            assert response.status_code == status, response.text
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"]
            if param is not None:
                assert error["param"] == param, error
        with pytest.raises(openai.AuthenticationError):
            client(url, "wrong").models.list()
        r = client(url, "secret").chat.completions.create(model="x", messages=ok["messages"], max_tokens=4)
        assert r.choices[0].message.role == "assistant"
        assert httpx.get(url + "/health").json()["status"] == "ok"


@pytest.mark.export
def test_concurrent_clients_sharing_a_prefix_get_their_answers_in_half_the_calls(model):
    docs = [f"{DOCUMENT}\n\nQuestion: {q}\nAnswer:" for q in QUESTIONS]
    assert len(model.encode(DOCUMENT)) >= 200
    # requests sent at once arrive within 0.2 s on a loaded machine too: they start as one batch
    with no_eos(model), serving(model, prompt_cache_bytes=0, batching="always", gather_seconds=0.2) as url:
        c = client(url)
        start = model.calls
        sequential = [c.completions.create(model="x", prompt=d, max_tokens=12, temperature=0).choices[0].text
                      for d in docs]
        sequential_calls = model.calls - start
        answers: list = [None] * len(docs)

        def ask(i):
            answers[i] = c.completions.create(model="x", prompt=docs[i], max_tokens=12, temperature=0).choices[0].text
        start = model.calls
        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(docs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        concurrent_calls = model.calls - start
        m = metrics(url)
    assert answers == sequential
    assert concurrent_calls <= sequential_calls / 2, (concurrent_calls, sequential_calls)
    assert m["llama_ane_cascade_batches_total"] >= 1


@pytest.mark.export
def test_prompt_cache_prefills_only_the_new_tokens(model, tmp_path):
    doc_ids = model.encode(DOCUMENT)
    with serving(model, prompt_cache_dir=tmp_path) as url:
        c = client(url)
        first = c.completions.create(model="x", prompt=DOCUMENT + " Question: who?", max_tokens=4, temperature=0)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        second = c.completions.create(model="x", prompt=DOCUMENT + " Question: what?", max_tokens=4, temperature=0)
        shared = len(os.path.commonprefix([model.encode(DOCUMENT + " Question: who?"),
                                           model.encode(DOCUMENT + " Question: what?")]))
        assert second.usage.prompt_tokens_details.cached_tokens == shared >= len(doc_ids) - 1

        turn1 = [{"role": "user", "content": "Hello there."}]
        r1 = c.chat.completions.create(model="x", messages=turn1, max_tokens=6, temperature=0)
        # the answer as text that tokenizes back to the same tokens after the template's "assistant\n"
        turn2 = turn1 + [{"role": "assistant", "content": "Sure."}, {"role": "user", "content": "And then?"}]
        r2 = c.chat.completions.create(model="x", messages=turn2, max_tokens=6, temperature=0)
        assert r2.usage.prompt_tokens_details.cached_tokens >= r1.usage.prompt_tokens
        assert metrics(url)["llama_ane_cached_prompt_tokens_total"] >= shared + r1.usage.prompt_tokens


@pytest.mark.export
def test_prompt_cache_spills_to_disk_and_reads_back(model, tmp_path):
    with serving(model, prompt_cache_bytes=1, prompt_cache_dir=tmp_path) as url:  # every entry goes to disk
        c = client(url)
        c.completions.create(model="x", prompt=DOCUMENT, max_tokens=2, temperature=0)
    assert list(tmp_path.glob("*.npz"))  # after the server stopped: the worker caches after answering
    with serving(model, prompt_cache_dir=tmp_path) as url:  # a new server indexes the folder
        r = client(url).completions.create(model="x", prompt=DOCUMENT + " More.", max_tokens=2, temperature=0)
        assert r.usage.prompt_tokens_details.cached_tokens >= len(model.encode(DOCUMENT)) - 1


@pytest.mark.export
def test_disconnect_mid_stream_frees_the_request(model):
    with no_eos(model), serving(model) as url:
        body = {"prompt": DOCUMENT, "max_tokens": 60, "temperature": 0, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")  # the answer has started: then the client goes away
        c = client(url)
        r = c.completions.create(model="x", prompt="The quick", max_tokens=8, temperature=0)
        assert r.choices[0].text == model.generate("The quick", max_new_tokens=8, raw=True).text
        deadline = time.monotonic() + 30
        while metrics(url)["llama_ane_requests_cancelled_total"] < 1:
            assert time.monotonic() < deadline, "the disconnected request was never cancelled"
            time.sleep(0.1)


@pytest.mark.export
def test_burst_is_served_or_refused_cleanly(model):
    """100 requests at once: each is answered or refused with 429, the server then stands idle and
    healthy, and its memory (PSS, the server runs in this process) is within 20% of before."""
    import gc

    import psutil

    def pss() -> int:
        gc.collect()
        return psutil.Process().memory_full_info().pss

    with serving(model, max_queue=8) as url:
        for i in range(2):  # warm: the first requests build what every later one reuses
            httpx.post(url + "/v1/completions", json={"prompt": f"Warm {i}", "max_tokens": 2}, timeout=120)
        before = pss()
        results: list = []

        def ask(i):
            try:
                r = httpx.post(url + "/v1/completions", json={"prompt": f"Burst {i}", "max_tokens": 2}, timeout=120)
                results.append((r.status_code, r.json()))
            except Exception as e:  # noqa: BLE001 - any transport failure is a failure of the test
                results.append((None, repr(e)))
        t0 = time.monotonic()
        threads = [threading.Thread(target=ask, args=(i,)) for i in range(100)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        elapsed = time.monotonic() - t0
        assert len(results) == 100 and elapsed < 120
        statuses = [s for s, _ in results]
        assert set(statuses) <= {200, 429}, results
        assert statuses.count(200) >= 8
        assert all(body["error"]["code"] == "queue_full" for s, body in results if s == 429)
        assert httpx.get(url + "/health").json() == {"status": "ok", "waiting": 0, "running": 0}
        after = pss()
        assert after <= 1.2 * before, f"PSS {before / 2**20:.0f} MiB before the burst, {after / 2**20:.0f} MiB after"


@pytest.mark.export
def test_scheduler_without_http_batches_and_isolates_a_failing_request(model):
    """The scheduler alone: shared-prefix requests batch on the cascade with each one's greedy answer;
    a request whose grammar fails fails alone."""
    rng = np.random.default_rng(0)
    prefix = [int(t) for t in rng.integers(3, 300, 90)]
    own = [[int(t) for t in rng.integers(3, 300, k)] for k in (1, 4, 2, 6)]

    class Broken:
        def mask(self, logits):
            raise ValueError("broken grammar")

    with no_eos(model):
        alone = [model.generate(prefix + o, max_new_tokens=6).token_ids for o in own]
        scheduler = Scheduler(model, max_queue=8, batching="always")
        try:
            handles = scheduler.submit([Request(prefix + o, 6) for o in own] +
                                       [Request(prefix + own[0], 6, constraint=Broken())])
            ends = [list(h)[-1] for h in handles]
        finally:
            scheduler.close()
    assert [e.token_ids for e in ends[:4]] == alone
    assert all(isinstance(e, Finished) for e in ends[:4]) and "broken grammar" in ends[4].message
    assert scheduler.metrics.cascade_batches == 1 and scheduler.metrics.requests_failed == 1


@pytest.mark.export
@pytest.mark.parametrize("which", ["model", "decode_model"])
def test_a_request_joins_the_running_batch_only_in_its_turn(which, request):
    """A request continuing the running batch's prefix takes a free branch slot mid-batch; one queued
    behind a request that does not match waits its turn (first come, first served). Through the
    prefill window and with the cascade's function."""
    model = request.getfixturevalue(which)
    assert window_cascade(model.manifest) == (which == "model")
    rng = np.random.default_rng(2)
    prefix = [int(t) for t in rng.integers(3, 300, 80)]
    other = [int(t) for t in rng.integers(3, 300, 40)]
    prompts = [prefix + [11], prefix + [12, 13], prefix + [14], other, prefix + [15]]
    with no_eos(model):
        alone = [model.generate(ids, max_new_tokens=20).token_ids for ids in prompts]
        scheduler = Scheduler(model, batching="always")
        try:
            first = scheduler.submit([Request(ids, 20) for ids in prompts[:2]])
            events = iter(first[0])
            assert isinstance(next(events), Token)  # the batch is running
            joiner = scheduler.submit([Request(prompts[2], 20)])
            later = scheduler.submit([Request(ids, 20) for ids in prompts[3:]])
            ends = [list(h)[-1] for h in [*first[1:], *joiner, *later]] + [list(events)[-1]]
            batches, singles = scheduler.metrics.cascade_batches, scheduler.metrics.single_runs
        finally:
            scheduler.close()
    assert [e.token_ids for e in ends] == [alone[1], alone[2], alone[3], alone[4], alone[0]]
    assert ends[1].cached_tokens == len(prefix)  # it joined the batch: the prefix was there already
    assert (batches, singles) == (1, 2)  # the non-matching one and the one behind it ran alone, in order


@pytest.mark.export
@pytest.mark.parametrize("which", ["model", "decode_model"])
def test_a_branch_leaves_its_prompt_and_answer_in_the_prompt_cache(which, request):
    """The next turn of a conversation served as a branch prefills only its new tokens, and
    continuing from the branch's cached K/V gives the same answer as starting afresh (its columns of
    the one cache through the prefill window, its suffix cache with the cascade's function)."""
    model = request.getfixturevalue(which)
    from llama_ane.serve.prompt_cache import PromptCache

    rng = np.random.default_rng(3)
    prefix = [int(t) for t in rng.integers(3, 300, 75)]
    prompts = [prefix + [21, 22], prefix + [23]]
    with no_eos(model):
        scheduler = Scheduler(model, PromptCache(model.pipeline.new_cache, model.manifest, 2**30), batching="always")
        try:
            answers = [list(h)[-1] for h in scheduler.submit([Request(ids, 10) for ids in prompts])]
            assert scheduler.metrics.cascade_batches == 1
            while not scheduler.idle:  # else the next turn joins the batch as a branch over its prefix
                time.sleep(0.01)
            turn2 = prompts[0] + answers[0].token_ids + [31, 32]
            [end] = [list(h)[-1] for h in scheduler.submit([Request(turn2, 8)])]
        finally:
            scheduler.close()
        fresh = model.generate(turn2, max_new_tokens=8).token_ids
    assert end.cached_tokens == len(prompts[0]) + len(answers[0].token_ids) - 1  # all but its last answer token
    assert end.token_ids == fresh


@pytest.mark.export
def test_a_request_cancelled_while_waiting_never_runs(model):
    rng = np.random.default_rng(4)
    first, second = ([int(t) for t in rng.integers(3, 300, 30)] for _ in range(2))
    with no_eos(model):
        scheduler = Scheduler(model)
        try:
            [running] = scheduler.submit([Request(first, 30)])
            events = iter(running)
            assert isinstance(next(events), Token)
            [waiting] = scheduler.submit([Request(second, 5)])
            waiting.cancel()
            end = list(waiting)[-1]
            assert list(events)[-1].finish_reason == "length"
            assert scheduler.metrics.single_runs == 1
        finally:
            scheduler.close()
    assert end.finish_reason == "cancelled" and end.token_ids == []


@pytest.mark.export
def test_sampled_branch_equals_sampling_alone(model):
    """Sampling under a seed gives the same tokens in a batch as alone (its own generator)."""
    rng = np.random.default_rng(1)
    prefix = [int(t) for t in rng.integers(3, 300, 70)]
    params = SamplingParams(temperature=0.9, top_k=40)
    with no_eos(model):
        alone = [model.generate(prefix + [7 + i], max_new_tokens=8, temperature=0.9, top_k=40, seed=i).token_ids
                 for i in range(3)]
        scheduler = Scheduler(model, batching="always")
        try:
            handles = scheduler.submit([Request(prefix + [7 + i], 8, params, seed=i) for i in range(3)])
            got = [[e.token_id for e in h if isinstance(e, Token)] for h in handles]
        finally:
            scheduler.close()
    assert got == alone and scheduler.metrics.cascade_batches == 1


class FixedPrices(Prices):
    """Steps at set prices: a window 1 (one token) or 4 (more), a batch step `batch_step`."""

    prefill_length = 64

    def __init__(self, batch_step: float):
        self.batch_step = batch_step

    def window(self, tokens, filled):
        return 1.0 if tokens == 1 else 4.0

    def cascade(self, lanes, prefix):
        return self.batch_step


@pytest.mark.export
@pytest.mark.parametrize("batching, batch_step, batched", [("auto", 3.0, False), ("auto", 1.0, True),
                                                           ("never", 1.0, False), ("always", 3.0, True)])
def test_requests_sharing_a_prefix_batch_only_where_it_pays(model, batching, batch_step, batched):
    """Two requests over a 70-token prefix with 1 and 2 tokens of their own, 8 answer tokens each.
    Batched: the prefix's two windows (8), then 2 + 8 - 1 = 9 steps of `batch_step`; one after the
    other: the first's two windows (8), the second's own tokens in one window (4: the prefix it
    reuses from the prompt cache) and 7 + 7 decode steps of 1, 26 in all. So a step of 3 (35) is
    declined and a step of 1 (17) pays. Declined, they run one after the other, the second
    continuing from the prefix the first left; either way each gets the answer it gets alone."""
    from llama_ane.serve.prompt_cache import PromptCache

    rng = np.random.default_rng(5)
    prefix = [int(t) for t in rng.integers(3, 300, 70)]
    prompts = [prefix + [11], prefix + [12, 13]]
    with no_eos(model):
        alone = [model.generate(ids, max_new_tokens=8).token_ids for ids in prompts]
        scheduler = Scheduler(model, PromptCache(model.pipeline.new_cache, model.manifest, 2**30),
                              batching=batching, prices=FixedPrices(batch_step))
        try:
            ends = [list(h)[-1] for h in scheduler.submit([Request(ids, 8) for ids in prompts])]
        finally:
            scheduler.close()
    m = scheduler.metrics
    assert [e.token_ids for e in ends] == alone
    assert (m.cascade_batches, m.single_runs) == ((1, 0) if batched else (0, 2))
    assert m.batches_declined == (batching == "auto" and not batched)
    if not batched:
        assert ends[1].cached_tokens == len(prefix)  # the prefix was computed once


@pytest.mark.export
def test_torch_times_its_steps_and_runs_one_slot_per_request(model):
    """On torch the prices are the steps measured: a request alone times its prefill window and its
    decode steps; a batch of two through the prefill window runs two slots a step, not the
    exported width."""
    rng = np.random.default_rng(6)
    prefix = [int(t) for t in rng.integers(3, 300, 70)]
    with no_eos(model):
        scheduler = Scheduler(model, batching="always")
        try:
            list(scheduler.submit([Request(prefix, 4)])[0])
            assert scheduler.prices.window(1, 0) > 0 and scheduler.prices.window(64, 0) > 0
            assert scheduler.prices.measured(WINDOW, 2) is not None  # interpolated
            for h in scheduler.submit([Request(prefix + [11], 4), Request(prefix + [12], 4)]):
                list(h)
            seen = set(scheduler.prices._seen)
        finally:
            scheduler.close()
    assert model.manifest["branch_width"] == 8 and scheduler.metrics.cascade_batches == 1
    assert (BATCH, 2) in seen and (BATCH, 8) not in seen
    assert model.pipeline.run_window.__name__ == "run_window"  # closing the scheduler stops timing


@contextlib.contextmanager
def serve_command(export, *args):
    """`llama-ane serve` in a subprocess on 127.0.0.1 (a free port), once /health answers; yields
    (process, base URL). The process is killed if it is still running when the block ends."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    proc = subprocess.Popen([sys.executable, "-m", "llama_ane", "serve", str(export), "--port", str(port),
                             "--backend", "torch", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the server did not come up"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health").status_code == 200:
                    break
            time.sleep(0.2)
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


LONG = {"prompt": "Once upon a time", "max_tokens": 1000, "temperature": 0, "stream": True}


@pytest.fixture(scope="module")
def export_without_eos(export, tmp_path_factory):
    """The export with no end-of-sequence token: every answer runs to max_tokens (LONG: seconds)."""
    import shutil

    out = shutil.copytree(export, tmp_path_factory.mktemp("no-eos") / "tiny")
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["tokenizer"]["eos_token_ids"] = []
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


@pytest.mark.export
def test_serve_command_exits_cleanly_on_sigterm(export):
    with serve_command(export, "--max-tokens-limit", "100") as (proc, url):
        r = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 3})
        assert r.status_code == 200
        body = {"prompt": "Once upon a time", "max_tokens": 100, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("data: ")
            proc.send_signal(signal.SIGTERM)  # mid-answer: the answer in flight still ends properly
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]" and json.loads(rest[-2][6:])["choices"][0]["finish_reason"]
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "Traceback" not in err


@pytest.mark.export
def test_serve_command_says_what_it_does_and_logs_each_request(export):
    with serve_command(export) as (proc, url):
        r = httpx.post(url + "/v1/completions", json={"prompt": "The quick brown", "max_tokens": 3})
        usage = r.json()["usage"]
        assert httpx.get(url + "/v1/models").status_code == 200
        assert httpx.post(url + "/v1/completions", json={"max_tokens": 3}).status_code == 400
        proc.send_signal(signal.SIGINT)  # nothing open: it stops at once
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    lines = err.splitlines()
    assert lines[0].startswith("loading ") and lines[1].startswith("warming up ")
    assert lines[2].startswith(f"serving on {url} ")
    requests = [line for line in lines if line.startswith(("GET ", "POST "))]
    health = [line for line in requests if line.startswith("GET /health ")]
    assert len(health) >= 1 and len(requests) == len(health) + 3, err  # one line a request
    completion, models, bad = requests[len(health):]
    assert completion.startswith("POST /v1/completions 200 ")
    assert (f"prompt={usage['prompt_tokens']} cached={usage['prompt_tokens_details']['cached_tokens']} "
            f"completion={usage['completion_tokens']} ") in completion
    assert float(completion.split()[-1].rstrip("s")) > 0
    assert models.startswith("GET /v1/models 200 prompt=0 cached=0 completion=0 ")
    assert bad.startswith("POST /v1/completions 400 ")
    assert "stopping: finishing 0 open requests" in err and "Traceback" not in err


@pytest.mark.export
def test_first_ctrl_c_ends_open_streams_with_an_error_after_the_bound(export_without_eos):
    with serve_command(export_without_eos, "--shutdown-timeout", "1") as (proc, url):
        with httpx.stream("POST", url + "/v1/completions", json=LONG, timeout=60) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("data: ")
            t0 = time.monotonic()
            proc.send_signal(signal.SIGINT)
            rest = [line for line in lines if line]
            took = time.monotonic() - t0
        out, err = proc.communicate(timeout=60)
    assert rest[-1] == "data: [DONE]"
    error = json.loads(rest[-2][6:])["error"]
    assert error["code"] == "shutting_down" and error["type"] == "server_error" and error["message"]
    assert 0.9 < took < 10
    assert proc.returncode == 0, err
    assert "stopping: finishing 1 open requests (up to 1 s); Ctrl-C again to quit now" in err
    assert "Traceback" not in err
    assert [line for line in err.splitlines() if line.startswith("POST ")][-1].startswith("POST /v1/completions 200 ")


@pytest.mark.export
def test_second_ctrl_c_quits_at_once_with_130(export_without_eos):
    with serve_command(export_without_eos) as (proc, url):
        with httpx.stream("POST", url + "/v1/completions", json=LONG, timeout=60) as stream:
            assert next(stream.iter_lines()).startswith("data: ")
            proc.send_signal(signal.SIGINT)
            deadline = time.monotonic() + 30
            while "stopping:" not in (line := proc.stderr.readline()):
                assert line and time.monotonic() < deadline, "the first Ctrl-C was not acknowledged"
            t0 = time.monotonic()
            proc.send_signal(signal.SIGINT)
            out, err = proc.communicate(timeout=30)
            took = time.monotonic() - t0
    assert proc.returncode == 130, err
    assert took < 5 and "Traceback" not in err


# ---- unit tests: no export, no server ----------------------------------------------------------

def _fake_cache(context: int = 64):
    from llama_ane.runtime.kv_cache import KVCache

    return KVCache([], [{"k": np.zeros((2, 8, 1, context), np.float32), "v": np.zeros((2, 8, 1, context), np.float32)}])


def _filled(tokens: list[int]):
    cache = _fake_cache()
    cache.tokens = list(tokens)
    for c in cache.caches:
        for a in c.values():
            a[..., :len(tokens)] = np.asarray(tokens, np.float32)  # each position holds its token id
    return cache


def test_prompt_cache_finds_the_longest_shared_prefix_and_evicts_by_bytes():
    from llama_ane.serve.prompt_cache import PromptCache

    entry_bytes = lambda n: 2 * 2 * 8 * n * 4  # noqa: E731  k and v, (2, 8, 1, n) float32
    lru = PromptCache(_fake_cache, {"name": "fake"}, max_bytes=entry_bytes(10) + entry_bytes(7))
    lru.put(_filled([1, 2, 3, 4, 5, 6, 7, 8, 9, 10]))
    lru.put(_filled([1, 2, 3, 9, 9, 9]))
    cache, shared = lru.lookup([1, 2, 3, 4, 5, 0])
    assert shared == 5 and cache.tokens == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert (cache.caches[0]["k"][0, 0, 0, :10] == np.arange(1, 11)).all()  # a copy of the entry's K/V
    cache.caches[0]["k"][:] = -1  # the caller's working cache: the entry is not touched
    assert (lru.lookup([1, 2, 3, 4])[0].caches[0]["k"][0, 0, 0, :10] == np.arange(1, 11)).all()
    lru.put(_filled([1, 2, 3, 9, 9, 9, 4]))  # supersedes [1, 2, 3, 9, 9, 9]
    assert lru.entries == 2 and lru.bytes == entry_bytes(10) + entry_bytes(7)
    assert lru.lookup([1, 2, 3, 4])[1] == 4  # [1..10] was used last: [1, 2, 3, 9, 9, 9, 4] is evicted next
    lru.put(_filled([5, 5]))
    assert lru.entries == 2 and lru.lookup([1, 2, 3, 9])[1] == 3 and lru.bytes <= lru.max_bytes
    assert lru.lookup([7])[1] == 0 and lru.lookup([7])[0].tokens == []


def test_prompt_cache_keeps_rings_and_carried_states_whole():
    """A conv state (the last K-1 inputs) and a recurrent state have no token axis: an entry of fewer
    tokens than their last axis keeps them whole, as it keeps a ring."""
    from llama_ane.runtime.kv_cache import KVCache
    from llama_ane.serve.prompt_cache import PromptCache

    rng = np.random.default_rng(0)
    states = {"conv": rng.standard_normal((1, 6, 1, 3)), "delta": rng.standard_normal((1, 2, 4, 4)),
              "k_ring": rng.standard_normal((1, 8, 1, 16))}

    def new_cache():
        return KVCache([], [{"k": np.zeros((2, 8, 1, 64), np.float32),
                             **{name: np.zeros_like(a, np.float32) for name, a in states.items()}}])

    cache = new_cache()
    cache.tokens = [5, 6]  # fewer than every state's last axis
    for name, a in states.items():
        cache.caches[0][name][:] = a
    lru = PromptCache(new_cache, {"name": "fake"}, max_bytes=2**20)
    lru.put(cache)
    got, shared = lru.lookup([5, 6, 7])
    assert shared == 2
    for name, a in states.items():
        np.testing.assert_array_equal(got.caches[0][name], a.astype(np.float32), err_msg=name)


def test_request_bodies_are_checked_with_the_bad_field_named():
    from llama_ane.serve import protocol as p

    ok = {"messages": [{"role": "user", "content": "hi"}]}
    assert p.check_body(ok, p.CHAT_SCHEMA) is ok
    for body, param in [({**ok, "top_p": 0}, "top_p"), ({**ok, "n": 0}, "n"), ({**ok, "stop": ["a"] * 5}, "stop"),
                        ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
                        ({**ok, "top_logprobs": 21}, "top_logprobs")]:
        with pytest.raises(p.RequestError) as e:
            p.check_body(body, p.CHAT_SCHEMA)
        assert e.value.param == param and e.value.status == 400


def test_tool_calls_are_read_back_as_the_mode_says():
    from llama_ane.serve import protocol as p

    tools = {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}
    auto, schema = p.tool_mode(tools)
    assert auto.parse and schema is None
    content, calls = p.tool_calls('Let me look. <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>', auto)
    assert content == "Let me look." and [c["function"] for c in calls] == [{"name": "f", "arguments": '{"x": 1}'}]
    assert p.tool_calls("<tool_call>{broken</tool_call>", auto) == ("<tool_call>{broken</tool_call>", [])
    required, schema = p.tool_mode({**tools, "tool_choice": "required"})
    assert schema["anyOf"][0]["properties"]["name"] == {"const": "f"}
    assert p.tool_calls('{"name": "f", "arguments": {}}', required)[1][0]["function"]["name"] == "f"
    forced, schema = p.tool_mode({**tools, "tool_choice": {"type": "function", "function": {"name": "f"}}})
    assert schema == {"type": "object"}
    assert p.tool_calls('{"a": 2}', forced)[1][0]["function"]["arguments"] == '{"a": 2}'
    assert p.tool_mode({**tools, "tool_choice": "none"})[0] == p.ToolMode(names=["f"])


def test_json_constraint_masks_all_but_the_grammar(tmp_path):
    from transformers import AutoTokenizer

    from llama_ane.serve.constraints import GrammarError, Grammars
    from llama_ane.testing import make_tiny_tokenizer

    vocab = make_tiny_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    grammars = Grammars(tok, vocab, [tok.eos_token_id])
    schema = {"type": "object", "properties": {"pet": {"enum": ["cat", "dog"]}}, "required": ["pet"],
              "additionalProperties": False}
    constraint = grammars.matcher(grammars.json_schema(schema))
    rng = np.random.default_rng(0)
    out: list[int] = []
    while not constraint.complete:
        logits = constraint.mask(rng.normal(size=vocab).astype(np.float32))
        assert np.isfinite(logits).sum() >= 1
        token = int(np.argmax(logits))
        constraint.advance(token)
        out.append(token)
    assert json.loads(tok.decode(out))["pet"] in ("cat", "dog")
    with pytest.raises(GrammarError):
        grammars.json_schema({"type": "object", "properties": {"a": {"type": "nonsense"}}})


def test_serve_command_names_the_extra_it_needs(monkeypatch, tmp_path):
    from click.testing import CliRunner

    from llama_ane.cli import main

    monkeypatch.setitem(sys.modules, "uvicorn", None)  # as if it were not installed
    r = CliRunner().invoke(main, ["serve", str(tmp_path)])
    assert r.exit_code == 1 and "pip install 'llama-ane[serve]'" in r.output and "Traceback" not in r.output


def test_serve_command_refuses_bad_options_in_one_line(tmp_path):
    from click.testing import CliRunner

    from llama_ane.cli import main

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    for args, needle in [([str(tmp_path / "missing"), "--port", "0"], "missing"),
                         ([str(tmp_path), "--port", str(busy.getsockname()[1])], "--port"),
                         ([str(tmp_path), "--host", "256.0.0.1", "--port", "0"], "--host"),
                         ([str(tmp_path), "--prompt-cache-dir", str(tmp_path / "nope")], "--prompt-cache-dir"),
                         ([str(tmp_path), "--max-queue", "0"], "--max-queue"),
                         ([str(tmp_path), "--batching", "sometimes"], "--batching")]:
        r = CliRunner().invoke(main, ["serve", *args])
        assert r.exit_code != 0 and "Traceback" not in r.output
        assert needle in r.output, r.output
    busy.close()
