"""Grammar-constrained decoding with llguidance: a JSON schema compiled once per request, one
matcher per branch, and the token mask applied to the logits on the host before sampling.

The mask only touches logits, so it works the same on every backend and in every branch of a
cascade. llguidance computes the set of allowed tokens from the tokenizer's byte strings; its
matcher stops once the grammar is complete (then only end-of-sequence is allowed).
"""

from __future__ import annotations

import json
from typing import Sequence

import numpy as np

from ..errors import InvalidArgumentError

#: compact JSON: no free whitespace, which an unconstrained model could otherwise emit forever
JSON_OPTIONS = {"whitespace_flexible": False}


class GrammarError(InvalidArgumentError):
    """A schema the grammar compiler refuses; the message says why."""


def _llguidance():
    try:
        import llguidance
        import llguidance.hf
        import llguidance.numpy
    except ImportError:
        raise InvalidArgumentError("structured output needs llguidance: pip install 'llama-ane[serve]'") from None
    return llguidance


class Grammars:
    """Compiles JSON schemas for one tokenizer (the llguidance tokenizer is built once: ~1 s on a
    large vocabulary)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int]):
        lg = _llguidance()
        self._lg = lg
        self.vocab_size = vocab_size
        self.eos = list(eos_token_ids)
        self.tokenizer = lg.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=self.eos or None)

    def json_schema(self, schema: dict | None) -> str:
        """The grammar of JSON text matching `schema` (None: any JSON object); checked now, so a bad
        schema is refused with the request rather than failing in the worker."""
        lg = self._lg
        grammar = lg.LLMatcher.grammar_from_json_schema(json.dumps({"type": "object"} if schema is None else schema),
                                                        overrides=JSON_OPTIONS)
        is_error, messages = lg.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if is_error:
            raise GrammarError(f"the JSON schema cannot be used: {messages[0] if messages else 'invalid'}")
        return grammar

    def matcher(self, grammar: str) -> "Constraint":
        return Constraint(self, self._lg.LLMatcher(self.tokenizer, grammar, log_level=0))


class Constraint:
    """One branch's matcher: `mask` the logits of the next token, then `advance` with the token drawn."""

    def __init__(self, grammars: Grammars, matcher):
        self._grammars = grammars
        self._matcher = matcher
        self._bits = grammars._lg.numpy.allocate_token_bitmask(1, grammars.vocab_size)

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """`logits` float32 [vocab] with every token the grammar forbids set to -inf."""
        self._grammars._lg.numpy.fill_next_token_bitmask(self._matcher, self._bits, 0)
        allowed = np.unpackbits(self._bits.view(np.uint8), bitorder="little")[:logits.shape[-1]].astype(bool)
        return np.where(allowed, logits, -np.inf).astype(np.float32)

    def advance(self, token: int) -> None:
        if not self._matcher.consume_token(int(token)):
            raise RuntimeError(f"the grammar refused token {token}: {self._matcher.get_error()}")

    @property
    def complete(self) -> bool:
        """The grammar is complete: nothing but end-of-sequence may follow."""
        return self._matcher.is_stopped()
