"""What `generate` and `chat` share around a generation: loading the model with a line that says so,
a warm-up kept out of the measured speeds, the statistics line, and the prompt-cache file's
wrapping check."""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import click

from ..errors import InvalidArgumentError


@dataclass
class Loaded:
    """A loaded model and what getting it ready cost, in seconds."""

    model: object
    load_seconds: float
    warmup_seconds: float


def load_model(out, backend: str, quiet: bool = False, **options) -> Loaded:
    """Load the export in `out` (every model file, before any clock starts) and warm it up, saying
    so on stderr first (a large model takes a while: the user sees what is going on)."""
    import llama_ane
    from ..hub import locate

    if str(out) != "default":  # a repo id is found (or fetched) before anything is said about loading it
        out = locate(out, options.pop("revision", None))
    if not quiet:
        click.echo(f"loading {out} ({backend})...", err=True)
    t0 = time.perf_counter()
    model = llama_ane.load(out, backend=backend, **options)
    try:
        model.prepare()
        t1 = time.perf_counter()
        warm_up(model)
    except BaseException:
        model.close()
        raise
    return Loaded(model, t1 - t0, time.perf_counter() - t1)


def warm_up(model) -> None:
    """Run the prefill and decode functions once on a scratch cache: a backend's first call of a
    function compiles or allocates, which would otherwise land in the first prompt's prefill speed."""
    pipe = model.pipeline
    pipe.reset()
    pipe.run_window([0, 0])
    pipe.run_window([0])
    pipe.wait()
    pipe.reset()


def peak_memory_bytes() -> int | None:
    """This process's peak resident memory, or None where the platform does not say."""
    try:
        import resource
    except ImportError:  # Windows
        import psutil

        return getattr(psutil.Process().memory_info(), "peak_wset", None)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB elsewhere


def rate(n: int, seconds: float) -> float | None:
    """n / seconds, or None when there is nothing to measure."""
    return round(n / seconds, 2) if n > 0 and seconds > 0 else None


def generation_stats(result, loaded: Loaded | None, cache_given: bool, started: float) -> dict:
    """The numbers of one generation (GenerationResult), as generate --json prints them.

    The first generated token comes from the prompt's own logits (prefill); every later one costs
    a decode step, so decode speed is decode steps over decode time."""
    generated = len(result.token_ids)
    stats = {"prompt_tokens": result.prompt_tokens, "prefilled_tokens": result.prefilled_tokens,
             "prefill_seconds": round(result.prefill_seconds, 3),
             "prefill_tokens_per_s": rate(result.prefilled_tokens, result.prefill_seconds),
             "first_token_seconds": None if math.isnan(result.first_token_seconds) else
             round(result.first_token_seconds, 3),
             "generated_tokens": generated, "decode_steps": result.decoded_tokens,
             "decode_seconds": round(result.decode_seconds, 3),
             "decode_tokens_per_s": rate(result.decoded_tokens, result.decode_seconds),
             "finish_reason": result.finish_reason, "total_seconds": round(time.perf_counter() - started, 3),
             "peak_memory_bytes": peak_memory_bytes()}
    if cache_given:
        stats["reused_tokens"] = result.reused_tokens
    if loaded is not None:
        stats["load_seconds"] = round(loaded.load_seconds, 3)
        stats["warmup_seconds"] = round(loaded.warmup_seconds, 3)
    if result.shifts:
        stats["context_shifts"] = result.shifts
    return stats


def _speed(x: float | None) -> str:
    return "-" if x is None else f"{x:g} tok/s"


def stats_lines(backend: str, stats: dict) -> list[str]:
    """The human form of `generation_stats`, for stderr."""
    reused = f" ({stats['reused_tokens']} reused from the cache)" if "reused_tokens" in stats else ""
    shifts = f", context shifted {stats['context_shifts']}x" if stats.get("context_shifts") else ""
    first = "" if stats["first_token_seconds"] is None else f" | first token after {stats['first_token_seconds']} s"
    lines = [f"[{backend}] prefill: {stats['prefilled_tokens']} tokens{reused} in {stats['prefill_seconds']} s, "
             f"{_speed(stats['prefill_tokens_per_s'])}{first}",
             f"[{backend}] generated {stats['generated_tokens']} tokens: {stats['decode_steps']} decode steps in "
             f"{stats['decode_seconds']} s, {_speed(stats['decode_tokens_per_s'])} | finish: "
             f"{stats['finish_reason']}{shifts}"]
    tail = []
    if "load_seconds" in stats:
        tail.append(f"load {stats['load_seconds']} s + warm-up {stats['warmup_seconds']} s")
    tail.append(f"total {stats['total_seconds']} s")
    if stats["peak_memory_bytes"] is not None:
        tail.append(f"peak memory {stats['peak_memory_bytes'] / 2**30:.2f} GiB (RSS)")
    lines.append(f"[{backend}] " + " | ".join(tail))
    return lines


def check_wrapping(cache, wrapping: str, path: Path) -> None:
    """Refuse a loaded prompt cache whose text was wrapped otherwise than this run wraps its prompt:
    it would reuse nothing, then be overwritten with the other wrapping."""
    if cache.wrapping is None or cache.wrapping == wrapping:
        return
    made = "with the chat template" if cache.wrapping == "chat" else "without the chat template (--raw)"
    now = "wraps the prompt in the chat template" if wrapping == "chat" else "gives it raw (--raw)"
    fix = "add --raw" if cache.wrapping == "raw" else "drop --raw"
    raise InvalidArgumentError(f"--prompt-cache {path} was made {made}, and this run {now}, so it would reuse "
                               f"nothing; it was left as it is: {fix}, or choose another --prompt-cache file")
