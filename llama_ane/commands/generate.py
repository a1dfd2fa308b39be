"""`llama-ane generate`: stream text from an export, then report prefill and decode speed."""

from __future__ import annotations

import json
from pathlib import Path

import click

from ..runtime.model import BACKENDS
from .errors import user_errors


@click.command("generate")
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--prompt", required=True, help="Prompt text.")
@click.option("--chat", is_flag=True, help="Wrap the prompt in the model's chat template.")
@click.option("--max-new-tokens", default=128, show_default=True)
@click.option("--backend", type=click.Choice(BACKENDS), default="auto", show_default=True,
              help="auto = coreml on macOS, torch elsewhere.")
@click.option("--precision", type=click.Choice(["fp16", "fp32"]), default=None,
              help="torch/mil compute precision [default: the export's].")
@click.option("--temperature", default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-k", default=0, show_default=True, help="0 = off.")
@click.option("--top-p", default=1.0, show_default=True)
@click.option("--seed", type=int, default=None)
@click.option("--stop", multiple=True, help="Stop at this string (repeatable).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of streaming.")
def command(out, prompt, chat, max_new_tokens, backend, precision, temperature, top_k, top_p, seed, stop, as_json):
    """Generate text from the export in OUT."""
    import llama_ane

    with user_errors():
        options = {"precision": precision} if precision and backend in ("torch", "mil", "auto") else {}
        model = llama_ane.load(out, backend=backend, **options)
        try:
            result = model.generate(prompt, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                                    top_p=top_p, seed=seed, stop=list(stop), chat=chat,
                                    on_token=None if as_json else lambda e: click.echo(e.text, nl=False))
        finally:
            model.close()
    stats = {"backend": model.backend.name, "prompt_tokens": result.prompt_tokens,
             "generated_tokens": len(result.token_ids), "finish_reason": result.finish_reason,
             "prefill_tokens_per_s": round(result.prefill_tokens_per_s, 2),
             "decode_tokens_per_s": round(result.decode_tokens_per_s, 2)}
    if as_json:
        click.echo(json.dumps({"text": result.text, "token_ids": result.token_ids, **stats}))
        return
    click.echo()
    if result.finish_reason == "context":
        click.echo(f"[stopped: the context of {model.manifest['context_length']} tokens is full]", err=True)
    click.echo(f"[{stats['backend']}] prefill: {result.prompt_tokens} tokens, {stats['prefill_tokens_per_s']} tok/s | "
               f"decode: {result.decoded_tokens} tokens, {stats['decode_tokens_per_s']} tok/s | "
               f"finish: {result.finish_reason}", err=True)
