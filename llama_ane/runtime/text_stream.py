"""Incremental detokenization: text deltas as tokens arrive, held back while a UTF-8 character is
incomplete, and cut at the first stop string."""

from __future__ import annotations

from typing import Sequence


class TextStream:
    """Feed token ids one at a time with `push`; read `text`, `token_ids` and `stopped`.

    `text` is always the concatenation of the deltas returned so far, so a stream and its final
    result agree (a character still open at the end is not shown).

    Each push decodes only the tokens since the last emitted delta plus the ones before it (their
    text is the reference that the new decode is compared with), not the whole answer: the cost per
    token stays constant however long the answer grows. Decoding from a reference token, rather than
    from the new one alone, keeps word-initial spaces and merged byte sequences as the full decode
    gives them.
    """

    def __init__(self, tokenizer, stops: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stops = [s for s in stops if s]
        self._longest_stop = max((len(s) for s in self.stops), default=0)
        self.token_ids: list[int] = []
        self.text = ""
        self.stopped = False
        self._prefix = 0  # token_ids[_prefix:_read] decode to the reference text
        self._read = 0  # token_ids[_read:] have not reached `text` yet

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, token: int) -> str:
        """Add a token; return the new text it completes ("" while a character is still open)."""
        self.token_ids.append(token)
        reference = self._decode(self.token_ids[self._prefix:self._read])
        new = self._decode(self.token_ids[self._prefix:])
        if len(new) <= len(reference) or new.endswith("\ufffd"):  # nothing yet, or a character split across tokens
            return ""
        delta = new[len(reference):]
        self._prefix, self._read = self._read, len(self.token_ids)
        start = max(0, len(self.text) - self._longest_stop + 1)  # a stop may begin in the text already shown
        self.text += delta
        cut = min((i for i in (self.text.find(s, start) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            delta = delta[: max(0, len(delta) - (len(self.text) - cut))]
            self.text, self.stopped = self.text[:cut], True
        return delta
