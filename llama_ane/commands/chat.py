"""`llama-ane chat OUT`: an interactive conversation on one cache.

Each turn prefills only its new tokens; a conversation longer than the context shifts (the system
prompt and the most recent tokens are kept). Commands: /reset, /save FILE, /load FILE, /quit.
A turn or command that fails is reported on one `Error:` line and the conversation goes on as it was.
"""

from __future__ import annotations

import sys

import click

from ..runtime.model import BACKENDS
from .errors import user_errors
from .options import TEMPERATURE, TEXT, TOP_P, not_utf8

HELP = "commands: /reset (new conversation), /save FILE, /load FILE, /quit"


@click.command("chat")
@click.argument("out", type=click.Path(path_type=str))  # as typed: "./x" stays a path
@click.option("--system", type=TEXT, default=None, help="A system prompt, kept through context shifts.")
@click.option("--max-new-tokens", default=256, show_default=True, help="Longest reply.")
@click.option("--revision", default=None, help="Branch, tag or commit of OUT when it is a Hugging Face repo id.")
@click.option("--backend", type=click.Choice(BACKENDS), default="auto", show_default=True,
              help="auto = coreml on macOS, torch elsewhere.")
@click.option("--temperature", type=TEMPERATURE, default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-k", default=0, show_default=True, help="0 = off.")
@click.option("--top-p", type=TOP_P, default=1.0, show_default=True)
@click.option("--seed", type=int, default=None)
def command(out, system, max_new_tokens, revision, backend, temperature, top_k, top_p, seed):
    """Chat with the export in OUT, a folder or a Hugging Face repo id (reads turns from standard input)."""
    import llama_ane
    from ..runtime.chat import Chat

    with user_errors():
        model = llama_ane.load(out, backend=backend, revision=revision)
        chat = Chat(model, system=system, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                    top_p=top_p, seed=seed)
        model.prepare()
    click.echo(f"{model.manifest['name']} on {model.backend.name}, context {model.manifest['context_length']} "
               f"tokens. {HELP}", err=True)
    _keep_undecodable_bytes(sys.stdin)
    try:
        while True:
            try:
                line = click.prompt(">", prompt_suffix=" ", default="", show_default=False, err=True)
            except (EOFError, click.Abort):
                break
            line = line.strip()
            if not line:
                continue
            problem = not_utf8("that line", line)
            if problem is not None:
                click.echo(f"Error: {problem}; type it again in UTF-8", err=True)
                continue
            with user_errors(exit_on_error=False):  # a failed turn or command leaves the conversation as it was
                if line.startswith("/"):
                    if not _command(chat, line):
                        break
                    continue
                r = chat.send(line, on_token=lambda e: click.echo(e.text, nl=False))
                click.echo()
                shift = f", context shifted {r.shifts}x" if r.shifts else ""
                click.echo(f"[prefill {r.prefilled_tokens} new tokens ({r.reused_tokens} reused) "
                           f"{r.prefill_tokens_per_s:.1f} tok/s | decode {r.decode_tokens_per_s:.1f} tok/s{shift}]",
                           err=True)
    finally:
        model.close()


def _keep_undecodable_bytes(stream) -> None:
    """Read bytes that are not UTF-8 as surrogates (refused line by line, with their offset) rather
    than let the decoder raise and end the conversation."""
    try:
        stream.reconfigure(errors="surrogateescape")
    except (AttributeError, ValueError, OSError):  # not a text stream that can change its error handler
        pass


def _command(chat, line: str) -> bool:
    """Run a /command; False to quit."""
    name, _, arg = line.partition(" ")
    arg = arg.strip()
    if name in ("/quit", "/exit"):
        return False
    if name == "/reset":
        chat.reset()
        click.echo("[new conversation]", err=True)
    elif name in ("/save", "/load") and not arg:
        click.echo(f"[{name} needs a file name: {name} FILE]", err=True)
    elif name == "/save":
        chat.save(arg)
        click.echo(f"[saved {chat.cache.position} tokens to {arg}]", err=True)
    elif name == "/load":
        chat.load(arg)
        click.echo(f"[loaded {chat.cache.position} tokens from {arg}]", err=True)
    else:
        click.echo(f"[unknown command {name}; {HELP}]", err=True)
    return True
