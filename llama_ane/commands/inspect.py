"""`llama-ane inspect PATH [--json] [--strict]`: static report of exported programs and ANE rule
violations. PATH is an export folder, a Hugging Face repo id of one, or a single .mlpackage."""

from __future__ import annotations

import sys

import click

from .errors import user_errors
from .options import LazyChoice, PathOrRepo, revision_option


@click.command("inspect")
@click.argument("path", type=PathOrRepo())
@revision_option("PATH")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--strict", is_flag=True, help="Exit with status 1 if there is any ANE rule violation.")
@click.option("--target", type=LazyChoice("llama_ane.contract.options", "TARGETS"), default=None,
              help="Deployment target for the file-size rule (e.g. iOS18, macOS15); default: the manifest's, "
                   "or iOS18 for a single package.")
def command(path: str, revision: str | None, as_json: bool, strict: bool, target: str | None) -> None:
    """Report I/O, op histogram, weight bytes and largest dimension per package and function, then
    every ANE rule violation.

    PATH is an export folder, a Hugging Face repo id of one, or a single .mlpackage."""
    from ..export.inspect import inspect_path
    from ..hub import locate

    with user_errors():
        report = inspect_path(locate(path, revision, "export"), target=target)
    click.echo(report.to_json() if as_json else report.format_text())
    if strict and report.violations:
        click.echo(f"{len(report.violations)} ANE rule violation(s) (--strict)", err=True)
        sys.exit(1)
