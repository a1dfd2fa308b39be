"""Incremental detokenization: text deltas as tokens arrive, held back while a UTF-8 character is
incomplete, and cut at the first stop string."""

from __future__ import annotations

from typing import Sequence


class TextStream:
    """Feed token ids one at a time with `push`; read `text`, `token_ids` and `stopped`.

    `text` is always the concatenation of the deltas returned so far, so a stream and its final
    result agree (a character still open at the end is not shown).
    """

    def __init__(self, tokenizer, stops: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stops = [s for s in stops if s]
        self.token_ids: list[int] = []
        self.text = ""
        self.stopped = False

    def push(self, token: int) -> str:
        """Add a token; return the new text it completes ("" while a character is still open)."""
        self.token_ids.append(token)
        full = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        if full.endswith("\ufffd"):  # a multi-byte character split across tokens: wait for the rest
            return ""
        delta, self.text = full[len(self.text):], full
        hit = next((s for s in self.stops if s in self.text), None)
        if hit is not None:
            cut = self.text.index(hit)
            delta = delta[: max(0, len(delta) - (len(self.text) - cut))]
            self.text, self.stopped = self.text[:cut], True
        return delta
