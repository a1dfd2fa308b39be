"""Turn the errors that bad input raises into one clear CLI line and a non-zero exit."""

from __future__ import annotations

import contextlib
from typing import Iterator

import click

from ..errors import LlamaANEError


def one_line(message: str) -> str:
    """`message` on one line: the first line of a longer report (the rest goes nowhere on the CLI;
    the exception itself keeps it)."""
    lines = [line for line in str(message).splitlines() if line.strip()]
    return lines[0] if lines else "an error without a message"


@contextlib.contextmanager
def user_errors(exit_on_error: bool = True) -> Iterator[None]:
    """Report a LlamaANEError as `Error: <message>` with exit code 1, without a traceback (or, with
    `exit_on_error` False, print that line and go on: an interactive command's bad input). Anything
    else is a bug and keeps its traceback."""
    try:
        yield
    except click.ClickException:
        raise
    except LlamaANEError as e:
        if not exit_on_error:
            click.echo(f"Error: {one_line(e)}", err=True)
            return
        raise click.ClickException(one_line(e)) from None
