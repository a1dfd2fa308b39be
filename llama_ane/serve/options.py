"""The server's settings and limits, in one place: the command's options take their defaults from here."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

BATCHING = ("auto", "always", "never")  # the server's --batching choices (Scheduler)


@dataclass
class ServeOptions:
    """The server's limits and settings (the command's options, with the same defaults)."""

    api_key: str | None = None
    max_queue: int = 64  # waiting requests (choices) before 429
    max_tokens_limit: int = 1024  # the largest max_tokens a request may ask for
    prompt_cache_bytes: int = 256 * 2**20  # RAM for cached prefixes
    prompt_cache_dir: Path | None = None  # evicted prefixes go here as prompt-cache files
    max_body_bytes: int = 4 * 2**20  # a request body larger than this is refused (413)
    gather_seconds: float = 0.01  # see Scheduler
    batching: str = "auto"  # shared-prefix requests as one batch: "auto" where it pays (pricing.py), "always", "never"
    chat_template: str | None = None  # a Jinja chat template replacing the model's own
    model_name: str | None = None  # the model id /v1/models reports (default: the export's name)
    shutdown_seconds: float = 10.0  # on SIGINT/SIGTERM, answers in progress get this long to finish
