"""`llama_ane.load()` and the model object it returns: scoring and streaming generation."""

from __future__ import annotations

import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

import numpy as np

from ..errors import InvalidArgumentError, LlamaANEError
from ..hub import resolve
from ..contract.manifest import model_names, read_manifest
from .backends.base import Backend
from .kv_cache import KVCache, load_cache, save_cache
from .pipeline import ContextFullError, Pipeline
from .sampling import REPETITION_WINDOW, SamplingParams, SeededRandom, branch_seed, sample
from .text_stream import TextStream

if TYPE_CHECKING:
    from .drafters import Drafter

BACKENDS = ("auto", "coreml", "torch", "mil")


class TokenizerError(LlamaANEError, OSError):
    """An export's tokenizer files are missing or unreadable."""

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


def _plain_tokens(logits: np.ndarray, params: SamplingParams, rng: SeededRandom,
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


def coreml_can_predict() -> bool:
    """Core ML predictions exist only on macOS."""
    if platform.system() != "Darwin":
        return False
    try:
        import coremltools  # noqa: F401
    except ImportError:
        return False
    return True


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


def make_backend(path: Path | None, manifest: dict, backend: str, **options) -> Backend:
    """Instantiate a backend by name ("auto" = coreml on macOS, else torch)."""
    if backend not in BACKENDS:
        raise InvalidArgumentError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if backend == "auto":
        backend = "coreml" if coreml_can_predict() and path is not None else "torch"
    if backend == "coreml" and options.get("precision") is not None:
        raise InvalidArgumentError("precision (--precision) sets the torch and mil backends' compute precision; Core ML "
                                   "(the backend on macOS by default) runs the export in its own: drop --precision, "
                                   "or choose --backend torch or mil")
    if backend == "torch":
        from .backends.torch_backend import TorchBackend
        # fp16 matmuls on a CPU are emulated and slow: compute in fp32 there unless asked otherwise
        on_cpu = str(options.get("device", "cpu")).startswith("cpu")
        options.setdefault("precision", "fp32" if on_cpu else manifest.get("precision", "fp32"))
        return TorchBackend(path, manifest, **options)
    if path is None:
        raise InvalidArgumentError(f"the {backend} backend runs exported packages: pass an export folder")
    if backend == "coreml":
        from .backends.coreml_backend import CoreMLBackend
        return CoreMLBackend(path, manifest, **options)
    from .backends.mil_backend import MilBackend
    return MilBackend(path, manifest, **options)


def load(path: str | Path, backend: str = "auto", revision: str | None = None, **options) -> "LlamaANEModel":
    """Load an export folder, or a Hugging Face repo id (`owner/name`, at `revision`) holding one
    (fetched into the Hub's cache); with the torch backend also a checkpoint (folder, repo id or
    .gguf) or "default".

    A path is made absolute and the tokenizer is read now, from the folder alone, so nothing later
    (a change of working directory included) reaches the network. options go to the backend:
    `precision` ("fp32"|"fp16") and `device` for torch, `compute_units` for coreml, `precision`
    for mil. Export options, for a checkpoint: `context_length`, `prefill_length`,
    `layers_per_chunk`, `branch_width`, `suffix_length`, `verify_window`.
    """
    if str(path) == "default" and revision is not None:
        raise InvalidArgumentError(f"revision {revision} applies to a Hugging Face repo id, not the embedded default "
                                   "model; drop it")
    p = resolve(path, revision) if str(path) != "default" else None
    if p is not None and (p / "manifest.json").is_file():
        manifest = read_manifest(p)
        folder = p
    else:
        if backend not in ("auto", "torch"):
            raise InvalidArgumentError(f"{path} is not an export folder (no manifest.json); only the torch backend runs "
                             "a checkpoint directly: export it first with `llama-ane export`")
        from ..contract.plan import describe_checkpoint
        ckpt_opts = {k: options.pop(k) for k in ("context_length", "prefill_length", "layers_per_chunk",
                                                 "branch_width", "suffix_length", "verify_window") if k in options}
        manifest, checkpoint, folder = describe_checkpoint(p, **ckpt_opts)
        options["checkpoint"] = checkpoint
        backend = "torch"
    return LlamaANEModel(folder, manifest, make_backend(p, manifest, backend, **options))


def load_tokenizer(folder: Path):
    """The tokenizer saved in `folder`, read from there alone: a folder never becomes a Hub request."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as e:  # transformers raises OSError, ValueError or its own errors for a missing or bad file
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise TokenizerError(f"the tokenizer in {folder} cannot be read ({first}); copy the export's tokenizer files "
                             "(tokenizer.json, tokenizer_config.json) back or export again") from None


@dataclass
class CascadeOutput:
    """What `generate_branches` returns: one result per branch, in order, and the run's accounting."""

    branches: list
    stats: object


class LlamaANEModel:
    """A loaded export: `score` for teacher-forced logits, `generate`/`stream` for text."""

    def __init__(self, folder: Path | None, manifest: dict, backend: Backend):
        self.folder = folder
        self.manifest = manifest
        self.backend = backend
        self.pipeline = Pipeline(backend, manifest)
        self._tokenizer = load_tokenizer(folder)

    @property
    def tokenizer(self):
        return self._tokenizer

    @property
    def eos_token_ids(self) -> list[int]:
        return list(self.manifest["tokenizer"]["eos_token_ids"])

    def encode(self, text: str, chat: bool = False) -> list[int]:
        """Token ids of `text`; with `chat`, wrapped as one user turn by the recorded chat template."""
        if chat:
            if not self.manifest["tokenizer"].get("chat_template"):
                raise InvalidArgumentError("this model has no chat template; drop --chat")
            from .chat import template_errors

            with template_errors():
                return list(self.tokenizer.apply_chat_template(
                    [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True,
                    return_dict=False))
        return list(self.tokenizer(text).input_ids)

    def make_cache(self) -> KVCache:
        """An empty cache to pass to `generate(..., cache=)`: generation continues from what it holds,
        prefilling only the part of each prompt it does not hold yet."""
        return self.pipeline.new_cache()

    def save_cache(self, cache: KVCache, path: str | Path) -> Path:
        """Write `cache` to a prompt-cache file (tied to this export) and return its path."""
        self.pipeline.wait()  # the cache's pending updates land first
        self.backend.sync_states()  # and states held by the backend are copied into its arrays
        return save_cache(cache, self.manifest, path)

    def load_cache(self, path: str | Path) -> KVCache:
        """Read a prompt-cache file written by `save_cache` for this export (another export's is refused)."""
        return load_cache(path, self.manifest, self.pipeline.new_cache())

    def prepare(self) -> None:
        """Load every model now rather than at the first step (keeps loading out of the timings)."""
        self.backend.prepare(model_names(self.manifest))

    def score(self, token_ids: Sequence[int]) -> np.ndarray:
        """Teacher-forced logits, float32 [T, vocab], through the chunked prefill + cache-update path."""
        self.pipeline.reset()
        logits = self.pipeline.prefill(token_ids, all_logits=True)
        self.pipeline.wait()
        return logits

    def stream(self, prompt: str | Sequence[int], max_new_tokens: int = 128, temperature: float = 0.0,
               top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
               stop: Sequence[str] | None = None, chat: bool = False, cache: KVCache | None = None,
               overflow: str = "stop", keep: int = 0, speculative: "str | Drafter | None" = None,
               draft_tokens: int | None = None, min_p: float = 0.0,
               repetition_penalty: float = 1.0) -> Iterator[TokenEvent]:
        """Yield TokenEvents as tokens are generated; the final GenerationResult is `self.last_result`.

        `cache` (from `make_cache` or `load_cache`): continue from it; the longest common prefix of
        the prompt with its tokens is reused and only the rest is prefilled; it then holds the prompt
        and the generated tokens. `overflow`: at a full context, "stop" (finish_reason "context") or
        "shift": keep the first `keep` tokens and the most recent ones, re-prefill them, go on.
        `speculative`: "lookup" (prompt lookup), "draft:OUT" (a smaller export drafts) or a Drafter:
        token trees of up to `draft_tokens` drafts verified in one window each, with the same output
        as without (greedy: the same tokens; sampling: the same distribution); the result's
        `speculative` holds tokens per verify step and the acceptance rate. `min_p` and
        `repetition_penalty`: see `sampling` (the penalty is not combined with `speculative`).
        """
        started = time.perf_counter()
        params = SamplingParams(temperature, top_k, top_p, min_p, repetition_penalty)
        if speculative is not None and repetition_penalty != 1.0:
            raise InvalidArgumentError("a repetition penalty cannot be combined with speculative decoding; drop one")
        if max_new_tokens < 1:
            raise InvalidArgumentError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        if overflow not in OVERFLOW:
            raise InvalidArgumentError(f"overflow must be one of {', '.join(OVERFLOW)}, got {overflow!r}")
        ids = self.encode(prompt, chat) if isinstance(prompt, str) else [int(t) for t in prompt]
        rng = SeededRandom(seed)
        if speculative is not None:
            from .speculative import check_speculative
            check_speculative(self.manifest, draft_tokens)
        elif draft_tokens is not None:
            raise InvalidArgumentError("draft_tokens needs speculative decoding (speculative='lookup' or 'draft:OUT')")
        drafter, owned = self._drafter(speculative)
        try:
            yield from self._stream(ids, max_new_tokens, params, rng, stop, cache, overflow, keep, drafter,
                                    draft_tokens, started)
        finally:
            if owned:
                drafter.close()

    def _stream(self, ids, max_new_tokens, params, rng, stop, cache, overflow, keep, drafter, draft_tokens,
                started):
        self.pipeline.start(cache)
        context = self.pipeline.context_length
        shifts = 0
        fed = ids
        if overflow == "shift" and len(ids) > context - 1:
            fed, shifts = shifted(ids, keep, shift_limit(context, keep)), 1
        t0 = time.perf_counter()
        logits, reused = self.pipeline.extend(fed)
        t1 = time.perf_counter()

        fed_one = 0  # tokens fed one at a time after the prompt

        def advance(token: int) -> np.ndarray | None:
            """Feed one token the plain way: the logits after it, or None at a full context (stop)."""
            nonlocal shifts, fed_one
            if self.pipeline.position < context:
                fed_one += 1
                return self.pipeline.run_window([token])[0]
            if overflow == "stop":
                return None
            tokens = shifted(self.pipeline.cache.tokens + [token], keep, shift_limit(context, keep))
            shifts += 1
            fed_one += 1
            return self.pipeline.extend(tokens)[0]

        decoder = None
        if drafter is not None:
            from .speculative import SpeculativeDecoder
            decoder = SpeculativeDecoder(self.pipeline, drafter, params, rng, advance, draft_tokens)
            source = decoder.tokens(logits, fed)
        else:
            source = _plain_tokens(logits, params, rng, advance, fed)
        text = TextStream(self.tokenizer, stop or [])
        reason = "context"
        decode_start = time.perf_counter()
        first_token = None
        for token in source:
            if first_token is None:
                first_token = time.perf_counter() - started
            if token in self.eos_token_ids:
                reason = "eos"
                break
            yield TokenEvent(token, text.push(token))
            if text.stopped:
                reason = "stop"
                break
            if len(text.token_ids) >= max_new_tokens:
                reason = "length"
                break
        if decoder is not None and decoder.unconsumed:  # accepted drafts past the end: as if never fed
            self.pipeline.rewind(self.pipeline.position - decoder.unconsumed)
        self.pipeline.wait()
        t2 = time.perf_counter()
        steps, spec = fed_one, None
        if decoder is not None:  # and the tokens the verify windows kept
            st = decoder.stats
            steps += st.verify_steps + st.accepted_tokens - decoder.unconsumed
            spec = st.as_dict()
        self.last_result = GenerationResult(text.token_ids, text.text, len(fed), reason, t1 - t0,
                                            t2 - decode_start, decoded_tokens=steps, reused_tokens=reused,
                                            shifts=shifts, speculative=spec,
                                            first_token_seconds=first_token if first_token is not None else
                                            time.perf_counter() - started)

    def _drafter(self, speculative) -> tuple[object | None, bool]:
        """The drafter named by `speculative` and whether this call owns it (closes it after)."""
        from .drafters import ModelDrafter, PromptLookupDrafter

        if speculative is None:
            return None, False
        if not isinstance(speculative, str):
            return speculative, False
        if speculative == "lookup":
            return PromptLookupDrafter(), False
        if speculative.startswith("draft:"):
            folder = speculative.removeprefix("draft:")
            draft = load(folder, backend=self.backend.name if self.backend.name != "coreml" else "auto")
            if draft.manifest["config"]["vocab_size"] != self.manifest["config"]["vocab_size"]:
                draft.close()
                raise InvalidArgumentError(f"the draft export {folder} has another vocabulary "
                                 f"({draft.manifest['config']['vocab_size']} tokens, this model "
                                 f"{self.manifest['config']['vocab_size']}); a drafter must share the tokenizer")
            return ModelDrafter(draft), True
        raise InvalidArgumentError(f"--speculative must be 'lookup' or 'draft:OUT' (an export folder), got {speculative!r}")

    def generate(self, prompt: str | Sequence[int], max_new_tokens: int = 128, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                 stop: Sequence[str] | None = None, chat: bool = False,
                 on_token: Callable[[TokenEvent], None] | None = None, cache: KVCache | None = None,
                 overflow: str = "stop", keep: int = 0, speculative: "str | Drafter | None" = None,
                 draft_tokens: int | None = None, min_p: float = 0.0,
                 repetition_penalty: float = 1.0) -> GenerationResult:
        """Generate up to `max_new_tokens`; `on_token` receives each TokenEvent as it is produced.
        `cache`, `overflow`, `keep`, `speculative`, `draft_tokens`, `min_p` and `repetition_penalty`:
        see `stream`."""
        for event in self.stream(prompt, max_new_tokens, temperature, top_k, top_p, seed, stop, chat,
                                 cache=cache, overflow=overflow, keep=keep, speculative=speculative,
                                 draft_tokens=draft_tokens, min_p=min_p, repetition_penalty=repetition_penalty):
            if on_token is not None:
                on_token(event)
        return self.last_result

    def generate_branches(self, prefix: str | Sequence[int], continuations: Sequence[str | Sequence[int]] | None = None,
                          n: int | None = None, max_new_tokens: int = 64, temperature: float = 0.0, top_k: int = 0,
                          top_p: float = 1.0, seed: int | None = None, stop: Sequence[str] | None = None,
                          on_token: Callable[[int, int, str], None] | None = None,
                          teacher_forced: bool = False, cache: KVCache | None = None,
                          min_p: float = 0.0) -> "CascadeOutput":
        """Decode several branches over one shared prefix with cascade attention.

        Give either `continuations` (each branch's own text or ids after the prefix, e.g. questions
        about a document; "" starts from the prefix itself) or `n` (n samples of the prefix).
        `on_token(branch_index, token_id, text_delta)` streams tokens as they come. Each branch
        decodes exactly as `prefix + continuation` would alone; the prefix is prefilled and stored
        once whatever the number of branches.

        With `teacher_forced`, nothing is sampled: each branch feeds its continuation and its
        `logits` hold float32 [vocab] after each continuation token (see `score_branches`).
        With `cache` (e.g. a loaded prompt cache of a document), the prefix reuses what it holds and
        the cache keeps the prefix afterwards (the branches' tokens live in their own suffix caches).
        """
        from .cascade import BranchResult, CascadeDecoder, CascadeStats, _Branch, prefix_bytes_per_step

        if (continuations is None) == (n is None):
            raise InvalidArgumentError("give either continuations=[...] or n=N")
        if n is not None and n < 1:
            raise InvalidArgumentError(f"n must be at least 1, got {n}")
        if continuations is not None and len(continuations) == 0:
            raise InvalidArgumentError("the list of continuations (questions) is empty")
        if teacher_forced:
            max_new_tokens = 0
        elif max_new_tokens < 1:
            raise InvalidArgumentError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        params = SamplingParams(temperature, top_k, top_p, min_p)
        prefix_ids = self.encode(prefix) if isinstance(prefix, str) else [int(t) for t in prefix]
        own = [[] for _ in range(n)] if n is not None else [
            list(self.tokenizer(c, add_special_tokens=False).input_ids) if isinstance(c, str) else [int(t) for t in c]
            for c in continuations]
        decoder = CascadeDecoder(self.pipeline, self.tokenizer, self.eos_token_ids)
        try:
            decoder.check_budget(len(prefix_ids), [len(o) for o in own], max_new_tokens)
            self.pipeline.start(cache)
            t0 = time.perf_counter()
            first, reused = self.pipeline.extend(prefix_ids)
            self.pipeline.wait()
            t1 = time.perf_counter()
            results = [BranchResult(i, ids) for i, ids in enumerate(own)]
            steps = 0
            for start in range(0, len(results), decoder.width):
                group = [_Branch(r, SeededRandom(None if seed is None else branch_seed(seed, r.index)), first,
                                 TextStream(self.tokenizer, stop or []))
                         for r in results[start:start + decoder.width]]
                steps += decoder.run_group(group, len(prefix_ids), max_new_tokens, params, on_token,
                                           record_logits=teacher_forced)
            t2 = time.perf_counter()
        finally:
            decoder.close()
        per_step = prefix_bytes_per_step(self.manifest, len(prefix_ids), self.backend.dtype.itemsize)
        stats = CascadeStats(len(prefix_ids), len(results), steps, sum(len(r.token_ids) for r in results),
                             t1 - t0, t2 - t1, per_step, per_step * min(len(results), decoder.width),
                             reused_tokens=reused)
        return CascadeOutput(results, stats)

    def score_branches(self, prefix: Sequence[int], continuations: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """Teacher-forced cascade logits: for each branch, float32 [len(continuation), vocab], the
        logits after each of its tokens (compare with `score(prefix + continuation)[len(prefix):]`)."""
        out = self.generate_branches(prefix, continuations, teacher_forced=True)
        return [np.stack(r.logits) for r in out.branches]

    def close(self) -> None:
        self.pipeline.close()
        self.backend.close()
