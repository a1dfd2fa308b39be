"""`llama-ane eval OUT [--text FILE] [--backend ...] [--reference OUT_FP16] [--json]`: perplexity of an
export on held-out text, and its distance from another export of the same model. OUT and OUT_FP16
are export folders or Hugging Face repo ids of exports."""

from __future__ import annotations

import json

import click

from .errors import user_errors
from .options import BACKEND, PathOrRepo, Utf8File, revision_option


@click.command("eval")
@click.argument("out", type=PathOrRepo(exists=True, file_okay=False))
@revision_option("OUT")
@click.option("--text", "text_file", type=Utf8File(), default=None,
              help="Text file to score instead of the shipped held-out prose (about 2100 tokens).")
@click.option("--backend", type=BACKEND, default="auto", show_default=True,
              help="auto = coreml on macOS, torch elsewhere; mil runs the saved programs with numpy.")
@click.option("--precision", type=click.Choice(["fp16", "fp32"]), default=None,
              help="Computation precision of the torch or mil backend [default: the backend's].")
@click.option("--reference", type=PathOrRepo(exists=True, file_okay=False), default=None,
              help="Another export of the same model (e.g. its fp16 one; a folder or a Hugging Face repo id at its "
                   "default branch): adds top-1 agreement and mean KL.")
@click.option("--window", type=int, default=None, help="Tokens per scored window [default: the context length].")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--quiet", is_flag=True, help="No progress line.")
def command(out: str, revision: str | None, text_file: str | None, backend: str, precision: str | None,
            reference: str | None, window: int | None, as_json: bool, quiet: bool) -> None:
    """Perplexity of the export OUT on held-out text (and, with --reference, agreement with another export).

    OUT and --reference are export folders or Hugging Face repo ids of exports."""
    from ..evaluate import evaluate
    from ..hub import locate

    with user_errors():
        out, reference = locate(out, revision, "export"), locate(reference, need="export")
        text = None
        if text_file is not None:
            with open(text_file, encoding="utf-8") as f:
                text = f.read()
        report = evaluate(out, text, backend=backend, precision=precision, reference=reference, window=window,
                          progress=not quiet)
    click.echo(json.dumps(report.to_dict(), indent=2) if as_json else str(report))
