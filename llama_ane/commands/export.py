"""`llama-ane export`: a checkpoint to an export folder of .mlpackage files and manifest.json."""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path
from typing import Iterator

import click

from ..contract.options import EXPORT_OPTIONS
from .errors import user_errors
from .options import FiniteFloat, options_from, revision_option


@click.command("export")
@click.argument("model", required=False)
@click.option("-o", "--out", "out", required=True, type=click.Path(path_type=Path), help="Export folder to create.")
@revision_option("MODEL")
@options_from(EXPORT_OPTIONS)
@click.option("--workers", type=int, default=None,
              help="Packages built at once [default: from cores and available memory].")
@click.option("--max-memory", "max_memory", type=FiniteFloat(minimum=0, min_open=True, unit="GiB"), default=None,
              help="Memory budget in GiB, instead of what the machine reports as available; an export "
                   "estimated above it is refused before anything is converted.")
@click.option("--force", is_flag=True, help="Replace OUT if it exists.")
@click.option("--no-verify", is_flag=True, help="Skip the parity check of the exported programs (and the perplexity "
                                                "check of 4-bit schemes).")
@click.option("--no-transformers", is_flag=True,
              help="Leave the gate's comparison with transformers' own model out: it checks the conversion only "
                   "and says it was partial.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
@click.option("--json", "as_json", is_flag=True, help="End with one JSON object on stdout (the log goes to stderr).")
def command(model, out, revision, workers, max_memory, force, no_verify, no_transformers, quiet, as_json, **options):
    """Export MODEL (a Hugging Face folder or repo id, a .gguf file, or nothing for the embedded
    SmolLM2-135M-Instruct) to OUT."""
    from ..api import export_model

    t0 = time.perf_counter()
    with user_errors(), stopped_by_signal(out):
        export_model(model, out, force=force, verify=not no_verify, with_transformers=not no_transformers,
                     workers=workers, max_memory_gb=max_memory, progress=not quiet,
                     log=_log_to_stderr if as_json else _log, revision=revision, **options)
    # the log's last line closes the export ("exported OUT in S s, peak memory ..."); --json adds the result
    if as_json:
        import json

        click.echo(json.dumps({"out": str(out), "seconds": round(time.perf_counter() - t0, 3),
                               "verified": not no_verify}))


def _log(line: str) -> None:
    """A line of the export's log, printed above the progress bar rather than through it."""
    from tqdm import tqdm

    tqdm.write(line)


def _log_to_stderr(line: str) -> None:
    from tqdm import tqdm

    tqdm.write(line, file=sys.stderr)


@contextlib.contextmanager
def stopped_by_signal(out: Path) -> Iterator[None]:
    """SIGTERM and SIGHUP clean up as Ctrl-C does (the export's workers stopped, its partial folder
    removed), then end the command with one `Error:` line and the exit code a shell gives a process
    that signal ended."""
    from ..export.convert import Stopped, stop_on_signals

    try:
        with stop_on_signals():
            yield
    except Stopped as stop:
        error = click.ClickException(f"the export was {stop}; nothing was written to {out}")
        error.exit_code = 128 + stop.signum
        raise error from None

