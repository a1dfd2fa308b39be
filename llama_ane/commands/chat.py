"""`llama-ane chat OUT`: an interactive conversation on one cache.

Each turn prefills only its new tokens; a conversation longer than the context shifts (the system
prompt and the most recent tokens are kept). At a terminal, lines are edited and recalled with the
arrow keys (prompt_toolkit), with a history kept across sessions in the user's cache folder;
otherwise turns are read line by line from standard input. Ctrl-C stops a reply and keeps the
conversation; Ctrl-C again at the prompt, or Ctrl-D, quits. A turn or command that fails is
reported on one `Error:` line and the conversation goes on as it was.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import click

from .errors import user_errors
from .options import BACKEND, TEXT, PathOrRepo, not_utf8, revision_option, sampling_options

COMMANDS_HELP = {
    "/help": "this list",
    "/reset": "a new conversation (the system prompt stays)",
    "/save FILE": "save the conversation (its messages and cache) to FILE",
    "/load FILE": "resume a conversation saved with /save (or a prompt cache made with generate)",
    "/set [NAME VALUE]": "show the sampling settings, or change one (e.g. /set temperature 0.7)",
    "/quit": "leave (also Ctrl-D, or Ctrl-C twice at the prompt)",
}
SETTABLE = ("max-new-tokens", "temperature", "top-k", "top-p", "min-p", "repetition-penalty", "seed")
HINT = "/help for commands"


@click.command("chat")
@click.argument("out", type=PathOrRepo())  # as typed: "./x" stays a path
@click.option("--system", type=TEXT, default=None, help="A system prompt, kept through context shifts.")
@revision_option("OUT")
@click.option("--backend", type=BACKEND, default="auto", show_default=True,
              help="auto = coreml on macOS, torch elsewhere.")
@click.option("--precision", type=click.Choice(["fp16", "fp32"]), default=None,
              help="torch/mil compute precision [default: fp32 for torch on CPU, else the export's].")
@sampling_options(max_new_tokens=256)
@click.option("--prompt-cache", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Resume the conversation saved in this file if it exists, and save it there on leaving.")
@click.option("--speculative", default=None, metavar="lookup|draft:OUT",
              help="Speculative decoding ('lookup' or 'draft:OUT', see generate); the replies are the same.")
@click.option("--draft-tokens", type=int, default=None,
              help="Most drafted tokens per verify step [default: the export's verify window - 1].")
def command(out, system, max_new_tokens, revision, backend, precision, temperature, top_k, top_p, min_p,
            repetition_penalty, seed, stop, prompt_cache, speculative, draft_tokens):
    """Chat with the export in OUT, a folder or a Hugging Face repo id (reads turns from standard input).

    OUT `default` is the embedded SmolLM2-135M-Instruct, run unexported by the torch backend (as a
    checkpoint folder is): a check of the model before an export, not a fast runtime."""
    from ..errors import InvalidArgumentError

    if draft_tokens is not None and speculative is None:
        raise click.UsageError("--draft-tokens needs --speculative")
    if speculative is not None and repetition_penalty != 1.0:
        raise click.UsageError("--repetition-penalty cannot be combined with --speculative: drop one")
    sampling = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                    min_p=min_p, repetition_penalty=repetition_penalty, stop=list(stop))
    if speculative is not None:
        sampling.update(speculative=speculative, draft_tokens=draft_tokens)
    with user_errors():
        if prompt_cache is not None and not prompt_cache.parent.is_dir():
            raise InvalidArgumentError(f"--prompt-cache {prompt_cache}: the folder {prompt_cache.parent} does not exist")
        from ..runtime.chat import Chat
        from .session import load_model

        loaded = load_model(out, backend, revision=revision, **({} if precision is None else {"precision": precision}))
        model = loaded.model
        try:
            chat = Chat(model, system=system, **sampling)
            if prompt_cache is not None and prompt_cache.exists():
                _load(chat, str(prompt_cache))
        except BaseException:
            model.close()
            raise
    click.echo(f"{model.manifest['name']} on {model.backend.name}, context {model.manifest['context_length']} "
               f"tokens (loaded in {loaded.load_seconds + loaded.warmup_seconds:.1f} s). {HINT}", err=True)
    lines = _reader()
    try:
        _loop(chat, lines)
        if prompt_cache is not None:
            with user_errors(exit_on_error=False):
                chat.save(prompt_cache)
                click.echo(f"[saved the conversation to {prompt_cache}]", err=True)
    finally:
        model.close()


def _loop(chat, lines) -> None:
    interrupted = False  # the last thing was a Ctrl-C at the prompt
    while True:
        try:
            line = lines()
        except EOFError:
            return
        except KeyboardInterrupt:
            if interrupted:
                return
            interrupted = True
            click.echo("[Ctrl-C again or Ctrl-D to quit]", err=True)
            continue
        interrupted = False
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
                    return
                continue
            _turn(chat, line)


def _turn(chat, line: str) -> None:
    t0 = time.perf_counter()
    try:
        r = chat.send(line, on_token=lambda e: click.echo(e.text, nl=False))
    except KeyboardInterrupt:
        chat.model.pipeline.wait()  # the cache's pending writes land before the next turn reads it
        click.echo("\n[reply stopped; the turn was dropped and the conversation goes on]", err=True)
        return
    click.echo()
    if r.finish_reason in ("length", "context"):
        why = (f"--max-new-tokens {chat.sampling['max_new_tokens']} reached" if r.finish_reason == "length"
               else "the context is full")
        click.echo(f"[cut off: {why} (finish: {r.finish_reason})]", err=True)
    shift = f", context shifted {r.shifts}x" if r.shifts else ""
    decode = f"{r.decoded_tokens / r.decode_seconds:.1f} tok/s" if r.decoded_tokens and r.decode_seconds > 0 else "-"
    click.echo(f"[prefill {r.prefilled_tokens} new tokens ({r.reused_tokens} reused) | {len(r.token_ids)} tokens, "
               f"the first after {r.first_token_seconds:.2f} s | decode {decode} | "
               f"{time.perf_counter() - t0:.1f} s{shift}]", err=True)


def _reader():
    """A function returning the next line typed: prompt_toolkit at a terminal (line editing, and a
    history across sessions), else standard input line by line. Raises EOFError at the end and
    KeyboardInterrupt on Ctrl-C."""
    if sys.stdin.isatty() and sys.stdout.isatty():
        from prompt_toolkit import PromptSession
        from prompt_toolkit.history import FileHistory

        session = PromptSession(history=FileHistory(str(history_file())))
        return lambda: session.prompt("> ")
    _keep_undecodable_bytes(sys.stdin)
    prompt = sys.stdin.isatty()  # piped input gets no prompt: each message stays a line of its own

    def plain() -> str:
        if prompt:
            click.echo("> ", nl=False, err=True)
        line = sys.stdin.readline()
        if not line:
            raise EOFError
        return line
    return plain


def history_file() -> Path:
    """Where the chat's line history lives: the user's cache folder (created if missing)."""
    from platformdirs import user_cache_dir

    folder = Path(user_cache_dir("llama-ane"))
    folder.mkdir(parents=True, exist_ok=True)
    return folder / "chat_history"


def _keep_undecodable_bytes(stream) -> None:
    """Read bytes that are not UTF-8 as surrogates (refused line by line, with their offset) rather
    than let the decoder raise and end the conversation."""
    try:
        stream.reconfigure(errors="surrogateescape")
    except (AttributeError, ValueError, OSError):  # not a text stream that can change its error handler
        pass


def _load(chat, path: str) -> None:
    with_messages = chat.load(path)
    what = f"{len(chat.messages)} messages, " if with_messages else ""
    click.echo(f"[loaded {what}{chat.cache.position} tokens from {path}]", err=True)


def _command(chat, line: str) -> bool:
    """Run a /command; False to quit."""
    name, _, arg = line.partition(" ")
    arg = arg.strip()
    if name in ("/quit", "/exit"):
        return False
    if name == "/help":
        width = max(len(c) for c in COMMANDS_HELP)
        for c, what in COMMANDS_HELP.items():
            click.echo(f"  {c:<{width}}  {what}", err=True)
    elif name == "/reset":
        chat.reset()
        click.echo("[new conversation]", err=True)
    elif name in ("/save", "/load") and not arg:
        click.echo(f"[{name} needs a file name: {name} FILE]", err=True)
    elif name == "/save":
        chat.save(arg)
        click.echo(f"[saved {len(chat.messages)} messages, {chat.cache.position} tokens to {arg}]", err=True)
    elif name == "/load":
        _load(chat, arg)
    elif name == "/set":
        _set(chat, arg)
    else:
        click.echo(f"[unknown command {name}; {HINT}]", err=True)
    return True


def _set(chat, arg: str) -> None:
    """`/set`: the sampling settings; `/set NAME VALUE`: one changed, checked as its command-line
    option --NAME is."""
    if not arg:
        click.echo("  " + "  ".join(f"{n}={chat.sampling.get(n.replace('-', '_'))}" for n in SETTABLE), err=True)
        return
    name, _, value = arg.partition(" ")
    name = name.lstrip("-")
    if name not in SETTABLE or not value.strip():
        click.echo(f"[/set takes one of {', '.join(SETTABLE)} and a value, e.g. /set temperature 0.7]", err=True)
        return
    key = name.replace("-", "_")
    param = next(p for p in command.params if p.name == key)
    try:
        converted = param.type_cast_value(click.Context(command), value.strip())
    except click.ClickException as e:  # the option's own message, naming --NAME
        click.echo(f"[/set {name}: {e.format_message()}]", err=True)
        return
    if key == "repetition_penalty" and converted != 1.0 and chat.sampling.get("speculative") is not None:
        click.echo("[/set repetition-penalty: not with --speculative (the replies would differ)]", err=True)
        return
    chat.sampling[key] = converted
    click.echo(f"[{name} = {converted}]", err=True)
