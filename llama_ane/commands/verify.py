"""`llama-ane verify OUT [--backend mil|coreml] [--text FILE]`: the parity gate of an export (a
folder, or a Hugging Face repo id of one).

Scores a fixed real text through the exported packages with the chosen backend and compares with
the torch backend and transformers; exits 1 below the thresholds."""

from __future__ import annotations

import sys

import click

from .errors import one_line, user_errors
from .options import PathOrRepo, Utf8File, revision_option


@click.command("verify")
@click.argument("out", type=PathOrRepo(exists=True, file_okay=False))
@revision_option("OUT")
@click.option("--backend", type=click.Choice(["mil", "coreml", "coreai"]), default="mil", show_default=True,
              help="mil runs the saved programs with numpy (any OS); coreml runs Core ML (macOS); coreai runs a Core AI "
                   "export through Apple's runtime (CPU on Linux).")
@click.option("--text", "text_file", type=Utf8File(), default=None,
              help="Text file to score instead of the shipped prose.")
@click.option("--max-tokens", default=128, show_default=True,
              help="Tokens of the text to score (capped at the context length).")
@click.option("--precision", type=click.Choice(["fp16", "fp32"]), default=None,
              help="mil backend only: compute in fp16 (as the ANE; default for fp16 exports) or fp32.")
@click.option("--no-transformers", is_flag=True, help="Skip the comparison with transformers.")
@click.option("--ane-numerics", is_flag=True,
              help="mil backend: also run the programs with the Neural Engine's reported fp16 deviations (softplus's "
                   "collapse, silu's error near 0, subnormals flushed to zero) against transformers.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--quiet", is_flag=True, help="No progress line.")
def command(out: str, revision: str | None, backend: str, text_file: str | None, max_tokens: int,
            precision: str | None, no_transformers: bool, ane_numerics: bool, as_json: bool, quiet: bool) -> None:
    """Check that the exported packages reproduce their source model's logits.

    OUT is an export folder or a Hugging Face repo id of one."""
    from ..hub import locate
    from ..verify import verify_export

    with user_errors():
        out = locate(out, revision, "export")
        text = None
        if text_file is not None:
            with open(text_file, encoding="utf-8") as f:
                text = f.read()
        report = verify_export(out, backend=backend, text=text, max_tokens=max_tokens, precision=precision,
                               with_transformers=not no_transformers, ane_numerics=ane_numerics, progress=not quiet)
    if as_json:
        import dataclasses
        import json

        click.echo(json.dumps({**dataclasses.asdict(report), "passed": report.passed}, indent=2))
    else:
        click.echo(str(report))
    if report.error:  # the export could not be read or run: say why on one line
        raise click.ClickException(one_line(report.error))
    if not report.passed:
        sys.exit(1)
