"""The HTTP layer: a Starlette app with OpenAI's endpoints over one `Scheduler`.

    POST /v1/chat/completions   POST /v1/completions   GET /v1/models   GET /health   GET /metrics

Errors are OpenAI's body {"error": {"message", "type", "param", "code"}}: 400 for a malformed or
invalid request (a prompt past the context, max_tokens above the limit, a bad schema), 401 without
the API key (when one is set; /health needs none), 404/405 for other paths, 413 for a body over
the limit, 429 when the queue is full, 503 while shutting down. Streaming answers are server-sent
events in OpenAI's chunk format, ending with `data: [DONE]`; a client that disconnects cancels its
request.

Each finished request logs one line to the `llama_ane.serve.access` logger (INFO):

    POST /v1/chat/completions 200 prompt=41 cached=32 completion=16 0.84s

`Server.stop_serving(seconds)` starts a shutdown: new requests get 503, and answers still running
after `seconds` end with an error (a streamed one with an error event, then `data: [DONE]`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from typing import Any, AsyncIterator

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from ..errors import InvalidArgumentError, LlamaANEError
from ..runtime.sampling import SamplingParams, branch_seed
from . import protocol as p
from .constraints import Grammars
from .options import ServeOptions
from .prompt_cache import PromptCache
from .scheduler import Failed, Finished, Handle, QueueFullError, Request, Scheduler, ShuttingDownError, Token

log = logging.getLogger(__name__)
access_log = logging.getLogger("llama_ane.serve.access")
SHUTTING_DOWN = "shutting_down"
_USAGE = "llama_ane.usage"  # the scope key of a request's handles (see _RequestLog)


_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
          500: "server_error", 503: "server_error"}


def error(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(p.error_body(message, _TYPES.get(status, "invalid_request_error"), param, code), status)


class Server:
    """What the endpoints share: the model, its scheduler, the grammar compiler and the options."""

    def __init__(self, model, options: ServeOptions):
        self.model = model
        self.options = options
        self.name = options.model_name or model.manifest.get("name") or "llama-ane"
        self.context = model.pipeline.context_length
        self.scheduler: Scheduler | None = None
        self._grammars: Grammars | None = None
        self.started = int(time.time())
        self.loop: asyncio.AbstractEventLoop | None = None
        self.in_flight = 0  # HTTP requests being answered
        self.stopping = False  # a shutdown has begun: new requests are refused
        self._open: set[Handle] = set()  # the handles of answers in progress

    def start(self) -> None:
        o = self.options
        cache = None
        if o.prompt_cache_bytes > 0 or o.prompt_cache_dir is not None:
            cache = PromptCache(self.model.pipeline.new_cache, self.model.manifest, o.prompt_cache_bytes,
                                o.prompt_cache_dir)
        self.scheduler = Scheduler(self.model, cache, max_queue=o.max_queue, gather_seconds=o.gather_seconds,
                                   batching=o.batching)
        self.loop = asyncio.get_running_loop()

    def stop_serving(self, seconds: float) -> None:
        """Refuse new requests, and end the answers still running after `seconds` with a
        `shutting_down` error. Safe from any thread, or from a signal handler."""
        if self.loop is None or self.stopping:
            return
        self.stopping = True
        self.loop.call_soon_threadsafe(self.loop.call_later, seconds, self._cut, seconds)

    def _cut(self, seconds: float) -> None:
        for h in list(self._open):
            h.cancel()
            h._put(Failed(f"the server is shutting down: the answer was cut off after {seconds:g} s; send the "
                          "request again later", SHUTTING_DOWN))

    def stop(self) -> None:
        if self.scheduler is not None:
            self.scheduler.close(timeout=30)

    @property
    def grammars(self) -> Grammars:
        if self._grammars is None:
            m = self.model
            self._grammars = Grammars(m.tokenizer, m.manifest["config"]["vocab_size"], m.eos_token_ids)
        return self._grammars

    # ---- requests -------------------------------------------------------------------------

    async def body(self, request: HTTPRequest, schema: dict) -> dict:
        declared = request.headers.get("content-length")
        limit = self.options.max_body_bytes
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise p.RequestError(f"the request body has {declared} bytes, more than {limit}", None,
                                 "request_too_large", 413)
        data = bytearray()
        async for chunk in request.stream():
            data += chunk
            if len(data) > limit:
                raise p.RequestError(f"the request body is larger than {limit} bytes", None, "request_too_large", 413)
        try:
            body = json.loads(data)
        except ValueError as e:
            raise p.RequestError(f"the body is not valid JSON: {e}", None, "invalid_json") from None
        return p.check_body(body, schema)

    def check_prompt(self, ids: list[int], param: str) -> None:
        if len(ids) >= self.context:
            raise p.RequestError(f"the prompt has {len(ids)} tokens; the model's context holds {self.context} "
                                 "(prompt and answer together); shorten it", param, "context_length_exceeded")

    def sampling(self, body: dict, ids: list[int], top_logprobs: int | None) -> p.Sampling:
        limit = min(self.options.max_tokens_limit, self.context)
        s = p.sampling(body, max(1, min(limit, self.context - len(ids))), limit, top_logprobs)
        if len(ids) + s.max_tokens > self.context:
            raise p.RequestError(f"the prompt has {len(ids)} tokens and max_tokens is {s.max_tokens}: more than the "
                                 f"model's context of {self.context}; lower max_tokens", "max_tokens",
                                 "context_length_exceeded")
        return s

    def submit(self, request: HTTPRequest, prompts: list[list[int]], s: p.Sampling, grammar: str | None
               ) -> list[Handle]:
        if self.stopping:
            raise ShuttingDownError("the server is shutting down; send the request again later")
        params = SamplingParams(s.temperature, s.top_k, s.top_p)
        requests = []
        for ids in prompts:
            for i in range(s.n):
                seed = s.seed if s.seed is None or s.n == 1 else branch_seed(s.seed, i)
                requests.append(Request(ids, s.max_tokens, params, seed, s.stop, s.top_logprobs,
                                        None if grammar is None else self.grammars.matcher(grammar)))
        handles = self.scheduler.submit(requests)
        self._open.update(handles)
        usage = request.scope.get(_USAGE)
        if usage is not None:  # (handle, whether its prompt counts): n choices of a prompt count it once
            usage.extend((h, i % s.n == 0) for i, h in enumerate(handles))
        return handles

    def release(self, handles: list[Handle]) -> None:
        """Cancel what still runs of `handles` (the answer is over, or its client went away)."""
        for h in handles:
            h.cancel()
            self._open.discard(h)

    def render(self, body: dict) -> list[int]:
        """The chat's prompt token ids: its messages (and tools) through the chat template."""
        tok = self.model.tokenizer
        template = self.options.chat_template or self.model.manifest["tokenizer"].get("chat_template")
        if not template:
            raise p.RequestError("this model has no chat template: use /v1/completions, or start the server with "
                                 "--chat-template FILE", "messages")
        try:
            ids = tok.apply_chat_template(p.template_messages(body["messages"]), tools=body.get("tools") or None,
                                          add_generation_prompt=True, tokenize=True, return_dict=False,
                                          chat_template=template)
        except Exception as e:  # a template's own error (jinja raises several kinds) names what it lacks
            raise p.RequestError(f"the chat template cannot render these messages: {e}", "messages") from None
        return [int(t) for t in ids]

    def token_text(self, token: int) -> str:
        return self.model.tokenizer.decode([token])

    # ---- endpoints ------------------------------------------------------------------------

    async def chat(self, request: HTTPRequest) -> Response:
        body = await self.body(request, p.CHAT_SCHEMA)
        mode, schema = p.tool_mode(body)
        fmt = body.get("response_format") or {"type": "text"}
        constrained = schema is not None or fmt["type"] != "text"
        if schema is None and fmt["type"] == "json_schema":
            schema = (fmt.get("json_schema") or {}).get("schema") or {"type": "object"}
        if body.get("top_logprobs") is not None and not body.get("logprobs"):
            raise p.RequestError("top_logprobs needs logprobs: true", "top_logprobs")
        ids = self.render(body)
        self.check_prompt(ids, "messages")
        s = self.sampling(body, ids, (body.get("top_logprobs") or 0) if body.get("logprobs") else None)
        grammar = self.grammars.json_schema(schema) if constrained else None
        handles = self.submit(request, [ids], s, grammar)
        cid = p.completion_id("chatcmpl")
        if s.stream:
            return self.stream(request, handles, self._chat_chunks(cid, handles, s, mode))
        results = await self.collect(request, handles)
        if results is None:
            return Response(status_code=499)
        choices, used = [], [0, 0, 0]
        for i, (tokens, end) in enumerate(results):
            content, calls = p.tool_calls(end.text, mode)
            message = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = calls
            choices.append({"index": i, "message": message, "finish_reason": p.finish_reason(end.finish_reason, calls),
                            "logprobs": self._chat_logprobs(tokens) if s.top_logprobs is not None else None})
            self._count(used, end, first_of_prompt=i == 0)
        return JSONResponse(p.envelope(cid, "chat.completion", self.name, choices, p.usage(*used)))

    async def completions(self, request: HTTPRequest) -> Response:
        body = await self.body(request, p.COMPLETION_SCHEMA)
        prompt = body["prompt"]
        tok = self.model.tokenizer
        if isinstance(prompt, str):
            prompts = [list(tok(prompt).input_ids)]
        elif isinstance(prompt[0], int):
            prompts = [[int(t) for t in prompt]]
        else:
            prompts = [list(tok(text).input_ids) for text in prompt]
        for ids in prompts:
            self.check_prompt(ids, "prompt")
        s = self.sampling(body, max(prompts, key=len), body.get("logprobs"))
        if len(prompts) * s.n > p.N_MAX:
            raise p.RequestError(f"{len(prompts)} prompts x n={s.n} choices is more than {p.N_MAX}", "n")
        try:
            handles = self.submit(request, prompts, s, None)
        except InvalidArgumentError as e:
            raise p.RequestError(str(e), "prompt") from None
        cid = p.completion_id("cmpl")
        if s.stream:
            return self.stream(request, handles, self._completion_chunks(cid, handles, s))
        results = await self.collect(request, handles)
        if results is None:
            return Response(status_code=499)
        choices, used = [], [0, 0, 0]
        for i, (tokens, end) in enumerate(results):
            choices.append({"index": i, "text": end.text, "finish_reason": p.finish_reason(end.finish_reason, []),
                            "logprobs": self._completion_logprobs(tokens) if s.top_logprobs is not None else None})
            self._count(used, end, first_of_prompt=i % s.n == 0)
        return JSONResponse(p.envelope(cid, "text_completion", self.name, choices, p.usage(*used)))

    async def models(self, request: HTTPRequest) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": self.name, "object": "model", "created": self.started, "owned_by": "llama-ane"}]})

    async def health(self, request: HTTPRequest) -> Response:
        if self.scheduler is None or self.scheduler._closing or self.stopping:
            return error(503, "the server is not serving (starting or shutting down)")
        return JSONResponse({"status": "ok", "waiting": self.scheduler.waiting, "running": self.scheduler.running})

    async def metrics(self, request: HTTPRequest) -> Response:
        sched = self.scheduler
        lines = []
        for name, value in vars(sched.metrics).items():
            lines += [f"# TYPE llama_ane_{name}_total counter", f"llama_ane_{name}_total {value}"]
        gauges = {"queue_waiting": sched.waiting, "requests_running": sched.running,
                  "prompt_cache_bytes": sched.prompt_cache.bytes if sched.prompt_cache else 0,
                  "prompt_cache_entries": sched.prompt_cache.entries if sched.prompt_cache else 0,
                  "branch_width": sched.width}
        for name, value in gauges.items():
            lines += [f"# TYPE llama_ane_{name} gauge", f"llama_ane_{name} {value}"]
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    # ---- answers --------------------------------------------------------------------------

    @staticmethod
    def _count(used: list[int], end: Finished, first_of_prompt: bool = True) -> None:
        if first_of_prompt:  # n choices of one prompt: the prompt counts once, as OpenAI counts it
            used[0] += end.prompt_tokens
            used[2] += end.cached_tokens
        used[1] += len(end.token_ids)

    async def collect(self, request: HTTPRequest, handles: list[Handle]) -> list[tuple[list[Token], Finished]] | None:
        """Every handle's tokens and end; None if the client went away first (its requests are
        cancelled)."""
        async def one(h: Handle):
            tokens = []
            async for event in h:
                if isinstance(event, Failed):
                    raise _Failure(event.message, event.code)
                if isinstance(event, Finished):
                    return tokens, event
                tokens.append(event)
        task = asyncio.ensure_future(asyncio.gather(*(one(h) for h in handles)))
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=0.25)
                if done:
                    return task.result()
                if await request.is_disconnected():
                    return None
        finally:
            if not task.done():
                task.cancel()
            self.release(handles)

    def stream(self, request: HTTPRequest, handles: list[Handle], chunks: AsyncIterator[dict]) -> StreamingResponse:
        async def events():
            try:
                async for chunk in chunks:
                    yield f"data: {json.dumps(chunk)}\n\n"
            except _Failure as e:
                yield f"data: {json.dumps(p.error_body(str(e), 'server_error', None, e.code))}\n\n"
            finally:  # also when the client disconnects and the response is cancelled
                self.release(handles)
            yield "data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @staticmethod
    async def _merged(handles: list[Handle]) -> AsyncIterator[tuple[int, Token | Finished]]:
        """(choice index, event) from every handle as they come."""
        q: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, h: Handle):
            async for event in h:
                await q.put((i, event))
        tasks = [asyncio.ensure_future(pump(i, h)) for i, h in enumerate(handles)]
        try:
            for _ in range(sum(1 for _ in handles)):
                while True:
                    i, event = await q.get()
                    if isinstance(event, Failed):
                        raise _Failure(event.message, event.code)
                    yield i, event
                    if isinstance(event, Finished):
                        break
        finally:
            for t in tasks:
                t.cancel()

    async def _chat_chunks(self, cid: str, handles: list[Handle], s: p.Sampling, mode: p.ToolMode):
        def chunk(choices, usage_=None):
            return p.envelope(cid, "chat.completion.chunk", self.name, choices, usage_)
        buffered = mode.forced or mode.required or mode.parse  # tool calls are known only at the end
        for i in range(len(handles)):
            yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None}])
        used = [0, 0, 0]
        async for i, event in self._merged(handles):
            if isinstance(event, Token):
                if not buffered and (event.text or s.top_logprobs is not None):
                    lp = self._chat_logprobs([event]) if s.top_logprobs is not None else None
                    yield chunk([{"index": i, "delta": {"content": event.text}, "logprobs": lp,
                                  "finish_reason": None}])
                continue
            delta: dict[str, Any] = {}
            calls: list[dict] = []
            if buffered:
                content, calls = p.tool_calls(event.text, mode)
                delta = {"content": content} if not calls else {
                    "tool_calls": [{"index": k, **call} for k, call in enumerate(calls)]}
            yield chunk([{"index": i, "delta": delta, "logprobs": None,
                          "finish_reason": p.finish_reason(event.finish_reason, calls)}])
            self._count(used, event, first_of_prompt=i == 0)
        if s.include_usage:
            yield chunk([], p.usage(*used))

    async def _completion_chunks(self, cid: str, handles: list[Handle], s: p.Sampling):
        used = [0, 0, 0]
        async for i, event in self._merged(handles):
            if isinstance(event, Token):
                if event.text or s.top_logprobs is not None:
                    lp = self._completion_logprobs([event]) if s.top_logprobs is not None else None
                    yield p.envelope(cid, "text_completion", self.name,
                                     [{"index": i, "text": event.text, "logprobs": lp, "finish_reason": None}])
                continue
            self._count(used, event, first_of_prompt=i % s.n == 0)
            yield p.envelope(cid, "text_completion", self.name,
                             [{"index": i, "text": "", "logprobs": None,
                               "finish_reason": p.finish_reason(event.finish_reason, [])}])
        if s.include_usage:
            yield p.envelope(cid, "text_completion", self.name, [], p.usage(*used))

    def _entry(self, token: int, logprob: float) -> dict:
        text = self.token_text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def _chat_logprobs(self, tokens: list[Token]) -> dict:
        return {"content": [{**self._entry(t.token_id, t.logprob),
                             "top_logprobs": [self._entry(k, lp) for k, lp in t.top or []]} for t in tokens]}

    def _completion_logprobs(self, tokens: list[Token]) -> dict:
        offsets, at = [], 0
        for t in tokens:
            offsets.append(at)
            at += len(t.text)
        return {"tokens": [self.token_text(t.token_id) for t in tokens],
                "token_logprobs": [t.logprob for t in tokens],
                "top_logprobs": [{self.token_text(k): lp for k, lp in t.top or []} for t in tokens],
                "text_offset": offsets}


class _Failure(Exception):
    """A request's generation failed in the worker, or was cut off by a shutdown (the message says
    why; `code` is the error's code)."""

    def __init__(self, message: str, code: str):
        super().__init__(message)
        self.code = code


def _handlers(server: Server) -> dict:
    async def llama_error(request, e: LlamaANEError):
        if isinstance(e, p.RequestError):
            return error(e.status, str(e), e.param, e.code)
        if isinstance(e, QueueFullError):
            return error(429, str(e), None, "queue_full")
        if isinstance(e, ShuttingDownError):
            return error(503, str(e), None, SHUTTING_DOWN)
        return error(400, str(e), None, "invalid_value")

    async def http_error(request, e: HTTPException):
        return error(e.status_code, e.detail or "error", None, None)

    async def failure(request, e: _Failure):
        return error(503 if e.code == SHUTTING_DOWN else 500, str(e), None, e.code)

    async def unexpected(request, e: Exception):
        log.exception("unexpected error")
        return error(500, f"the server failed: {type(e).__name__}", None, None)
    return {LlamaANEError: llama_error, HTTPException: http_error, _Failure: failure, Exception: unexpected}


class _APIKey:
    """Refuses every request but /health without `Authorization: Bearer KEY` when a key is set
    (plain ASGI, so streamed answers and disconnects pass through untouched)."""

    def __init__(self, app, key: str | None):
        self.app, self.expected = app, None if not key else f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        if self.expected and scope["type"] == "http" and scope["path"] != "/health":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                response = error(401, "a valid API key is required: send 'Authorization: Bearer KEY'", None,
                                 "invalid_api_key")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _RequestLog:
    """Logs one line per HTTP request when its answer ends (plain ASGI, so it times a streamed
    answer to its last event): method, path, status, prompt and cached prompt tokens, completion
    tokens and seconds. The tokens are the request's choices' (a prompt counts once for its `n`
    choices; an answer cut short counts the tokens sent)."""

    def __init__(self, app, server: Server):
        self.app, self.server = app, server

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500  # unless a response starts
        scope[_USAGE] = usage = []
        t0 = time.perf_counter()

        answered = False

        async def sent(message):
            nonlocal status, answered
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body") and not answered:
                answered = True  # no longer open once its last bytes are handed over: a client may read
                self.server.in_flight -= 1  # them, and stop the server, before this task runs again
            await send(message)
        self.server.in_flight += 1
        try:
            await self.app(scope, receive, sent)
        finally:
            if not answered:
                self.server.in_flight -= 1
            prompt = cached = completion = 0
            for h, counts_prompt in usage:
                completion += h.tokens
                if counts_prompt:
                    end = h.end if isinstance(h.end, Finished) else None
                    prompt += end.prompt_tokens if end else len(h.request.prompt)
                    cached += end.cached_tokens if end else 0
            access_log.info("%s %s %d prompt=%d cached=%d completion=%d %.2fs", scope["method"], scope["path"],
                            status, prompt, cached, completion, time.perf_counter() - t0)


def create_app(model, options: ServeOptions | None = None) -> Starlette:
    """The app serving `model` (a loaded LlamaANEModel). Its scheduler starts with the app's
    lifespan and stops (waiting requests refused, running ones cancelled) when it ends."""
    server = Server(model, options or ServeOptions())

    @contextlib.asynccontextmanager
    async def lifespan(app):
        server.start()
        try:
            yield
        finally:
            await asyncio.get_running_loop().run_in_executor(None, server.stop)

    routes = [Route("/v1/chat/completions", server.chat, methods=["POST"]),
              Route("/v1/completions", server.completions, methods=["POST"]),
              Route("/v1/models", server.models, methods=["GET"]),
              Route("/health", server.health, methods=["GET"]),
              Route("/metrics", server.metrics, methods=["GET"])]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers=_handlers(server),
                    middleware=[Middleware(_RequestLog, server=server),
                                Middleware(_APIKey, key=server.options.api_key)])
    app.state.server = server
    return app


@contextlib.contextmanager
def serve_in_thread(app: Starlette, host: str = "127.0.0.1", port: int = 0, startup_seconds: float = 60.0):
    """Run `app` with uvicorn in a background thread (port 0: a free one) and yield its base URL;
    the server stops, its lifespan closing the scheduler, when the block ends. For notebooks,
    benchmarks and tests; `llama-ane serve` runs uvicorn in the main thread instead."""
    import socket
    import threading

    import uvicorn

    sock = socket.socket()
    sock.bind((host, port))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_seconds
    try:
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        yield f"http://{host}:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
