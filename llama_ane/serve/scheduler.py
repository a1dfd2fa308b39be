"""Serving many requests on one model: shared prefixes decode together as cascade branches.

One worker thread drives the model; requests arrive from any thread (or an asyncio loop) through a
bounded FIFO queue, and each one's tokens come back as events on its own `Handle`.

How the worker picks what to run, each time it is free:

* the oldest waiting request (the head) and every other waiting request that shares a token prefix
  with it form a batch, the prefix chosen so that the most of them fit (then the longest); up to
  the export's branch width run as branches over that prefix (cascade attention, `CascadeDecoder`):
  the prefix is prefilled once (reusing the prompt cache), each branch feeds its own tokens one per
  step, then samples. The batch runs only where it pays (`batching` "auto", the default): where
  pricing.py prices it below the same requests one after the other on the backend in use (by the
  device model on Core ML and Core AI, by the step times measured here elsewhere); else the head
  runs alone, and the others after it reuse the prefix it leaves in the prompt cache. Through the
  prefill window on torch, where a step computes only its rows, the batch has one branch slot per
  request; elsewhere the exported width. While the batch runs, a waiting request takes a freed
  branch slot if its prompt starts with the batch's prefix and nothing older than it waits (first
  come, first served);
* a request with nothing to share (or that would not fit a branch: its own tokens longer than a
  prefill window, or with its answer past the suffix length, or, where the branches step through
  the prefill window, past the context the batch's steps leave), and every request on an export
  without branch functions, runs alone through the plain pipeline, continuing from the prompt
  cache's longest matching entry.

What a request leaves in the prompt cache: its prompt and answer (a branch's prefix K/V joined with
its suffix), so the next turn of a conversation prefills only its new tokens; and a batch's prefix.

Each request samples with its own generator (its seed), so its output does not depend on what it
ran beside: greedy tokens equal the ones it gives alone (fp32), samples come from the same
distribution. A failing batch fails its own requests only; a cancelled request (a client gone)
frees its branch at the next step.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import AsyncIterator, Iterator, Sequence

import numpy as np

from ..errors import InvalidArgumentError, LlamaANEError
from ..runtime.cascade import CascadeDecoder, WindowSteps
from ..runtime.kv_cache import KVCache, common_prefix
from ..runtime.sampling import SamplingParams, SeededRandom, sample
from ..runtime.text_stream import TextStream
from .constraints import Constraint
from .pricing import BATCH, WINDOW, Group, Prices, check_batching, prices_for
from .prompt_cache import PromptCache

log = logging.getLogger(__name__)


class QueueFullError(LlamaANEError):
    """The queue of waiting requests is full; try again later."""


class ShuttingDownError(LlamaANEError):
    """The scheduler is closing and takes no new requests."""


@dataclass
class Request:
    """One generation: prompt token ids, its budget and how to sample.

    `top_logprobs`: None for no log-probabilities, else how many alternatives to report per token.
    `constraint`: a grammar matcher of this request alone (see constraints.py).
    """

    prompt: list[int]
    max_tokens: int
    params: SamplingParams = field(default_factory=SamplingParams)
    seed: int | None = None
    stop: Sequence[str] = ()
    top_logprobs: int | None = None
    constraint: Constraint | None = None


@dataclass
class Token:
    token_id: int
    text: str  # the text this token completes ("" while a character is open, or past a stop)
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None  # (token id, logprob), most likely first


@dataclass
class Finished:
    finish_reason: str  # sampling.FINISH_REASONS, or "cancelled"
    text: str
    token_ids: list[int]
    prompt_tokens: int
    cached_tokens: int  # prompt tokens whose K/V were reused, not computed for this request


@dataclass
class Failed:
    message: str
    code: str = "generation_failed"  # "shutting_down": the server stopped before the answer ended


class Handle:
    """A submitted request's events (`Token`..., then one `Finished` or `Failed`): iterate it from
    a thread, or `async for` it on the loop it was submitted from."""

    def __init__(self, request: Request):
        self.request = request
        self.cancelled = False
        self.tokens = 0  # the Token events taken so far
        self.end: Finished | Failed | None = None  # the last event, once taken
        try:
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
            self._events: asyncio.Queue | queue.Queue = asyncio.Queue()
        except RuntimeError:
            self._loop, self._events = None, queue.Queue()

    def _put(self, event) -> None:
        if self._loop is None:
            self._events.put(event)
            return
        try:
            self._loop.call_soon_threadsafe(self._events.put_nowait, event)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def _took(self, event) -> None:
        if isinstance(event, Token):
            self.tokens += 1
        else:
            self.end = event

    def cancel(self) -> None:
        """Stop generating for this request (its branch frees at the next step)."""
        self.cancelled = True

    def __iter__(self) -> Iterator[Token | Finished | Failed]:
        while True:
            event = self._events.get()
            self._took(event)
            yield event
            if not isinstance(event, Token):
                return

    async def __aiter__(self) -> AsyncIterator[Token | Finished | Failed]:
        while True:
            event = await self._events.get()
            self._took(event)
            yield event
            if not isinstance(event, Token):
                return


@dataclass
class Metrics:
    """Counters since start (read by /metrics)."""

    requests: int = 0
    requests_refused: int = 0
    requests_failed: int = 0
    requests_cancelled: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    completion_tokens: int = 0
    prefilled_tokens: int = 0  # prompt tokens computed (prefill windows and branch-fed tokens)
    model_calls: int = 0
    cascade_steps: int = 0
    cascade_batches: int = 0
    batches_declined: int = 0  # shared-prefix requests run one after the other: a batch would cost more
    single_runs: int = 0


def log_softmax(logits: np.ndarray) -> np.ndarray:
    z = np.asarray(logits, np.float64)
    finite = np.isfinite(z)
    m = z[finite].max()
    out = np.full(z.shape, -np.inf)
    out[finite] = z[finite] - m - np.log(np.exp(z[finite] - m).sum())
    return out


class _Job:
    """A request being served: its sampler, text and (in a batch) branch state."""

    def __init__(self, handle: Handle, tokenizer, eos: set[int]):
        self.handle = handle
        self.request = handle.request
        self.ids = list(self.request.prompt)
        self.rng = SeededRandom(self.request.seed)
        self.text = TextStream(tokenizer, self.request.stop)
        self.eos = eos
        self.own: list[int] = []  # tokens still to feed as a branch
        self.cached = 0  # tokens in its branch's suffix cache
        self.cached_tokens = 0
        self.done = False
        self.failed = False

    def pick(self, logits: np.ndarray) -> tuple[int, float | None, list[tuple[int, float]] | None]:
        """Draw the next token from logits [vocab] (masked by the request's grammar)."""
        r = self.request
        if r.constraint is not None:
            logits = r.constraint.mask(logits)
        token = sample(logits, r.params, self.rng)
        if r.top_logprobs is None:
            return token, None, None
        lp = log_softmax(logits)
        k = min(r.top_logprobs, lp.size)
        top = np.argsort(-lp, kind="stable")[:k]
        return token, float(lp[token]), [(int(t), float(lp[t])) for t in top]

    def take(self, token: int, logprob, top) -> bool:
        """Record a drawn token; finish on end-of-sequence, a stop string, a complete grammar or the
        token budget. Returns whether the job is done."""
        r = self.request
        if token in self.eos:
            return self.finish("eos")
        if r.constraint is not None:
            r.constraint.advance(token)
        self.handle._put(Token(token, self.text.push(token), logprob, top))
        if self.text.stopped:
            return self.finish("stop")
        if r.constraint is not None and r.constraint.complete:
            return self.finish("eos")
        if len(self.text.token_ids) >= r.max_tokens:
            return self.finish("length")
        return False

    def finish(self, reason: str) -> bool:
        self.done = True
        self.handle._put(Finished(reason, self.text.text, list(self.text.token_ids), len(self.ids),
                                  self.cached_tokens))
        return True

    def fail(self, message: str) -> None:
        if not self.done:
            self.done = self.failed = True
            self.handle._put(Failed(message))


class Scheduler:
    """Serves `Request`s on `model` (a loaded `LlamaANEModel`) from one worker thread.

    `max_queue`: waiting requests at most (`submit` refuses more with QueueFullError);
    `gather_seconds`: how long the worker waits, when it picks up work, for requests sent at the
    same moment to arrive, so they can share a batch; `batching`: "auto" (batch where it pays, by
    `prices`, default the backend's: pricing.prices_for), "always" or "never".
    """

    def __init__(self, model, prompt_cache: PromptCache | None = None, max_queue: int = 64,
                 gather_seconds: float = 0.01, batching: str = "auto", prices: Prices | None = None):
        if max_queue < 1:
            raise InvalidArgumentError(f"the queue must hold at least one request, got {max_queue}")
        self.batching = check_batching(batching)
        self.model = model
        self.pipeline = model.pipeline
        self.manifest = model.manifest
        self.context = self.pipeline.context_length
        self.tokenizer = model.tokenizer
        self.eos = set(model.eos_token_ids)
        self.decoder = CascadeDecoder(self.pipeline, self.tokenizer, model.eos_token_ids) \
            if self.manifest.get("branch_width") else None
        self.width = self.decoder.width if self.decoder else 0
        self._steps = 0  # the running batch's steps so far (through the prefill window, its columns used)
        self._lanes = self.width  # the running batch's branch slots
        self.prompt_cache = prompt_cache
        self.max_queue = max_queue
        self.gather_seconds = gather_seconds
        self.metrics = Metrics()
        self.prices = prices or prices_for(model.backend, self.manifest)
        self._waiting: deque[_Job] = deque()
        self._running: list[_Job] = []
        self._cv = threading.Condition()
        self._closing = False
        self._count_calls(model.backend)
        self._time_steps(self.pipeline)
        self._thread = threading.Thread(target=self._run, name="llama-ane-serve", daemon=True)
        self._thread.start()

    def _count_calls(self, backend) -> None:
        predict = backend.predict

        def counted(*args, **kwargs):
            self.metrics.model_calls += 1
            return predict(*args, **kwargs)
        backend.predict = counted
        self._uncount = lambda: setattr(backend, "predict", predict) if backend.predict is counted else None

    def _time_steps(self, pipeline) -> None:
        """Time every window of the pipeline the worker runs (prefill windows and decode steps), by
        its tokens, for the measured prices (a batch's steps are timed in `_run_batch`)."""
        run_window = pipeline.run_window

        def timed(token_ids):
            t0 = time.perf_counter()
            out = run_window(token_ids)
            self.prices.observe(WINDOW, len(token_ids), time.perf_counter() - t0)
            return out
        pipeline.run_window = timed
        self._untime = lambda: setattr(pipeline, "run_window", run_window) if pipeline.run_window is timed else None

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def idle(self) -> bool:
        """Nothing waits and nothing runs (the last batch has also finished its bookkeeping)."""
        with self._cv:
            return not self._waiting and not self._running

    @property
    def running(self) -> int:
        return sum(not job.done for job in self._running)

    def check(self, request: Request) -> None:
        """Refuse a request that could never run: an empty prompt, ids outside the vocabulary, or a
        prompt and answer longer than the context."""
        vocab = self.manifest["config"]["vocab_size"]
        n = len(request.prompt)
        if n == 0:
            raise InvalidArgumentError("the prompt is empty; give some text")
        if any(not 0 <= t < vocab for t in request.prompt):
            raise InvalidArgumentError(f"the prompt holds token ids outside the vocabulary (0..{vocab - 1})")
        if request.max_tokens < 1:
            raise InvalidArgumentError(f"max_tokens must be at least 1, got {request.max_tokens}")
        if n + request.max_tokens > self.context:
            raise InvalidArgumentError(
                f"the prompt has {n} tokens and max_tokens is {request.max_tokens}: together more than the model's "
                f"context of {self.context}; shorten the prompt or lower max_tokens")

    def submit(self, requests: Sequence[Request]) -> list[Handle]:
        """Queue `requests` (all or none) and return their handles, in order."""
        for r in requests:
            self.check(r)
        handles = [Handle(r) for r in requests]
        with self._cv:
            if self._closing:
                raise ShuttingDownError("the server is shutting down; send the request again later")
            if len(self._waiting) + len(handles) > self.max_queue:
                self.metrics.requests_refused += len(handles)
                raise QueueFullError(f"{len(self._waiting)} requests are waiting (at most {self.max_queue}); "
                                     "send it again later")
            self._waiting.extend(_Job(h, self.tokenizer, self.eos) for h in handles)
            self.metrics.requests += len(handles)
            self._cv.notify()
        return handles

    def close(self, timeout: float | None = None) -> None:
        """Stop: waiting requests fail, running ones are cancelled; returns when the worker exits."""
        with self._cv:
            self._closing = True
            while self._waiting:
                self._waiting.popleft().fail("the server is shutting down")
            for job in self._running:
                job.handle.cancel()
            self._cv.notify()
        self._thread.join(timeout)
        self._uncount()
        self._untime()

    # ---- the worker -------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._waiting and not self._closing:
                    self._cv.wait()
                if self._closing:
                    return
            time.sleep(self.gather_seconds)
            with self._cv:
                self._drop_cancelled()
                if not self._waiting:
                    continue
                prefix, jobs = self._plan()
                self._running = list(jobs)
            try:
                if prefix:
                    self._run_batch(prefix, jobs)
                else:
                    self._run_alone(jobs[0])
            except Exception as e:  # the batch's requests fail; the server goes on
                log.exception("a batch failed")
                message = str(e) if isinstance(e, LlamaANEError) else f"the model failed: {type(e).__name__}: {e}"
                for job in self._running:
                    if not job.done:
                        self.metrics.requests_failed += 1
                    job.fail(message)
                self.pipeline.reset()
            finally:
                with self._cv:
                    self._running = []

    def _drop_cancelled(self) -> None:
        """Forget waiting requests whose client has gone (under the lock)."""
        for job in [job for job in self._waiting if job.handle.cancelled]:
            self._waiting.remove(job)
            self.metrics.requests_cancelled += 1
            job.finish("cancelled")

    def _fits(self, job: _Job, prefix: int, lanes: int) -> bool:
        """Whether `job` can run as a branch over its first `prefix` tokens: it feeds at least one
        token of its own and at most a prefill window of them (more would cost more steps than
        prefilling), and its own tokens and answer fit a branch's suffix cache (through the prefill
        window: the context after the batch's steps so far, each step a column per one of `lanes`
        branch slots, `CascadeDecoder.fits`)."""
        own = len(job.ids) - prefix
        return 1 <= own <= self.pipeline.prefill_length and self.decoder.fits(prefix, self._steps,
                                                                              own + job.request.max_tokens, lanes)

    def _joins(self, job: _Job, prefix: list[int]) -> bool:
        n = len(prefix)
        return job.ids[:n] == prefix and self._fits(job, n, self._lanes)

    def _plan(self) -> tuple[list[int], list[_Job]]:
        """Take the next work off the queue: (shared prefix, its branches) or ([], [the head alone])."""
        head, others = self._waiting[0], list(self._waiting)[1:]
        best: tuple[int, list[_Job]] = (0, [head])
        if self.decoder is not None and others and self.batching != "never":
            lengths = {min(common_prefix(head.ids, r.ids), len(head.ids) - 1) for r in others}
            for n in sorted(lengths, reverse=True):
                if n < 1 or not self._fits(head, n, 2):
                    continue
                group = [head] + [r for r in others if r.ids[:n] == head.ids[:n] and self._fits(r, n, 2)]
                group = group[:self.width]
                # through the prefill window a batch has a slot per branch it starts with, each step a
                # column per slot: fewer branches leave more context to each
                while len(group) > 1 and not all(self._fits(j, n, len(group)) for j in group):
                    group.pop()
                if len(group) > len(best[1]):
                    best = (n, group)
        n, jobs = best
        if len(jobs) > 1 and not self._pays(head.ids[:n], jobs):
            self.metrics.batches_declined += 1
            n, jobs = 0, [head]
        for job in jobs:
            self._waiting.remove(job)
        return (head.ids[:n] if len(jobs) > 1 else []), jobs

    def _pays(self, prefix: list[int], jobs: list[_Job]) -> bool:
        """Whether `jobs` should run as one batch over `prefix` (`batching`, pricing.py)."""
        if self.batching != "auto":
            return self.batching == "always"
        n = len(prefix)
        cached = self.prompt_cache.shared(prefix) if self.prompt_cache is not None else 0
        return self.prices.batch_pays(Group(n, [len(j.ids) - n for j in jobs], [j.request.max_tokens for j in jobs],
                                            self._lanes_for(jobs, n), min(cached, n - 1),
                                            reused=self.prompt_cache is not None))

    def _lanes_for(self, jobs: list[_Job], prefix: int) -> int:
        """The branch slots of a batch of `jobs` over `prefix` tokens: the exported width, or through
        the prefill window as many as leave its branches the context they need (at least one per
        branch it starts with; the rest take requests that join), and on torch, whose window computes
        only its rows, one per request."""
        if not self.decoder.in_window:
            return self.width
        top = len(jobs) if self.pipeline.direct else self.width
        return next(n for n in range(top, len(jobs) - 1, -1) if all(self._fits(job, prefix, n) for job in jobs))

    def _start(self, tokens: list[int]) -> tuple[np.ndarray, int]:
        """Make the pipeline hold `tokens` (from the prompt cache's best entry if any): the logits
        after them and the tokens reused."""
        cache = self.prompt_cache.lookup(tokens)[0] if self.prompt_cache is not None else None
        self.pipeline.start(cache)
        logits, reused = self.pipeline.extend(tokens)
        self.metrics.prefilled_tokens += len(tokens) - reused
        return logits, reused

    def _remember(self) -> None:
        self.pipeline.wait()
        if self.prompt_cache is not None:
            self.model.backend.sync_states()
            self.prompt_cache.put(self.pipeline.cache)

    def _finished(self, job: _Job) -> None:
        m = self.metrics
        m.prompt_tokens += len(job.ids)
        m.cached_prompt_tokens += job.cached_tokens
        m.completion_tokens += len(job.text.token_ids)

    def _run_alone(self, job: _Job) -> None:
        self.metrics.single_runs += 1
        logits, job.cached_tokens = self._start(job.ids)
        while not job.done:
            if job.handle.cancelled:
                self.metrics.requests_cancelled += 1
                job.finish("cancelled")
                break
            if self._advance(job, logits):
                break
            token = job.text.token_ids[-1]
            if self.pipeline.position >= self.context:
                job.finish("context")
                break
            logits = self.pipeline.run_window([token])[0]
        self._finished(job)
        self._remember()

    def _advance(self, job: _Job, logits: np.ndarray) -> bool:
        """Draw and record `job`'s next token; whether it is done. What fails here (its grammar, its
        text) belongs to this request alone: it fails, the others go on."""
        try:
            return job.take(*job.pick(logits))
        except Exception as e:
            log.exception("a request failed")
            self.metrics.requests_failed += 1
            job.fail(f"generating failed: {type(e).__name__}: {e}")
            return True

    def _seat(self, job: _Job, prefix: int, cached_tokens: int) -> None:
        job.own, job.cached, job.cached_tokens = job.ids[prefix:], 0, cached_tokens
        self.metrics.prefilled_tokens += len(job.own)

    def _keep_branch(self, job: _Job, slot: int, prefix: list[int], suffixes: "list[dict] | WindowSteps") -> None:
        """Cache a finished branch's whole sequence (the prefix, its own tokens and its answer) as
        one entry, so its next turn prefills only what is new, as after a plain run: the prefix's
        K/V and the branch's suffix slot, (layers*G, B, D, U) -> (layers, G*D, 1, n), or through the
        prefill window its slot's columns of the one cache (`CascadeDecoder.branch_columns`)."""
        if self.prompt_cache is None or job.failed or self.pipeline.ring:  # a branch's ring is not rebuilt
            return
        self.pipeline.wait()
        self.model.backend.sync_states()
        fed = job.cached  # tokens in the branch's suffix: its own, then all but its last answer token
        tokens = prefix + (job.ids[len(prefix):] + job.text.token_ids)[:fed]
        caches = []
        window = isinstance(suffixes, WindowSteps)
        columns = self.decoder.branch_columns(len(prefix), suffixes.steps, slot, fed, self._lanes) if window else None
        for i, held in enumerate(self.pipeline.cache.caches):
            entry = {}
            for name in (n for n in ("k", "v") if n in held):
                if window:
                    own = held[name][..., columns]
                else:
                    own = suffixes[i][name][:, slot, :, :fed]
                    own = own.reshape(held[name].shape[0], held[name].shape[1], 1, fed)
                entry[name] = np.concatenate([held[name][..., :len(prefix)], own.astype(held[name].dtype)], axis=-1)
            caches.append(entry)
        self.prompt_cache.put(KVCache(tokens, caches))

    def _admit(self, slots: list[_Job | None], prefix: list[int]) -> None:
        """Seat waiting requests that continue `prefix` in free slots, oldest first, stopping at the
        first one that does not (it runs next, after this batch)."""
        with self._cv:
            self._drop_cancelled()
            while None in slots and self._waiting and not self._closing and self._joins(self._waiting[0], prefix):
                job = self._waiting.popleft()
                self._seat(job, len(prefix), len(prefix))
                slots[slots.index(None)] = job
                self._running.append(job)

    def _run_batch(self, prefix: list[int], jobs: list[_Job]) -> None:
        decoder = self.decoder
        self.metrics.cascade_batches += 1
        _, reused = self._start(prefix)
        self._remember()
        suffixes = decoder.new_state()
        self._steps = 0
        self._lanes = self._lanes_for(jobs, len(prefix))
        slots: list[_Job | None] = [None] * self._lanes
        for j, job in enumerate(jobs):
            self._seat(job, len(prefix), reused)
            slots[j] = job
        while True:
            self._admit(slots, prefix)
            for j, job in enumerate(slots):
                if job is not None and job.handle.cancelled:
                    self.metrics.requests_cancelled += 1
                    job.finish("cancelled")
                    self._finished(job)
                    slots[j] = None
            active = [j for j, job in enumerate(slots) if job is not None]
            if not active:
                break
            tokens = np.zeros(len(slots), np.int32)
            cached = np.zeros(len(slots), np.int32)
            for j in active:
                tokens[j], cached[j] = slots[j].own[0], slots[j].cached
            t0 = time.perf_counter()
            logits = decoder.step(tokens, cached, len(prefix), suffixes)
            self.prices.observe(BATCH, len(slots), time.perf_counter() - t0)
            self._steps += 1
            self.metrics.cascade_steps += 1
            for j in active:
                job = slots[j]
                job.own.pop(0)
                job.cached += 1
                if job.own:
                    continue
                if self._advance(job, logits[j]):
                    self._finished(job)
                    self._keep_branch(job, j, prefix, suffixes)
                    slots[j] = None
                else:
                    job.own.append(job.text.token_ids[-1])
        self.pipeline.wait()
        self._steps, self._lanes = 0, self.width
