"""Turn the errors that bad input raises into one clear CLI line and a non-zero exit."""

from __future__ import annotations

import contextlib
from typing import Iterator

import click

from ..config import ConfigError
from ..export.budget import MemoryBudgetError
from ..export.convert import ConversionError
from ..contract.plan import ExportOptionsError
from ..contract.manifest import ManifestError
from ..checkpoint.loader import CheckpointError
from ..quantize import QuantizeError
from ..runtime.backends.base import BackendError
from ..runtime.pipeline import CacheUpdateError, ContextFullError

USER_ERRORS = (ConfigError, CheckpointError, ExportOptionsError, ManifestError, BackendError,
               ContextFullError, CacheUpdateError, MemoryBudgetError, ConversionError, QuantizeError, ValueError,
               FileNotFoundError)


@contextlib.contextmanager
def user_errors(exit_on_error: bool = True) -> Iterator[None]:
    """Report known error types as `Error: <message>` with exit code 1, without a traceback (or, with
    `exit_on_error` False, print that line and go on: an interactive command's bad input)."""
    try:
        yield
    except click.ClickException:
        raise
    except USER_ERRORS as e:
        if not exit_on_error:
            click.echo(f"Error: {e}", err=True)
            return
        raise click.ClickException(str(e)) from None
    except RuntimeError as e:
        if type(e).__name__ in ("ExportError", "VerifyError"):
            raise click.ClickException(str(e)) from None
        raise
