"""Generation as a step generator: `generate_step` prefills a prompt and yields token ids, one
decode step (plain) or verify window (speculative) at a time, shifting the context when it is full;
`stream_generate` turns those ids into text events and a `GenerationResult`.

The caller decides when to stop (EOS, a stop string, a token budget) simply by not asking for the
next token: closing the step generator rewinds the drafts a verify window cached past that point
and lets the cache updates land, so the cache holds exactly what plain decoding would have fed.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Generator, Iterator, Sequence

import numpy as np

from ..errors import InvalidArgumentError
from .kv_cache import KVCache
from .pipeline import ContextFullError, Pipeline
from .sampling import REPETITION_WINDOW, SamplingParams, SeededRandom, sample
from .text_stream import TextStream

if TYPE_CHECKING:
    from .drafters import Drafter
    from .speculative import SpeculativeDecoder

OVERFLOW = ("stop", "shift")


@dataclass
class TokenEvent:
    """One generated token and the text it completes (may be "" while a UTF-8 sequence is open)."""

    token_id: int
    text: str


@dataclass
class GenerationResult:
    token_ids: list[int]
    text: str
    prompt_tokens: int
    finish_reason: str  # one of sampling.FINISH_REASONS: "eos", "stop", "length", "context"
    prefill_seconds: float
    decode_seconds: float
    decoded_tokens: int = field(default=0)  # tokens that went through a decode step (timed by decode_seconds)
    reused_tokens: int = field(default=0)  # prompt tokens whose K/V the cache already held
    shifts: int = field(default=0)  # context shifts (overflow="shift")
    speculative: dict | None = field(default=None)  # SpeculativeStats.as_dict() of a speculative generation
    first_token_seconds: float = field(default=float("nan"))  # from the call to the first token (or the end)

    @property
    def prefilled_tokens(self) -> int:
        """Prompt tokens that were prefilled (not reused from the cache)."""
        return self.prompt_tokens - self.reused_tokens

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prefilled_tokens / self.prefill_seconds if self.prefill_seconds > 0 else float("nan")

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decoded_tokens / self.decode_seconds if self.decode_seconds > 0 else float("nan")


@dataclass
class StepStats:
    """What `generate_step` measured; filled in as it runs, complete once it has ended."""

    prompt_tokens: int = 0  # tokens of the prompt as fed (after a shift)
    reused_tokens: int = 0  # of those, tokens whose K/V the cache already held
    prefill_seconds: float = 0.0
    decode_started: float = 0.0  # time.perf_counter() when the prefill ended
    decoded_tokens: int = 0  # tokens that went through a decode step or a verify window
    shifts: int = 0
    speculative: dict | None = None  # SpeculativeStats.as_dict(), when a drafter was used


def shift_limit(context: int, keep: int) -> int:
    """Tokens a context shift keeps: the first `keep` and half of the context's other positions."""
    if not 0 <= keep <= context - 2:
        raise ContextFullError(f"cannot shift the context: keeping the first {keep} tokens leaves no room in "
                               f"{context}; keep fewer or re-export with a larger --context-length")
    return keep + (context - keep) // 2


def shifted(tokens: Sequence[int], keep: int, limit: int) -> list[int]:
    """Context shift: the first `keep` tokens (e.g. the system prompt) and the most recent
    `limit - keep` ones; `tokens` itself if it has at most `limit`."""
    tokens = list(tokens)
    if len(tokens) <= limit:
        return tokens
    return tokens[:keep] + tokens[len(tokens) - (limit - keep):]


def plain_steps(logits: np.ndarray, params: SamplingParams, rng: SeededRandom,
                advance: Callable[[int], np.ndarray | None], context: Sequence[int] = ()) -> Iterator[int]:
    """Plain decoding: sample a token, feed it (`advance`), repeat; ends when `advance` returns None.
    `context`: the prompt's ids, which the repetition penalty reads with the generated ones."""
    recent = list(context)[-REPETITION_WINDOW:] if params.repetition_penalty != 1.0 else None
    while True:
        token = sample(logits, params, rng, recent)
        if recent is not None:
            recent = (recent + [token])[-REPETITION_WINDOW:]
        yield token
        logits = advance(token)
        if logits is None:
            return


def generate_step(pipeline: Pipeline, prompt: Sequence[int], params: SamplingParams, rng: SeededRandom, *,
                  cache: KVCache | None = None, overflow: str = "stop", keep: int = 0,
                  drafter: "Drafter | None" = None, draft_tokens: int | None = None,
                  stats: StepStats | None = None) -> Iterator[int]:
    """Prefill `prompt` (continuing from `cache`, reusing the prefix it holds), then yield the
    generated token ids until the caller stops or the context is full (overflow "stop"); with
    overflow "shift" a full context keeps the first `keep` tokens and the most recent ones and goes
    on. With a `drafter`, tokens come from verified draft trees (runtime/speculative.py), the same
    tokens as without. `stats` (optional) receives the timings and counts."""
    stats = StepStats() if stats is None else stats
    pipeline.start(cache)
    context = pipeline.context_length
    fed = list(prompt)
    if overflow == "shift" and len(fed) > context - 1:
        fed, stats.shifts = shifted(fed, keep, shift_limit(context, keep)), 1
    t0 = time.perf_counter()
    logits, stats.reused_tokens = pipeline.extend(fed)
    stats.decode_started = time.perf_counter()
    stats.prefill_seconds, stats.prompt_tokens = stats.decode_started - t0, len(fed)

    def advance(token: int) -> np.ndarray | None:
        """Feed one token the plain way: the logits after it, or None at a full context (stop)."""
        if pipeline.position < context:
            stats.decoded_tokens += 1
            return pipeline.run_window([token])[0]
        if overflow == "stop":
            return None
        tokens = shifted(pipeline.cache.tokens + [token], keep, shift_limit(context, keep))
        stats.shifts += 1
        stats.decoded_tokens += 1
        return pipeline.extend(tokens)[0]

    decoder = None
    if drafter is not None:
        from .speculative import SpeculativeDecoder
        decoder = SpeculativeDecoder(pipeline, drafter, params, rng, advance, draft_tokens)
        source = decoder.tokens(logits, fed)
    else:
        source = plain_steps(logits, params, rng, advance, fed)
    try:
        yield from source
    except GeneratorExit:  # the caller has enough
        _finish(pipeline, decoder, stats)
        raise
    _finish(pipeline, decoder, stats)


def _finish(pipeline: Pipeline, decoder: "SpeculativeDecoder | None", stats: StepStats) -> None:
    """Rewind the accepted drafts the caller did not take (as if never fed), let the cache updates
    land, and count the tokens the verify windows kept."""
    if decoder is not None and decoder.unconsumed:
        pipeline.rewind(pipeline.position - decoder.unconsumed)
    pipeline.wait()
    if decoder is not None:
        st = decoder.stats
        stats.decoded_tokens += st.verify_steps + st.accepted_tokens - decoder.unconsumed
        stats.speculative = st.as_dict()


def stream_generate(pipeline: Pipeline, tokenizer, eos_token_ids: Sequence[int], prompt: Sequence[int],
                    max_new_tokens: int, params: SamplingParams, rng: SeededRandom,
                    stop: Sequence[str] | None = None, started: float | None = None,
                    **step_options) -> Generator[TokenEvent, None, GenerationResult]:
    """Yield a TokenEvent per generated token until EOS, a stop string, `max_new_tokens` or a full
    context; return (as the generator's value) the GenerationResult. `started` is when the call
    began (time to the first token counts from it); `step_options` go to `generate_step`."""
    started = time.perf_counter() if started is None else started
    stats = StepStats()
    text = TextStream(tokenizer, stop or [])
    eos = set(eos_token_ids)
    reason, first_token = "context", None
    with contextlib.closing(generate_step(pipeline, prompt, params, rng, stats=stats, **step_options)) as steps:
        for token in steps:
            if first_token is None:
                first_token = time.perf_counter() - started
            if token in eos:
                reason = "eos"
                break
            yield TokenEvent(token, text.push(token))
            if text.stopped:
                reason = "stop"
                break
            if len(text.token_ids) >= max_new_tokens:
                reason = "length"
                break
    end = time.perf_counter()
    return GenerationResult(text.token_ids, text.text, stats.prompt_tokens, reason, stats.prefill_seconds,
                            end - stats.decode_started, decoded_tokens=stats.decoded_tokens,
                            reused_tokens=stats.reused_tokens, shifts=stats.shifts, speculative=stats.speculative,
                            first_token_seconds=first_token if first_token is not None else end - started)


def make_drafter(speculative: "str | Drafter | None", open_export: Callable[[str], object],
                 vocab_size: int) -> tuple["Drafter | None", bool]:
    """The drafter `speculative` names ("lookup", "draft:OUT" or a Drafter) and whether the caller
    owns it (closes it after). `open_export(OUT)` loads a draft export."""
    from .drafters import ModelDrafter, PromptLookupDrafter

    if speculative is None:
        return None, False
    if not isinstance(speculative, str):
        return speculative, False
    if speculative == "lookup":
        return PromptLookupDrafter(), False
    if speculative.startswith("draft:"):
        folder = speculative.removeprefix("draft:")
        draft = open_export(folder)
        if draft.manifest["config"]["vocab_size"] != vocab_size:
            draft.close()
            raise InvalidArgumentError(f"the draft export {folder} has another vocabulary "
                                       f"({draft.manifest['config']['vocab_size']} tokens, this model {vocab_size}); "
                                       "a drafter must share the tokenizer")
        return ModelDrafter(draft), True
    raise InvalidArgumentError(f"--speculative must be 'lookup' or 'draft:OUT' (an export folder), got {speculative!r}")
