"""`llama-ane serve OUT`: an OpenAI-compatible HTTP server over one export, a folder or a Hugging
Face repo id (see docs/serve.md).

    llama-ane serve out/smollm2                       http://127.0.0.1:8080/v1
    llama-ane serve out/smollm2 --api-key KEY --prompt-cache-dir caches/
    llama-ane serve owner/model-ane --revision v1
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
from pathlib import Path

import click

from .errors import user_errors
from ..serve.options import BATCHING, ServeOptions as DEFAULTS
from .options import BACKEND, FiniteFloat, PathOrRepo, Utf8File, revision_option

def _serve_extra():
    """The serve package, or a one-line error naming the extra to install."""
    try:
        import starlette  # noqa: F401
        import uvicorn
    except ImportError as e:
        raise click.ClickException(f"llama-ane serve needs {e.name}: pip install 'llama-ane[serve]'") from None
    from ..serve.app import create_app
    return uvicorn, create_app


def _say(line: str) -> None:
    click.echo(line, err=True)


def _server_class(uvicorn):
    class Server(uvicorn.Server):
        """uvicorn's server, telling what it does: it says when it serves, and on the first SIGINT or
        SIGTERM stops accepting (uvicorn's `should_exit`) and gives the open answers the app's
        `shutdown_seconds` before the app ends them with an error; a second SIGINT exits at once
        with status 130 (the model's worker may be inside a call that cannot be interrupted)."""

        def __init__(self, config, app_server, url: str):
            super().__init__(config)
            self.app_server, self.url = app_server, url

        async def startup(self, sockets=None) -> None:
            await super().startup(sockets=sockets)
            if not self.should_exit:
                _say(f"serving on {self.url} (OpenAI API at {self.url}/v1; Ctrl-C to stop)")

        def handle_exit(self, sig, frame) -> None:
            if self.should_exit:
                if sig == signal.SIGINT:
                    _say(f"quit: {self.app_server.in_flight} open requests cut off")
                    sys.stderr.flush()
                    os._exit(130)
                return
            super().handle_exit(sig, frame)
            seconds = self.app_server.options.shutdown_seconds
            _say(f"stopping: finishing {self.app_server.in_flight} open requests (up to {seconds:g} s); "
                 "Ctrl-C again to quit now")
            self.app_server.stop_serving(seconds)
    return Server


@click.command("serve")
@click.argument("out", type=PathOrRepo())
@revision_option("OUT")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on (0.0.0.0 serves other machines: set --api-key).")
@click.option("--port", type=click.IntRange(0, 65535), default=8080, show_default=True)
@click.option("--backend", type=BACKEND, default="auto", show_default=True,
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
@click.option("--batching", type=click.Choice(BATCHING), default=DEFAULTS.batching,
              show_default=True, help="Run requests sharing a prompt prefix as one batch: auto = only where it is "
                                      "faster than one after the other on this backend (priced by the device model "
                                      "on Core ML and Core AI, by measured step times elsewhere).")
@click.option("--shutdown-timeout", type=FiniteFloat(minimum=0), default=DEFAULTS.shutdown_seconds, show_default=True,
              metavar="SECONDS", help="On Ctrl-C or SIGTERM, how long open answers get to finish before they "
                                      "end with an error.")
def command(out, revision, host, port, backend, precision, api_key, max_queue, max_tokens_limit, prompt_cache_bytes,
            prompt_cache_dir, chat_template, batching, shutdown_timeout):
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
        try:
            out = locate(out, revision)  # what llama_ane.load reads: an export (or, with torch, a checkpoint)
            _say(f"loading {out} (backend {backend})")
            model = llama_ane.load(out, backend=backend, **({} if precision is None else {"precision": precision}))
            _say(f"warming up {model.manifest['name']} on {model.backend.name}: loading its models")
            model.prepare()
        except KeyboardInterrupt:
            sys.exit(130)
        options = DEFAULTS(api_key=api_key, max_queue=max_queue, max_tokens_limit=max_tokens_limit,
                           prompt_cache_bytes=prompt_cache_bytes, prompt_cache_dir=prompt_cache_dir,
                           chat_template=None if chat_template is None else chat_template.read_text("utf-8"),
                           batching=batching, shutdown_seconds=shutdown_timeout)
        app = create_app(model, options)
    _log_requests()
    url = f"http://{f'[{host}]' if ':' in host else host}:{sock.getsockname()[1]}"
    # The first SIGINT/SIGTERM stops the server (see _server_class): no new connections, open answers
    # get shutdown_seconds (uvicorn's own graceful timeout, a little longer, backs that up), then the
    # app's lifespan closes the scheduler. uvicorn then re-raises the signal to the handler it found:
    # a no-op one here, so a requested stop exits 0, not by the signal.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=shutdown_timeout + 5)
    _server_class(uvicorn)(config, app.state.server, url).run(sockets=[sock])
    sock.close()
    model.close()


def _log_requests() -> None:
    """The app's one line per request, to stderr."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    access = logging.getLogger("llama_ane.serve.access")
    access.addHandler(handler)
    access.setLevel(logging.INFO)
    access.propagate = False


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
