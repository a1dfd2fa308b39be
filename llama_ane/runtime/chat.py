"""A multi-turn conversation on one cache: each turn prefills only its own new tokens.

The conversation is kept twice: as messages (rendered by the export's recorded chat template) and
as token ids (each prompt and the reply's generated ids). A new turn renders the whole
conversation, takes the text that follows what those ids already cover, and tokenizes only that;
the cache then reuses everything before it. When the template does not extend the previous text (some templates rewrite earlier
turns), the whole conversation is tokenized again and the cache still reuses the longest common
prefix. A conversation longer than the context shifts: the system prompt and the most recent
tokens are kept.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from ..errors import InvalidArgumentError
from .chat_template import template_errors
from .model import GenerationResult, LlamaANEModel, TokenEvent


def prompt_ids(model: LlamaANEModel, text: str, system: str | None = None) -> list[int]:
    """Token ids of `text` as one user turn (after a system turn, if `system`), ready for the
    assistant's reply, by the export's chat template."""
    if not system:
        return model.encode(text, chat=True)
    messages = [{"role": "system", "content": system}, {"role": "user", "content": text}]
    with template_errors():
        rendered = model.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(model.tokenizer(rendered, add_special_tokens=False).input_ids)


class Chat:
    """`chat = Chat(model, system="...")`, then `chat.send("Hello")` per user turn."""

    def __init__(self, model: LlamaANEModel, system: str | None = None, **sampling):
        if not model.manifest["tokenizer"].get("chat_template"):
            raise InvalidArgumentError("this model has no chat template, so it cannot hold a conversation; use generate")
        self.model = model
        self.system = system
        self.sampling = {"max_new_tokens": 256, **sampling}
        self.reset()

    def reset(self) -> None:
        """Forget the conversation (the system prompt stays)."""
        self.messages: list[dict[str, str]] = [{"role": "system", "content": self.system}] if self.system else []
        self.cache = self.model.make_cache()
        self.covered = ""  # the rendered text that `self.history` stands for
        self.history: list[int] = []
        self.keep = len(self._tokenize(self._render(add_generation_prompt=False))) if self.system else 0

    def _render(self, add_generation_prompt: bool) -> str:
        if not self.messages:
            return ""
        with template_errors():
            return self.model.tokenizer.apply_chat_template(self.messages, tokenize=False,
                                                            add_generation_prompt=add_generation_prompt)

    def _tokenize(self, text: str) -> list[int]:
        return list(self.model.tokenizer(text, add_special_tokens=False).input_ids)

    def prompt_ids(self) -> list[int]:
        """The token ids of the whole conversation so far, ready for the assistant's turn."""
        return self._ids_of(self._render(add_generation_prompt=True))

    def _ids_of(self, text: str) -> list[int]:
        """Token ids of the rendered conversation `text`: the ids kept for what they cover, plus the
        tokens of the rest."""
        if self.history and text.startswith(self.covered):
            return self.history + self._tokenize(text[len(self.covered):])
        return self._tokenize(text)

    def send(self, text: str, on_token: Callable[[TokenEvent], None] | None = None, **sampling) -> GenerationResult:
        """Add a user turn, generate the assistant's reply on the conversation's cache, and return it
        (`reused_tokens` / `prefilled_tokens` say what the cache saved). If it fails, the conversation
        is as it was before the call (the cache still holds its tokens and reuses what matches)."""
        self.messages.append({"role": "user", "content": text})
        try:
            rendered = self._render(add_generation_prompt=True)
            ids = self._ids_of(rendered)
            result = self.model.generate(ids, cache=self.cache, on_token=on_token, overflow="shift", keep=self.keep,
                                         **{**self.sampling, **sampling})
        except BaseException:
            self.messages.pop()
            raise
        self.messages.append({"role": "assistant", "content": result.text})
        self.covered, self.history = rendered + result.text, ids + result.token_ids
        if result.shifts:  # the cache no longer starts with the rendered text: tokenize it all next turn
            self.covered, self.history = "", []
        return result

    def save(self, path: str | Path) -> Path:
        """Write the conversation's cache and its messages to one prompt-cache file (`load` resumes it)."""
        self.cache.wrapping, self.cache.messages = "chat", [dict(m) for m in self.messages]
        return self.model.save_cache(self.cache, path)

    def load(self, path: str | Path) -> bool:
        """Resume from a prompt-cache file. One saved by `save` brings its conversation back (its
        messages, the system prompt among them, are rendered as they were, and the cache reuses
        their tokens); any other holds only tokens, which become the start of the conversation as
        one block of context. Returns whether messages came with it. On an error the conversation
        is as it was."""
        from .kv_cache import PromptCacheError

        cache = self.model.load_cache(path)
        if cache.wrapping == "raw":
            raise PromptCacheError(f"{path} holds a prompt given without the chat template (generate --raw); "
                                   "a conversation continues only from a chat-wrapped cache")
        self.cache = cache
        if cache.messages is not None:
            self.messages = [dict(m) for m in cache.messages]
            system = self.messages[0]["content"] if self.messages and self.messages[0]["role"] == "system" else None
            self.system = system
            self.keep = len(self._tokenize(self._render_messages(self.messages[:1]))) if system else 0
            self.covered, self.history = "", []  # re-rendered next turn; the cache reuses what matches
            return True
        # tokens only: they stand for everything before the next turn, system prompt included
        self.messages, self.keep = [], 0
        self.covered, self.history = "", list(cache.tokens)
        return False

    def _render_messages(self, messages: list[dict[str, str]]) -> str:
        with template_errors():
            return self.model.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
