"""`llama_ane.load()` and the model object it returns: encoding, caches, scoring, and thin
`generate`/`stream`/`generate_branches` over runtime/generate.py and runtime/cascade.py."""

from __future__ import annotations

import platform
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

import numpy as np

from ..errors import InvalidArgumentError, LlamaANEError
from ..hub import resolve
from ..contract.manifest import model_names, read_manifest
from .backends.base import Backend
from .kv_cache import KVCache, load_cache, save_cache
from .cascade import CascadeDecoder, CascadeOutput
from .chat_template import template_errors
from .generate import (OVERFLOW, GenerationResult, TokenEvent, make_drafter, shift_limit, shifted,  # noqa: F401
                       stream_generate)  # GenerationResult, TokenEvent, shift_limit, shifted: importable from here too
from .pipeline import Pipeline
from .sampling import SamplingParams, SeededRandom

if TYPE_CHECKING:
    from .drafters import Drafter

BACKENDS = ("auto", "coreml", "torch", "mil", "coreai")


class TokenizerError(LlamaANEError, OSError):
    """An export's tokenizer files are missing or unreadable."""


def coreml_can_predict() -> bool:
    """Core ML predictions exist only on macOS."""
    if platform.system() != "Darwin":
        return False
    try:
        import coremltools  # noqa: F401
    except ImportError:
        return False
    return True


def make_backend(path: Path | None, manifest: dict, backend: str, **options) -> Backend:
    """Instantiate a backend by name ("auto" = coreai for a Core AI export, coreml on macOS, else torch)."""
    if backend not in BACKENDS:
        raise InvalidArgumentError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if backend == "auto" and path is not None and manifest.get("deployment_target") == "coreai":
        backend = "coreai"  # its assets run on Apple's runtime everywhere; the other backends read .mlpackage files
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
    if backend == "coreai":  # Core AI assets (--target coreai) through coreai-core's runtime
        from .backends.coreai_backend import CoreAIBackend
        return CoreAIBackend(path, manifest, **options)
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
    `layers_per_chunk`, `branch_width`, `suffix_length`, `verify_window`, `decode_function`.
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
                                                 "branch_width", "suffix_length", "verify_window", "decode_function")
                     if k in options}
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

    @property
    def has_chat_template(self) -> bool:
        """Whether the export records a chat template (string prompts are then wrapped by default)."""
        return bool(self.manifest["tokenizer"].get("chat_template"))

    def encode(self, text: str, chat: bool = False) -> list[int]:
        """Token ids of `text` as plain text; with `chat`, wrapped as one user turn by the recorded
        chat template and followed by the assistant's generation prompt (an export without a
        template refuses `chat=True`)."""
        if chat:
            if not self.has_chat_template:
                raise InvalidArgumentError("this model has no chat template: encode the text without chat=True")
            with template_errors():
                return list(self.tokenizer.apply_chat_template(
                    [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True,
                    return_dict=False))
        return list(self.tokenizer(text).input_ids)

    def prompt_ids(self, prompt: str | Sequence[int], raw: bool = False) -> list[int]:
        """The token ids `generate` and `stream` feed for `prompt`: a string is wrapped as one user
        turn by the chat template, unless `raw` or the export has no template; ids are used as given."""
        if not isinstance(prompt, str):
            return [int(t) for t in prompt]
        return self.encode(prompt, chat=not raw and self.has_chat_template)

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
               stop: Sequence[str] | None = None, raw: bool = False, cache: KVCache | None = None,
               overflow: str = "stop", keep: int = 0, speculative: "str | Drafter | None" = None,
               draft_tokens: int | None = None, min_p: float = 0.0,
               repetition_penalty: float = 1.0) -> Iterator[TokenEvent]:
        """Yield TokenEvents as tokens are generated; the final GenerationResult is `self.last_result`.

        A string `prompt` is one user turn: the export's chat template wraps it and the model writes
        the assistant's reply. `raw=True` feeds the string as plain text to continue (base models,
        completion); an export without a chat template always does. Token ids are fed as given.

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
        ids = self.prompt_ids(prompt, raw)
        rng = SeededRandom(seed)
        if speculative is not None:
            from .speculative import check_speculative
            check_speculative(self.manifest, draft_tokens)
        elif draft_tokens is not None:
            raise InvalidArgumentError("draft_tokens needs speculative decoding (speculative='lookup' or 'draft:OUT')")
        drafter, owned = (None, False) if speculative is None else make_drafter(
            speculative, self._open_draft, self.manifest["config"]["vocab_size"])
        try:
            self.last_result = yield from stream_generate(
                self.pipeline, self.tokenizer, self.eos_token_ids, ids, max_new_tokens, params, rng, stop, started,
                cache=cache, overflow=overflow, keep=keep, drafter=drafter, draft_tokens=draft_tokens)
        finally:
            if owned:
                drafter.close()

    def _open_draft(self, folder: str) -> "LlamaANEModel":
        """A draft export, on this model's backend (Core ML's own choice, "auto", for coreml)."""
        return load(folder, backend=self.backend.name if self.backend.name != "coreml" else "auto")

    def generate(self, prompt: str | Sequence[int], max_new_tokens: int = 128, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                 stop: Sequence[str] | None = None, raw: bool = False,
                 on_token: Callable[[TokenEvent], None] | None = None, cache: KVCache | None = None,
                 overflow: str = "stop", keep: int = 0, speculative: "str | Drafter | None" = None,
                 draft_tokens: int | None = None, min_p: float = 0.0,
                 repetition_penalty: float = 1.0) -> GenerationResult:
        """Generate up to `max_new_tokens`; `on_token` receives each TokenEvent as it is produced.
        A string `prompt` is wrapped by the chat template unless `raw=True`. `cache`, `overflow`,
        `keep`, `speculative`, `draft_tokens`, `min_p` and `repetition_penalty`: see `stream`."""
        for event in self.stream(prompt, max_new_tokens, temperature, top_k, top_p, seed, stop, raw,
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
                          min_p: float = 0.0, raw: bool = False) -> "CascadeOutput":
        """Decode several branches over one shared prefix with cascade attention.

        Give either `continuations` (each branch's own text or ids after the prefix, e.g. questions
        about a document; "" starts from the prefix itself) or `n` (n samples of the prefix).
        `on_token(branch_index, token_id, text_delta)` streams tokens as they come. Each branch
        decodes exactly as `generate(prefix + continuation, raw=raw)` would alone; the shared prefix
        is prefilled and stored once whatever the number of branches.

        The chat template applies as in `generate`: when `prefix` is a string, the export has a
        template and `raw` is False, each branch's whole text `prefix + continuation` is rendered as
        one user turn with the generation prompt, and the shared prefix is the longest common token
        prefix of those renderings (so write the separator yourself, e.g. `document + "\n\n"` and
        questions as continuations); with `n`, the prefix is rendered as one user turn. Otherwise
        the prefix and each continuation are tokenized as plain text. Ids are never wrapped, and
        ids among the continuations of a string prefix that would be wrapped are refused.

        With `teacher_forced`, nothing is sampled: each branch feeds its continuation and its
        `logits` hold float32 [vocab] after each continuation token (see `score_branches`).
        With `cache` (e.g. a loaded prompt cache of a document), the prefix reuses what it holds and
        the cache keeps the prefix afterwards (the branches' tokens live in their own suffix caches).
        """
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
        prefix_ids, own = self._branch_ids(prefix, continuations, n, raw)
        decoder = CascadeDecoder(self.pipeline, self.tokenizer, self.eos_token_ids)
        return decoder.run(prefix_ids, own, max_new_tokens, params, seed, stop, on_token, teacher_forced, cache)

    def _branch_ids(self, prefix, continuations, n, raw) -> tuple[list[int], list[list[int]]]:
        """The shared prefix's ids and each branch's own ids, by the rule in `generate_branches`."""
        wrap = isinstance(prefix, str) and not raw and self.has_chat_template
        if n is not None:
            return self.prompt_ids(prefix, raw=not wrap), [[] for _ in range(n)]
        if not wrap:
            prefix_ids = self.prompt_ids(prefix, raw=True)
            return prefix_ids, [list(self.tokenizer(c, add_special_tokens=False).input_ids) if isinstance(c, str)
                                else [int(t) for t in c] for c in continuations]
        if not all(isinstance(c, str) for c in continuations):
            raise InvalidArgumentError("token-id continuations cannot go into the chat template's user turn: give "
                                       "the prefix as token ids too, or pass raw=True")
        from .cascade import split_shared_prefix

        return split_shared_prefix([self.encode(prefix + c, chat=True) for c in continuations])

    def score_branches(self, prefix: Sequence[int], continuations: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """Teacher-forced cascade logits: for each branch, float32 [len(continuation), vocab], the
        logits after each of its tokens (compare with `score(prefix + continuation)[len(prefix):]`)."""
        out = self.generate_branches(prefix, continuations, teacher_forced=True)
        return [np.stack(r.logits) for r in out.branches]

    def close(self) -> None:
        self.pipeline.close()
        self.backend.close()
