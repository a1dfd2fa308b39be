"""Errors raised while rendering an export's chat template: the template's problem, said as such."""

from __future__ import annotations

import contextlib
from typing import Iterator

from ..errors import LlamaANEError


class ChatTemplateError(LlamaANEError, ValueError):
    """The export's chat template failed to render a conversation; the message says how."""


@contextlib.contextmanager
def template_errors() -> Iterator[None]:
    """Turn an exception raised while rendering the chat template into a ChatTemplateError.

    The template is code that came with the checkpoint (jinja, run by transformers): a syntax error,
    an undefined name, its own raise_exception(...) or a Python error in an expression all surface
    here, and all are the template's problem, not ours. Our own errors pass through unchanged."""
    try:
        yield
    except LlamaANEError:
        raise
    except Exception as e:
        detail = " ".join(str(e).split()) or "no message"
        raise ChatTemplateError(f"the export's chat template failed ({type(e).__name__}: {detail}); fix "
                                "chat_template in its tokenizer_config.json (or chat_template.jinja), or run "
                                "without the chat template (generate --raw, or raw=True in Python)") from e
