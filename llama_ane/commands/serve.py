"""`llama-ane serve OUT`: an OpenAI-compatible HTTP server over one export, a folder or a Hugging
Face repo id (see docs/serve.md).

    llama-ane serve out/smollm2                       http://127.0.0.1:8080/v1
    llama-ane serve out/smollm2 --api-key KEY --prompt-cache-dir caches/
    llama-ane serve owner/model-ane --revision v1
"""

from __future__ import annotations

import os
import signal
import socket
from pathlib import Path

import click

from ..runtime.model import BACKENDS
from .errors import user_errors
from ..serve.options import ServeOptions as DEFAULTS
from .options import PathOrRepo, Utf8File, revision_option

def _serve_extra():
    """The serve package, or a one-line error naming the extra to install."""
    try:
        import starlette  # noqa: F401
        import uvicorn
    except ImportError as e:
        raise click.ClickException(f"llama-ane serve needs {e.name}: pip install 'llama-ane[serve]'") from None
    from ..serve.app import create_app
    return uvicorn, create_app


@click.command("serve")
@click.argument("out", type=PathOrRepo())
@revision_option("OUT")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on (0.0.0.0 serves other machines: set --api-key).")
@click.option("--port", type=click.IntRange(0, 65535), default=8080, show_default=True)
@click.option("--backend", type=click.Choice(BACKENDS), default="auto", show_default=True,
              help="auto = coreml on macOS, torch elsewhere.")
@click.option("--precision", type=click.Choice(["fp16", "fp32"]), default=None,
              help="torch/mil compute precision [default: fp32 for torch on CPU, else the export's].")
@click.option("--api-key", default=None, envvar="LLAMA_ANE_API_KEY",
              help="Require 'Authorization: Bearer KEY' on every path but /health (or set LLAMA_ANE_API_KEY).")
@click.option("--max-queue", type=click.IntRange(1), default=DEFAULTS.max_queue, show_default=True,
              help="Waiting requests (choices) before 429.")
@click.option("--max-tokens-limit", type=click.IntRange(1), default=DEFAULTS.max_tokens_limit, show_default=True,
              help="The largest max_tokens a request may ask for.")
@click.option("--prompt-cache-bytes", type=click.IntRange(0), default=DEFAULTS.prompt_cache_bytes, show_default=True,
              help="RAM for cached prefixes (0: none).")
@click.option("--prompt-cache-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="An existing folder: prefixes evicted from RAM are kept there as prompt-cache files.")
@click.option("--chat-template", type=Utf8File(), default=None,
              help="A Jinja chat template file replacing the model's (e.g. one that renders tools).")
def command(out, revision, host, port, backend, precision, api_key, max_queue, max_tokens_limit, prompt_cache_bytes,
            prompt_cache_dir, chat_template):
    """Serve the export in OUT (a folder or a Hugging Face repo id) with OpenAI's API (chat, completions,
    models) over HTTP."""
    uvicorn, create_app = _serve_extra()
    import llama_ane
    from ..errors import InvalidArgumentError
    from ..hub import locate

    with user_errors():
        sock = _bind(host, port)  # before the model loads: a busy port is refused at once
        if prompt_cache_dir is not None and not prompt_cache_dir.is_dir():
            raise InvalidArgumentError(f"--prompt-cache-dir {prompt_cache_dir}: the folder does not exist; create it "
                                       "or choose another")
        if prompt_cache_dir is not None and not os.access(prompt_cache_dir, os.W_OK):
            raise InvalidArgumentError(f"--prompt-cache-dir {prompt_cache_dir}: the folder is not writable")
        out = locate(out, revision)  # what llama_ane.load reads: an export (or, with torch, a checkpoint)
        model = llama_ane.load(out, backend=backend, **({} if precision is None else {"precision": precision}))
        model.prepare()
        options = DEFAULTS(api_key=api_key, max_queue=max_queue, max_tokens_limit=max_tokens_limit,
                               prompt_cache_bytes=prompt_cache_bytes, prompt_cache_dir=prompt_cache_dir,
                               chat_template=None if chat_template is None else chat_template.read_text("utf-8"))
        app = create_app(model, options)
    port = sock.getsockname()[1]
    click.echo(f"{model.manifest['name']} on {model.backend.name}: http://{host}:{port}/v1", err=True)
    # uvicorn stops on SIGTERM/SIGINT: no new connections, running answers get up to 30 s, then
    # the app's lifespan closes the scheduler (what still waits is refused). It then re-raises the
    # signal to the handler it found: a no-op one here, so a requested stop exits 0, not by the signal.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=30)).run(sockets=[sock])
    sock.close()
    model.close()


def _bind(host: str, port: int) -> socket.socket:
    """A socket bound to host:port for uvicorn to listen on, or one clear error."""
    from ..errors import InvalidArgumentError

    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise InvalidArgumentError(f"--host {host} --port {port}: cannot listen there ({e.strerror or e}); choose "
                                   "another --port, or an address this host has for --host") from None
    return sock
